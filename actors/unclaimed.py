"""The unclaimed bound of submitted work: when nobody can run it.

``runtime.submit`` saves the operation's bound (``OperationRecord.unclaimed_after``,
default ``preconditions.DEFAULT_UNCLAIMED_AFTER``). **Unclaimed** means no live worker of
its account and endpoint, never "not claimed yet": a queue that a live worker serves may
stay long, and nothing in it is ever ended for waiting. An operation ends ``failed`` with
``failure_reason="no_worker"`` (:func:`recoverable.machine.unclaimed`) when all hold:

- it is runnable (``prepared``, or ``waiting`` past its cooldown) and no live lease holds it;
- no live worker serves its account and endpoint now (the ``queue`` table's worker rows
  whose owner lock is held: :class:`Served`);
- its bound has passed since the latest of: it became runnable, and the last moment a
  worker of its account and endpoint was known to serve the queue (the served mark,
  ``storage/queue.py``: moved ahead by each such worker when it starts, every minute while
  it runs, and when it stops). So a worker that restarts, or the workers of a batch that
  are still starting, never make its queue "unclaimed".

Who applies it: every sweep (``actors/sweep.py``: the cheap one of every ``open_runtime``,
the full ``recoverable sweep``, a worker's start-up sweep) to queued operations with a
saved bound (``recoverable sweep --unclaimed-after S`` to every runnable one), and the
poller of a runtime that waits for them (``actors/waiters.py``), so ``wait`` ends even when
no other runtime sweeps. A runtime never ends, when it opens, the operations of its own
account and endpoint (``serving``): it may be the worker about to serve them, or the host
about to submit them again; its poller applies the bound to what it waits for, counted
from the moment the wait began at the earliest.

Each ending is one write transaction conditional on the fence that was read
(:func:`end_unclaimed`), which reads the served mark again: a worker that registered
meanwhile (its row and its mark are written together) keeps the operation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import msgspec

from recoverable import errors, machine
from recoverable.records import LeaseRecord, OperationRecord
from recoverable.storage.base import Store as RecoveryStore
from recoverable.storage.base import WriteTransaction as WriteTxn
from recoverable.storage.leases import lease_blocks
from recoverable.storage.queue import decode_served, served_key

__all__ = [
    "Key", "QueueReason", "Served", "bound_of", "end_unclaimed", "key_of", "no_worker_at",
    "reread", "served_now",
]

Key = tuple[str, str, str]  # (account id, credential source, endpoint id)
QueueReason = Literal["no_worker_for_account", "no_worker_for_endpoint"]
Ended = Literal["untouched", "live", "raced", "failed", "unreadable"]

_RUNNABLE = frozenset({"prepared", "waiting"})


def key_of(record: OperationRecord) -> Key:
    return (record.account.account_id, record.account.source, record.endpoint_id)


def bound_of(record: OperationRecord, override: float | None = None) -> float | None:
    """The bound that applies: the sweep's ``--unclaimed-after``, else the saved one."""
    return override if override is not None else record.unclaimed_after


class Served:
    """Which accounts and endpoints live workers serve now (one read of the worker rows,
    one owner-lock check per worker), and the served mark of each (read when asked,
    batched by :meth:`prime`)."""

    def __init__(self, store: RecoveryStore) -> None:
        self._store = store
        self.live: frozenset[Key] = frozenset(
            (row.account_id, row.source, row.endpoint_id)
            for owner_id, _token, row in store.workers()
            if store.owner_is_live(owner_id)
        )
        self._endpoints = frozenset(endpoint for _account, _source, endpoint in self.live)
        self._marks: dict[Key, float | None] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.live

    def reason(self, key: Key) -> QueueReason:
        """Why nobody serves ``key``: no live worker serves its endpoint at all, or only
        for other accounts."""
        return "no_worker_for_account" if key[2] in self._endpoints else "no_worker_for_endpoint"

    def prime(self, keys: Iterable[Key]) -> None:
        """Read the served marks of ``keys`` not read yet, in one read."""
        wanted = [key for key in dict.fromkeys(keys) if key not in self._marks]
        if not wanted:
            return
        rows = self._store.get_raw_many("queue", [served_key(*key) for key in wanted])
        for key, raw in zip(wanted, rows, strict=True):
            row = None if raw is None else decode_served(raw)
            self._marks[key] = None if row is None else row.until

    def until(self, key: Key) -> float | None:
        """Until when a worker of ``key`` is known to have served (None: never)."""
        self.prime((key,))
        return self._marks[key]


def served_now(store: RecoveryStore) -> Served:
    return Served(store)


def no_worker_at(
    record: OperationRecord, bound: float | None, served_until: float | None,
    waiting_since: float | None = None,
) -> float | None:
    """When ``record`` ends ``no_worker`` if no worker serves it by then (None: never: no
    bound, or not runnable); ``waiting_since`` delays it (a waiting runtime's own rule)."""
    if bound is None or record.phase not in _RUNNABLE or record.has_completion:
        return None
    latest = max(served_until or 0.0, waiting_since or 0.0)
    return machine.unclaimed_since(record, latest or None) + bound


def reread(
    txn: WriteTxn, seen: OperationRecord
) -> tuple[OperationRecord, LeaseRecord | None] | Literal["unreadable", "raced"]:
    """The record and lease of ``seen`` again, inside the write that may change it:
    ``"raced"`` if it was claimed (or removed) since the scan read it (its fence moved),
    ``"unreadable"`` if either row does not decode. The sweep's rule and this module's."""
    try:
        current = txn.get_operation(seen.operation_id)
        lease = txn.get_lease(seen.operation_id)
    except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
        return "unreadable"
    if current is None or current.fence != seen.fence:
        return "raced"
    return current, lease


def end_unclaimed(txn: WriteTxn, seen: OperationRecord, now: float, bound: float) -> Ended:
    """End one operation ``no_worker`` if it is still unclaimed (one transaction,
    conditional on the fence the caller read; the served mark read again here)."""
    operation_id = seen.operation_id
    read = reread(txn, seen)
    if isinstance(read, str):
        return read
    current, lease = read
    if lease is not None and lease_blocks(txn, lease, current, now):
        return "live"
    new = machine.unclaimed(
        current, now=now, unclaimed_after=bound, served_until=mark_in(txn, current)
    ).record
    if new == current:
        return "untouched"
    txn.put_operation(
        msgspec.structs.replace(new, fence=current.fence + 1), expect_fence=current.fence
    )
    if lease is not None:
        txn.delete_lease(operation_id)
    return "failed"


def mark_in(txn: WriteTxn, record: OperationRecord) -> float | None:
    """The served mark of ``record``'s account and endpoint, read in ``txn``."""
    raw = txn.get_raw("queue", served_key(*key_of(record)))
    row = None if raw is None else decode_served(raw)
    return None if row is None else row.until
