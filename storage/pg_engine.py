"""The PostgreSQL engine: the storage contract on a database a fleet shares.

``RecoveryStore.open("postgresql://user@host:port/db")`` opens a ``RecoveryStore`` over
it (the dispatch is in ``storage/store.py``, the seam in ``storage/engine.py``; the LMDB
engine is its sibling, ``storage/lmdb_engine.py``). The records are the same bytes as
LMDB's in one table per logical table (``storage/pg_sql.py``; the operations table also
has typed columns, ``storage/pg_operations.py``), the write transaction is the shared
``WriteTxn`` over SQL, the writer groups the mutations of this process into one PostgreSQL
transaction per batch (``storage/pg_writer.py``); reads use a small pool of connections,
each query from one snapshot (REPEATABLE READ, read only).

Owners and leases. An opened store is an *owner*: a ``recoverable_owners`` row (its id,
an advisory-lock key, a heartbeat expiry in server time) and a session advisory lock held
by a dedicated connection for the store's whole life. Another owner is live while that
lock is held (PostgreSQL drops it when the owner's process or connection dies: SIGKILL,
a killed backend) AND its expiry, renewed by a heartbeat thread, is after the server's
``now()`` (a hung owner stops renewing). The client clock never decides another owner's
liveness. Lease rows, fences and their checks are the shared ones (``storage/leases.py``,
``WriteTxn.put_operation(expect_fence=)``), made atomic by the writer's keyed locks and
commit check (``storage/pg_locks.py``, ``storage/pg_readset.py``: a batch commits only
if nothing it read changed since, and nothing can change it until it has).

Failing closed. If this owner's lock connection is lost or its heartbeat finds its row
expired, the owner is *lost*: every later write is refused (``StorageUnavailable``) and
none of its leases is live, so nothing is authorized, transmitted or delivered by it
again; open the store anew. An unreachable database makes every read and write raise
``StorageUnavailable``. Connection strings are redacted (``postgresql://user:***@...``,
from the raw text: ``storage/redact.py``) in ``path``, ``repr`` and every error, and the
driver's reasons in errors are scrubbed of the password.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any, Final, TypeVar

import psycopg
from psycopg.conninfo import make_conninfo

from recoverable.errors import CorruptRecord, StorageUnavailable, UnsupportedRecordVersion
from recoverable.records import CommandRecord, LeaseRecord
from recoverable.storage import codec, queue, redact
from recoverable.storage.base import Table, Touches
from recoverable.storage.keys import hosts_prefix, key_str, operation_key
from recoverable.storage.leases import LeaseTokens, lease_expired
from recoverable.storage.pg_changes import COMMIT_COUNT, KEPT_SECONDS, PRUNE, PRUNE_EVERY
from recoverable.storage.pg_claims import (
    CLAIM_SECONDS,
    KEEP_LAPSED_SECONDS,
    PRUNE_CLAIMS,
    reserve_statement,
)
from recoverable.storage.pg_listen import CommitListener
from recoverable.storage.pg_schema import (
    LIVE_OWNERS,
    LOCK_NAMESPACE,
    owner_lock_held,
    upgrade,
)
from recoverable.storage.pg_sql import (
    FOLD_BYTES,
    SqlSnapshot,
    describe,
    read_source,
    sql_table,
    table_names,
)
from recoverable.storage.pg_writer import PgWriter
from recoverable.storage.registry import StoreOptions
from recoverable.storage.store import redact_url
from recoverable.storage.txn import WriteState, WriteTxn
from recoverable.types import AccountBinding

__all__ = ["HEARTBEAT_SECONDS", "OWNER_TTL_SECONDS", "PgEngine", "redact_url"]

Result = TypeVar("Result")

OWNER_TTL_SECONDS: Final = 10.0  # another owner is dead once its heartbeat is this old
HEARTBEAT_SECONDS: Final = 1.0
CONNECT_TIMEOUT: Final = 5
POOL_SIZE: Final = 16
# Reads run off the event loop at once (RecoveryStore.read_off_loop): one connection of
# the pool stays for the reads the event loop makes inline.
READ_THREADS: Final = POOL_SIZE - 1
WRITER_IDLE_MS: Final = 5000  # idle_in_transaction_session_timeout of the writer's session
# Every statement of this process (reads, the writer's batches, the heartbeat, LISTEN) is
# bounded by the server: one still running after this long (waiting on a lock, a stalled
# server process) is cancelled (SQLSTATE 57014) and its caller gets StorageUnavailable.
# The owner's session runs the schema upgrade first, unbounded, and is bounded after it.
STATEMENT_TIMEOUT_MS: Final = 30_000
# A dead link or peer (a vanished host, a frozen VM, a cut network) is found by the
# client's kernel: keepalive probes after 5 s of silence, 2 s apart, 3 unanswered end the
# connection; data unacknowledged for 15 s does too (libpq's keepalives*, tcp_user_timeout).
KEEPALIVES: Final = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 15_000,
}
COMMIT_POLL_SECONDS: Final = 0.25  # a monitor's poll when no notification comes
# How long advisory shared state read from the database (the rate governor's pause row)
# may be served from a process's memory: each read is a round trip on the event loop.
ADVISORY_READ_SECONDS: Final = 0.05
QUERY_CANCELED: Final = "57014"  # a statement_timeout (or a cancel request)
RESERVE: Final = reserve_statement(LIVE_OWNERS)  # storage/pg_claims.py



def _connection_lost(conn: psycopg.Connection[Any], exc: BaseException | None) -> bool:
    """The statement failed because the connection is gone: the server ended the
    session (SQLSTATE class 57: a killed backend, a shutdown) or the link broke (08).
    A statement cancelled by its timeout (57014) left the connection as it was."""
    if conn.broken or conn.closed:
        return True
    state = getattr(exc, "sqlstate", None) or ""
    return isinstance(exc, psycopg.OperationalError) and state != QUERY_CANCELED and (
        state.startswith(("57", "08")) or not state
    )


class _OwnerTokens(LeaseTokens):
    """The active lease tokens of this owner; another owner's liveness from the database."""

    def __init__(self, engine: PgEngine) -> None:  # no owner lock file: see PgEngine
        self._store = engine
        self._active: set[str] = set()
        self._lock = threading.Lock()

    def is_live(self, lease: LeaseRecord, now: float | None = None) -> bool:
        if lease_expired(lease, now):
            return False
        if lease.owner_id == self._store.owner_id:
            if self._store.owner_lost:
                return False
            with self._lock:
                return lease.token in self._active
        return self._store.owner_is_live(lease.owner_id)


