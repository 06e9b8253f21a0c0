"""Table-driven tests of the pure operation state machine, one test per rule.

Every test builds an ``OperationRecord`` directly, feeds one event and checks both
halves of the returned ``Transition``: the record the driver persists FIRST, and the
ONE action it performs afterwards.
"""

from __future__ import annotations

from typing import Any

import pytest

from recoverable import errors
from recoverable import machine as m
from recoverable.machine import (
    AskHost,
    Context,
    Deliver,
    InvalidTransition,
    Stop,
    Transition,
    Transmit,
    WaitUntil,
)
from recoverable.outcome import Interruption
from recoverable.records import (
    AttemptRecord,
    CommandKind,
    FailureReason,
    OperationRecord,
    PendingAttempt,
    Phase,
)
from recoverable.types import AccountBinding, Attempt, RetryPolicy

ALICE = AccountBinding("alice")
BOB = AccountBinding("bob")
ALICE_OAUTH = AccountBinding("alice", "oauth")  # same id, other credential source
T0 = 1_700_000_000.0
OP = "op-1"
FH = "format-hash-1"
EP = "endpoint-1"

DISCONNECT = Interruption(kind="disconnected", transport_code="ws_close_1006")


# --- helpers -------------------------------------------------------------------------


def record(**changes: Any) -> OperationRecord:
    fields: dict[str, Any] = {
        "operation_id": OP,
        "account": ALICE,
        "endpoint_id": EP,
        "created_at": T0,
        "maximum_attempts": 3,
        "model": "gpt-test",
        "format_name": "Answer",
        "format_hash": FH,
        "body_hash": "body-1",
        "root_operation_id": OP,
    }
    fields.update(changes)
    return OperationRecord(**fields)


def ctx(
    now: float = T0,
    account: AccountBinding | None = ALICE,
    *,
    credentials_account: AccountBinding | None = None,
    endpoint_id: str | None = None,
    command: CommandKind | None = None,
) -> Context:
    return Context(
        now=now,
        account=account,
        credentials_account=credentials_account,
        endpoint_id=endpoint_id,
        command=command,
    )


def open_(
    rec: OperationRecord,
    c: Context | None = None,
    *,
    format_hash: str = FH,
    expected_contract_version: str | None = None,
    check_contract_version: bool = False,
) -> Transition:
    return m.open_operation(
        rec,
        c if c is not None else ctx(),
        format_hash=format_hash,
        expected_contract_version=expected_contract_version,
        check_contract_version=check_contract_version,
    )


def asked(t: Transition) -> Attempt:
    assert isinstance(t.action, AskHost), t.action
    return t.action.attempt


def stopped(t: Transition, cls: type[errors.RecoveryError]) -> errors.RecoveryError:
    assert isinstance(t.action, Stop), t.action
    assert type(t.action.error) is cls, t.action.error
    assert t.action.error.operation_id == OP
    return t.action.error


def attempt(number: int, outcome: str = "failed", **kw: Any) -> AttemptRecord:
    reason = kw.pop("reason", "initial" if number == 1 else "replacement")
    return AttemptRecord(
        attempt_id=m.attempt_id_for(OP, number),
        number=number,
        reason=reason,
        consumed_at=T0 + number,
        outcome=outcome,  # type: ignore[arg-type]
        **kw,
    )


def spent(n: int, *, last_in_flight: bool = False) -> dict[str, Any]:
    """Fields of a record with ``n`` consumed attempts (the last one possibly in flight)."""
    attempts = tuple(
        attempt(i, "in_flight" if (last_in_flight and i == n) else "failed",
                failure=None if (last_in_flight and i == n) else DISCONNECT)
        for i in range(1, n + 1)
    )
    return {"attempts": attempts, "attempts_used": n}


def transmitting(n: int = 1, **changes: Any) -> OperationRecord:
    """A record whose attempt ``n`` is consumed and in flight."""
    return record(phase="transmitting", **spent(n, last_in_flight=True), **changes)


def run_to_transmit(rec: OperationRecord, now: float = T0) -> tuple[OperationRecord, str]:
    """open (or wake) → AskHost → approve → Transmit; returns the persisted record."""
    t = open_(rec, ctx(now))
    a = asked(t)
    t2 = m.authorization_answered(t.record, a.attempt_id, True, ctx(now))
    assert isinstance(t2.action, Transmit)
    return t2.record, t2.action.attempt_id


def nothing_consumed(before: OperationRecord, after: OperationRecord) -> None:
    assert after.attempts_used == before.attempts_used
    assert after.attempts == before.attempts


# --- preparation: the budget ------------------------------------------------------------


def _prep(**kw: Any) -> None:
    args: dict[str, Any] = {
        "maximum_attempts": 3,
        "retry_policy": RetryPolicy(),
        "scope": None,
        "job_id": None,
        "input_revision": None,
        "contract_version": None,
    }
    args.update(kw)
    m.validate_preparation(**args)


@pytest.mark.parametrize("value", [1, 2, 999, 1000])
def test_budget_in_1_to_1000_is_accepted(value: int) -> None:
    _prep(maximum_attempts=value)


@pytest.mark.parametrize("value", [0, -1, 1001, 10**9, True, False, 1.0, 2.5, "3", None])
def test_budget_outside_1_to_1000_or_not_int_is_invalid_request(value: Any) -> None:
    with pytest.raises(errors.InvalidRequest):
        _prep(maximum_attempts=value)


@pytest.mark.parametrize(
    "field,value",
    [
        ("scope", "x" * (m.MAX_METADATA_CHARS + 1)),
        ("job_id", "a\0b"),
        ("input_revision", 7),
        ("contract_version", b"v1"),
    ],
)
def test_metadata_bounded_strings_without_nul(field: str, value: Any) -> None:
    with pytest.raises(errors.InvalidRequest):
        _prep(**{field: value})
    _prep(**{field: "x" * m.MAX_METADATA_CHARS})


@pytest.mark.parametrize(
    "policy",
    [
        RetryPolicy(initial_backoff=-1.0),
        RetryPolicy(initial_backoff=float("nan")),
        RetryPolicy(maximum_backoff=float("inf")),
        RetryPolicy(maximum_retry_after=-0.5),
        RetryPolicy(multiplier=0.5),
        RetryPolicy(multiplier=float("nan")),
    ],
)
def test_retry_policy_numbers_validated(policy: RetryPolicy) -> None:
    with pytest.raises(errors.InvalidRequest):
        _prep(retry_policy=policy)


def test_budget_counts_every_post_including_the_401_reissue() -> None:
    rec, first = run_to_transmit(record(maximum_attempts=2))
    assert rec.attempts_used == 1
    t = m.attempt_failed(rec, first, Interruption(kind="http_rejected", http_status=401), ctx())
    a = asked(t)
    assert a.reason == "authentication_reissue" and a.number == 2
    t2 = m.authorization_answered(t.record, a.attempt_id, True, ctx())
    assert t2.action == Transmit(a.attempt_id, renew=True)
    assert t2.record.attempts_used == 2 and t2.record.attempts_remaining == 0
    # The reissue was a POST: a transport failure now finds the budget spent.
    t3 = m.attempt_failed(t2.record, a.attempt_id, DISCONNECT, ctx())
    err = stopped(t3, errors.AttemptsExhausted)
    assert isinstance(err, errors.AttemptsExhausted) and err.last_failure == DISCONNECT
    assert t3.record.phase == "failed" and t3.record.failure_reason == "exhausted"


def test_401_with_a_budget_of_one_is_exhausted_not_reissued() -> None:
    rec, first = run_to_transmit(record(maximum_attempts=1))
    t = m.attempt_failed(rec, first, Interruption(kind="http_rejected", http_status=401), ctx())
    stopped(t, errors.AttemptsExhausted)
    assert t.record.attempts_used == 1


# --- authorization: pending id saved before asking, reused on replay --------------------


