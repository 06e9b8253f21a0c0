"""The LMDB write transaction: typed table helpers over one nested LMDB transaction.

Every put/delete made through :class:`WriteTxn` adjusts ``bytes_used`` (key + value
lengths, all tables except ``meta``) in the same transaction, so quotas are enforced
from a counter, never by scanning, and nothing is ever evicted. The counter is carried
in memory from one mutation of a commit batch to the next (:class:`WriteState`) and
written once per batch by the store.

This is the hot path of every durable step: keep it free of work that is not needed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, Final, TypeVar

import lmdb

from recoverable.errors import (
    AdmissionChanged,
    FenceMismatch,
    InvalidRequest,
    StorageLimitExceeded,
    StorageUnavailable,
)
from recoverable.machine import merge_command
from recoverable.records import (
    CommandKind,
    CommandRecord,
    DispositionRecord,
    LeaseRecord,
    OperationRecord,
    PayloadKind,
)
from recoverable.storage import codec, integrity, queue
from recoverable.storage.base import TABLES, Table
from recoverable.storage.keys import (
    COMMAND_KINDS,
    HASH_BYTES,
    META_BYTES,
    META_SERIAL,
    SOURCE_BOUND,
    check_next_attempt_at,
    hosts_account_prefix,
    hosts_key,
    hosts_prefix,
    key_str,
    marker_hosts_key,
    operation_key,
    payload_key,
    source_bound_prefix,
    source_key,
    str_operation_key,
    u64,
)
from recoverable.storage.leases import LeaseTokens
from recoverable.storage.queue_writes import QueueWrites
from recoverable.storage.rows import RecordGetters, decode_row
from recoverable.storage.writer import MutationContext
from recoverable.transitions import FINISHED, InvalidTransition
from recoverable.types import AccountBinding

__all__ = ["ADMISSION_FIELDS", "WriteState", "WriteTxn"]

Result = TypeVar("Result")

_MISSING: Final = object()
# One byte per table: a read cache's key is the table's tag + the row's key (see WriteTxn).
_TAG: Final[dict[str, bytes]] = {table: bytes((index,)) for index, table in enumerate(TABLES)}
_META_TAG: Final = _TAG["meta"]

# What an operation was admitted with: fixed by ``prepare``, never changed by a
# later write of the same record (``put_operation`` refuses it with ``AdmissionChanged``).
# A field is listed only once the record has it (``on_interruption`` arrives with the
# interruption policy).
ADMISSION_FIELDS: Final[tuple[str, ...]] = tuple(
    name
    for name in (
        "account", "endpoint_id", "model", "reasoning_effort", "body_hash",
        "maximum_attempts", "maximum_output_tokens_total", "retry_policy", "expires_at",
        "format_hash", "contract_version", "scope", "job_id", "input_revision",
        "on_interruption", "source", "attempt_timeout",
        "reattach",  # chosen at prepare
        "live",  # chosen at prepare (it fixed on_interruption="fail")
        "unclaimed_after",  # chosen at submit
        # The cost budget and the price it counts at, frozen at prepare; the service tier
        # is the frozen body's.
        "maximum_cost_total", "cost_price", "service_tier",
    )
    if name in OperationRecord.__struct_fields__
)
_admission: Final = operator.attrgetter(*ADMISSION_FIELDS)  # one C call: a tuple of values


class WriteState:
    """What every write transaction of one store shares: its tables, its limits, its
    owner's lease tokens, and the ``bytes_used`` carried across a commit batch."""

    def __init__(
        self,
        dbs: dict[Table, Any],
        *,
        max_bytes: int,
        max_record_bytes: int,
        owner_id: str,
        tokens: LeaseTokens,
    ) -> None:
        self.dbs = dbs
        self.max_bytes = max_bytes
        self.max_record_bytes = max_record_bytes
        self.owner_id = owner_id
        self.tokens = tokens
        self.batch_bytes: int | None = None  # None: read from meta by the batch's first mutation


