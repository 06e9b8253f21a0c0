"""``MockClock`` with a store: the writer thread's commits are work, not idleness.

With ``autojump_threshold=0`` Trio jumps its clock to the next deadline as soon as no task
is runnable. A task waiting for the store's writer thread is not runnable, so during one
LMDB commit the clock can run through every timer there is (the monitor's poll, the
heartbeat, a test's ``move_on_after``): an hour can pass inside one fsync. Inside
:func:`commits_take_no_time`, a spinning task keeps the loop busy while any write is in
flight, so the clock stands still for it, as a commit of a few milliseconds should.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import trio

from recoverable.storage.writer import Writer


@contextlib.asynccontextmanager
async def commits_take_no_time() -> AsyncIterator[None]:
    """Within this block (a Trio task), no clock jump happens while a write is in flight."""
    in_flight = 0
    started = trio.Event()
    original = Writer.write

    async def write(self: Writer[Any], fn: Callable[[Any], Any],
                    touches: Iterable[Any] = ()) -> Any:
        nonlocal in_flight
        in_flight += 1
        started.set()
        try:
            return await original(self, fn, touches)
        finally:
            in_flight -= 1

    async def spin() -> None:
        nonlocal started
        while True:
            if in_flight:
                await trio.lowlevel.checkpoint()  # runnable: the loop is not idle
            else:
                started = trio.Event()
                await started.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(spin)
        Writer.write = write  # type: ignore[method-assign]
        try:
            yield
        finally:
            Writer.write = original  # type: ignore[method-assign]
            nursery.cancel_scope.cancel()
