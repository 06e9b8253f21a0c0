"""Optimistic batches: what a batch read, and the server's check that nobody changed it.

A writer batch of the PostgreSQL store runs its mutations without any lock
(``storage/pg_writer.py``): its reads come from the row cache and from statements of its
own, its writes stay in memory. Only its last round trip locks, and only what the batch
read, wrote and listed (``storage/pg_locks.py``); then it calls the server's check
(``pg_changes.CHANGED_SINCE``):

- the commits since the batch's first round trip (those not visible in the snapshot it
  took then) must be in the change feed with their keys (a pruned stretch, or a batch
  too large to log its keys, cannot be checked: a conflict);
- no key those commits wrote may be one the batch read (:attr:`ReadSet.rows`, present or
  absent) or fall in a key range it read (:attr:`ReadSet.ranges`: a prefix it listed);
- on a conflict the function raises ``serialization_failure`` (SQLSTATE 40001) and the
  writer runs the batch again: optimistic once more, then holding the writers' lock
  exclusively from its first statement (so a conflict costs a wasted round trip or two,
  never a livelock);
  otherwise it returns the keys those commits wrote (the writer's row cache forgets them).

So a batch's locks are held only while the server runs its last round trip (the check,
the writes, the counters, ``COMMIT``), never while a client computes or waits: a worker
stopped in the middle of a batch holds no lock the others need. The serials
(commands, queue) still commit in serial order: a batch that took one read its counter,
and a batch that read a counter another commit moved conflicts.

A mutation that needs a scan (``cursor``, ``stat``) would send its writes before the
lock: it raises :class:`NeedsLock` and the batch runs under the lock instead.

Version 4 of the schema created the first check (:func:`step_4`, over a commit counter);
version 5 replaced it (``storage/pg_changes.py``).
"""

from __future__ import annotations

from typing import Any, Final

import psycopg

from recoverable.storage.pg_sql import sql_table

__all__ = ["META_COMMITS", "NeedsLock", "ReadSet", "step_4"]

# The meta row every batch moved up to version 4 (no longer written from version 5).
META_COMMITS: Final = b"commits"

FUNCTION: Final = "recoverable_changed_since"


class NeedsLock(BaseException):
    """Internal: an optimistic batch's mutation asked for a scan; run the batch under
    the writers' lock. A ``BaseException``: a mutation's ``except Exception`` never
    swallows it."""


class ReadSet:
    """The committed rows an optimistic batch read (row ids: a table tag byte and the
    key, ``pg_batch.row_id``) and the ranges of row ids it listed (``low <= id <
    high``)."""

    __slots__ = ("ranges", "rows")

    def __init__(self) -> None:
        self.rows: set[bytes] = set()
        self.ranges: list[tuple[bytes, bytes]] = []

    def params(self) -> tuple[Any, ...]:
        """The read rows and ranges, the last parameters of ``pg_changes.CHANGED_SINCE``."""
        return (
            list(self.rows),
            [low for low, _ in self.ranges],
            [high for _, high in self.ranges],
        )


def step_4(conn: psycopg.Connection[Any]) -> None:
    """Version 4: the function that checks an optimistic batch (see the module doc)."""
    meta = sql_table("meta")
    conn.execute(
        f"""
CREATE OR REPLACE FUNCTION {FUNCTION}(
    since bigint, read_rows bytea[], lows bytea[], highs bytea[]
) RETURNS bytea[] LANGUAGE plpgsql VOLATILE AS $check$
DECLARE
    current bigint;
    changed bytea[];
BEGIN
    SELECT ('x' || encode(value, 'hex'))::bit(64)::int8 INTO current
      FROM {meta} WHERE key = '\\x{META_COMMITS.hex()}'::bytea;
    IF current IS NOT DISTINCT FROM since THEN
        RETURN '{{}}';
    END IF;
    IF (SELECT count(*) FROM recoverable_changes
         WHERE commit > since AND commit <= current AND keys IS NOT NULL)
       <> current - since THEN
        RAISE EXCEPTION 'recoverable: the commits since this batch read cannot be checked'
              USING ERRCODE = 'serialization_failure';
    END IF;
    SELECT coalesce(array_agg(DISTINCT entry), '{{}}') INTO changed
      FROM recoverable_changes c, unnest(c.keys) AS entry WHERE c.commit > since;
    IF EXISTS (SELECT unnest(changed) INTERSECT SELECT unnest(read_rows))
       OR EXISTS (SELECT 1 FROM unnest(changed) AS entry, unnest(lows, highs) AS r(low, high)
                   WHERE entry >= r.low AND entry < r.high) THEN
        RAISE EXCEPTION 'recoverable: a row this batch read was changed by another commit'
              USING ERRCODE = 'serialization_failure';
    END IF;
    RETURN changed;
END
$check$"""
    )