def test_pending_attempt_id_is_saved_before_ask_host() -> None:
    rec = record()
    t = open_(rec)
    a = asked(t)
    assert t.changed
    assert t.record.phase == "authorizing"
    assert t.record.pending == PendingAttempt(a.attempt_id, 1, "initial")
    assert (a.number, a.maximum_attempts, a.operation_id) == (1, 3, OP)
    nothing_consumed(rec, t.record)


def test_replay_from_authorizing_reuses_the_same_attempt_id_and_number() -> None:
    t = open_(record())
    first = asked(t)
    # The driver died while the host callback ran: the persisted record is reopened.
    replay = open_(t.record, ctx(T0 + 50))
    again = asked(replay)
    assert (again.attempt_id, again.number, again.reason) == (
        first.attempt_id, first.number, first.reason
    )
    assert replay.record.pending == t.record.pending
    nothing_consumed(t.record, replay.record)


def test_replay_of_a_replacement_reuses_its_pending_id() -> None:
    rec = record(phase="authorizing", pending=PendingAttempt(m.attempt_id_for(OP, 2), 2,
                 "replacement"), **spent(1))
    again = asked(open_(rec))
    assert again.attempt_id == m.attempt_id_for(OP, 2) and again.reason == "replacement"


def test_attempt_ids_are_derived_and_distinct_per_number() -> None:
    ids = {m.attempt_id_for(OP, n) for n in range(1, 1001)}
    assert len(ids) == 1000
    assert m.attempt_id_for(OP, 1) == m.attempt_id_for(OP, 1)
    assert m.attempt_id_for(OP, 1) != m.attempt_id_for("op-2", 1)


# --- approval rechecks -------------------------------------------------------------------


def _authorizing(**changes: Any) -> OperationRecord:
    t = open_(record(**changes))
    asked(t)
    return t.record


@pytest.mark.parametrize(
    "label,context,error,phase",
    [
        ("suspend command", ctx(command="suspend"), errors.OperationSuspended, "suspended"),
        ("cancel command", ctx(command="cancel"), errors.OperationCancelled, "cancelled"),
        ("account changed", ctx(account=BOB), errors.AccountChanged, "prepared"),
        ("credential source changed", ctx(account=ALICE_OAUTH), errors.AccountChanged,
         "prepared"),
        ("signed out", ctx(account=None), errors.AccountChanged, "prepared"),
        ("credentials of another account", ctx(credentials_account=BOB),
         errors.AccountChanged, "prepared"),
        ("expired", ctx(now=T0 + 100), errors.StateExpired, "prepared"),
    ],
)
def test_approval_is_rechecked_and_stops_without_transmit(
    label: str, context: Context, error: type[errors.RecoveryError], phase: Phase
) -> None:
    rec = _authorizing(expires_at=T0 + 100)
    assert rec.pending is not None
    t = m.authorization_answered(rec, rec.pending.attempt_id, True, context)
    stopped(t, error)
    assert t.record.phase == phase, label
    nothing_consumed(rec, t.record)
    if phase != "cancelled":
        assert t.record.pending == rec.pending  # the id survives for the next try


def test_approval_rechecks_budget() -> None:
    # A record whose budget was spent behind the pending id (e.g. an upgraded record).
    rec = record(phase="authorizing", maximum_attempts=2, **spent(2),
                 pending=PendingAttempt(m.attempt_id_for(OP, 3), 3, "replacement"))
    t = m.authorization_answered(rec, m.attempt_id_for(OP, 3), True, ctx())
    stopped(t, errors.AttemptsExhausted)
    assert t.record.phase == "failed" and t.record.failure_reason == "exhausted"
    nothing_consumed(rec, t.record)


def test_attempt_is_consumed_in_the_transition_that_returns_transmit() -> None:
    rec = _authorizing()
    t = m.authorization_answered(rec, m.attempt_id_for(OP, 1), True, ctx(T0 + 3))
    assert t.action == Transmit(m.attempt_id_for(OP, 1), renew=False)
    assert t.changed
    new = t.record
    assert new.phase == "transmitting"
    assert new.attempts_used == 1 and new.pending is None
    assert new.attempts == (
        AttemptRecord(attempt_id=m.attempt_id_for(OP, 1), number=1, reason="initial",
                      consumed_at=T0 + 3, outcome="in_flight"),
    )


def test_denial_spends_nothing_keeps_the_pending_id_and_is_not_a_cancel() -> None:
    rec = _authorizing()
    t = m.authorization_answered(rec, m.attempt_id_for(OP, 1), False, ctx())
    err = stopped(t, errors.AttemptNotAuthorized)
    assert isinstance(err, errors.AttemptNotAuthorized)
    assert err.attempt_id == m.attempt_id_for(OP, 1)
    assert t.record.phase == "prepared"
    assert t.record.pending == rec.pending
    nothing_consumed(rec, t.record)
    # Resuming later asks about the very same attempt.
    assert asked(open_(t.record, ctx(T0 + 10))).attempt_id == m.attempt_id_for(OP, 1)


def test_denial_of_a_replacement_returns_to_waiting() -> None:
    rec = record(phase="authorizing", **spent(1),
                 pending=PendingAttempt(m.attempt_id_for(OP, 2), 2, "replacement"))
    t = m.authorization_answered(rec, m.attempt_id_for(OP, 2), False, ctx())
    stopped(t, errors.AttemptNotAuthorized)
    assert t.record.phase == "waiting" and t.record.attempts_used == 1


# --- completion ----------------------------------------------------------------------------


def test_completion_is_saved_in_the_transition_that_returns_deliver() -> None:
    rec = transmitting(1)
    t = m.completion_validated(rec, m.attempt_id_for(OP, 1), ctx(T0 + 9),
                               response_id="resp_1", sequence_number=42)
    assert t.action == Deliver()
    new = t.record
    assert new.phase == "completed" and new.completed_at == T0 + 9 and new.has_completion
    assert new.attempts[-1].outcome == "completed"
    assert (new.attempts[-1].response_id, new.attempts[-1].sequence_number) == ("resp_1", 42)
    assert new.attempts_used == 1


@pytest.mark.parametrize(
    "label,context",
    [
        ("same runtime", ctx(T0 + 5)),
        ("expired since", ctx(T0 + 10_000)),
        ("endpoint changed since", ctx(endpoint_id="endpoint-2")),
    ],
)
def test_reopening_a_completed_record_delivers_without_ask_host(
    label: str, context: Context
) -> None:
    rec = record(phase="completed", completed_at=T0 + 1, expires_at=T0 + 100,
                 **{**spent(1), "attempts": (attempt(1, "completed"),)})
    t = open_(rec, context)
    assert t.action == Deliver(), label
    assert t.record == rec and not t.changed


def test_saved_completion_in_a_suspended_record_is_delivered_on_reopen() -> None:
    rec = record(phase="suspended", completed_at=T0 + 1, maximum_attempts=1,
                 **{**spent(1), "attempts": (attempt(1, "completed"),)})
    t = open_(rec)
    assert t.action == Deliver()
    assert t.record.phase == "completed" and t.record.attempts_used == 1


def test_completed_record_is_not_delivered_to_another_account() -> None:
    rec = record(phase="completed", completed_at=T0 + 1, **spent(1))
    for c in (ctx(account=BOB), ctx(account=None), ctx(credentials_account=BOB)):
        t = open_(rec, c)
        stopped(t, errors.AccountChanged)
        assert t.record == rec


@pytest.mark.parametrize(
    "context", [ctx(account=BOB), ctx(account=None), ctx(credentials_account=BOB)]
)
def test_completion_validated_after_an_account_change_is_kept_but_not_delivered(
    context: Context,
) -> None:
    # Issue 10.3 (changed on purpose): the attempt was authorized for ALICE and its
    # completion validated, so it is ALICE's paid result. It used to be discarded; now
    # it is saved as her receipt, and the execution stops without delivering it.
    t = m.completion_validated(transmitting(1), m.attempt_id_for(OP, 1), context,
                               response_id="resp_1", sequence_number=None)
    stopped(t, errors.AccountChanged)
    assert t.record.has_completion and t.record.phase == "completed"
    assert t.record.attempts_used == 1 and t.record.attempts[0].outcome == "completed"
    # ALICE reopening gets it delivered with no generation; nobody else does.
    assert open_(t.record).action == Deliver()
    stopped(open_(t.record, ctx(account=BOB)), errors.AccountChanged)


