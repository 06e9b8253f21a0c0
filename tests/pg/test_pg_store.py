"""The PostgreSQL store on a real server (issue 17): open, migrate, write, read, fence,
owners, redaction, failing closed."""

from __future__ import annotations

import gc
import socket
import time
from typing import Any

import psycopg
import pytest

from recoverable.errors import (
    FenceMismatch,
    InvalidRequest,
    OperationBusy,
    StorageUnavailable,
    UnsupportedRecordVersion,
)
from recoverable.storage import RecoveryStore, acquire_lease
from recoverable.storage.pg_batch import MAX_LOGGED_KEYS, row_id
from recoverable.storage.pg_changes import PRUNE
from recoverable.storage.pg_engine import PgEngine, redact_url
from recoverable.storage.pg_schema import (
    LOCK_NAMESPACE,
    SCHEMA_VERSION,
    owner_lock_held,
    schema_version,
    upgrade,
)
from tests.pg.cluster import Cluster
from tests.pg.fixtures import drop_database, new_database, other_owner_url
from tests.storage.storage_helpers import make_op


def test_open_a_url_returns_the_postgresql_store_and_migrates(pg_url: str) -> None:
    with RecoveryStore.open(pg_url) as store:
        assert isinstance(store.engine, PgEngine)
        store.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        found = store.get_operation("op-1")
        assert found is not None and found.operation_id == "op-1"
        assert store.get_operation("missing") is None
        assert store.check_integrity() == []
        assert store.stats()["entries"] == 2  # the record and its hosts index entry
    with psycopg.connect(pg_url) as conn:
        assert schema_version(conn) == SCHEMA_VERSION


async def test_a_stale_fence_cannot_write(pg_url: str) -> None:
    with RecoveryStore.open(pg_url) as store:
        await store.write(lambda txn: txn.put_operation(make_op("op-1")))
        lease = await store.write(lambda txn: acquire_lease(txn, "op-1", time.time()))
        record = store.get_operation("op-1")
        assert record is not None and record.fence == lease.fence == 1
        with pytest.raises(FenceMismatch):
            await store.write(lambda txn: txn.put_operation(record, expect_fence=0))


def test_connection_strings_are_redacted() -> None:
    assert redact_url("postgresql://alice:s3cret@db.example:5432/jobs") == (
        "postgresql://alice:***@db.example:5432/jobs"
    )
    assert "hunter2" not in redact_url("postgresql://bob@db/jobs?password=hunter2&sslmode=require")
    assert redact_url("postgresql://bob@db/jobs") == "postgresql://bob@db/jobs"


def test_a_password_never_shows_in_the_store_or_its_errors(pg_cluster: Cluster) -> None:
    url = f"postgresql://postgres:hunter2@127.0.0.1:{pg_cluster.port}/no_such_database"
    with pytest.raises(StorageUnavailable) as caught:
        RecoveryStore.open(url)
    text = f"{caught.value} {caught.value!r} {caught.value.__cause__!r}"
    assert "hunter2" not in text
    assert "postgres:***@127.0.0.1" in str(caught.value)


def test_an_unreachable_database_is_storage_unavailable() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(StorageUnavailable):
        RecoveryStore.open(f"postgresql://postgres@127.0.0.1:{port}/db")


