"""The storage seam: what an engine gives ``RecoveryStore``, and nothing more.

``RecoveryStore`` (``storage/store.py``) is store-neutral: the typed getters, the queries,
the source manifest, retention, statistics and the open-once registry are written once,
over a :class:`StoreEngine`. An engine is where the bytes live and how a transaction
commits: ``storage/lmdb_engine.py`` (one directory, one LMDB environment, a
group-committing writer thread) and ``storage/pg_engine.py`` (a PostgreSQL database a
fleet shares). They are siblings: neither inherits from the other, and no code outside
``storage/`` names either.

What an engine provides (``docs/architecture.md``, "The storage seam"):

- **Rows.** Eleven named tables of ``bytes -> bytes`` rows (``storage.base.TABLES``), the
  same bytes on every engine (``storage/codec.py``, keys in ``storage/keys.py``).
  :attr:`StoreEngine.tables` maps each table to the engine's handle for it.
- **Snapshots.** :meth:`StoreEngine.read` runs a function on one consistent snapshot that
  offers ``get(key, db=)``, ``cursor(db=)`` (``set_range``, ``set_key``, ``iternext``),
  ``stat(db)`` and ``id()``: the calls ``storage/queries.py``, the queue scan and the
  integrity check make, so those are written once.
- **One atomic write.** :meth:`StoreEngine.write` runs a mutation on a
  ``storage.txn.WriteTxn`` (over the engine's write transaction, the same calls plus
  ``put``, ``replace``, ``pop``, ``delete``) and returns once it is durable; a mutation
  that raises changes nothing; the fence, the quotas and the record invariants are checked
  by ``WriteTxn`` for every engine (``WriteTxn.put_operation`` is the one door of every
  operation write).
- **Owners.** This engine's owner id, whether another owner is live (a process that holds
  its lock and, where the engine has one, whose heartbeat has not expired), whether a
  lease is live.
- **Where reads run.** :attr:`StoreEngine.read_threads`: 0 for an engine whose reads are
  memory reads (they run inline on the event loop), the number of reads that may run at
  once in worker threads for one whose every read is a round trip (``RecoveryStore
  .read_off_loop``: a host waiting on thousands of jobs keeps its event loop free).
- **A change feed.** :meth:`StoreEngine.last_txnid` moves on every commit by any process
  (the lifecycle monitor polls it); an engine that can push commits also has
  ``commit_listener()`` (PostgreSQL's LISTEN/NOTIFY), which ``RecoveryStore`` offers when
  present.

Adding a store is one engine module registered with
``storage.store.register_url_store`` and the shared contract suite
(``tests/storage/test_storage_contract.py``, run on every engine) run against it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from recoverable.records import CommandRecord, LeaseRecord
from recoverable.storage.base import Table, Touches
from recoverable.types import AccountBinding

if TYPE_CHECKING:
    from recoverable.storage.queue import QueueEntry
    from recoverable.storage.txn import WriteTxn

__all__ = ["StoreEngine"]

Result = TypeVar("Result")


class StoreEngine(Protocol):
    """One opened engine (see the module docstring)."""

    path: str  # what the store shows as its location (a URL with its password redacted)
    max_bytes: int
    max_record_bytes: int
    tables: dict[Table, Any]  # logical table -> the engine's handle, for snapshots
    advisory_read_seconds: float  # how long a read of advisory shared state may be reused
    # Worker threads a batch of reads may use at once off the event loop: 0 when a read
    # is a local memory read (it runs inline: a thread hop would cost more than it), >0
    # when every read is a round trip to a server (RecoveryStore.read_off_loop).
    read_threads: int

    @property
    def owner_id(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    # -- reading: each call from one snapshot --

    def read(self, fn: Callable[[Any], Result]) -> Result:
        """``fn(snapshot)`` on one consistent snapshot of every table."""
        ...

    def get(self, table: Table, key: bytes) -> bytes | None: ...

    def get_raw_many(self, table: Table, keys: list[bytes]) -> list[bytes | None]: ...

    def get_raw_rows(self, wanted: list[tuple[Table, bytes]]) -> list[bytes | None]: ...

    def ids_by_job(
        self, account: AccountBinding, scope: str | None, job_id: str | None
    ) -> list[str]: ...

    def queued(self, *, after_serial: int, limit: int) -> list[QueueEntry]: ...

    def commands_snapshot(self, *, after_serial: int) -> tuple[int, list[CommandRecord]]: ...

    def reserve_claims(self, operation_ids: list[str], limit: int) -> list[str]:
        """``RecoveryStore.reserve_claims``: an engine whose owners race for leases
        reserves; one whose writes are serialized returns ``operation_ids[:limit]``."""
        ...

    def last_txnid(self) -> int:
        """Moves on every commit by any process (the change feed's poll)."""
        ...

    # -- writing --

    async def write(self, fn: Callable[[WriteTxn], Result], touches: Touches) -> Result: ...

    def write_sync(self, fn: Callable[[WriteTxn], Result]) -> Result: ...

    # -- owners --

    def lease_is_live(self, lease: LeaseRecord, now: float | None) -> bool: ...

    def owner_is_live(self, owner_id: str) -> bool: ...

    def other_live_owners(self) -> list[str]: ...

    # -- statistics and closing --

    def writer_stats(self) -> dict[str, int]:
        """This process's writer counters (``commits``, ``writes``, ``largest_batch``,
        ``isolated_reruns``, ``map_*``, and the engine's own)."""
        ...

    def close(self) -> None:
        """Drain the writer and release everything (called once, by the last close)."""
        ...
