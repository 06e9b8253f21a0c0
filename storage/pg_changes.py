"""The change feed of the PostgreSQL store: which rows other owners' commits wrote.

Every writer batch logs the rows it wrote (row ids, ``pg_batch.row_id``) in one
``recoverable_changes`` row stamped with its transaction id (``xid8``), its owner and
the server's clock. Nothing in it is a counter every commit must update: a commit adds
its own row and touches no row another owner's commit touches, so the feed puts no order
on the fleet's commits.

A reader asks "what was committed since my snapshot?": the rows whose transaction is not
visible in a snapshot it took earlier (``pg_current_snapshot()``, kept as text) but is
visible now. That question has the same answer whatever order the commits came in, so
no commit can be missed by one that took a lower transaction id and committed later.
The writer asks it twice per batch (``storage/pg_writer.py``):

- in its first round trip, since its previous batch's first round trip: its row cache
  forgets exactly those rows (``pg_batch.RowCache.adopt``);
- in its last, since its first, on the server: :data:`CHANGED_SINCE` refuses the batch
  (SQLSTATE 40001) if one of those commits wrote a row the batch read or a key in a range
  it listed (``storage/pg_readset.py``), and returns the rows they wrote otherwise.

A writer's own rows are left out of both answers (its batches run one at a time).

Pruning. Each owner's heartbeat deletes the rows older than :data:`KEPT_SECONDS`
(server time) every :data:`PRUNE_EVERY` beats and moves ``pruned_before`` on
(``recoverable_change_horizon``, one row, touched by the pruning transaction only). A
snapshot taken less than :data:`TRUSTED_SECONDS` after ``pruned_before`` can no longer be
answered for (a commit it missed may have been pruned): the cache is dropped whole, and
the check refuses the batch. This assumes a commit completes within
:data:`TRUSTED_SECONDS` of writing its change row (after it, a batch's last round trip
only writes its own ``txn_log`` row, notifies and commits; each statement is bounded by
``statement_timeout``); a synchronous standby that holds commits back longer is outside
it. A batch too large to log its keys (``MAX_LOGGED_KEYS``) logs NULL: it drops every
other owner's cache and refuses every batch it overlaps.

Cost. A reader scans the rows whose transaction id is at least its snapshot's ``xmin``:
normally the last moments' commits. A transaction elsewhere on the server that holds a
transaction id for long holds ``xmin`` back, and the scans grow towards the five minutes
the feed keeps.

The monitor's and the waiters' "has anything been committed?" (``last_txnid``) is the sum
of the owners' commit counts in ``recoverable_txn_log`` (each owner's row is written by
its own batches only): it moves on every commit and is read in the same snapshot as what
it guards.
"""

from __future__ import annotations

from typing import Any, Final

import psycopg

__all__ = [
    "CHANGED_SINCE", "CHANGES_SINCE", "COMMIT_COUNT", "KEPT_SECONDS", "LOG_CHANGES",
    "PRUNE", "PRUNE_EVERY", "SNAPSHOT_NOW", "TRUSTED_SECONDS", "step_5",
]

KEPT_SECONDS: Final = 300.0  # change rows older than this (server time) are pruned
# A snapshot is answered for while it was taken this long after the pruning horizon: a
# commit's change row is written in its last round trip, seconds at most before it commits.
TRUSTED_SECONDS: Final = 120.0
PRUNE_EVERY: Final = 30  # heartbeats between two prunings by one owner

FUNCTION: Final = "recoverable_changed_since"

