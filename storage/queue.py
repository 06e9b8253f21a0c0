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

A row names an operation; it never holds any of its content. Rows of operations that
became terminal or were disposed are removed by the worker that sees them (lazily: a
row naming a missing operation is not damage). Pure functions and one-snapshot reads;
the writes are ``WriteTxn.enqueue`` / ``WriteTxn.dequeue``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Protocol

import attrs
import msgspec
from recoverable.storage.keys import key_str, operation_key

if TYPE_CHECKING:
    import lmdb


class RecordReader(Protocol):
    """A store or a write transaction (``storage.base.RecordReader``'s raw getter)."""

    def get_raw(self, table: Any, key: bytes) -> bytes | None: ...

__all__ = [
    "MAX_SCAN",
    "META_QUEUE_SERIAL",
    "QueueEntry",
    "WorkerRow",
    "check_entry",
    "decode_member",
    "encode_member",
    "entry",
    "member_key",
    "order_key",
    "ordered_entry",
    "scan",
]

META_QUEUE_SERIAL: Final = b"queue_serial"
ORDER: Final = b"s"
MEMBER: Final = b"o"
WORKER: Final = b"w"
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


def worker_key(owner_id: str, token: str) -> bytes:
    """One running worker: its owner (process) and a token of its own (one process may
    run several workers, e.g. for several endpoints)."""
    return WORKER + owner_id.encode("ascii", "strict") + b"\0" + token.encode("ascii")


def encode_worker(row: WorkerRow) -> bytes:
    return msgspec.msgpack.encode(row)


def decode_worker(raw: bytes) -> WorkerRow | None:
    """The row, or None for one this version cannot read."""
    try:
        row = _WORKER_DECODER.decode(raw)
    except msgspec.DecodeError:
        return None
    return row if row.version == 1 else None


def workers(txn: lmdb.Transaction[bytes], db: Any) -> list[tuple[str, str, WorkerRow]]:
    """Every readable worker row, ``(owner id, token, row)`` (one snapshot)."""
    found: list[tuple[str, str, WorkerRow]] = []
    cursor = txn.cursor(db=db)
    if not cursor.set_range(WORKER):
        return found
    for key, value in cursor.iternext():
        if not key.startswith(WORKER):
            break
        row = decode_worker(value)
        owner, separator, token = key[1:].partition(b"\0")
        if row is not None and separator:
            found.append((owner.decode("ascii", "replace"), token.decode("ascii", "replace"),
                          row))
    return found


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
    operation's membership row; None when they do not agree (``check_integrity`` names
    such rows)."""
    decoded = None if member is None else decode_member(member)
    if decoded is None or decoded[0] != int.from_bytes(order[1:], "big"):
        return None
    return QueueEntry(decoded[0], key_str(operation), decoded[1])


def check_entry(txn: lmdb.Transaction[bytes], db: Any, key: bytes, raw: bytes) -> str | None:
    """Why a ``queue`` row is malformed (None: it is well formed). A row naming an
    operation that no longer exists is not a problem (removed lazily)."""
    if key.startswith(ORDER):
        if len(key) != 9 or not raw:
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
        return None if decode_worker(raw) is not None else "malformed worker row"
    return "unknown queue row"
