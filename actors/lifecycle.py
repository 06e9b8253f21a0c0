"""The lifecycle transactions of the runtime: suspend/cancel commands and dispositions.

Named transaction functions (run by ``store.write``): :func:`write_command` records a
``suspend``/``cancel`` for a running operation (any process's monitor delivers it) or
applies it directly to an idle one; :func:`write_lineage_command` does so for an
operation and, in the same transaction, for the continuation successors dispatched
after it (user intent on any member of a lineage applies to what runs after
it); :func:`dispose` acknowledges or abandons an operation, removing its content and
keeping a small marker, in one transaction (a thread turn leaves what its thread needs:
``actors/turns.py``).
"""

from __future__ import annotations

import functools
from typing import Final

import attrs
import msgspec

from recoverable import _killpoints, continuation, errors, machine
from recoverable.actors.checks import check_disposition, require_owner, require_signed_in
from recoverable.actors.turns import remember_turn
from recoverable.records import CommandKind, CommandRecord, Disposition, DispositionRecord
from recoverable.storage.base import Store
from recoverable.storage.base import WriteTransaction as WriteTxn
from recoverable.storage.leases import lease_blocks
from recoverable.storage.migration import saved_completion
from recoverable.storage.queue import entry as queue_entry
from recoverable.storage.retention import remove_content
from recoverable.telemetry import Telemetry
from recoverable.types import AccountBinding


def write_command(
    operation_id: str,
    kind: CommandKind,
    now: float,
    account: AccountBinding | None,
    txn: WriteTxn,
) -> CommandRecord | None:
    """Record ``kind`` for a live execution (returned: deliver it locally), or apply it."""
    check_disposition(txn, operation_id)
    record = txn.get_operation(operation_id)
    if record is None:
        raise errors.StateUnavailable("no such operation", operation_id=operation_id)
    require_owner(account, record.account, operation_id)
    existing = txn.get_command(operation_id)
    lease = txn.get_lease(operation_id)
    # A derivative's unexpired lease holds even after its owner died: the
    # command waits in its row for the claim after the expiry, which applies it.
    if lease is not None and lease_blocks(txn, lease, record, now):
        standing = machine.merge_command(
            existing.kind if existing is not None else None, kind
        )
        if existing is not None and standing != kind:
            return existing  # what stood already says more (a cancel is never downgraded)
        return txn.put_command(operation_id, standing, now)
    # Nobody runs it: apply directly (a dead owner's lease is void). A lease that only
    # expired may belong to a hung owner that wakes up later: the write raises the fence
    # (and drops the stale row), so that owner's next fenced write is refused.
    applied = machine.command_on_idle(record, kind)
    if continuation.is_pending(record):
        # A stop (cancel, or suspend: also a snooze) cancels a pending
        # continuation before its dispatch; recovery never resumes what a host stopped.
        stopped = continuation.cancelled(
            applied.record, "cancelled" if kind == "cancel" else "suspended", now
        )
        applied = attrs.evolve(applied, record=stopped, changed=True)
        txn.dequeue(operation_id)
    elif kind == "suspend":
        queued = queue_entry(txn, operation_id)
        if queued is not None and queued.resume:
            # A stopped worker flagged it for the next one: a host's suspend wins (the
            # next worker must not resume what the host stopped).
            txn.enqueue(operation_id, resume=False)
    if lease is not None:
        fenced_out = msgspec.structs.replace(applied.record, fence=record.fence + 1)
        txn.put_operation(fenced_out, expect_fence=record.fence)
        txn.delete_lease(operation_id)
    elif applied.changed:
        txn.put_operation(applied.record)
    if existing is not None and kind == "cancel":
        txn.delete_command(operation_id)  # folded into the record's phase
    return None


def write_lineage_command(
    operation_id: str,
    kind: CommandKind,
    now: float,
    account: AccountBinding | None,
    txn: WriteTxn,
) -> list[CommandRecord]:
    """:func:`write_command` for the operation, then for each continuation successor
    dispatched after it (a successor's successor too, at most ``continuation.MAX_BUDGET``
    + 1 steps), in this one transaction: a successor nobody runs is suspended or cancelled
    here (a pending continuation of a failed one is cancelled), so no worker runs it
    afterwards; a running one gets its command row (returned, with the operation's own:
    deliver them locally; any other process's monitor reads them). A completed,
    cancelled or superseded successor ends the walk: nothing runs after it."""
    written: list[CommandRecord] = []
    command = write_command(operation_id, kind, now, account, txn)
    if command is not None:
        written.append(command)
    record = txn.get_operation(operation_id)
    for _ in range(continuation.MAX_BUDGET + 1):
        decided = record.continuation if record is not None else None
        if decided is None or decided.state != "dispatched" or decided.successor_id is None:
            break
        try:
            record = txn.get_operation(decided.successor_id)
        except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
            break  # nothing can be read of it, so nothing runs it either
        if record is None or record.phase in ("completed", "cancelled", "superseded") or (
            record.has_completion
        ):
            break  # disposed, or settled: nothing runs after it
        if record.phase == "failed" and not continuation.is_pending(record):
            continue  # its own continuation (if dispatched) is the next to stop
        command = write_command(record.operation_id, kind, now, account, txn)
        if command is not None:
            written.append(command)
        break
    return written


# What ``dispose`` raises before it writes anything: one operation's refusal in a write of
# many leaves nothing of it behind, and the others go on (``acknowledge_all``).
REFUSALS: Final = (
    errors.StateUnavailable, errors.AccountChanged, errors.OperationBusy,
    errors.CompletionUnavailable, errors.OperationCancelled, errors.OperationSuperseded,
    errors.CorruptRecord, errors.UnsupportedRecordVersion,
)


