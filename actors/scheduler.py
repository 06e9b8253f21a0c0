"""The Scheduler: one timer heap for every waiting operation of a runtime.

Operations never sleep on their own: they park on the heap at their persisted
``next_attempt_at`` (wall-clock seconds) and one task wakes them. A woken
operation re-reads the wall clock, so no attempt ever starts before its time.
It also owns the optional global limits of batch hosts: at most
``max_concurrency`` generations streaming at once, and at most
``requests_per_second`` generation POSTs started per second.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio


class Scheduler:
    def __init__(
        self,
        wall_clock: Callable[[], float],
        *,
        max_concurrency: int | None = None,
        requests_per_second: float | None = None,
    ) -> None:
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if requests_per_second is not None and not (
            math.isfinite(requests_per_second) and requests_per_second > 0
        ):
            raise ValueError("requests_per_second must be a positive number")
        self._wall = wall_clock
        self._heap: list[tuple[float, int, trio.Event]] = []
        self._seq = itertools.count()
        self._rescan = trio.Event()
        self._limiter = trio.CapacityLimiter(max_concurrency) if max_concurrency else None
        self._rate = requests_per_second
        self._next_slot = 0.0  # trio time at which the next POST may start (rate limit)
        self.woken = 0

    @property
    def waiting(self) -> int:
        return len(self._heap)

    @property
    def next_wake_at(self) -> float | None:
        """Wall-clock time at which the earliest waiting operation wakes, if any."""
        return self._heap[0][0] if self._heap else None

    async def wait_until(self, at: float) -> None:
        """Return once ``wall_clock() >= at`` (never earlier)."""
        while self._wall() < at:
            event = trio.Event()
            entry = (at, next(self._seq), event)
            heapq.heappush(self._heap, entry)
            if self._heap[0] is entry:
                self._rescan.set()
            await event.wait()

    async def run(self) -> None:
        """The single timer task (started by the runtime's supervisor nursery)."""
        while True:
            now = self._wall()
            while self._heap and self._heap[0][0] <= now:
                heapq.heappop(self._heap)[2].set()
                self.woken += 1
            timeout = (self._heap[0][0] - now) if self._heap else math.inf
            with trio.move_on_after(timeout):
                await self._rescan.wait()
            self._rescan = trio.Event()

    @asynccontextmanager
    async def transmission_slot(self) -> AsyncIterator[None]:
        """Held while one generation POST streams (global concurrency and rate limits)."""
        if self._rate is not None:
            now = trio.current_time()
            start = max(now, self._next_slot)
            self._next_slot = start + 1.0 / self._rate
            if start > now:
                await trio.sleep_until(start)
        if self._limiter is None:
            yield
            return
        async with self._limiter:
            yield
