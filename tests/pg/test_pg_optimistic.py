"""Optimistic writer batches (storage/pg_readset.py): no owner holds the fleet's writers'
lock while it computes or waits, and a batch that read what another owner changed since
runs again under the lock, so nothing it decided on a stale read is committed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import psycopg
import pytest

from recoverable.storage import RecoveryStore, WriteTxn
from recoverable.storage.pg_changes import PRUNE
from recoverable.storage.pg_engine import PgEngine
from recoverable.storage.pg_writer import PgWriter
from tests.pg.fixtures import other_owner_url
from tests.storage.storage_helpers import ACCOUNT, make_op

BOUND = 30.0  # seconds a step may take on a loaded machine before the test says why


@pytest.fixture(params=["read committed", "repeatable read"])
def default_isolation(request: pytest.FixtureRequest, pg_url: str) -> Iterator[str]:
    """The database's default isolation level: the outcome is the same under both. (The
    writer's session asks for READ COMMITTED whatever the default: under REPEATABLE READ
    the check would read the snapshot of the batch's first statement, and only the
    server refusing the commit counter's update, 40001, would stop the batch; a locked
    rerun could be refused the same way until the writer gave up.)"""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        found = conn.execute("SELECT current_database()").fetchone()
        assert found is not None
        name = found[0]
        conn.execute(f"ALTER DATABASE {name} SET default_transaction_isolation = "
                     f"'{request.param}'")
    try:
        yield str(request.param)
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(f"ALTER DATABASE {name} RESET default_transaction_isolation")


@contextmanager
def two_owners(pg_url: str) -> Iterator[tuple[RecoveryStore, RecoveryStore]]:
    """Two owners of one database, as two machines of a fleet would be."""
    first = RecoveryStore.open(pg_url)
    second = RecoveryStore.open(other_owner_url(pg_url))
    try:
        assert isinstance(first.engine, PgEngine) and isinstance(second.engine, PgEngine)
        yield first, second
    finally:
        second.close()
        first.close()


def writer_of(store: RecoveryStore) -> PgWriter:
    assert isinstance(store.engine, PgEngine)
    writer = store.engine.writer
    assert writer is not None
    return writer


class Paused:
    """Runs ``store.write_sync(fn)`` on a thread of its own; the mutation ``fn`` calls
    :meth:`pause` to stop there until the test says go on."""

    def __init__(self, store: RecoveryStore, fn: Callable[[WriteTxn, Paused], Any]) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.result: list[Any] = []
        self.error: list[BaseException] = []

        def run() -> None:
            try:
                self.result.append(store.write_sync(lambda txn: fn(txn, self)))
            except BaseException as exc:  # handed to the test by finish()
                self.error.append(exc)

        self._thread = threading.Thread(target=run)
        self._thread.start()

    def pause(self) -> None:
        self.entered.set()
        assert self.release.wait(BOUND), "the test never let the paused batch go on"

    def finish(self) -> Any:
        self.release.set()
        self._thread.join(BOUND)
        assert not self._thread.is_alive(), "the paused batch did not end"
        if self.error:
            raise self.error[0]
        return self.result[0]


def spend_one_after_a_pause(store: RecoveryStore, operation_id: str) -> Paused:
    """A batch that reads the record, pauses (returned once it has), then writes it
    with one attempt spent."""

    def read_pause_write(txn: WriteTxn, paused: Paused) -> None:
        record = txn.get_operation(operation_id)
        paused.pause()
        assert record is not None
        txn.put_operation(msgspec.structs.replace(record, attempts_used=1))

    paused = Paused(store, read_pause_write)
    assert paused.entered.wait(BOUND)
    return paused


def test_an_owner_paused_inside_a_batch_does_not_stop_another_owners_commits(
    pg_url: str,
) -> None:
    """A worker stopped in the middle of a batch (here: a mutation that waits) holds no
    lock: the other owner's writes commit meanwhile. Under a lock taken by the batch's
    first round trip they waited for it (until the server ended the stopped session)."""
    with two_owners(pg_url) as (stopped, other):
        stopped.write_sync(lambda txn: txn.put_operation(make_op("op-stopped")))

        paused = spend_one_after_a_pause(stopped, "op-stopped")
        done = threading.Event()

        def commit_ten() -> None:
            for index in range(10):
                other.write_sync(lambda txn, i=index: txn.put_operation(make_op(f"op-{i}")))
            done.set()

        committer = threading.Thread(target=commit_ten)
        committer.start()
        finished = done.wait(BOUND)
        paused.finish()
        committer.join(BOUND)
        assert finished, "the other owner's commits waited for the paused batch"
        assert all(other.get_operation(f"op-{index}") is not None for index in range(10))
        changed = other.get_operation("op-stopped")
        assert changed is not None and changed.attempts_used == 1
        assert writer_of(stopped).locked_batches == 0 and writer_of(stopped).conflicts == 0


def test_a_batch_whose_read_another_owner_changed_meanwhile_runs_again(
    pg_url: str, default_isolation: str
) -> None:
    """A lost update is refused: the batch read ``attempts_used`` = 0, another owner
    committed 1 before it, so writing 0 + 1 would lose an attempt. The server's check
    finds the row in the other commit, the batch runs again (optimistic once more: its
    first round trip forgets the row the other commit wrote) and counts 2."""
    with two_owners(pg_url) as (mine, other):
        mine.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        runs: list[int] = []

        def add_attempt(txn: WriteTxn, paused: Paused) -> int:
            record = txn.get_operation("op-1")
            assert record is not None
            runs.append(record.attempts_used)
            if len(runs) == 1:
                paused.pause()  # the other owner commits here
            txn.put_operation(
                msgspec.structs.replace(record, attempts_used=record.attempts_used + 1)
            )
            for index in range(300):  # a large batch: the refusal comes back mid-pipeline
                txn.put_operation(make_op(f"op-more-{index}"))
            return record.attempts_used + 1

        paused = Paused(mine, add_attempt)
        assert paused.entered.wait(BOUND)
        found = other.get_operation("op-1")
        assert found is not None
        other.write_sync(lambda txn: txn.put_operation(
            msgspec.structs.replace(found, attempts_used=1)
        ))
        assert paused.finish() == 2
        assert runs == [0, 1]
        stored = other.get_operation("op-1")
        assert stored is not None and stored.attempts_used == 2
        writer = writer_of(mine)
        assert writer.conflicts == 1 and writer.locked_batches == 0
        assert writer.reruns == 0  # a conflict is not a failure: it never counts toward one
        stats = mine.stats()
        assert (stats["conflicts"], stats["locked_batches"], stats["wide_batches"]) == (1, 0, 0)


def test_a_batch_that_listed_a_job_reruns_when_another_owner_admits_that_job(
    pg_url: str, default_isolation: str
) -> None:
    """A range read is checked too: the batch listed job-7's operations (none), another
    owner admitted one for job-7 before the batch committed; the locked rerun sees it,
    so the batch does not admit a second operation for the same job."""
    with two_owners(pg_url) as (mine, other):
        seen: list[list[str]] = []

        def admit_once(txn: WriteTxn, paused: Paused) -> str:
            existing = txn.operation_ids_by_job(ACCOUNT, None, "job-7")
            seen.append(existing)
            if len(seen) == 1:
                paused.pause()
            if existing:
                return existing[0]
            txn.put_operation(make_op("op-mine", job_id="job-7"))
            return "op-mine"

        paused = Paused(mine, admit_once)
        assert paused.entered.wait(BOUND)
        other.write_sync(lambda txn: txn.put_operation(make_op("op-other", job_id="job-7")))
        assert paused.finish() == "op-other"
        assert seen == [[], ["op-other"]]
        assert mine.get_operation("op-mine") is None
        assert writer_of(mine).conflicts == 1


def test_commits_of_others_that_the_batch_did_not_read_do_not_make_it_rerun(
    pg_url: str,
) -> None:
    """Another owner's commit of rows this batch never read leaves it optimistic; the
    row cache still forgets the rows that commit wrote (a later read sees them)."""
    with two_owners(pg_url) as (mine, other):
        mine.write_sync(lambda txn: txn.put_operation(make_op("op-a")))
        mine.write_sync(lambda txn: txn.put_operation(make_op("op-b")))
        assert mine.write_sync(lambda txn: txn.get_operation("op-b")) is not None  # cached

        paused = spend_one_after_a_pause(mine, "op-a")
        found = other.get_operation("op-b")
        assert found is not None
        other.write_sync(
            lambda txn: txn.put_operation(msgspec.structs.replace(found, attempts_used=2))
        )
        paused.finish()
        writer = writer_of(mine)
        assert writer.conflicts == 0 and writer.locked_batches == 0
        # Read through the writer (its row cache): the other owner's op-b, not the old one.
        seen = mine.write_sync(lambda txn: txn.get_operation("op-b"))
        assert seen is not None and seen.attempts_used == 2
        assert writer.conflicts == 0


def test_the_database_has_the_check_function_and_a_raw_conflict_is_refused(
    pg_url: str,
) -> None:
    """The check is the server's: a read key that a commit since the caller's snapshot
    logged raises serialization_failure (40001), whatever client asks; the caller's own
    commits, and those its snapshot saw, are not held against it."""
    with RecoveryStore.open(pg_url) as store, psycopg.connect(pg_url, autocommit=True) as conn:
        store.write_sync(lambda txn: txn.put_operation(make_op("op-0")))  # seen: before
        taken = conn.execute(
            "SELECT pg_current_snapshot()::text, extract(epoch FROM clock_timestamp())"
        ).fetchone()
        assert taken is not None
        since, at = str(taken[0]), float(taken[1])
        store.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        (logged,) = conn.execute(
            "SELECT keys FROM recoverable_changes WHERE owner_id = %s"
            " ORDER BY xid DESC LIMIT 1", (store.owner_id,),
        ).fetchone() or (None,)
        assert logged
        call = (
            "SELECT recoverable_changed_since(%s::pg_snapshot, to_timestamp(%s), %s,"
            " %s::bytea[], '{}', '{}')"
        )
        try:
            conn.execute(call, (since, at, "someone-else", [bytes(logged[0])]))
        except psycopg.errors.SerializationFailure as exc:
            assert "changed by another commit" in str(exc)
        else:
            raise AssertionError("a conflicting read was not refused")
        (changed,) = conn.execute(call, (since, at, "someone-else", [])).fetchone() or (None,)
        assert sorted(bytes(key) for key in changed) == sorted(bytes(key) for key in logged)
        # The writer's own commits are its own: no conflict, nothing changed.
        (own,) = conn.execute(
            call, (since, at, store.owner_id, [bytes(logged[0])])
        ).fetchone() or (None,)
        assert own == []
        # Pruned past the snapshot: nothing can be said for it, so the batch is refused.
        conn.execute(PRUNE, (-1.0,))
        with pytest.raises(psycopg.errors.SerializationFailure, match="pruned"):
            conn.execute(call, (since, at, "someone-else", []))