def dispose_each(
    operation_ids: list[str], now: float, account: AccountBinding | None, txn: WriteTxn
) -> dict[str, errors.RecoveryError]:
    """Acknowledge every operation in one transaction: what each one refused (``dispose``'s
    checks, all made before it writes), by operation id. Any other error (the store full,
    unavailable) fails the whole write: nothing of it commits."""
    refused: dict[str, errors.RecoveryError] = {}
    for operation_id in operation_ids:
        try:
            dispose(operation_id, "acknowledged", now, account, txn)
        except REFUSALS as exc:
            refused[operation_id] = exc
    return refused


async def acknowledge_all(
    store: Store, operation_ids: list[str], now: float, account: AccountBinding | None,
    telemetry: Telemetry,
) -> dict[str, errors.RecoveryError]:
    """``Runtime.acknowledge`` of many operations in ONE store write (one commit, one wait
    for the writer instead of one per operation), after the host's own commit of all of
    them: each is acknowledged or refused on its own; returns the refused ones' errors."""
    if not operation_ids:
        return {}
    refused = await store.write(
        functools.partial(dispose_each, operation_ids, now, account),
        touches=tuple(operation_ids),
    )
    _killpoints.hit("acknowledge.marker_saved")
    for operation_id in operation_ids:
        if operation_id not in refused:
            telemetry.emit("receipt.acknowledged", operation_id)
    return refused


def disposition_marker(marker: DispositionRecord, txn: WriteTxn, operation_id: str) -> None:
    """Remove the operation's content and save its marker as complete (one transaction);
    the job index keeps naming it while the marker is kept (``AlreadyAcknowledged``)."""
    remove_content(txn, operation_id)
    complete = msgspec.structs.replace(marker, removal_complete=True)
    txn.put_disposition(complete)
    txn.index_disposed(complete)


def dispose(
    operation_id: str,
    disposition: Disposition,
    now: float,
    account: AccountBinding | None,
    txn: WriteTxn,
) -> None:
    """Acknowledge or abandon: the marker and the removal of the content commit together."""
    existing = txn.get_disposition(operation_id)
    if existing is not None:
        require_owner(account, existing.account, operation_id)
        if existing.disposition != disposition:
            raise errors.StateUnavailable(
                f"operation is {existing.disposition}", operation_id=operation_id
            )
        if not existing.removal_complete:
            disposition_marker(existing, txn, operation_id)  # a repeat completes a removal
        return
    try:
        record = txn.get_operation(operation_id)
    except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
        if disposition != "abandoned":
            raise  # only a deliberate abandon may remove what cannot be read
        abandon_unreadable(operation_id, now, account, txn)
        return
    if record is None:
        raise errors.StateUnavailable("no such operation", operation_id=operation_id)
    require_owner(account, record.account, operation_id)
    try:
        lease = txn.get_lease(operation_id)
    except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
        # Only a deliberate abandon removes an operation whose lease row
        # cannot be read; an owner still running it could write nothing afterwards (every
        # owner write is fenced on the record, which is gone).
        if disposition != "abandoned":
            raise
        txn.delete_lease(operation_id, unreadable=True)
        lease = None
    if lease is not None and txn.lease_is_live(lease, now):
        raise errors.OperationBusy(
            "stop and await the active execution first", operation_id=operation_id
        )
    if disposition == "acknowledged":
        machine.check_acknowledge(record)
        # Acknowledge what the host could have read: the completion must be
        # readable (a current payload, or a version-1 record's inline one).
        # A damaged record fails closed and keeps its state; abandon it instead.
        if saved_completion(txn, record) is None:
            raise errors.CompletionUnavailable(
                "the saved completion is missing from the store: nothing to "
                "acknowledge (abandon the operation instead)",
                operation_id=operation_id,
            )
    # A thread turn leaves its thread what it needs (numbering, and a committed
    # turn's history) in the thread's row, in this same transaction.
    remember_turn(txn, record)
    # The marker and the removal of the content commit together: the operation
    # can never generate again, and nothing sensitive stays behind it.
    disposition_marker(
        DispositionRecord(
            operation_id=operation_id,
            disposition=disposition,
            at=now,
            account=record.account,
            scope=record.scope,
            job_id=record.job_id,
            input_revision=record.input_revision,
            root_operation_id=record.root_operation_id,
            previous_operation_id=record.previous_operation_id,
            attempts_used=record.attempts_used,
            maximum_attempts=record.maximum_attempts,
            usage=record.usage,
        ),
        txn,
        operation_id,
    )


def abandon_unreadable(
    operation_id: str, now: float, account: AccountBinding | None, txn: WriteTxn
) -> None:
    """Abandon an operation whose record no longer decodes: the operator's documented
    repair (``recoverable abandon``). Nothing can be read of it, so nothing of it is
    ever delivered or generated again; the account's job index, written while it was
    readable, proves it is this account's. Its content and rows are removed and an
    ``abandoned`` marker saved, in one transaction (the rerun of its job then prepares
    a new operation)."""
    owner = require_signed_in(account, "abandoning needs the operation's account")
    lease = txn.get_lease(operation_id)
    if lease is not None and txn.lease_is_live(lease, now):
        raise errors.OperationBusy(
            "stop and await the active execution first", operation_id=operation_id
        )
    if not txn.remove_unreadable_operation(operation_id, owner):
        raise errors.AccountChanged(
            "this account's job index does not name the unreadable operation",
            operation_id=operation_id,
        )
    disposition_marker(
        DispositionRecord(operation_id=operation_id, disposition="abandoned", at=now,
                          account=owner),
        txn,
        operation_id,
    )