def test_a_newer_schema_is_refused_and_left_untouched(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE recoverable_schema SET version = %s", (SCHEMA_VERSION + 1,))
    with pytest.raises(UnsupportedRecordVersion):
        RecoveryStore.open(pg_url)
    with psycopg.connect(pg_url) as conn:
        assert schema_version(conn) == SCHEMA_VERSION + 1


def test_the_migration_is_idempotent_and_runs_on_an_empty_database(pg_cluster: Cluster) -> None:
    name = new_database(pg_cluster, template="template0")
    try:
        with psycopg.connect(pg_cluster.url(name), autocommit=True) as conn:
            assert upgrade(conn) == (0, SCHEMA_VERSION)
            assert upgrade(conn) == (SCHEMA_VERSION, SCHEMA_VERSION)
    finally:
        drop_database(pg_cluster, name)


def test_an_unknown_url_scheme_is_a_typed_error() -> None:
    with pytest.raises(InvalidRequest):
        RecoveryStore.open("mysql://root@localhost/db")


def test_a_commit_by_another_process_invalidates_the_writers_row_cache(pg_url: str) -> None:
    """The writer serves reads from its cache only while nobody else committed since its
    last batch: a fence taken by another owner is seen, never the cached older one."""
    mine = RecoveryStore.open(pg_url)
    other = RecoveryStore.open(other_owner_url(pg_url))  # another owner (machine)
    try:
        mine.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        cached = mine.write_sync(lambda txn: txn.get_operation("op-1"))
        assert cached is not None and cached.fence == 0
        taken = other.write_sync(lambda txn: acquire_lease(txn, "op-1", time.time()))
        assert taken.fence == 1
        with pytest.raises(FenceMismatch):
            mine.write_sync(lambda txn: txn.put_operation(cached, expect_fence=0))
        seen = mine.write_sync(lambda txn: txn.get_operation("op-1"))
        assert seen is not None and seen.fence == 1
        # And the other way round: the other owner sees this one's later writes.
        mine.write_sync(lambda txn: txn.put_command("op-1", "suspend", 1.0))
        command = other.write_sync(lambda txn: txn.get_command("op-1"))
        assert command is not None and command.kind == "suspend"
    finally:
        other.close()
        mine.close()


def test_rows_nobody_else_changed_stay_in_the_writers_cache(pg_url: str) -> None:
    """Another process's commit evicts only the rows it wrote (recoverable_changes)."""
    mine = RecoveryStore.open(pg_url)
    other = RecoveryStore.open(other_owner_url(pg_url))
    try:
        assert isinstance(mine.engine, PgEngine)
        mine.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        mine.write_sync(lambda txn: txn.put_operation(make_op("op-2")))
        cache = mine.engine.writer._cache  # type: ignore[union-attr]
        assert row_id("recoverable_operations", b"op-1") in cache.rows
        other.write_sync(lambda txn: acquire_lease(txn, "op-2", time.time()))
        seen = mine.write_sync(lambda txn: txn.get_operation("op-2"))
        assert seen is not None and seen.fence == 1  # evicted, read again
        assert row_id("recoverable_operations", b"op-1") in cache.rows  # untouched: kept
    finally:
        other.close()
        mine.close()


def test_the_writers_row_cache_is_never_tracked_by_the_garbage_collector(pg_url: str) -> None:
    """Rows are cached by bytes ids (table index + key) holding bytes or None: the cache
    dict is never tracked, so it costs the collector nothing however large (issue 17)."""
    store = RecoveryStore.open(pg_url)
    try:
        assert isinstance(store.engine, PgEngine)
        for index in range(20):
            store.write_sync(lambda txn, i=index: txn.put_operation(make_op(f"op-{i}")))
        store.write_sync(lambda txn: txn.get_operation("op-missing"))  # cached as absent
        cache = store.engine.writer._cache  # type: ignore[union-attr]
        assert row_id("recoverable_operations", b"op-missing") in cache.rows
        assert cache.rows[row_id("recoverable_operations", b"op-missing")] is None
        assert len(cache.rows) > 20
        assert all(type(rid) is bytes for rid in cache.rows)
        assert not gc.is_tracked(cache.rows)
    finally:
        store.close()


def test_the_queue_is_read_in_one_statement_with_lmdbs_rules(pg_url: str) -> None:
    """``queued`` on PostgreSQL joins the order rows to their membership rows in one
    statement: same entries, same paging, and an order row whose membership row does not
    agree is skipped, as the LMDB scan does."""
    from recoverable.storage import queue

    with RecoveryStore.open(pg_url) as store:
        assert isinstance(store.engine, PgEngine)
        for index in range(5):
            store.write_sync(lambda txn, i=index: txn.put_operation(make_op(f"op-{i}")))
            store.write_sync(lambda txn, i=index: txn.enqueue(f"op-{i}"))
        store.write_sync(lambda txn: txn.enqueue("op-1", resume=True))  # flagged again
        entries = store.queued()
        assert [e.operation_id for e in entries] == [f"op-{i}" for i in range(5)]
        assert [e.resume for e in entries] == [False, True, False, False, False]
        page = store.queued(after_serial=entries[1].serial, limit=2)
        assert [e.operation_id for e in page] == ["op-2", "op-3"]
        # An order row without its membership row (a damaged row): skipped.
        store.write_sync(lambda txn: txn.put_raw(
            "queue", queue.order_key(entries[-1].serial + 10), b"op-9"
        ))
        assert [e.operation_id for e in store.queued()] == [f"op-{i}" for i in range(5)]
        # Damaged order rows are not counted against the page: the entries after a run of
        # them are still found (the worker pages on, never stops early).
        for name in ("op-a", "op-b", "op-c", "op-late"):
            store.write_sync(lambda txn, name=name: txn.put_operation(make_op(name)))
            store.write_sync(lambda txn, name=name: txn.enqueue(name))
        for name in ("op-a", "op-b", "op-c"):  # their membership rows damaged
            store.write_sync(lambda txn, name=name: txn.put_raw(
                "queue", queue.member_key(name), b"damaged"
            ))
        late = store.queued()[-1].serial
        page = store.queued(after_serial=entries[-1].serial, limit=2)
        assert [e.operation_id for e in page] == ["op-late"] and page[0].serial == late


def test_other_live_owners_lists_another_open_owner_until_it_closes(pg_url: str) -> None:
    """``other_live_owners`` (``migrate-store`` refuses a source someone else has open):
    the other owner while its advisory lock is held, never this one, none once it closed."""
    mine = RecoveryStore.open(pg_url)
    other = RecoveryStore.open(other_owner_url(pg_url))
    try:
        assert isinstance(mine.engine, PgEngine) and isinstance(other.engine, PgEngine)
        assert mine.other_live_owners() == [other.owner_id]
        assert other.other_live_owners() == [mine.owner_id]
        other.close()
        assert mine.other_live_owners() == []
    finally:
        other.close()
        mine.close()


def test_a_pruned_stretch_of_the_change_feed_drops_the_writers_cache(pg_url: str) -> None:
    """Another owner's commit was pruned from the change feed (an owner's heartbeat
    prunes rows older than five minutes) after this writer's last batch: the cache cannot
    tell which rows went stale and is dropped whole (a stale fence is never served), and
    the rows nobody pruned are evicted as before."""
    mine = RecoveryStore.open(pg_url)
    other = RecoveryStore.open(other_owner_url(pg_url))
    try:
        mine.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        mine.write_sync(lambda txn: txn.put_operation(make_op("op-2")))
        cached = mine.write_sync(lambda txn: txn.get_operation("op-1"))
        assert cached is not None and cached.fence == 0
        other.write_sync(lambda txn: acquire_lease(txn, "op-1", time.time()))  # fence 1
        other.write_sync(lambda txn: txn.put_command("op-2", "suspend", 1.0))
        with psycopg.connect(pg_url, autocommit=True) as conn:
            # Every row pruned (the horizon a second ahead of the server's clock).
            conn.execute(PRUNE, (-1.0,))
            left = conn.execute("SELECT count(*) FROM recoverable_changes").fetchone()
            assert left == (0,)
        seen = mine.write_sync(lambda txn: txn.get_operation("op-1"))
        assert seen is not None and seen.fence == 1
    finally:
        other.close()
        mine.close()


def test_a_batch_too_large_to_log_drops_the_writers_cache(pg_url: str) -> None:
    """A batch that wrote more rows than one change-log entry names logs "unknown": every
    other writer drops its cache (the fence it took is seen, never the cached one)."""
    mine = RecoveryStore.open(pg_url)
    other = RecoveryStore.open(other_owner_url(pg_url))
    try:
        mine.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        cached = mine.write_sync(lambda txn: txn.get_operation("op-1"))
        assert cached is not None and cached.fence == 0

        def large(txn: Any) -> None:
            acquire_lease(txn, "op-1", time.time())
            for index in range(MAX_LOGGED_KEYS + 1):
                txn.put_raw("sources", b"bulk-%d" % index, b"x")

        other.write_sync(large)
        seen = mine.write_sync(lambda txn: txn.get_operation("op-1"))
        assert seen is not None and seen.fence == 1
    finally:
        other.close()
        mine.close()


def test_an_owner_whose_heartbeat_expired_is_dead_though_its_lock_is_held(
    pg_url: str,
) -> None:
    """Liveness is the advisory lock AND the heartbeat: an owner whose session still holds
    its lock (a process stopped between statements keeps its connection) but whose
    heartbeat expiry passed is dead to the others: not listed, and its lease is taken."""
    mine = RecoveryStore.open(pg_url)
    hung = RecoveryStore.open(other_owner_url(pg_url))
    try:
        assert isinstance(mine.engine, PgEngine) and isinstance(hung.engine, PgEngine)
        mine.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        held = hung.write_sync(lambda txn: acquire_lease(txn, "op-1", time.time()))
        assert held.owner_id == hung.owner_id and mine.owner_is_live(hung.owner_id)
        with pytest.raises(OperationBusy):
            mine.write_sync(lambda txn: acquire_lease(txn, "op-1", time.time()))
        # What ten seconds without a beat leave: the expiry passed, the lock still held.
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE recoverable_owners SET expires_at = now() - interval '1 second'"
                " WHERE owner_id = %s", (hung.owner_id,),
            )
            locked = conn.execute(
                "SELECT o.owner_id FROM recoverable_owners o WHERE "
                + owner_lock_held("o.lock_key"), (LOCK_NAMESPACE,),
            ).fetchall()
        assert (hung.owner_id,) in locked
        assert not mine.owner_is_live(hung.owner_id)
        assert hung.owner_id not in mine.other_live_owners()
        taken = mine.write_sync(lambda txn: acquire_lease(txn, "op-1", time.time()))
        assert taken.owner_id == mine.owner_id and taken.fence == held.fence + 1
    finally:
        hung.close()
        mine.close()


