"""Version-1 operation records ("alpha.30"): read them, and upgrade them conservatively.

Version 1 stored the request's parts (model, instructions, input, schema) but
NOT the canonical wire body, and kept a validated completion inline as JSON
text. It used msgpack with these fields::

    version=1, operation_id, account_id, account_source, created_at,
    status ("pending" | "running" | "completed" | "cancelled" | "failed"),
    maximum_attempts, consumed_attempts, pending_attempt_id, model,
    reasoning_effort, instructions, input, schema_name, schema, completion,
    completed_at, contract_version, job_id, input_revision, scope

The upgrade keeps ids, consumed attempts (never refunded), saved completions and
permanent cancellation. It is conservative where version 1 was uncertain: a
"running" record's consumed attempts are all treated as spent and interrupted,
and the canonical body is frozen once from the saved parts (marked
``upgraded_from=1``). Other versions are never interpreted.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgspec

from recoverable import errors
from recoverable.outcome import Interruption
from recoverable.records import (
    AttemptRecord,
    OperationRecord,
    PayloadKind,
    PendingAttempt,
    StoredRequest,
)
from recoverable.storage import codec
from recoverable.storage.base import RecordReader, Store, WriteTransaction
from recoverable.storage.keys import operation_key
from recoverable.types import AccountBinding, JsonSchema, StructuredRequest

V1_STATUS = Literal["pending", "running", "completed", "cancelled", "failed"]


class OperationRecordV1(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    version: int
    operation_id: str
    account_id: str
    account_source: str
    created_at: float
    status: V1_STATUS
    maximum_attempts: int
    consumed_attempts: int
    pending_attempt_id: str | None = None
    model: str
    reasoning_effort: str | None = None
    instructions: str | None = None
    input: str | list[dict[str, Any]]
    schema_name: str
    schema: dict[str, Any]
    completion: str | None = None
    completed_at: float | None = None
    contract_version: str | None = None
    job_id: str | None = None
    input_revision: str | None = None
    scope: str | None = None


_decoder = msgspec.msgpack.Decoder(OperationRecordV1)
V1_ENDPOINT = "version-1"  # v1 did not record an endpoint identity


def _format_hash(name: str, schema: dict[str, Any]) -> str:
    canonical = msgspec.json.encode({"name": name, "schema": schema, "strict": True},
                                    order="sorted")
    return hashlib.sha256(canonical).hexdigest()


def decode_v1(data: bytes) -> OperationRecordV1:
    old = _decoder.decode(data)
    if old.version != 1:
        raise ValueError("not a version-1 record")
    if not 1 <= old.maximum_attempts <= 1000 or not 0 <= old.consumed_attempts:
        raise ValueError("version-1 budget out of range")
    return old


def upgrade_record(old: OperationRecordV1, *, endpoint_id: str = V1_ENDPOINT) -> OperationRecord:
    """The current record for a version-1 one (no I/O; payloads are separate)."""
    op = old.operation_id
    used = min(old.consumed_attempts, old.maximum_attempts)
    interrupted = Interruption(kind="interrupted", transport_code="upgraded_from_v1")
    attempts = tuple(
        AttemptRecord(
            attempt_id=f"{op}.{number}",
            number=number,
            reason="initial" if number == 1 else "replacement",
            consumed_at=old.created_at,
            outcome=(
                "completed" if (old.status == "completed" and number == used) else "interrupted"
            ),
            failure=None if (old.status == "completed" and number == used) else interrupted,
        )
        for number in range(1, used + 1)
    )
    phase: Any
    failure_reason: Any = None
    pending = None
    if old.status == "cancelled":
        phase = "cancelled"
    elif old.status == "completed" and old.completion is not None:
        phase = "completed"
    elif old.status == "failed" or used >= old.maximum_attempts:
        phase, failure_reason = "failed", "exhausted" if used >= old.maximum_attempts else (
            "provider_failed"
        )
    else:
        phase = "waiting" if used else "prepared"
        if old.pending_attempt_id is not None:
            pending = PendingAttempt(
                old.pending_attempt_id, used + 1, "initial" if used == 0 else "replacement"
            )
    return OperationRecord(
        operation_id=op,
        account=AccountBinding(old.account_id, old.account_source),
        endpoint_id=endpoint_id,
        created_at=old.created_at,
        phase=phase,
        maximum_attempts=old.maximum_attempts,
        attempts_used=used,
        attempts=attempts,
        pending=pending,
        model=old.model,
        reasoning_effort=old.reasoning_effort,
        format_name=old.schema_name,
        format_hash=_format_hash(old.schema_name, old.schema),
        contract_version=old.contract_version,
        scope=old.scope,
        job_id=old.job_id,
        input_revision=old.input_revision,
        body_hash="",
        root_operation_id=op,
        last_failure=interrupted if old.status == "running" else None,
        failure_reason=failure_reason,
        completed_at=(old.completed_at or old.created_at) if phase == "completed" else None,
        upgraded_from=1,
    )


def v1_completion(raw: bytes) -> bytes | None:
    """The inline completion of version-1 bytes (``None`` if it has none or is unreadable)."""
    try:
        old = decode_v1(raw)
    except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    if old.status != "completed" or old.completion is None:
        return None
    return old.completion.encode()


def saved_completion(reader: RecordReader, record: OperationRecord) -> bytes | None:
    """The saved completion of ``record``, whatever its record version.

    ``reader`` is a store or a write transaction (``get_payload``/``get_raw``).
    A version-1 record that was never rewritten keeps its completion inline:
    it is read from the stored bytes, with no backend, no lease and no write.
    """
    op_id = record.operation_id
    payload: bytes | None = reader.get_payload(op_id, "completion")
    if payload is not None or not record.awaiting_upgrade:
        return payload
    raw: bytes | None = reader.get_raw("operations", operation_key(op_id))
    if raw is None:
        return None
    if codec.read_version(raw) != 1:  # upgraded meanwhile by another execution
        upgraded: bytes | None = reader.get_payload(op_id, "completion")
        return upgraded
    return v1_completion(raw)


def _read_v1(data: bytes) -> OperationRecord:
    return upgrade_record(decode_v1(data))


codec.register_operation_upgrader(1, _read_v1)


def plan_upgrade(
    raw: bytes, *, endpoint_id: str
) -> tuple[OperationRecord, dict[PayloadKind, bytes]]:
    """The current record and payloads for version-1 bytes (raises if it cannot be frozen)."""
    from recoverable.body import body_hash, freeze_body
    from recoverable.contract import contract_for

    old = decode_v1(raw)
    contract = contract_for(JsonSchema(old.schema_name, old.schema))
    request = StructuredRequest(
        model=old.model, instructions=old.instructions, input=old.input,
        reasoning_effort=old.reasoning_effort,
    )
    body = freeze_body(request, contract)
    new = msgspec.structs.replace(
        upgrade_record(old, endpoint_id=endpoint_id), body_hash=body_hash(body)
    )
    payloads: dict[PayloadKind, bytes] = {
        "body": body,
        "request": msgspec.json.encode(
            StoredRequest(request=request, format_name=contract.name, schema=contract.schema)
        ),
    }
    if old.completion is not None and new.phase == "completed":
        payloads["completion"] = old.completion.encode()
    return new, payloads


async def upgrade_operation(store: Store, operation_id: str, *, endpoint_id: str) -> bool:
    """Rewrite one version-1 record (and its payloads) as current, in one transaction.

    Called lazily when a version-1 operation is reopened for sending. A record
    whose body cannot be frozen is left untouched (still readable).
    """
    raw = store.get_raw("operations", operation_key(operation_id))
    if raw is None or codec.read_version(raw) != 1:
        return False
    try:
        new, payloads = plan_upgrade(raw, endpoint_id=endpoint_id)
    except (errors.RecoveryError, ValueError, msgspec.DecodeError, msgspec.ValidationError):
        return False

    def write(txn: WriteTransaction) -> bool:
        if txn.get_raw("operations", operation_key(operation_id)) != raw:
            return False  # changed meanwhile
        for kind, data in payloads.items():
            txn.put_payload(operation_id, kind, data)
        txn.put_operation(new)
        return True

    result: bool = await store.write(write)
    return result
