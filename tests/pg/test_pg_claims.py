"""Claim reservations (storage/pg_claims.py): workers of different owners take disjoint
operations, a claimer skips a row another session is locking instead of waiting for it,
and a reservation stops counting when its owner is gone or it lapses."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
import trio

import recoverable
from recoverable.actors.worker import run_worker
from recoverable.storage import RecoveryStore
from recoverable.storage import pg_engine as pg_engine_module
from recoverable.storage.keys import operation_key
from recoverable.storage.pg_claims import CLAIM_SECONDS, CLAIMS
from recoverable.testing import FixtureProvider
from tests.pg.fixtures import other_owner_url
from tests.runtime.conftest import ACCOUNT, REQUEST, Answer, generation_requests, make_backend
from tests.storage.storage_helpers import make_op

BOUND = 30.0  # seconds a step may take on a loaded machine before the test says why
IDS = [f"op-{index}" for index in range(6)]


@contextmanager
def two_owners(pg_url: str) -> Iterator[tuple[RecoveryStore, RecoveryStore]]:
    """Two owners of one database (two opened stores), with ``IDS`` saved."""
    with RecoveryStore.open(pg_url) as first, RecoveryStore.open(other_owner_url(pg_url)) as second:
        first.write_sync(lambda txn: [txn.put_operation(make_op(op_id)) for op_id in IDS])
        yield first, second


def _claim_rows(pg_url: str) -> dict[str, str]:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        rows = conn.execute(f"SELECT operation_key, owner_id FROM {CLAIMS}").fetchall()
    return {bytes(key).decode(): owner for key, owner in rows}


def test_two_owners_reserve_disjoint_operations_in_queue_order(pg_url: str) -> None:
    with two_owners(pg_url) as (first, second):
        assert first.reserve_claims(IDS, limit=3) == IDS[:3]
        # The other owner's live reservations are skipped; the limit counts what it got.
        assert second.reserve_claims(IDS, limit=6) == IDS[3:]
        # An owner's own reservations are its own again; the other's are not.
        assert first.reserve_claims(IDS, limit=6) == IDS[:3]
        assert second.reserve_claims(list(reversed(IDS)), limit=2) == ["op-5", "op-4"]
        assert first.reserve_claims([], limit=3) == []
        assert first.reserve_claims(IDS, limit=0) == []
        # An id with no operation row is never reserved.
        assert first.reserve_claims(["missing", "op-0"], limit=2) == ["op-0"]
        owners = _claim_rows(pg_url)
        assert {op_id for op_id, owner in owners.items() if owner == first.owner_id} == set(
            IDS[:3]
        )


def test_a_closed_owners_reservations_stop_counting_at_once(pg_url: str) -> None:
    with RecoveryStore.open(pg_url) as survivor:
        with RecoveryStore.open(other_owner_url(pg_url)) as leaving:
            leaving.write_sync(
                lambda txn: [txn.put_operation(make_op(op_id)) for op_id in IDS]
            )
            assert leaving.reserve_claims(IDS, limit=6) == IDS
            assert survivor.reserve_claims(IDS, limit=6) == []
        # Its lock is released: it is not live, so its reservations (unlapsed) are free.
        assert survivor.reserve_claims(IDS, limit=6) == IDS


def test_a_lapsed_reservation_stops_counting(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with two_owners(pg_url) as (first, second):
        monkeypatch.setattr(pg_engine_module, "CLAIM_SECONDS", 0.0)
        assert first.reserve_claims(IDS[:2], limit=2) == IDS[:2]
        # Lapsed at the server's now() of the reservation: free for the next statement.
        assert second.reserve_claims(IDS[:2], limit=2) == IDS[:2]
        monkeypatch.setattr(pg_engine_module, "CLAIM_SECONDS", 600.0)
        assert first.reserve_claims(IDS[2:4], limit=2) == IDS[2:4]
        assert second.reserve_claims(IDS[2:4], limit=2) == []


def test_an_owner_that_is_not_live_reserves_nothing(pg_url: str) -> None:
    """Its heartbeat expired (server time): it may be taken for dead by the others, so it
    reserves nothing, and its reservations no longer keep the others off."""
    with two_owners(pg_url) as (first, second):
        assert first.reserve_claims(IDS[:2], limit=2) == IDS[:2]
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE recoverable_owners SET expires_at = now() - interval '1 second'"
                " WHERE owner_id = %s", (first.owner_id,),
            )
        assert first.reserve_claims(IDS, limit=6) == []
        assert second.reserve_claims(IDS[:2], limit=2) == IDS[:2]


def test_a_row_another_session_is_locking_is_skipped_not_waited_for(pg_url: str) -> None:
    """SKIP LOCKED: an operation row locked by another session (a writer's last round
    trip updating it, another claimer's statement) is passed over at once; it can be
    reserved once that session's transaction ends."""
    with two_owners(pg_url) as (first, _second):
        with psycopg.connect(pg_url) as blocker:
            blocker.execute(
                "SELECT 1 FROM recoverable_operations WHERE key = %s FOR UPDATE",
                (operation_key("op-0"),),
            )
            got: list[list[str]] = []
            claimer = threading.Thread(
                target=lambda: got.append(first.reserve_claims(IDS[:3], limit=3)),
                daemon=True,
            )
            claimer.start()
            claimer.join(BOUND)
            assert not claimer.is_alive(), "the claimer waited on a locked row"
            assert got == [IDS[1:3]]
            blocker.rollback()
        assert first.reserve_claims(IDS[:3], limit=3) == IDS[:3]


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


async def test_a_worker_leaves_what_another_live_owner_reserved(pg_url: str) -> None:
    """A worker's claim round starts only what it reserved: two operations another live
    owner reserved wait for that owner, and are run once it is gone."""
    other = RecoveryStore.open(other_owner_url(pg_url))
    try:
        async with FixtureProvider.serve(reply_delay=0.2) as provider:
            with RecoveryStore.open(pg_url) as store:
                async with recoverable.open_runtime(
                    store, make_backend(provider), account=ACCOUNT
                ) as rt:
                    handles = [
                        await rt.submit(REQUEST, response=Answer, job_id=f"j{index}",
                                        maximum_attempts=2)
                        for index in range(4)
                    ]
                    held = [handle.operation_id for handle in handles[:2]]
                    assert other.reserve_claims(held, limit=2) == held
                    stop = trio.Event()
                    async with trio.open_nursery() as nursery:

                        async def work() -> None:
                            await run_worker(rt, concurrency=4, authorize=approve, stop=stop)

                        nursery.start_soon(work)
                        with trio.fail_after(BOUND):
                            for handle in handles[2:]:
                                assert isinstance(
                                    await rt.wait(handle, response=Answer), Answer
                                )
                        # Started in the same rounds as the two others, had it not reserved.
                        assert [generation_requests(provider, op_id) for op_id in held] == [
                            [], []
                        ]
                        other.close()  # its reservations stop counting with its lock
                        with trio.fail_after(BOUND):
                            for handle in handles[:2]:
                                assert isinstance(
                                    await rt.wait(handle, response=Answer), Answer
                                )
                        stop.set()
    finally:
        if not other.closed:
            other.close()


# A process that opens the store, reserves every id, says so and then waits to be killed.
_RESERVER = """
import sys, time
from recoverable.storage import RecoveryStore
store = RecoveryStore.open(sys.argv[1])
print(len(store.reserve_claims(sys.argv[2:], limit=len(sys.argv) - 2)), flush=True)
time.sleep(600)
"""


def test_a_killed_owners_reservations_stop_counting_before_they_lapse(pg_url: str) -> None:
    """SIGKILL: the killed process's session ends, its advisory lock with it, so its
    reservations (10 s) are free to the others at once: adoption is not delayed."""
    with RecoveryStore.open(pg_url) as survivor:
        survivor.write_sync(lambda txn: [txn.put_operation(make_op(op_id)) for op_id in IDS])
        reserver = subprocess.Popen(
            [sys.executable, "-c", _RESERVER, other_owner_url(pg_url), *IDS],
            stdout=subprocess.PIPE, text=True,
        )
        try:
            assert reserver.stdout is not None
            assert reserver.stdout.readline().strip() == str(len(IDS))
            assert survivor.reserve_claims(IDS, limit=6) == []
            killed_at = time.monotonic()
            reserver.send_signal(signal.SIGKILL)
            reserver.wait(timeout=BOUND)
        finally:
            if reserver.poll() is None:
                reserver.kill()
                reserver.wait()
        # The server ends the dead session within moments; well before CLAIM_SECONDS.
        while (got := survivor.reserve_claims(IDS, limit=6)) != IDS:
            assert time.monotonic() - killed_at < CLAIM_SECONDS / 2, got
            time.sleep(0.05)  # polling the server's view of the session (a bounded wait)
