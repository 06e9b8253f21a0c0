"""``RecoveryStore.read_off_loop``: reads run where they cost the event loop least.

On LMDB a read is a memory read: it runs inline, on the event loop's thread (a thread hop
would cost more than the read). On PostgreSQL every read is a round trip: it runs in a
worker thread, at most ``engine.read_threads`` at once, and the event loop serves other
tasks while it travels.
"""

from __future__ import annotations

import threading

import pytest
import trio

from recoverable.storage.store import RecoveryStore

pytestmark = pytest.mark.both_stores


def test_reads_run_inline_on_lmdb_and_off_the_loop_on_postgresql(store_location: str) -> None:
    store = RecoveryStore.open(store_location)
    try:
        ran_on: list[threading.Thread] = []

        def reads() -> int:
            ran_on.append(threading.current_thread())
            return store.last_txnid()

        async def main() -> int:
            return await store.read_off_loop(reads)

        assert trio.run(main) == store.last_txnid()
        off_loop = ran_on[0] is not threading.main_thread()
        assert off_loop == (store.engine.read_threads > 0)
        assert off_loop == store_location.startswith("postgresql")
    finally:
        store.close()


def test_the_loop_runs_other_tasks_while_a_postgresql_read_travels(pg_url: str) -> None:
    """The read waits for an event only another Trio task sets: were it run on the event
    loop, that task could never run (the bound turns the hang into a failure)."""
    store = RecoveryStore.open(pg_url)
    try:
        released = threading.Event()

        def reads() -> int:
            assert released.wait(10), "the event loop was blocked by the read"
            return store.last_txnid()

        async def main() -> int:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, released.set)
                with trio.fail_after(20):
                    return await store.read_off_loop(reads)
            raise AssertionError("unreachable")

        assert trio.run(main) == store.last_txnid()
    finally:
        store.close()


def test_at_most_read_threads_postgresql_reads_run_at_once(pg_url: str) -> None:
    store = RecoveryStore.open(pg_url)
    try:
        bound = store.engine.read_threads
        assert bound > 1
        lock = threading.Lock()
        running = 0
        most = 0
        all_in = threading.Barrier(bound)

        def reads() -> int:
            nonlocal running, most
            with lock:
                running += 1
                most = max(most, running)
            try:
                # The first ``bound`` reads meet here: that many run at once.
                if most <= bound:
                    try:
                        all_in.wait(10)
                    except threading.BrokenBarrierError:
                        pass
                return store.last_txnid()
            finally:
                with lock:
                    running -= 1

        results: list[int] = []

        async def one() -> None:
            results.append(await store.read_off_loop(reads))

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                for _ in range(bound * 3):
                    nursery.start_soon(one)

        trio.run(main)
        assert len(results) == bound * 3
        assert most == bound  # as many as the engine allows, never more
        assert not all_in.broken
    finally:
        store.close()


def test_a_cancelled_caller_leaves_a_postgresql_read_that_never_returns(pg_url: str) -> None:
    """A read stuck on the server (here: on an event nobody sets until the end) does not
    hold its caller: a cancellation returns at once; the thread finishes later."""
    store = RecoveryStore.open(pg_url)
    try:
        stuck = threading.Event()
        finished = threading.Event()

        def reads() -> int:
            stuck.wait(30)
            finished.set()
            return 0

        async def main() -> bool:
            with trio.move_on_after(0.2) as scope:
                await store.read_off_loop(reads)
            return scope.cancelled_caught

        assert trio.run(main) is True
        assert not finished.is_set()  # the read is still in its thread
        stuck.set()
        assert finished.wait(10)
    finally:
        store.close()
