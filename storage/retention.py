"""Explicit retention: purge an account's idle records, clean up old disposition markers.

Nothing here runs on its own and nothing is evicted to make room: these are
store-maintenance decisions a host makes deliberately. Busy (live lease) and
unreadable records are reported as skipped, never guessed about or removed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Protocol, TypeVar, get_args

from recoverable.records import DispositionRecord, OperationRecord, PayloadKind
from recoverable.storage.base import WriteTransaction
from recoverable.storage.threads import THREAD_SCOPE, delete_rows
from recoverable.types import AccountBinding, CleanupResult

Result = TypeVar("Result")


class RetentionTxn(WriteTransaction, Protocol):
    """A write transaction that can also remove disposition markers (and find an account's
    thread rows, ``storage/threads.py``)."""

    def delete_disposition(self, operation_id: str) -> bool: ...

    def payload_owners(self, prefix: str) -> list[str]: ...


class RetainedStore(Protocol):
    """What retention needs from a store (the LMDB ``RecoveryStore`` has it)."""

    def inventory(
        self, account: AccountBinding | None = None, scope: str | None = None
    ) -> tuple[list[OperationRecord], list[str]]: ...

    def dispositions(
        self, account: AccountBinding | None = None, scope: str | None = None
    ) -> list[DispositionRecord]: ...

    def write_sync(self, fn: Callable[[RetentionTxn], Result]) -> Result: ...


_PAYLOADS: Final[tuple[PayloadKind, ...]] = get_args(PayloadKind)


def remove_control_rows(txn: WriteTransaction, operation_id: str) -> None:
    """Delete the operation's lifecycle command, (dead) lease and queue rows, if any."""
    txn.delete_command(operation_id)
    txn.delete_lease(operation_id)
    txn.dequeue(operation_id)


def remove_content(txn: WriteTransaction, operation_id: str) -> None:
    """Delete the request, the response and the record (its disposition marker stays)."""
    for kind in _PAYLOADS:
        txn.delete_payload(operation_id, kind)
    txn.delete_operation(operation_id)
    remove_control_rows(txn, operation_id)


def _remove_operation(txn: RetentionTxn, operation_id: str) -> None:
    remove_content(txn, operation_id)
    txn.delete_disposition(operation_id)


def purge_account(
    store: RetainedStore, account: AccountBinding, scope: str | None = None
) -> CleanupResult:
    """Remove this account's idle records (and their markers and control rows).

    Works after sign-out with the host's retained binding. Records with a live
    lease are skipped (stop and await the execution first); unreadable records
    are skipped and reported by id, whatever their owner might be. The account's
    thread rows (the history its threads kept of disposed turns) go too.
    """
    records, unreadable = store.inventory(account=account, scope=scope)
    candidates = [record.operation_id for record in records]
    markers = [
        marker.operation_id for marker in store.dispositions(account=account, scope=scope)
    ]

    def purge(txn: RetentionTxn) -> tuple[list[str], list[str]]:
        removed: list[str] = []
        skipped: list[str] = []
        for op_id in candidates:
            record = txn.get_operation(op_id)
            if record is None or record.account != account:
                continue
            lease = txn.get_lease(op_id)
            if lease is not None and txn.lease_is_live(lease):
                skipped.append(op_id)
                continue
            _remove_operation(txn, op_id)
            removed.append(op_id)
        for op_id in markers:
            marker = txn.get_disposition(op_id)
            if marker is None or marker.account != account or op_id in removed:
                continue
            if txn.get_operation(op_id) is not None:
                continue  # handled above (or busy)
            _remove_operation(txn, op_id)
            removed.append(op_id)
        if scope is None or scope == THREAD_SCOPE:
            delete_rows(txn, account)  # the threads' kept history goes too
        return removed, skipped

    removed, skipped = store.write_sync(purge)
    return CleanupResult(removed=tuple(removed), skipped=tuple(skipped + unreadable))


def cleanup_disposed(
    store: RetainedStore,
    *,
    before: float,
    account: AccountBinding,
    operation_ids: frozenset[str] | None = None,
) -> CleanupResult:
    """Remove acknowledgement/abandonment markers older than ``before`` for ``account``
    (only those of ``operation_ids`` when given).

    Never touches unacknowledged completions or unfinished requests. A marker
    whose content removal is still incomplete is skipped (repeat the
    acknowledgement first). Once a marker is removed, status is unavailable.
    """
    markers = [
        marker for marker in store.dispositions(account=account)
        if marker.at < before and (operation_ids is None or marker.operation_id in operation_ids)
    ]

    def clean(txn: RetentionTxn) -> tuple[list[str], list[str]]:
        removed: list[str] = []
        skipped: list[str] = []
        for marker in markers:
            current = txn.get_disposition(marker.operation_id)
            if current is None or current.account != account or current.at >= before:
                continue
            if not current.removal_complete or txn.get_operation(marker.operation_id):
                skipped.append(marker.operation_id)
                continue
            txn.delete_disposition(marker.operation_id)
            remove_control_rows(txn, marker.operation_id)
            removed.append(marker.operation_id)
        return removed, skipped

    removed, skipped = store.write_sync(clean)
    return CleanupResult(removed=tuple(removed), skipped=tuple(skipped))
