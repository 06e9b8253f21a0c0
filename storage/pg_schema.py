"""The PostgreSQL store's schema: a versioned, idempotent migration.

``recoverable_schema`` holds one row, the schema version. :func:`upgrade` takes an
advisory lock (two processes upgrading at once take turns), applies each missing step in
one transaction, and refuses a database whose schema is newer than this code
(``UnsupportedRecordVersion``: nothing is touched). ``RecoveryStore.open(url)`` runs it;
so does ``recoverable db upgrade --store URL``.

Version 1: one ``(key bytea PRIMARY KEY, value bytea)`` table per logical table (the
bytes the LMDB store writes, see ``storage/pg_sql.py``), the ``meta`` counters, the
owners (one row per opened store: its advisory-lock key and its heartbeat expiry in
server time) and the transaction log (the last batch id of each owner: a commit whose
acknowledgement was lost is resolved by reading it back, never guessed).
Version 2: the ``sources`` table (the source manifest and its index).
Version 3: ``recoverable_operations`` gains typed columns projected from each record
(filled for every existing row), their indexes, and the triggers that refuse a falling
fence or attempts count, a finished phase made live again, a changed admission column
and a changed frozen body, whatever client writes (``storage/pg_operations.py``).
Version 4: the function that checks an optimistic writer batch under the writers' lock
(``storage/pg_readset.py``).
Version 5: the change feed by transaction visibility (``storage/pg_changes.py``) in place
of the ``commits`` counter every batch updated and its log, the pruning horizon, the
owners' commit counts, ``bytes_used`` one row per owner, the check function asking the
feed, and the function taking a batch's keyed locks (``storage/pg_locks.py``).
Version 6: the reservations of workers' claim rounds (``storage/pg_claims.py``). It
only adds a table: a version-5 process still running goes on, its workers reserving
nothing (their claims race for the leases, whose fences decide, as before).
"""

from __future__ import annotations

from typing import Any, Final

import psycopg

from recoverable.errors import StorageUnavailable, UnsupportedRecordVersion
from recoverable.storage.base import TABLES
from recoverable.storage.keys import META_BYTES, META_FORMAT, META_SERIAL
from recoverable.storage.pg_changes import step_5
from recoverable.storage.pg_claims import step_6
from recoverable.storage.pg_locks import step_5_locks
from recoverable.storage.pg_operations import step_3
from recoverable.storage.pg_readset import META_COMMITS, step_4
from recoverable.storage.pg_sql import describe, sql_table
from recoverable.storage.queue import META_QUEUE_SERIAL

__all__ = [
    "LIVE_OWNERS", "LOCK_NAMESPACE", "META_COMMITS", "SCHEMA_VERSION", "owner_lock_held",
    "schema_version", "upgrade",
]

SCHEMA_VERSION: Final = 6
FORMAT_VERSION: Final = 1  # the record format in meta, as in the LMDB store
# Advisory locks of this library: (LOCK_NAMESPACE, n). n = 0: the writers' lock (shared by
# every optimistic batch's last round trip, exclusive for a batch that runs locked: see
# storage/pg_locks.py); n = -1: migrations;
# n > 0: an owner's liveness lock (held by its session for its whole life).
# Single bigint keys: a batch's keyed locks (storage/pg_locks.py).
LOCK_NAMESPACE: Final = 0x5245  # "RE"


def owner_lock_held(lock_key: str) -> str:
    """SQL: the session advisory lock of an owner (its lock key: the SQL expression
    ``lock_key``) is held in this database. Takes one parameter, ``LOCK_NAMESPACE``."""
    return (
        "EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted"
        " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        f" AND l.classid = %s::oid AND l.objid = {lock_key}::oid AND l.objsubid = 2)"
    )


# Every owner whose advisory lock is held and whose heartbeat has not expired (server time).
LIVE_OWNERS: Final = (
    "SELECT o.owner_id FROM recoverable_owners o WHERE o.expires_at > now() AND "
    + owner_lock_held("o.lock_key")
)
WRITER_LOCK: Final = 0
MIGRATION_LOCK: Final = -1


# The logical tables version 1 created (a later table is created by its own step, so an
# existing version-1 database gains it when it is upgraded).
_V1_TABLES: Final = (
    "operations", "payloads", "commands", "leases", "schedule", "hosts", "dispositions",
    "governor", "meta", "queue",
)


