"""The database itself failing (issue 17): lost connections, a commit whose outcome is
unknown, a killed backend, an unreachable server. Real server, real sockets: the
connection losses come from a TCP relay (``proxy.py``) and ``pg_terminate_backend``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import psycopg
import pytest

import recoverable
from recoverable.errors import FenceMismatch, StorageUnavailable
from recoverable.records import CommandRecord
from recoverable.storage import RecoveryStore, WriteTransaction, acquire_lease
from recoverable.storage.pg_engine import PgEngine
from recoverable.storage.registry import StoreOptions
from recoverable.testing import FixtureProvider
from tests.pg.cluster import Cluster
from tests.pg.proxy import PgProxy
from tests.runtime.conftest import ACCOUNT, REQUEST, Answer, Authorizer, make_backend
from tests.storage.storage_helpers import make_op


@pytest.fixture
def proxy(pg_cluster: Cluster) -> Iterator[PgProxy]:
    relay = PgProxy(pg_cluster.port)
    yield relay
    relay.close()


def _proxied(proxy: PgProxy, pg_url: str) -> str:
    return proxy.url(pg_url.rsplit("/", 1)[1])


def _counting(calls: list[int]) -> Callable[[WriteTransaction], CommandRecord]:
    """A mutation that writes a command and counts its runs."""

    def mutation(txn: WriteTransaction) -> CommandRecord:
        calls.append(1)
        return txn.put_command("op-1", "suspend", 1.0)

    return mutation


def test_a_commit_whose_answer_is_lost_is_read_back_not_run_again(
    proxy: PgProxy, pg_url: str
) -> None:
    with RecoveryStore.open(_proxied(proxy, pg_url)) as store:
        store.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        calls: list[int] = []
        proxy.arm("lose_commit_reply")
        command = store.write_sync(_counting(calls))
        assert proxy.fired.is_set()
        # Committed once: the mutation ran once, the serial is the first one.
        assert calls == [1] and command.serial == 1
        assert store.get_command("op-1") == command
        stats = store.stats()
        assert stats["unknown_commits_resolved"] == 1 and stats["reruns"] == 0
        assert store.check_integrity() == []


def test_a_commit_the_server_never_received_is_run_again(proxy: PgProxy, pg_url: str) -> None:
    with RecoveryStore.open(_proxied(proxy, pg_url)) as store:
        store.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        calls: list[int] = []
        proxy.arm("lose_commit")
        command = store.write_sync(_counting(calls))
        assert proxy.fired.is_set()
        # Rolled back by the server, found missing in the txn log, run again: the serial
        # of the run that committed is still the first (the lost run wrote nothing).
        assert calls == [1, 1] and command.serial == 1
        assert store.get_command("op-1") == command
        stats = store.stats()
        assert stats["unknown_commits_resolved"] == 0 and stats["reruns"] == 1
        assert store.check_integrity() == []


def _terminate(pg_url: str, role: str) -> int:
    with psycopg.connect(pg_url, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = %s AND datname = current_database()",
            (f"recoverable-{role}",),
        ).fetchall()
    return len(rows)


def test_a_killed_writer_backend_is_replaced_and_nothing_is_lost(pg_url: str) -> None:
    with RecoveryStore.open(pg_url) as store:
        store.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        assert _terminate(pg_url, "writer") == 1
        store.write_sync(lambda txn: txn.put_operation(make_op("op-2")))
        assert store.get_operation("op-1") is not None
        assert store.get_operation("op-2") is not None
        assert store.stats()["reconnects"] == 1


def test_a_writer_backend_killed_inside_a_batch_reruns_the_batch(pg_url: str) -> None:
    """Killed mid-batch (after the mutation ran, before its writes were sent): the
    transaction is known rolled back, so the batch is run again, never failed."""
    with RecoveryStore.open(pg_url) as store:
        store.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        calls: list[int] = []

        def mutation(txn: WriteTransaction) -> None:
            calls.append(1)
            txn.put_operation(make_op("op-2"))
            if len(calls) == 1:
                assert _terminate(pg_url, "writer") == 1

        store.write_sync(mutation)
        assert calls == [1, 1]
        assert store.get_operation("op-2") is not None
        assert store.stats()["reruns"] == 1
        assert store.check_integrity() == []


def test_reads_survive_killed_read_backends(pg_url: str) -> None:
    with RecoveryStore.open(pg_url) as store:
        store.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        assert store.get_operation("op-1") is not None  # a pooled read connection now
        assert store.inventory()[0] != []
        assert _terminate(pg_url, "read") >= 1
        assert store.get_operation("op-1") is not None  # tried again on a new connection
        assert _terminate(pg_url, "read") >= 1
        assert [r.operation_id for r in store.inventory()[0]] == ["op-1"]


def test_reads_survive_every_idle_read_backend_killed_at_once(pg_url: str) -> None:
    """Every session ended together (a restart, an operator's pg_terminate_backend): the
    retry of a read that met a lost connection takes a new connection, never another
    idle one that was ended with it (the soak with killed backends once failed so)."""
    with RecoveryStore.open(pg_url) as store:
        store.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        together = threading.Barrier(3)

        def held(snapshot: object) -> None:
            together.wait(30)  # three reads at once: three idle connections after

        readers = [threading.Thread(target=store.engine.read, args=(held,)) for _ in range(3)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(60)
        assert _terminate(pg_url, "read") == 3
        assert store.get_operation("op-1") is not None
        assert [r.operation_id for r in store.inventory()[0]] == ["op-1"]
        assert _terminate(pg_url, "read") == 1  # one read session now: the retry's


def test_a_killed_owner_backend_loses_the_owner_and_its_stale_writes_fail(
    pg_url: str,
) -> None:
    stale = RecoveryStore.open(pg_url)
    try:
        assert isinstance(stale.engine, PgEngine)
        stale.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        lease = stale.write_sync(lambda txn: acquire_lease(txn, "op-1", time.time()))
        assert _terminate(pg_url, "owner") == 1  # its advisory lock goes with it
        # Another opener of the same database stands for another machine: it sees the
        # lease dead at once and takes the operation over with a higher fence.
        # Not registered in this process's open stores: a second owner of the same URL.
        other = RecoveryStore(PgEngine(pg_url, stale_options(stale)), pg_url)
        try:
            deadline = time.monotonic() + 5.0  # generous: the server closes the session
            while other.lease_is_live(lease) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not other.lease_is_live(lease)
            taken = other.write_sync(lambda txn: acquire_lease(txn, "op-1", time.time()))
            assert taken.fence == lease.fence + 1
        finally:
            other.engine.close()
        record = stale.get_operation("op-1")
        assert record is not None
        # The stale owner can neither checkpoint (fenced) nor commit anything at all.
        with pytest.raises((FenceMismatch, StorageUnavailable)):
            stale.write_sync(lambda txn: txn.put_operation(record, expect_fence=lease.fence))
        with pytest.raises(StorageUnavailable):
            stale.write_sync(lambda txn: txn.put_operation(make_op("op-3")))
        assert stale.get_operation("op-3") is None
        assert not stale.lease_is_live(lease)
    finally:
        stale.close()


def stale_options(store: RecoveryStore) -> StoreOptions:
    return StoreOptions(store.max_bytes, store.max_record_bytes, None)


def test_an_unreachable_database_refuses_reads_and_writes(proxy: PgProxy, pg_url: str) -> None:
    with RecoveryStore.open(_proxied(proxy, pg_url)) as store:
        store.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
        proxy.down()
        with pytest.raises(StorageUnavailable):
            store.get_operation("op-1")
        with pytest.raises(StorageUnavailable):
            store.write_sync(lambda txn: txn.put_operation(make_op("op-2")))
        proxy.up()
        with psycopg.connect(pg_url) as conn:
            rows = conn.execute("SELECT count(*) FROM recoverable_operations").fetchone()
        assert rows == (1,)


async def test_while_the_database_is_unreachable_nothing_is_authorized_or_sent(
    proxy: PgProxy, pg_url: str
) -> None:
    async with FixtureProvider.serve() as provider:
        store = RecoveryStore.open(_proxied(proxy, pg_url))
        try:
            async with recoverable.open_runtime(
                store, make_backend(provider), account=ACCOUNT
            ) as rt:
                handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
                proxy.down()
                auth = Authorizer()
                with pytest.raises(StorageUnavailable):
                    await rt.send_recovering(handle, response=Answer, authorize=auth)
                assert auth.calls == []
        finally:
            store.close()
        assert provider.requests == []
    proxy.up()
    with RecoveryStore.open(pg_url) as fresh:  # nothing was spent while it was down
        record = fresh.get_operation(handle.operation_id)
        assert record is not None and record.attempts_used == 0


def test_the_writer_session_is_ended_by_the_server_when_stopped_in_a_transaction(
    pg_url: str,
) -> None:
    """A writer stopped inside its transaction would hold the fleet's writers' lock: its
    session carries idle_in_transaction_session_timeout, so the server ends it."""
    with RecoveryStore.open(pg_url) as store:
        # The setting of the writer's own session (the connection under the write view).
        setting = store.write_sync(
            lambda txn: txn._txn._conn.execute(  # type: ignore[attr-defined]
                "SHOW idle_in_transaction_session_timeout"
            ).fetchone()
        )
        assert setting == ("5s",)
