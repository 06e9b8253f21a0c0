"""Claims on the PostgreSQL store: workers of a fleet take disjoint operations.

A worker's claim round (``actors/worker.py``) reads a page of the queue, keeps what it
may run, and then *reserves* those operations before it starts them: one statement
(:func:`reserve_statement`) locks their ``recoverable_operations`` rows ``FOR NO KEY UPDATE SKIP
LOCKED`` in queue order and writes a ``recoverable_claims`` row for each it got (this
owner, until :data:`CLAIM_SECONDS` from the server's ``now()``). It skips, and never
waits for:

- a row another claimer's reservation is locking at that moment, or a writer batch of
  another owner is updating (its last round trip holds the row);
- an operation another owner reserved, while that owner is live (its advisory lock held,
  its heartbeat not expired: ``pg_schema.LIVE_OWNERS``) and its reservation has not
  lapsed.

So two workers reading the same page start different operations instead of racing for
the same leases (the loser's execution would end ``busy``). A reservation is a hint,
never the authority: the lease and its fence still decide who may run an operation, and
the reservation matters only between the claim round and the lease's commit (that
commit makes the lease live, which every claim round already skips). A reservation
whose owner dies or closes stops counting at once; one that lapses counts no more
after :data:`CLAIM_SECONDS` (a worker that reserved and then could not start the
operation, say). An owner that is not live itself (lost) reserves nothing.

The statement runs on a reading connection in autocommit: its row locks are held by the
server for that one statement only, never across a client's round trip, so a stopped
client holds nothing. Being hints, reservations are not made durable: the table is
``UNLOGGED`` (emptied by a server crash, not copied to standbys) and the reading
connections commit without waiting for the WAL flush (``synchronous_commit=off``).
Each owner's heartbeat prunes the lapsed rows with the change feed
(:data:`PRUNE_CLAIMS`).
"""

from __future__ import annotations

from typing import Any, Final

import psycopg

from recoverable.storage.pg_operations import TABLE as OPERATIONS

__all__ = [
    "CLAIMS", "CLAIM_SECONDS", "KEEP_LAPSED_SECONDS", "PRUNE_CLAIMS", "reserve_statement",
    "step_6",
]

CLAIMS: Final = "recoverable_claims"
# How long a reservation keeps other owners' workers off an operation while its owner is
# live: well beyond a claim round's lease commit, short enough that an operation its
# worker could not start is soon another's.
CLAIM_SECONDS: Final = 10.0
# Lapsed reservations older than this are deleted by each owner's pruning.
KEEP_LAPSED_SECONDS: Final = 60.0


def reserve_statement(live_owners: str) -> str:
    """The reservation statement over ``live_owners`` (``pg_schema.LIVE_OWNERS``: one
    positional parameter, the lock namespace). Parameters, in order: the lock namespace,
    the operation keys (``bytea[]``, in queue order), this owner's id twice, the limit,
    this owner's id, the seconds a reservation lasts. Returns the keys reserved, in no
    particular order."""
    return f"""
WITH live AS ({live_owners}),
free AS (
  SELECT o.key FROM {OPERATIONS} o
  JOIN unnest(%s::bytea[]) WITH ORDINALITY AS w(key, n) ON w.key = o.key
  LEFT JOIN {CLAIMS} c ON c.operation_key = o.key
  WHERE %s IN (SELECT owner_id FROM live)
    AND (c.owner_id IS NULL OR c.owner_id = %s OR c.until <= now()
         OR c.owner_id NOT IN (SELECT owner_id FROM live))
  ORDER BY w.n
  LIMIT %s
  FOR NO KEY UPDATE OF o SKIP LOCKED
)
INSERT INTO {CLAIMS} AS c (operation_key, owner_id, until)
SELECT key, %s, now() + make_interval(secs => %s) FROM free
ON CONFLICT (operation_key) DO UPDATE SET owner_id = EXCLUDED.owner_id, until = EXCLUDED.until
  WHERE c.owner_id = EXCLUDED.owner_id OR c.until <= now()
     OR c.owner_id NOT IN (SELECT owner_id FROM live)
RETURNING operation_key
"""


# Parameter: KEEP_LAPSED_SECONDS.
PRUNE_CLAIMS: Final = (
    f"DELETE FROM {CLAIMS} WHERE until < now() - make_interval(secs => %s)"
)


def step_6(conn: psycopg.Connection[Any]) -> None:
    """Version 6: the reservations of claim rounds (one row per operation, typed)."""
    conn.execute(
        f"CREATE UNLOGGED TABLE IF NOT EXISTS {CLAIMS} ("
        " operation_key bytea PRIMARY KEY,"
        " owner_id text NOT NULL,"
        " until timestamptz NOT NULL)"
    )
    conn.execute(f"CREATE INDEX IF NOT EXISTS {CLAIMS}_until ON {CLAIMS} (until)")
