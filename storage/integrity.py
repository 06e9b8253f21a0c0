"""What the store checks about its own files: damage and lock replacement.

- **The data file against its own metadata**, before LMDB maps it: LMDB's two meta
  pages (at offsets 0 and one page) name the last used page; a ``data.mdb``
  shorter than ``(last_pgno + 1) * page_size`` was truncated, and mapping it would
  end in a Bus error at the first read past its end. An empty or missing
  ``data.mdb`` next to a lock file (empty: or an ``owners`` directory) is a store
  whose data was lost, never a new store.
- **The identity of ``lock.mdb``** (``st_dev``, ``st_ino``): LMDB coordinates its
  writers and readers through that file. If it is removed or replaced while a
  process has the store open, a process opening the store afterwards gets a
  *different* lock, and two writers run at once: the store is destroyed (an
  ``mdb.c`` assertion, records overwritten). So each process records the identity
  at open (also in its owner file, for the others), checks it before every write
  batch, and a process that finds the lock missing or different from the one a
  living owner uses refuses to open.
- **The frozen body against its record's digest** (``body_hash``, the sha256 of
  the body, as ``recoverable.body.body_hash`` computes it): checked before every
  transmission and by ``check_integrity``; a mismatch is a corrupt record, never
  sent and never rewritten.
- **The records against their keys and indexes** (``check_records``, behind
  ``RecoveryStore.check_integrity``): every row strictly decoded, every record under its
  own key, the ``hosts`` index against the operations, each body against its record's
  digest, the ``bytes_used`` counter against the stored sizes.
- **Every LMDB error** becomes a typed ``StorageUnavailable``; those that mean
  damaged pages (``MDB_CORRUPTED``, ``MDB_PAGE_NOTFOUND``, ...) a ``StoreDamaged``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from typing import Any, Final

import lmdb

from recoverable.errors import (
    CorruptRecord,
    StorageUnavailable,
    StoreDamaged,
    StoreLockReplaced,
    UnsupportedRecordVersion,
)
from recoverable.records import OperationRecord
from recoverable.storage import queue
from recoverable.storage.base import TABLES, Table
from recoverable.storage.governor import check_governor_entry
from recoverable.storage.keys import (
    HASH_BYTES,
    META_BYTES,
    PAYLOAD_KINDS,
    hosts_key,
    key_str,
    marker_hosts_key,
    u64,
)
from recoverable.storage.rows import decode_row
from recoverable.storage.sources import check_source_entry

__all__ = [
    "LockIdentity",
    "UnfinishedDataFile",
    "body_matches",
    "check_data_file",
    "check_lock_before_open",
    "check_owner_locks",
    "check_records",
    "lock_identity",
    "owner_note",
    "storage_error",
    "verify_body",
]

LockIdentity = tuple[int, int]

DATA_FILE: Final = "data.mdb"
LOCK_FILE: Final = "lock.mdb"
OWNERS_DIR: Final = "owners"

_MAGIC: Final = 0xBEEFC0DE
_DATA_VERSION: Final = 1
_PAGE_HEADER: Final = 16  # mp_pgno (8), mp_pad (2), mp_flags (2), mp_lower/upper (4)
# MDB_meta after the page header (64-bit): magic u32, version u32, address u64,
# mapsize u64, then two MDB_db of 48 bytes (the first one's md_pad is the page
# size), then last_pgno u64 and txnid u64.
_META: Final = struct.Struct("=IIQQI44x48xQQ")
_MIN_PAGE: Final = 512
_MAX_PAGE: Final = 65536

_DAMAGE_ERRORS: Final = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.VersionMismatchError,
    lmdb.PanicError,
    lmdb.BadChecksumError,
)


def storage_error(exc: lmdb.Error, doing: str) -> StorageUnavailable:
    """The typed error for an LMDB error met while ``doing`` something."""
    error: StorageUnavailable
    if isinstance(exc, _DAMAGE_ERRORS):
        error = StoreDamaged(f"the store is damaged ({doing}: {exc})")
    else:
        error = StorageUnavailable(f"LMDB error while {doing}: {exc}")
    error.__cause__ = exc
    return error


# -- the data file ------------------------------------------------------------------


def _read_meta(fd: int, offset: int) -> tuple[int, int, int] | None:
    """``(page_size, last_pgno, txnid)`` of the meta page at ``offset``; None if invalid."""
    raw = os.pread(fd, _PAGE_HEADER + _META.size, offset)
    if len(raw) < _PAGE_HEADER + _META.size:
        return None
    magic, version, _addr, _mapsize, page_size, last_pgno, txnid = _META.unpack_from(
        raw, _PAGE_HEADER
    )
    if magic != _MAGIC or version != _DATA_VERSION:
        return None
    if page_size < _MIN_PAGE or page_size > _MAX_PAGE or page_size & (page_size - 1):
        return None
    return page_size, last_pgno, txnid


class UnfinishedDataFile(StoreDamaged):
    """A data file that is missing, empty, without a valid meta page or shorter than its
    two meta pages, next to a lock file: damage, unless another process is creating the
    store right now (``storage/creation.py`` tells them apart)."""


def check_data_file(path: str) -> None:
    """Refuse a data file that LMDB would map past its end, or a lost one.

    ``StoreDamaged`` if ``data.mdb`` is missing next to a lock file, or empty next
    to a lock file or an ``owners`` directory (the store was used), if neither meta page is
    valid, or if a page the newest snapshot uses is past the end of the file (the file
    itself may be shorter than the meta page's last page: see the end of the function).
    """
    data = os.path.join(path, DATA_FILE)
    used = os.path.exists(os.path.join(path, LOCK_FILE)) or os.path.isdir(
        os.path.join(path, OWNERS_DIR)
    )
    try:
        fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        # LMDB creates the lock file just before the data file, and removes neither.
        if os.path.exists(os.path.join(path, LOCK_FILE)):
            raise UnfinishedDataFile(
                f"the store at {path} is damaged: {DATA_FILE} is missing but its "
                f"{LOCK_FILE} exists (the store was used before); restore it or move it aside"
            ) from None
        return  # a new store
    except OSError as exc:
        raise StorageUnavailable(f"cannot read {data}: {exc}") from exc
    try:
        # The metas first, the size after: a commit by another process only ever
        # makes the file longer before it writes a newer meta page.
        first = _read_meta(fd, 0)
        second = _read_meta(fd, first[0]) if first is not None else None
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise StorageUnavailable(f"cannot read {data}: {exc}") from exc
    finally:
        os.close(fd)
    if size == 0:
        if used:
            raise UnfinishedDataFile(
                f"the store at {path} is damaged: {DATA_FILE} is empty but the store was "
                "used before (lock file or owners directory present); restore it or move "
                "it aside"
            )
        return  # created by an open that died before writing anything
    metas = [meta for meta in (first, second) if meta is not None]
    if not metas:
        raise UnfinishedDataFile(
            f"the store at {path} is damaged: {DATA_FILE} has no valid LMDB meta page"
        )
    page_size, last_pgno, _txnid = max(metas, key=lambda meta: meta[2])
    needed = max(2, last_pgno + 1) * page_size
    if size < 2 * page_size:
        raise UnfinishedDataFile(
            f"the store at {path} is damaged: {DATA_FILE} is truncated ({size} bytes, its "
            f"metadata needs {needed}); restore it or move it aside"
        )
    problem = walk_pages(data)
    if problem is not None and size < needed:
        raise StoreDamaged(
            f"the store at {path} is damaged: {DATA_FILE} is truncated ({size} bytes, its "
            f"metadata needs {needed}: {problem}); restore it or move it aside"
        )
    if problem is not None:
        raise StoreDamaged(
            f"the store at {path} is damaged: {problem}; restore it or move it aside"
        )
    # A file shorter than ``needed`` whose walk is clean is healthy: LMDB never writes a
    # page a transaction allocated and freed again (a "loose" page), so the last pages
    # may be missing; the walk read every page the snapshot uses and found each missing
    # one on the free list.


# -- the page walk ------------------------------------------------------------------

_P_BRANCH: Final = 0x01
_P_LEAF: Final = 0x02
_P_OVERFLOW: Final = 0x04
_P_IGNORED: Final = 0x10 | 0x4000 | 0x8000  # P_DIRTY, P_LOOSE, P_KEEP (in-memory marks)
_F_BIGDATA: Final = 0x01
_F_SUBDATA: Final = 0x02
_P_INVALID: Final = 2**64 - 1
_HEADER: Final = struct.Struct("=QHHHH")  # pgno, pad, flags, lower, upper
_NODE: Final = struct.Struct("=HHHH")  # lo, hi, flags, ksize
_DB_ROOT: Final = struct.Struct("=40xQ")  # the root page of an MDB_db (48 bytes)
_U64: Final = struct.Struct("=Q")


class _Damage(Exception):
    pass


def walk_pages(data: str) -> str | None:
    """Walk every page the newest snapshot uses; describe the first damage found.

    LMDB trusts its pages: a corrupted page header, node size, child or overflow
    page number, or free-page list is not checked before LMDB copies or reuses the
    page, and ends in a native crash (heap corruption, assertion, segfault) at the
    next write. This walk checks, without mapping the file, that every page of the
    free-page list and of every database tree (the main one and each named one) is
    inside the file, of the expected type, with its node table and nodes inside the
    page, used once, and never both used and free.
    """
    try:
        fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise StorageUnavailable(f"cannot read {data}: {exc}") from exc
    try:
        for _ in range(5):
            before = _newest_txnid(fd)
            try:
                _walk(fd)
            except _Damage as exc:
                # Another process may have committed (and reused pages of the snapshot
                # being walked) meanwhile: only a walk of an unchanged snapshot counts.
                if _newest_txnid(fd) == before:
                    return str(exc)
                continue
            return None
        return None  # the store kept changing under the walk: busy, so not verified here
    except OSError as exc:
        raise StorageUnavailable(f"cannot read {data}: {exc}") from exc
    finally:
        os.close(fd)


def _newest_txnid(fd: int) -> int:
    first = _read_meta(fd, 0)
    if first is None:
        return -1
    second = _read_meta(fd, first[0])
    return max(first[2], second[2] if second is not None else -1)


def _walk(fd: int) -> None:
    first = _read_meta(fd, 0)
    if first is None:
        raise _Damage("no valid meta page")
    psize = first[0]
    metas = [
        (meta, offset)
        for meta, offset in ((first, 0), (_read_meta(fd, psize), psize))
        if meta
    ]
    (_psize, last_pgno, txnid), offset = max(metas, key=lambda found: found[0][2])
    end = last_pgno + 1
    raw = os.pread(fd, _PAGE_HEADER + 24 + 96, offset)
    free_root = _DB_ROOT.unpack_from(raw, _PAGE_HEADER + 24)[0]
    main_root = _DB_ROOT.unpack_from(raw, _PAGE_HEADER + 24 + 48)[0]
    used: set[int] = {0, 1}
    free: list[int] = []

    def page(pgno: int) -> bytes:
        if pgno >= end:
            raise _Damage(f"page {pgno} is past the last page {last_pgno}")
        if pgno in used:
            raise _Damage(f"page {pgno} is used twice")
        used.add(pgno)
        buf = os.pread(fd, psize, pgno * psize)
        if len(buf) < psize:
            raise _Damage(f"page {pgno} is past the end of the file")
        if _HEADER.unpack_from(buf)[0] != pgno:
            raise _Damage(f"page {pgno} names another page number")
        return buf

    def overflow(pgno: int, size: int) -> bytes:
        buf = page(pgno)
        flags = _HEADER.unpack_from(buf)[2] & ~_P_IGNORED
        count = struct.unpack_from("=I", buf, 12)[0]
        if flags != _P_OVERFLOW or count < 1 or pgno + count > end:
            raise _Damage(f"overflow page {pgno} is malformed")
        if size > count * psize - _PAGE_HEADER:
            raise _Damage(f"a value on overflow page {pgno} is longer than its pages")
        for extra in range(pgno + 1, pgno + count):
            if extra in used:
                raise _Damage(f"page {extra} is used twice")
            used.add(extra)
        if count == 1:
            return buf[_PAGE_HEADER : _PAGE_HEADER + size]
        rest = os.pread(fd, (count - 1) * psize, (pgno + 1) * psize)
        return (buf + rest)[_PAGE_HEADER : _PAGE_HEADER + size]

    def tree(root: int, *, main: bool, freelist: bool) -> None:
        if root == _P_INVALID:
            return
        stack = [root]
        while stack:
            pgno = stack.pop()
            buf = page(pgno)
            _, _, flags, lower, upper = _HEADER.unpack_from(buf)
            flags &= ~_P_IGNORED
            if flags not in (_P_BRANCH, _P_LEAF):
                raise _Damage(f"page {pgno} of a tree is neither a branch nor a leaf")
            if not (_PAGE_HEADER <= lower <= upper <= psize) or (lower - _PAGE_HEADER) % 2:
                raise _Damage(f"page {pgno} has a malformed node table")
            count = (lower - _PAGE_HEADER) // 2
            if flags == _P_BRANCH and count < 1:
                raise _Damage(f"branch page {pgno} is empty")
            for index in range(count):
                ptr = struct.unpack_from("=H", buf, _PAGE_HEADER + 2 * index)[0]
                if ptr < upper or ptr + _NODE.size > psize:
                    raise _Damage(f"page {pgno} has a node outside the page")
                lo, hi, nflags, ksize = _NODE.unpack_from(buf, ptr)
                start = ptr + _NODE.size + ksize
                if flags == _P_BRANCH:
                    if start > psize:
                        raise _Damage(f"page {pgno} has a key outside the page")
                    stack.append(lo | hi << 16 | nflags << 32)
                    continue
                size = lo | hi << 16
                if nflags & ~(_F_BIGDATA | _F_SUBDATA):
                    raise _Damage(f"page {pgno} has a node with unknown flags")
                if nflags & _F_BIGDATA:
                    if start + 8 > psize:
                        raise _Damage(f"page {pgno} has a node outside the page")
                    value = overflow(_U64.unpack_from(buf, start)[0], size)
                else:
                    if start + size > psize:
                        raise _Damage(f"page {pgno} has a value outside the page")
                    value = buf[start : start + size]
                if nflags & _F_SUBDATA:
                    if not main or len(value) != 48:
                        raise _Damage(f"page {pgno} has a malformed database record")
                    tree(_DB_ROOT.unpack_from(value)[0], main=False, freelist=False)
                elif freelist:
                    # The key is the id of the transaction that freed these pages: 8 bytes,
                    # never newer than the snapshot (LMDB asserts it when it saves the
                    # list, an abort of the whole process).
                    if ksize != 8 or _U64.unpack_from(buf, ptr + _NODE.size)[0] > txnid:
                        raise _Damage(f"free-page list page {pgno} has a malformed key")
                    if len(value) < 8 or len(value) % 8:
                        raise _Damage(f"free-page list page {pgno} is malformed")
                    ids = struct.unpack_from(f"={len(value) // 8}Q", value)
                    if ids[0] != len(ids) - 1:
                        raise _Damage(f"free-page list page {pgno} is malformed")
                    free.extend(ids[1:])

    tree(main_root, main=True, freelist=False)
    tree(free_root, main=False, freelist=True)
    seen_free: set[int] = set()
    for pgno in free:
        if pgno < 2 or pgno >= end or pgno in used or pgno in seen_free:
            raise _Damage(f"the free-page list names page {pgno}, which is not free")
        seen_free.add(pgno)
    # The file may end before the last page: only pages LMDB never wrote (allocated and
    # freed again in one transaction) may be missing, and those are on the free list.
    for pgno in range(max(2, os.fstat(fd).st_size // psize), end):
        if pgno not in seen_free:
            raise _Damage(f"page {pgno} is past the end of the file and not free")


# -- the lock file ------------------------------------------------------------------


def lock_identity(path: str) -> LockIdentity | None:
    """``(st_dev, st_ino)`` of the store's lock file, None if it is missing."""
    try:
        st = os.stat(os.path.join(path, LOCK_FILE))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StorageUnavailable(f"cannot check the store's lock file: {exc}") from exc
    return st.st_dev, st.st_ino


def owner_note(identity: LockIdentity) -> bytes:
    """What an owner file records: the identity of the lock file its process uses."""
    return f"lock {identity[0]} {identity[1]}\n".encode()


def _parse_note(raw: bytes) -> LockIdentity | None:
    parts = raw.split()
    if len(parts) != 3 or parts[0] != b"lock":
        return None
    try:
        return int(parts[1]), int(parts[2])
    except ValueError:
        return None


def _living_owner_notes(path: str, skip: str | None) -> list[tuple[str, LockIdentity | None]]:
    """``(owner_id, recorded lock identity)`` of every living owner but ``skip``."""
    from recoverable.storage.leases import OwnerLock

    owners = os.path.join(path, OWNERS_DIR)
    try:
        names = os.listdir(owners)
    except OSError:
        return []
    found: list[tuple[str, LockIdentity | None]] = []
    for name in names:
        owner_id, dot, ext = name.partition(".")
        if ext != "lock" or not dot or owner_id == skip:
            continue
        if not OwnerLock.is_held(owners, owner_id):
            continue
        note: LockIdentity | None = None
        with contextlib.suppress(OSError), open(os.path.join(owners, name), "rb") as file:
            note = _parse_note(file.read(256))
        found.append((owner_id, note))
    return found


def check_lock_before_open(path: str) -> None:
    """Before LMDB opens (and would create) ``lock.mdb``: refuse if it was removed
    while another process still has the store open (that process uses the old one)."""
    if lock_identity(path) is not None:
        return
    if not os.path.exists(os.path.join(path, DATA_FILE)):
        return
    living = _living_owner_notes(path, skip=None)
    if living:
        raise StoreLockReplaced(
            f"the store at {path} is in use by another process but its {LOCK_FILE} was "
            "removed; a new lock file would let two writers destroy the store. Stop every "
            "process using it, then open it again"
        )


def check_owner_locks(path: str, mine: LockIdentity, owner_id: str | None) -> None:
    """After opening: every living owner must use the lock file this process uses."""
    for other, note in _living_owner_notes(path, skip=owner_id):
        if note is not None and note != mine:
            raise StoreLockReplaced(
                f"the store at {path} is in use by another process through a {LOCK_FILE} "
                f"that was removed or replaced (owner {other}); stop every process using "
                "it, then open it again"
            )
    if lock_identity(path) != mine:
        raise StoreLockReplaced(f"the {LOCK_FILE} of {path} was removed or replaced while opening")


def lock_replaced_error(path: str) -> StoreLockReplaced:
    return StoreLockReplaced(
        f"the {LOCK_FILE} of the store at {path} was removed or replaced while this process "
        "had the store open; every read and write is refused (another process could be "
        "writing through a different lock). Close the store in every process, then reopen"
    )


# -- the frozen body ----------------------------------------------------------------


def body_matches(expected_hash: str, body: bytes) -> bool:
    """Whether ``body`` is the frozen body its record's ``body_hash`` names."""
    return bool(expected_hash) and hashlib.sha256(body).hexdigest() == expected_hash


def verify_body(operation_id: str, expected_hash: str, body: bytes) -> None:
    """``CorruptRecord`` unless ``body`` matches the record's digest (never send it)."""
    if not body_matches(expected_hash, body):
        raise CorruptRecord(
            "the stored frozen body does not match its record's digest (body_hash): the "
            "record is corrupt and is never sent",
            operation_id=operation_id,
        )


# -- the records ----------------------------------------------------------------------


def _disposed_entry(txn: Any, dbs: Any, key: bytes, operation_id: str) -> bool:
    """``key`` is the job index entry a disposed operation keeps (its marker's)."""
    raw = txn.get(operation_id.encode("utf-8", "surrogateescape"), db=dbs["dispositions"])
    if raw is None:
        return False
    try:
        marker = decode_row("dispositions", raw, operation_id)
    except (CorruptRecord, UnsupportedRecordVersion):
        return False
    return marker_hosts_key(marker) == key


def check_records(txn: lmdb.Transaction[bytes], dbs: dict[Table, Any]) -> list[str]:
    """Strictly decode every row of every table (one snapshot); describe each problem.

    Also checks keys against records, the ``hosts`` index against the operations, each
    frozen body against its record's digest and ``bytes_used`` against the stored sizes.
    Rows of the retired ``schedule`` table are counted, never interpreted.
    """
    problems: list[str] = []
    total = 0
    operations: dict[str, OperationRecord | None] = {}
    for table in TABLES:
        if table == "meta":
            continue
        for key, raw in txn.cursor(db=dbs[table]).iternext():
            total += len(key) + len(raw)
            problem = _check_entry(table, key, raw, operations)
            if problem is not None:
                problems.append(f"{table}:{key!r}: {problem}")
    last_serial = 0
    for key, raw in txn.cursor(db=dbs["queue"]).iternext():
        problem = queue.check_entry(txn, dbs["queue"], key, raw)
        if problem is not None:
            problems.append(f"queue:{key!r}: {problem}")
        if key[:1] == queue.ORDER and len(key) == 9:  # a serial in use, well formed or not
            last_serial = max(last_serial, int.from_bytes(key[1:], "big"))
    counted_serial = u64(txn.get(queue.META_QUEUE_SERIAL, db=dbs["meta"]))
    problem = queue.counter_problem(counted_serial, last_serial)
    if problem is not None:
        problems.append(f"meta:{queue.META_QUEUE_SERIAL!r}: {problem}")
    for key in txn.cursor(db=dbs["hosts"]).iternext(values=False):
        operation_id = key_str(key[3 * HASH_BYTES :])
        record = operations.get(operation_id)
        if operation_id not in operations:
            if not _disposed_entry(txn, dbs, key, operation_id):
                problems.append(f"hosts:{key!r}: no such operation")
        elif record is not None and hosts_key(record) != key:
            problems.append(f"hosts:{key!r}: does not match its operation")
    for operation_id, record in operations.items():
        if record is None:
            continue
        if txn.get(hosts_key(record), db=dbs["hosts"]) is None:
            problems.append(f"operations:{operation_id!r}: missing from the hosts index")
    for operation_id, record in operations.items():
        if record is None:
            continue
        key = operation_id.encode("utf-8", "surrogateescape") + b"\0body"
        body = txn.get(key, db=dbs["payloads"])
        if body is not None and not body_matches(record.body_hash, body):
            problems.append(
                f"payloads:{key!r}: corrupt_record: the body digest does not match "
                "its operation's body_hash"
            )
    counted = u64(txn.get(META_BYTES, db=dbs["meta"]))
    if counted != total:
        problems.append(f"meta:bytes_used: counter {counted} != stored {total}")
    return problems


def _check_entry(
    table: Table, key: bytes, raw: bytes, operations: dict[str, OperationRecord | None]
) -> str | None:
    match table:
        case "schedule" | "hosts" | "queue":
            return None  # hosts and queue: checked afterwards
        case "governor":
            return check_governor_entry(key, raw)
        case "sources":
            return check_source_entry(key, raw)
        case "payloads":
            operation_raw, separator, kind = key.rpartition(b"\0")
            if (
                not separator
                or not operation_raw
                or kind.decode(errors="replace") not in PAYLOAD_KINDS
            ):
                return "malformed payload key"
            return None
    operation_id = key_str(key)
    try:
        record = decode_row(table, raw, operation_id)
    except (CorruptRecord, UnsupportedRecordVersion) as exc:
        if table == "operations":
            operations[operation_id] = None
        return f"{exc.code}: {exc}"
    if table == "operations":
        operations[operation_id] = record
    if record.operation_id != operation_id:
        return f"record names operation {record.operation_id!r}"
    return None