_IMPORTS = """
import sys
import recoverable.cli
from recoverable.storage import RecoveryStore
with RecoveryStore.open(sys.argv[1]) as store:
    store.write_sync(lambda txn: None)
print(sorted(name for name in ("psycopg", "recoverable.storage.pg_engine")
             if name in sys.modules))
"""


def test_psycopg_is_imported_at_the_first_postgresql_store_only(
    pg_url: str, tmp_path: Any
) -> None:
    """An LMDB process (every CLI command on one) never imports psycopg (about 0.1 s of
    each start); the first postgresql:// store a process opens does."""
    import subprocess
    import sys

    def imported(location: str) -> str:
        done = subprocess.run([sys.executable, "-c", _IMPORTS, location],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert imported(str(tmp_path / "store")) == "[]"
    assert imported(pg_url) == "['psycopg', 'recoverable.storage.pg_engine']"


def test_a_psycopg_that_cannot_load_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """psycopg installed but unable to load (no libpq, say): opening a URL says so and
    how to repair it, a typed error, not an ImportError from deep inside."""
    import sys

    monkeypatch.setitem(sys.modules, "recoverable.storage.pg_engine", None)  # import fails
    with pytest.raises(InvalidRequest, match=r"cannot be loaded.*recoverable\[postgres\]"):
        RecoveryStore.open("postgresql://nobody@127.0.0.1:1/none")
