"""Keyed locks: what an optimistic batch locks in its last round trip, instead of the fleet.

Two writers' batches need to exclude each other only where one read or listed what the
other writes. So the last round trip of an optimistic batch (``storage/pg_writer.py``)
takes, before the server's check (``pg_changes.CHANGED_SINCE``):

1. the writers' lock in *shared* mode (``pg_advisory_xact_lock_shared``): every other
   optimistic batch holds it the same way, so this excludes only a batch running
   *locked* (after repeated conflicts, or one that needs a scan: exclusive mode, from its
   first statement, as every batch once did);
2. a transaction-scoped advisory lock per key, in ascending order (:data:`LOCK_KEYS`),
   so two batches never wait on each other in a cycle:
   - each *operation* the batch read a row of (its record, command, lease, disposition,
     payloads, queue membership): shared when it only read them, exclusive when it wrote
     one; any other row (a job index entry, a source row, a serial) on its own the same
     way;
   - each key *range* the batch listed (a job's entries in the job index, an account's,
     a source's bound operations): exclusive; and every range a written key falls in
     (:data:`RANGES`): shared. So a batch listing a range and a batch writing into it
     exclude each other, and batches writing into one range (admissions of one account)
     do not. A range of any other shape cannot be locked so: a batch listing one runs
     locked (``NeedsLock``).

After its locks, a batch's check sees every commit that wrote what it read (such a commit
held a conflicting lock, so it committed before the lock was granted, and is visible to
the check's snapshot), and no commit that will write it can begin before this one ends:
the check and the writes are one atomic step for every row the batch depends on, and for
nothing else. A worker stopped in its last round trip (SIGSTOP) holds its own keys only.

Bounds. Advisory locks share the server's lock table (``max_locks_per_transaction`` x
``max_connections`` entries): a batch needing more than :data:`MAX_KEYS` keys takes the
writers' lock exclusively instead (it waits for the batches in their last round trip,
and they for it), counted as ``wide_batches``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any, Final

import psycopg

from recoverable.storage.keys import HASH_BYTES
from recoverable.storage.pg_sql import sql_table

__all__ = [
    "LOCK_KEYS", "MAX_KEYS", "RANGES", "lock_keys", "lockable_range", "operation_lock",
    "step_5_locks",
]

MAX_KEYS: Final = 1024
FUNCTION: Final = "recoverable_lock_keys"
# The call: the keys (bigint, ascending) and whether each is taken exclusively.
LOCK_KEYS: Final = f"SELECT {FUNCTION}(%s::int8[], %s::bool[])"

# The ranges a batch may list without the fleet's lock, by table: the prefix lengths
# (``storage/keys.py``: a job index key is the account's digest, the scope's, the job's,
# then the operation id; a source binding is ``b``, the source key's digest, then the
# operation id).
RANGES: Final[dict[str, tuple[int, ...]]] = {
    sql_table("hosts"): (HASH_BYTES, 2 * HASH_BYTES, 3 * HASH_BYTES),
    sql_table("sources"): (1, 1 + HASH_BYTES),
}


def lockable_range(db: str, prefix: bytes) -> bool:
    """Whether a listing of ``prefix`` in SQL table ``db`` can be locked by key."""
    return len(prefix) in RANGES.get(db, ())


def _key(name: bytes) -> int:
    """A lock key: 64 bits of a digest of its name (signed, as PostgreSQL's bigint)."""
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "big", signed=True)


def operation_lock(operation: bytes) -> int:
    """The key every batch that reads or writes a row of ``operation`` (its key,
    ``keys.operation_key``) locks: ``pg_locks`` names the batch holding it (``objid``
    and ``classid`` are its low and high 32 bits)."""
    return _key(b"o" + operation)


def lock_keys(
    read: Iterable[bytes], written: Iterable[bytes], ranges: Iterable[bytes],
    *, identity: Callable[[bytes], bytes], table_of: Callable[[int], str],
) -> tuple[list[int], list[bool]]:
    """The keys of a batch (see the module doc) in ascending order, and for each whether
    it is taken exclusively. ``read`` / ``written``: row ids (a table tag byte, the key);
    ``ranges``: the listed ranges' lows (a tag byte, the prefix); ``identity(rid)``: what
    a row is locked as (``b"o"`` and its operation's key, or ``b"r"`` and the row id:
    ``pg_batch.lock_identity``); ``table_of(tag)``: the SQL table of a tag. Each distinct
    identity is hashed once (a batch's rows are mostly a few rows per operation)."""
    exclusive: set[bytes] = set()
    for rid in written:
        exclusive.add(identity(rid))
        lengths = RANGES.get(table_of(rid[0]))
        if lengths:
            # The ranges a written key falls in: shared (unless listed: exclusive below).
            for length in lengths:
                if len(rid) - 1 >= length:
                    exclusive.add(b"s" + rid[: 1 + length])
    shared = {identity(rid) for rid in read}
    listed = {b"p" + low for low in ranges}
    modes: dict[int, bool] = {}
    for name in shared:
        modes[_key(name)] = False
    for name in exclusive:
        if name[:1] == b"s":  # a range written into: shared, under the range's own name
            modes.setdefault(_key(b"p" + name[1:]), False)
        else:
            modes[_key(name)] = True
    for name in listed:
        modes[_key(name)] = True
    keys = sorted(modes)
    return keys, [modes[key] for key in keys]


def step_5_locks(conn: psycopg.Connection[Any]) -> None:
    """The function that takes a batch's keys in order (part of schema version 5)."""
    conn.execute(
        f"""
CREATE OR REPLACE FUNCTION {FUNCTION}(keys bigint[], exclusive boolean[])
RETURNS void LANGUAGE plpgsql VOLATILE AS $lock$
BEGIN
    FOR i IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        IF exclusive[i] THEN
            PERFORM pg_advisory_xact_lock(keys[i]);
        ELSE
            PERFORM pg_advisory_xact_lock_shared(keys[i]);
        END IF;
    END LOOP;
END
$lock$"""
    )
