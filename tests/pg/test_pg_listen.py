"""The lifecycle monitor on PostgreSQL (issue 17): woken by LISTEN/NOTIFY, with a
bounded poll when a notification is lost or its connection drops.

Two store objects on one database stand for two machines (two owners: a command written
through one reaches the other's monitor only through the database)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
import trio

import recoverable
from recoverable.storage import pg_engine, pg_writer
from recoverable.testing import FixtureProvider, Reply
from tests.runtime.conftest import ACCOUNT, REQUEST, Answer, Authorizer, make_backend

BOUND = 5.0  # seconds: generous for a loaded 2-core machine, far below a disabled poll


@pytest.fixture
def machines(pg_url: str) -> Iterator[tuple[recoverable.RecoveryStore, recoverable.RecoveryStore]]:
    first = recoverable.RecoveryStore.open(pg_url)
    # Another URL string for the same database: another store object, another owner.
    second = recoverable.RecoveryStore.open(pg_url + "?sslmode=disable")
    try:
        assert first.owner_id != second.owner_id
        yield first, second
    finally:
        second.close()
        first.close()


async def _cancel_seen_across_machines(
    machines: tuple[recoverable.RecoveryStore, recoverable.RecoveryStore],
    between: object = None,
) -> tuple[float, int]:
    """Machine A streams (the provider stalls); machine B cancels: seconds until A's
    send ends with OperationCancelled, and how many times A's monitor woke."""
    store_a, store_b = machines
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.stall(after_events=2)])
        async with recoverable.open_runtime(
            store_a, make_backend(provider), account=ACCOUNT
        ) as rt_a, recoverable.open_runtime(
            store_b, make_backend(provider), account=ACCOUNT
        ) as rt_b:
            handle = await rt_a.prepare(REQUEST, response=Answer, maximum_attempts=3)
            ended: list[float] = []
            done = trio.Event()

            async def stream() -> None:
                with pytest.raises(recoverable.OperationCancelled):
                    await rt_a.send_recovering(handle, response=Answer, authorize=Authorizer())
                ended.append(time.monotonic())
                done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream)
                await provider.wait_for_requests(1)
                if callable(between):
                    between()
                started = time.monotonic()
                await rt_b.cancel(handle)
                with trio.fail_after(30):
                    await done.wait()
            return ended[0] - started, rt_a.monitor.polls


async def test_a_cancel_on_another_machine_wakes_the_monitor_by_notify(
    machines: tuple[recoverable.RecoveryStore, recoverable.RecoveryStore],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pg_engine, "COMMIT_POLL_SECONDS", 60.0)  # no poll can explain it
    latency, wakes = await _cancel_seen_across_machines(machines)
    assert latency < BOUND
    # Woken by notifications only (a 2 ms poll would have woken it hundreds of times).
    assert wakes <= 10, wakes


async def test_a_lost_notification_is_covered_by_the_bounded_poll(
    machines: tuple[recoverable.RecoveryStore, recoverable.RecoveryStore],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pg_writer, "_NOTIFY_TABLES", frozenset())  # every NOTIFY is lost
    monkeypatch.setattr(pg_engine, "COMMIT_POLL_SECONDS", 0.1)
    latency, _ = await _cancel_seen_across_machines(machines)
    assert latency < BOUND


async def test_a_dropped_listen_connection_is_reopened_and_scanned(
    machines: tuple[recoverable.RecoveryStore, recoverable.RecoveryStore],
    monkeypatch: pytest.MonkeyPatch,
    pg_url: str,
) -> None:
    monkeypatch.setattr(pg_engine, "COMMIT_POLL_SECONDS", 60.0)

    def kill_listeners() -> None:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            killed = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname ="
                " current_database() AND application_name = 'recoverable-listen'"
            ).fetchall()
        assert len(killed) >= 1

    latency, _ = await _cancel_seen_across_machines(machines, between=kill_listeners)
    assert latency < BOUND
