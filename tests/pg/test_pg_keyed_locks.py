"""Keyed locks (storage/pg_locks.py): an optimistic batch's last round trip locks what it
read, wrote and listed, not the fleet. A session that stops inside its last round trip
(simulated by a raw session holding exactly what such a batch holds: the writers' lock
shared and its keys) delays only the batches that touch its keys."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from recoverable.storage import RecoveryStore
from recoverable.storage.keys import hosts_key, hosts_prefix, operation_key
from recoverable.storage.pg_batch import SQL_TABLES, lock_identity, row_id
from recoverable.storage.pg_engine import PgEngine
from recoverable.storage.pg_locks import LOCK_KEYS, lock_keys, operation_lock
from recoverable.storage.pg_schema import LOCK_NAMESPACE, WRITER_LOCK
from recoverable.storage.pg_sql import sql_table
from tests.pg.fixtures import other_owner_url
from tests.storage.storage_helpers import ACCOUNT, make_op

BOUND = 30.0  # seconds a step may take on a loaded machine before the test says why


@contextmanager
def stopped_last_round_trip(
    pg_url: str, keys: list[int], exclusive: list[bool]
) -> Iterator[psycopg.Connection[Any]]:
    """A session holding what a batch stopped in its last round trip holds: the writers'
    lock shared, then its keys; rolled back at the end."""
    with psycopg.connect(pg_url) as conn:
        conn.execute(
            "SELECT pg_advisory_xact_lock_shared(%s, %s)", (LOCK_NAMESPACE, WRITER_LOCK)
        )
        conn.execute(LOCK_KEYS, (keys, exclusive))
        try:
            yield conn
        finally:
            conn.rollback()


@contextmanager
def fleet(pg_url: str) -> Iterator[RecoveryStore]:
    """A store with another owner live beside it (a lone owner commits under the writers'
    lock exclusively: nobody else could be delayed), the other one idle."""
    with RecoveryStore.open(other_owner_url(pg_url)) as other:
        assert other.other_live_owners() == []
        with RecoveryStore.open(pg_url) as store:
            yield store


def _writer_waits_on_a_key(pg_url: str) -> bool:
    """Whether a writer session (the test's one writing store) waits on an advisory lock."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND wait_event = 'advisory' AND application_name = 'recoverable-writer'"
            " AND datname = current_database()"
        ).fetchone()
    return bool(row and row[0])


def test_a_stopped_last_round_trip_does_not_stop_other_operations_commits(
    pg_url: str,
) -> None:
    """A session stopped holding the writers' lock (shared) and one operation's key:
    another owner's commits of other operations go on (under a fleet-wide exclusive lock
    they would all wait until the server ended the stopped session)."""
    with fleet(pg_url) as store:
        store.write_sync(lambda txn: txn.put_operation(make_op("op-held")))
        held = operation_lock(operation_key("op-held"))
        with stopped_last_round_trip(pg_url, [held], [True]):
            done = threading.Event()

            def commit_ten() -> None:
                for index in range(10):
                    store.write_sync(
                        lambda txn, i=index: txn.put_operation(make_op(f"op-{i}"))
                    )
                done.set()

            committer = threading.Thread(target=commit_ten, daemon=True)
            committer.start()
            finished = done.wait(BOUND)
        committer.join(BOUND)
        assert finished, "commits of other operations waited for the stopped session"
        assert all(store.get_operation(f"op-{index}") is not None for index in range(10))


def test_a_batch_that_writes_a_held_operation_waits_for_it_then_commits(
    pg_url: str,
) -> None:
    """The operation's key is held exclusively (a batch stopped while writing it): a batch
    writing that operation waits on the key (seen in pg_stat_activity) and commits once
    the key is released, with what it wrote."""
    with fleet(pg_url) as store:
        assert isinstance(store.engine, PgEngine)
        store.write_sync(lambda txn: txn.put_operation(make_op("op-held")))
        held = operation_lock(operation_key("op-held"))
        done = threading.Event()
        with stopped_last_round_trip(pg_url, [held], [True]):

            def write_held() -> None:
                record = store.write_sync(lambda txn: txn.get_operation("op-held"))
                assert record is not None
                store.write_sync(lambda txn: txn.put_operation(
                    make_op("op-held", attempts_used=1)
                ))
                done.set()

            writer = threading.Thread(target=write_held, daemon=True)
            writer.start()
            waited = False
            for _ in range(int(BOUND / 0.02)):
                if _writer_waits_on_a_key(pg_url):
                    waited = True
                    break
                if done.is_set():
                    break
                threading.Event().wait(0.02)  # polling the server's view (a barrier)
            assert waited and not done.is_set(), "the batch did not wait for the held key"
        assert done.wait(BOUND), "the batch did not commit once the key was released"
        writer.join(BOUND)
        stored = store.get_operation("op-held")
        assert stored is not None and stored.attempts_used == 1


def test_listing_a_job_and_admitting_into_it_lock_the_same_key() -> None:
    """A batch that listed a job's range locks that range's key exclusively; a batch that
    writes a job index entry in it locks the same key shared (and its account's and
    scope's ranges): so they exclude each other, and two admissions of one account only
    exclude each other at that account's range if one of them listed it."""
    hosts = sql_table("hosts")
    record = make_op("op-1", job_id="job-7")
    job = row_id(hosts, hosts_prefix(ACCOUNT, None, "job-7", with_job=True))
    written = row_id(hosts, hosts_key(record))
    by_table = {"table_of": SQL_TABLES.__getitem__, "identity": lock_identity}
    listed_keys, listed_modes = lock_keys([], [], [job], **by_table)
    written_keys, written_modes = lock_keys([], [written], [], **by_table)
    assert len(listed_keys) == 1 and listed_modes == [True]
    shared = {key for key, exclusive in zip(written_keys, written_modes, strict=True)
              if not exclusive}
    assert listed_keys[0] in shared
    assert len(shared) == 3  # the account's, the scope's and the job's ranges
    other_job = lock_keys(
        [], [row_id(hosts, hosts_key(make_op("op-2", job_id="job-8")))], [], **by_table
    )
    assert listed_keys[0] not in other_job[0]
    # The keys come in ascending order: two batches never wait on each other in a cycle.
    assert written_keys == sorted(written_keys)


def test_every_row_of_an_operation_is_locked_as_the_operation() -> None:
    """Its record, command, lease, disposition, payloads and queue membership are one key
    (``operation_lock``): a batch reading one of them and a batch writing another exclude
    each other; rows of other tables are keys of their own."""
    from recoverable.storage import queue

    op = operation_key("op-1")
    rows = [row_id(sql_table(table), op) for table in (
        "operations", "commands", "leases", "dispositions")]
    rows += [row_id(sql_table("payloads"), op + b"\0body"),
             row_id(sql_table("queue"), queue.member_key("op-1"))]
    by_table = {"table_of": SQL_TABLES.__getitem__, "identity": lock_identity}
    for written in rows:
        for read in rows:
            keys, modes = lock_keys([read], [written], [], **by_table)
            assert keys == [operation_lock(op)] and modes == [True]
    other = lock_keys([row_id(sql_table("governor"), op)], [], [], **by_table)[0]
    assert other != [operation_lock(op)]
