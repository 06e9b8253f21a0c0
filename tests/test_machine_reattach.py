"""Issue 15: reattach instead of regenerate — the pure rules (``recoverable.reattachment``
and its hooks in ``machine.open_operation``, ``attempt_failed``, ``owner_lost`` and the
suspension), fed directly to the machine.

Resuming a saved background response is not a new attempt: no ``AskHost``, no budget;
the attempt stays the same attempt, its reattachments are counted (and bounded) before
the GET, and the checkpoint's cursor never goes backwards. When it cannot be resumed,
seed 000 decides exactly as before.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recoverable import errors, reattachment
from recoverable import machine as m
from recoverable.body import freeze_body
from recoverable.contract import contract_for
from recoverable.outcome import Interruption
from recoverable.records import AttemptRecord, OperationRecord
from recoverable.transitions import AskHost, Reattach
from recoverable.types import RetryPolicy, StructuredRequest

from .test_machine import (
    BOB,
    DISCONNECT,
    T0,
    ctx,
    open_,
    record,
    run_to_transmit,
    stopped,
    transmitting,
)

POLICY = RetryPolicy(initial_backoff=5.0, maximum_backoff=60.0, multiplier=2.0)


def _with_checkpoint(rec: OperationRecord, rid: str | None = "resp_1",
                     seq: int | None = 7, **kw: object) -> OperationRecord:
    last = msgspec.structs.replace(rec.attempts[-1], response_id=rid, sequence_number=seq, **kw)
    return msgspec.structs.replace(rec, attempts=(*rec.attempts[:-1], last))


def _streaming(n: int = 1, **changes: object) -> OperationRecord:
    """A reattach operation whose attempt ``n`` is in flight with a saved checkpoint."""
    return _with_checkpoint(transmitting(n, reattach=True, retry_policy=POLICY, **changes))


def _reattach(t: m.Transition) -> Reattach:
    assert isinstance(t.action, Reattach), t.action
    return t.action


# --- the frozen body -------------------------------------------------------------------


class _Out(msgspec.Struct):
    answer: int


def test_reattach_freezes_a_background_stored_body_and_the_default_stays_unstored() -> None:
    request = StructuredRequest(model="gpt-test", input="hi")
    contract = contract_for(_Out)
    plain = msgspec.json.decode(freeze_body(request, contract))
    background = msgspec.json.decode(freeze_body(request, contract, reattach=True))
    assert plain["store"] is False and "background" not in plain
    assert background["store"] is True and background["background"] is True
    # Still tool-free and strict: only these two members differ.
    del background["background"]
    background["store"] = False
    assert background == plain


def test_the_request_itself_still_may_not_ask_for_store_or_background() -> None:
    contract = contract_for(_Out)
    for name in ("store", "background"):
        request = StructuredRequest(model="gpt-test", input="hi", **{name: True})
        with pytest.raises(errors.InvalidParameter) as caught:
            freeze_body(request, contract, reattach=True)
        assert caught.value.parameter == name


# --- reattach before replacing: at open -------------------------------------------------


def test_a_crashed_attempt_with_a_saved_response_is_resumed_not_asked_for_again() -> None:
    rec = _streaming(1)
    t = open_(rec)
    action = _reattach(t)
    assert action == Reattach(rec.attempts[-1].attempt_id, "resp_1", 7)
    new = t.record
    assert new.phase == "transmitting"
    assert new.attempts_used == 1 and len(new.attempts) == 1  # no budget, no new attempt
    assert new.attempts[-1].outcome == "in_flight"
    assert new.attempts[-1].reattachments == 1  # counted (saved) before the GET
    assert new.reattachments == 1


def test_without_reattach_the_same_record_is_closed_and_asked_for_a_replacement() -> None:
    rec = _with_checkpoint(transmitting(1, retry_policy=POLICY))
    t = open_(rec)
    assert not isinstance(t.action, Reattach)
    assert t.record.attempts[-1].outcome == "interrupted"


def test_no_saved_response_id_means_no_reattachment() -> None:
    rec = _with_checkpoint(transmitting(1, reattach=True), rid=None, seq=None)
    assert reattachment.reattach_target(rec) is None
    assert not isinstance(open_(rec).action, Reattach)


def test_reattaching_spends_no_budget_even_when_none_is_left() -> None:
    rec = _streaming(3)  # 3 of 3 spent
    assert rec.attempts_remaining == 0
    t = open_(rec)
    assert _reattach(t).response_id == "resp_1"
    assert t.record.attempts_used == 3 and t.record.phase == "transmitting"


def test_the_sweep_keeps_a_resumable_attempt_for_the_next_owner_even_without_budget() -> None:
    rec = _streaming(3)  # budget spent: seed 000 alone would end it owner_lost
    swept = m.owner_lost(rec, now=T0 + 10).record
    assert swept.phase == "waiting" and swept.failure_reason is None
    last = swept.attempts[-1]
    assert last.outcome == "interrupted" and last.response_id == "resp_1"
    assert last.sequence_number == 7  # the cursor is kept
    t = open_(swept, ctx(T0 + 11))  # before the cooldown: a reattachment does not wait it
    action = _reattach(t)
    assert action.after == 7
    assert t.record.attempts[-1].outcome == "in_flight" and t.record.attempts[-1].failure is None


def test_the_sweep_ends_an_unresumable_one_as_before() -> None:
    rec = _streaming(3, on_interruption="fail")
    exhausted = _with_checkpoint(rec, reattachments=reattachment.MAX_REATTACHMENTS)
    swept = m.owner_lost(exhausted, now=T0).record
    assert swept.phase == "failed" and swept.failure_reason == "owner_lost"


def test_an_expired_operation_is_not_resumed() -> None:
    rec = _streaming(1, expires_at=T0 + 5)
    t = open_(rec, ctx(T0 + 6))
    assert not isinstance(t.action, Reattach)
    swept = m.owner_lost(rec, now=T0 + 6).record
    assert swept.failure_reason == "expired"


def test_another_account_never_resumes_it() -> None:
    rec = _streaming(1)
    t = open_(rec, ctx(account=BOB))
    stopped(t, errors.AccountChanged)
    assert t.record == rec


def test_a_cancel_pending_at_open_wins_over_reattaching() -> None:
    t = open_(_streaming(1), ctx(command="cancel"))
    stopped(t, errors.OperationCancelled)
    assert t.record.phase == "cancelled"


# --- in the same execution: after a disconnect ------------------------------------------


def test_a_disconnect_mid_stream_resumes_after_the_later_cursor() -> None:
    rec, attempt_id = run_to_transmit(record(reattach=True, retry_policy=POLICY))
    rec = reattachment.checkpoint(rec, attempt_id, "resp_2", 3, T0).record
    lost = Interruption(kind="disconnected", transport_code="read_error",
                        response_id="resp_2", sequence_number=40)
    t = m.attempt_failed(rec, attempt_id, lost, ctx())
    action = _reattach(t)
    assert action == Reattach(attempt_id, "resp_2", 40)
    last = t.record.attempts[-1]
    assert last.outcome == "in_flight" and last.reattachments == 1 and last.failure is None
    assert t.record.attempts_used == 1 and t.record.next_attempt_at is None
    assert t.record.last_failure is not None and t.record.last_failure.kind == "disconnected"


def test_reattachments_are_bounded_then_seed_000_replaces() -> None:
    rec, attempt_id = run_to_transmit(record(reattach=True, retry_policy=POLICY))
    rec = reattachment.checkpoint(rec, attempt_id, "resp_3", 0, T0).record
    for count in range(1, reattachment.MAX_REATTACHMENTS + 1):
        t = m.attempt_failed(rec, attempt_id, DISCONNECT, ctx())
        assert _reattach(t) and t.record.attempts[-1].reattachments == count
        rec = t.record
    t = m.attempt_failed(rec, attempt_id, DISCONNECT, ctx())
    assert isinstance(t.action, m.WaitUntil)  # closed: a replacement after the cooldown
    last = t.record.attempts[-1]
    assert last.outcome == "failed" and last.reattachments == reattachment.MAX_REATTACHMENTS
    assert t.record.phase == "waiting"


@pytest.mark.parametrize(
    "failure",
    [
        Interruption(kind="reattach_unavailable", http_status=404, transport_code="response_gone"),
        Interruption(kind="reattach_unavailable", provider_code="cancelled"),
        Interruption(kind="provider_failed", provider_code="server_error"),
        Interruption(kind="incomplete", provider_code="max_output_tokens"),
        Interruption(kind="malformed", transport_code="resumed_without_output"),
    ],
    ids=["gone", "cancelled_on_server", "failed_on_server", "incomplete", "no_output"],
)
def test_honest_endings_close_the_attempt_and_seed_000_decides(failure: Interruption) -> None:
    rec = _streaming(1)
    resumed = open_(rec)
    attempt_id = _reattach(resumed).attempt_id
    t = m.attempt_failed(resumed.record, attempt_id, failure, ctx())
    last = t.record.attempts[-1]
    assert last.outcome == "failed" and last.failure is not None
    assert last.failure.kind == failure.kind
    assert not t.record.has_completion  # nothing fabricated
    assert reattachment.reattach_target(t.record) is None
    expected = m.classify(failure, POLICY)
    if expected is None:  # replaceable: a new attempt after the cooldown, within budget
        assert isinstance(t.action, m.WaitUntil) and t.record.phase == "waiting"
    else:
        assert t.record.phase == "failed" and t.record.failure_reason == expected


def test_the_gone_response_of_the_last_attempt_ends_exhausted() -> None:
    resumed = open_(_streaming(3))
    gone = Interruption(kind="reattach_unavailable", http_status=404)
    t = m.attempt_failed(resumed.record, _reattach(resumed).attempt_id, gone, ctx())
    err = stopped(t, errors.AttemptsExhausted)
    assert err.operation_id == "op-1" and t.record.failure_reason == "exhausted"


def test_a_command_at_the_disconnect_closes_it_and_resuming_later_reattaches() -> None:
    rec = _streaming(1)
    attempt_id = rec.attempts[-1].attempt_id
    t = m.attempt_failed(rec, attempt_id, DISCONNECT, ctx(command="suspend"))
    stopped(t, errors.OperationSuspended)
    assert t.record.phase == "suspended"
    assert isinstance(open_(t.record).action, Reattach)


def test_suspension_under_fail_policy_keeps_a_resumable_attempt() -> None:
    rec = _streaming(1, on_interruption="fail")
    t = m.command_observed(rec, "suspend")
    assert t.record.phase == "suspended"
    assert isinstance(open_(t.record).action, Reattach)


def test_a_reattached_completion_is_saved_like_a_streamed_one() -> None:
    resumed = open_(_streaming(1))
    attempt_id = _reattach(resumed).attempt_id
    t = m.completion_validated(resumed.record, attempt_id, ctx(), response_id="resp_1",
                               sequence_number=90)
    assert isinstance(t.action, m.Deliver)
    last = t.record.attempts[-1]
    assert last.outcome == "completed" and last.reattached and last.sequence_number == 90
    assert t.record.attempts_used == 1


# --- the checkpoint ---------------------------------------------------------------------


def test_the_checkpoint_never_goes_backwards_and_keeps_the_first_response_id() -> None:
    rec = _streaming(1)
    attempt_id = rec.attempts[-1].attempt_id
    later = reattachment.checkpoint(rec, attempt_id, "resp_1", 300, T0 + 1)
    assert later.changed and later.record.attempts[-1].sequence_number == 300
    assert later.record.attempts[-1].checkpoint_at == T0 + 1
    back = reattachment.checkpoint(later.record, attempt_id, "resp_other", 12, T0 + 2)
    assert not back.changed
    assert back.record.attempts[-1].sequence_number == 300
    assert back.record.attempts[-1].response_id == "resp_1"


def test_checkpoint_is_only_for_the_attempt_in_flight() -> None:
    rec = _streaming(1)
    with pytest.raises(m.InvalidTransition):
        reattachment.checkpoint(rec, "op-1.9", "resp_1", 1, T0)
    with pytest.raises(m.InvalidTransition):
        reattachment.checkpoint(record(phase="waiting"), "op-1.1", "resp_1", 1, T0)


def test_a_response_that_is_not_a_background_one_is_saved_as_not_resumable() -> None:
    rec = _streaming(1)
    attempt_id = rec.attempts[-1].attempt_id
    # The server said background: false (the flag ignored): never resumed, seed 000 decides.
    ignored = reattachment.checkpoint(rec, attempt_id, "resp_1", 1, T0, background=False)
    last = ignored.record.attempts[-1]
    assert last.response_id == "resp_1"
    assert last.not_resumable == reattachment.BACKGROUND_IGNORED
    assert reattachment.reattach_target(ignored.record) is None
    assert reattachment.lease_lost(rec, attempt_id, "resp_1", 3, T0, background=False) is None
    # Later checkpoints keep it; ``True`` or unknown (``None``) never set it.
    later = reattachment.checkpoint(ignored.record, attempt_id, "resp_1", 9, T0, True)
    assert later.record.attempts[-1].not_resumable == reattachment.BACKGROUND_IGNORED
    for background in (True, None):
        kept = reattachment.checkpoint(rec, attempt_id, "resp_1", 1, T0, background)
        assert kept.record.attempts[-1].not_resumable is None
        assert reattachment.reattach_target(kept.record) is not None


def test_checkpoint_due_at_once_for_the_id_then_at_bounded_intervals() -> None:
    blank = AttemptRecord(attempt_id="a", number=1, reason="initial", consumed_at=T0)
    assert reattachment.checkpoint_due(blank, "resp", 0, events_since=0, seconds_since=0)
    saved = msgspec.structs.replace(blank, response_id="resp", sequence_number=0)
    due = reattachment.checkpoint_due
    assert not due(saved, "resp", 5, events_since=5, seconds_since=0.1)
    assert due(saved, "resp", 300, events_since=reattachment.CHECKPOINT_EVERY_EVENTS,
               seconds_since=0.1)
    assert due(saved, "resp", 6, events_since=6,
               seconds_since=reattachment.CHECKPOINT_EVERY_SECONDS)
    assert not due(saved, "resp", 0, events_since=999, seconds_since=99)  # not forward


def test_a_lost_lease_leaves_a_resumable_attempt_in_flight_without_counting() -> None:
    rec = _streaming(1)
    attempt_id = rec.attempts[-1].attempt_id
    t = reattachment.lease_lost(rec, attempt_id, "resp_1", 20, T0)
    assert t is not None and t.action is None
    last = t.record.attempts[-1]
    assert last.outcome == "in_flight" and last.reattachments == 0
    assert last.sequence_number == 20
    plain = _with_checkpoint(transmitting(1))
    assert reattachment.lease_lost(plain, attempt_id, "resp_1", 20, T0) is None


def test_a_default_operation_is_never_asked_to_reattach() -> None:
    rec, attempt_id = run_to_transmit(record(retry_policy=POLICY))
    lost = Interruption(kind="disconnected", response_id="resp_1", sequence_number=4)
    t = m.attempt_failed(rec, attempt_id, lost, ctx())
    assert isinstance(t.action, m.WaitUntil | AskHost)
    assert t.record.attempts[-1].reattachments == 0


# --- status ------------------------------------------------------------------------------


def test_status_of_a_resumable_operation_without_budget_is_not_exhausted() -> None:
    swept = m.owner_lost(_streaming(3), now=T0).record
    status = m.derive_status(swept, now=T0, lease_live=False, viewer=swept.account)
    assert status.availability == "replacement_eligible" and "execute" in status.suggested_actions
    assert status.reattach and status.reattachments == 0 and not status.reattached
    unresumable = _with_checkpoint(swept, reattachments=reattachment.MAX_REATTACHMENTS)
    status = m.derive_status(unresumable, now=T0, lease_live=False, viewer=swept.account)
    assert status.availability == "exhausted"


def test_status_says_the_result_came_by_reattachment() -> None:
    resumed = open_(_streaming(1))
    done = m.completion_validated(resumed.record, _reattach(resumed).attempt_id, ctx(),
                                  response_id="resp_1", sequence_number=9).record
    status = m.derive_status(done, now=T0, lease_live=False, viewer=done.account)
    assert status.reattached and status.reattachments == 1
    assert status.attempts[-1].reattached and status.attempts[-1].reattachments == 1


# --- properties over random histories ------------------------------------------------------

STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("fail"), st.sampled_from(
            ["disconnected", "timeout", "premature_eof", "reattach_unavailable",
             "provider_failed", "incomplete", "malformed"]),
            st.sampled_from([None, "resp_a", "resp_b"]), st.sampled_from([None, 0, 5, 40, 300])),
        st.tuples(st.just("checkpoint"), st.sampled_from([None, "resp_a", "resp_b"]),
                  st.sampled_from([None, 0, 3, 90, 256])),
        st.tuples(st.just("crash")),
        st.tuples(st.just("suspend")),
        st.tuples(st.just("complete")),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(steps=STEPS, budget=st.integers(1, 3), fail_policy=st.booleans())
def test_random_histories_keep_the_reattachment_invariants(
    steps: list[tuple[object, ...]], budget: int, fail_policy: bool
) -> None:
    """Whatever happens: a reattachment never spends budget nor asks the host; each
    attempt's reattachments stay within the bound; its response id never changes once
    saved and its cursor never goes backwards; a Reattach names the saved id and cursor."""
    rec = record(reattach=True, retry_policy=RetryPolicy(initial_backoff=0.0,
                                                           maximum_backoff=0.0),
                 maximum_attempts=budget, on_interruption="fail" if fail_policy else "replace")
    now = T0
    t = open_(rec, ctx(now))
    seen: dict[str, tuple[str | None, int | None]] = {}
    for step in steps:
        before = t.record
        action = t.action
        if isinstance(action, AskHost):
            t = m.authorization_answered(before, action.attempt.attempt_id, True, ctx(now))
            continue
        if isinstance(action, m.WaitUntil):
            now = max(now, action.at)
            t = m.wake(before, ctx(now))
            continue
        if before.phase != "transmitting" or not before.attempts:
            break  # finished, stopped or idle: this history is over
        attempt_id = before.attempts[-1].attempt_id
        match step:
            case ("fail", kind, rid, seq):
                failure = Interruption(kind=kind, response_id=rid, sequence_number=seq)  # type: ignore[arg-type]
                t = m.attempt_failed(before, attempt_id, failure, ctx(now))
            case ("checkpoint", rid, seq):
                t = reattachment.checkpoint(before, attempt_id, rid, seq, now)  # type: ignore[arg-type]
            case ("crash",):
                swept = m.owner_lost(before, now=now).record
                t = open_(swept, ctx(now))
            case ("suspend",):
                suspended = m.command_observed(before, "suspend").record
                t = open_(suspended, ctx(now)) if suspended.phase == "suspended" else \
                    m.command_observed(before, "suspend")
            case _:
                t = m.completion_validated(before, attempt_id, ctx(now), response_id=None,
                                           sequence_number=None)
        after = t.record
        assert after.attempts_used <= budget
        if isinstance(t.action, Reattach):
            last = after.attempts[-1]
            assert after.attempts_used == before.attempts_used  # no budget
            assert (t.action.response_id, t.action.after) == (
                last.response_id, last.sequence_number)
            assert last.outcome == "in_flight" and after.phase == "transmitting"
        for attempt in after.attempts:
            assert attempt.reattachments <= reattachment.MAX_REATTACHMENTS
            old = seen.get(attempt.attempt_id)
            if old is not None:
                old_id, old_seq = old
                if old_id is not None:
                    assert attempt.response_id == old_id, "the response id changed"
                if old_seq is not None and attempt.response_id is not None:
                    assert attempt.sequence_number is not None
                    assert attempt.sequence_number >= old_seq, "the cursor went backwards"
            seen[attempt.attempt_id] = (attempt.response_id, attempt.sequence_number)