# The first statement of a batch's first round trip: the snapshot every later question is
# asked against, the server's clock then, and the pruning horizon.
SNAPSHOT_NOW: Final = (
    "SELECT pg_current_snapshot()::text, extract(epoch FROM clock_timestamp())::float8,"
    " extract(epoch FROM (SELECT pruned_before FROM recoverable_change_horizon))::float8"
)
_SINCE: Final = (
    "xid >= pg_snapshot_xmin({s}) AND NOT pg_visible_in_snapshot(xid, {s})"
    " AND owner_id <> {me}"
)
# The rows other owners' commits wrote since a snapshot (keys NULL: too many to log).
CHANGES_SINCE: Final = (
    "SELECT keys FROM recoverable_changes WHERE "
    + _SINCE.format(s="%(since)s::pg_snapshot", me="%(me)s")
)
# The check of an optimistic batch (see the module doc): its parameters are the snapshot
# and clock of its first round trip, its owner, the rows it read and the ranges it listed.
CHANGED_SINCE: Final = (
    f"SELECT {FUNCTION}(%s::pg_snapshot, to_timestamp(%s), %s, %b::bytea[], %b::bytea[],"
    " %b::bytea[])"
)
# A batch's change row (in its last round trip).
LOG_CHANGES: Final = "INSERT INTO recoverable_changes (owner_id, keys) VALUES (%s, %b)"
# "Has anything been committed?": the owners' commit counts, summed.
COMMIT_COUNT: Final = "SELECT coalesce(sum(commits), 0)::int8 FROM recoverable_txn_log"
# One pruning (one transaction): the horizon first, then the rows behind it.
PRUNE: Final = (
    "WITH horizon AS (UPDATE recoverable_change_horizon SET pruned_before ="
    " greatest(pruned_before, clock_timestamp() - make_interval(secs => %s))"
    " RETURNING pruned_before)"
    " DELETE FROM recoverable_changes WHERE at < (SELECT pruned_before FROM horizon)"
)


def step_5(conn: psycopg.Connection[Any]) -> None:
    """Version 5: the change feed by transaction visibility (this module's doc) in place
    of the commit counter and its log, the owners' commit counts, and ``bytes_used`` one
    row per owner (``storage/pg_sql.py``): no row that every commit updates."""
    conn.execute(f"DROP FUNCTION IF EXISTS {FUNCTION}(bigint, bytea[], bytea[], bytea[])")
    conn.execute("DROP TABLE IF EXISTS recoverable_changes")
    conn.execute(
        "CREATE TABLE recoverable_changes ("
        " xid xid8 NOT NULL DEFAULT pg_current_xact_id(),"
        " owner_id text NOT NULL,"
        " at timestamptz NOT NULL DEFAULT clock_timestamp(),"
        " keys bytea[])"
    )
    conn.execute("CREATE INDEX recoverable_changes_by_xid ON recoverable_changes (xid)")
    conn.execute("CREATE INDEX recoverable_changes_by_at ON recoverable_changes (at)")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS recoverable_change_horizon ("
        " singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),"
        " pruned_before timestamptz NOT NULL)"
    )
    conn.execute(
        "INSERT INTO recoverable_change_horizon (singleton, pruned_before)"
        " VALUES (true, 'epoch') ON CONFLICT (singleton) DO NOTHING"
    )
    conn.execute(
        "ALTER TABLE recoverable_txn_log ADD COLUMN IF NOT EXISTS"
        " commits bigint NOT NULL DEFAULT 0"
    )
    # bytes_used, one row per owner beside the meta row (storage/pg_sql.py).
    conn.execute(
        "CREATE TABLE IF NOT EXISTS recoverable_bytes ("
        " owner_id text PRIMARY KEY, bytes bigint NOT NULL)"
    )
    since = _SINCE.format(s="since", me="me")
    conn.execute(
        f"""
CREATE OR REPLACE FUNCTION {FUNCTION}(
    since pg_snapshot, since_at timestamptz, me text, read_rows bytea[], lows bytea[],
    highs bytea[]
) RETURNS bytea[] LANGUAGE plpgsql VOLATILE AS $check$
DECLARE
    changed bytea[];
BEGIN
    IF since_at <= (SELECT pruned_before FROM recoverable_change_horizon)
                   + make_interval(secs => {TRUSTED_SECONDS}) THEN
        RAISE EXCEPTION 'recoverable: the commits since this batch read cannot be checked'
              ' (the change log was pruned since)'
              USING ERRCODE = 'serialization_failure';
    END IF;
    IF EXISTS (SELECT 1 FROM recoverable_changes WHERE {since} AND keys IS NULL) THEN
        RAISE EXCEPTION 'recoverable: the commits since this batch read cannot be checked'
              ' (one was too large to log its keys)'
              USING ERRCODE = 'serialization_failure';
    END IF;
    SELECT coalesce(array_agg(DISTINCT entry), '{{}}') INTO changed
      FROM recoverable_changes, unnest(keys) AS entry WHERE {since};
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