def test_completion_validated_with_a_cancel_and_an_account_change_is_fenced() -> None:
    t = m.completion_validated(transmitting(1), m.attempt_id_for(OP, 1),
                               ctx(account=None, command="cancel"),
                               response_id="resp_1", sequence_number=None)
    stopped(t, errors.OperationCancelled)
    assert t.record.phase == "cancelled"


@pytest.mark.parametrize("code", ["signed_out", "account_changed"])
def test_account_stop_while_streaming_keeps_the_attempt_spent_as_an_interruption(
    code: str,
) -> None:
    rec = transmitting(2)
    t = m.account_stopped(rec, code, ctx(account=None))
    stopped(t, errors.AccountChanged)
    assert t.record.attempts_used == 2 and t.record.phase == "waiting"
    last = t.record.attempts[-1]
    assert last.outcome == "interrupted" and last.failure is not None
    assert last.failure.kind == "interrupted" and last.failure.transport_code == code
    assert t.record.last_failure == last.failure
    assert not t.record.has_completion and t.record.completed_at is None


def test_account_stop_while_waiting_keeps_the_cooldown_and_spends_nothing() -> None:
    rec = record(phase="waiting", next_attempt_at=T0 + 60, **spent(1))
    t = m.account_stopped(rec, "signed_out", ctx(account=None))
    stopped(t, errors.AccountChanged)
    assert t.record == rec and not t.changed


def test_account_stop_while_authorizing_keeps_the_pending_id_and_spends_nothing() -> None:
    rec = _authorizing()
    t = m.account_stopped(rec, "account_changed", ctx(account=BOB))
    stopped(t, errors.AccountChanged)
    nothing_consumed(rec, t.record)
    assert t.record.phase == "prepared" and t.record.pending == rec.pending


@pytest.mark.parametrize(
    "command,error,phase",
    [("cancel", errors.OperationCancelled, "cancelled"),
     ("suspend", errors.OperationSuspended, "suspended")],
)
def test_account_stop_with_a_command_applies_the_command(
    command: CommandKind, error: type[errors.RecoveryError], phase: str
) -> None:
    t = m.account_stopped(transmitting(1), "signed_out", ctx(account=None, command=command))
    stopped(t, error)
    assert t.record.phase == phase and t.record.attempts[0].outcome == "interrupted"


def test_completion_while_suspend_commanded_is_saved_then_suspends() -> None:
    t = m.completion_validated(transmitting(1), m.attempt_id_for(OP, 1),
                               ctx(command="suspend"), response_id=None, sequence_number=None)
    stopped(t, errors.OperationSuspended)
    assert t.record.has_completion
    assert open_(t.record).action == Deliver()


# --- lifecycle: suspend keeps, cancel fences -------------------------------------------------


def test_suspend_keeps_budget_cooldown_and_history() -> None:
    rec = record(phase="waiting", next_attempt_at=T0 + 60, **spent(2))
    t = m.interrupted_locally(rec)
    stopped(t, errors.OperationSuspended)
    s = t.record
    assert s.phase == "suspended"
    assert (s.attempts_used, s.attempts, s.next_attempt_at) == (2, rec.attempts, T0 + 60)
    # Reopening (resuming) waits for the very same cooldown.
    t2 = open_(s, ctx(T0 + 10))
    assert t2.action == WaitUntil(T0 + 60)
    assert t2.record.phase == "waiting" and t2.record.attempts_used == 2


def test_suspend_while_transmitting_marks_the_attempt_interrupted_and_spent() -> None:
    t = m.interrupted_locally(transmitting(1))
    s = t.record
    assert s.phase == "suspended" and s.attempts_used == 1
    assert s.attempts[-1].outcome == "interrupted"
    assert s.last_failure is not None and s.last_failure.kind == "interrupted"
    a = asked(open_(s))
    assert (a.number, a.reason) == (2, "replacement")


def test_suspend_while_authorizing_keeps_the_pending_id() -> None:
    rec = _authorizing()
    s = m.interrupted_locally(rec).record
    assert s.phase == "suspended" and s.pending == rec.pending
    assert asked(open_(s)).attempt_id == m.attempt_id_for(OP, 1)


@pytest.mark.parametrize("phase", ["completed", "failed", "cancelled"])
def test_suspend_of_a_finished_record_changes_nothing(phase: Phase) -> None:
    rec = record(phase=phase, completed_at=T0 + 1 if phase != "failed" else None,
                 failure_reason="quota" if phase == "failed" else None, **spent(1))
    assert m.interrupted_locally(rec).record == rec
    assert m.command_on_idle(rec, "suspend").record == rec


@pytest.mark.parametrize(
    "phase,extra",
    [
        ("prepared", {}),
        ("waiting", {**spent(1), "next_attempt_at": T0 + 5}),
        ("suspended", spent(1)),
        ("completed", {**spent(1), "completed_at": T0 + 1}),
        ("failed", {**spent(1), "failure_reason": "exhausted"}),
    ],
)
def test_cancel_is_terminal_and_fences_generation_and_delivery(
    phase: Phase, extra: dict[str, Any]
) -> None:
    rec = record(phase=phase, **extra)
    t = m.command_on_idle(rec, "cancel")
    stopped(t, errors.OperationCancelled)
    c = t.record
    assert c.phase == "cancelled" and c.attempts_used == rec.attempts_used
    assert c.completed_at == rec.completed_at  # kept (for diagnostics), never delivered
    for later in (ctx(T0 + 1000), ctx(T0 + 1000, endpoint_id="endpoint-2")):
        t2 = open_(c, later)
        stopped(t2, errors.OperationCancelled)
        assert t2.record == c
    with pytest.raises(errors.OperationCancelled):
        m.check_acknowledge(c)
    with pytest.raises(InvalidTransition):
        m.wake(c, ctx(T0 + 1000))


def test_cancel_fences_a_late_completion() -> None:
    t = m.completion_validated(transmitting(1), m.attempt_id_for(OP, 1), ctx(command="cancel"),
                               response_id="resp_1", sequence_number=3)
    stopped(t, errors.OperationCancelled)
    assert t.record.phase == "cancelled" and not t.record.has_completion
    assert t.record.attempts_used == 1
    stopped(open_(t.record), errors.OperationCancelled)


def test_pending_cancel_command_at_open_cancels_before_anything_else() -> None:
    rec = record(phase="waiting", **spent(1))
    t = open_(rec, ctx(command="cancel"))
    stopped(t, errors.OperationCancelled)
    assert t.record.phase == "cancelled"


@pytest.mark.parametrize(
    "kind,error,phase",
    [("suspend", errors.OperationSuspended, "suspended"),
     ("cancel", errors.OperationCancelled, "cancelled")],
)
def test_command_observed_at_wake(kind: CommandKind, error: type[errors.RecoveryError],
                                  phase: Phase) -> None:
    rec = record(phase="waiting", next_attempt_at=T0, **spent(1))
    t = m.wake(rec, ctx(T0 + 1, command=kind))
    stopped(t, error)
    assert t.record.phase == phase and t.record.attempts_used == 1


@pytest.mark.parametrize(
    "kind,error,phase",
    [("suspend", errors.OperationSuspended, "suspended"),
     ("cancel", errors.OperationCancelled, "cancelled")],
)
def test_command_observed_when_an_attempt_fails(
    kind: CommandKind, error: type[errors.RecoveryError], phase: Phase
) -> None:
    t = m.attempt_failed(transmitting(1), m.attempt_id_for(OP, 1), DISCONNECT,
                         ctx(command=kind))
    stopped(t, error)
    assert t.record.phase == phase
    assert t.record.attempts_used == 1 and t.record.attempts[-1].outcome == "failed"


