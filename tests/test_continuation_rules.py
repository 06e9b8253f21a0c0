"""Issue 18: the pure continuation rules (``recoverable.continuation``): eligibility from
the typed failure chain only, the budget, the due time and every invalidation."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from recoverable import continuation as cont
from recoverable import machine as m
from recoverable.outcome import Interruption
from recoverable.records import AttemptRecord, ContinuationRecord, OperationRecord, RetryReservation
from recoverable.types import AccountBinding

T0 = 1_700_000_000.0
OP = "op-cont"

DROP = Interruption(kind="disconnected", transport_code="ws_close_1006")
EOF_ = Interruption(kind="premature_eof", transport_code="done_sentinel")
IDLE = Interruption(kind="timeout", transport_code="idle_timeout")
CONNECT_TIMEOUT = Interruption(kind="timeout", transport_code="connect_timeout")
STREAM_EVENT = Interruption(kind="provider_failed", provider_code="stream_error")
OTHER = Interruption(kind="provider_failed", provider_code="other")
NO_CODE = Interruption(kind="provider_failed")
OVERLOADED = Interruption(kind="provider_failed", provider_code="server_is_overloaded")
POLICY = Interruption(kind="provider_failed", provider_code="cyber_policy")
CONTEXT = Interruption(kind="http_rejected", http_status=400,
                       provider_code="context_length_exceeded")
RATE = Interruption(kind="http_rejected", http_status=429, provider_code="rate_limit_exceeded")
HTTP_500 = Interruption(kind="http_rejected", http_status=500)
CRASH = Interruption(kind="interrupted", transport_code="owner_lost")
MALFORMED = Interruption(kind="malformed", transport_code="invalid_json")


def failed(*failures: Interruption | None, reason: str = "exhausted", **changes: Any
           ) -> OperationRecord:
    attempts = tuple(
        AttemptRecord(attempt_id=m.attempt_id_for(OP, number), number=number,
                      reason="initial" if number == 1 else "replacement",
                      consumed_at=T0 + number, outcome="failed", failure=failure)
        for number, failure in enumerate(failures, 1)
    )
    fields: dict[str, Any] = {
        "operation_id": OP, "account": AccountBinding("alice"), "endpoint_id": "ep",
        "created_at": T0, "maximum_attempts": len(failures), "model": "gpt-test",
        "format_name": "Answer", "format_hash": "fh", "body_hash": "bh",
        "root_operation_id": OP, "attempts": attempts, "attempts_used": len(failures),
        "phase": "failed", "failure_reason": reason,
        "last_failure": failures[-1] if failures else None,
    }
    fields.update(changes)
    return OperationRecord(**fields)


@pytest.mark.parametrize(("record", "expected"), [
    (failed(DROP, DROP, DROP), "stream_failures_exhausted"),
    (failed(DROP, EOF_, IDLE), "stream_failures_exhausted"),
    (failed(STREAM_EVENT, DROP, STREAM_EVENT), "stream_failures_exhausted"),
    # The seed's chain: stream failures, then an uninformative final code.
    (failed(DROP, DROP, OTHER, reason="provider_failed"), "stream_failures_then_generic"),
    (failed(DROP, NO_CODE, reason="provider_failed"), "stream_failures_then_generic"),
    (failed(DROP, STREAM_EVENT, reason="provider_failed"), "stream_failures_then_generic"),
    # A generic final code alone is no evidence (an unrelated unknown failure).
    (failed(OTHER, reason="provider_failed"), "no_evidence"),
    (failed(NO_CODE, reason="provider_failed"), "no_evidence"),
    # Missing evidence: no attempt history, an attempt without its failure, a v1 record.
    (failed(reason="exhausted"), "no_evidence"),
    (failed(DROP, None, DROP), "no_evidence"),
    (failed(DROP, DROP, upgraded_from=1), "no_evidence"),
    # A changed failure anywhere in the chain.
    (failed(HTTP_500, DROP, DROP), "changed_failure"),
    (failed(DROP, CRASH, DROP), "changed_failure"),
    (failed(DROP, MALFORMED), "changed_failure"),
    (failed(DROP, CONNECT_TIMEOUT), "changed_failure"),
    (failed(DROP, CRASH), "changed_failure"),
    # Never continued: policy, overload, context, rate limit, and the excluded reasons.
    (failed(DROP, POLICY, reason="provider_failed"), "excluded_failure"),
    (failed(DROP, OVERLOADED, reason="provider_failed"), "excluded_failure"),
    (failed(DROP, Interruption(kind="http_rejected", http_status=503,
                               provider_code="server_is_overloaded"), reason="exhausted"),
     "excluded_failure"),
    (failed(DROP, CONTEXT, reason="rejected"), "excluded_failure"),
    (failed(DROP, RATE, reason="exhausted"), "excluded_failure"),
    (failed(DROP, reason="quota"), "excluded_failure"),
    (failed(DROP, reason="authentication_required"), "excluded_failure"),
    (failed(DROP, reason="invalid_output"), "excluded_failure"),
    (failed(DROP, reason="incomplete"), "excluded_failure"),
    (failed(DROP, reason="tool_activity"), "excluded_failure"),
    (failed(DROP, reason="token_budget_exhausted"), "excluded_failure"),
    (failed(DROP, reason="interrupted"), "excluded_failure"),
    (failed(DROP, reason="owner_lost"), "excluded_failure"),
    (failed(DROP, reason="no_worker"), "excluded_failure"),
    (failed(DROP, phase="completed", failure_reason=None, completed_at=T0), "not_failed"),
    (failed(DROP, phase="suspended", failure_reason=None), "not_failed"),
])
def test_eligibility_reads_the_typed_chain_only(record: OperationRecord, expected: str) -> None:
    assert cont.eligibility(record) == expected


def test_message_text_never_matters() -> None:
    """Interruptions carry no message text at all: a disconnect-looking code in a field
    that is not a stream code (an HTTP 500's code) does not qualify."""
    disguised = Interruption(kind="http_rejected", http_status=500,
                             provider_code="response_stream_disconnected")
    assert cont.eligibility(failed(DROP, disguised)) == "changed_failure"
    assert not cont.is_stream_failure(disguised)


def test_the_chain_is_bounded_to_the_last_attempts() -> None:
    old_noise = (HTTP_500,) * 3
    chain = old_noise + (DROP,) * cont.MAX_FAILURE_CHAIN
    record = failed(*chain)
    assert len(cont.failure_chain(record)) == cont.MAX_FAILURE_CHAIN
    assert cont.eligibility(record) == "stream_failures_exhausted"


def test_decide_records_pending_with_a_due_time_once() -> None:
    record = failed(DROP, DROP)
    decided = cont.decide(record, now=T0, delay=30.0, budget=2)
    assert decided.continuation == ContinuationRecord(
        state="pending", reason="stream_failures_exhausted", decided_at=T0, due_at=T0 + 30.0,
        budget=2,
    )
    # A duplicate terminal event decides nothing new.
    assert cont.decide(decided, now=T0 + 5, delay=1.0, budget=2) is decided


@pytest.mark.parametrize(("record", "budget", "reason"), [
    (failed(DROP, DROP, continuations_used=2), 2, "budget_spent"),
    (failed(DROP, DROP), 0, "budget_spent"),
    (failed(DROP, DROP, expires_at=T0 + 10), 2, "expired"),
    (failed(POLICY, reason="provider_failed"), 2, "excluded_failure"),
])
def test_decide_declines_with_the_reason(record: OperationRecord, budget: int,
                                         reason: str) -> None:
    decided = cont.decide(record, now=T0, delay=30.0, budget=budget)
    assert decided.continuation is not None
    assert (decided.continuation.state, decided.continuation.reason) == ("declined", reason)
    assert decided.continuation.due_at is None


PENDING = cont.decide(failed(DROP, DROP, job_id="j", input_revision="1"), now=T0, delay=0.0,
                      budget=2)
CHECK: dict[str, Any] = {"enabled": True, "budget": 2, "now": T0, "command": None,
                         "lease_live": False, "newer_revision": False, "newer_turn": False}


@pytest.mark.parametrize(("record", "changes", "reason"), [
    (PENDING, {}, None),
    (msgspec.structs.replace(PENDING, phase="cancelled"), {}, "cancelled"),
    (msgspec.structs.replace(PENDING, phase="suspended"), {}, "suspended"),
    (PENDING, {"command": "cancel"}, "cancelled"),
    (PENDING, {"command": "suspend"}, "suspended"),
    (PENDING, {"enabled": False}, "disabled"),
    (msgspec.structs.replace(PENDING, retry_reservation=RetryReservation(
        retry_action_id="user-click", successor_id="op_x", settings_hash="h")), {},
     "manual_retry"),
    (PENDING, {"newer_revision": True}, "newer_revision"),
    (PENDING, {"newer_turn": True}, "newer_turn"),
    (PENDING, {"lease_live": True}, "lease_live"),
    (PENDING, {"budget": 0}, "budget_spent"),
    (msgspec.structs.replace(PENDING, expires_at=T0), {}, "expired"),
])
def test_invalidation_before_dispatch(record: OperationRecord, changes: dict[str, Any],
                                      reason: str | None) -> None:
    assert cont.invalidation(record, **{**CHECK, **changes}) == reason


def test_cancelled_and_dispatched_edit_only_a_pending_continuation() -> None:
    stopped = cont.cancelled(PENDING, "disabled", T0 + 1)
    assert stopped.continuation is not None
    assert (stopped.continuation.state, stopped.continuation.reason) == ("cancelled", "disabled")
    assert cont.cancelled(stopped, "suspended", T0 + 2) is stopped  # no longer pending
    sent = cont.dispatched(PENDING, "op_next", T0 + 3)
    assert sent.continuation is not None
    assert (sent.continuation.state, sent.continuation.successor_id) == ("dispatched", "op_next")
    assert not cont.is_pending(sent)


def test_records_written_before_issue_18_decode_without_a_continuation() -> None:
    """Existing stores: a record saved before the fields existed reads as 'none decided,
    none used, not committed' — and its failure chain still decides (typed attempts)."""
    from pathlib import Path

    from recoverable.storage import codec

    data = Path(__file__).resolve().parent / "data" / "version2_before_usage.hex"
    rows = [line.split() for line in data.read_text().splitlines()
            if line and not line.startswith("#")]
    assert rows
    for operation_id, hexed in rows:
        raw = bytes.fromhex(hexed)
        assert b"continuation" not in raw
        record = codec.decode_operation(raw, operation_id=operation_id)
        assert (record.continuation, record.continuations_used, record.thread_committed) == (
            None, 0, False)
        again = codec.decode_operation(codec.encode(record), operation_id=operation_id)
        assert again == record


def test_an_unreadable_preference_reads_as_off() -> None:
    from recoverable import errors
    from recoverable.storage.preferences import CONTINUATION_KEY, read_continuation

    class Rows:
        def __init__(self, raw: bytes | None) -> None:
            self.raw = raw

        def get_raw(self, table: object, key: bytes) -> bytes | None:
            assert (table, key) == ("meta", CONTINUATION_KEY)
            return self.raw

    assert read_continuation(Rows(None)).enabled is False  # an existing store: no row
    assert read_continuation(Rows(b"\xc1garbage")).enabled is False
    with pytest.raises(errors.CorruptRecord):
        read_continuation(Rows(b"\xc1garbage"), strict=True)


HARD_TIMEOUT = Interruption(kind="timeout", transport_code="hard_timeout")


@pytest.mark.parametrize("record", [
    failed(HARD_TIMEOUT, HARD_TIMEOUT),
    failed(DROP, HARD_TIMEOUT),
    failed(HARD_TIMEOUT, DROP),
], ids=["all", "last", "first"])
def test_the_hosts_own_hard_timeout_is_never_continued(record: OperationRecord) -> None:
    """Issue 16's hard ``attempt_timeout`` (a source-bound operation always has one) is an
    elapsed-time bound the host set, not the stream failing (criterion 3 lists
    disconnects, premature EOF, idle timeouts and stream error events): a successor has
    the same bound and would be cut again, spending the continuation budget for nothing."""
    assert not cont.is_stream_failure(HARD_TIMEOUT)
    assert cont.eligibility(record) == "excluded_failure"


# -- issue 29.14: a policy named by error.type, and a word nobody can read ----------------

POLICY_TYPE = Interruption(kind="provider_failed", provider_type="cyber_policy",
                           provider_code="other")
MISALIGNED_TYPE = Interruption(kind="provider_failed", provider_type="misalignment_error")
SAFETY_TYPE_STREAM = Interruption(kind="provider_failed", provider_type="safety.block",
                                  provider_code="stream_error")
CONTENT_POLICY_CODE = Interruption(kind="provider_failed", provider_code="Content-Policy-Hit")
RATE_TYPE = Interruption(kind="provider_failed", provider_type="rate_limit_exceeded",
                         provider_code="other")
# A code with spaces or over 64 characters is kept as "unrecognized" (outcome.bounded_code).
SPACED_CODE = Interruption(kind="provider_failed", provider_code="cyber policy violation")
LONG_CODE = Interruption(kind="provider_failed", provider_code="x" * 65)
SPACED_TYPE = Interruption(kind="provider_failed", provider_type="a policy stop",
                           provider_code="other")
STREAM_UNREADABLE_TYPE = Interruption(kind="provider_failed", provider_code="stream_error",
                                      provider_type="the stream was stopped by a check")
INFORMATIVE_TYPE = Interruption(kind="provider_failed", provider_type="invalid_request_error",
                                provider_code="other")
STREAM_TYPE = Interruption(kind="provider_failed", provider_type="stream_error",
                           provider_code="other")


def test_the_bounded_words_are_what_the_rule_reads() -> None:
    assert SPACED_CODE.provider_code == LONG_CODE.provider_code == "unrecognized"
    assert SPACED_TYPE.provider_type == "unrecognized"
    assert POLICY_TYPE.provider_key == "other"  # the code hides the type from provider_key


@pytest.mark.parametrize(("record", "expected"), [
    # A policy, misalignment or safety word in the error.type (or the code) is excluded,
    # whatever the code says and whatever came before it.
    (failed(DROP, DROP, POLICY_TYPE, reason="provider_failed"), "excluded_failure"),
    (failed(DROP, MISALIGNED_TYPE, reason="provider_failed"), "excluded_failure"),
    (failed(DROP, SAFETY_TYPE_STREAM, reason="provider_failed"), "excluded_failure"),
    (failed(SAFETY_TYPE_STREAM, DROP), "excluded_failure"),
    (failed(DROP, CONTENT_POLICY_CODE, reason="provider_failed"), "excluded_failure"),
    (failed(DROP, RATE_TYPE, reason="provider_failed"), "excluded_failure"),
    # A word nobody can read is no evidence, even after confirmed stream failures.
    (failed(DROP, DROP, SPACED_CODE, reason="provider_failed"), "no_evidence"),
    (failed(DROP, LONG_CODE, reason="provider_failed"), "no_evidence"),
    (failed(DROP, SPACED_TYPE, reason="provider_failed"), "no_evidence"),
    (failed(DROP, STREAM_UNREADABLE_TYPE, reason="provider_failed"), "no_evidence"),
    (failed(STREAM_UNREADABLE_TYPE, DROP), "no_evidence"),
    (failed(SPACED_CODE, reason="provider_failed"), "no_evidence"),
    # A generic code with an informative (non-policy) type is not generic.
    (failed(DROP, INFORMATIVE_TYPE, reason="provider_failed"), "excluded_failure"),
    # ... while a stream word in the type keeps the generic final code continued.
    (failed(DROP, STREAM_TYPE, reason="provider_failed"), "stream_failures_then_generic"),
])
def test_exclusions_read_the_error_type_and_unrecognized_is_no_evidence(
    record: OperationRecord, expected: str
) -> None:
    assert cont.eligibility(record) == expected
    decided = cont.decide(record, now=T0, delay=0.0, budget=2)
    assert decided.continuation is not None
    assert (decided.continuation.state == "pending") == (expected in cont.ELIGIBLE)


@pytest.mark.parametrize("word", [
    "cyber_policy", "content_policy_violation", "CONTENT-POLICY", "misalignment",
    "safety", "moderation_blocked", "contentFilter", "guardrail_triggered",
])
def test_policy_words(word: str) -> None:
    assert cont.names_policy(word)


@pytest.mark.parametrize("word", ["other", "stream_error", "server_error", "timeout"])
def test_not_policy_words(word: str) -> None:
    assert not cont.names_policy(word)
