"""The LMDB recovery store: one environment per directory, one writer per process.

Tables (LMDB named databases; keys in ``storage/keys.py``):

- ``operations``   op_id -> OperationRecord
- ``payloads``     op_id + b"\\0" + kind -> raw bytes (kind: body / request / completion)
- ``commands``     op_id -> CommandRecord (the latest lifecycle command for the operation)
- ``leases``       op_id -> LeaseRecord
- ``hosts``        h(account) + h(scope) + h(job_id) + op_id -> b"" (every readable operation)
- ``dispositions`` op_id -> DispositionRecord
- ``governor``     h(endpoint, account) -> the shared rate-governor state (storage/governor.py)
- ``meta``         format version, bytes_used, command and queue serials (8-byte big-endian)
- ``queue``        operations submitted for workers, in enqueue order (storage/queue.py);
                   a store written before it existed gets the empty table when opened
- ``schedule``     retired: written by older versions (waiting operations by time), read by
                   nothing; its rows are dropped when the store is opened (same format)

``RecoveryStore`` implements ``storage.base.Store`` and hands each mutation a
``storage.txn.WriteTxn`` (``storage.base.WriteTransaction``). Reads open a fresh snapshot
each; writes go through the process's single group-committing writer (storage/writer.py).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final, TypeVar

import lmdb

from recoverable.errors import (
    InvalidRequest,
    StorageUnavailable,
    StoreDamaged,
    UnsupportedRecordVersion,
)
from recoverable.records import CommandRecord, DispositionRecord, LeaseRecord, OperationRecord
from recoverable.storage import creation, integrity, queries, queue, retention, sources
from recoverable.storage.base import TABLES, Table, Touches
from recoverable.storage.keys import (
    META_BYTES,
    META_FORMAT,
    META_SERIAL,
    governor_key,
    operation_key,
    u64,
)
from recoverable.storage.leases import LeaseTokens, OwnerLock
from recoverable.storage.redact import redact_url
from recoverable.storage.registry import OpenStores, StoreOptions
from recoverable.storage.rows import RecordGetters
from recoverable.storage.txn import WriteState, WriteTxn
from recoverable.storage.writer import MapGuard, Writer
from recoverable.types import AccountBinding, CleanupResult, to_timestamp

if TYPE_CHECKING:
    from recoverable.storage.base import Store, WriteTransaction

__all__ = [
    "FORMAT_VERSION",
    "TABLES",
    "RecoveryStore",
    "Table",
    "WriteTxn",
    "governor_key",
    "operation_key",
    "redact_url",
    "register_url_store",
    "url_scheme",
]

Result = TypeVar("Result")

FORMAT_VERSION: Final = 1
_MiB: Final = 2**20

_OPEN_STORES: Final[OpenStores[RecoveryStore]] = OpenStores()

# Stores opened by URL (``postgresql://...``: storage/pg_store.py registers itself when
# ``recoverable.storage`` is imported and psycopg is installed), by URL scheme.
_URL_STORES: Final[dict[str, Callable[[str, StoreOptions], RecoveryStore]]] = {}


def register_url_store(
    schemes: Iterable[str], opener: Callable[[str, StoreOptions], RecoveryStore]
) -> None:
    """Make ``RecoveryStore.open(url)`` open URLs of these schemes with ``opener``."""
    for scheme in schemes:
        _URL_STORES[scheme] = opener


def url_scheme(path: object) -> str | None:
    """The scheme of a store URL (``postgresql``), None for a directory path."""
    if isinstance(path, str) and "://" in path:
        return path.split("://", 1)[0].lower()
    return None


class RecoveryStore(RecordGetters):
    """An LMDB recovery store directory, opened once per process.

    Open with :meth:`open`; use as a context manager or call :meth:`close`.
    Reads are synchronous and cheap (a fresh read transaction each). Writes go
    through the process's single group-committing writer: ``await store.write(fn)``
    from Trio, ``store.write_sync(fn)`` from plain threads.
    """

    def __init__(self, path: str, options: StoreOptions) -> None:
        # Use RecoveryStore.open(): it enforces one environment per process per path.
        self.path = path
        self.max_bytes = options.max_bytes
        self.max_record_bytes = options.max_record_bytes
        self.max_map_size = max(4 * options.max_bytes + 256 * _MiB, 64 * _MiB)
        self._closed = False
        self._guard = MapGuard()
        self._env: lmdb.Environment | None = None
        self._dbs: dict[Table, Any] = {}
        self._owner: OwnerLock | None = None
        self._tokens: LeaseTokens | None = None
        self._write_state: WriteState | None = None
        self._lock_identity: integrity.LockIdentity | None = None
        # Set once lock.mdb is found removed/replaced, or a damaged page is met: every
        # later read and write of this process is refused (fail closed for good).
        self._lock_replaced = False
        self._damage: str | None = None
        self._writer: Writer[WriteTxn] | None = None
        try:
            self._open_files(options)
        except BaseException:
            self._teardown()
            raise

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
        ``postgresql://user@host:port/db`` URL (the PostgreSQL store, storage/pg_store.py;
        ``initial_map_size`` does not apply to it).

        A second ``open`` of the same directory in this process returns the same
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
            opener = _URL_STORES.get(scheme)
            if opener is None:
                raise InvalidRequest(
                    f"no store for {scheme}:// URLs (the PostgreSQL store needs "
                    "recoverable[postgres]: pip install 'recoverable[postgres]')"
                )
            return opener(str(path), options)
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            real = os.path.realpath(path)
            os.chmod(real, 0o700)
        except OSError as exc:
            raise StorageUnavailable(f"cannot create the store directory: {exc}") from exc
        return _OPEN_STORES.open(real, options, cls)

    def _open_files(self, options: StoreOptions) -> None:
        initial = options.initial_map_size or min(
            self.max_map_size, 2 * options.max_bytes + 64 * _MiB
        )
        # Before LMDB maps the data file (a truncated one would end in a Bus error) and
        # before it creates a lock file (a removed one still used by another process).
        creation.check_data_file_settled(self.path)  # waits out another process creating it
        integrity.check_lock_before_open(self.path)
        try:
            self._env = env = lmdb.open(
                self.path,
                map_size=initial,
                subdir=True,
                max_dbs=len(TABLES),
                sync=True,
                metasync=True,
                writemap=False,
                readahead=False,
                mode=0o600,
                max_readers=1022,
                lock=True,
            )
            for name in ("data.mdb", "lock.mdb"):
                os.chmod(os.path.join(self.path, name), 0o600)
            identity = integrity.lock_identity(self.path)
            if identity is None:
                raise integrity.lock_replaced_error(self.path)
            self._lock_identity = identity
            # Before this process's first write transaction: no living owner may be
            # using another lock file (checked again once our own owner file exists).
            integrity.check_owner_locks(self.path, identity, owner_id=None)
            env.reader_check()
            with env.begin(write=True) as txn:
                for table in TABLES:
                    self._dbs[table] = env.open_db(table.encode(), txn=txn, create=True)
                meta = self._dbs["meta"]
                stored = txn.get(META_FORMAT, db=meta)
                if stored is None:
                    txn.put(META_FORMAT, FORMAT_VERSION.to_bytes(8, "big"), db=meta)
                    txn.put(META_BYTES, (0).to_bytes(8, "big"), db=meta)
                    txn.put(META_SERIAL, (0).to_bytes(8, "big"), db=meta)
                elif u64(stored) == FORMAT_VERSION:
                    self._drop_retired_schedule(txn)
        except lmdb.Error as exc:
            raise integrity.storage_error(exc, f"opening the store at {self.path}") from exc
        except OSError as exc:
            raise StorageUnavailable(f"cannot open the store at {self.path}: {exc}") from exc
        if stored is not None and u64(stored) != FORMAT_VERSION:
            raise UnsupportedRecordVersion(
                f"store format {u64(stored)} is not supported (this library reads "
                f"format {FORMAT_VERSION})"
            )
        try:
            self._owner = OwnerLock.create(
                os.path.join(self.path, "owners"), note=integrity.owner_note(identity)
            )
        except OSError as exc:
            raise StorageUnavailable(f"cannot create the owner lock: {exc}") from exc
        integrity.check_owner_locks(self.path, identity, self._owner.owner_id)
        self._tokens = LeaseTokens(self._owner)
        self._write_state = state = WriteState(
            self._dbs,
            max_bytes=self.max_bytes,
            max_record_bytes=self.max_record_bytes,
            owner_id=self._owner.owner_id,
            tokens=self._tokens,
        )
        self._writer = Writer(
            env,
            self._guard,
            lambda txn: WriteTxn(state, txn),
            max_map_size=self.max_map_size,
            name=f"recoverable-writer:{os.path.basename(self.path)}",
            begin_batch=self._begin_batch,
            end_batch=self._end_batch,
        )

    def _drop_retired_schedule(self, txn: lmdb.Transaction[bytes]) -> None:
        """Delete the rows an older version wrote to the retired ``schedule`` index (read
        by nothing), giving their bytes back to the quota. Nothing to do in a store
        written by this version: one stat."""
        schedule = self._dbs["schedule"]
        if not txn.stat(schedule)["entries"]:
            return
        freed = 0
        for key, raw in txn.cursor(db=schedule).iternext():
            freed += len(key) + len(raw)
        txn.drop(schedule, delete=False)
        meta = self._dbs["meta"]
        used = u64(txn.get(META_BYTES, db=meta))
        txn.put(META_BYTES, max(0, used - freed).to_bytes(8, "big"), db=meta)

    def _begin_batch(self) -> None:
        # Holding LMDB's write lock now: is it still the lock every process uses?
        # (One stat per commit batch; see integrity.py and docs/guarantees.md.)
        self._refuse_if_failed()
        self._check_lock()
        assert self._write_state is not None
        self._write_state.batch_bytes = None  # (re)read from meta by the first mutation

    def _refuse_if_failed(self) -> None:
        if self._lock_replaced:
            raise integrity.lock_replaced_error(self.path)
        if self._damage is not None:
            raise StoreDamaged(
                f"the store is damaged; every read and write is refused ({self._damage})"
            )

    def _note_damage(self, error: BaseException) -> None:
        if isinstance(error, StoreDamaged) and self._damage is None:
            self._damage = str(error)

    def _check_lock(self) -> None:
        if not self._lock_replaced and integrity.lock_identity(self.path) == self._lock_identity:
            return
        self._lock_replaced = True
        raise integrity.lock_replaced_error(self.path)

    def _end_batch(self, parent: lmdb.Transaction[bytes]) -> None:
        assert self._write_state is not None
        carried = self._write_state.batch_bytes
        if carried is not None:
            parent.put(META_BYTES, carried.to_bytes(8, "big"), db=self._dbs["meta"])

    def close(self) -> None:
        """Drop one reference; the last one drains the writer and closes the files."""
        if _OPEN_STORES.release(self.path, self):
            self._teardown()

    def _teardown(self) -> None:
        self._closed = True
        if self._writer is not None:
            self._writer.stop()
        if self._env is not None:
            with self._guard.exclusive():
                self._env.close()
        if self._owner is not None:
            self._owner.release()
        if self._tokens is not None:
            self._tokens.clear()

    def __enter__(self) -> RecoveryStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def owner_id(self) -> str:
        assert self._owner is not None
        return self._owner.owner_id

    # -- writing --

    def _live_writer(self) -> Writer[WriteTxn]:
        if self._closed or self._writer is None:
            raise StorageUnavailable("the store is closed")
        return self._writer

    async def write(self, fn: Callable[[WriteTxn], Result], *, touches: Touches = ()) -> Result:
        """Run ``fn`` in the next group commit; return its result once durable.

        ``touches`` (the operations ``fn`` reads) is a prefetch hint for stores whose
        reads are round trips (PostgreSQL); LMDB reads are memory reads: ignored here.

        The wait is shielded from cancellation (a queued write cannot be undone);
        an exception raised by ``fn`` rolls back ``fn``'s changes alone and is
        re-raised here. ``fn`` may run more than once (after a map resize), so it
        must not have side effects outside the transaction.
        """
        try:
            return await self._live_writer().write(fn, touches)
        except StoreDamaged as exc:
            self._note_damage(exc)
            raise

    def write_sync(self, fn: Callable[[WriteTxn], Result]) -> Result:
        """Blocking :meth:`write` for code that is not running under Trio."""
        try:
            return self._live_writer().write_sync(fn)
        except StoreDamaged as exc:
            self._note_damage(exc)
            raise

    # -- reading (the getters: RecordGetters over _get) --

    def _read(self, fn: Callable[[lmdb.Transaction[bytes]], Result]) -> Result:
        for _ in range(10):
            if self._closed:
                raise StorageUnavailable("the store is closed")
            self._refuse_if_failed()
            env = self._env
            assert env is not None
            try:
                with self._guard.shared():
                    if self._closed:
                        raise StorageUnavailable("the store is closed")
                    with env.begin(write=False) as txn:
                        return fn(txn)
            except lmdb.MapResizedError:
                # Another process grew the map past ours: adopt its size and read again.
                try:
                    with self._guard.exclusive():
                        if not self._closed:
                            env.set_mapsize(0)
                except lmdb.Error as exc:
                    raise integrity.storage_error(exc, "adopting a grown map") from exc
            except lmdb.Error as exc:
                error = integrity.storage_error(exc, "reading")
                self._note_damage(error)
                raise error from exc
        raise StorageUnavailable("the LMDB map kept being resized")

    def _environment(self) -> lmdb.Environment:
        if self._closed or self._env is None:
            raise StorageUnavailable("the store is closed")
        return self._env

    def _get(self, table: Table, key: bytes) -> bytes | None:
        return self._read(lambda txn: txn.get(key, db=self._dbs[table]))

    def get_raw_many(self, table: Table, keys: list[bytes]) -> list[bytes | None]:
        """``get_raw`` of every key, from one snapshot."""
        db = self._dbs[table]
        return self._read(lambda txn: [txn.get(key, db=db) for key in keys])

    def get_raw_rows(self, wanted: list[tuple[Table, bytes]]) -> list[bytes | None]:
        """``get_raw`` of every ``(table, key)``, from one snapshot."""
        dbs = self._dbs
        return self._read(lambda txn: [txn.get(key, db=dbs[table]) for table, key in wanted])

    def lease_is_live(self, lease: LeaseRecord, now: float | None = None) -> bool:
        """Not expired at ``now`` (None: ``time.time()``), and held by one of this store's
        active acquisitions or by a living other owner."""
        assert self._tokens is not None
        return self._tokens.is_live(lease, now)

    def last_command_serial(self) -> int:
        return u64(self._get("meta", META_SERIAL))

    def last_txnid(self) -> int:
        """LMDB's last committed transaction id (moves on every commit by any process)."""
        env = self._environment()
        self._refuse_if_failed()
        try:
            return env.info()["last_txnid"]
        except lmdb.Error as exc:
            raise integrity.storage_error(exc, "reading the environment info") from exc

    # -- queries (each from one snapshot; see storage/queries.py) --

    def payload_kinds(self, operation_ids: Iterable[str]) -> dict[str, frozenset[str]]:
        """Which payloads each operation has, from one snapshot (keys only: no value is
        copied, so a status of a large request stays cheap)."""
        ids = list(operation_ids)
        return self._read(lambda txn: queries.payload_kinds(txn, self._dbs, ids))

    def queued(self, *, after_serial: int = 0, limit: int = 1024) -> list[queue.QueueEntry]:
        """Queued operations with a serial above ``after_serial``, in order, at most
        ``limit`` (and ``queue.MAX_SCAN``) of them, from one snapshot."""
        return self._read(lambda txn: queue.scan(
            txn, self._dbs["queue"], after_serial=after_serial, limit=limit
        ))

    def workers(self) -> list[tuple[str, str, queue.WorkerRow]]:
        """Every worker row ``(owner id, token, row)``, live or not (``owner_is_live``)."""
        return self._read(lambda txn: queue.workers(txn, self._dbs["queue"]))

    def owner_is_live(self, owner_id: str) -> bool:
        """This store's own owner, or another whose lock a living process holds."""
        assert self._owner is not None
        if owner_id == self._owner.owner_id:
            return True
        return OwnerLock.is_held(self._owner.owners_dir, owner_id)

    def other_live_owners(self) -> list[str]:
        """The owners other than this one that a living process holds (this directory
        is open elsewhere)."""
        assert self._owner is not None
        owners_dir = self._owner.owners_dir
        try:
            names = os.listdir(owners_dir)
        except OSError:
            return []
        ids = [name[: -len(".lock")] for name in names if name.endswith(".lock")]
        return [
            owner for owner in ids
            if owner != self._owner.owner_id and OwnerLock.is_held(owners_dir, owner)
        ]

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
        return self._read(
            lambda txn: (txn.id(), queries.commands_after(txn, self._dbs, after_serial))
        )

    def inventory(
        self, account: AccountBinding | None = None, scope: str | None = None
    ) -> tuple[list[OperationRecord], list[str]]:
        """Readable records matching ``account``/``scope`` (None: any), and the ids of
        ALL unreadable operation records (whatever their account).

        With both ``account`` and ``scope`` given, only that scope is read, through the
        hosts index (cheap in a large store); the unreadable ids are then those of the
        indexed records of that scope that no longer decode.
        """
        return self._read(lambda txn: queries.inventory(txn, self._dbs, account, scope))

    def control_rows(self) -> tuple[dict[str, LeaseRecord], dict[str, CommandRecord]]:
        """Every readable lease and command, from one snapshot (for bulk status)."""
        return self._read(lambda txn: queries.control_rows(txn, self._dbs))

    def ids_by_job(
        self, account: AccountBinding, scope: str | None, job_id: str | None
    ) -> list[str]:
        """Operation ids with exactly this account, scope and job id (None is not "")."""
        return self._read(lambda txn: queries.ids_by_job(txn, self._dbs, account, scope, job_id))

    def dispositions(
        self, account: AccountBinding | None = None, scope: str | None = None
    ) -> list[DispositionRecord]:
        """Readable disposition markers matching ``account``/``scope`` (None: any)."""
        return self._read(lambda txn: queries.dispositions(txn, self._dbs, account, scope))

    # -- integrity and statistics --

    def stats(self) -> dict[str, int]:
        """Quota counters and, for this process, commits vs writes (group commit)."""

        def read(txn: lmdb.Transaction[bytes]) -> tuple[int, int]:
            entries = sum(
                txn.stat(self._dbs[table])["entries"] for table in TABLES if table != "meta"
            )
            return u64(txn.get(META_BYTES, db=self._dbs["meta"])), entries

        bytes_used, entries = self._read(read)
        return {
            "bytes_used": bytes_used,
            "max_bytes": self.max_bytes,
            "max_record_bytes": self.max_record_bytes,
            "entries": entries,
            **self._writer_stats(),
        }

    def _writer_stats(self) -> dict[str, int]:
        """This process's writer counters (and, for LMDB, the map's)."""
        writer = self._live_writer()
        map_size: int = self._read(lambda _txn: self._environment().info()["map_size"])
        return {
            "commits": writer.commits,
            "writes": writer.writes,
            "largest_batch": writer.largest_batch,
            "map_size": map_size,
            "map_growths": writer.map_growths,
            "map_adoptions": writer.map_adoptions,
            # Batches run again with a child transaction per mutation because one raised.
            "isolated_reruns": writer.isolated_reruns,
        }

    def check_integrity(self) -> list[str]:
        """Strictly decode every record of every table; describe each one that fails.

        Also checks keys against records, index entries against their records and
        the ``bytes_used`` counter against the stored sizes (``integrity.check_records``).
        """
        return self._read(lambda txn: integrity.check_records(txn, self._dbs))

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