def test_command_on_idle_suspend_is_idempotent() -> None:
    rec = record(phase="waiting", next_attempt_at=T0 + 5, **spent(1))
    s = m.command_on_idle(rec, "suspend")
    assert s.action is None and s.record.phase == "suspended"
    again = m.command_on_idle(s.record, "suspend")
    assert again.record == s.record and not again.changed


# --- the failure table -----------------------------------------------------------------------

P = RetryPolicy()
P_INVALID = RetryPolicy(replace_invalid_output=True)
P_INCOMPLETE = RetryPolicy(replace_incomplete=True)
P_501 = RetryPolicy(retryable_statuses=frozenset({501}))
P_CODES = RetryPolicy(retryable_provider_codes=frozenset({"server_error"}))
P_NO_429 = RetryPolicy(retryable_statuses=frozenset({500}))


def failed(**kw: Any) -> Interruption:
    return Interruption(kind="provider_failed", **kw)


def rejected(status: int, **kw: Any) -> Interruption:
    return Interruption(kind="http_rejected", http_status=status, **kw)


FAILURE_TABLE: list[tuple[str, Interruption, RetryPolicy, FailureReason | None]] = [
    ("disconnect", DISCONNECT, P, None),
    ("timeout", Interruption(kind="timeout"), P, None),
    ("premature eof", Interruption(kind="premature_eof"), P, None),
    ("garbled stream", Interruption(kind="malformed", transport_code="invalid_json"), P, None),
    # Issue 10.6: a configured size bound is terminal (a replacement would pass it again).
    ("frame too large", Interruption(kind="response_too_large", transport_code="frame_too_large"),
     P, "response_too_large"),
    ("stream too large",
     Interruption(kind="response_too_large", transport_code="stream_too_large"), P,
     "response_too_large"),
    ("too many events", Interruption(kind="response_too_large", transport_code="too_many_events"),
     P_INVALID, "response_too_large"),
    ("process interrupted", Interruption(kind="interrupted"), P, None),
    ("disconnect after output", Interruption(kind="disconnected", had_output=True), P, None),
    ("429 rate limit", rejected(429, retry_after=5.0), P, None),
    ("429 not configured: the policy decides", rejected(429),
     RetryPolicy(retryable_statuses=frozenset()), "rejected"),
    ("429 insufficient_quota", rejected(429, provider_type="insufficient_quota"), P, "quota"),
    ("429 quota code", rejected(429, provider_code="insufficient_quota"), P, "quota"),
    ("credit exhausted", Interruption(kind="provider_failed",
                                      provider_code="credit_balance_exhausted"), P, "quota"),
    ("spend limit", rejected(400, provider_code="organization_spend_limit_exceeded"), P,
     "quota"),
    ("quota even if code allowed",
     Interruption(kind="provider_failed", provider_code="quota_exceeded"),
     RetryPolicy(retryable_provider_codes=frozenset({"quota_exceeded"})), "quota"),
    ("500 configured", rejected(500), P, None),
    ("503 configured", rejected(503), P, None),
    ("501 not configured", rejected(501), P, "rejected"),
    ("501 configured", rejected(501), P_501, None),
    ("500 no longer configured", rejected(500), P_501, "rejected"),
    ("403", rejected(403), P, "rejected"),
    ("400", rejected(400), P, "rejected"),
    ("401 handled by reissue", rejected(401), P, None),
    # Issue 10.5: no provider code is replaced unless the host allows it explicitly.
    ("failed server_error, default policy", failed(provider_code="server_error"), P,
     "provider_failed"),
    ("failed allowed code", failed(provider_code="server_error"), P_CODES, None),
    # Issue 10.14: status, then code, then error.type — the same on both transports.
    ("no status, rate-limit code: like a 429", failed(provider_code="rate_limit_exceeded"), P,
     None),
    ("no status, rate-limit type: like a 429",
     failed(provider_type="rate_limit_exceeded"), P, None),
    ("no status, rate-limit type, 429 not configured",
     failed(provider_type="rate_limit_exceeded"), P_NO_429, "provider_failed"),
    ("no status, server_error type, default policy", failed(provider_type="server_error"), P,
     "provider_failed"),
    ("no status, server_error type, opted in", failed(provider_type="server_error"), P_CODES,
     None),
    ("code before type", failed(provider_code="invalid_prompt", provider_type="server_error"),
     P_CODES, "provider_failed"),
    ("code before rate-limit type",
     failed(provider_code="invalid_prompt", provider_type="rate_limit_exceeded"), P,
     "provider_failed"),
    ("no status, quota type", failed(provider_type="insufficient_quota"), P, "quota"),
    ("500 server_error type, null code: the status decides",
     rejected(500, provider_type="server_error"), P, None),
    ("403 with a rate-limit code is a 403", rejected(403, provider_code="rate_limit_exceeded"),
     P, "rejected"),
    ("ws error frame with status 429", rejected(429, provider_type="rate_limit_exceeded"),
     P, None),
    ("failed other code", Interruption(kind="provider_failed", provider_code="invalid_prompt"),
     P, "provider_failed"),
    ("failed no code", Interruption(kind="provider_failed"), P, "provider_failed"),
    ("invalid output default", Interruption(kind="invalid_output"), P, "invalid_output"),
    ("invalid output opted in", Interruption(kind="invalid_output"), P_INVALID, None),
    ("refusal default", Interruption(kind="refusal"), P, "invalid_output"),
    ("incomplete default", Interruption(kind="incomplete", provider_code="max_output_tokens"), P,
     "incomplete"),
    ("incomplete opted in", Interruption(kind="incomplete"), P_INCOMPLETE, None),
    ("tool activity", Interruption(kind="tool_activity"), P_INVALID, "tool_activity"),
    ("tool activity seen then invalid",
     Interruption(kind="invalid_output", had_tool_activity=True), P_INVALID, "tool_activity"),
    ("tool activity seen then disconnect",
     Interruption(kind="disconnected", had_tool_activity=True), P, "tool_activity"),
]


@pytest.mark.parametrize("label,failure,policy,expected", FAILURE_TABLE,
                         ids=[row[0] for row in FAILURE_TABLE])
def test_failure_table_classification(
    label: str, failure: Interruption, policy: RetryPolicy, expected: FailureReason | None
) -> None:
    assert m.classify(failure, policy) == expected


ELIGIBLE = [row for row in FAILURE_TABLE if row[3] is None and row[1].http_status != 401]
TERMINAL = [row for row in FAILURE_TABLE if row[3] is not None]


@pytest.mark.parametrize("label,failure,policy,expected", ELIGIBLE,
                         ids=[row[0] for row in ELIGIBLE])
def test_eligible_failure_waits_with_persisted_backoff(
    label: str, failure: Interruption, policy: RetryPolicy, expected: None
) -> None:
    rec = transmitting(1, retry_policy=policy)
    now = T0 + 20
    t = m.attempt_failed(rec, m.attempt_id_for(OP, 1), failure, ctx(now))
    delay = m.backoff_delay(policy, 1, failure.retry_after)
    assert delay > 0
    assert t.action == WaitUntil(now + delay)
    new = t.record
    assert new.phase == "waiting" and new.next_attempt_at == now + delay
    assert new.attempts_used == 1 and new.attempts[-1].outcome == "failed"
    assert new.attempts[-1].failure == failure and new.last_failure == failure
    assert new.failure_reason is None


@pytest.mark.parametrize("label,failure,policy,expected", ELIGIBLE,
                         ids=[row[0] for row in ELIGIBLE])
def test_eligible_failure_asks_for_replacement_when_the_delay_has_passed(
    label: str, failure: Interruption, policy: RetryPolicy, expected: None
) -> None:
    immediate = RetryPolicy(
        initial_backoff=0.0, maximum_retry_after=0.0,
        retryable_statuses=policy.retryable_statuses,
        retryable_provider_codes=policy.retryable_provider_codes,
        replace_invalid_output=policy.replace_invalid_output,
        replace_incomplete=policy.replace_incomplete,
    )
    rec = transmitting(1, retry_policy=immediate)
    t = m.attempt_failed(rec, m.attempt_id_for(OP, 1), failure, ctx())
    a = asked(t)
    assert (a.number, a.reason, a.previous_failure) == (2, "replacement", failure)
    assert t.record.phase == "authorizing" and t.record.attempts_used == 1
    assert t.record.pending == PendingAttempt(a.attempt_id, 2, "replacement")


