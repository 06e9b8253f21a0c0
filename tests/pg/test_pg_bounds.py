"""Every wait on the database ends: statements are bounded by the server, dead links are
found by the client's kernel (storage/pg_engine.py: STATEMENT_TIMEOUT_MS, KEEPALIVES).

A statement that waits on a lock another session holds (an operator's ``LOCK TABLE``, a
long migration run by hand) is cancelled after the bound: a read raises
``StorageUnavailable`` saying so, once, and its pooled connection stays usable; a write
is run again a few times and then fails the same way with nothing written; once the
lock is gone both work again.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from recoverable.errors import StorageUnavailable
from recoverable.storage import RecoveryStore, pg_engine
from recoverable.storage.pg_engine import PgEngine
from recoverable.storage.pg_schema import LOCK_NAMESPACE, MIGRATION_LOCK
from tests.storage.storage_helpers import make_op

# The bound applies to every statement of the test's store, its set-up reads and fsynced
# commits too: short, so the lock waits end soon, yet long enough that a loaded machine's
# slow commit is not mistaken for one.
BOUND_MS = 1000


@pytest.fixture
def short_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pg_engine, "STATEMENT_TIMEOUT_MS", BOUND_MS)


@pytest.fixture
def locked_operations(pg_url: str) -> Iterator[psycopg.Connection[object]]:
    """An operator's session that holds the operations table (begin it with ``lock``)."""
    with psycopg.connect(pg_url) as admin:
        yield admin  # type: ignore[misc]
        admin.rollback()


def _lock(admin: psycopg.Connection[object]) -> None:
    admin.execute("LOCK TABLE recoverable_operations IN ACCESS EXCLUSIVE MODE")


def _read_backends(pg_url: str) -> set[int]:
    with psycopg.connect(pg_url, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'recoverable-read' "
            "AND datname = current_database()"
        ).fetchall()
    return {int(row[0]) for row in rows}


def test_a_read_waiting_on_a_lock_ends_with_a_clear_error_and_keeps_its_connection(
    pg_url: str, short_bound: None, locked_operations: psycopg.Connection[object]
) -> None:
    with RecoveryStore.open(pg_url) as store:
        store.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        assert store.get_operation("op-1") is not None
        pooled = _read_backends(pg_url)
        assert len(pooled) == 1
        _lock(locked_operations)
        with pytest.raises(StorageUnavailable, match="statement timeout"):
            store.get_operation("op-1")
        # Cancelled, not lost: not tried again on a new connection, nor dropped.
        assert _read_backends(pg_url) == pooled
        locked_operations.rollback()
        assert store.get_operation("op-1") is not None
        assert _read_backends(pg_url) == pooled


def test_a_write_waiting_on_a_lock_fails_after_its_tries_and_writes_nothing(
    pg_url: str, short_bound: None, locked_operations: psycopg.Connection[object]
) -> None:
    with RecoveryStore.open(pg_url) as store:
        _lock(locked_operations)
        with pytest.raises(StorageUnavailable, match="statement timeout"):
            store.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        locked_operations.rollback()
        assert store.stats()["reruns"] >= 1  # run again before failing
        assert store.get_operation("op-1") is None  # nothing of the failed batch
        store.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        assert store.get_operation("op-1") is not None
        assert store.check_integrity() == []


def _bounds(conn: psycopg.Connection[object]) -> tuple[object, ...]:
    """A session's statement bound, and its socket's keepalive and user-timeout options."""
    timeout = conn.execute("SHOW statement_timeout").fetchone()
    with socket.socket(fileno=conn.fileno()) as sock:
        try:
            return (
                timeout,
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
            )
        finally:
            sock.detach()  # the driver's socket: not closed here


def test_every_session_is_bounded_and_probes_its_link(pg_url: str) -> None:
    expected = (("30s",), 1, 5, 2, 3, 15_000)
    with RecoveryStore.open(pg_url) as store:
        engine = store.engine
        assert isinstance(engine, PgEngine)
        assert store.write_sync(lambda txn: _bounds(txn._txn._conn)) == expected  # type: ignore[attr-defined]
        assert engine._owner_conn is not None
        assert _bounds(engine._owner_conn) == expected
        with engine._pool.connection() as reader:
            assert _bounds(reader) == expected


def test_the_schema_upgrade_waits_past_the_bound(pg_url: str, short_bound: None) -> None:
    """The upgrade may rewrite a large table (or wait for another process's upgrade):
    the owner's session is bounded only after it. Here it waits on the migration lock,
    held by another session, for longer than the bound, and the store still opens."""
    opened: list[RecoveryStore | BaseException] = []

    def open_store() -> None:
        try:
            opened.append(RecoveryStore.open(pg_url))
        except BaseException as exc:  # reported below
            opened.append(exc)

    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("SELECT pg_advisory_lock(%s, %s)", (LOCK_NAMESPACE, MIGRATION_LOCK))
        thread = threading.Thread(target=open_store)
        thread.start()
        deadline = time.monotonic() + 30
        while not admin.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE application_name ="
            " 'recoverable-owner' AND wait_event_type = 'Lock' AND now() - query_start >"
            " make_interval(secs => %s))",
            (3 * BOUND_MS / 1000,),
        ).fetchone() == (True,):
            assert time.monotonic() < deadline and thread.is_alive(), opened
            time.sleep(0.05)  # polling the server's view of the waiting session
        admin.execute("SELECT pg_advisory_unlock(%s, %s)", (LOCK_NAMESPACE, MIGRATION_LOCK))
    thread.join(30)
    [store] = opened
    assert isinstance(store, RecoveryStore), store
    with store:
        store.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        assert store.get_operation("op-1") is not None
