"""The LMDB engine: one environment per directory, one writer per process.

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
- ``sources``      the source manifest and its index (storage/sources.py)
- ``schedule``     retired: written by older versions (waiting operations by time), read by
                   nothing; its rows are dropped when the store is opened (same format)

Reads open a fresh read transaction each (the snapshot of :meth:`LmdbEngine.read`);
writes go through the process's single group-committing writer thread
(``storage/writer.py``), each mutation on a ``storage.txn.WriteTxn``. Owners are lock
files in ``owners/`` (``storage/leases.py``); a replaced lock file or a damaged page
refuses every later read and write of this process (``storage/integrity.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Final, TypeVar

import lmdb

from recoverable.errors import StorageUnavailable, StoreDamaged, UnsupportedRecordVersion
from recoverable.records import CommandRecord, LeaseRecord
from recoverable.storage import creation, integrity, queries, queue
from recoverable.storage.base import TABLES, Table, Touches
from recoverable.storage.keys import META_BYTES, META_FORMAT, META_SERIAL, u64
from recoverable.storage.leases import LeaseTokens, OwnerLock
from recoverable.storage.registry import StoreOptions
from recoverable.storage.txn import WriteState, WriteTxn
from recoverable.storage.writer import MapGuard, Writer
from recoverable.types import AccountBinding

__all__ = ["FORMAT_VERSION", "LmdbEngine"]

Result = TypeVar("Result")

FORMAT_VERSION: Final = 1
_MiB: Final = 2**20


class LmdbEngine:
    """An LMDB store directory (see the module docstring); ``storage.engine.StoreEngine``."""

    advisory_read_seconds = 0.0  # reads are memory reads: nothing is worth keeping
    read_threads = 0  # ... and cost less than a hop to a worker thread: they run inline

    def __init__(self, path: str, options: StoreOptions) -> None:
        self.path = path
        self.max_bytes = options.max_bytes
        self.max_record_bytes = options.max_record_bytes
        self.max_map_size = max(4 * options.max_bytes + 256 * _MiB, 64 * _MiB)
        self._closed = False
        self._guard = MapGuard()
        self._env: lmdb.Environment | None = None
        self.tables: dict[Table, Any] = {}
        self._owner: OwnerLock | None = None
        self._tokens: LeaseTokens | None = None
        self._write_state: WriteState | None = None
        self._lock_identity: integrity.LockIdentity | None = None
        # Set once lock.mdb is found removed/replaced, or a damaged page is met: every
        # later read and write of this process is refused (fail closed for good).
        self._lock_replaced = False
        self._damage: str | None = None
        self.writer: Writer[WriteTxn] | None = None
        try:
            self._open_files(options)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"<LmdbEngine {self.path}>"

    # -- opening and closing --

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
                    self.tables[table] = env.open_db(table.encode(), txn=txn, create=True)
                meta = self.tables["meta"]
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
            self.tables,
            max_bytes=self.max_bytes,
            max_record_bytes=self.max_record_bytes,
            owner_id=self._owner.owner_id,
            tokens=self._tokens,
        )
        self.writer = Writer(
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
        schedule = self.tables["schedule"]
        if not txn.stat(schedule)["entries"]:
            return
        freed = 0
        for key, raw in txn.cursor(db=schedule).iternext():
            freed += len(key) + len(raw)
        txn.drop(schedule, delete=False)
        meta = self.tables["meta"]
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
            parent.put(META_BYTES, carried.to_bytes(8, "big"), db=self.tables["meta"])

    def close(self) -> None:
        self._closed = True
        if self.writer is not None:
            self.writer.stop()
        if self._env is not None:
            with self._guard.exclusive():
                self._env.close()
        if self._owner is not None:
            self._owner.release()
        if self._tokens is not None:
            self._tokens.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def owner_id(self) -> str:
        assert self._owner is not None
        return self._owner.owner_id

    # -- writing --

    def _live_writer(self) -> Writer[WriteTxn]:
        if self._closed or self.writer is None:
            raise StorageUnavailable("the store is closed")
        return self.writer

    async def write(self, fn: Callable[[WriteTxn], Result], touches: Touches) -> Result:
        # ``touches``: a prefetch hint for engines whose reads are round trips; LMDB
        # reads are memory reads.
        try:
            return await self._live_writer().write(fn, touches)
        except StoreDamaged as exc:
            self._note_damage(exc)
            raise

    def write_sync(self, fn: Callable[[WriteTxn], Result]) -> Result:
        try:
            return self._live_writer().write_sync(fn)
        except StoreDamaged as exc:
            self._note_damage(exc)
            raise

    # -- reading --

    def read(self, fn: Callable[[lmdb.Transaction[bytes]], Result]) -> Result:
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

    def get(self, table: Table, key: bytes) -> bytes | None:
        db = self.tables[table]
        return self.read(lambda txn: txn.get(key, db=db))

    def get_raw_many(self, table: Table, keys: list[bytes]) -> list[bytes | None]:
        db = self.tables[table]
        return self.read(lambda txn: [txn.get(key, db=db) for key in keys])

    def get_raw_rows(self, wanted: list[tuple[Table, bytes]]) -> list[bytes | None]:
        dbs = self.tables
        return self.read(lambda txn: [txn.get(key, db=dbs[table]) for table, key in wanted])

    def ids_by_job(
        self, account: AccountBinding, scope: str | None, job_id: str | None
    ) -> list[str]:
        return self.read(
            lambda txn: queries.ids_by_job(txn, self.tables, account, scope, job_id)
        )

    def queued(self, *, after_serial: int, limit: int) -> list[queue.QueueEntry]:
        return self.read(lambda txn: queue.scan(
            txn, self.tables["queue"], after_serial=after_serial, limit=limit
        ))

    def commands_snapshot(self, *, after_serial: int) -> tuple[int, list[CommandRecord]]:
        # The snapshot's own id, not last_txnid(): see RecoveryStore.commands_snapshot.
        return self.read(
            lambda txn: (txn.id(), queries.commands_after(txn, self.tables, after_serial))
        )

    def reserve_claims(self, operation_ids: list[str], limit: int) -> list[str]:
        """Nothing to reserve: the writes are serialized (one writer lock for every
        process), so each lease acquisition sees the one before and its fence decides."""
        return operation_ids[:max(0, limit)]

    def last_txnid(self) -> int:
        """LMDB's last committed transaction id (moves on every commit by any process)."""
        env = self._environment()
        self._refuse_if_failed()
        try:
            return env.info()["last_txnid"]
        except lmdb.Error as exc:
            raise integrity.storage_error(exc, "reading the environment info") from exc

    # -- owners --

    def lease_is_live(self, lease: LeaseRecord, now: float | None) -> bool:
        assert self._tokens is not None
        return self._tokens.is_live(lease, now)

    def owner_is_live(self, owner_id: str) -> bool:
        """This engine's own owner, or another whose lock a living process holds."""
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

    # -- statistics --

    def writer_stats(self) -> dict[str, int]:
        """This process's writer counters and the map's."""
        writer = self._live_writer()
        map_size: int = self.read(lambda _txn: self._environment().info()["map_size"])
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
