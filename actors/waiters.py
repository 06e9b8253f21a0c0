"""One poller for every ``runtime.wait`` of a runtime: which waited operations left the queue.

``runtime.wait`` (``actors/queue.py``) runs nothing itself: a worker runs the operation, and
the operation leaves the store's queue when it ends. Each waiter used to poll the store on
its own (the commit counter, then its queue row), so a batch host waiting on thousands of
jobs made thousands of reads per second — each one a round trip on the PostgreSQL store,
on the event loop. :class:`QueueWatch` makes it one: a single task reads the commit counter
(``store.last_txnid()``) with backoff (``POLL_FIRST`` .. ``POLL_MAX``) while anyone waits,
and when it moved, reads the queue rows of every waited operation in one snapshot
(``store.get_raw_many``), waking those that left. Some states keep an operation queued (a
host's suspend, a cancel no worker has seen yet, an idle operation past its expiry):
every ``FULL_READ_EVERY`` seconds the task also reads the records and command rows of
every waited operation (two reads in all, not two per waiter) and wakes those that may
have settled (:func:`may_settle`). A waiter wakes on its own at least every
``SAFETY_READ_EVERY`` seconds, and every ``FULL_READ_EVERY`` seconds when no task runs the
watch (a runtime not opened with ``open_runtime``): a bounded poll, never a hang.

Two more things keep a queued operation from ever settling, and the same full read finds
them: a damaged queue or lease row (``storage/queue_checks.py``: no worker would
ever run it), whose ``CorruptRecord`` its waiters raise; and no live worker of its account
and endpoint for its unclaimed bound (``actors/unclaimed.py``): the watch ends it
``no_worker`` itself (one fenced write), counting the bound from the moment the wait
began at the earliest, so ``wait`` ends even when no other runtime sweeps.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Final

import trio

from recoverable.actors.unclaimed import Served, end_unclaimed, key_of, no_worker_at
from recoverable.errors import RecoveryError
from recoverable.preconditions import is_expired
from recoverable.records import OperationRecord
from recoverable.status import SETTLED_STATES
from recoverable.storage import codec
from recoverable.storage.base import Store as RecoveryStore
from recoverable.storage.keys import operation_key
from recoverable.storage.queue import member_key
from recoverable.storage.queue_checks import QueueLook, RowDamage, find_damage

__all__ = ["FULL_READ_EVERY", "POLL_FIRST", "POLL_MAX", "QueueWatch", "may_settle"]

POLL_FIRST: Final = 0.005  # seconds: the first look after a change
POLL_MAX: Final = 0.2  # seconds: the longest pause between two looks
FULL_READ_EVERY: Final = 1.0  # seconds: every waited record is looked at this often
SAFETY_READ_EVERY: Final = 30.0  # seconds: each waiter reads its record at least this often
_STOPPED: Final = frozenset({*SETTLED_STATES, "suspended"})


def may_settle(record: OperationRecord | None, has_command: bool, now: float) -> bool:
    """Whether ``wait``'s full read could end now for an operation still queued: gone, a
    lifecycle command standing, a saved completion, a settled or suspended record, or
    idle past its expiry."""
    if record is None or has_command or record.has_completion or record.phase in _STOPPED:
        return True
    idle = record.phase in ("prepared", "waiting")
    return idle and is_expired(record, now)


def _stopped_rows(
    store: RecoveryStore, waited: list[str]
) -> tuple[list[bytes | None], list[bytes | None], QueueLook]:
    """The records, command rows and queue and lease rows of the waited operations."""
    keys = [operation_key(op) for op in waited]
    return (
        store.get_raw_many("operations", keys), store.get_raw_many("commands", keys),
        find_damage(store, waited),
    )


class QueueWatch:
    """Wakes the waiters of operations that left the store's queue (see the module doc)."""

    def __init__(self, store: RecoveryStore, now: Callable[[], float]) -> None:
        self._store = store
        self._now = now
        self._waiting: dict[str, list[trio.Event]] = {}
        self._since: dict[str, float] = {}  # operation id -> when its earliest wait began
        self._damaged: dict[trio.Event, RowDamage] = {}  # a waiter woken by a damaged row
        self._someone_waits = trio.Event()
        self.running = False
        self.polls = 0  # commit-counter reads
        self.scans = 0  # queue reads of every waited operation at once
        self.full_scans = 0  # record and command reads of every waited operation at once

    async def until_gone(self, operation_id: str, waiting_since: float | None = None) -> bool:
        """Until ``operation_id`` left the queue or may have settled (True), or the
        waiter's own bound passed (False): see the module doc. ``waiting_since`` (wall
        clock): when the wait began (its unclaimed bound counts from then at the
        earliest). Raises the ``CorruptRecord`` of a damaged queue or lease row."""
        longest = SAFETY_READ_EVERY if self.running else FULL_READ_EVERY
        gone = trio.Event()
        events = self._waiting.setdefault(operation_id, [])
        events.append(gone)
        if waiting_since is not None:
            self._since[operation_id] = min(
                self._since.get(operation_id, math.inf), waiting_since
            )
        self._someone_waits.set()
        try:
            with trio.move_on_after(longest):
                await gone.wait()
        finally:
            damage = self._damaged.pop(gone, None)
            if not gone.is_set():
                events.remove(gone)
                if not events:
                    del self._waiting[operation_id]
                    self._since.pop(operation_id, None)
        if damage is not None:
            raise damage.error()
        return gone.is_set()

    async def run(self) -> None:
        """The poller (a task of ``open_runtime``'s nursery)."""
        self.running = True
        try:
            await self._run()
        finally:
            self.running = False

    async def _run(self) -> None:
        last: int | None = None
        while True:
            if not self._waiting:
                self._someone_waits = trio.Event()
                await self._someone_waits.wait()
                last = None  # who waits now has not been looked for yet
            delay = POLL_FIRST
            full_read_at = trio.current_time() + FULL_READ_EVERY
            while self._waiting:
                try:
                    # Each read off the event loop where it is a round trip
                    # (RecoveryStore.read_off_loop): the waiters' host runs meanwhile.
                    txnid = await self._store.read_off_loop(self._store.last_txnid)
                    self.polls += 1
                    if txnid != last:
                        await self._wake_gone()
                        last, delay = txnid, POLL_FIRST
                    if trio.current_time() >= full_read_at and self._waiting:
                        full_read_at = trio.current_time() + FULL_READ_EVERY
                        await self._wake_stopped()
                except RecoveryError:
                    # An unreachable or damaged store: every waiter reads again now and
                    # meets the typed error itself (the watch must not end the runtime).
                    for operation_id in list(self._waiting):
                        self._wake(operation_id)
                await trio.sleep(delay)
                delay = min(delay * 2, POLL_MAX)

    def _wake(self, operation_id: str, damage: RowDamage | None = None) -> None:
        self._since.pop(operation_id, None)
        for event in self._waiting.pop(operation_id, ()):
            if damage is not None:
                self._damaged[event] = damage  # its waiter raises the row's CorruptRecord
            event.set()

    async def _wake_gone(self) -> None:
        waited = list(self._waiting)
        rows = await self._store.read_off_loop(functools.partial(
            self._store.get_raw_many, "queue", [member_key(op) for op in waited]
        ))
        self.scans += 1
        for operation_id, row in zip(waited, rows, strict=True):
            if row is None:
                self._wake(operation_id)

    async def _wake_stopped(self) -> None:
        waited = list(self._waiting)
        records, commands, look = await self._store.read_off_loop(
            functools.partial(_stopped_rows, self._store, waited)
        )
        self.full_scans += 1
        now = self._now()
        unclaimed: list[OperationRecord] = []
        for operation_id, raw, command in zip(waited, records, commands, strict=True):
            try:
                record = (
                    None if raw is None
                    else codec.decode_operation(raw, operation_id=operation_id)
                )
            except RecoveryError:
                record = None  # unreadable: the waiter's own read raises the typed error
            damage = look.damage.get(operation_id)
            if damage is not None or may_settle(record, command is not None, now):
                self._wake(operation_id, damage)
            elif record is not None and operation_id in look.queued and self._past_bound(
                record, None, now
            ):
                unclaimed.append(record)
        if unclaimed:
            await self._end_unclaimed(unclaimed, now)

    def _past_bound(self, record: OperationRecord, served: Served | None, now: float) -> bool:
        """Whether ``record``'s saved bound has passed (with ``served``: also since a
        worker of its account and endpoint served, and none does now)."""
        key = key_of(record)
        if served is not None and key in served:
            return False
        at = no_worker_at(
            record, record.unclaimed_after, None if served is None else served.until(key),
            self._since.get(record.operation_id),
        )
        return at is not None and at <= now

    async def _end_unclaimed(self, records: list[OperationRecord], now: float) -> None:
        """End ``no_worker`` what no worker served within its bound (the sweep's rule,
        ``actors/unclaimed.py``); its waiters then read the failed record."""
        served = Served(self._store)
        served.prime(key_of(record) for record in records)
        for record in records:
            bound = record.unclaimed_after
            if bound is None or not self._past_bound(record, served, now):
                continue
            ended = await self._store.write(
                functools.partial(end_unclaimed, seen=record, now=now, bound=bound),
                touches=(record.operation_id,),
            )
            if ended in ("failed", "raced", "unreadable"):
                self._wake(record.operation_id)
