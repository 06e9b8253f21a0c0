"""The recovery store: one store-neutral ``RecoveryStore`` over a storage engine.

``RecoveryStore.open(path)`` opens the LMDB engine on a directory
(``storage/lmdb_engine.py``); ``RecoveryStore.open("postgresql://...")`` the PostgreSQL
engine (``storage/pg_engine.py``), or any engine registered for a URL scheme with
:func:`register_url_store`. What an engine gives, and what is written once here over it
(the typed getters, the queries, the source manifest, retention, statistics, the
open-once registry): ``storage/engine.py``.

``RecoveryStore`` implements ``storage.base.Store`` and hands each mutation a
``storage.txn.WriteTxn`` (``storage.base.WriteTransaction``). Reads run on a fresh
snapshot each; writes go through the process's single group-committing writer.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Final, TypeVar

import trio

from recoverable.errors import InvalidRequest, StorageUnavailable
from recoverable.records import CommandRecord, DispositionRecord, LeaseRecord, OperationRecord
from recoverable.storage import integrity, queries, queue, retention, sources
from recoverable.storage.base import TABLES, Table, Touches
from recoverable.storage.engine import StoreEngine
from recoverable.storage.keys import META_BYTES, META_SERIAL, governor_key, operation_key, u64
from recoverable.storage.lmdb_engine import FORMAT_VERSION, LmdbEngine
from recoverable.storage.redact import redact_url
from recoverable.storage.registry import OpenStores, StoreOptions
from recoverable.storage.rows import RecordGetters
from recoverable.storage.txn import WriteTxn
from recoverable.types import AccountBinding, CleanupResult, to_timestamp

if TYPE_CHECKING:
    from recoverable.storage.base import Store, WriteTransaction

__all__ = [
    "FORMAT_VERSION",
    "POSTGRESQL_SCHEMES",
    "TABLES",
    "RecoveryStore",
    "Table",
    "WriteTxn",
    "governor_key",
    "operation_key",
    "redact_url",
    "register_url_store",
    "registered_schemes",
    "url_scheme",
]

Result = TypeVar("Result")

_MiB: Final = 2**20

# Every store this process has open, by real directory path or by URL.
_OPEN_STORES: Final[OpenStores[RecoveryStore]] = OpenStores()

# The URL schemes of the PostgreSQL engine (storage/pg_engine.py).
POSTGRESQL_SCHEMES: Final = ("postgresql", "postgres")

# Engines opened by URL (``postgresql://...``: ``recoverable.storage`` registers the
# PostgreSQL engine, imported at its first use, when psycopg is installed), by URL scheme.
_URL_ENGINES: Final[dict[str, Callable[[str, StoreOptions], StoreEngine]]] = {}


def register_url_store(
    schemes: Iterable[str], opener: Callable[[str, StoreOptions], StoreEngine]
) -> None:
    """Make ``RecoveryStore.open(url)`` open URLs of these schemes with the engine
    ``opener(url, options)`` returns."""
    for scheme in schemes:
        _URL_ENGINES[scheme] = opener


def registered_schemes() -> frozenset[str]:
    """The URL schemes some engine opens in this installation (``postgresql`` once
    psycopg is installed and ``recoverable.storage`` imported)."""
    return frozenset(_URL_ENGINES)


def url_scheme(path: object) -> str | None:
    """The scheme of a store URL (``postgresql``), None for a directory path."""
    if isinstance(path, str) and "://" in path:
        return path.split("://", 1)[0].lower()
    return None


class RecoveryStore(RecordGetters):
    """A recovery store, opened once per process (by directory or URL).

    Open with :meth:`open`; use as a context manager or call :meth:`close`.
    Reads are synchronous (a fresh snapshot each). Writes go through the process's
    single group-committing writer: ``await store.write(fn)`` from Trio,
    ``store.write_sync(fn)`` from plain threads. ``engine`` is where the rows live
    (``storage/engine.py``).
    """

    def __init__(self, engine: StoreEngine, key: str) -> None:
        # Use RecoveryStore.open(): it enforces one engine per process per location.
        self.engine = engine
        self._key = key  # the registry's key: the real directory path, or the URL
        self.path = engine.path
        self.max_bytes = engine.max_bytes
        self.max_record_bytes = engine.max_record_bytes
        self._tables = engine.tables
        self.advisory_read_seconds = engine.advisory_read_seconds  # see actors/governor.py
        # At most this many reads off the event loop at once (read_off_loop); None: inline.
        self._read_limiter = (
            trio.CapacityLimiter(engine.read_threads) if engine.read_threads > 0 else None
        )
        listener = getattr(engine, "commit_listener", None)
        if listener is not None:
            # An engine that pushes commits (actors/monitor.py looks for this method).
            self.commit_listener = listener

    def __repr__(self) -> str:
        return f"<RecoveryStore {self.engine!r}>"

    # -- opening and closing --

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        max_bytes: int = 512 * _MiB,
        max_record_bytes: int = 128 * _MiB,
        initial_map_size: int | None = None,
    ) -> RecoveryStore:
        """Open (creating if needed) the store at ``path``: a directory (LMDB), or a
        ``postgresql://user@host:port/db`` URL (the PostgreSQL engine,
        storage/pg_engine.py; ``initial_map_size`` does not apply to it).

        A second ``open`` of the same directory or URL in this process returns the same
        object (reference counted: the last ``close`` closes it); with different
        options it raises ``ValueError``.
        """
        for name, value in (("max_bytes", max_bytes), ("max_record_bytes", max_record_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidRequest(f"{name} must be a positive integer")
        if initial_map_size is not None and (
            not isinstance(initial_map_size, int) or initial_map_size < _MiB
        ):
            raise InvalidRequest("initial_map_size must be an integer >= 1 MiB")
        options = StoreOptions(max_bytes, max_record_bytes, initial_map_size)
        scheme = url_scheme(path)
        if scheme is not None:
            opener = _URL_ENGINES.get(scheme)
            if opener is None:
                raise InvalidRequest(
                    f"no store for {scheme}:// URLs (the PostgreSQL store needs "
                    "recoverable[postgres]: pip install 'recoverable[postgres]')"
                )
            engine_for: Callable[[str, StoreOptions], StoreEngine] = opener
            key = str(path)
        else:
            try:
                os.makedirs(path, mode=0o700, exist_ok=True)
                key = os.path.realpath(path)
                os.chmod(key, 0o700)
            except OSError as exc:
                raise StorageUnavailable(f"cannot create the store directory: {exc}") from exc
            engine_for = LmdbEngine
        return _OPEN_STORES.open(
            key, options, lambda where, chosen: cls(engine_for(where, chosen), where)
        )

    def close(self) -> None:
        """Drop one reference; the last one drains the writer and closes the engine."""
        if _OPEN_STORES.release(self._key, self):
            self.engine.close()

    def __enter__(self) -> RecoveryStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self.engine.closed

    @property
    def owner_id(self) -> str:
        return self.engine.owner_id

    # -- writing --

    def write(
        self, fn: Callable[[WriteTxn], Result], *, touches: Touches = ()
    ) -> Coroutine[Any, Any, Result]:
        """Run ``fn`` in the next group commit; return its result once durable.

        ``touches`` (the operations ``fn`` reads) is a prefetch hint for engines whose
        reads are round trips (PostgreSQL); LMDB ignores it.

        The wait is shielded from cancellation (a queued write cannot be undone);
        an exception raised by ``fn`` rolls back ``fn``'s changes alone and is
        re-raised here. ``fn`` may run more than once (after a map resize, a refused
        optimistic batch), so it must not have side effects outside the transaction.

        A plain method returning the engine's coroutine: no frame of its own per write.
        """
        return self.engine.write(fn, touches)

    def write_sync(self, fn: Callable[[WriteTxn], Result]) -> Result:
        """Blocking :meth:`write` for code that is not running under Trio."""
        return self.engine.write_sync(fn)

    # -- reading (the getters: RecordGetters over _get) --

    def _read(self, fn: Callable[[Any], Result]) -> Result:
        return self.engine.read(fn)

    async def read_off_loop(self, reads: Callable[[], Result]) -> Result:
        """``reads()`` (synchronous calls of this store's getters) where they cost the
        event loop least. On an engine whose reads are memory reads (LMDB) it runs inline:
        a thread hop would cost more than the reads. On one whose every read is a round
        trip to a server (PostgreSQL), it runs in a worker thread, at most
        ``engine.read_threads`` at once (the engine's pool of reading connections), so a
        host waiting on thousands of operations keeps serving the others while one read
        travels. ``reads`` must touch nothing but the store and its arguments. A
        cancelled caller returns at once, whatever the server does (a hung one included):
        a read changes nothing, so its thread is left to finish and its result dropped
        (it keeps its place among ``read_threads`` until then)."""
        limiter = self._read_limiter
        if limiter is None:
            return reads()
        return await trio.to_thread.run_sync(reads, limiter=limiter, abandon_on_cancel=True)

    def _get(self, table: Table, key: bytes) -> bytes | None:
        return self.engine.get(table, key)

    def get_raw_many(self, table: Table, keys: list[bytes]) -> list[bytes | None]:
        """``get_raw`` of every key, from one snapshot (one statement on PostgreSQL)."""
        return self.engine.get_raw_many(table, keys)

    def get_raw_rows(self, wanted: list[tuple[Table, bytes]]) -> list[bytes | None]:
        """``get_raw`` of every ``(table, key)``, from one snapshot."""
        return self.engine.get_raw_rows(wanted)

    def lease_is_live(self, lease: LeaseRecord, now: float | None = None) -> bool:
        """Not expired at ``now`` (None: ``time.time()``), and held by one of this store's
        active acquisitions or by a living other owner."""
        return self.engine.lease_is_live(lease, now)

    def last_command_serial(self) -> int:
        return u64(self._get("meta", META_SERIAL))

    def last_txnid(self) -> int:
        """Moves on every commit by any process (LMDB's transaction id; PostgreSQL's count
        of committed batches)."""
        return self.engine.last_txnid()

    # -- queries (each from one snapshot; see storage/queries.py) --

    def payload_kinds(self, operation_ids: Iterable[str]) -> dict[str, frozenset[str]]:
        """Which payloads each operation has, from one snapshot (keys only: no value is
        copied, so a status of a large request stays cheap)."""
        ids = list(operation_ids)
        return self._read(lambda txn: queries.payload_kinds(txn, self._tables, ids))

    def queued(self, *, after_serial: int = 0, limit: int = 1024) -> list[queue.QueueEntry]:
        """Queued operations with a serial above ``after_serial``, in order, at most
        ``limit`` (and ``queue.MAX_SCAN``) of them, from one snapshot."""
        return self.engine.queued(after_serial=after_serial, limit=limit)

    def reserve_claims(self, operation_ids: list[str], *, limit: int) -> list[str]:
        """Of ``operation_ids`` (a claim round's candidates, in queue order), the first
        ``limit`` this owner may start without racing another owner's workers for them,
        reserved for it (a round trip on PostgreSQL: run it with ``read_off_loop``).
        A hint, never the authority: the lease's fence still decides who runs an
        operation. PostgreSQL skips an operation another live owner reserved, or whose
        row another session is locking (``FOR NO KEY UPDATE SKIP LOCKED``:
        ``storage/pg_claims.py``). LMDB reserves nothing: its writes are serialized,
        each lease acquisition sees the one before, and it returns the first ``limit``."""
        return self.engine.reserve_claims(operation_ids, limit)

    def workers(self) -> list[tuple[str, str, queue.WorkerRow]]:
        """Every worker row ``(owner id, token, row)``, live or not (``owner_is_live``)."""
        return self._read(lambda txn: queue.workers(txn, self._tables["queue"]))

    def owner_is_live(self, owner_id: str) -> bool:
        """This store's own owner, or another that a living process holds (and, on
        PostgreSQL, whose heartbeat has not expired)."""
        return self.engine.owner_is_live(owner_id)

    def other_live_owners(self) -> list[str]:
        """The live owners other than this one (this store is open elsewhere)."""
        return self.engine.other_live_owners()

    def commands(self, *, after_serial: int = 0) -> list[CommandRecord]:
        """Every readable command with ``serial > after_serial``, in serial order.

        Unreadable command rows are skipped here (``check_integrity`` lists them).
        """
        return self.commands_snapshot(after_serial=after_serial)[1]

    def commands_snapshot(self, *, after_serial: int = 0) -> tuple[int, list[CommandRecord]]:
        """``(txnid, commands)`` read from ONE snapshot; ``txnid`` is that snapshot's id.

        A poller should remember this ``txnid`` (not ``last_txnid()``): a reader may
        briefly get the previous snapshot while ``last_txnid()`` already names the
        newer commit, and remembering the snapshot's own id makes the next poll scan
        again instead of missing that commit.
        """
        return self.engine.commands_snapshot(after_serial=after_serial)

    def inventory(
        self, account: AccountBinding | None = None, scope: str | None = None
    ) -> tuple[list[OperationRecord], list[str]]:
        """Readable records matching ``account``/``scope`` (None: any), and the ids of
        ALL unreadable operation records (whatever their account).

        With both ``account`` and ``scope`` given, only that scope is read, through the
        hosts index (cheap in a large store); the unreadable ids are then those of the
        indexed records of that scope that no longer decode.
        """
        return self._read(lambda txn: queries.inventory(txn, self._tables, account, scope))

    def control_rows(self) -> tuple[dict[str, LeaseRecord], dict[str, CommandRecord]]:
        """Every readable lease and command, from one snapshot (for bulk status)."""
        return self._read(lambda txn: queries.control_rows(txn, self._tables))

    def ids_by_job(
        self, account: AccountBinding, scope: str | None, job_id: str | None
    ) -> list[str]:
        """Operation ids with exactly this account, scope and job id (None is not "")."""
        return self.engine.ids_by_job(account, scope, job_id)

    def dispositions(
        self, account: AccountBinding | None = None, scope: str | None = None
    ) -> list[DispositionRecord]:
        """Readable disposition markers matching ``account``/``scope`` (None: any)."""
        return self._read(lambda txn: queries.dispositions(txn, self._tables, account, scope))

    # -- integrity and statistics --

    def stats(self) -> dict[str, int]:
        """Quota counters and, for this process, commits vs writes (group commit)."""

        def read(txn: Any) -> tuple[int, int]:
            entries = sum(
                txn.stat(self._tables[table])["entries"] for table in TABLES if table != "meta"
            )
            return u64(txn.get(META_BYTES, db=self._tables["meta"])), entries

        bytes_used, entries = self._read(read)
        return {
            "bytes_used": bytes_used,
            "max_bytes": self.max_bytes,
            "max_record_bytes": self.max_record_bytes,
            "entries": entries,
            **self.engine.writer_stats(),
        }

    def check_integrity(self) -> list[str]:
        """Strictly decode every record of every table; describe each one that fails.

        Also checks keys against records, index entries against their records and
        the ``bytes_used`` counter against the stored sizes (``integrity.check_records``).
        """
        return self._read(lambda txn: integrity.check_records(txn, self._tables))

    # -- retention (explicit maintenance; see storage/retention.py) --

    # -- the source manifest (storage/sources.py, docs/sources.md) --

    async def set_source(
        self, key: str, digest: str, *, now: float | None = None
    ) -> sources.SourceChange:
        """Make ``digest`` the current digest of source ``key``. In the same transaction,
        every operation bound to another digest of ``key`` that could still produce a
        result, or holds an unacknowledged receipt, becomes ``superseded``."""
        when = time.time() if now is None else now
        return await self.write(functools.partial(sources.change_source, key, digest, when))

    async def delete_source(self, key: str, *, now: float | None = None) -> sources.SourceChange:
        """Remove source ``key`` from the manifest; everything bound to it is superseded
        (reason ``source_deleted``) in the same transaction."""
        when = time.time() if now is None else now
        return await self.write(functools.partial(sources.change_source, key, None, when))

    def set_source_sync(
        self, key: str, digest: str | None, *, now: float | None = None
    ) -> sources.SourceChange:
        """Blocking :meth:`set_source` (``digest=None``: :meth:`delete_source`) for code not
        running under Trio (the CLI)."""
        when = time.time() if now is None else now
        return self.write_sync(functools.partial(sources.change_source, key, digest, when))

    def purge_account(
        self, account: AccountBinding, scope: str | None = None
    ) -> CleanupResult:
        """Remove the account's idle records and markers; report busy/unreadable ones."""
        return retention.purge_account(self, account, scope)

    def cleanup_disposed(
        self, *, before: Any, account: AccountBinding,
        operation_ids: Iterable[str] | None = None,
    ) -> CleanupResult:
        """Remove old acknowledgement/abandonment markers (never live records); only
        those of ``operation_ids`` when given (``Client.forget``).

        ``before`` is a timezone-aware ``datetime`` or a POSIX timestamp.
        """
        stamp = before if isinstance(before, int | float) else to_timestamp(before)
        if stamp is None:
            raise InvalidRequest("before is required")
        only = None if operation_ids is None else frozenset(operation_ids)
        return retention.cleanup_disposed(
            self, before=float(stamp), account=account, operation_ids=only
        )


if TYPE_CHECKING:
    # The LMDB store implements the storage contract (checked by mypy, no runtime cost).
    def _implements_the_contract(store: RecoveryStore, txn: WriteTxn) -> tuple[
        Store, WriteTransaction, retention.RetainedStore, retention.RetentionTxn
    ]:
        return store, txn, store, txn
