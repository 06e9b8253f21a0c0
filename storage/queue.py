"""The ``queue`` table: operations submitted for workers (``runtime.submit``).

Three kinds of rows, all in the ``queue`` table:

- ``b"s" + serial`` (8-byte big-endian enqueue serial) -> the operation id (UTF-8): the
  order in which workers look at queued operations;
- ``b"o" + operation id`` -> serial (8 bytes) + one state byte: the membership row, so
  an operation is found (and removed) by id without a scan. The state is ``q``
  (queued) or ``r`` (suspended by a worker that stopped cleanly: the next worker resumes
  it; an operation suspended by a host's ``suspend`` is never flagged, so no worker
  resumes it on its own);
- ``b"w" + owner id + b"\\0" + token`` -> a :class:`WorkerRow` (msgpack): a worker
  serving one account and endpoint, written when it starts and removed when it stops;
  live while its owner's lock is held (a row left by a killed worker is dead at once,
  and removed by the next worker that starts).
- ``b"v" + sha256(account, source, endpoint)`` -> a :class:`ServedRow` (msgpack): until
  when the workers of one account and endpoint are known to have served it (unclaimed work):
  each worker of it moves ``until`` to ``SERVED_GRACE`` seconds ahead when it starts and
  every ``SERVED_RENEW`` seconds while it runs, and to at least its own stop when it
  stops. Never moved back, never removed: the unclaimed bound of an operation counts
  from it, so a worker that restarts, or a host that waits while its workers start, is
  not taken for "no worker".

A row names an operation; it never holds any of its content. Rows of operations that
became terminal or were disposed are removed by the worker that sees them (lazily: a
row naming a missing operation is not damage). Pure functions and one-snapshot reads;
the writes are ``WriteTxn.enqueue`` / ``WriteTxn.dequeue``.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

import attrs
import msgspec

from recoverable.storage.keys import MAX_ID_BYTES, key_str, operation_key

if TYPE_CHECKING:
    import lmdb


class RecordReader(Protocol):
    """A store or a write transaction (``storage.base.RecordReader``'s raw getter)."""

    def get_raw(self, table: Any, key: bytes) -> bytes | None: ...

__all__ = [
    "MAX_SCAN",
    "META_QUEUE_SERIAL",
    "SERVED_GRACE",
    "SERVED_RENEW",
    "QueueEntry",
    "ServedRow",
    "WorkerRow",
    "check_entry",
    "counter_problem",
    "decode_member",
    "decode_served",
    "encode_member",
    "encode_served",
    "entry",
    "member_key",
    "member_problem",
    "order_key",
    "ordered_entry",
    "scan",
    "served_key",
]

META_QUEUE_SERIAL: Final = b"queue_serial"
ORDER: Final = b"s"
MEMBER: Final = b"o"
WORKER: Final = b"w"
SERVED: Final = b"v"
SERVED_GRACE: Final = 120.0  # seconds a worker's served mark holds past its last renewal
SERVED_RENEW: Final = 60.0  # seconds between two renewals by a running worker
QUEUED: Final = b"q"
RESUME: Final = b"r"
MAX_SCAN: Final = 4096  # rows one scan returns at most (a worker pages through the rest)


@attrs.frozen
class QueueEntry:
    """One queued operation: its enqueue serial, its id, and whether a worker that
    stopped cleanly suspended it (the next worker resumes it)."""

    serial: int
    operation_id: str
    resume: bool = False


class WorkerRow(msgspec.Struct, frozen=True, kw_only=True):
    """A running worker: which account and endpoint it serves (``WORKER`` rows)."""

    version: int = 1
    account_id: str
    source: str
    endpoint_id: str
    concurrency: int
    started_at: float


_WORKER_DECODER: Final = msgspec.msgpack.Decoder(WorkerRow)


class ServedRow(msgspec.Struct, frozen=True, kw_only=True):
    """Until when a worker of one account and endpoint is known to have served them
    (``SERVED`` rows; wall-clock seconds)."""

    version: int = 1
    account_id: str
    source: str
    endpoint_id: str
    until: float


_SERVED_DECODER: Final = msgspec.msgpack.Decoder(ServedRow)
RowT = TypeVar("RowT", WorkerRow, ServedRow)


def served_key(account_id: str, source: str, endpoint_id: str) -> bytes:
    """The served mark of one account and endpoint (a digest: any text, a fixed key)."""
    named = msgspec.msgpack.encode([account_id, source, endpoint_id])
    return SERVED + hashlib.sha256(named).digest()


def encode_served(row: ServedRow) -> bytes:
    return msgspec.msgpack.encode(row)


def _version_1(decoder: msgspec.msgpack.Decoder[RowT], raw: bytes) -> RowT | None:
    """A version-1 row, or None for one this version cannot read."""
    try:
        row = decoder.decode(raw)
    except msgspec.DecodeError:
        return None
    return row if row.version == 1 else None


def decode_served(raw: bytes) -> ServedRow | None:
    """The row, or None for one this version cannot read (read as no mark at all)."""
    return _version_1(_SERVED_DECODER, raw)


def worker_key(owner_id: str, token: str) -> bytes:
    """One running worker: its owner (process) and a token of its own (one process may
    run several workers, e.g. for several endpoints)."""
    return WORKER + owner_id.encode("ascii", "strict") + b"\0" + token.encode("ascii")


def encode_worker(row: WorkerRow) -> bytes:
    return msgspec.msgpack.encode(row)


def decode_worker(raw: bytes) -> WorkerRow | None:
    """The row, or None for one this version cannot read."""
    return _version_1(_WORKER_DECODER, raw)


def workers(txn: lmdb.Transaction[bytes], db: Any) -> list[tuple[str, str, WorkerRow]]:
    """Every readable worker row, ``(owner id, token, row)`` (one snapshot)."""
    found: list[tuple[str, str, WorkerRow]] = []
    cursor = txn.cursor(db=db)
    if not cursor.set_range(WORKER):
        return found
    for key, value in cursor.iternext():
        if not key.startswith(WORKER):
            break
        named = _worker_names(key)
        row = decode_worker(value)
        if row is not None and named is not None:
            found.append((*named, row))
    return found


def _worker_names(key: bytes) -> tuple[str, str] | None:
    """``(owner id, token)`` of a worker row's key, None for a damaged key: one that could
    not be written back (``worker_key`` is ASCII), so that removing the row of a dead
    worker never fails on it (``check_integrity`` names it)."""
    owner, separator, token = key[1:].partition(b"\0")
    if not separator:
        return None
    try:
        return owner.decode("ascii"), token.decode("ascii")
    except UnicodeDecodeError:
        return None


def order_key(serial: int) -> bytes:
    return ORDER + serial.to_bytes(8, "big")


def member_key(operation_id: str) -> bytes:
    return MEMBER + operation_key(operation_id)


def encode_member(serial: int, *, resume: bool) -> bytes:
    return serial.to_bytes(8, "big") + (RESUME if resume else QUEUED)


def decode_member(raw: bytes) -> tuple[int, bool] | None:
    """``(serial, resume)``, or None for a row this version cannot read."""
    if len(raw) != 9 or raw[8:] not in (QUEUED, RESUME):
        return None
    return int.from_bytes(raw[:8], "big"), raw[8:] == RESUME


def member_problem(
    member: tuple[int, bool] | None, order: bytes | None, operation: bytes
) -> str | None:
    """What is wrong with an operation's stored membership row (None: nothing), given
    its decoded value (None: it does not decode), the order row its serial names, and the
    operation's key: a row that does not decode, or whose serial names no order row of this
    operation (a damaged serial: no worker would ever see the operation)."""
    if member is None:
        return "the membership row does not decode (not 8 serial bytes and a state q or r)"
    if order != operation:
        return (f"the membership row's serial {member[0]} names no order row of this "
                "operation (a damaged serial)")
    return None


def entry(reader: RecordReader, operation_id: str) -> QueueEntry | None:
    """The operation's queue row (None: not queued, or an unreadable row)."""
    raw = reader.get_raw("queue", member_key(operation_id))
    member = None if raw is None else decode_member(raw)
    if member is None:
        return None
    return QueueEntry(member[0], operation_id, member[1])


def scan(
    txn: lmdb.Transaction[bytes], db: Any, *, after_serial: int, limit: int
) -> list[QueueEntry]:
    """Up to ``limit`` queued operations with a serial above ``after_serial``, in order
    (one snapshot; unreadable rows are skipped, ``check_integrity`` names them)."""
    found: list[QueueEntry] = []
    cursor = txn.cursor(db=db)
    if not cursor.set_range(order_key(after_serial + 1)):
        return found
    for key, value in cursor.iternext():
        if not key.startswith(ORDER) or len(found) >= min(limit, MAX_SCAN):
            break
        queued = ordered_entry(key, value, txn.get(MEMBER + value, db=db))
        if queued is not None:
            found.append(queued)
    return found


def ordered_entry(order: bytes, operation: bytes, member: bytes | None) -> QueueEntry | None:
    """The entry of one order row (its key, its value: the operation key) and the
    operation's membership row; None when they do not agree, or the value cannot be an
    operation id (damage: skipped, never handed to a worker as an id; ``check_integrity``
    names such rows)."""
    decoded = None if member is None else decode_member(member)
    if (decoded is None or decoded[0] != int.from_bytes(order[1:], "big")
            or not _is_operation_key(operation)):
        return None
    return QueueEntry(decoded[0], key_str(operation), decoded[1])


def _is_operation_key(raw: bytes) -> bool:
    """Whether ``raw`` is a key ``operation_key`` could have written (non-empty UTF-8 of at
    most ``MAX_ID_BYTES`` bytes, no NUL)."""
    if not raw or len(raw) > MAX_ID_BYTES or b"\0" in raw:
        return False
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def check_entry(txn: lmdb.Transaction[bytes], db: Any, key: bytes, raw: bytes) -> str | None:
    """Why a ``queue`` row is malformed (None: it is well formed). A row naming an
    operation that no longer exists is not a problem (removed lazily)."""
    if key.startswith(ORDER):
        if len(key) != 9 or not _is_operation_key(raw):
            return "malformed queue order row"
        member = txn.get(MEMBER + raw, db=db)
        decoded = None if member is None else decode_member(member)
        if decoded is None or decoded[0] != int.from_bytes(key[1:], "big"):
            return "queue order row without its membership row"
        return None
    if key.startswith(MEMBER) and len(key) > 1:
        decoded = decode_member(raw)
        if decoded is None:
            return "malformed queue membership row"
        if txn.get(order_key(decoded[0]), db=db) != key[1:]:
            return "queue membership row without its order row"
        return None
    if key.startswith(WORKER) and b"\0" in key:
        ok = decode_worker(raw) is not None and _worker_names(key) is not None
        return None if ok else "malformed worker row"
    if key.startswith(SERVED):
        row = decode_served(raw)
        ok = row is not None and served_key(row.account_id, row.source, row.endpoint_id) == key
        return None if ok else "malformed served row"
    return "unknown queue row"


def counter_problem(counter: int, serial: int) -> str | None:
    """What is wrong with the queue serial counter (None: nothing), given the highest
    serial a queue row holds: a counter below it was rolled back, and its next rows would
    take the places of queued operations."""
    if serial <= counter:
        return None
    return (f"the queue serial counter {counter} is below serial {serial} in use (rolled "
            "back: new rows would take the places of queued operations)")
