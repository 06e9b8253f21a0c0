"""The PostgreSQL store's writer: one thread, one connection, group commit.

The submission side (Trio waiters woken once per loop, ``write_sync`` for threads, the
queue drained batch by batch, the counters) is the LMDB writer's (``storage/writer.py``):
only how a batch commits differs. A batch is one PostgreSQL transaction, *optimistic*
first (``storage/pg_readset.py``):

1. One round trip without any lock: the batch's snapshot and the change feed since the
   previous batch's (the row cache, ``pg_batch``, ``pg_changes``), the live owners, and
   the rows the batch's writes said they will read (``store.write(fn, touches=...)``,
   ``pg_batch.Prefetch``).
2. Every mutation runs straight in the transaction, its reads recorded, its writes
   buffered in memory (``pg_batch``). If one raises before any of its writes was sent
   (the usual case: a refused precondition, a lease another owner holds), its writes
   are forgotten in memory and the batch goes on without it: no statement, no rerun.
3. The last round trip, built whole before its first statement leaves: the writers'
   lock in shared mode and the batch's keyed locks in ascending order (what it read,
   wrote and listed: ``storage/pg_locks.py``), the server's check that no commit since
   step 1 changed what the batch read (``pg_changes.CHANGED_SINCE``), the buffered
   writes, the change row, this owner's share of ``bytes_used`` and its ``txn_log`` row
   (a fresh batch id, its commit count, its ownership checked), ``NOTIFY recoverable``
   when commands or the queue changed; ``COMMIT``. An owner alone on the database (no
   other live at the batch's start), or a batch with more keys than ``MAX_KEYS``, takes
   the writers' lock exclusively instead of its keys. The locks are held while the server
   runs these statements only: a writer stopped between two round trips (SIGSTOP, a
   long pause) holds nothing, and one stopped in its last holds only its own keys.

If the check finds a conflict, the batch runs once more optimistic (its first round
trip forgets what the conflicting commit wrote), then *locked*; a mutation that needs a
scan (which would send writes before the keys are locked) runs it locked at once. A
locked batch takes the writers' lock exclusively as the first statement of its first
round trip: every statement after it sees every earlier commit and nobody else commits,
so its reads and its conditional writes (a fenced ``put_operation``, a lease taken with
its fence incremented) are one atomic step. If a mutation raised after some of its
writes were sent (a scan flushed them), the batch runs again locked with each mutation
in a savepoint, so the failing one is rolled back alone (the LMDB writer's child
transactions).

A lost connection before ``COMMIT`` rolled the transaction back: reconnect and run the
batch again. A lost connection *during* ``COMMIT`` leaves the outcome unknown: reconnect
and read this owner's ``txn_log`` row: the batch id is there (committed: the callers get
their results) or it is not (run again). A serialization failure or deadlock (40001 /
40P01) is a known rollback: run again. After :data:`MAX_TRIES` the callers get
``StorageUnavailable`` (for an unknown outcome, saying so): never a guess.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from typing import Any, Final, cast

import outcome
import psycopg

from recoverable.errors import StorageUnavailable
from recoverable.storage.keys import META_BYTES, u64
from recoverable.storage.pg_batch import (
    LAST_ORDER,
    BatchSnapshot,
    Prefetch,
    RowCache,
    changed_keys,
    last_order_serial,
)
from recoverable.storage.pg_changes import (
    CHANGED_SINCE,
    CHANGES_SINCE,
    LOG_CHANGES,
    SNAPSHOT_NOW,
)
from recoverable.storage.pg_listen import CHANNEL
from recoverable.storage.pg_locks import LOCK_KEYS, MAX_KEYS
from recoverable.storage.pg_readset import NeedsLock, ReadSet
from recoverable.storage.pg_schema import (
    LIVE_OWNERS,
    LOCK_NAMESPACE,
    WRITER_LOCK,
    owner_lock_held,
)
from recoverable.storage.pg_sql import ADD_BYTES, describe, read_source, sql_table
from recoverable.storage.txn import WriteState, WriteTxn
from recoverable.storage.writer import MapGuard, Writer, _Isolate, _Job

__all__ = ["MAX_TRIES", "PgWriter"]

MAX_TRIES: Final = 5
OPTIMISTIC_RERUNS: Final = 1  # a batch refused by the check runs optimistic once more
_RETRYABLE: Final = frozenset({"40001", "40P01"})
_NOTIFY_TABLES: Final = frozenset({sql_table("commands"), sql_table("queue")})
OWNED_CHECK: Final = "recoverable_txn_log_owned"  # the CHECK on txn_log.owned (pg_schema)
OWN_LOCK_HELD: Final = (
    "SELECT " + owner_lock_held("%s")
    + " AND EXISTS (SELECT 1 FROM recoverable_owners WHERE owner_id = %s"
    " AND expires_at > clock_timestamp())"
)


class _Rerun(Exception):
    """Internal: the transaction was rolled back (known): run the batch again."""


class _Conflict(Exception):
    """Internal: an optimistic batch read a row another commit changed since (or could
    not be checked): rolled back; run the batch again under the writers' lock."""


