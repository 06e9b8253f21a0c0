"""The PostgreSQL store's rows, seen through the LMDB transaction's shape.

Each logical table of the store (``storage.base.TABLES``) is one PostgreSQL table
``recoverable_<name> (key bytea PRIMARY KEY, value bytea NOT NULL)`` holding the same
bytes the LMDB store writes (``storage/codec.py``; bytea sorts bytewise, as LMDB keys
do). :class:`SqlSnapshot` offers the handful of calls the shared storage code makes on
an LMDB transaction (``get``, ``replace``, ``put``, ``delete``, ``pop``, ``cursor`` with
``set_range`` / ``set_key`` / ``iternext``, ``stat``), each one SQL statement on one
psycopg connection. So the write transaction (``storage/txn.py``), the queries, the
queue scan and the integrity check are the very code the LMDB store runs: the records,
their typed errors, the quotas and the indexes behave the same on both stores.

A failing statement raises ``StorageUnavailable`` (its class, SQLSTATE and the first line
of the server's or libpq's reason, scrubbed of every password: :func:`describe`) and is
remembered in :attr:`SqlSnapshot.failed`: the writer then knows the transaction is lost
whatever the mutation did with the error.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

import psycopg

from recoverable.errors import StorageUnavailable
from recoverable.storage import redact
from recoverable.storage.base import TABLES, Table
from recoverable.storage.keys import META_BYTES
from recoverable.storage.pg_operations import INSERT_ONE, columns_of

__all__ = [
    "BYTES_SHARDS", "PAGE_ROWS", "SqlCursor", "SqlSnapshot", "prefix_end", "read_source",
    "sql_table", "table_names",
]

PAGE_ROWS: Final = 512  # rows fetched per round trip by a cursor scan
_OPERATIONS: Final = "recoverable_operations"  # its writes carry typed columns


def sql_table(table: Table) -> str:
    """The PostgreSQL table of a logical table (a fixed name: safe to format into SQL)."""
    return f"recoverable_{table}"


# ``bytes_used`` on PostgreSQL: the ``meta`` row (what a migration or schema version 4
# left) plus one row per owner that each batch adds its change to (``pg_writer``): no row
# every batch of the fleet updates, so no lock every commit waits for. Gone owners' rows
# are folded back into the ``meta`` row (``pg_engine``). A read of the ``meta`` row sees
# the total, never below 0; a row that is not 8 bytes (damage) is read as it is
# (``check_integrity`` names it).
BYTES_SHARDS: Final = "recoverable_bytes"
_META_SQL: Final = "recoverable_meta"
_BYTES_KEY: Final = f"'\\x{META_BYTES.hex()}'::bytea"
_COUNT: Final = "('x' || encode(value, 'hex'))::bit(64)::int8"
_META_READ: Final = (
    f"(SELECT key, CASE WHEN key = {_BYTES_KEY} AND length(value) = 8 THEN"
    f" int8send(GREATEST(0, {_COUNT} + (SELECT coalesce(sum(bytes), 0) FROM {BYTES_SHARDS}))"
    f"::int8) ELSE value END AS value FROM {_META_SQL}) AS {_META_SQL}"
)
# Gone owners' rows (no owner row: closed, or found dead) folded into the meta row, in
# one statement (the total a reader sees does not move).
FOLD_BYTES: Final = (
    f"WITH gone AS (DELETE FROM {BYTES_SHARDS} b WHERE NOT EXISTS (SELECT 1 FROM"
    " recoverable_owners o WHERE o.owner_id = b.owner_id) RETURNING b.bytes)"
    f" UPDATE {_META_SQL} SET value = int8send(({_COUNT} + (SELECT coalesce(sum(bytes), 0)"
    f" FROM gone))::int8) WHERE key = {_BYTES_KEY} AND length(value) = 8"
)
# A batch's change to ``bytes_used`` (its owner's row).
ADD_BYTES: Final = (
    f"INSERT INTO {BYTES_SHARDS} (owner_id, bytes) VALUES (%s, %s) ON CONFLICT (owner_id)"
    f" DO UPDATE SET bytes = {BYTES_SHARDS}.bytes + EXCLUDED.bytes"
)


def read_source(name: str) -> str:
    """What a read names in ``FROM`` for the SQL table ``name``: the table, or for
    ``meta`` the table with ``bytes_used`` totalled (see ``BYTES_SHARDS``)."""
    return _META_READ if name == _META_SQL else name


def table_names() -> dict[Table, Any]:
    """``dbs`` for the shared storage code: logical table -> SQL table name."""
    return {table: sql_table(table) for table in TABLES}


def describe(exc: BaseException, url: str | None = None) -> str:
    """A database error as it may be shown: its class, SQLSTATE, and the first line of its
    reason ("connection refused", "password authentication failed for user ...") with no
    password of ``url`` (the URL it was connecting with, if any) or of any URL this
    process connected with, bounded (``storage/redact.py``)."""
    state = getattr(exc, "sqlstate", None)
    reason = redact.brief(redact.scrub(str(exc), url))
    return (
        f"{type(exc).__name__}"
        + (f" (SQLSTATE {state})" if state else "")
        + (f": {reason}" if reason else "")
    )


def prefix_end(prefix: bytes) -> bytes | None:
    """The first key after every key that starts with ``prefix`` (None: there is none,
    the prefix is empty or all 0xff)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes((stripped[-1] + 1,))


