"""One poller for every ``runtime.wait`` of a runtime: which waited operations left the queue.

``runtime.wait`` (``actors/queue.py``) runs nothing itself: a worker runs the operation, and
the operation leaves the store's queue when it ends. Each waiter used to poll the store on
its own (the commit counter, then its queue row), so a batch host waiting on thousands of
jobs made thousands of reads per second — each one a round trip on the PostgreSQL store,
on the event loop. :class:`QueueWatch` makes it one: a single task reads the commit counter
(``store.last_txnid()``) with backoff (``POLL_FIRST`` .. ``POLL_MAX``) while anyone waits,
and when it moved, reads the queue rows of every waited operation in one snapshot
(``store.get_raw_many``), waking those that left. A waiter still reads its record itself
at least every ``FULL_READ_EVERY`` seconds (``wait`` bounds each wait), so a state that
keeps an operation queued (a host's suspend, a cancel a worker has not seen yet) is found
as before, and a runtime whose watch is not running (no ``open_runtime``) degrades to that
bounded poll, never to a hang.
"""

from __future__ import annotations

from typing import Final

import trio
from recoverable.storage.base import Store as RecoveryStore
from recoverable.storage.queue import member_key

from recoverable.errors import StorageUnavailable

__all__ = ["POLL_FIRST", "POLL_MAX", "QueueWatch"]

POLL_FIRST: Final = 0.005  # seconds: the first look after a change
POLL_MAX: Final = 0.2  # seconds: the longest pause between two looks


class QueueWatch:
    """Wakes the waiters of operations that left the store's queue (see the module doc)."""

    def __init__(self, store: RecoveryStore) -> None:
        self._store = store
        self._waiting: dict[str, list[trio.Event]] = {}
        self._someone_waits = trio.Event()
        self.polls = 0  # commit-counter reads
        self.scans = 0  # queue reads of every waited operation at once

    async def until_gone(self, operation_id: str, longest: float) -> bool:
        """Until ``operation_id`` is no longer queued (True) or ``longest`` s passed (False)."""
        gone = trio.Event()
        events = self._waiting.setdefault(operation_id, [])
        events.append(gone)
        self._someone_waits.set()
        try:
            with trio.move_on_after(longest):
                await gone.wait()
        finally:
            if not gone.is_set():
                events.remove(gone)
                if not events:
                    del self._waiting[operation_id]
        return gone.is_set()

    async def run(self) -> None:
        """The poller (a task of ``open_runtime``'s nursery)."""
        last: int | None = None
        while True:
            if not self._waiting:
                self._someone_waits = trio.Event()
                await self._someone_waits.wait()
                last = None  # who waits now has not been looked for yet
            delay = POLL_FIRST
            while self._waiting:
                try:
                    txnid = self._store.last_txnid()
                    self.polls += 1
                    if txnid != last:
                        self._wake_gone()
                        last, delay = txnid, POLL_FIRST
                except StorageUnavailable:
                    pass  # each waiter meets the typed error on its own next full read
                await trio.sleep(delay)
                delay = min(delay * 2, POLL_MAX)

    def _wake_gone(self) -> None:
        waited = list(self._waiting)
        rows = self._store.get_raw_many("queue", [member_key(op) for op in waited])
        self.scans += 1
        for operation_id, row in zip(waited, rows, strict=True):
            if row is None:
                for event in self._waiting.pop(operation_id):
                    event.set()
