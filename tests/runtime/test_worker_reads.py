"""A worker's claim rounds and its lifecycle monitor read off the event loop on PostgreSQL.

Each claim round reads the queue, the page's leases and records, other owners'
liveness and the claimed requests; the monitor reads the commit count and the commands.
On PostgreSQL each is a round trip: made on the event loop, every stream the worker runs
waits for it. They run in worker threads (``RecoveryStore.read_off_loop``); this test
counts the reads made on the event loop's thread while a real worker runs real
operations (every claim and completion changes the queue, which wakes the monitor).
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio

import recoverable
from recoverable.actors.worker import run_worker
from recoverable.storage.pg_engine import PgEngine
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, REQUEST, Answer, make_backend

OFF_LOOP = ("queued", "commands_snapshot", "owner_is_live")


@pytest.fixture
def on_loop(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    counts: collections.Counter[str] = collections.Counter()

    def counted(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def read(self: PgEngine, *args: Any, **kwargs: Any) -> Any:
            if name == "owner_is_live" and args[0] == self.owner_id:
                pass  # this process's own ownership: a memory read
            elif threading.current_thread() is threading.main_thread():
                counts[name] += 1
            else:
                counts["off:" + name] += 1
            return method(self, *args, **kwargs)
        return read

    for name in OFF_LOOP:
        monkeypatch.setattr(PgEngine, name, counted(name, getattr(PgEngine, name)))
    yield counts


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


async def test_claim_rounds_and_the_monitor_read_off_the_loop(
    pg_url: str, on_loop: collections.Counter[str]
) -> None:
    store = recoverable.RecoveryStore.open(pg_url)
    try:
        async with FixtureProvider.serve(reply_delay=0.05) as provider:
            provider.script([Reply.stall(after_events=2)])  # the first generation streams on
            async with recoverable.open_runtime(
                store, make_backend(provider), account=ACCOUNT
            ) as rt:
                held = await rt.submit(REQUEST, response=Answer, job_id="held",
                                       maximum_attempts=2)
                stop = trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(functools.partial(
                        run_worker, rt, concurrency=3, authorize=approve, stop=stop
                    ))
                    with trio.fail_after(60):
                        await provider.wait_for_requests(1)
                        # While it streams its monitor watches it: each of these claims
                        # and completions changes the queue and wakes the monitor.
                        handles = [
                            await rt.submit(REQUEST, response=Answer, job_id=f"j{i}",
                                            maximum_attempts=2)
                            for i in range(8)
                        ]
                        for handle in handles:
                            assert isinstance(await rt.wait(handle, response=Answer), Answer)
                        await rt.cancel(held)
                        with pytest.raises(recoverable.OperationCancelled):
                            await rt.wait(held, response=Answer)
                    stop.set()
    finally:
        store.close()
    # One queue read on the loop: the sweep when the runtime opened; none per round.
    assert on_loop["off:queued"] > 1 and on_loop["queued"] <= 1, on_loop
    assert on_loop["owner_is_live"] == 0, on_loop
    # The queue changed while operations ran: the monitor was woken and scanned.
    assert on_loop["off:commands_snapshot"] > 0 and on_loop["commands_snapshot"] == 0, on_loop