@pytest.mark.parametrize("label,failure,policy,expected", TERMINAL,
                         ids=[row[0] for row in TERMINAL])
def test_terminal_failure_is_never_replaced_and_reopens_as_permanently_failed(
    label: str, failure: Interruption, policy: RetryPolicy, expected: FailureReason
) -> None:
    rec = transmitting(1, retry_policy=policy)
    t = m.attempt_failed(rec, m.attempt_id_for(OP, 1), failure, ctx())
    err = stopped(t, errors.ProviderError)
    assert isinstance(err, errors.ProviderError) and err.interruption == failure
    assert t.record.phase == "failed" and t.record.failure_reason == expected
    assert t.record.last_failure == failure and t.record.attempts_used == 1
    for later in (ctx(T0 + 1), ctx(T0 + 10**6)):
        again = open_(t.record, later)
        e2 = stopped(again, errors.PermanentlyFailed)
        assert isinstance(e2, errors.PermanentlyFailed) and e2.last_failure == failure
        assert again.record == t.record


def test_429_cooldown_is_max_of_backoff_and_retry_after_and_persisted() -> None:
    policy = RetryPolicy(initial_backoff=2.0, maximum_retry_after=100.0)
    for retry_after, expected in [(30.0, 30.0), (0.5, 2.0), (None, 2.0), (10_000.0, 100.0)]:
        rec = transmitting(1, retry_policy=policy)
        t = m.attempt_failed(rec, m.attempt_id_for(OP, 1), rejected(429, retry_after=retry_after),
                             ctx())
        assert t.action == WaitUntil(T0 + expected), retry_after
        assert t.record.next_attempt_at == T0 + expected


def test_reopening_waits_for_the_persisted_cooldown_never_ask_host_before() -> None:
    rec = transmitting(1)
    t = m.attempt_failed(rec, m.attempt_id_for(OP, 1), rejected(429, retry_after=30.0), ctx())
    waiting = t.record
    for now in (T0, T0 + 1, T0 + 29.999):
        r = open_(waiting, ctx(now))
        assert r.action == WaitUntil(T0 + 30.0)
        assert r.record.next_attempt_at == T0 + 30.0
        w = m.wake(waiting, ctx(now))
        assert w.action == WaitUntil(T0 + 30.0)
    assert asked(open_(waiting, ctx(T0 + 30.0))).number == 2
    assert asked(m.wake(waiting, ctx(T0 + 30.0))).number == 2


def test_401_reissues_immediately_with_renewed_credentials_consuming_budget() -> None:
    rec = transmitting(1, retry_policy=RetryPolicy(initial_backoff=50.0))
    t = m.attempt_failed(rec, m.attempt_id_for(OP, 1), rejected(401), ctx())
    a = asked(t)  # no WaitUntil: the reissue is immediate
    assert (a.number, a.reason) == (2, "authentication_reissue")
    assert t.record.renew_next
    t2 = m.authorization_answered(t.record, a.attempt_id, True, ctx())
    assert t2.action == Transmit(a.attempt_id, renew=True)
    assert t2.record.attempts_used == 2 and not t2.record.renew_next
    assert t2.record.attempts[-1].reason == "authentication_reissue"


def test_second_401_after_reissue_requires_authentication() -> None:
    rec = transmitting(1)
    t = m.attempt_failed(rec, m.attempt_id_for(OP, 1), rejected(401), ctx())
    t2 = m.authorization_answered(t.record, asked(t).attempt_id, True, ctx())
    t3 = m.attempt_failed(t2.record, m.attempt_id_for(OP, 2), rejected(401), ctx())
    stopped(t3, errors.AuthenticationRequired)
    assert t3.record.phase == "failed"
    assert t3.record.failure_reason == "authentication_required"
    assert t3.record.attempts_used == 2
    # After signing in to the same account the operation reissues within its budget.
    a = asked(open_(t3.record))
    assert (a.number, a.reason) == (3, "authentication_reissue")


def test_renewal_unavailable_before_reissue_is_a_sign_in_blocker_spending_nothing() -> None:
    rec = transmitting(1)
    t = m.attempt_failed(rec, m.attempt_id_for(OP, 1), rejected(401), ctx())
    a = asked(t)
    t2 = m.credentials_unavailable(t.record, a.attempt_id)
    stopped(t2, errors.AuthenticationRequired)
    nothing_consumed(t.record, t2.record)
    assert t2.record.failure_reason == "authentication_required"
    assert asked(open_(t2.record)).attempt_id == a.attempt_id


def test_budget_spent_on_eligible_failures_is_attempts_exhausted() -> None:
    rec = record(maximum_attempts=2, retry_policy=RetryPolicy(initial_backoff=0.0))
    rec, aid = run_to_transmit(rec)
    t = m.attempt_failed(rec, aid, Interruption(kind="timeout"), ctx())
    t2 = m.authorization_answered(t.record, asked(t).attempt_id, True, ctx())
    assert isinstance(t2.action, Transmit)
    last = Interruption(kind="premature_eof")
    t3 = m.attempt_failed(t2.record, t2.action.attempt_id, last, ctx())
    err = stopped(t3, errors.AttemptsExhausted)
    assert isinstance(err, errors.AttemptsExhausted) and err.last_failure == last
    assert t3.record.failure_reason == "exhausted" and t3.record.attempts_used == 2
    again = open_(t3.record, ctx(T0 + 1000))
    stopped(again, errors.AttemptsExhausted)
    assert again.record == t3.record


# --- crashes ---------------------------------------------------------------------------------


def test_stale_transmitting_record_reopened_marks_attempt_interrupted_and_spent() -> None:
    rec = transmitting(1)
    t = open_(rec, ctx(T0 + 100))
    a = asked(t)
    assert (a.number, a.reason) == (2, "replacement")
    assert a.previous_failure is not None and a.previous_failure.kind == "interrupted"
    new = t.record
    assert new.attempts_used == 1 and len(new.attempts) == 1
    assert new.attempts[0].outcome == "interrupted"
    assert new.last_failure is not None and new.last_failure.kind == "interrupted"


def test_stale_transmitting_record_on_its_last_attempt_is_exhausted() -> None:
    t = open_(transmitting(3))
    stopped(t, errors.AttemptsExhausted)
    assert t.record.attempts_used == 3 and t.record.attempts[-1].outcome == "interrupted"


def test_suspended_operation_with_no_budget_gains_none_on_resume() -> None:
    s = m.interrupted_locally(transmitting(3)).record
    assert s.phase == "suspended" and s.attempts_remaining == 0
    t = open_(s, ctx(T0 + 10**6))
    stopped(t, errors.AttemptsExhausted)
    assert t.record.attempts_used == 3 and t.record.maximum_attempts == 3


def test_open_after_a_crash_between_approval_and_send_does_not_refund() -> None:
    rec, _ = run_to_transmit(record())
    t = open_(rec)  # the driver died after persisting the consumed attempt
    assert t.record.attempts_used == 1
    assert asked(t).number == 2


# --- expiry, format, endpoint ----------------------------------------------------------------


def test_expiry_stops_authorization_of_new_attempts() -> None:
    rec = record(expires_at=T0 + 10)
    t = open_(rec, ctx(T0 + 10))
    stopped(t, errors.StateExpired)
    assert t.record.pending is None
    nothing_consumed(rec, t.record)
    waiting = record(phase="waiting", expires_at=T0 + 10, **spent(1))
    stopped(m.wake(waiting, ctx(T0 + 11)), errors.StateExpired)


