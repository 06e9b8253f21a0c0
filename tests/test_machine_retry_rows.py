"""The source-condition table of manual retry (``machine.check_retry_source``), every row.

The runtime tests (``tests/runtime/test_branches.py``, ``tests/runtime/test_retry.py``)
reach each row through real executions; this table pins the rows themselves, including
their order (the first matching row decides).
"""

from __future__ import annotations

from typing import Any

import pytest

from recoverable import errors
from recoverable import machine as m
from recoverable.records import AttemptRecord, OperationRecord
from recoverable.types import AccountBinding

T0 = 1_700_000_000.0
OP = "op-rows"
EP = "endpoint-1"


def record(used: int = 0, maximum: int = 3, **changes: Any) -> OperationRecord:
    attempts = tuple(
        AttemptRecord(attempt_id=m.attempt_id_for(OP, i), number=i,
                      reason="initial" if i == 1 else "replacement", consumed_at=T0 + i,
                      outcome="failed")
        for i in range(1, used + 1)
    )
    fields: dict[str, Any] = {
        "operation_id": OP, "account": AccountBinding("alice"), "endpoint_id": EP,
        "created_at": T0, "maximum_attempts": maximum, "model": "gpt-test",
        "format_name": "Answer", "format_hash": "fh", "body_hash": "bh",
        "root_operation_id": OP, "attempts": attempts, "attempts_used": used,
    }
    fields.update(changes)
    return OperationRecord(**fields)


REFUSED = "refused"
ALLOWED = "allowed"

ROWS: list[tuple[str, OperationRecord, str | None, str, str]] = [
    # (row, record, endpoint of this runtime, outcome, message fragment)
    ("permanently cancelled", record(1, phase="cancelled"), EP, REFUSED, "cancelled"),
    ("completion saved", record(1, phase="completed", completed_at=T0 + 5), EP, REFUSED,
     "receipt"),
    ("cancelled beats a saved completion",
     record(1, phase="cancelled", completed_at=T0 + 5), EP, REFUSED, "cancelled"),
    ("tool activity", record(1, phase="failed", failure_reason="tool_activity"), EP, REFUSED,
     "tool activity"),
    ("authentication required",
     record(1, phase="failed", failure_reason="authentication_required"), EP, REFUSED,
     "sign in"),
    ("failed: exhausted", record(3, phase="failed", failure_reason="exhausted"), EP, ALLOWED,
     ""),
    ("failed: quota", record(1, phase="failed", failure_reason="quota"), EP, ALLOWED, ""),
    ("failed: invalid output", record(1, phase="failed", failure_reason="invalid_output"), EP,
     ALLOWED, ""),
    ("suspended and exhausted", record(3, phase="suspended"), EP, ALLOWED, ""),
    ("interrupted and exhausted", record(3, phase="transmitting"), EP, ALLOWED, ""),
    ("expired permission", record(1, phase="waiting", expires_at=T0 - 1), EP, ALLOWED, ""),
    ("prepared for another endpoint", record(0, phase="prepared"), "other-endpoint", ALLOWED,
     ""),
    ("suspended, budget left", record(1, phase="suspended"), EP, REFUSED, "resume"),
    ("prepared, budget left", record(0, phase="prepared"), EP, REFUSED, "resume"),
    ("waiting, budget left", record(1, phase="waiting"), EP, REFUSED, "resume"),
    ("no endpoint known here: not a configuration block", record(0, phase="prepared"), None,
     REFUSED, "resume"),
]


@pytest.mark.parametrize(
    "rec,endpoint,outcome,fragment", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_retry_source_row(
    rec: OperationRecord, endpoint: str | None, outcome: str, fragment: str
) -> None:
    if outcome == ALLOWED:
        m.check_retry_source(rec, now=T0, endpoint_id=endpoint)
        return
    with pytest.raises(errors.RetryNotAllowed, match=fragment) as refused:
        m.check_retry_source(rec, now=T0, endpoint_id=endpoint)
    assert refused.value.operation_id == OP


def test_status_of_the_allowed_rows_suggests_manual_retry() -> None:
    """Every row that allows a retry shows ``manual_retry`` in its status."""
    for name, rec, endpoint, outcome, _ in ROWS:
        if outcome != ALLOWED:
            continue
        status = m.derive_status(rec, now=T0, lease_live=False, viewer=rec.account,
                                 endpoint_id=endpoint)
        assert "manual_retry" in status.suggested_actions, (name, status.availability)