class _Pool:
    """A few autocommit connections for reads, each used by one thread at a time."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], size: int) -> None:
        self._connect = connect
        self._size = size
        self._idle: list[psycopg.Connection[Any]] = []
        self._lock = threading.Lock()
        self._closed = False

    @contextlib.contextmanager
    def connection(self, *, fresh: bool = False) -> Iterator[psycopg.Connection[Any]]:
        """An idle connection, or a new one (always when ``fresh``)."""
        conn = None
        if not fresh:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._connect()
        try:
            yield conn
        finally:
            idle = (
                not conn.closed
                and not conn.broken
                and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            )
            with self._lock:
                keep = idle and not self._closed and len(self._idle) < self._size
                if keep:
                    self._idle.append(conn)
            if not keep:
                conn.close()

    def discard_idle(self) -> None:
        """Close every idle connection: one was found lost, and what ended its session (a
        server restart, an operator ending every session) most likely ended theirs."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.discard_idle()


class PgEngine:
    """A PostgreSQL database as a ``storage.engine.StoreEngine`` (see the module
    docstring). Open it with ``RecoveryStore.open(url)``."""

    advisory_read_seconds = ADVISORY_READ_SECONDS  # see actors/governor.py
    read_threads = READ_THREADS  # every read is a round trip: off the event loop

    def __init__(self, url: str, options: StoreOptions) -> None:
        self._url = url
        self.path = redact_url(url)
        redact.remember(url)  # its password is scrubbed from every later driver message
        self.max_bytes = options.max_bytes
        self.max_record_bytes = options.max_record_bytes
        self._closed = False
        self.tables = table_names()
        self._owner_id = secrets.token_hex(16)
        self._owner_conn: psycopg.Connection[Any] | None = None
        self._lock_key = 0
        self.owner_lost = False
        self.liveness_queries = 0  # owner_is_live answered by a query of its own
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._pool = _Pool(self._connect_reader, POOL_SIZE)
        self._tokens = self._owner_tokens = _OwnerTokens(self)
        self.writer: PgWriter | None = None
        try:
            self._open_database()
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"<PgEngine {self.path} owner={self._owner_id}>"

    # -- opening and closing --

    def _connect(
        self, *, autocommit: bool, role: str, bounded: bool = True
    ) -> psycopg.Connection[Any]:
        """A new connection; ``application_name`` says its role (``recoverable-writer``,
        ``-owner``, ``-read``, ``-listen``) so an operator can tell them apart. Its
        statements are bounded (:data:`STATEMENT_TIMEOUT_MS`) unless ``bounded`` is
        false, and a dead link is found by :data:`KEEPALIVES`."""
        settings = [f"statement_timeout={STATEMENT_TIMEOUT_MS}"] if bounded else []
        if role == "read":
            # The one write a reading connection makes is a claim reservation, a hint
            # (storage/pg_claims.py): its commit need not wait for the WAL flush.
            settings.append("synchronous_commit=off")
        if role == "writer":
            # A session stopped inside a transaction (SIGSTOP, a paused VM) may hold the
            # fleet's writers' lock (a batch running locked, or a last round trip stopped
            # mid-send); the server ends it after a bound (its batch is rolled back and
            # run again elsewhere or on its return).
            settings.append(f"idle_in_transaction_session_timeout={WRITER_IDLE_MS}")
        try:
            conn = psycopg.connect(
                make_conninfo(
                    self._url,
                    connect_timeout=CONNECT_TIMEOUT,
                    application_name=f"recoverable-{role}",
                    options=" ".join(f"-c {setting}" for setting in settings) or None,
                    **KEEPALIVES,
                ),
                autocommit=autocommit,
            )
        except psycopg.Error as exc:
            raise StorageUnavailable(
                f"cannot connect to the database at {self.path}: {describe(exc, self._url)}"
            ) from None  # the driver's exception may echo connection details
        if role == "writer":
            # READ COMMITTED whatever the database's default: each statement of a batch
            # after the writers' lock (and the commit check) must see every commit before
            # it (storage/pg_writer.py, storage/pg_readset.py).
            conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        return conn

    def _connect_reader(self) -> psycopg.Connection[Any]:
        return self._connect(autocommit=True, role="read")

    def _connect_writer(self) -> psycopg.Connection[Any]:
        try:
            return self._connect(autocommit=False, role="writer")
        except StorageUnavailable as exc:
            raise psycopg.OperationalError(str(exc)) from None

    def _open_database(self) -> None:
        # The schema upgrade may rewrite a large table: unbounded, then bounded.
        conn = self._owner_conn = self._connect(autocommit=True, role="owner", bounded=False)
        upgrade(conn)
        try:
            conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
            row = conn.execute(
                "INSERT INTO recoverable_owners (owner_id, lock_key, expires_at) "
                "VALUES (%s, nextval('recoverable_owner_lock'), "
                "now() + make_interval(secs => %s)) RETURNING lock_key",
                (self._owner_id, OWNER_TTL_SECONDS),
            ).fetchone()
            assert row is not None
            self._lock_key = int(row[0])
            conn.execute("SELECT pg_advisory_lock(%s, %s)", (LOCK_NAMESPACE, self._lock_key))
            # The rows of owners that are gone (their lock free and their heartbeat over).
            conn.execute(
                "DELETE FROM recoverable_owners o WHERE o.expires_at < now() AND NOT "
                + owner_lock_held("o.lock_key"),
                (LOCK_NAMESPACE,),
            )
            conn.execute(FOLD_BYTES)  # their bytes_used rows (pg_sql.BYTES_SHARDS)
        except psycopg.Error as exc:
            raise StorageUnavailable(f"cannot register the owner: {describe(exc)}") from exc
        state = WriteState(
            self.tables,
            max_bytes=self.max_bytes,
            max_record_bytes=self.max_record_bytes,
            owner_id=self._owner_id,
            tokens=self._owner_tokens,
        )
        self.writer = PgWriter(
            self._connect_writer,
            state,
            owner_id=self._owner_id,
            lock_key=self._lock_key,
            refuse=self._refuse_if_lost,
            lost=self._lose_owner,
            name=f"recoverable-pg-writer:{self._owner_id[:8]}",
        )
        self._heartbeat = threading.Thread(
            target=self._beat, name="recoverable-pg-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def _beat(self) -> None:
        """Renew this owner's expiry (server time) until closed; a failed renewal, or an
        expiry found already past (this process was stalled), loses the owner. Every
        ``PRUNE_EVERY`` beats, prune the change feed (``storage/pg_changes.py``)."""
        beats = 0
        while not self._stop.wait(HEARTBEAT_SECONDS):
            conn = self._owner_conn
            if conn is None:
                return
            beats += 1
            if beats % PRUNE_EVERY == 0:
                self.prune_changes()
            try:
                row = conn.execute(
                    "UPDATE recoverable_owners SET expires_at = now() + "
                    "make_interval(secs => %s) WHERE owner_id = %s AND expires_at > now() "
                    "RETURNING 1",
                    (OWNER_TTL_SECONDS, self._owner_id),
                ).fetchone()
            except psycopg.Error:
                row = None
            if row is None:
                if not self._stop.is_set():
                    self.owner_lost = True
                return

    def prune_changes(self) -> None:
        """Delete the change rows older than ``KEPT_SECONDS`` (server time) and move the
        pruning horizon on, and delete the claim reservations lapsed for
        ``KEEP_LAPSED_SECONDS`` (``storage/pg_claims.py``), in one transaction of the
        owner's session (a failure is left for the next pruning: the tables only grow
        meanwhile)."""
        conn = self._owner_conn
        if conn is None:
            return
        with contextlib.suppress(psycopg.Error):
            with conn.transaction():
                conn.execute(PRUNE, (KEPT_SECONDS,))
                conn.execute(PRUNE_CLAIMS, (KEEP_LAPSED_SECONDS,))

    def _lose_owner(self) -> None:
        self.owner_lost = True

    def _refuse_if_lost(self) -> None:
        if self._closed:
            raise StorageUnavailable("the store is closed")
        if self.owner_lost:
            raise StorageUnavailable(
                "this process lost its ownership of the PostgreSQL store (its connection "
                "or heartbeat failed): every write is refused; open the store again"
            )

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        if self.writer is not None:
            self.writer.stop()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join()
        conn, self._owner_conn = self._owner_conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                if not conn.broken:
                    conn.execute(
                        "DELETE FROM recoverable_owners WHERE owner_id = %s", (self._owner_id,)
                    )
                    conn.execute(FOLD_BYTES)
            conn.close()  # drops the owner's advisory lock
        self._pool.close()
        self._owner_tokens.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def owner_id(self) -> str:
        return self._owner_id

    # -- writing --

    def _live_writer(self) -> PgWriter:
        if self._closed or self.writer is None:
            raise StorageUnavailable("the store is closed")
        return self.writer

    async def write(self, fn: Callable[[WriteTxn], Result], touches: Touches) -> Result:
        """``touches``: the operations ``fn`` reads, prefetched in the batch's first round
        trip (``storage/pg_batch.py``)."""
        return await self._live_writer().write(fn, touches)

    def write_sync(self, fn: Callable[[WriteTxn], Result]) -> Result:
        return self._live_writer().write_sync(fn)

    # -- reading --

    def read(self, fn: Callable[[Any], Result]) -> Result:
        """``fn`` on one snapshot (REPEATABLE READ, read only) of a pooled connection."""

        def snapshot(conn: psycopg.Connection[Any]) -> Result:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            try:
                return fn(SqlSnapshot(conn))
            finally:
                if not conn.broken:
                    conn.execute("COMMIT")

        return self._pooled(snapshot)

    def _query(self, sql: str, params: tuple[Any, ...]) -> list[Any]:
        return self._pooled(lambda conn: conn.execute(sql, params, binary=True).fetchall())

    def _pooled(self, call: Callable[[psycopg.Connection[Any]], Result]) -> Result:
        """``call`` on a pooled connection. A read is idempotent: one that met a lost
        connection (a killed backend, a restarted server) is tried once more on a new one,
        never on another idle one (whatever ended the first session most likely ended
        theirs too: they are closed)."""
        for last_try in (False, True):
            if self._closed:
                raise StorageUnavailable("the store is closed")
            with self._pool.connection(fresh=last_try) as conn:
                try:
                    return call(conn)
                except StorageUnavailable as exc:
                    if last_try or not _connection_lost(conn, exc.__cause__):
                        raise
                except psycopg.Error as exc:
                    if last_try or not _connection_lost(conn, exc):
                        raise StorageUnavailable(f"reading failed: {describe(exc)}") from exc
                conn.close()  # not back to the pool
            self._pool.discard_idle()
        raise AssertionError("unreachable")

    def get(self, table: Table, key: bytes) -> bytes | None:
        rows = self._query(
            f"SELECT value FROM {read_source(sql_table(table))} WHERE key = %b", (key,)
        )
        return bytes(rows[0][0]) if rows else None

    def queued(self, *, after_serial: int, limit: int) -> list[queue.QueueEntry]:
        """``RecoveryStore.queued``: a page of order rows per statement (joined to their
        membership rows), not a round trip per entry; an order row whose membership row
        does not agree is skipped and not counted, as the LMDB scan does. Normally one
        statement, one snapshot; only a page with such rows is followed by another
        statement (its own snapshot: keys only move forward, nothing is listed twice)."""
        table = sql_table("queue")
        wanted = min(limit, queue.MAX_SCAN)
        start, end = queue.order_key(after_serial + 1), bytes([queue.ORDER[0] + 1])
        found: list[queue.QueueEntry] = []
        while len(found) < wanted:
            asked = wanted - len(found)
            rows = self._query(
                f"SELECT o.key, o.value, m.value FROM {table} o LEFT JOIN {table} m"
                " ON m.key = %b || o.value WHERE o.key >= %b AND o.key < %b"
                " ORDER BY o.key LIMIT %s",
                (queue.MEMBER, start, end, asked),
            )
            for order, operation, member in rows:
                entry = queue.ordered_entry(
                    bytes(order), bytes(operation), None if member is None else bytes(member)
                )
                if entry is not None:
                    found.append(entry)
            if len(rows) < asked:
                break  # no more order rows
            start = bytes(rows[-1][0]) + b"\0"  # the first key after the last order row
        return found

    def get_raw_rows(self, wanted: list[tuple[Table, bytes]]) -> list[bytes | None]:
        """``get_raw`` of every ``(table, key)``: one statement (a ``UNION ALL`` of one
        select per table), one round trip."""
        if not wanted:
            return []
        by_table: dict[Table, list[bytes]] = {}
        for table, key in wanted:
            by_table.setdefault(table, []).append(key)
        tables = sorted(by_table)
        sql = " UNION ALL ".join(
            f"SELECT {index}, key, value FROM {read_source(sql_table(table))}"
            " WHERE key = ANY(%b)"
            for index, table in enumerate(tables)
        )
        found = {
            (tables[index], bytes(key)): bytes(value)
            for index, key, value in self._query(sql, tuple(by_table[table] for table in tables))
        }
        return [found.get((table, key)) for table, key in wanted]

    def ids_by_job(
        self, account: AccountBinding, scope: str | None, job_id: str | None
    ) -> list[str]:
        """``RecoveryStore.ids_by_job`` in one statement (the job's range of the job
        index): a snapshot and a cursor were four round trips on the event loop."""
        prefix = hosts_prefix(account, scope, job_id, with_job=True)
        hosts = sql_table("hosts")
        keys = self._pooled(lambda conn: SqlSnapshot(conn).prefix_keys(prefix, hosts))
        return [key_str(key[len(prefix):]) for key in keys]

    def get_raw_many(self, table: Table, keys: list[bytes]) -> list[bytes | None]:
        """``get_raw`` of every key: one statement, one round trip."""
        found = {
            bytes(key): bytes(value) for key, value in self._query(
                f"SELECT key, value FROM {read_source(sql_table(table))} WHERE key = ANY(%b)",
                (keys,),
            )
        }
        return [found.get(key) for key in keys]

    def reserve_claims(self, operation_ids: list[str], limit: int) -> list[str]:
        """``RecoveryStore.reserve_claims``: one statement, ``FOR NO KEY UPDATE SKIP
        LOCKED`` (``storage/pg_claims.py``). A lost owner reserves nothing."""
        if limit <= 0 or not operation_ids or self.owner_lost:
            return []
        keys = [operation_key(operation_id) for operation_id in operation_ids]
        me = self._owner_id
        got = {
            bytes(row[0]) for row in self._query(
                RESERVE, (LOCK_NAMESPACE, keys, me, me, limit, me, CLAIM_SECONDS)
            )
        }
        return [operation_id for operation_id, key in zip(operation_ids, keys, strict=True)
                if key in got]

    def owner_is_live(self, owner_id: str) -> bool:
        """This owner (unless lost), or another whose advisory lock is held and whose
        heartbeat expiry is after the server's ``now()``."""
        if owner_id == self._owner_id:
            return not self.owner_lost
        writer = self.writer
        if writer is not None and writer.on_writer_thread():
            live = writer.live_owners  # read in the running batch's first round trip
            if live is not None:
                return owner_id in live
        self.liveness_queries += 1
        rows = self._query(LIVE_OWNERS + " AND o.owner_id = %s", (LOCK_NAMESPACE, owner_id))
        return bool(rows)

    def other_live_owners(self) -> list[str]:
        """The other owners whose lock is held and whose heartbeat has not expired."""
        rows = self._query(LIVE_OWNERS, (LOCK_NAMESPACE,))  # one statement for them all
        return [str(row[0]) for row in rows if row[0] != self._owner_id]

    def commit_listener(self) -> CommitListener:
        """A LISTEN connection for one lifecycle monitor (``actors/monitor.py`` uses it
        when a store has this method): woken by every commit that writes a command, with
        a bounded poll of ``last_txnid`` every ``COMMIT_POLL_SECONDS`` as the fallback."""
        return CommitListener(
            lambda: self._connect(autocommit=True, role="listen"), COMMIT_POLL_SECONDS
        )

    def last_txnid(self) -> int:
        """The count of committed batches, by every process (moves on every commit): the
        owners' commit counts, summed (``storage/pg_changes.py``)."""
        rows = self._query(COMMIT_COUNT, ())
        return int(rows[0][0]) if rows else 0

    def commands_snapshot(self, *, after_serial: int) -> tuple[int, list[CommandRecord]]:
        """``(commit count, commands with serial > after_serial)`` from one snapshot: one
        statement, one round trip (the monitor's scan; unreadable commands are skipped,
        as ``queries.commands_after`` does)."""
        rows = self._query(
            f"SELECT n.count, c.key, c.value FROM ({COMMIT_COUNT}) AS n(count)"
            f" LEFT JOIN {sql_table('commands')} c ON true",
            (),
        )
        found: list[CommandRecord] = []
        for _, key, raw in rows:
            if key is None:
                continue
            try:
                record = codec.decode_command(bytes(raw), operation_id=key_str(bytes(key)))
            except (CorruptRecord, UnsupportedRecordVersion):
                continue
            if record.serial > after_serial:
                found.append(record)
        found.sort(key=lambda command: command.serial)
        return (int(rows[0][0]) if rows else 0), found

    def lease_is_live(self, lease: LeaseRecord, now: float | None) -> bool:
        return self._owner_tokens.is_live(lease, now)

    def writer_stats(self) -> dict[str, int]:
        """The writer's counters; no map (``map_*`` are 0), and the database's reruns."""
        writer = self._live_writer()
        return {
            "commits": writer.commits,
            "writes": writer.writes,
            "largest_batch": writer.largest_batch,
            "map_size": 0,
            "map_growths": 0,
            "map_adoptions": 0,
            "isolated_reruns": writer.isolated_reruns,
            "reconnects": writer.reconnects,
            "reruns": writer.reruns,
            "unknown_commits_resolved": writer.unknown_resolved,
            # How batches met the fleet (storage/pg_locks.py): refused by the check, run
            # under the writers' lock from their first statement, too wide for keyed locks.
            "conflicts": writer.conflicts,
            "locked_batches": writer.locked_batches,
            "wide_batches": writer.wide_batches,
        }