def test_expiry_does_not_cut_a_running_generation_and_completion_is_delivered() -> None:
    rec = transmitting(1, expires_at=T0 + 10)
    t = m.completion_validated(rec, m.attempt_id_for(OP, 1), ctx(T0 + 500),
                               response_id=None, sequence_number=None)
    assert t.action == Deliver()
    assert open_(t.record, ctx(T0 + 10**6)).action == Deliver()


@pytest.mark.parametrize(
    "phase,extra",
    [("prepared", {}), ("waiting", spent(1)), ("suspended", spent(2)),
     ("transmitting", spent(1, last_in_flight=True))],
)
def test_format_mismatch_at_open_consumes_nothing(phase: Phase, extra: dict[str, Any]) -> None:
    rec = record(phase=phase, **extra)
    t = open_(rec, format_hash="other-format")
    stopped(t, errors.FormatMismatch)
    assert t.record == rec and not t.changed


def test_contract_version_mismatch_at_open_consumes_nothing() -> None:
    rec = record(contract_version="v2")
    t = open_(rec, expected_contract_version="v1", check_contract_version=True)
    stopped(t, errors.FormatMismatch)
    assert t.record == rec
    assert asked(open_(rec, expected_contract_version="v2", check_contract_version=True))
    # Not checked when the host does not supply an expected version.
    assert asked(open_(rec, expected_contract_version=None, check_contract_version=False))
    # A saved completion is not handed to an incompatible contract either.
    done = record(phase="completed", completed_at=T0, contract_version="v2", **spent(1))
    stopped(open_(done, expected_contract_version="v3", check_contract_version=True),
            errors.FormatMismatch)


def test_endpoint_change_blocks_generation_but_not_delivery() -> None:
    other = ctx(endpoint_id="endpoint-2")
    rec = record(phase="waiting", **spent(1))
    t = open_(rec, other)
    stopped(t, errors.ConfigurationUnavailable)
    nothing_consumed(rec, t.record)
    assert t.record.pending is None
    done = record(phase="completed", completed_at=T0, **spent(1))
    assert open_(done, other).action == Deliver()
    assert asked(open_(rec, ctx(endpoint_id=EP)))


@pytest.mark.parametrize(
    "context", [ctx(account=BOB), ctx(account=None), ctx(credentials_account=BOB)]
)
def test_open_for_another_account_stops_before_anything(context: Context) -> None:
    rec = record()
    t = open_(rec, context)
    stopped(t, errors.AccountChanged)
    assert t.record == rec


# --- progress --------------------------------------------------------------------------------


def test_progress_records_response_id_and_cursor_without_an_action() -> None:
    rec = transmitting(1)
    aid = m.attempt_id_for(OP, 1)
    t = m.progress(rec, aid, "resp_9", 3)
    assert t.action is None and t.changed
    t2 = m.progress(t.record, aid, None, None)
    assert (t2.record.attempts[-1].response_id, t2.record.attempts[-1].sequence_number) == (
        "resp_9", 3
    )
    assert t2.record.attempts[-1].outcome == "in_flight" and t2.record.attempts_used == 1


# --- invalid transitions ---------------------------------------------------------------------

_A1 = m.attempt_id_for(OP, 1)
_A2 = m.attempt_id_for(OP, 2)

INVALID: list[tuple[str, Any]] = [
    ("wake in prepared", lambda: m.wake(record(), ctx())),
    ("wake in authorizing", lambda: m.wake(_authorizing(), ctx())),
    ("wake in transmitting", lambda: m.wake(transmitting(1), ctx())),
    ("wake in completed", lambda: m.wake(record(phase="completed", completed_at=T0), ctx())),
    ("wake in suspended", lambda: m.wake(record(phase="suspended"), ctx())),
    ("progress in prepared", lambda: m.progress(record(), _A1, "r", 1)),
    ("progress in waiting", lambda: m.progress(record(phase="waiting", **spent(1)), _A1, "r",
                                               1)),
    ("progress for another attempt", lambda: m.progress(transmitting(2), _A1, "r", 1)),
    ("progress after completion",
     lambda: m.progress(record(phase="transmitting", **{**spent(1), "attempts": (
         attempt(1, "completed"),)}), _A1, "r", 1)),
    ("answer for the wrong attempt id",
     lambda: m.authorization_answered(_authorizing(), _A2, True, ctx())),
    ("answer in prepared", lambda: m.authorization_answered(record(), _A1, True, ctx())),
    ("answer in transmitting",
     lambda: m.authorization_answered(transmitting(1), _A1, True, ctx())),
    ("failure in waiting",
     lambda: m.attempt_failed(record(phase="waiting", **spent(1)), _A1, DISCONNECT, ctx())),
    ("failure for another attempt",
     lambda: m.attempt_failed(transmitting(2), _A1, DISCONNECT, ctx())),
    ("completion in authorizing",
     lambda: m.completion_validated(_authorizing(), _A1, ctx(), response_id=None,
                                    sequence_number=None)),
    ("completion in cancelled",
     lambda: m.completion_validated(record(phase="cancelled", **spent(1, last_in_flight=True)),
                                    _A1, ctx(), response_id=None, sequence_number=None)),
    ("credentials unavailable in transmitting",
     lambda: m.credentials_unavailable(transmitting(1), _A1)),
    ("credentials unavailable for another id",
     lambda: m.credentials_unavailable(_authorizing(), _A2)),
]


@pytest.mark.parametrize("label,call", INVALID, ids=[row[0] for row in INVALID])
def test_unknown_phase_event_pairs_raise_invalid_transition(label: str, call: Any) -> None:
    with pytest.raises(InvalidTransition):
        call()


# --- acknowledgement -------------------------------------------------------------------------


def test_acknowledge_only_a_saved_completion() -> None:
    m.check_acknowledge(record(phase="completed", completed_at=T0, **spent(1)))
    for rec in (record(), record(phase="waiting", **spent(1)),
                record(phase="failed", failure_reason="quota", **spent(1))):
        with pytest.raises(errors.CompletionUnavailable):
            m.check_acknowledge(rec)


# --- backoff ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy,used,retry_after,expected",
    [
        (RetryPolicy(initial_backoff=1.0, multiplier=2.0), 1, None, 1.0),
        (RetryPolicy(initial_backoff=1.0, multiplier=2.0), 2, None, 2.0),
        (RetryPolicy(initial_backoff=1.0, multiplier=2.0), 4, None, 8.0),
        (RetryPolicy(initial_backoff=1.0, multiplier=2.0, maximum_backoff=5.0), 4, None, 5.0),
        (RetryPolicy(initial_backoff=1.0, multiplier=2.0), 1000, None, 60.0),
        (RetryPolicy(initial_backoff=1.0, multiplier=1e300), 999, None, 60.0),  # overflow
        (RetryPolicy(initial_backoff=1.0), 1, 7.0, 7.0),
        (RetryPolicy(initial_backoff=4.0), 1, 2.0, 4.0),
        (RetryPolicy(initial_backoff=1.0, maximum_retry_after=10.0), 1, 3600.0, 10.0),
        (RetryPolicy(initial_backoff=1.0), 1, float("inf"), 1.0),
        (RetryPolicy(initial_backoff=1.0), 1, float("nan"), 1.0),
        (RetryPolicy(initial_backoff=1.0), 1, -5.0, 1.0),
        (RetryPolicy(initial_backoff=0.0), 3, None, 0.0),
    ],
)
def test_backoff_delay_table(
    policy: RetryPolicy, used: int, retry_after: float | None, expected: float
) -> None:
    assert m.backoff_delay(policy, used, retry_after) == expected


def test_backoff_overflow_with_zero_initial_backoff_stays_zero() -> None:
    policy = RetryPolicy(initial_backoff=0.0, multiplier=10.0, maximum_backoff=60.0)
    assert m.backoff_delay(policy, 2, None) == 0.0  # fine without overflow
    assert m.backoff_delay(policy, 400, None) == 0.0  # 10.0**399 overflows


# --- derive_status ---------------------------------------------------------------------------