def _step_1(conn: psycopg.Connection[Any]) -> None:
    for table in _V1_TABLES:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {sql_table(table)} "
            "(key bytea PRIMARY KEY, value bytea NOT NULL)"
        )
    for key in (META_BYTES, META_SERIAL, META_QUEUE_SERIAL, META_COMMITS):
        conn.execute(
            f"INSERT INTO {sql_table('meta')} (key, value) VALUES (%s, %s) "
            "ON CONFLICT (key) DO NOTHING",
            (key, (0).to_bytes(8, "big")),
        )
    conn.execute(
        f"INSERT INTO {sql_table('meta')} (key, value) VALUES (%s, %s) "
        "ON CONFLICT (key) DO NOTHING",
        (META_FORMAT, FORMAT_VERSION.to_bytes(8, "big")),
    )
    conn.execute("CREATE SEQUENCE IF NOT EXISTS recoverable_owner_lock MAXVALUE 2147483647 CYCLE")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS recoverable_owners ("
        " owner_id text PRIMARY KEY,"
        " lock_key integer NOT NULL,"
        " started_at timestamptz NOT NULL DEFAULT now(),"
        " expires_at timestamptz NOT NULL)"
    )
    # ``owned``: computed by the writer in its last statement before COMMIT (its owner's
    # advisory lock held, its heartbeat not expired); false fails the CHECK, so a batch
    # of an owner the others may consider dead never commits (storage/pg_writer.py).
    # The keys each batch wrote, by commit count (version 5 replaced it: pg_changes.py).
    conn.execute(
        "CREATE TABLE IF NOT EXISTS recoverable_changes ("
        " commit bigint PRIMARY KEY, keys bytea[])"
    )
    conn.execute(
        "CREATE TABLE IF NOT EXISTS recoverable_txn_log ("
        " owner_id text PRIMARY KEY, txn_id text NOT NULL,"
        " owned boolean NOT NULL CONSTRAINT recoverable_txn_log_owned CHECK (owned))"
    )


def _step_2(conn: psycopg.Connection[Any]) -> None:
    """Version 2: the source manifest (``storage/sources.py``)."""
    conn.execute(
        f"CREATE TABLE IF NOT EXISTS {sql_table('sources')} "
        "(key bytea PRIMARY KEY, value bytea NOT NULL)"
    )


def _step_5(conn: psycopg.Connection[Any]) -> None:
    """Version 5: the change feed (``storage/pg_changes.py``) and the keyed locks
    (``storage/pg_locks.py``)."""
    step_5(conn)
    step_5_locks(conn)


_STEPS: Final = {1: _step_1, 2: _step_2, 3: step_3, 4: step_4, 5: _step_5, 6: step_6}
assert set(_V1_TABLES) | {"sources"} == set(TABLES), "a new logical table needs a step"


def schema_version(conn: psycopg.Connection[Any]) -> int:
    """The database's schema version (0: never migrated)."""
    row = conn.execute(
        "SELECT to_regclass('recoverable_schema') IS NOT NULL"
    ).fetchone()
    if not row or not row[0]:
        return 0
    found = conn.execute("SELECT version FROM recoverable_schema").fetchone()
    return 0 if found is None else int(found[0])


def upgrade(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """Bring the schema to :data:`SCHEMA_VERSION`: ``(before, after)``. Idempotent.

    ``conn`` is in autocommit mode; each call is one transaction under the migration
    lock. A newer schema than this code raises ``UnsupportedRecordVersion``.
    """
    try:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LOCK_NAMESPACE, MIGRATION_LOCK))
            conn.execute(
                "CREATE TABLE IF NOT EXISTS recoverable_schema ("
                " singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),"
                " version integer NOT NULL)"
            )
            before = schema_version(conn)
            if before > SCHEMA_VERSION:
                raise UnsupportedRecordVersion(
                    f"the database's recoverable schema is version {before}; this library "
                    f"reads version {SCHEMA_VERSION} (upgrade recoverable)"
                )
            for version in range(before + 1, SCHEMA_VERSION + 1):
                _STEPS[version](conn)
            conn.execute(
                "INSERT INTO recoverable_schema (singleton, version) VALUES (true, %s) "
                "ON CONFLICT (singleton) DO UPDATE SET version = EXCLUDED.version",
                (SCHEMA_VERSION,),
            )
    except psycopg.Error as exc:
        raise StorageUnavailable(f"migrating the schema failed: {describe(exc)}") from exc
    return before, SCHEMA_VERSION