class WriteTxn(RecordGetters, MutationContext, QueueWrites):
    """What a mutation receives (the LMDB ``WriteTransaction``).

    Reads see the batch's earlier writes. Every helper that writes several keys is
    atomic: when it raises, it changed nothing. Helpers refuse to overwrite or delete a
    stored record that is unreadable (``CorruptRecord`` / ``UnsupportedRecordVersion``).
    """

    def __init__(self, state: WriteState, txn: lmdb.Transaction[bytes]) -> None:
        super().__init__()
        self._state = state
        self._txn = txn
        self._dbs = state.dbs
        running = state.batch_bytes
        self._bytes_used = (
            running if running is not None else u64(txn.get(META_BYTES, db=self._dbs["meta"]))
        )
        # Keyed by ``_TAG[table] + key`` (bytes, not a tuple) and holding bytes, None and
        # ``gc=False`` records only: the collector never tracks these dicts nor their keys
        # (a tuple key per read was ~25 tracked objects per durable job, alive for the
        # whole batch).
        self._cache: dict[bytes, bytes | None] = {}
        self._decoded_raw: dict[bytes, bytes] = {}  # the bytes each record was decoded from
        self._decoded: dict[bytes, Any] = {}
        self._broken = False

    # -- plumbing --

    @property
    def owner_id(self) -> str:
        return self._state.owner_id

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
        self._state.batch_bytes = self._bytes_used

    def next_mutation(self) -> None:
        """The next mutation of the same batch transaction runs in this context: its read
        caches stay valid (every write of a mutation goes through them, and the run is
        thrown away whole if one mutation raises); ``bytes_used`` carries on."""
        self._broken = False

    # Atomic composite helpers. A helper that writes several keys is all or nothing. No
    # nested transaction is needed for that: a mutation that raises is rolled back whole by
    # the writer. If a mutation catches a composite helper's error and carries on, the
    # partial writes would stay — so each such helper runs its body in
    # ``try: ... except BaseException: self._broken = True; raise`` (inline: no context
    # manager object and generator per call on the hot path), and ``finish`` refuses to
    # commit a broken mutation (fail closed).

    def _lmdb(self, call: Callable[[], Result]) -> Result:
        try:
            return call()
        except lmdb.Error as exc:
            raise self._lmdb_error(exc) from exc

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
        slot = _TAG[table] + key
        cached = self._cache.get(slot, _MISSING)
        if cached is not _MISSING:
            return cached  # type: ignore[return-value]
        try:
            value: bytes | None = self._txn.get(key, db=self._dbs[table])
        except lmdb.Error as exc:
            raise self._lmdb_error(exc) from exc
        self._cache[slot] = value
        return value

    def _put(
        self, table: Table, key: bytes, value: bytes, *, immutable: str | None = None
    ) -> None:
        """Put ``value`` at ``key``. With ``immutable`` (the operation id), an existing
        different value is not replaced: ``AdmissionChanged`` (no extra read: the old
        value comes back from the same LMDB call)."""
        state = self._state
        if len(value) > state.max_record_bytes:
            raise StorageLimitExceeded(
                f"a {table} value of {len(value)} bytes exceeds max_record_bytes="
                f"{state.max_record_bytes}"
            )
        db = self._dbs[table]
        slot = _TAG[table] + key
        cached = self._cache.get(slot, _MISSING)
        try:
            if cached is _MISSING:
                old: bytes | None = self._txn.replace(key, value, db=db)  # one LMDB call
            else:
                old = cached  # type: ignore[assignment]
        except lmdb.Error as exc:
            raise self._lmdb_error(exc) from exc
        if immutable is not None and old is not None and old != value:
            if cached is _MISSING:
                self._undo_replace(db, key, old)
            raise AdmissionChanged(
                f"the frozen {table} value differs from the saved one",
                operation_id=immutable,
                field="body",
            )
        delta = len(value) - len(old) if old is not None else len(key) + len(value)
        if delta > 0 and self._bytes_used + delta > state.max_bytes:
            if cached is _MISSING:  # undo the replace: a refused write changes nothing
                self._undo_replace(db, key, old)
            raise StorageLimitExceeded(
                f"the store would hold {self._bytes_used + delta} bytes; max_bytes="
                f"{state.max_bytes}"
            )
        if cached is not _MISSING:
            try:
                self._txn.put(key, value, db=db)
            except lmdb.Error as exc:
                raise self._lmdb_error(exc) from exc
        self._cache[slot] = value
        self._bytes_used += delta

    def _undo_replace(self, db: Any, key: bytes, old: bytes | None) -> None:
        """Put back what ``txn.replace`` overwrote (a refused write changes nothing)."""
        try:
            if old is None:
                self._txn.delete(key, db=db)
            else:
                self._txn.put(key, old, db=db)
        except lmdb.Error as exc:
            raise self._lmdb_error(exc) from exc

    def _delete(self, table: Table, key: bytes) -> bool:
        slot = _TAG[table] + key
        cached = self._cache.get(slot, _MISSING)
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
        self._cache[slot] = None
        if old is None:
            return False
        self._bytes_used -= len(key) + len(old)
        return True

    def _counter_next(self, name: bytes) -> int:
        value = u64(self._get("meta", name)) + 1
        raw = value.to_bytes(8, "big")
        self._lmdb(lambda: self._txn.put(name, raw, db=self._dbs["meta"]))
        self._cache[_META_TAG + name] = raw
        return value

    def carry_counter(self, name: bytes, at_least: int) -> None:
        """Raise the command or queue serial to at least ``at_least`` (moving a store's
        rows to another store, ``storage/copy.py``: new serials must follow the copied
        ones, or a monitor would miss a command)."""
        if name not in (META_SERIAL, queue.META_QUEUE_SERIAL):
            raise InvalidRequest("only the command and queue serials can be carried")
        if u64(self._get("meta", name)) < at_least:
            raw = at_least.to_bytes(8, "big")
            self._lmdb(lambda: self._txn.put(name, raw, db=self._dbs["meta"]))
            self._cache[_META_TAG + name] = raw

    def _read_record(self, table: Table, operation_id: str) -> Any:
        # The hot read of every named transaction (~24 per durable job): one frame, the
        # key from the C-level cache for a plain non-empty ``str`` (anything else takes
        # ``operation_key``'s checks), one dict lookup for the bytes and one for the
        # decoded record.
        key = (
            str_operation_key(operation_id)
            if type(operation_id) is str and operation_id
            else operation_key(operation_id)
        )
        slot = _TAG[table] + key
        cached = self._cache.get(slot, _MISSING)
        if cached is _MISSING:
            try:
                raw: bytes | None = self._txn.get(key, db=self._dbs[table])
            except lmdb.Error as exc:
                raise self._lmdb_error(exc) from exc
            self._cache[slot] = raw
        else:
            raw = cached  # type: ignore[assignment]
        if raw is None:
            return None
        if self._decoded_raw.get(slot) is raw:
            return self._decoded[slot]  # records are frozen: the decoded value can be shared
        record = decode_row(table, raw, operation_id)
        self._decoded_raw[slot] = raw
        self._decoded[slot] = record
        return record

    def put_preference(self, name: str, value: bytes) -> None:
        """Save a store-wide preference row (``storage/preferences.py``) in the
        ``meta`` table under ``b"preference." + name``: small (at most 4 KiB), not counted
        in ``bytes_used`` (like the store's own counters, so a full store can still be
        configured)."""
        if not name or len(name) > 64 or len(value) > 4096:
            raise InvalidRequest("a preference name is 1..64 characters, its value <= 4 KiB")
        key = b"preference." + name.encode("ascii")
        self._lmdb(lambda: self._txn.put(key, value, db=self._dbs["meta"]))
        self._cache[_META_TAG + key] = value

    def put_raw(self, table: Table, key: bytes, value: bytes) -> None:
        """Store bytes as they are (fixtures, repair tools): no decoding, no indexes.

        Still counted in ``bytes_used`` and limited by the quotas.
        """
        if table == "meta":
            raise InvalidRequest("the meta table is written by the store only")
        self._put(table, key, value)

    # -- operations --

    def put_operation(self, record: OperationRecord, *, expect_fence: int | None = None) -> None:
        """Write ``record``, keeping the hosts index in step.

        With ``expect_fence``: ``FenceMismatch`` unless the stored record exists and
        its ``fence`` equals it (a stale owner can never overwrite a newer one).
        """
        key = operation_key(record.operation_id)
        check_next_attempt_at(record)
        data = codec.encode(record)
        try:  # atomic: see _broken
            old = self.get_operation(record.operation_id)
            if expect_fence is not None and (old is None or old.fence != expect_fence):
                raise FenceMismatch(
                    f"expected fence {expect_fence}, found "
                    f"{'no record' if old is None else old.fence}",
                    operation_id=record.operation_id,
                )
            if old is None:
                self._put("operations", key, data)
                self._put("hosts", hosts_key(record), b"")
                if record.source is not None:  # the source's bound operations
                    self._put("sources", source_bound_prefix(record.source.key) + key, b"")
                return
            if old.awaiting_upgrade:  # a version-1 record is frozen by its upgrade
                new_hosts, old_hosts = hosts_key(record), hosts_key(old)
                if old_hosts != new_hosts:
                    self._delete("hosts", old_hosts)
                    self._put("hosts", new_hosts, b"")
            else:
                if _admission(old) != _admission(record):
                    raise _admission_changed(old, record)
                _check_progress(old, record)
            # Otherwise account, scope and job id are admission fields, unchanged: so is
            # the record's hosts index entry (no key to build or write).
            self._put("operations", key, data)
        except BaseException:
            self._broken = True
            raise

    def delete_operation(self, operation_id: str, *, expect_fence: int | None = None) -> bool:
        """Delete the record and its index entry (not its payloads, lease, command)."""
        try:  # atomic: see _broken
            old = self.get_operation(operation_id)
            if expect_fence is not None and (old is None or old.fence != expect_fence):
                raise FenceMismatch(
                    f"expected fence {expect_fence}, found "
                    f"{'no record' if old is None else old.fence}",
                    operation_id=operation_id,
                )
            if old is None:
                return False
            self._delete("hosts", hosts_key(old))
            if old.source is not None:
                self._delete(
                    "sources", source_bound_prefix(old.source.key) + operation_key(operation_id)
                )
            self._delete("operations", operation_key(operation_id))
            return True
        except BaseException:
            self._broken = True
            raise

    # -- payloads --

    def put_payload(self, operation_id: str, kind: PayloadKind, data: bytes) -> None:
        """Write a payload. The frozen body is immutable: putting a different body over an
        existing one raises ``AdmissionChanged`` (the same bytes again are a no-op)."""
        if not isinstance(data, bytes):
            raise InvalidRequest("payload data must be bytes", operation_id=operation_id)
        if kind == "body":
            self._put("payloads", payload_key(operation_id, kind), data, immutable=operation_id)
        else:
            self._put("payloads", payload_key(operation_id, kind), data)

    def delete_payload(self, operation_id: str, kind: PayloadKind) -> bool:
        return self._delete("payloads", payload_key(operation_id, kind))

    # -- commands --

    def put_command(self, operation_id: str, kind: CommandKind, now: float) -> CommandRecord:
        """Write a lifecycle command with the next store-wide serial.

        The command that stands is ``machine.merge_command``'s: when it keeps the stored
        one (a cancel is never downgraded by a later suspend), that stored command is
        returned unchanged and nothing is written.
        """
        if kind not in COMMAND_KINDS:
            raise InvalidRequest(f"unknown command kind {kind!r}", operation_id=operation_id)
        key = operation_key(operation_id)
        try:  # atomic: see _broken
            existing = self.get_command(operation_id)
            if existing is not None and merge_command(existing.kind, kind) != kind:
                return existing
            record = CommandRecord(
                operation_id=operation_id,
                kind=kind,
                issued_at=now,
                serial=self._counter_next(META_SERIAL),
            )
            self._put("commands", key, codec.encode(record))
            return record
        except BaseException:
            self._broken = True
            raise

    def delete_command(self, operation_id: str) -> bool:
        if self.get_command(operation_id) is None:
            return False
        return self._delete("commands", operation_key(operation_id))

    # -- leases --

    def put_lease(self, lease: LeaseRecord) -> None:
        self.get_lease(lease.operation_id)  # refuse to overwrite an unreadable lease
        self._put("leases", operation_key(lease.operation_id), codec.encode(lease))

    def delete_lease(self, operation_id: str, *, unreadable: bool = False) -> bool:
        """``unreadable``: also a row that does not decode (an operator's abandon)."""
        if not unreadable and self.get_lease(operation_id) is None:
            return False
        return self._delete("leases", operation_key(operation_id))

    def lease_is_live(self, lease: LeaseRecord, now: float | None = None) -> bool:
        return self._state.tokens.is_live(lease, now)

    def register_token(self, token: str) -> None:
        """Mark a lease token of this store as active now; undone if this run is discarded.

        Registered *before* the commit: a lease row naming this owner is only ever
        visible after its commit, so an early registration cannot make a missing
        lease look live, while a late one would let a reader see our own fresh
        lease as dead for a moment.
        """
        tokens = self._state.tokens
        tokens.add(token)
        self.on_abort(lambda: tokens.discard(token))

    def unregister_token(self, token: str) -> None:
        self._state.tokens.discard(token)

    # -- dispositions --

    def put_disposition(self, record: DispositionRecord) -> None:
        self.get_disposition(record.operation_id)  # refuse over an unreadable one
        self._put("dispositions", operation_key(record.operation_id), codec.encode(record))

    def delete_disposition(self, operation_id: str) -> bool:
        marker = self.get_disposition(operation_id)
        if marker is None:
            return False
        if marker.job_id is not None and self._get(
            "operations", operation_key(operation_id)
        ) is None:
            self._delete("hosts", marker_hosts_key(marker))  # its job index entry
        return self._delete("dispositions", operation_key(operation_id))

    def index_disposed(self, marker: DispositionRecord) -> None:
        """Keep the job index entry of an acknowledged or abandoned operation (its record
        is gone) while its marker is kept: a duplicate of its job finds it. Removed with
        the marker (:meth:`delete_disposition`)."""
        if marker.job_id is not None:
            self._put("hosts", marker_hosts_key(marker), b"")

    def payload_owners(self, prefix: str) -> list[str]:
        """The ids (what precedes ``\\0<kind>``) of the payload rows whose id starts with
        ``prefix``, sorted: a purge finds an account's thread rows (``storage/threads.py``)."""
        owners = {key.rpartition(b"\0")[0] for key in self._keys("payloads", prefix.encode())}
        return sorted(key_str(owner) for owner in owners)

    # -- the source manifest and its index (storage/sources.py) --

    def put_source(self, key: str, digest: str) -> None:
        self._put("sources", source_key(key), digest.encode("ascii"))

    def delete_source(self, key: str) -> bool:
        return self._delete("sources", source_key(key))

    def source_bound(self, key: str) -> list[str]:
        return self._scan("sources", source_bound_prefix(key))

    def unbind_source(self, key: str, operation_id: str) -> bool:
        return self._delete("sources", source_bound_prefix(key) + operation_key(operation_id))

    def remove_unreadable_operation(self, operation_id: str, account: AccountBinding) -> bool:
        """Remove an operation record that no longer decodes, and the index entries that
        name it, when ``account``'s job index names it; False (nothing changed) when it
        does not (another account's, or not indexed).

        The operator's repair of a damaged record (``abandon``): its own fields cannot be
        read, so the index entry written while it was readable says whose it was. The
        payloads and control rows are the caller's to remove (by operation id)."""
        key = operation_key(operation_id)
        skip = 3 * HASH_BYTES  # account, scope and job id digests, then the operation key
        entries = [
            entry for entry in self._keys("hosts", hosts_account_prefix(account))
            if entry[skip:] == key
        ]
        if not entries or self._get("operations", key) is None:
            return False
        for entry in entries:
            self._delete("hosts", entry)
        for entry in self._keys("sources", SOURCE_BOUND):  # its source binding, if any
            if entry.endswith(key) and len(entry) == len(SOURCE_BOUND) + HASH_BYTES + len(key):
                self._delete("sources", entry)
        self._delete("operations", key)
        return True

    def _keys(self, table: Table, prefix: bytes) -> list[bytes]:
        """The whole keys that start with ``prefix`` in ``table``."""
        # A PostgreSQL batch answers a prefix in one statement (or from what its first
        # round trip read), its buffered writes laid over it (``pg_batch``); a cursor
        # there would first send every buffered write, then cost two round trips.
        prefix_keys = getattr(self._txn, "prefix_keys", None)
        if prefix_keys is not None:
            keys: list[bytes] = prefix_keys(prefix, self._dbs[table])
            return keys
        found: list[bytes] = []

        def scan() -> None:
            cursor = self._txn.cursor(db=self._dbs[table])
            if not cursor.set_range(prefix):
                return
            for key in cursor.iternext(values=False):
                if not key.startswith(prefix):
                    return
                found.append(key)

        self._lmdb(scan)
        return found

    def _scan(self, table: Table, prefix: bytes) -> list[str]:
        """The key suffixes (operation ids) after ``prefix`` in ``table``."""
        skip = len(prefix)
        return [key_str(key[skip:]) for key in self._keys(table, prefix)]

    # -- the queue (storage/queue.py) and the job index --

    def operation_ids_by_job(
        self, account: AccountBinding, scope: str | None, job_id: str | None
    ) -> list[str]:
        """Operation ids with exactly this account, scope and job id, through the hosts
        index (this transaction's own writes included)."""
        return self._scan("hosts", hosts_prefix(account, scope, job_id, with_job=True))