STATUS_TABLE: list[tuple[str, OperationRecord, bool, str, str, tuple[str, ...]]] = [
    ("prepared", record(), False, "prepared", "ready", ("execute", "abandon")),
    ("authorizing live", record(phase="authorizing",
                                pending=PendingAttempt(_A1, 1, "initial")),
     True, "running", "running", ("wait",)),
    ("authorizing dead", record(phase="authorizing", pending=PendingAttempt(_A1, 1, "initial")),
     False, "interrupted", "ready", ("execute", "abandon")),
    ("transmitting live", transmitting(1), True, "running", "running", ("wait",)),
    ("transmitting dead", transmitting(1), False, "interrupted", "replacement_eligible",
     ("execute", "abandon")),
    ("transmitting dead last", transmitting(3), False, "interrupted", "exhausted",
     ("manual_retry", "abandon")),
    ("waiting live", record(phase="waiting", next_attempt_at=T0 + 5, **spent(1)), True,
     "running", "waiting", ("wait", "execute", "abandon")),
    ("waiting dead cooldown", record(phase="waiting", next_attempt_at=T0 + 5, **spent(1)),
     False, "interrupted", "waiting", ("wait", "execute", "abandon")),
    ("waiting dead due", record(phase="waiting", next_attempt_at=T0 - 5, **spent(1)), False,
     "interrupted", "replacement_eligible", ("execute", "abandon")),
    ("completed", record(phase="completed", completed_at=T0, **spent(1)), False, "completed",
     "completion_saved", ("read_receipt", "acknowledge", "abandon")),
    ("suspended with budget", record(phase="suspended", **spent(1)), False, "suspended",
     "suspended", ("resume", "abandon")),
    ("suspended no budget", record(phase="suspended", **spent(3)), False, "suspended",
     "exhausted", ("manual_retry", "abandon")),
    ("suspended with completion", record(phase="suspended", completed_at=T0, **spent(1)),
     False, "completed", "completion_saved", ("read_receipt", "acknowledge", "abandon")),
    ("failed exhausted", record(phase="failed", failure_reason="exhausted", **spent(3)), False,
     "failed", "exhausted", ("manual_retry", "abandon")),
    ("failed quota", record(phase="failed", failure_reason="quota", **spent(1),
                            last_failure=rejected(429, provider_type="insufficient_quota")),
     False, "failed", "failed", ("manual_retry", "abandon")),
    ("failed auth", record(phase="failed", failure_reason="authentication_required",
                           **spent(2)),
     False, "failed", "authentication_required", ("sign_in", "abandon")),
    ("cancelled", record(phase="cancelled", **spent(1)), False, "cancelled",
     "permanently_cancelled", ("abandon",)),
    ("cancelled with completion", record(phase="cancelled", completed_at=T0, **spent(1)), False,
     "cancelled", "permanently_cancelled", ("abandon",)),
    ("expired prepared", record(expires_at=T0 - 1), False, "prepared", "expired",
     ("manual_retry", "abandon")),
    ("expired suspended", record(phase="suspended", expires_at=T0 - 1, **spent(1)), False,
     "suspended", "expired", ("manual_retry", "abandon")),
    ("expired completed", record(phase="completed", completed_at=T0, expires_at=T0 - 1,
                                 **spent(1)),
     False, "completed", "completion_saved", ("read_receipt", "acknowledge", "abandon")),
]


@pytest.mark.parametrize("label,rec,lease_live,state,availability,actions", STATUS_TABLE,
                         ids=[row[0] for row in STATUS_TABLE])
def test_derive_status_table(
    label: str, rec: OperationRecord, lease_live: bool, state: str, availability: str,
    actions: tuple[str, ...]
) -> None:
    s = m.derive_status(rec, now=T0, lease_live=lease_live, viewer=ALICE)
    assert (s.state, s.availability, s.suggested_actions) == (state, availability, actions)
    assert not s.redacted
    assert s.has_saved_completion == rec.has_completion
    assert (s.attempts_used, s.maximum_attempts, s.attempts_remaining) == (
        rec.attempts_used, rec.maximum_attempts, rec.attempts_remaining
    )
    assert [a.attempt_id for a in s.attempts] == [a.attempt_id for a in rec.attempts]
    assert s.last_failure == rec.last_failure
    assert s.pending_attempt_id == (rec.pending.attempt_id if rec.pending else None)
    if "read_receipt" in actions or "acknowledge" in actions:
        assert rec.has_completion and rec.phase != "cancelled"


def test_status_of_stale_transmitting_reads_attempt_interrupted_live_reads_in_flight() -> None:
    rec = transmitting(2)
    dead = m.derive_status(rec, now=T0, lease_live=False, viewer=ALICE)
    live = m.derive_status(rec, now=T0, lease_live=True, viewer=ALICE)
    assert dead.attempts[-1].outcome == "interrupted" and dead.state == "interrupted"
    assert live.attempts[-1].outcome == "in_flight" and live.state == "running"
    assert dead.attempts[0].outcome == live.attempts[0].outcome == "failed"


def test_status_pending_cancel_command_reads_cancelled_only_without_live_owner() -> None:
    rec = record(phase="waiting", **spent(1))
    assert m.derive_status(rec, now=T0, lease_live=False, viewer=ALICE,
                           command="cancel").state == "cancelled"
    assert m.derive_status(rec, now=T0, lease_live=True, viewer=ALICE,
                           command="cancel").state == "running"


@pytest.mark.parametrize("viewer", [BOB, None, ALICE_OAUTH])
def test_status_is_redacted_for_another_account_or_signed_out(
    viewer: AccountBinding | None
) -> None:
    rec = record(phase="completed", completed_at=T0, job_id="secret-job", scope="s",
                 input_revision="r7", **spent(1),
                 last_failure=DISCONNECT)
    s = m.derive_status(rec, now=T0, lease_live=False, viewer=viewer)
    assert s.redacted and s.operation_id == OP
    assert s.blockers == frozenset({"account_mismatch"}) and s.availability == "blocked"
    assert not s.has_saved_completion and s.attempts == () and s.attempts_used == 0
    assert (s.job_id, s.scope, s.input_revision, s.model, s.last_failure) == (
        None, None, None, None, None
    )
    assert s.suggested_actions == ("sign_in",)


def test_status_blocked_by_endpoint_change_keeps_budget_visible() -> None:
    rec = record(phase="waiting", next_attempt_at=T0 - 1, **spent(1))
    s = m.derive_status(rec, now=T0, lease_live=False, viewer=ALICE, endpoint_id="endpoint-2")
    assert s.availability == "blocked"
    assert "configuration_unavailable" in s.blockers
    assert s.attempts_remaining == 2
    done = record(phase="completed", completed_at=T0, **spent(1))
    sd = m.derive_status(done, now=T0, lease_live=False, viewer=ALICE, endpoint_id="endpoint-2")
    assert sd.availability == "completion_saved"  # delivery is not blocked
    assert m.derive_status(rec, now=T0, lease_live=False, viewer=ALICE,
                           endpoint_id=EP).availability == "replacement_eligible"


def test_status_authentication_blocker_coexists_with_remaining_budget() -> None:
    rec = record(phase="failed", failure_reason="authentication_required", **spent(1))
    s = m.derive_status(rec, now=T0, lease_live=False, viewer=ALICE)
    assert "authentication_required" in s.blockers and s.attempts_remaining == 2


def test_status_reports_next_attempt_and_expiry_times() -> None:
    rec = record(phase="waiting", next_attempt_at=T0 + 30, expires_at=T0 + 90, **spent(1))
    s = m.derive_status(rec, now=T0, lease_live=False, viewer=ALICE)
    assert s.next_attempt_at is not None and s.next_attempt_at.timestamp() == T0 + 30
    assert s.expires_at is not None and s.expires_at.timestamp() == T0 + 90


# --- a lifecycle command observed together with a failure ----------------------------------
#
# A suspend observed at the same checkpoint as a failure must not bypass the failure table,
# the cooldown or a pending 401 reissue (regression: attempt_failed once applied the command
# before classifying, so resuming asked for a replacement of e.g. a quota/tool failure).


