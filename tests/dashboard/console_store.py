"""A store for the console's tests, written through the store's own API (real records,
real payloads, one write transaction): LMDB directory or PostgreSQL URL alike.

``fill(spec)`` writes, all of ``ACCOUNT`` unless said otherwise:

- ``server_error``: 3 failed operations (HTTP 500, provider code ``server_error``), model
  ``gpt-a``; their last attempt at ``EARLY`` (1) or ``LATE`` (2);
- ``rate_limited``: 2 failed (HTTP 429, ``rate_limit_exceeded``), model ``gpt-a``, at LATE;
- ``invalid``: 1 failed (``invalid_output``, no code), model ``gpt-b``, at LATE;
- ``prepared``: 4 prepared (model ``gpt-b``, jobs ``batch-p-0..3``);
- ``completed``: 2 with a saved, validated completion (model ``gpt-b``);
- ``other``: 1 failed with ``server_error`` at LATE, of ``OTHER`` (another account).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

import recoverable
from recoverable.body import body_hash, freeze_body
from recoverable.contract import contract_for
from recoverable.records import AttemptRecord, OperationRecord, StoredRequest

from .helpers import ACCOUNT, OTHER

EARLY = 1_796_112_000.0  # 2026-12-01T08:00:00Z
LATE = 1_796_121_000.0  # 2026-12-01T10:30:00Z
CUTOFF = "2026-12-01T10:00Z"  # between the two


class Answer(msgspec.Struct, frozen=True):
    label: str


def _record(op_id: str, account: recoverable.AccountBinding, model: str, created: float,
            job: str, **extra: Any) -> tuple[OperationRecord, bytes, bytes, bytes | None]:
    contract = contract_for(Answer)
    request = recoverable.StructuredRequest(model=model, input=f"question {op_id}")
    body = freeze_body(request, contract)
    stored = msgspec.json.encode(
        StoredRequest(request=request, format_name=contract.name, schema=contract.schema))
    completion = extra.pop("completion", None)
    record = OperationRecord(
        operation_id=op_id, account=account, endpoint_id="fixture", created_at=created,
        maximum_attempts=extra.pop("maximum_attempts", 1), model=model,
        format_name=contract.name, format_hash=contract.format_hash, scope="batch",
        job_id=job, input_revision="r1", body_hash=body_hash(body),
        root_operation_id=extra.pop("root_operation_id", op_id),
        **extra,
    )
    return record, body, stored, completion


def _failed(op_id: str, account: recoverable.AccountBinding, model: str, at: float,
            failure: recoverable.Interruption, job: str) -> Any:
    return _record(
        op_id, account, model, at - 60, job, phase="failed", failure_reason="exhausted",
        attempts_used=1, last_failure=failure,
        attempts=(AttemptRecord(f"{op_id}.1", 1, "initial", at, "failed", failure=failure),),
    )


def save(spec: str, members: list[Any], also: Callable[[Any], None] | None = None) -> None:
    """Write each member ``(record, body, stored request, completion or None)`` with its
    payloads, and then ``also`` (more rows), in one commit, into the store at ``spec``."""

    def write(txn: Any) -> None:
        for record, body, stored, completion in members:
            txn.put_payload(record.operation_id, "body", body)
            txn.put_payload(record.operation_id, "request", stored)
            if completion is not None:
                txn.put_payload(record.operation_id, "completion", completion)
            txn.put_operation(record)
        if also is not None:
            also(txn)

    store = recoverable.RecoveryStore.open(spec)
    try:
        store.write_sync(write)
    finally:
        store.close()


def fill(spec: str) -> dict[str, list[str]]:
    """Write the operations above into the store at ``spec``; return their ids by group."""
    server = recoverable.Interruption(kind="http_rejected", http_status=500,
                                      provider_code="server_error")
    limited = recoverable.Interruption(kind="http_rejected", http_status=429,
                                       provider_code="rate_limit_exceeded")
    invalid = recoverable.Interruption(kind="invalid_output", output_path="/label")
    groups: dict[str, list[Any]] = {
        "server_error": [
            _failed(f"op-se-{index}", ACCOUNT, "gpt-a", EARLY if index == 0 else LATE,
                    server, f"batch-se-{index}") for index in range(3)],
        "rate_limited": [
            _failed(f"op-rl-{index}", ACCOUNT, "gpt-a", LATE, limited, f"batch-rl-{index}")
            for index in range(2)],
        "invalid": [_failed("op-inv-0", ACCOUNT, "gpt-b", LATE, invalid, "batch-inv-0")],
        "prepared": [
            _record(f"op-p-{index}", ACCOUNT, "gpt-b", LATE + index, f"batch-p-{index}",
                    maximum_attempts=3) for index in range(4)],
        "completed": [
            _record(f"op-c-{index}", ACCOUNT, "gpt-b", LATE, f"batch-c-{index}",
                    phase="completed", attempts_used=1, completed_at=LATE + 5,
                    completion=msgspec.json.encode(Answer(label="ok")),
                    attempts=(AttemptRecord(f"op-c-{index}.1", 1, "initial", LATE,
                                            "completed", response_id=f"resp_{index}"),))
            for index in range(2)],
        "other": [_failed("op-other-0", OTHER, "gpt-a", LATE, server, "batch-other-0")],
    }

    save(spec, [member for members in groups.values() for member in members])
    return {name: [member[0].operation_id for member in members]
            for name, members in groups.items()}