def _check_progress(old: OperationRecord, new: OperationRecord) -> None:
    """The record invariants every operation write keeps, in both engines (this is the one
    place a stored record is replaced): the fence and the attempts spent never fall, and a
    finished operation never runs again: from a finished phase it only moves to another
    (a cancel, a superseding source, a saved completion delivered), except the one way
    back the machine defines (a failure that waits for sign-in reopens after it). A write
    that would break one is a defect: ``InvalidTransition``, nothing written."""
    if new.fence < old.fence:
        problem = f"its fence would fall from {old.fence} to {new.fence}"
    elif new.attempts_used < old.attempts_used:
        problem = f"its attempts spent would fall from {old.attempts_used} to {new.attempts_used}"
    elif old.phase in FINISHED and new.phase not in FINISHED and not (
        old.phase == "failed" and old.failure_reason == "authentication_required"
    ):
        problem = f"it would go from the finished phase {old.phase} back to {new.phase}"
    else:
        return
    raise InvalidTransition(f"operation {old.operation_id}: {problem}; nothing was written")


def _admission_changed(old: OperationRecord, new: OperationRecord) -> AdmissionChanged:
    """The error naming the first admission field ``new`` changes (ids and names only)."""
    field = next(
        name for name in ADMISSION_FIELDS if getattr(old, name) != getattr(new, name)
    )
    return AdmissionChanged(
        f"{field} is an admission field: it cannot change once the operation is saved",
        operation_id=old.operation_id,
        field=field,
    )