@pytest.mark.parametrize(
    "failure",
    [
        rejected(429, provider_type="insufficient_quota"),
        Interruption(kind="tool_activity"),
        Interruption(kind="disconnected", had_tool_activity=True),
        rejected(403),
        Interruption(kind="invalid_output"),
    ],
    ids=["quota", "tool activity", "tool activity seen", "403", "invalid output"],
)
def test_suspend_with_a_terminal_failure_never_makes_it_replaceable(
    failure: Interruption,
) -> None:
    t = m.attempt_failed(transmitting(1), _A1, failure, ctx(command="suspend"))
    assert isinstance(t.action, Stop)
    resumed = open_(t.record, ctx(T0 + 10**6))
    assert not isinstance(resumed.action, (AskHost, Transmit))
    stopped(resumed, errors.PermanentlyFailed)


@pytest.mark.parametrize(
    "failure,cooldown",
    [(rejected(429, retry_after=30.0), 30.0), (DISCONNECT, 10.0)],
    ids=["429 retry-after", "backoff"],
)
def test_suspend_with_an_eligible_failure_keeps_the_cooldown(
    failure: Interruption, cooldown: float
) -> None:
    rec = transmitting(1, retry_policy=RetryPolicy(initial_backoff=10.0))
    t = m.attempt_failed(rec, _A1, failure, ctx(command="suspend"))
    stopped(t, errors.OperationSuspended)
    assert t.record.phase == "suspended" and t.record.next_attempt_at == T0 + cooldown
    assert open_(t.record, ctx(T0 + 1)).action == WaitUntil(T0 + cooldown)


def test_suspend_with_a_401_keeps_the_authentication_reissue() -> None:
    t = m.attempt_failed(transmitting(1), _A1, rejected(401), ctx(command="suspend"))
    stopped(t, errors.OperationSuspended)
    assert asked(open_(t.record)).reason == "authentication_reissue"


@pytest.mark.parametrize("status", [403, 400])
def test_http_status_decides_a_rejection_even_with_a_rate_limit_code(status: int) -> None:
    # Found by the stateful model: a 403 must never be replaced automatically ("no blanket
    # refresh"); only 429 (or a configured retryable status) is a rate limit over HTTP.
    failure = rejected(status, provider_code="rate_limit_exceeded")
    assert m.classify(failure, RetryPolicy()) == "rejected"


# --- issue 11.7: an endpoint that cannot be connected to -------------------------------


def _asking() -> OperationRecord:
    t = open_(record())
    assert isinstance(t.action, AskHost)
    return t.record


def test_endpoint_unreachable_spends_nothing_and_keeps_the_pending_id() -> None:
    rec = _asking()
    pending = rec.pending
    t = m.endpoint_unreachable(rec, f"{OP}.1", "connect_refused")
    assert t.action is None and t.changed
    assert t.record.phase == "authorizing" and t.record.pending == pending
    assert t.record.attempts_used == 0 and t.record.attempts == ()
    assert t.record.endpoint_failure == "connect_refused"
    # Consuming the attempt (the connection was established) clears it.
    sent = m.authorization_answered(t.record, f"{OP}.1", True, ctx())
    assert isinstance(sent.action, m.Transmit)
    assert sent.record.endpoint_failure is None and sent.record.attempts_used == 1


def test_endpoint_given_up_ends_with_nothing_spent_and_the_same_attempt_next() -> None:
    """Issue 29.5: past the runtime's bound the execution ends (EndpointUnavailable); the
    record rests prepared with its pending attempt and the kind; reopening asks for the
    same attempt id; a standing suspend applies instead."""
    noted = m.endpoint_unreachable(_asking(), f"{OP}.1", "dns_failure").record
    t = m.endpoint_given_up(noted, f"{OP}.1", "dns_failure", 300.0, None)
    assert isinstance(t.action, m.Stop) and t.changed
    error = t.action.error
    assert isinstance(error, errors.EndpointUnavailable)
    assert (error.code, error.kind, error.unreachable_after, error.operation_id) == (
        "endpoint_unavailable", "dns_failure", 300.0, OP)
    assert "dns_failure" in str(error) and "300 s" in str(error)
    rec = t.record
    assert rec.phase == "prepared" and rec.pending == noted.pending
    assert rec.attempts_used == 0 and rec.attempts == () and rec.endpoint_failure == "dns_failure"
    status = m.derive_status(rec, now=T0, lease_live=False, viewer=ALICE)
    assert status.availability == "endpoint_unavailable" and status.attempts_remaining == 3
    reopened = open_(rec)
    assert isinstance(reopened.action, AskHost)
    assert reopened.action.attempt.attempt_id == f"{OP}.1"
    suspended = m.endpoint_given_up(noted, f"{OP}.1", "dns_failure", 300.0, "suspend")
    assert suspended.record.phase == "suspended" and suspended.record.pending == noted.pending
    assert isinstance(suspended.action, m.Stop)
    assert isinstance(suspended.action.error, errors.OperationSuspended)


def test_endpoint_unreachable_outside_authorizing_is_invalid() -> None:
    with pytest.raises(m.InvalidTransition):
        m.endpoint_unreachable(record(), f"{OP}.1", "connect_refused")
    with pytest.raises(m.InvalidTransition):
        m.endpoint_unreachable(_asking(), f"{OP}.2", "connect_refused")


@pytest.mark.parametrize(
    ("phase", "live", "state"),
    [("authorizing", True, "running"), ("authorizing", False, "interrupted"),
     ("suspended", False, "suspended"), ("prepared", False, "prepared")],
)
def test_status_reads_endpoint_unavailable_from_the_record(
    phase: str, live: bool, state: str
) -> None:
    rec = m.evolve(_asking(), phase=phase, endpoint_failure="dns_failure")
    s = m.derive_status(rec, now=T0, lease_live=live, viewer=ALICE)
    assert (s.state, s.availability) == (state, "endpoint_unavailable")
    assert s.endpoint_failure == "dns_failure" and "endpoint_unavailable" in s.blockers
    assert s.attempts_remaining == 3 and s.suggested_actions == ("wait", "resume", "abandon")


def test_status_endpoint_down_in_this_runtime_applies_to_a_live_authorizing_execution() -> None:
    rec = _asking()
    live = m.derive_status(rec, now=T0, lease_live=True, viewer=ALICE,
                           endpoint_down="connect_refused")
    assert live.availability == "endpoint_unavailable"
    idle = m.derive_status(record(), now=T0, lease_live=False, viewer=ALICE,
                           endpoint_down="connect_refused")
    assert idle.availability == "ready" and idle.endpoint_failure is None


def test_status_terminal_states_win_over_an_endpoint_failure() -> None:
    failed = m.evolve(record(), phase="failed", failure_reason="exhausted",
                      endpoint_failure="connect_refused")
    s = m.derive_status(failed, now=T0, lease_live=False, viewer=ALICE)
    assert s.availability == "exhausted" and s.endpoint_failure is None



def test_a_failed_standing_authorization_is_a_terminal_failure_with_nothing_spent() -> None:
    """A worker's policy that raised: saved as ``authorization_failed``, the pending
    attempt dropped, no budget spent; reopening raises the same typed error."""
    rec = _authorizing()
    attempt_id = rec.pending.attempt_id if rec.pending is not None else ""
    step = m.authorization_failed(rec, attempt_id, "it raised RuntimeError")
    failed = step.record
    assert (failed.phase, failed.failure_reason, failed.pending) == (
        "failed", "authorization_failed", None,
    )
    assert failed.attempts_used == rec.attempts_used
    assert isinstance(step.action, m.Stop)
    assert isinstance(step.action.error, errors.AuthorizationFailed)
    assert step.action.error.attempt_id == attempt_id
    assert isinstance(m.terminal_error(failed), errors.AuthorizationFailed)
    assert isinstance(m.ended_error(failed), errors.AuthorizationFailed)
