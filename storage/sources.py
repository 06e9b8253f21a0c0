"""The source manifest and what a change to it does (docs/sources.md).

The ``sources`` table holds the manifest (a source key → the digest that is current) and
an index (a source key → the operations bound to it; ``put_operation`` of a new
source-bound record writes its entry). Hosts update the manifest with
``store.set_source(key, digest)`` / ``store.delete_source(key)``; both run
:func:`change_source` in ONE transaction:

- the manifest row is written (or removed);
- every operation bound to the key at another digest that could still produce a result,
  or holds a saved receipt nobody acknowledged, becomes ``superseded``
  (``sources_rules.supersede``): its completion payload is removed, it leaves the queue
  and the index, and if a live owner streams it a ``cancel`` command tells that owner's
  monitor to cut the stream (its later writes are refused: ``actors/fenced.py`` reads the
  superseded record). Acknowledged or abandoned operations are history: untouched.

The receipt side (a completion saved only while the manifest holds its digest) is
checked by the actor's fenced write in the transaction that would save it.
"""

from __future__ import annotations

import attrs

from recoverable.errors import CorruptRecord, UnsupportedRecordVersion
from recoverable.records import OperationRecord
from recoverable.sources_rules import (
    check_digest,
    check_source_key,
    needs_superseding,
    supersede,
)
from recoverable.storage.base import WriteTransaction
from recoverable.storage.keys import HASH_BYTES, key_str
from recoverable.types import AccountBinding, SupersededReason

__all__ = [
    "SourceChange",
    "change_source",
    "check_source_entry",
    "supersede_in",
    "supersede_revisions",
]


@attrs.frozen
class SourceChange:
    """What one manifest change did (ids and counts only)."""

    key: str
    previous: str | None  # the digest that was current (None: none)
    current: str | None  # the digest now current (None: deleted)
    superseded: tuple[str, ...] = ()  # operation ids superseded in the same transaction
    unreadable: tuple[str, ...] = ()  # bound ids whose record does not decode (left as is)


def supersede_in(
    txn: WriteTransaction, record: OperationRecord, reason: SupersededReason, now: float
) -> OperationRecord:
    """Write ``record`` as superseded (not as an owner: no fence expected) with everything
    that goes with it, inside the caller's transaction."""
    operation_id = record.operation_id
    new = supersede(record, reason)
    txn.put_operation(new)
    if record.has_completion:
        txn.delete_payload(operation_id, "completion")  # never readable, never delivered
    lease = txn.get_lease(operation_id)
    if lease is not None and txn.lease_is_live(lease, now):
        # A live owner streams it: its monitor cuts the stream (the cancel path); the
        # record says superseded, and the owner's next fenced write reads that and stops.
        txn.put_command(operation_id, "cancel", now)
    else:
        txn.delete_command(operation_id)  # a stored command has nothing left to say
    txn.dequeue(operation_id)
    if record.source is not None:
        txn.unbind_source(record.source.key, operation_id)
    return new


def change_source(
    key: str, digest: str | None, now: float, txn: WriteTransaction
) -> SourceChange:
    """Set (``digest``) or delete (``None``) a source in the manifest and supersede what
    was bound to another digest of it — all in this transaction."""
    check_source_key(key)
    if digest is not None:
        check_digest(digest)
    previous = txn.get_source(key)
    if digest is None:
        txn.delete_source(key)
    elif digest != previous:
        txn.put_source(key, digest)
    reason: SupersededReason = "source_deleted" if digest is None else "source_changed"
    superseded: list[str] = []
    unreadable: list[str] = []
    for operation_id in txn.source_bound(key):
        try:
            record = txn.get_operation(operation_id)
        except (CorruptRecord, UnsupportedRecordVersion):
            unreadable.append(operation_id)  # it cannot run or deliver: reported, kept
            continue
        if record is None:
            txn.unbind_source(key, operation_id)  # removed without its index entry
            continue
        source = record.source
        if source is None or source.key != key or source.digest == digest:
            continue  # bound to the digest that is current now: it stays valid
        if txn.get_disposition(operation_id) is not None or not needs_superseding(record):
            continue  # acknowledged/abandoned (history) or already terminal without a result
        supersede_in(txn, record, reason, now)
        superseded.append(operation_id)
    return SourceChange(key, previous, digest, tuple(superseded), tuple(unreadable))


def supersede_revisions(
    account: AccountBinding,
    scope: str | None,
    job_id: str,
    revision: str | None,
    candidates: frozenset[str],
    now: float,
    txn: WriteTransaction,
) -> list[str]:
    """Supersede (reason ``newer_revision``) the operations among ``candidates`` that
    belong to this job with another revision and could still produce a result or hold an
    unacknowledged receipt, re-read in this transaction. Returns their ids."""
    superseded: list[str] = []
    for operation_id in sorted(candidates):
        try:
            record = txn.get_operation(operation_id)
        except (CorruptRecord, UnsupportedRecordVersion):
            continue
        if (
            record is None
            or (record.account, record.scope, record.job_id) != (account, scope, job_id)
            or record.input_revision == revision
            or txn.get_disposition(operation_id) is not None
            or not needs_superseding(record)
        ):
            continue
        supersede_in(txn, record, "newer_revision", now)
        superseded.append(operation_id)
    return superseded


def check_source_entry(key: bytes, raw: bytes) -> str | None:
    """The integrity check of one ``sources`` row (None: fine)."""
    if key.startswith(b"m") and len(key) > 1:
        try:
            check_source_key(key_str(key[1:]))
            check_digest(raw.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return "malformed manifest row"
        return None
    if key.startswith(b"b") and len(key) > 1 + HASH_BYTES and raw == b"":
        return None
    return "malformed sources row"
