"""The machine's rule for a live operation (issue 16): an attempt that streamed output a
person may have seen is never replaced, whatever ended it. A transport interruption ends
any ``on_interruption="fail"`` operation (issue 14); for a live operation a replaceable
provider failure after output (a 5xx or 429 error event mid-stream, a retryable
``response.failed``) ends it too. Before any output, a live attempt is replaced as usual.
"""

from __future__ import annotations

from typing import Any

import pytest

from recoverable import errors
from recoverable import machine as m
from recoverable.outcome import Interruption
from recoverable.records import AttemptRecord, OperationRecord
from recoverable.types import AccountBinding, RetryPolicy

T0 = 1_700_000_000.0
OP = "op-live"
ALICE = AccountBinding("alice")


def in_flight(**changes: Any) -> OperationRecord:
    attempt = AttemptRecord(attempt_id=m.attempt_id_for(OP, 1), number=1, reason="initial",
                            consumed_at=T0 + 1)
    fields: dict[str, Any] = {
        "operation_id": OP, "account": ALICE, "endpoint_id": "ep", "created_at": T0,
        "maximum_attempts": 3, "model": "gpt-test", "format_name": "Answer",
        "format_hash": "fh", "body_hash": "bh", "root_operation_id": OP,
        "phase": "transmitting", "attempts": (attempt,), "attempts_used": 1,
        "retry_policy": RetryPolicy(retryable_provider_codes=("server_error",)),
    }
    fields.update(changes)
    return OperationRecord(**fields)


FAILURES = [
    Interruption(kind="http_rejected", http_status=500, had_output=True),
    Interruption(kind="http_rejected", http_status=429, had_output=True),
    Interruption(kind="provider_failed", provider_code="server_error", had_output=True),
]


def ended(record: OperationRecord, failure: Interruption) -> m.Transition:
    context = m.Context(now=T0 + 2, account=ALICE, credentials_account=None,
                        endpoint_id=None, command=None)
    return m.attempt_failed(record, m.attempt_id_for(OP, 1), failure, context)


@pytest.mark.parametrize("failure", FAILURES, ids=lambda f: f"{f.kind}-{f.http_status}")
def test_a_live_attempt_that_had_output_is_never_replaced(failure: Interruption) -> None:
    step = ended(in_flight(live=True, on_interruption="fail"), failure)
    assert step.record.phase == "failed" and step.record.failure_reason == "interrupted"
    assert isinstance(step.action, m.Stop)
    assert isinstance(step.action.error, errors.PermanentlyFailed)


@pytest.mark.parametrize("failure", FAILURES, ids=lambda f: f"{f.kind}-{f.http_status}")
def test_before_any_output_or_when_not_live_the_failure_table_decides(
    failure: Interruption,
) -> None:
    import msgspec

    silent = msgspec.structs.replace(failure, had_output=False)
    live = ended(in_flight(live=True, on_interruption="fail"), silent)
    assert live.record.phase == "waiting"  # replaced within the budget, as any operation
    for policy in ("fail", "replace"):  # not live: unchanged (issue 14's rule)
        plain = ended(in_flight(on_interruption=policy), failure)
        assert plain.record.phase == "waiting", policy
