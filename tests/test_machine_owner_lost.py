"""``machine.owner_lost`` (issue 14, the recovery sweep's step) and the interruption
policy ``on_interruption`` (``"replace"``, the default, or ``"fail"``), fed directly to
the pure machine.

owner_lost: an attempt in flight is closed as an interruption (``owner_lost``) and
nothing is invented (no completion, usage or response id); then the operation waits for
adoption, or is failed (``owner_lost`` / ``expired``). Applying it to its own result
changes nothing.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from recoverable import errors
from recoverable import machine as m
from recoverable.outcome import Interruption, Usage
from recoverable.records import OperationRecord, PendingAttempt, Phase
from recoverable.types import RetryPolicy

from .test_machine import (
    DISCONNECT,
    OP,
    T0,
    attempt,
    ctx,
    open_,
    record,
    run_to_transmit,
    spent,
    stopped,
    transmitting,
)

POLICY = RetryPolicy(initial_backoff=5.0, maximum_backoff=60.0, multiplier=2.0)


def _no_invention(before: OperationRecord, after: OperationRecord) -> None:
    """Nothing the provider did not report appears: no completion, usage or response id."""
    assert not after.has_completion and after.completed_at is None
    assert after.usage == before.usage
    assert [a.response_id for a in after.attempts] == [a.response_id for a in before.attempts]
    assert [a.usage for a in after.attempts] == [a.usage for a in before.attempts]
    assert after.attempts_used == before.attempts_used  # spent stays spent, never refunded


def _idempotent(t: m.Transition, now: float) -> None:
    again = m.owner_lost(t.record, now=now)
    assert again.record == t.record and not again.changed and again.action is None


# --- owner_lost ---------------------------------------------------------------------------


def test_in_flight_attempt_is_closed_and_the_operation_waits_for_adoption() -> None:
    rec = transmitting(1, retry_policy=POLICY)
    t = m.owner_lost(rec, now=T0 + 100)
    assert t.changed and t.action is None
    new = t.record
    assert new.phase == "waiting"
    last = new.attempts[-1]
    assert last.outcome == "interrupted" and last.usage is None
    assert last.failure == Interruption(kind="interrupted", transport_code="owner_lost")
    assert new.last_failure == last.failure
    # The cooldown of the retry policy after attempt 1 (initial_backoff), from now.
    assert new.next_attempt_at == T0 + 100 + 5.0
    _no_invention(rec, new)
    _idempotent(t, T0 + 100)


def test_the_response_id_and_cursor_already_saved_are_kept_never_invented() -> None:
    rec = transmitting(2, retry_policy=POLICY)
    saved = msgspec.structs.replace(rec.attempts[-1], response_id="resp_9", sequence_number=4)
    rec = msgspec.structs.replace(rec, attempts=(*rec.attempts[:-1], saved))
    new = m.owner_lost(rec, now=T0).record
    failure = new.attempts[-1].failure
    assert failure is not None and failure.response_id == "resp_9"
    assert failure.sequence_number == 4 and new.attempts[-1].response_id == "resp_9"
    assert new.next_attempt_at == T0 + 10.0  # 5 * 2**(2-1)
    _no_invention(rec, new)


def test_reported_usage_of_earlier_attempts_stays_as_it_was() -> None:
    first = attempt(1, failure=DISCONNECT, usage=Usage(input_tokens=3, output_tokens=2))
    rec = record(phase="transmitting", attempts=(first, attempt(2, "in_flight")),
                 attempts_used=2)
    new = m.owner_lost(rec, now=T0).record
    assert new.usage == Usage(input_tokens=3, output_tokens=2)
    _no_invention(rec, new)


def test_a_later_saved_cooldown_is_kept() -> None:
    rec = transmitting(1, retry_policy=POLICY, next_attempt_at=T0 + 1000)
    assert m.owner_lost(rec, now=T0).record.next_attempt_at == T0 + 1000


def test_no_budget_left_fails_owner_lost() -> None:
    rec = transmitting(3)  # maximum_attempts 3, all spent
    t = m.owner_lost(rec, now=T0)
    new = t.record
    assert new.phase == "failed" and new.failure_reason == "owner_lost"
    assert new.attempts[-1].outcome == "interrupted" and new.next_attempt_at is None
    _no_invention(rec, new)
    _idempotent(t, T0)
    # Reopened later, it stays failed with the typed terminal error; nothing is asked.
    stopped(open_(new), errors.PermanentlyFailed)


def test_token_budget_spent_fails_owner_lost() -> None:
    first = attempt(1, failure=DISCONNECT, usage=Usage(output_tokens=50))
    rec = record(phase="transmitting", attempts=(first, attempt(2, "in_flight")),
                 attempts_used=2, maximum_output_tokens_total=50)
    new = m.owner_lost(rec, now=T0).record
    assert new.phase == "failed" and new.failure_reason == "owner_lost"


def test_policy_fail_fails_owner_lost_even_with_budget_left() -> None:
    rec = transmitting(1, on_interruption="fail")
    t = m.owner_lost(rec, now=T0)
    assert t.record.phase == "failed" and t.record.failure_reason == "owner_lost"
    assert t.record.attempts[-1].failure == Interruption(
        kind="interrupted", transport_code="owner_lost"
    )
    _no_invention(rec, t.record)
    _idempotent(t, T0)


def test_expired_fails_expired_and_reopening_raises_state_expired() -> None:
    rec = transmitting(1, expires_at=T0 + 10)
    t = m.owner_lost(rec, now=T0 + 10)
    assert t.record.phase == "failed" and t.record.failure_reason == "expired"
    _idempotent(t, T0 + 10)
    stopped(open_(t.record, ctx(T0 + 20)), errors.StateExpired)
    status = m.derive_status(t.record, now=T0 + 20, lease_live=False, viewer=rec.account)
    assert status.state == "failed" and status.availability == "expired"


def test_authorizing_with_nothing_spent_goes_back_to_prepared_keeping_the_pending_id() -> None:
    rec = open_(record()).record
    assert rec.phase == "authorizing" and rec.pending is not None
    t = m.owner_lost(rec, now=T0)
    assert t.record.phase == "prepared" and t.record.pending == rec.pending
    assert t.record.attempts_used == 0 and t.record.next_attempt_at is None
    _idempotent(t, T0)


def test_authorizing_a_replacement_goes_back_to_waiting_with_the_same_pending_id() -> None:
    pending = PendingAttempt(m.attempt_id_for(OP, 2), 2, "replacement")
    rec = record(phase="authorizing", pending=pending, **spent(1))
    t = m.owner_lost(rec, now=T0)
    assert t.record.phase == "waiting" and t.record.pending == pending
    assert t.record.attempts == rec.attempts  # nothing was in flight: nothing closed


def test_policy_fail_with_nothing_in_flight_still_waits() -> None:
    """Only an interrupted attempt is covered by the policy; an owner lost while asking
    the host interrupted nothing."""
    pending = PendingAttempt(m.attempt_id_for(OP, 2), 2, "replacement")
    rec = record(phase="authorizing", pending=pending, on_interruption="fail", **spent(1))
    assert m.owner_lost(rec, now=T0).record.phase == "waiting"


def test_waiting_with_a_saved_cooldown_is_unchanged() -> None:
    rec = record(phase="waiting", next_attempt_at=T0 + 30, **spent(1))
    t = m.owner_lost(rec, now=T0)
    assert t.record == rec and not t.changed


@pytest.mark.parametrize("phase", ["prepared", "completed", "failed", "suspended", "cancelled"])
def test_phases_no_owner_drives_are_untouched(phase: Phase) -> None:
    rec = record(phase=phase, **spent(1))
    t = m.owner_lost(rec, now=T0 + 10**6)
    assert t.record == rec and not t.changed and t.action is None


def test_a_saved_completion_is_never_touched() -> None:
    rec = record(phase="completed", completed_at=T0, **spent(1))
    assert m.owner_lost(rec, now=T0).record == rec


def test_after_owner_lost_the_replacement_is_a_new_attempt_of_the_same_budget() -> None:
    rec = transmitting(1, retry_policy=RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0))
    waiting = m.owner_lost(rec, now=T0).record
    t = open_(waiting, ctx(T0 + 1))
    assert isinstance(t.action, m.AskHost)
    assert t.action.attempt.number == 2 and t.action.attempt.reason == "replacement"
    assert t.action.attempt.previous_failure == Interruption(
        kind="interrupted", transport_code="owner_lost"
    )


# --- on_interruption="fail" in the other events -----------------------------------------


def _fail(**changes: Any) -> OperationRecord:
    return transmitting(1, on_interruption="fail", **changes)


def test_the_default_policy_is_replace() -> None:
    assert record().on_interruption == "replace"


@pytest.mark.parametrize(
    "failure",
    [
        DISCONNECT,
        Interruption(kind="timeout", transport_code="idle_timeout"),
        Interruption(kind="premature_eof"),
        Interruption(kind="malformed", transport_code="invalid_json"),
        Interruption(kind="interrupted", transport_code="lease_lost"),
    ],
)
def test_policy_fail_an_interrupted_attempt_fails_interrupted(failure: Interruption) -> None:
    rec = _fail()
    t = m.attempt_failed(rec, rec.attempts[-1].attempt_id, failure, ctx())
    assert t.record.phase == "failed" and t.record.failure_reason == "interrupted"
    assert t.record.next_attempt_at is None and t.record.attempts_used == 1
    error = stopped(t, errors.PermanentlyFailed)
    assert "on_interruption" in str(error) and error.last_failure == failure
    # The same failure under the default policy is replaced.
    replace = transmitting(1)
    t2 = m.attempt_failed(replace, replace.attempts[-1].attempt_id, failure, ctx())
    assert t2.record.phase in ("waiting", "authorizing")


@pytest.mark.parametrize(
    "failure,reason",
    [
        (Interruption(kind="http_rejected", http_status=503), None),
        (Interruption(kind="http_rejected", http_status=429), None),
        (Interruption(kind="http_rejected", http_status=403), "rejected"),
        (Interruption(kind="incomplete", provider_code="max_output_tokens"), "incomplete"),
    ],
)
def test_policy_fail_does_not_change_rejections(
    failure: Interruption, reason: str | None
) -> None:
    """A rejected request generated nothing: it is not an interruption."""
    rec = _fail()
    t = m.attempt_failed(rec, rec.attempts[-1].attempt_id, failure, ctx())
    if reason is None:
        assert t.record.phase in ("waiting", "authorizing")
    else:
        assert t.record.failure_reason == reason


def test_policy_fail_a_crash_seen_at_reopen_fails_interrupted() -> None:
    rec = _fail()
    t = open_(rec)
    assert t.record.phase == "failed" and t.record.failure_reason == "interrupted"
    assert t.record.attempts[-1].failure == Interruption(
        kind="interrupted", transport_code="owner_lost"
    )
    stopped(t, errors.PermanentlyFailed)
    # Reopening again: the same terminal answer, nothing asked, nothing changed.
    again = open_(t.record)
    assert again.record == t.record
    stopped(again, errors.PermanentlyFailed)


def test_policy_fail_the_caller_cancelled_mid_stream_fails_interrupted() -> None:
    rec, _ = run_to_transmit(record(on_interruption="fail"))
    t = m.interrupted_locally(rec)
    assert t.record.phase == "failed" and t.record.failure_reason == "interrupted"
    assert t.record.attempts[-1].outcome == "interrupted"
    stopped(t, errors.PermanentlyFailed)


def test_policy_fail_a_suspend_with_nothing_in_flight_still_suspends() -> None:
    rec = record(phase="waiting", on_interruption="fail", next_attempt_at=T0 + 5, **spent(1))
    t = m.interrupted_locally(rec)
    assert t.record.phase == "suspended"
    stopped(t, errors.OperationSuspended)
    t2 = m.command_observed(rec, "suspend")
    assert t2.record.phase == "suspended"


def test_policy_fail_a_suspend_command_on_an_orphaned_attempt_fails_interrupted() -> None:
    t = m.command_on_idle(_fail(), "suspend")
    assert t.record.phase == "failed" and t.record.failure_reason == "interrupted"


def test_policy_fail_a_cancel_still_cancels() -> None:
    t = m.command_observed(_fail(), "cancel")
    assert t.record.phase == "cancelled"
    stopped(t, errors.OperationCancelled)


def test_policy_fail_signed_out_mid_stream_fails_interrupted() -> None:
    t = m.account_stopped(_fail(), "signed_out", ctx())
    assert t.record.phase == "failed" and t.record.failure_reason == "interrupted"
    stopped(t, errors.AccountChanged)


def test_policy_fail_status_of_an_orphaned_attempt_is_not_replacement_eligible() -> None:
    rec = _fail()
    status = m.derive_status(rec, now=T0, lease_live=False, viewer=rec.account)
    assert status.state == "interrupted" and status.availability == "failed"
    assert "execute" not in status.suggested_actions
    replace = transmitting(1)
    status2 = m.derive_status(replace, now=T0, lease_live=False, viewer=replace.account)
    assert status2.availability == "replacement_eligible"


@pytest.mark.parametrize("reason", ["interrupted", "owner_lost", "no_worker"])
def test_new_reasons_read_as_failed_with_a_manual_retry(reason: str) -> None:
    rec = record(phase="failed", failure_reason=reason, **spent(1))
    status = m.derive_status(rec, now=T0, lease_live=False, viewer=rec.account)
    assert status.state == "failed" and status.availability == "failed"
    assert status.suggested_actions == ("manual_retry", "abandon")
    m.check_retry_source(rec, now=T0, endpoint_id=None)  # a manual retry is allowed
    error = stopped(open_(rec), errors.PermanentlyFailed)
    text = str(error)
    assert reason.replace("_", " ") in text or "on_interruption" in text or "worker" in text
    assert "runtime.retry" in text


# --- unclaimed (the sweep's --unclaimed-after bound) --------------------------------------


def test_a_prepared_operation_nobody_claimed_fails_no_worker_after_the_bound() -> None:
    rec = record()  # created at T0
    assert not m.unclaimed(rec, now=T0 + 59, unclaimed_after=60).changed
    t = m.unclaimed(rec, now=T0 + 60, unclaimed_after=60)
    assert t.record.phase == "failed" and t.record.failure_reason == "no_worker"
    assert t.record.attempts == rec.attempts and t.action is None
    again = m.unclaimed(t.record, now=T0 + 60, unclaimed_after=60)
    assert again.record == t.record and not again.changed
    stopped(open_(t.record), errors.PermanentlyFailed)


def test_a_waiting_operation_counts_from_its_saved_cooldown() -> None:
    rec = record(phase="waiting", next_attempt_at=T0 + 100, **spent(1))
    assert not m.unclaimed(rec, now=T0 + 150, unclaimed_after=60).changed
    assert m.unclaimed(rec, now=T0 + 160, unclaimed_after=60).record.failure_reason == (
        "no_worker"
    )


def test_the_wait_for_a_worker_counts_from_the_last_moment_a_worker_served() -> None:
    """Issue 29.4/29.11: a worker of its account and endpoint served the queue until
    T0 + 500 (its served mark): the bound counts from then, not from creation."""
    rec = record()  # created at T0
    assert m.unclaimed_since(rec, served_until=T0 + 500) == T0 + 500
    assert m.unclaimed_since(rec, served_until=T0 - 500) == T0  # never before it was made
    assert not m.unclaimed(rec, now=T0 + 559, unclaimed_after=60,
                           served_until=T0 + 500).changed
    ended = m.unclaimed(rec, now=T0 + 560, unclaimed_after=60, served_until=T0 + 500)
    assert ended.record.failure_reason == "no_worker"


@pytest.mark.parametrize("phase", ["authorizing", "transmitting", "suspended", "completed",
                                   "failed", "cancelled"])
def test_unclaimed_leaves_other_phases_alone(phase: Phase) -> None:
    rec = record(phase=phase, **spent(1))
    assert not m.unclaimed(rec, now=T0 + 10**6, unclaimed_after=0).changed


@pytest.mark.parametrize("value", ["replace", "fail"])
def test_preparation_accepts_the_two_policies(value: str) -> None:
    m.validate_preparation(
        maximum_attempts=3, retry_policy=RetryPolicy(), scope=None, job_id=None,
        input_revision=None, contract_version=None, on_interruption=value,
    )


@pytest.mark.parametrize("value", ["Fail", "retry", "", None, 1, ["fail"], b"fail"])
def test_preparation_refuses_any_other_policy(value: object) -> None:
    with pytest.raises(errors.InvalidRequest, match="on_interruption"):
        m.validate_preparation(
            maximum_attempts=3, retry_policy=RetryPolicy(), scope=None, job_id=None,
            input_revision=None, contract_version=None, on_interruption=value,
        )