class _Statements:
    """The SQL of one table, built once."""

    def __init__(self, name: str) -> None:
        source = read_source(name)  # reads; writes name the table
        self.get = f"SELECT value FROM {source} WHERE key = %b"
        self.exists = f"SELECT 1 FROM {name} WHERE key = %b"
        self.put = (
            f"INSERT INTO {name} (key, value) VALUES (%b, %b) "
            "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value"
        )
        # The old value comes back from the same statement (the CTE reads the snapshot
        # before the upsert).
        self.replace = (
            f"WITH old AS (SELECT value FROM {source} WHERE key = %b) "
            f"INSERT INTO {name} (key, value) VALUES (%b, %b) "
            "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value "
            "RETURNING (SELECT value FROM old)"
        )
        self.pop = f"DELETE FROM {name} WHERE key = %b RETURNING value"
        self.count = f"SELECT count(*) FROM {name}"
        self.first_from = f"SELECT key FROM {name} WHERE key >= %b ORDER BY key LIMIT 1"
        self.page_from = (
            f"SELECT key, value FROM {source} WHERE key >= %b ORDER BY key LIMIT {PAGE_ROWS}"
        )
        self.page_after = (
            f"SELECT key, value FROM {source} WHERE key > %b ORDER BY key LIMIT {PAGE_ROWS}"
        )
        self.keys_from = f"SELECT key FROM {name} WHERE key >= %b ORDER BY key LIMIT {PAGE_ROWS}"
        self.keys_after = f"SELECT key FROM {name} WHERE key > %b ORDER BY key LIMIT {PAGE_ROWS}"


_STATEMENTS: Final[dict[str, _Statements]] = {
    sql_table(table): _Statements(sql_table(table)) for table in TABLES
}


