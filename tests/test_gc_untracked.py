"""The persisted records and stream outcomes are never tracked by the cyclic GC (issue 20).

They are frozen values of scalars, strings and other such values (no reference cycle can
pass through them), declared ``gc=False``: thousands of them are alive in a busy runtime
and each tracked one is walked by every full collection. msgspec untracks a struct by
itself only when all its fields are scalars, so a record holding a nested struct or a
tuple (an attempt, the account, the retry policy) was tracked before.
"""

from __future__ import annotations

import gc

import msgspec
import pytest

from recoverable.failure_policy import RetryPolicy
from recoverable.outcome import Completed, Interruption, Progress, RateLimits, Usage
from recoverable.records import (
    AttemptRecord,
    CommandRecord,
    DispositionRecord,
    LeaseRecord,
    OperationRecord,
    PendingAttempt,
    RetryReservation,
)
from recoverable.storage import codec
from recoverable.types import AccountBinding, Attempt
from tests.storage.storage_helpers import ACCOUNT, make_op

USAGE = Usage(input_tokens=10, output_tokens=5)
LIMITS = RateLimits(remaining_requests=3)
FAILURE = Interruption(kind="disconnected", http_status=None, provider_code="x")
LIVE_FAILURE = Interruption(kind="incomplete", usage=USAGE, rate_limits=LIMITS)


def _record() -> OperationRecord:
    attempt = AttemptRecord(
        "att-1", 1, "initial", 1_700_000_001.0, outcome="failed", failure=FAILURE, usage=USAGE
    )
    return make_op(
        "op-1",
        phase="waiting",
        attempts=(attempt,),
        attempts_used=1,
        pending=PendingAttempt("att-2", 2, "replacement"),
        retry_reservation=RetryReservation("act", "op-2", "h"),
        last_failure=FAILURE,
    )


VALUES: list[msgspec.Struct] = [
    _record(),
    _record().attempts[0],
    _record().retry_reservation,  # type: ignore[list-item]
    CommandRecord(operation_id="op-1", kind="cancel", issued_at=1.0, serial=3),
    LeaseRecord(operation_id="op-1", owner_id="o", token="t", fence=2, acquired_at=1.0),
    DispositionRecord(
        operation_id="op-1", disposition="acknowledged", at=1.0, account=ACCOUNT, usage=USAGE
    ),
    FAILURE,
    LIVE_FAILURE,
    Completed(text="{}", usage=USAGE, rate_limits=LIMITS),
    Progress(response_id="resp_1", sequence_number=4, had_output=True),
    Attempt(
        operation_id="op-1",
        attempt_id="att-2",
        number=2,
        maximum_attempts=3,
        reason="replacement",
        previous_failure=FAILURE,
    ),
    AccountBinding("acct-1", "api-key"),
    RetryPolicy(retryable_provider_codes=frozenset({"a"})),
    USAGE,
    LIMITS,
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_value_structs_are_untracked(value: msgspec.Struct) -> None:
    assert not gc.is_tracked(value)


@pytest.mark.parametrize("decode", [codec.decode_operation, codec.decode_disposition])
def test_decoded_records_are_untracked(decode: object) -> None:
    """What the store hands out (decoded from LMDB bytes) is untracked too, nested parts
    included."""
    source: msgspec.Struct = _record() if decode is codec.decode_operation else VALUES[5]
    decoded = decode(codec.encode(source))  # type: ignore[operator]
    assert decoded == source
    assert not gc.is_tracked(decoded)
    if isinstance(decoded, OperationRecord):
        parts = (decoded.attempts[0], decoded.account, decoded.retry_policy,
                 decoded.last_failure, decoded.pending)
        assert not any(gc.is_tracked(part) for part in parts)
