"""The runtime's reads that need no runtime state: a record by id, a disposition marker's
status, and a saved receipt. Each checks the viewer's account binding; none generates,
renews or takes a lease (``actors/runtime.py`` forwards to them).
"""

from __future__ import annotations

from recoverable import errors, machine
from recoverable.actors.checks import require_owner
from recoverable.outcome import Usage
from recoverable.records import DispositionRecord, OperationRecord
from recoverable.sources_rules import superseded_error
from recoverable.storage.base import Store
from recoverable.storage.migration import saved_completion
from recoverable.telemetry import Telemetry
from recoverable.types import AccountBinding, Receipt, Status, to_datetime

__all__ = ["disposition_status", "read_record", "saved_receipt"]


def read_record(store: Store, operation_id: str) -> OperationRecord:
    """The operation's record, or ``StateUnavailable`` saying why there is none."""
    record = store.get_operation(operation_id)
    if record is None:
        disposition = store.get_disposition(operation_id)
        if disposition is not None:
            raise errors.StateUnavailable(
                f"operation is {disposition.disposition}", operation_id=operation_id
            )
        raise errors.StateUnavailable("no such operation", operation_id=operation_id)
    return record


def disposition_status(viewer: AccountBinding | None, marker: DispositionRecord) -> Status:
    """The status of an acknowledged or abandoned operation (redacted for another account)."""
    try:
        require_owner(viewer, marker.account, marker.operation_id)
    except errors.AccountChanged:
        return machine.redacted_status(marker.operation_id)
    return Status(
        operation_id=marker.operation_id,
        state=marker.disposition,
        availability=marker.disposition,
        attempts_used=marker.attempts_used,
        maximum_attempts=marker.maximum_attempts,
        root_operation_id=marker.root_operation_id,
        previous_operation_id=marker.previous_operation_id,
        job_id=marker.job_id,
        input_revision=marker.input_revision,
        scope=marker.scope,
        usage=marker.usage or Usage(),
    )


def saved_receipt(
    store: Store, viewer: AccountBinding | None, telemetry: Telemetry, operation_id: str
) -> Receipt:
    """The saved, validated completion of the viewer's operation, or a typed error."""
    record = read_record(store, operation_id)
    require_owner(viewer, record.account, record.operation_id)
    if record.phase == "superseded":  # no result of it may count
        raise superseded_error(record)
    command = store.get_command(record.operation_id)
    if machine.cancel_fences(record, command.kind if command is not None else None):
        raise errors.OperationCancelled(operation_id=record.operation_id)
    # A version-1 record that was never upgraded keeps its completion inline: it is
    # read from there (no backend, no lease, no write).
    payload = saved_completion(store, record) if record.has_completion else None
    if not record.has_completion or payload is None or record.completed_at is None:
        raise errors.CompletionUnavailable("no saved completion", operation_id=record.operation_id)
    last = record.attempts[-1] if record.attempts else None
    completed_at = to_datetime(record.completed_at)
    assert completed_at is not None
    telemetry.emit("receipt.retrieved", record.operation_id)
    return Receipt(
        operation_id=record.operation_id,
        payload=payload,
        format_name=record.format_name,
        format_hash=record.format_hash,
        contract_version=record.contract_version,
        job_id=record.job_id,
        input_revision=record.input_revision,
        scope=record.scope,
        completed_at=completed_at,
        root_operation_id=record.root_operation_id,
        previous_operation_id=record.previous_operation_id,
        response_id=last.response_id if last else None,
        account=record.account,
        usage=record.usage,
        reattached=last is not None and last.reattached,
        reattachments=record.reattachments,
    )