class _Unknown(Exception):
    """Internal: the connection was lost during COMMIT: resolve through the txn log."""


class PgWriter(Writer[WriteTxn]):
    """The writer thread of one PostgreSQL store (see the module docstring)."""

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection[Any]],
        state: WriteState,
        *,
        owner_id: str,
        lock_key: int,
        refuse: Callable[[], None],
        lost: Callable[[], None],
        name: str,
    ) -> None:
        self._connect = connect
        self._conn: psycopg.Connection[Any] | None = None
        self._state = state
        self._owner_id = owner_id
        self._refuse = refuse
        self._lost = lost
        self._lock_key = lock_key
        self._cache = RowCache()  # see storage/pg_batch.py
        self.reconnects = 0
        self.unknown_resolved = 0
        self.reruns = 0
        self.rolled_back_in_memory = 0  # failed mutations undone without a statement
        self.conflicts = 0  # optimistic batches run again under the lock (pg_readset)
        self.locked_batches = 0  # batches that took the writers' lock in their first trip
        self.wide_batches = 0  # optimistic batches too wide for keyed locks (pg_locks)
        # The owners live at the start of the running batch (None between batches), read
        # in its first round trip: the batch's lease checks ask this, not the database.
        self.live_owners: frozenset[str] | None = None
        self._bytes_read = 0  # ``bytes_used`` as the running batch read it
        self._stop_event = threading.Event()
        super().__init__(
            cast(Any, None),  # no LMDB environment: _commit_batch is replaced below
            MapGuard(),
            lambda txn: WriteTxn(state, txn),  # unused: batches run in _try_pg_batch
            max_map_size=0,
            name=name,
        )

    def on_writer_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self) -> None:
        super().stop()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    # -- one batch ----------------------------------------------------------------

    def _connection(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        if conn is not None:
            conn.close()
            self.reconnects += 1
        self._conn = None
        self._conn = conn = self._connect()
        return conn

    def _commit_batch(self, batch: list[_Job]) -> None:
        isolated = False
        locked = False
        conflicted = 0
        tries = 0
        while True:
            txn_id = secrets.token_hex(16)
            try:
                self._try_pg_batch(batch, isolated, locked, txn_id)
                return
            except _Isolate:
                self._discard_runs(batch)
                isolated = locked = True
                self.isolated_reruns += 1
                continue
            except NeedsLock:
                self._discard_runs(batch)
                locked = True
                continue
            except _Conflict:
                # Once more optimistic (its first round trip forgets what the conflicting
                # commits wrote), then locked: never a livelock.
                self._discard_runs(batch)
                conflicted += 1
                locked = conflicted > OPTIMISTIC_RERUNS
                self.conflicts += 1
                continue
            except StorageUnavailable as exc:
                self._fail_batch(batch, exc)
                return
            except _Rerun as exc:
                self._discard_runs(batch)
                failure: BaseException = exc
                unknown = False
            except _Unknown as exc:
                committed = self._committed(txn_id)
                if committed:
                    self.unknown_resolved += 1
                    self.commits += 1
                    self.writes += len(batch)
                    return
                self._discard_runs(batch)
                failure = exc
                unknown = committed is None
            tries += 1
            self.reruns += 1
            if tries >= MAX_TRIES:
                cause = failure.__cause__ or failure
                error = StorageUnavailable(
                    "the database is unreachable: "
                    + (
                        "the outcome of the last commit could not be read back, so it is "
                        "unknown (nothing is assumed)"
                        if unknown
                        else "nothing was written"
                    )
                    + f" ({describe(cause)})"
                )
                error.__cause__ = cause
                self._fail_batch(batch, error)
                return
            # Before the next try: a short pause, cut short when the store closes.
            self._stop_event.wait(0.05 * 2**tries)

    def _committed(self, txn_id: str) -> bool | None:
        """Whether the batch ``txn_id`` committed (None: the database cannot say now)."""
        for _ in range(MAX_TRIES):
            try:
                conn = self._connection()
                with conn.transaction():
                    row = conn.execute(
                        "SELECT txn_id FROM recoverable_txn_log WHERE owner_id = %s",
                        (self._owner_id,),
                    ).fetchone()
                return row is not None and row[0] == txn_id
            except psycopg.Error:
                self._stop_event.wait(0.1)
        return None

    def _try_pg_batch(
        self, batch: list[_Job], isolated: bool, locked: bool, txn_id: str
    ) -> None:
        try:
            self._run_pg_batch(batch, isolated, locked, txn_id)
        finally:
            self.live_owners = None  # known for one batch only

    def _run_pg_batch(
        self, batch: list[_Job], isolated: bool, locked: bool, txn_id: str
    ) -> None:
        self._refuse()
        try:
            conn = self._connection()
        except psycopg.Error as exc:
            raise _Rerun from exc
        snapshot = BatchSnapshot(conn, self._cache)
        if not locked:
            snapshot.reads = ReadSet()
        committed_any = False
        try:
            try:
                # One round trip (behind the lock when ``locked``): has anyone committed
                # since our last batch? (the row cache, pg_batch.py) The other meta rows
                # (quota counter, serials) come with it: every batch reads the quota
                # counter, and they change with every batch of anyone.
                since = self._cache.since
                prefetch = Prefetch.for_batch(
                    self._cache, (touched for job in batch for touched in job.touches)
                )
                with conn.pipeline():
                    if locked:
                        self.locked_batches += 1
                        conn.execute(
                            "SELECT pg_advisory_xact_lock(%s, %s)",
                            (LOCK_NAMESPACE, WRITER_LOCK),
                        )
                    # The batch's snapshot first: what is read after it is at least as new.
                    now = conn.execute(SNAPSHOT_NOW)
                    logged = None if since is None else conn.execute(
                        CHANGES_SINCE, {"since": since, "me": self._owner_id}, binary=True
                    )
                    metas = conn.execute(
                        f"SELECT key, value FROM {read_source(sql_table('meta'))}",
                        binary=True,
                    )
                    # The live owners, for the batch's lease checks (see live_owners).
                    owners = conn.execute(LIVE_OWNERS, (LOCK_NAMESPACE,))
                    # The highest queue order row (pg_batch.BatchSnapshot.get).
                    last_order = conn.execute(LAST_ORDER, binary=True)
                    # The rows the batch's hinted writes will read (pg_batch.Prefetch).
                    fetched = (
                        conn.execute(prefetch.sql, prefetch.params, binary=True)
                        if prefetch else None
                    )
                meta = {bytes(key): bytes(value) for key, value in metas.fetchall()}
                taken = now.fetchone()
                assert taken is not None
                read_at, read_clock, pruned_before = str(taken[0]), float(taken[1]), taken[2]
                self._cache.adopt(
                    read_at, read_clock, None if pruned_before is None else float(pruned_before),
                    None if logged is None else [row[0] for row in logged.fetchall()],
                )
                self._bytes_read = u64(meta.get(META_BYTES))
                self._cache.seed(sql_table("meta"), meta)
                if fetched is not None:
                    rows = fetched.fetchall()
                    prefetch.seed(self._cache, rows)
                    snapshot.ranges = prefetch.job_ranges(rows)
                self.live_owners = frozenset(str(row[0]) for row in owners.fetchall())
                self._cache.last_order = last_order_serial(last_order.fetchall())
                self._state.batch_bytes = None
                shared: WriteTxn | None = None
                for index, job in enumerate(batch):
                    job.result = None
                    if isolated:
                        committed_any |= self._run_saved(conn, snapshot, job, index)
                    else:
                        # One context for the whole run, as the LMDB writer does
                        # (MutationContext.next_mutation): fewer objects per write.
                        if shared is None:
                            shared = WriteTxn(self._state, cast(Any, snapshot))
                        else:
                            shared.next_mutation()
                        if not self._run_in(snapshot, shared, job):
                            # Rolled back in memory; the shared context's read caches saw
                            # its writes: the next mutation gets a fresh context.
                            shared = None
                            continue
                        self._check(snapshot)
                        snapshot.end_mutation(True)
                        committed_any = True
                if not committed_any:
                    conn.rollback()
                    self.writes += len(batch)
                    return
                changed = self._end(conn, snapshot, txn_id, (read_at, read_clock))  # COMMIT
            except psycopg.Error as exc:
                raise self._classify(exc, optimistic=not locked) from exc
            except StorageUnavailable:
                self._check(snapshot)  # a failed statement: classified (a lost link reruns)
                raise
            except BaseException:
                self._rollback(conn)
                raise
        except (_Isolate, _Conflict, NeedsLock):
            # Nothing committed; the cache holds committed rows only: still valid (the
            # next batch's first round trip forgets what others changed since).
            self._rollback(conn)
            raise
        except BaseException:
            self._cache.clear()
            self._rollback(conn)
            raise
        snapshot.committed(changed)
        self.commits += 1
        self.writes += len(batch)
        self.largest_batch = max(self.largest_batch, len(batch))

    def _check(self, snapshot: BatchSnapshot) -> None:
        """A statement failed inside the mutation: the transaction is lost whatever the
        mutation did with the error."""
        failed = snapshot.failed
        if failed is not None:
            assert isinstance(failed, psycopg.Error)
            raise self._classify(failed, optimistic=snapshot.reads is not None) from failed

    def _classify(self, exc: psycopg.Error, *, optimistic: bool = False) -> Exception:
        if exc.sqlstate in _RETRYABLE:  # a known rollback (the check's conflict is 40001)
            return _Conflict() if optimistic else _Rerun()
        if exc.sqlstate is None or isinstance(exc, psycopg.OperationalError):
            return _Rerun()
        if optimistic:
            # A statement refused on what may be a stale read (a guard trigger): the
            # locked run decides.
            return _Conflict()
        return StorageUnavailable(f"the database refused the write: {describe(exc)}")

    @staticmethod
    def _rollback(conn: psycopg.Connection[Any]) -> None:
        if not conn.closed and not conn.broken:
            try:
                conn.rollback()
            except psycopg.Error:
                conn.close()

    def _run_in(self, snapshot: BatchSnapshot, ctx: WriteTxn, job: _Job) -> bool:
        """Run ``job`` in the batch's shared context: True if it succeeded; False if it
        raised and was rolled back in memory (its result is the error)."""
        job.ctx = ctx  # shared by the run: its abort hooks run once if the run is discarded
        mark = ctx.hooks_mark()
        try:
            value = job.fn(ctx)
            ctx.finish()
        except NeedsLock:
            raise
        except BaseException as exc:
            self._check(snapshot)  # a failed statement: the transaction is lost
            if snapshot.mutation_sent or not isinstance(exc, Exception):
                raise _Isolate from exc
            # None of its writes left this process: forgetting them undoes it whole
            # (``bytes_used`` too: the state carries the last finished mutation's count).
            snapshot.end_mutation(False)
            ctx.run_abort_hooks(since=mark)
            job.result = outcome.Error(exc)
            self.rolled_back_in_memory += 1
            return False
        job.result = outcome.Value(value)
        return True

    def _run_saved(
        self, conn: psycopg.Connection[Any], snapshot: BatchSnapshot, job: _Job, index: int
    ) -> bool:
        name = f"m{index}"
        snapshot.flush()  # the savepoint then covers this mutation's writes only
        self._check(snapshot)
        conn.execute(f"SAVEPOINT {name}")
        bytes_before = self._state.batch_bytes
        ctx = WriteTxn(self._state, cast(Any, snapshot))  # an LMDB-transaction-shaped view
        job.ctx = ctx
        try:
            value = job.fn(ctx)
            ctx.finish()
        except BaseException as exc:
            self._check(snapshot)
            snapshot.end_mutation(False)
            conn.execute(f"ROLLBACK TO SAVEPOINT {name}")
            self._state.batch_bytes = bytes_before
            ctx.run_abort_hooks()
            job.result = outcome.Error(exc)
            return False
        self._check(snapshot)
        snapshot.end_mutation(True)
        conn.execute(f"RELEASE SAVEPOINT {name}")
        job.result = outcome.Value(value)
        return True

    def _end(
        self, conn: psycopg.Connection[Any], snapshot: BatchSnapshot, txn_id: str,
        read_at: tuple[str, float],
    ) -> list[bytes]:
        """Send (an optimistic batch: the writers' lock and the check of what it read
        since its snapshot ``read_at`` (and the server's clock then), then) the buffered
        writes, the bytes counter, the change row, this owner's batch id and commit
        count, the notification and COMMIT in one round trip (a pipeline): the rows others
        changed since ``read_at`` (``storage/pg_changes.py``).

        The ownership check runs on the server, in the transaction: the ``txn_log`` row's
        ``owned`` column must be true (a CHECK constraint), computed from this owner's
        advisory lock and its heartbeat expiry against the server's clock at that
        statement, after the batch's locks. If it is not, the statement
        fails, COMMIT never runs, and the owner is lost for good: another owner may
        already have taken its leases."""
        carried = self._state.batch_bytes
        reads = snapshot.reads
        checked: psycopg.Cursor[Any] | None = None
        # Everything is built before the first statement leaves: psycopg sends each
        # statement of a pipeline as it is executed, so the writers' lock is taken on the
        # server while the rest is still being sent. Built first, no Python work (records'
        # typed columns, key arrays) runs while it is held: a writer stopped (SIGSTOP, a
        # long pause) in this round trip almost surely stops before its lock statement,
        # holding nothing the others need (the rest is in the kernel's send buffer).
        writes = snapshot.take_writes()
        logged = changed_keys(snapshot.written_keys)
        check = None if reads is None else (
            *read_at, self._owner_id, *reads.params()
        )
        notify = bool(snapshot.written & _NOTIFY_TABLES)
        bytes_delta = (
            None if carried is None or carried == self._bytes_read
            else carried - self._bytes_read
        )
        # Alone (no other owner was live at the batch's start), or more keys than the
        # lock table should hold: the writers' lock exclusively, one lock for the whole
        # commit (an owner that appeared since waits for this commit, server-side only).
        alone = self.live_owners is not None and self.live_owners <= {self._owner_id}
        keys = None if check is None or alone else snapshot.lock_keys()
        wide = keys is not None and len(keys[0]) > MAX_KEYS
        self.wide_batches += wide
        try:
            with conn.pipeline():
                if check is not None:
                    if keys is None or wide:
                        conn.execute(
                            "SELECT pg_advisory_xact_lock(%s, %s)",
                            (LOCK_NAMESPACE, WRITER_LOCK),
                        )
                    else:  # storage/pg_locks.py
                        conn.execute(
                            "SELECT pg_advisory_xact_lock_shared(%s, %s)",
                            (LOCK_NAMESPACE, WRITER_LOCK),
                        )
                        conn.execute(LOCK_KEYS, keys)
                    checked = conn.execute(CHANGED_SINCE, check, binary=True)
                snapshot.send(writes)
                if bytes_delta is not None:
                    # What the batch added (or freed), in this owner's row of the total
                    # (pg_sql.BYTES_SHARDS): other writers' batches since our read count too.
                    conn.execute(ADD_BYTES, (self._owner_id, bytes_delta))
                conn.execute(LOG_CHANGES, (self._owner_id, logged), binary=True)
                conn.execute(
                    "INSERT INTO recoverable_txn_log (owner_id, txn_id, owned, commits) "
                    f"VALUES (%s, %s, ({OWN_LOCK_HELD}), 1) ON CONFLICT (owner_id) DO UPDATE "
                    "SET txn_id = EXCLUDED.txn_id, owned = EXCLUDED.owned,"
                    " commits = recoverable_txn_log.commits + 1",
                    (self._owner_id, txn_id, LOCK_NAMESPACE, self._lock_key, self._owner_id),
                )
                if notify:
                    conn.execute(f"NOTIFY {CHANNEL}")
                conn.commit()
        except psycopg.errors.CheckViolation as exc:
            if exc.diag.constraint_name != OWNED_CHECK:
                raise
            self._lost()
            raise StorageUnavailable(
                "this process lost its ownership of the PostgreSQL store: nothing of this "
                "batch was written"
            ) from exc
        except psycopg.Error as exc:
            if exc.sqlstate not in _RETRYABLE and (
                exc.sqlstate is None or isinstance(exc, psycopg.OperationalError)
            ):
                # The link broke, or the server ended the session (a terminated backend
                # answers 57P01 and may do so after COMMIT was applied), while the pipeline
                # (COMMIT included) was under way: the outcome is unknown; the txn log
                # will tell (a batch that did not commit is run again).
                raise _Unknown from exc
            raise
        self._check(snapshot)
        changed: list[bytes] = []
        if checked is not None:
            row = checked.fetchone()
            changed = [] if row is None or row[0] is None else [bytes(key) for key in row[0]]
        return changed
