"""The writer's view of a batch: a process-local row cache and buffered writes.

Every statement of the writer is a round trip (and, on a busy host, a wait for the GIL
after it), so the writer avoids the ones it can prove it does not need:

- **Row cache.** The rows as this process last committed or read them. Every batch of
  every process logs the keys it wrote in the change feed (``storage/pg_changes.py``); a
  batch's first round trip takes a snapshot and reads what other owners committed since
  the previous batch's, and evicts exactly those rows (a pruned stretch of the feed, or
  a batch too large to log, drops the whole cache); an optimistic batch's commit also
  evicts what others wrote
  between its first read and it (the server's check returns those keys,
  ``storage/pg_readset.py``). Reads are served from what remains, and the check, before
  the batch commits, refuses any read that another commit made stale. An unknown commit
  outcome or any failure drops the cache too, and it is bounded (:data:`CACHE_ROWS`).
- **Rows of one operation together.** A read the cache cannot answer of a row keyed by
  an operation id (its record, command, lease, disposition, payloads, queue membership)
  fetches all of that operation's rows in one statement: a mutation reads several of them
  and each would otherwise be a round trip (absent rows are cached as absent).
- **Rows of a whole batch together.** A write may name the operations it will read
  (``store.write(fn, touches=...)``): the batch's first round trip, pipelined behind the
  change log, fetches them all at once (:class:`Prefetch`) — every row of an operation
  not cached, the small rows (record, command, lease, disposition, queue membership) of
  one that is, since another process may have changed them — so a batch of N such writes
  costs no read round trip at all instead of N. A record about to be created brings its
  job's whole range of the job index: admission's "is this job already here?" is then
  answered from memory (``prefix_keys``), not by flushing and scanning.
- **Buffered writes.** A mutation's writes are kept in memory (its reads see them) and
  sent at the end of the batch, one statement per table (``unnest`` arrays). A scan
  (``cursor``, ``stat``) first sends what is buffered, so SQL sees every write.

A mutation that raises is rolled back in memory (``end_mutation(False)`` forgets its
layer) when none of its writes reached the server (:attr:`BatchSnapshot.mutation_sent`):
the batch goes on without it, no statement needed. Otherwise, savepoints (a batch run
again with each mutation alone, ``pg_writer``): the writer calls
:meth:`BatchSnapshot.flush` before each ``SAVEPOINT`` and :meth:`end_mutation` after the
mutation, so a mutation rolled back to its savepoint takes only its own writes with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import psycopg

from recoverable.records import OperationRecord
from recoverable.storage.base import TABLES
from recoverable.storage.keys import (
    META_BYTES,
    PAYLOAD_KINDS,
    hosts_key,
    hosts_prefix,
    operation_key,
    u64,
)
from recoverable.storage.pg_changes import TRUSTED_SECONDS
from recoverable.storage.pg_locks import lock_keys, lockable_range
from recoverable.storage.pg_operations import INSERT_MANY, columns_of
from recoverable.storage.pg_readset import NeedsLock, ReadSet
from recoverable.storage.pg_sql import SqlCursor, SqlSnapshot, prefix_end, sql_table
from recoverable.storage.queue import MEMBER, META_QUEUE_SERIAL, ORDER

__all__ = [
    "CACHE_ROWS", "LAST_ORDER", "BatchSnapshot", "Prefetch", "RowCache",
    "changed_keys", "last_order_serial", "lock_identity", "row_id",
]

CACHE_ROWS: Final = 200_000
MAX_LOGGED_KEYS: Final = 4096  # a batch writing more logs None (the others drop their cache)
SQL_TABLES: Final[tuple[str, ...]] = tuple(sql_table(table) for table in TABLES)
TABLE_INDEX: Final[dict[str, int]] = {name: index for index, name in enumerate(SQL_TABLES)}
# A row's id in the caches and the write buffers: its table's index (one byte), then its
# key — the form ``recoverable_changes`` logs. Bytes, not a (table, key) tuple: a dict of
# bytes is never tracked by the garbage collector, and a tuple per read was.
_TAG: Final[dict[str, bytes]] = {name: bytes((index,)) for name, index in TABLE_INDEX.items()}
_META: Final = sql_table("meta")
# The meta row the server counts (``value + n`` in the batch's last statements): no
# mutation depends on its exact value, so it is neither logged nor checked.
_COUNTED: Final = frozenset({_TAG[_META] + META_BYTES})
_DELETED: Final = None  # a buffered delete (and, in the cache, a row known to be absent)
_BY_OPERATION: Final = frozenset(
    sql_table(table) for table in ("operations", "commands", "leases", "dispositions")
)
_PAYLOADS: Final = sql_table("payloads")
_OPERATIONS: Final = sql_table("operations")
_QUEUE: Final = sql_table("queue")
_KINDS: Final = tuple(sorted(kind.encode() for kind in PAYLOAD_KINDS))
# The queue order row an operation's membership row names (its serial: the first 8 bytes).
_ORDER_ROWS: Final = (
    f"SELECT '{_QUEUE}', o.key, o.value FROM {_QUEUE} m JOIN {_QUEUE} o"
    f" ON o.key = '\\x{ORDER.hex()}'::bytea || substring(m.value from 1 for 8)"
    " WHERE m.key = {members}"
)
_HOSTS: Final = sql_table("hosts")
_MANY_OPERATIONS: Final = " UNION ALL ".join(
    [f"SELECT '{table}', key, value FROM {table} WHERE key = ANY(%(ops)b)" for table in sorted(
        _BY_OPERATION)]
    + [f"SELECT '{_PAYLOADS}', key, value FROM {_PAYLOADS} WHERE key = ANY(%(payloads)b)",
       f"SELECT '{_QUEUE}', key, value FROM {_QUEUE} WHERE key = ANY(%(members)b)",
       _ORDER_ROWS.format(members="ANY(%(members)b)"),
       # Every job index entry of each job about to be admitted (its prefix's range).
       f"SELECT '{_HOSTS}', h.key, h.value FROM {_HOSTS} h JOIN"
       " unnest(%(jobs)b::bytea[], %(jobs_end)b::bytea[]) AS r(low, high)"
       " ON h.key >= r.low AND h.key < r.high"]
)


class Prefetch:
    """The rows a batch's hinted writes will read, fetched in its first round trip.

    Built before the batch's first round trip from the row cache as it stands: an operation whose
    record is not cached gets all its rows (payloads too); one that is gets its small
    rows, which another process may have changed since (the change log, read in the same
    round trip, may evict them). A record about to be created also names its hosts
    index entry. :meth:`seed` caches what came back (absent rows as absent), after the
    change log was applied: the rows were read after the log, so they are at least as
    new as it (and the batch's check refuses any that changed before it commits)."""

    def __init__(
        self, ops: list[bytes], payloads: list[bytes], hosts: list[bytes],
        jobs: list[bytes] | None = None,
    ) -> None:
        jobs = jobs or []
        # Statement parameters: lists of keys (``jobs_end``: a range's end, or None).
        self.params: dict[str, list[Any]] = {
            "ops": ops, "payloads": payloads, "members": [MEMBER + key for key in ops],
            "hosts": hosts, "jobs": jobs,
            "jobs_end": [_range_end(prefix) for prefix in jobs],
        }
        self.sql = _MANY_OPERATIONS

    @classmethod
    def for_batch(cls, cache: RowCache, hinted: Iterable[str | OperationRecord]) -> Prefetch:
        """The rows of the operations the batch's writes name (see the class doc)."""
        rows = cache.rows
        ops: dict[bytes, None] = {}
        payloads: list[bytes] = []
        hosts: list[bytes] = []
        jobs: list[bytes] = []
        for touched in hinted:
            if isinstance(touched, OperationRecord):
                hosts.append(hosts_key(touched))
                jobs.append(hosts_prefix(
                    touched.account, touched.scope, touched.job_id, with_job=True
                ))
                touched = touched.operation_id
            key = operation_key(touched)
            if key in ops:
                continue
            ops[key] = None
            if _TAG[_OPERATIONS] + key not in rows:
                payloads.extend(_payload_keys(key))
        return cls(list(ops), payloads, hosts, jobs)

    @classmethod
    def one_operation(cls, operation: bytes) -> Prefetch:
        """Every row of one operation (a read the row cache could not answer)."""
        return cls([operation], _payload_keys(operation), [])

    def __bool__(self) -> bool:
        return bool(self.params["ops"])

    def found(self, fetched: Iterable[Any]) -> dict[bytes, bytes | None]:
        """Every row asked for, by row id: those ``fetched``, the others as absent."""
        params = self.params
        found: dict[bytes, bytes | None] = dict.fromkeys(
            [tag + key for tag in _BY_OPERATION_TAGS for key in params["ops"]]
        )
        for tag, keys in _OTHER_TAGS:
            for key in params[keys]:
                found[tag + key] = None
        for db, key, value in fetched:
            found[_TAG[db] + key] = value
        return found

    def seed(self, cache: RowCache, fetched: list[Any]) -> None:
        if len(cache.rows) < CACHE_ROWS:
            cache.rows.update(self.found(fetched))

    def job_ranges(self, fetched: list[Any]) -> dict[bytes, set[bytes]]:
        """The job index entries read for each job prefix (by ``_TAG[hosts] + prefix``):
        the whole committed range when it was read (checked when the batch commits)."""
        ranges: dict[bytes, set[bytes]] = {
            _HOSTS_TAG + prefix: set() for prefix in self.params["jobs"]
        }
        if not ranges:
            return ranges
        for db, key, _value in fetched:
            if db != _HOSTS:
                continue
            key = bytes(key)
            for prefix in self.params["jobs"]:
                if key.startswith(prefix):
                    ranges[_HOSTS_TAG + prefix].add(key)
        return ranges


# The highest committed queue order row (its key), read with the meta rows (pg_writer).
LAST_ORDER: Final = (
    f"SELECT key FROM {_QUEUE} WHERE key >= '\\x{ORDER.hex()}'::bytea"
    f" AND key < '\\x{bytes([ORDER[0] + 1]).hex()}'::bytea ORDER BY key DESC LIMIT 1"
)


def last_order_serial(rows: list[Any]) -> int:
    """The serial of ``LAST_ORDER``'s row (0: no order row)."""
    return int.from_bytes(bytes(rows[0][0])[1:], "big") if rows else 0


def _range_end(prefix: bytes) -> bytes:
    """A bound above every job index key that starts with ``prefix`` (always a value, so
    the range is an index range scan: an open end would scan the index to its end). An
    all-0xff prefix (a digest that never occurs in practice) is bounded past the longest
    key it can start (an operation key is at most a few hundred bytes)."""
    return prefix_end(prefix) or prefix + b"\xff" * 1024


def row_id(db: str, key: bytes) -> bytes:
    """The id of the row ``key`` of SQL table ``db`` (see ``_TAG``)."""
    return _TAG[db] + key


def _payload_keys(operation: bytes) -> list[bytes]:
    return [operation + b"\0" + kind for kind in _KINDS]


def _operation_of(db: str, key: bytes) -> bytes | None:
    """The operation key a row belongs to, when its table is keyed by operation."""
    if db in _BY_OPERATION:
        return key
    if db == _PAYLOADS:
        operation, separator, _kind = key.rpartition(b"\0")
        return operation if separator else None
    if db == _QUEUE and key.startswith(MEMBER):
        return key[len(MEMBER):]
    return None


_BY_OPERATION_TAGS: Final = tuple(_TAG[db] for db in sorted(_BY_OPERATION))


def lock_identity(rid: bytes) -> bytes:
    """What a row is locked as (``storage/pg_locks.py``): ``b"o"`` and the key of the
    operation it belongs to (``_operation_of``), or ``b"r"`` and its row id."""
    operation = _operation_of(SQL_TABLES[rid[0]], rid[1:])
    return b"r" + rid if operation is None else b"o" + operation


_HOSTS_TAG: Final = _TAG[_HOSTS]
_OTHER_TAGS: Final = (
    (_TAG[_PAYLOADS], "payloads"), (_TAG[_QUEUE], "members"), (_TAG[_HOSTS], "hosts")
)


class RowCache:
    """Rows by row id (``row_id``) as committed, and the snapshot they are valid at."""

    def __init__(self) -> None:
        self.rows: dict[bytes, bytes | None] = {}
        # The snapshot of the last batch's first round trip (``pg_changes.SNAPSHOT_NOW``,
        # as text; None: nothing is known) and the server's clock then (epoch seconds):
        # every cached row is valid at it, except those other owners wrote since (the next
        # batch's first round trip names them, ``adopt``).
        self.since: str | None = None
        self.since_at = 0.0
        # The highest serial of a committed queue order row, read with the meta rows in a
        # batch's first round trip (``LAST_ORDER``): until then, unknown (no order row is assumed
        # absent without a read).
        self.last_order: int = 2**64

    def clear(self) -> None:
        self.rows.clear()
        self.since = None

    def seed(self, db: str, rows: dict[bytes, bytes]) -> None:
        """Rows read at a batch's start (committed state): cache them."""
        tag = _TAG[db]
        for key, value in rows.items():
            self.rows[tag + key] = value

    def adopt(
        self, snapshot: str, at: float, pruned_before: float | None,
        changes: list[list[bytes] | None] | None,
    ) -> None:
        """At a batch's start: ``snapshot`` (taken at server time ``at``) is the batch's,
        ``changes`` the change rows other owners committed since :attr:`since` (read in
        the same round trip, after ``snapshot``: they may name commits after it too,
        forgotten as well; None: not asked, nothing was known). The cache keeps every row
        nobody else changed; it is dropped whole when that cannot be told: the previous
        snapshot is too close to the pruning horizon ``pruned_before`` (a commit since it
        may have been pruned, ``pg_changes.TRUSTED_SECONDS``), or a commit was too large
        to log its keys."""
        since_at = self.since_at
        known = self.since is not None and changes is not None
        self.since, self.since_at = snapshot, at
        if not known or (
            pruned_before is not None and since_at <= pruned_before + TRUSTED_SECONDS
        ):
            self.rows.clear()
            return
        rows = self.rows
        assert changes is not None
        for keys in changes:
            if keys is None:
                rows.clear()
                return
            for entry in keys:
                rows.pop(bytes(entry), None)  # a row id


def changed_keys(written: Iterable[bytes]) -> list[bytes] | None:
    """The rows a batch wrote (row ids), for ``recoverable_changes`` (None: too many to
    log)."""
    entries = [rid for rid in written if rid not in _COUNTED]
    return None if len(entries) > MAX_LOGGED_KEYS else entries


class BatchSnapshot(SqlSnapshot):
    """``SqlSnapshot`` for one writer batch: cached reads, buffered writes."""

    def __init__(self, conn: psycopg.Connection[Any], cache: RowCache) -> None:
        super().__init__(conn)
        self._cache = cache
        # By row id (``row_id``):
        self._batch: dict[bytes, bytes | None] = {}  # this batch's writes
        self._unsent: dict[bytes, bytes | None] = {}  # not yet sent
        self._mutation: dict[bytes, bytes | None] = {}  # the running mutation's
        # Whether some of the running mutation's writes were sent to the server (a scan
        # flushes them): then only a savepoint (or a rerun) can take them back.
        self.mutation_sent = False
        # Key ranges known whole at the batch's start (``Prefetch.job_ranges``), and the
        # keys this batch wrote, by table tag: ``prefix_keys`` lays the second over the
        # first (or over one statement) instead of flushing and scanning.
        self.ranges: dict[bytes, set[bytes]] = {}
        self._written_by_table: dict[bytes, set[bytes]] = {}
        # An optimistic batch (run without the writers' lock): what it read, checked by
        # the server before it commits (``storage/pg_readset.py``). None: under the lock.
        self.reads: ReadSet | None = None

    # -- reads ------------------------------------------------------------------------

    def get(self, key: bytes, db: str) -> bytes | None:
        where = _TAG[db] + key
        if where in self._mutation:
            return self._mutation[where]
        if where in self._batch:
            return self._batch[where]
        if self.reads is not None and where not in _COUNTED:
            self.reads.rows.add(where)
        rows = self._cache.rows
        if where in rows:
            return rows[where]
        if db == _QUEUE and key[:1] == ORDER and len(key) == 9 and int.from_bytes(
            key[1:], "big"
        ) > max(u64(rows.get(_TAG[_META] + META_QUEUE_SERIAL)), self._cache.last_order):
            # An order row of a serial above the committed counter and above every
            # committed order row (both read at the batch's start; the read of this key
            # is checked before the batch commits): not written yet. A counter rolled
            # back below the rows in use is damage: those reads go to the table
            # (WriteTxn.enqueue refuses the serial).
            return None
        operation = _operation_of(db, key)
        if operation is not None and len(rows) < CACHE_ROWS:
            self._fetch_operation(operation)
            if where in rows:
                return rows[where]
        value = super().get(key, db)
        if len(rows) < CACHE_ROWS:
            rows[where] = value  # committed state: no write of ours to this key yet
        return value

    def _fetch_operation(self, operation: bytes) -> None:
        """Cache every row of one operation (committed state; absent ones as absent),
        except those this batch wrote (its layers answer for them)."""
        one = Prefetch.one_operation(operation)
        found = one.found(self._rows(one.sql, one.params))
        rows = self._cache.rows
        for where, value in found.items():
            if where not in self._batch and where not in self._mutation:
                rows[where] = value

    def cursor(self, db: str) -> SqlCursor:
        if self.reads is not None:
            raise NeedsLock  # a scan sends the batch's writes first: run under the lock
        self.flush()
        return super().cursor(db)

    def prefix_keys(self, prefix: bytes, db: str) -> list[bytes]:
        """Every key of ``db`` starting with ``prefix`` as this batch sees it: the range
        read at the batch's start (or read now, one statement: it sees what this batch
        already sent), with the batch's and the mutation's buffered writes laid over."""
        tag = _TAG[db]
        if self.reads is not None:
            if not lockable_range(db, prefix):
                raise NeedsLock  # a range no key lock covers (pg_locks.RANGES)
            end = prefix_end(prefix)
            self.reads.ranges.append(
                (tag + prefix, tag + end if end is not None else bytes((tag[0] + 1,)))
            )
        known = self.ranges.get(tag + prefix)
        keys = set(known) if known is not None else set(super().prefix_keys(prefix, db))
        for key in self._written_by_table.get(tag, ()):
            if not key.startswith(prefix):
                continue
            where = tag + key
            if where in self._mutation:
                value = self._mutation[where]
            elif where in self._batch:
                value = self._batch[where]
            else:
                continue  # a rolled-back mutation's: the committed state decides
            if value is _DELETED:
                keys.discard(key)
            else:
                keys.add(key)
        return sorted(keys)

    def stat(self, db: str) -> dict[str, int]:
        if self.reads is not None:
            raise NeedsLock
        self.flush()
        return super().stat(db)

    # -- writes -----------------------------------------------------------------------

    def replace(self, key: bytes, value: bytes, db: str) -> bytes | None:
        old = self.get(key, db)
        self.put(key, value, db)
        return old

    def put(self, key: bytes, value: bytes, db: str) -> bool:
        self.written.add(db)
        tag = _TAG[db]
        self._mutation[tag + key] = value
        self._written_by_table.setdefault(tag, set()).add(key)
        return True

    def pop(self, key: bytes, db: str) -> bytes | None:
        old = self.get(key, db)
        if old is not None:
            self.written.add(db)
            tag = _TAG[db]
            self._mutation[tag + key] = _DELETED
            self._written_by_table.setdefault(tag, set()).add(key)
        return old

    # -- the batch --------------------------------------------------------------------

    def end_mutation(self, keep: bool) -> None:
        """The mutation finished (``keep``) or was rolled back: its writes join the batch
        or are forgotten."""
        if keep:
            self._batch.update(self._mutation)
            self._unsent.update(self._mutation)
        self._mutation = {}
        self.mutation_sent = False

    def flush(self) -> None:
        """Send every buffered write (the batch's and the running mutation's)."""
        self.send(self.take_writes())

    def take_writes(self) -> list[tuple[str, tuple[Any, ...]]]:
        """The statements that send every buffered write (the batch's and the running
        mutation's), built now and counted as sent: the writer's last round trip builds
        them all before its first statement leaves, so no Python work runs between the
        writers' lock and ``COMMIT`` (``pg_writer.PgWriter._end``)."""
        pending = {**self._unsent, **self._mutation}
        if not pending:
            return []
        if self._mutation:
            self.mutation_sent = True
        upserts: dict[str, tuple[list[bytes], list[bytes]]] = {}
        deletes: dict[str, list[bytes]] = {}
        for rid, value in pending.items():
            db, key = SQL_TABLES[rid[0]], rid[1:]
            if value is _DELETED:
                deletes.setdefault(db, []).append(key)
            else:
                keys, values = upserts.setdefault(db, ([], []))
                keys.append(key)
                values.append(value)
        statements: list[tuple[str, tuple[Any, ...]]] = [
            (f"DELETE FROM {db} WHERE key = ANY(%b)", (keys,)) for db, keys in deletes.items()
        ]
        for db, (keys, values) in upserts.items():
            if db == _OPERATIONS:  # with the typed columns of each record (pg_operations)
                columns = zip(*(columns_of(value) for value in values), strict=True)
                statements.append(
                    (INSERT_MANY, (keys, values, *(list(column) for column in columns)))
                )
                continue
            statements.append((
                f"INSERT INTO {db} (key, value) SELECT * FROM unnest(%b::bytea[], %b::bytea[]) "
                "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                (keys, values),
            ))
        self._unsent = {}
        # The running mutation's writes are sent; they stay in its layer for its reads
        # (and are sent again, harmlessly, if it ends kept and the batch flushes again).
        return statements

    def send(self, statements: list[tuple[str, tuple[Any, ...]]]) -> None:
        """Send statements :meth:`take_writes` built (a failure is kept in ``failed``)."""
        for sql, params in statements:
            self._execute(sql, params)

    def lock_keys(self) -> tuple[list[int], list[bool]]:
        """The keyed locks of this optimistic batch (``storage/pg_locks.py``): what it
        read, wrote and listed."""
        reads = self.reads
        assert reads is not None
        return lock_keys(
            reads.rows, (rid for rid in self._batch if rid not in _COUNTED),
            (low for low, _high in reads.ranges),
            identity=lock_identity, table_of=SQL_TABLES.__getitem__,
        )

    @property
    def written_keys(self) -> list[bytes]:
        """Every row (row id) this batch wrote so far."""
        return list(self._batch)

    def committed(self, changed: Iterable[bytes] = ()) -> None:
        """The batch committed; ``changed``: the rows the commits between its first read
        and it wrote (an optimistic batch's check returns them): the cache forgets those
        and takes the batch's writes (valid at the batch's snapshot: the next batch's
        first round trip forgets what others committed since)."""
        rows = self._cache.rows
        for entry in changed:
            rows.pop(bytes(entry), None)
        if len(rows) + len(self._batch) > CACHE_ROWS:
            self._cache.clear()
            return
        rows.update(self._batch)
