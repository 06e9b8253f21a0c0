"""The LMDB recovery store: one environment per directory, one writer per process.

Tables (LMDB named databases):

- ``operations``   op_id -> OperationRecord
- ``payloads``     op_id + b"\\0" + kind -> raw bytes (kind: body / request / completion)
- ``commands``     op_id -> CommandRecord (the latest lifecycle command for the operation)
- ``leases``       op_id -> LeaseRecord
- ``schedule``     sortable(next_attempt_at) + op_id -> b"" (waiting operations only)
- ``hosts``        h(account) + h(scope) + h(job_id) + op_id -> b"" (every readable operation)
- ``dispositions`` op_id -> DispositionRecord
- ``governor``     h(endpoint, account) -> the shared rate-governor state (actors/governor.py:
                   the 429 pause and the request/token bucket levels of one endpoint+account)
- ``meta``         format version, bytes_used, command serial (8-byte big-endian integers)

Every put/delete made through :class:`WriteTxn` adjusts ``bytes_used`` (key +
value lengths, all tables except ``meta``) in the same transaction, so quotas are
enforced from a counter, never by scanning, and nothing is ever evicted.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any, Final, Literal, TypeVar, get_args

import lmdb
import msgspec
from recoverable.storage import codec, integrity
from recoverable.storage.leases import OwnerLock
from recoverable.storage.writer import MapGuard, MutationContext, Writer

from recoverable.errors import (
    CorruptRecord,
    FenceMismatch,
    InvalidRequest,
    StorageLimitExceeded,
    StorageUnavailable,
    StoreDamaged,
    UnsupportedRecordVersion,
)
from recoverable.records import (
    CommandKind,
    CommandRecord,
    DispositionRecord,
    LeaseRecord,
    OperationRecord,
    PayloadKind,
)
from recoverable.types import AccountBinding, CleanupResult, to_timestamp

__all__ = [
    "FORMAT_VERSION", "TABLES", "RecoveryStore", "Table", "WriteTxn", "governor_key",
]

T = TypeVar("T")

FORMAT_VERSION: Final = 1
Table = Literal[
    "operations", "payloads", "commands", "leases", "schedule", "hosts", "dispositions",
    "governor", "meta",
]
TABLES: Final[tuple[Table, ...]] = get_args(Table)
PAYLOAD_KINDS: Final[frozenset[str]] = frozenset(get_args(PayloadKind))
COMMAND_KINDS: Final[frozenset[str]] = frozenset(get_args(CommandKind))

_META_FORMAT: Final = b"format_version"
_META_BYTES: Final = b"bytes_used"
_META_SERIAL: Final = b"command_serial"
_MAX_ID_BYTES: Final = 400  # keeps every key below LMDB's 511-byte limit
_HASH_BYTES: Final = 16
_MiB: Final = 2**20

_MISSING: Final = object()

_open_lock = threading.Lock()
_open_stores: dict[str, RecoveryStore] = {}


# -- keys -------------------------------------------------------------------------


def operation_key(operation_id: str) -> bytes:
    """The key of an operation id; ``InvalidRequest`` if it cannot be a key."""
    if not isinstance(operation_id, str) or not operation_id:
        raise InvalidRequest("operation_id must be a non-empty string")
    return _operation_key(operation_id)


@functools.lru_cache(maxsize=16384)
def _operation_key(operation_id: str) -> bytes:
    try:
        key = operation_id.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest("operation_id must be valid Unicode text") from exc
    if len(key) > _MAX_ID_BYTES or b"\0" in key:
        raise InvalidRequest(
            f"operation_id must be at most {_MAX_ID_BYTES} UTF-8 bytes without NUL",
            operation_id=operation_id[:64],
        )
    return key


def payload_key(operation_id: str, kind: str) -> bytes:
    if kind not in PAYLOAD_KINDS:
        raise InvalidRequest(f"unknown payload kind {kind!r}", operation_id=operation_id)
    return operation_key(operation_id) + b"\0" + kind.encode()


def _sortable_time(t: float) -> bytes:
    """8 bytes whose unsigned big-endian order is the numeric order of ``t``."""
    if not isinstance(t, float | int) or not math.isfinite(t):
        raise InvalidRequest(f"next_attempt_at must be a finite number, not {t!r}")
    (bits,) = struct.unpack(">Q", struct.pack(">d", float(t)))
    bits = bits ^ 0xFFFFFFFFFFFFFFFF if bits >> 63 else bits | (1 << 63)
    return struct.pack(">Q", bits)


def _time_from_sortable(raw: bytes) -> float:
    (bits,) = struct.unpack(">Q", raw)
    bits = bits & ~(1 << 63) if bits >> 63 else bits ^ 0xFFFFFFFFFFFFFFFF
    (t,) = struct.unpack(">d", struct.pack(">Q", bits))
    return float(t)


def schedule_key(record: OperationRecord) -> bytes | None:
    if record.phase != "waiting" or record.next_attempt_at is None:
        return None
    return _sortable_time(record.next_attempt_at) + operation_key(record.operation_id)


@functools.lru_cache(maxsize=16384)
def _h(*parts: str | None) -> bytes:
    """A fixed-size digest of tagged, length-prefixed parts (None differs from "")."""
    digest = hashlib.blake2b(digest_size=_HASH_BYTES)
    for part in parts:
        if part is None:
            digest.update(b"\0")
        else:
            data = part.encode("utf-8", "surrogatepass")
            digest.update(b"\1" + len(data).to_bytes(8, "big") + data)
    return digest.digest()


def _hosts_prefix(
    account: AccountBinding, scope: str | None, job_id: str | None = None, *, with_job: bool
) -> bytes:
    prefix = _h(account.account_id, account.source) + _h(scope)
    return prefix + _h(job_id) if with_job else prefix


def hosts_key(record: OperationRecord) -> bytes:
    return _hosts_prefix(
        record.account, record.scope, record.job_id, with_job=True
    ) + operation_key(record.operation_id)


def governor_key(endpoint_id: str, account: AccountBinding) -> bytes:
    """The key of the shared rate-governor row of one endpoint and account (a digest:
    no account identifier is stored in a key)."""
    return _h("governor", endpoint_id, account.account_id, account.source)


def _key_str(raw: bytes) -> str:
    """A stored key back to text (bytes that are not UTF-8 survive as surrogates)."""
    return raw.decode("utf-8", "surrogateescape")


def _u64(value: bytes | None) -> int:
    return 0 if value is None else int.from_bytes(value, "big")


def _sort_operations(
    rows: Iterable[tuple[bytes, bytes]], account: AccountBinding | None, scope: str | None
) -> tuple[list[OperationRecord], list[str]]:
    """Readable records matching account/scope (None: any), and every unreadable id."""
    readable: list[OperationRecord] = []
    unreadable: list[str] = []
    for key, raw in rows:
        op_id = _key_str(key)
        try:
            record = codec.decode_operation(raw, operation_id=op_id)
        except (CorruptRecord, UnsupportedRecordVersion):
            unreadable.append(op_id)
            continue
        if account is not None and record.account != account:
            continue
        if scope is not None and record.scope != scope:
            continue
        readable.append(record)
    return readable, unreadable


def _decode_table(table: Table, data: bytes, operation_id: str | None) -> Any:
    if table == "operations":
        return codec.decode_operation(data, operation_id=operation_id)
    if table == "commands":
        return codec.decode_command(data, operation_id=operation_id)
    if table == "leases":
        return codec.decode_lease(data, operation_id=operation_id)
    if table == "dispositions":
        return codec.decode_disposition(data, operation_id=operation_id)
    raise AssertionError(table)


# -- the write transaction --------------------------------------------------------


class WriteTxn(MutationContext):
    """What a mutation receives: typed table helpers over one nested LMDB transaction.

    Reads see the batch's earlier writes. Every helper that writes several keys is
    atomic (its own nested transaction): when it raises, it changed nothing.
    Helpers refuse to overwrite or delete a stored record that is unreadable
    (``CorruptRecord`` / ``UnsupportedRecordVersion``).
    """

    def __init__(self, store: RecoveryStore, txn: lmdb.Transaction[bytes]) -> None:
        super().__init__()
        self._store = store
        self._txn = txn
        self._dbs = store._dbs
        running = store._batch_bytes
        self._bytes_used = (
            running if running is not None else _u64(txn.get(_META_BYTES, db=self._dbs["meta"]))
        )
        self._bytes_dirty = False
        self._cache: dict[tuple[str, bytes], bytes | None] = {}
        self._decoded: dict[tuple[str, bytes], tuple[bytes, Any]] = {}
        self._broken = False

    # -- plumbing --

    @property
    def owner_id(self) -> str:
        return self._store.owner_id

    @property
    def bytes_used(self) -> int:
        return self._bytes_used

    def finish(self) -> None:
        if self._broken:
            raise StorageUnavailable(
                "a storage helper failed inside this mutation and the mutation went on; "
                "it was rolled back whole"
            )
        # The counter is carried in memory to the next mutation of the batch and
        # written once, before the batch commits (RecoveryStore._end_batch).
        self._store._batch_bytes = self._bytes_used
        self._bytes_dirty = False

    @contextlib.contextmanager
    def _atomic(self) -> Iterator[None]:
        """A composite helper (several keys) is all or nothing.

        No nested transaction is needed for that: a mutation that raises is rolled
        back whole by the writer. If a mutation catches a composite helper's error
        and carries on, the partial writes would stay — so the mutation is marked
        and ``finish`` refuses to commit it (fail closed).
        """
        try:
            yield
        except BaseException:
            self._broken = True
            raise

    def _lmdb(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except lmdb.MapFullError:
            self.map_full = True  # the writer grows the map and runs the batch again
            raise
        except lmdb.TxnFullError:
            self.txn_full = True
            raise
        except lmdb.Error as exc:
            raise integrity.storage_error(exc, "writing") from exc

    def _lmdb_error(self, exc: lmdb.Error) -> Exception:
        if isinstance(exc, lmdb.MapFullError):
            self.map_full = True  # the writer grows the map and runs the batch again
            return exc
        if isinstance(exc, lmdb.TxnFullError):
            self.txn_full = True
            return exc
        return integrity.storage_error(exc, "writing")

    def _get(self, table: Table, key: bytes) -> bytes | None:
        # Values read or written by this mutation are remembered: composite helpers read
        # the same keys several times (old record, quota deltas, index entries).
        cached = self._cache.get((table, key), _MISSING)
        if cached is not _MISSING:
            return cached  # type: ignore[return-value]
        try:
            value: bytes | None = self._txn.get(key, db=self._dbs[table])
        except lmdb.Error as exc:
            raise self._lmdb_error(exc) from exc
        self._cache[(table, key)] = value
        return value

    def _put(self, table: Table, key: bytes, value: bytes) -> None:
        store = self._store
        if len(value) > store.max_record_bytes:
            raise StorageLimitExceeded(
                f"a {table} value of {len(value)} bytes exceeds max_record_bytes="
                f"{store.max_record_bytes}"
            )
        db = self._dbs[table]
        cached = self._cache.get((table, key), _MISSING)
        try:
            if cached is _MISSING:
                old: bytes | None = self._txn.replace(key, value, db=db)  # one LMDB call
            else:
                old = cached  # type: ignore[assignment]
        except lmdb.Error as exc:
            raise self._lmdb_error(exc) from exc
        delta = len(value) - len(old) if old is not None else len(key) + len(value)
        if delta > 0 and self._bytes_used + delta > store.max_bytes:
            if cached is _MISSING:  # undo the replace: a refused write changes nothing
                try:
                    if old is None:
                        self._txn.delete(key, db=db)
                    else:
                        self._txn.put(key, old, db=db)
                except lmdb.Error as exc:
                    raise self._lmdb_error(exc) from exc
            raise StorageLimitExceeded(
                f"the store would hold {self._bytes_used + delta} bytes; max_bytes="
                f"{store.max_bytes}"
            )
        if cached is not _MISSING:
            try:
                self._txn.put(key, value, db=db)
            except lmdb.Error as exc:
                raise self._lmdb_error(exc) from exc
        self._cache[(table, key)] = value
        self._bytes_used += delta
        self._bytes_dirty = True

    def _delete(self, table: Table, key: bytes) -> bool:
        cached = self._cache.get((table, key), _MISSING)
        if cached is None:
            return False
        try:
            if cached is _MISSING:
                old: bytes | None = self._txn.pop(key, db=self._dbs[table])  # one LMDB call
            else:
                old = cached  # type: ignore[assignment]
                self._txn.delete(key, db=self._dbs[table])
        except lmdb.Error as exc:
            raise self._lmdb_error(exc) from exc
        self._cache[(table, key)] = None
        if old is None:
            return False
        self._bytes_used -= len(key) + len(old)
        self._bytes_dirty = True
        return True

    def _counter_next(self, name: bytes) -> int:
        value = _u64(self._get("meta", name)) + 1
        raw = value.to_bytes(8, "big")
        self._lmdb(lambda: self._txn.put(name, raw, db=self._dbs["meta"]))
        self._cache[("meta", name)] = raw
        return value

    def _read_record(self, table: Table, operation_id: str) -> Any:
        key = operation_key(operation_id)
        raw = self._get(table, key)
        if raw is None:
            return None
        seen = self._decoded.get((table, key))
        if seen is not None and seen[0] is raw:
            return seen[1]  # records are frozen: the decoded value can be shared
        record = _decode_table(table, raw, operation_id)
        self._decoded[(table, key)] = (raw, record)
        return record

    def put_raw(self, table: Table, key: bytes, value: bytes) -> None:
        """Store bytes as they are (fixtures, repair tools): no decoding, no indexes.

        Still counted in ``bytes_used`` and limited by the quotas.
        """
        if table == "meta":
            raise InvalidRequest("the meta table is written by the store only")
        self._put(table, key, value)

    def get_raw(self, table: Table, key: bytes) -> bytes | None:
        return self._get(table, key)

    # -- operations --

    def get_operation(self, operation_id: str) -> OperationRecord | None:
        """The record, ``None`` if missing; unreadable records raise their typed error."""
        record: OperationRecord | None = self._read_record("operations", operation_id)
        return record

    def put_operation(self, record: OperationRecord, *, expect_fence: int | None = None) -> None:
        """Write ``record``, keeping the schedule and hosts indexes in step.

        With ``expect_fence``: ``FenceMismatch`` unless the stored record exists and
        its ``fence`` equals it (a stale owner can never overwrite a newer one).
        """
        key = operation_key(record.operation_id)
        data = codec.encode(record)
        new_schedule = schedule_key(record)
        with self._atomic():
            old = self.get_operation(record.operation_id)
            if expect_fence is not None and (old is None or old.fence != expect_fence):
                raise FenceMismatch(
                    f"expected fence {expect_fence}, found "
                    f"{'no record' if old is None else old.fence}",
                    operation_id=record.operation_id,
                )
            new_hosts = hosts_key(record)
            old_schedule = schedule_key(old) if old is not None else None
            old_hosts = hosts_key(old) if old is not None else None
            if old_schedule is not None and old_schedule != new_schedule:
                self._delete("schedule", old_schedule)
            if old_hosts is not None and old_hosts != new_hosts:
                self._delete("hosts", old_hosts)
            self._put("operations", key, data)
            if new_schedule is not None and new_schedule != old_schedule:
                self._put("schedule", new_schedule, b"")
            if new_hosts != old_hosts:
                self._put("hosts", new_hosts, b"")

    def delete_operation(self, operation_id: str, *, expect_fence: int | None = None) -> bool:
        """Delete the record and its index entries (not its payloads, lease, command)."""
        with self._atomic():
            old = self.get_operation(operation_id)
            if expect_fence is not None and (old is None or old.fence != expect_fence):
                raise FenceMismatch(
                    f"expected fence {expect_fence}, found "
                    f"{'no record' if old is None else old.fence}",
                    operation_id=operation_id,
                )
            if old is None:
                return False
            self._unindex(old)
            self._delete("operations", operation_key(operation_id))
            return True

    def _unindex(self, old: OperationRecord) -> None:
        old_schedule = schedule_key(old)
        if old_schedule is not None:
            self._delete("schedule", old_schedule)
        self._delete("hosts", hosts_key(old))

    # -- payloads --

    def get_payload(self, operation_id: str, kind: PayloadKind) -> bytes | None:
        return self._get("payloads", payload_key(operation_id, kind))

    def put_payload(self, operation_id: str, kind: PayloadKind, data: bytes) -> None:
        if not isinstance(data, bytes):
            raise InvalidRequest("payload data must be bytes", operation_id=operation_id)
        self._put("payloads", payload_key(operation_id, kind), data)

    def delete_payload(self, operation_id: str, kind: PayloadKind) -> bool:
        return self._delete("payloads", payload_key(operation_id, kind))

    # -- commands --

    def get_command(self, operation_id: str) -> CommandRecord | None:
        record: CommandRecord | None = self._read_record("commands", operation_id)
        return record

    def put_command(self, operation_id: str, kind: CommandKind, now: float) -> CommandRecord:
        """Write a lifecycle command with the next store-wide serial.

        ``cancel`` is permanent: a later ``suspend`` does not replace it (the stored
        cancel command is returned unchanged).
        """
        if kind not in COMMAND_KINDS:
            raise InvalidRequest(f"unknown command kind {kind!r}", operation_id=operation_id)
        key = operation_key(operation_id)
        with self._atomic():
            existing = self.get_command(operation_id)
            if existing is not None and existing.kind == "cancel" and kind != "cancel":
                return existing
            record = CommandRecord(
                operation_id=operation_id,
                kind=kind,
                issued_at=now,
                serial=self._counter_next(_META_SERIAL),
            )
            self._put("commands", key, codec.encode(record))
            return record

    def delete_command(self, operation_id: str) -> bool:
        if self.get_command(operation_id) is None:
            return False
        return self._delete("commands", operation_key(operation_id))

    # -- leases --

    def get_lease(self, operation_id: str) -> LeaseRecord | None:
        record: LeaseRecord | None = self._read_record("leases", operation_id)
        return record

    def put_lease(self, lease: LeaseRecord) -> None:
        self.get_lease(lease.operation_id)  # refuse to overwrite an unreadable lease
        self._put("leases", operation_key(lease.operation_id), codec.encode(lease))

    def delete_lease(self, operation_id: str) -> bool:
        if self.get_lease(operation_id) is None:
            return False
        return self._delete("leases", operation_key(operation_id))

    def lease_is_live(self, lease: LeaseRecord) -> bool:
        return self._store.lease_is_live(lease)

    def register_token(self, token: str) -> None:
        """Mark a lease token of this store as active now; undone if this run is discarded.

        Registered *before* the commit: a lease row naming this owner is only ever
        visible after its commit, so an early registration cannot make a missing
        lease look live, while a late one would let a reader see our own fresh
        lease as dead for a moment.
        """
        self._store._tokens_add(token)
        self.on_abort(lambda: self._store._tokens_discard(token))

    def unregister_token(self, token: str) -> None:
        self._store._tokens_discard(token)

    # -- dispositions --

    def get_disposition(self, operation_id: str) -> DispositionRecord | None:
        record: DispositionRecord | None = self._read_record("dispositions", operation_id)
        return record

    def put_disposition(self, record: DispositionRecord) -> None:
        self.get_disposition(record.operation_id)  # refuse over an unreadable one
        self._put("dispositions", operation_key(record.operation_id), codec.encode(record))

    def delete_disposition(self, operation_id: str) -> bool:
        if self.get_disposition(operation_id) is None:
            return False
        return self._delete("dispositions", operation_key(operation_id))


# -- the store ----------------------------------------------------------------------


class _Options(msgspec.Struct, frozen=True):
    max_bytes: int
    max_record_bytes: int
    initial_map_size: int | None


class RecoveryStore:
    """An LMDB recovery store directory, opened once per process.

    Open with :meth:`open`; use as a context manager or call :meth:`close`.
    Reads are synchronous and cheap (a fresh read transaction each). Writes go
    through the process's single group-committing writer: ``await store.write(fn)``
    from Trio, ``store.write_sync(fn)`` from plain threads.
    """

    _env: lmdb.Environment
    _dbs: dict[Table, Any]

    def __init__(self, path: str, options: _Options) -> None:
        # Use RecoveryStore.open(): it enforces one environment per process per path.
        self.path = path
        self._options = options
        self.max_bytes = options.max_bytes
        self.max_record_bytes = options.max_record_bytes
        self.max_map_size = max(4 * options.max_bytes + 256 * _MiB, 64 * _MiB)
        self._refs = 1
        self._closed = False
        self._guard = MapGuard()
        self._tokens: set[str] = set()
        self._batch_bytes: int | None = None  # bytes_used carried across a batch (writer)
        self._tokens_lock = threading.Lock()
        self._owner: OwnerLock | None = None
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
        """Open (creating if needed) the store at ``path``.

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
        options = _Options(max_bytes, max_record_bytes, initial_map_size)
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            real = os.path.realpath(path)
            os.chmod(real, 0o700)
        except OSError as exc:
            raise StorageUnavailable(f"cannot create the store directory: {exc}") from exc
        with _open_lock:
            existing = _open_stores.get(real)
            if existing is not None:
                if existing._options != options:
                    raise ValueError(
                        f"the store at {real} is already open in this process with "
                        f"different options ({existing._options} != {options})"
                    )
                existing._refs += 1
                return existing
            store = cls(real, options)
            _open_stores[real] = store
            return store

    def _open_files(self, options: _Options) -> None:
        initial = options.initial_map_size or min(
            self.max_map_size, 2 * options.max_bytes + 64 * _MiB
        )
        # Before LMDB maps the data file (a truncated one would end in a Bus error) and
        # before it creates a lock file (a removed one still used by another process).
        integrity.check_data_file(self.path)
        integrity.check_lock_before_open(self.path)
        try:
            self._env = lmdb.open(
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
            self._env.reader_check()
            self._dbs = {}
            with self._env.begin(write=True) as txn:
                for table in TABLES:
                    self._dbs[table] = self._env.open_db(table.encode(), txn=txn, create=True)
                meta = self._dbs["meta"]
                stored = txn.get(_META_FORMAT, db=meta)
                if stored is None:
                    txn.put(_META_FORMAT, FORMAT_VERSION.to_bytes(8, "big"), db=meta)
                    txn.put(_META_BYTES, (0).to_bytes(8, "big"), db=meta)
                    txn.put(_META_SERIAL, (0).to_bytes(8, "big"), db=meta)
        except lmdb.Error as exc:
            raise integrity.storage_error(exc, f"opening the store at {self.path}") from exc
        except OSError as exc:
            raise StorageUnavailable(f"cannot open the store at {self.path}: {exc}") from exc
        if stored is not None and _u64(stored) != FORMAT_VERSION:
            raise UnsupportedRecordVersion(
                f"store format {_u64(stored)} is not supported (this library reads "
                f"format {FORMAT_VERSION})"
            )
        try:
            self._owner = OwnerLock.create(
                os.path.join(self.path, "owners"), note=integrity.owner_note(identity)
            )
        except OSError as exc:
            raise StorageUnavailable(f"cannot create the owner lock: {exc}") from exc
        integrity.check_owner_locks(self.path, identity, self._owner.owner_id)
        self._writer = Writer(
            self._env,
            self._guard,
            lambda txn: WriteTxn(self, txn),
            max_map_size=self.max_map_size,
            name=f"recoverable-writer:{os.path.basename(self.path)}",
            begin_batch=self._begin_batch,
            end_batch=self._end_batch,
        )

    def _begin_batch(self) -> None:
        # Holding LMDB's write lock now: is it still the lock every process uses?
        # (One stat per commit batch; see integrity.py and docs/guarantees.md.)
        self._refuse_if_failed()
        self._check_lock()
        self._batch_bytes = None  # (re)read from meta by the batch's first mutation

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
        if self._batch_bytes is not None:
            parent.put(_META_BYTES, self._batch_bytes.to_bytes(8, "big"), db=self._dbs["meta"])

    def close(self) -> None:
        """Drop one reference; the last one drains the writer and closes the files."""
        with _open_lock:
            if self._closed:
                return
            self._refs -= 1
            if self._refs > 0:
                return
            self._closed = True
            if _open_stores.get(self.path) is self:
                del _open_stores[self.path]
        self._teardown()

    def _teardown(self) -> None:
        self._closed = True
        if self._writer is not None:
            self._writer.stop()
        env = getattr(self, "_env", None)
        if env is not None:
            with self._guard.exclusive():
                env.close()
        if self._owner is not None:
            self._owner.release()
        with self._tokens_lock:
            self._tokens.clear()

    def __enter__(self) -> RecoveryStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
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

    async def write(self, fn: Callable[[WriteTxn], T]) -> T:
        """Run ``fn`` in the next group commit; return its result once durable.

        The wait is shielded from cancellation (a queued write cannot be undone);
        an exception raised by ``fn`` rolls back ``fn``'s changes alone and is
        re-raised here. ``fn`` may run more than once (after a map resize), so it
        must not have side effects outside the transaction.
        """
        try:
            return await self._live_writer().write(fn)
        except StoreDamaged as exc:
            self._note_damage(exc)
            raise

    def write_sync(self, fn: Callable[[WriteTxn], T]) -> T:
        """Blocking :meth:`write` for code that is not running under Trio."""
        try:
            return self._live_writer().write_sync(fn)
        except StoreDamaged as exc:
            self._note_damage(exc)
            raise

    # -- reading --

    def _read(self, fn: Callable[[lmdb.Transaction[bytes]], T]) -> T:
        for _ in range(10):
            if self._closed:
                raise StorageUnavailable("the store is closed")
            self._refuse_if_failed()
            try:
                with self._guard.shared():
                    if self._closed:
                        raise StorageUnavailable("the store is closed")
                    with self._env.begin(write=False) as txn:
                        return fn(txn)
            except lmdb.MapResizedError:
                # Another process grew the map past ours: adopt its size and read again.
                try:
                    with self._guard.exclusive():
                        if not self._closed:
                            self._env.set_mapsize(0)
                except lmdb.Error as exc:
                    raise integrity.storage_error(exc, "adopting a grown map") from exc
            except lmdb.Error as exc:
                error = integrity.storage_error(exc, "reading")
                self._note_damage(error)
                raise error from exc
        raise StorageUnavailable("the LMDB map kept being resized")

    def _get(self, table: Table, key: bytes) -> bytes | None:
        return self._read(lambda txn: txn.get(key, db=self._dbs[table]))

    def _get_record(self, table: Table, operation_id: str) -> Any:
        raw = self._get(table, operation_key(operation_id))
        return None if raw is None else _decode_table(table, raw, operation_id)

    def get_raw(self, table: Table, key: bytes) -> bytes | None:
        """The stored bytes of any key (diagnostics and tests)."""
        return self._get(table, key)

    def get_operation(self, operation_id: str) -> OperationRecord | None:
        record: OperationRecord | None = self._get_record("operations", operation_id)
        return record

    def get_payload(self, operation_id: str, kind: PayloadKind) -> bytes | None:
        return self._get("payloads", payload_key(operation_id, kind))

    def get_command(self, operation_id: str) -> CommandRecord | None:
        record: CommandRecord | None = self._get_record("commands", operation_id)
        return record

    def payload_kinds(self, operation_ids: Iterable[str]) -> dict[str, frozenset[str]]:
        """Which payloads each operation has, from one snapshot (keys only: no value is
        copied, so a status of a large request stays cheap)."""
        ids = list(operation_ids)

        def scan(txn: lmdb.Transaction[bytes]) -> dict[str, frozenset[str]]:
            cursor = txn.cursor(db=self._dbs["payloads"])
            return {
                op_id: frozenset(
                    kind for kind in PAYLOAD_KINDS if cursor.set_key(payload_key(op_id, kind))
                )
                for op_id in ids
            }

        return self._read(scan)

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

        def scan(txn: lmdb.Transaction[bytes]) -> tuple[int, list[CommandRecord]]:
            found = []
            for key, raw in txn.cursor(db=self._dbs["commands"]).iternext():
                try:
                    record = codec.decode_command(raw, operation_id=_key_str(key))
                except (CorruptRecord, UnsupportedRecordVersion):
                    continue
                if record.serial > after_serial:
                    found.append(record)
            return txn.id(), sorted(found, key=lambda c: c.serial)

        return self._read(scan)

    def last_command_serial(self) -> int:
        return _u64(self._get("meta", _META_SERIAL))

    def get_lease(self, operation_id: str) -> LeaseRecord | None:
        record: LeaseRecord | None = self._get_record("leases", operation_id)
        return record

    def get_disposition(self, operation_id: str) -> DispositionRecord | None:
        record: DispositionRecord | None = self._get_record("dispositions", operation_id)
        return record

    def last_txnid(self) -> int:
        """LMDB's last committed transaction id (moves on every commit by any process)."""
        if self._closed:
            raise StorageUnavailable("the store is closed")
        self._refuse_if_failed()
        try:
            return self._env.info()["last_txnid"]
        except lmdb.Error as exc:
            raise integrity.storage_error(exc, "reading the environment info") from exc

    def inventory(
        self, account: AccountBinding | None = None, scope: str | None = None
    ) -> tuple[list[OperationRecord], list[str]]:
        """Readable records matching ``account``/``scope`` (None: any), and the ids of
        ALL unreadable operation records (whatever their account).

        With both ``account`` and ``scope`` given, only that scope is read, through the
        hosts index (cheap in a large store); the unreadable ids are then those of the
        indexed records of that scope that no longer decode.
        """
        if account is not None and scope is not None:
            return self._inventory_scope(account, scope)

        def scan(txn: lmdb.Transaction[bytes]) -> tuple[list[OperationRecord], list[str]]:
            rows = txn.cursor(db=self._dbs["operations"]).iternext()
            return _sort_operations(rows, account, scope)

        return self._read(scan)

    def _inventory_scope(
        self, account: AccountBinding, scope: str
    ) -> tuple[list[OperationRecord], list[str]]:
        prefix = _hosts_prefix(account, scope, with_job=False)
        skip = len(prefix) + _HASH_BYTES  # the job hash, then the operation id

        def scan(txn: lmdb.Transaction[bytes]) -> tuple[list[OperationRecord], list[str]]:
            def rows() -> Iterator[tuple[bytes, bytes]]:
                cursor = txn.cursor(db=self._dbs["hosts"])
                if not cursor.set_range(prefix):
                    return
                operations = self._dbs["operations"]
                for key in cursor.iternext(values=False):
                    if not key.startswith(prefix):
                        return
                    raw = txn.get(key[skip:], db=operations)
                    if raw is not None:
                        yield key[skip:], raw

            return _sort_operations(rows(), account, scope)

        return self._read(scan)

    def control_rows(self) -> tuple[dict[str, LeaseRecord], dict[str, CommandRecord]]:
        """Every readable lease and command, from one snapshot (for bulk status)."""

        def scan(
            txn: lmdb.Transaction[bytes],
        ) -> tuple[dict[str, LeaseRecord], dict[str, CommandRecord]]:
            leases: dict[str, LeaseRecord] = {}
            commands: dict[str, CommandRecord] = {}
            for key, raw in txn.cursor(db=self._dbs["leases"]).iternext():
                with contextlib.suppress(CorruptRecord, UnsupportedRecordVersion):
                    leases[_key_str(key)] = codec.decode_lease(raw, operation_id=_key_str(key))
            for key, raw in txn.cursor(db=self._dbs["commands"]).iternext():
                with contextlib.suppress(CorruptRecord, UnsupportedRecordVersion):
                    commands[_key_str(key)] = codec.decode_command(
                        raw, operation_id=_key_str(key)
                    )
            return leases, commands

        return self._read(scan)

    def ids_by_job(
        self, account: AccountBinding, scope: str | None, job_id: str | None
    ) -> list[str]:
        """Operation ids with exactly this account, scope and job id (None is not "")."""
        prefix = _hosts_prefix(account, scope, job_id, with_job=True)

        def scan(txn: lmdb.Transaction[bytes]) -> list[str]:
            cursor = txn.cursor(db=self._dbs["hosts"])
            ids: list[str] = []
            if not cursor.set_range(prefix):
                return ids
            for key in cursor.iternext(values=False):
                if not key.startswith(prefix):
                    break
                ids.append(_key_str(key[len(prefix) :]))
            return ids

        return self._read(scan)

    def waiting(self, until: float | None = None) -> list[tuple[float, str]]:
        """``(next_attempt_at, operation_id)`` of waiting operations, earliest first."""
        limit = None if until is None else _sortable_time(until)

        def scan(txn: lmdb.Transaction[bytes]) -> list[tuple[float, str]]:
            out: list[tuple[float, str]] = []
            for key in txn.cursor(db=self._dbs["schedule"]).iternext(values=False):
                if limit is not None and key[:8] > limit:
                    break
                out.append((_time_from_sortable(key[:8]), _key_str(key[8:])))
            return out

        return self._read(scan)

    def stats(self) -> dict[str, int]:
        """Quota counters and, for this process, commits vs writes (group commit)."""

        def read(txn: lmdb.Transaction[bytes]) -> tuple[int, int]:
            entries = sum(txn.stat(self._dbs[t])["entries"] for t in TABLES if t != "meta")
            return _u64(txn.get(_META_BYTES, db=self._dbs["meta"])), entries

        bytes_used, entries = self._read(read)
        writer = self._live_writer()
        return {
            "bytes_used": bytes_used,
            "max_bytes": self.max_bytes,
            "max_record_bytes": self.max_record_bytes,
            "entries": entries,
            "commits": writer.commits,
            "writes": writer.writes,
            "largest_batch": writer.largest_batch,
            "map_size": self._read(lambda _txn: self._env.info()["map_size"]),
            "map_growths": writer.map_growths,
            "map_adoptions": writer.map_adoptions,
        }

    def check_integrity(self) -> list[str]:
        """Strictly decode every record of every table; describe each one that fails.

        Also checks keys against records, index entries against their records and
        the ``bytes_used`` counter against the stored sizes.
        """

        def scan(txn: lmdb.Transaction[bytes]) -> list[str]:
            problems: list[str] = []
            total = 0
            operations: dict[str, OperationRecord | None] = {}
            for table in TABLES:
                if table == "meta":
                    continue
                for key, raw in txn.cursor(db=self._dbs[table]).iternext():
                    total += len(key) + len(raw)
                    problem = self._check_entry(table, key, raw, operations)
                    if problem is not None:
                        problems.append(f"{table}:{key!r}: {problem}")
            for key, _ in txn.cursor(db=self._dbs["schedule"]).iternext():
                rec = operations.get(_key_str(key[8:]))
                if rec is not None and schedule_key(rec) != key:
                    problems.append(f"schedule:{key!r}: does not match its operation")
                elif _key_str(key[8:]) not in operations:
                    problems.append(f"schedule:{key!r}: no such operation")
            for key, _ in txn.cursor(db=self._dbs["hosts"]).iternext():
                op_id = _key_str(key[3 * _HASH_BYTES :])
                rec = operations.get(op_id)
                if op_id not in operations:
                    problems.append(f"hosts:{key!r}: no such operation")
                elif rec is not None and hosts_key(rec) != key:
                    problems.append(f"hosts:{key!r}: does not match its operation")
            for op_id, rec in operations.items():
                if rec is None:
                    continue
                sk = schedule_key(rec)
                if sk is not None and txn.get(sk, db=self._dbs["schedule"]) is None:
                    problems.append(f"operations:{op_id!r}: missing from the schedule index")
                if txn.get(hosts_key(rec), db=self._dbs["hosts"]) is None:
                    problems.append(f"operations:{op_id!r}: missing from the hosts index")
            for op_id, rec in operations.items():
                if rec is None:
                    continue
                key = op_id.encode("utf-8", "surrogateescape") + b"\0body"
                body = txn.get(key, db=self._dbs["payloads"])
                if body is not None and not integrity.body_matches(rec.body_hash, body):
                    problems.append(
                        f"payloads:{key!r}: corrupt_record: the body digest does not match "
                        "its operation's body_hash"
                    )
            counted = _u64(txn.get(_META_BYTES, db=self._dbs["meta"]))
            if counted != total:
                problems.append(f"meta:bytes_used: counter {counted} != stored {total}")
            return problems

        return self._read(scan)

    @staticmethod
    def _check_entry(
        table: Table, key: bytes, raw: bytes, operations: dict[str, OperationRecord | None]
    ) -> str | None:
        if table in ("schedule", "hosts"):
            return None  # checked against the operations afterwards
        if table == "governor":
            from recoverable.actors.governor import check_governor_entry

            return check_governor_entry(key, raw)
        if table == "payloads":
            op_raw, sep, kind = key.rpartition(b"\0")
            if not sep or not op_raw or kind.decode(errors="replace") not in PAYLOAD_KINDS:
                return "malformed payload key"
            return None
        op_id = _key_str(key)
        try:
            record = _decode_table(table, raw, op_id)
        except (CorruptRecord, UnsupportedRecordVersion) as exc:
            if table == "operations":
                operations[op_id] = None
            return f"{exc.code}: {exc}"
        if table == "operations":
            operations[op_id] = record
        if record.operation_id != op_id:
            return f"record names operation {record.operation_id!r}"
        return None

    # -- leases (state kept in memory for this owner) --

    def lease_is_live(self, lease: LeaseRecord) -> bool:
        """Held by one of this store's active acquisitions, or by a living other owner."""
        if lease.owner_id == self.owner_id:
            with self._tokens_lock:
                return lease.token in self._tokens
        return OwnerLock.is_held(os.path.join(self.path, "owners"), lease.owner_id)

    def _tokens_add(self, token: str) -> None:
        with self._tokens_lock:
            self._tokens.add(token)

    def _tokens_discard(self, token: str) -> None:
        with self._tokens_lock:
            self._tokens.discard(token)

    # -- retention (explicit maintenance; see storage/retention.py) --

    def dispositions(
        self, account: AccountBinding | None = None, scope: str | None = None
    ) -> list[DispositionRecord]:
        """Readable disposition markers matching ``account``/``scope`` (None: any)."""

        def scan(txn: lmdb.Transaction[bytes]) -> list[DispositionRecord]:
            found: list[DispositionRecord] = []
            for key, raw in txn.cursor(db=self._dbs["dispositions"]).iternext():
                try:
                    record = codec.decode_disposition(raw, operation_id=_key_str(key))
                except (CorruptRecord, UnsupportedRecordVersion):
                    continue
                if account is not None and record.account != account:
                    continue
                if scope is not None and record.scope != scope:
                    continue
                found.append(record)
            return found

        return self._read(scan)

    def purge_account(
        self, account: AccountBinding, scope: str | None = None
    ) -> CleanupResult:
        """Remove the account's idle records and markers; report busy/unreadable ones."""
        from recoverable.storage.retention import purge_account

        return purge_account(self, account, scope)

    def cleanup_disposed(self, *, before: Any, account: AccountBinding) -> CleanupResult:
        """Remove old acknowledgement/abandonment markers (never live records).

        ``before`` is a timezone-aware ``datetime`` or a POSIX timestamp.
        """
        from recoverable.storage.retention import cleanup_disposed

        stamp = before if isinstance(before, int | float) else to_timestamp(before)
        if stamp is None:
            raise InvalidRequest("before is required")
        return cleanup_disposed(self, before=float(stamp), account=account)
