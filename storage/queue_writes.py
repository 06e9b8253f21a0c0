"""The queue's writes, one idea of the write transaction (``storage/queue.py`` holds its
rows): a queued operation's order and member rows, the worker rows and the served marks.

A mixin of :class:`recoverable.storage.txn.WriteTxn` (the PostgreSQL store's transaction
inherits it too): it writes through the transaction's own row plumbing, so the batch's
read-your-writes cache, the size bounds and the all-or-nothing rule (``_broken``) hold
for these rows as for every other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recoverable.errors import CorruptRecord
from recoverable.storage import queue
from recoverable.storage.base import Table
from recoverable.storage.keys import operation_key

__all__ = ["QueueWrites"]


class QueueWrites:
    """``enqueue``/``dequeue``, the worker rows and the served marks of a transaction."""

    _broken: bool

    if TYPE_CHECKING:  # the transaction's row plumbing (storage/txn.py)

        @property
        def owner_id(self) -> str: ...

        def _get(self, table: Table, key: bytes) -> bytes | None: ...

        def _put(
            self, table: Table, key: bytes, value: bytes, *, immutable: str | None = None
        ) -> None: ...

        def _delete(self, table: Table, key: bytes) -> bool: ...

        def _counter_next(self, name: bytes) -> int: ...

    def enqueue(self, operation_id: str, *, resume: bool | None = None) -> int:
        member = queue.member_key(operation_id)
        raw = self._get("queue", member)
        try:  # atomic: see _broken
            if raw is not None:
                current = queue.decode_member(raw)
                order = None if current is None else self._get(
                    "queue", queue.order_key(current[0])
                )
                problem = queue.member_problem(current, order, member[1:])
                if problem is not None or current is None:
                    # Damage to a stored row, never the caller's request: the row is left
                    # as it is (check_integrity lists it too).
                    raise CorruptRecord(
                        f"queue table, row {member!r}: {problem}", operation_id=operation_id
                    )
                serial, flagged = current
                if resume is not None and flagged != resume:
                    self._put("queue", member, queue.encode_member(serial, resume=resume))
                return serial
            serial = self._counter_next(queue.META_QUEUE_SERIAL)
            if self._get("queue", queue.order_key(serial)) is not None:
                # A rolled-back counter: the row would take a queued operation's place.
                raise CorruptRecord(
                    f"meta table, row {queue.META_QUEUE_SERIAL!r}: the queue serial "
                    f"counter names serial {serial}, already in use (rolled back)",
                    operation_id=operation_id,
                )
            self._put("queue", queue.order_key(serial), operation_key(operation_id))
            self._put("queue", member, queue.encode_member(serial, resume=bool(resume)))
            return serial
        except BaseException:
            self._broken = True
            raise

    def spend_resume_mark(self, operation_id: str) -> bool:
        """An execution opens the operation: a stopped worker's resume mark is spent (True
        if there was one). A row that is not queued is never created; a damaged one is
        left as it is (``enqueue`` and the checks name it)."""
        member = queue.member_key(operation_id)
        raw = self._get("queue", member)
        current = None if raw is None else queue.decode_member(raw)
        if current is None or not current[1]:
            return False
        self._put("queue", member, queue.encode_member(current[0], resume=False))
        return True

    def dequeue(self, operation_id: str) -> bool:
        member = queue.member_key(operation_id)
        raw = self._get("queue", member)
        if raw is None:
            return False
        current = queue.decode_member(raw)
        try:  # atomic: see _broken
            # Only the order row that names this operation: a damaged serial must not
            # take another operation's place in the queue with it.
            if current is not None and self._get(
                "queue", queue.order_key(current[0])
            ) == member[1:]:
                self._delete("queue", queue.order_key(current[0]))
            self._delete("queue", member)
        except BaseException:
            self._broken = True
            raise
        return True

    def register_worker(self, token: str, row: queue.WorkerRow) -> None:
        """This owner runs a worker (``storage/queue.py``), named by ``token``."""
        self._put("queue", queue.worker_key(self.owner_id, token), queue.encode_worker(row))

    def unregister_worker(self, owner_id: str, token: str) -> bool:
        return self._delete("queue", queue.worker_key(owner_id, token))

    def mark_served(self, row: queue.ServedRow) -> None:
        """Its account and endpoint were served until ``row.until`` (never moved back)."""
        key = queue.served_key(row.account_id, row.source, row.endpoint_id)
        raw = self._get("queue", key)
        old = None if raw is None else queue.decode_served(raw)
        if old is None or old.until < row.until:
            self._put("queue", key, queue.encode_served(row))
