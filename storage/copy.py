"""Moving a store's rows to another store (``recoverable migrate-store SRC DST``).

The rows are the same bytes in both stores (LMDB and PostgreSQL), so a move is a raw copy,
table by table, through the destination's own write path: every row is counted against its
quotas, and the command and queue serials are carried over (a command written afterwards
must have a higher serial than every copied one, or a monitor would miss it), and so are
the store-wide preferences (``meta`` rows ``preference.*``: a store with
continuation turned on has it on after the move). Refused unless no other process has the
source open (its operations would go on changing) and the destination holds nothing yet.
Leases are copied as they are: they name the source's owners, which are dead in the
destination, so their operations are adopted there with a higher fence, as after a crash.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

from recoverable.errors import InvalidRequest
from recoverable.storage.base import TABLES, Table
from recoverable.storage.keys import META_SERIAL, u64
from recoverable.storage.queue import META_QUEUE_SERIAL, ORDER
from recoverable.storage.store import RecoveryStore
from recoverable.storage.txn import WriteTxn

__all__ = ["CHUNK_ROWS", "copy_store"]

CHUNK_ROWS: Final = 256  # rows per destination transaction
_PREFERENCE: Final = b"preference."  # storage/preferences.py: b"preference." + name
_COPIED: Final[tuple[Table, ...]] = tuple(
    table for table in TABLES if table not in ("meta", "schedule")
)


def _rows(source: RecoveryStore, table: Table, after: bytes | None) -> list[tuple[bytes, bytes]]:
    """Up to CHUNK_ROWS rows of ``table`` with a key above ``after``, from one snapshot."""

    def read(txn: Any) -> list[tuple[bytes, bytes]]:
        cursor = txn.cursor(db=source.engine.tables[table])
        if after is None:
            found = iter(cursor.iternext())
        elif cursor.set_range(after):
            found = iter(cursor.iternext())
        else:
            return []
        chunk: list[tuple[bytes, bytes]] = []
        for key, value in found:
            key, value = bytes(key), bytes(value)
            if key == after:
                continue
            chunk.append((key, value))
            if len(chunk) >= CHUNK_ROWS:
                break
        return chunk

    result: list[tuple[bytes, bytes]] = source.engine.read(read)
    return result


def _chunks(source: RecoveryStore, table: Table) -> Iterator[list[tuple[bytes, bytes]]]:
    after: bytes | None = None
    while True:
        chunk = _rows(source, table, after)
        if not chunk:
            return
        yield chunk
        after = chunk[-1][0]


def copy_store(source: RecoveryStore, destination: RecoveryStore) -> dict[str, int]:
    """Copy every row of ``source`` into the empty ``destination``: rows per table.

    ``InvalidRequest`` if another process has the source open or the destination is
    not empty (nothing is written then)."""
    busy = source.other_live_owners()
    if busy:
        raise InvalidRequest(
            f"the source store is open in {len(busy)} other process(es): stop them first"
        )
    if destination.stats()["entries"]:
        raise InvalidRequest("the destination store is not empty")
    counts: dict[str, int] = {}
    in_use = 0  # the highest queue serial of a copied order row
    for table in _COPIED:
        counts[table] = 0
        for chunk in _chunks(source, table):
            if table == "queue":
                in_use = max(in_use, *(
                    int.from_bytes(key[1:], "big") for key, _ in chunk
                    if key[:1] == ORDER and len(key) == 9
                ), 0)

            def put(txn: WriteTxn, rows: list[tuple[bytes, bytes]] = chunk,
                    name: Table = table) -> None:
                for key, value in rows:
                    txn.put_raw(name, key, value)

            destination.write_sync(put)
            counts[table] += len(chunk)
    serials = (
        u64(source.get_raw("meta", META_SERIAL)),
        # Never below a serial in use: a source counter that was rolled back (damage)
        # is repaired by the copy instead of overwriting queued places.
        max(u64(source.get_raw("meta", META_QUEUE_SERIAL)), in_use),
    )

    preferences = [
        (key.removeprefix(_PREFERENCE).decode("ascii"), value)
        for chunk in _chunks(source, "meta") for key, value in chunk
        if key.startswith(_PREFERENCE)
    ]

    def carry(txn: WriteTxn) -> None:
        txn.carry_counter(META_SERIAL, serials[0])
        txn.carry_counter(META_QUEUE_SERIAL, serials[1])
        for name, value in preferences:
            txn.put_preference(name, value)

    destination.write_sync(carry)
    return counts