class SqlSnapshot:
    """The LMDB-transaction-shaped view of one psycopg connection (see the module doc).

    Used inside one database transaction (the writer's, or a read-only snapshot of the
    read pool); ``written`` collects the logical tables written (the writer notifies
    listeners of command and queue writes).
    """

    def __init__(self, conn: psycopg.Connection[Any], snapshot_id: int = 0) -> None:
        self._conn = conn
        self._id = snapshot_id
        self.failed: BaseException | None = None
        self.written: set[str] = set()

    def id(self) -> int:
        return self._id

    def _rows(self, sql: str, params: tuple[Any, ...] | dict[str, Any]) -> list[Any]:
        try:
            return self._conn.execute(sql, params, binary=True).fetchall()
        except psycopg.Error as exc:
            self.failed = exc
            raise StorageUnavailable(f"the database refused a statement: {describe(exc)}") from exc

    def _one(self, sql: str, params: tuple[Any, ...]) -> Any:
        rows = self._rows(sql, params)
        return rows[0][0] if rows else None

    def get(self, key: bytes, db: str) -> bytes | None:
        value: bytes | None = self._one(_STATEMENTS[db].get, (key,))
        return value

    def replace(self, key: bytes, value: bytes, db: str) -> bytes | None:
        self.written.add(db)
        if db == _OPERATIONS:
            old_record = self.get(key, db)
            self.put(key, value, db)
            return old_record
        old: bytes | None = self._one(_STATEMENTS[db].replace, (key, key, value))
        return old

    def put(self, key: bytes, value: bytes, db: str) -> bool:
        self.written.add(db)
        if db == _OPERATIONS:  # with the record's typed columns (storage/pg_operations.py)
            self._execute(INSERT_ONE, (key, value, *columns_of(value)))
            return True
        self._execute(_STATEMENTS[db].put, (key, value))
        return True

    def _execute(self, sql: str, params: tuple[Any, ...]) -> None:
        try:
            self._conn.execute(sql, params, binary=True)
        except psycopg.Error as exc:
            self.failed = exc
            raise StorageUnavailable(f"the database refused a statement: {describe(exc)}") from exc

    def pop(self, key: bytes, db: str) -> bytes | None:
        self.written.add(db)
        old: bytes | None = self._one(_STATEMENTS[db].pop, (key,))
        return old

    def delete(self, key: bytes, db: str) -> bool:
        return self.pop(key, db) is not None

    def stat(self, db: str) -> dict[str, int]:
        return {"entries": int(self._one(_STATEMENTS[db].count, ()))}

    def prefix_keys(self, prefix: bytes, db: str) -> list[bytes]:
        """Every key of ``db`` that starts with ``prefix``, in order: one statement."""
        upper = prefix_end(prefix)
        if upper is None:
            rows = self._rows(f"SELECT key FROM {db} WHERE key >= %b ORDER BY key", (prefix,))
        else:
            rows = self._rows(
                f"SELECT key FROM {db} WHERE key >= %b AND key < %b ORDER BY key",
                (prefix, upper),
            )
        return [bytes(row[0]) for row in rows]

    def cursor(self, db: str) -> SqlCursor:
        return SqlCursor(self, _STATEMENTS[db])


class SqlCursor:
    """An LMDB-cursor-shaped scan in key order, one page of rows per round trip."""

    def __init__(self, snapshot: SqlSnapshot, statements: _Statements) -> None:
        self._snapshot = snapshot
        self._sql = statements
        self._start: bytes | None = None

    def set_range(self, key: bytes) -> bool:
        """Position at the first key >= ``key``; False when there is none."""
        found = self._snapshot._one(self._sql.first_from, (key,))
        self._start = None if found is None else bytes(found)
        return found is not None

    def set_key(self, key: bytes) -> bool:
        """Position at ``key`` exactly; False when it is missing."""
        found = self._snapshot._one(self._sql.exists, (key,)) is not None
        self._start = key if found else None
        return found

    def iternext(self, keys: bool = True, values: bool = True) -> Iterator[Any]:
        """From the position (or the first key) to the end: ``(key, value)`` pairs, or the
        keys alone with ``values=False``."""
        start = self._start if self._start is not None else b""
        first, after = (
            (self._sql.page_from, self._sql.page_after)
            if values
            else (self._sql.keys_from, self._sql.keys_after)
        )
        rows = self._snapshot._rows(first, (start,))
        while rows:
            for row in rows:
                if not values:
                    yield row[0]
                elif keys:
                    yield row[0], row[1]
                else:
                    yield row[1]
            if len(rows) < PAGE_ROWS:
                return
            rows = self._snapshot._rows(after, (rows[-1][0],))
