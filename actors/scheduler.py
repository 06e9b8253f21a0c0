"""The Scheduler: one timer heap for every waiting operation of a runtime.

Operations never sleep on their own: they park on the heap at their persisted
``next_attempt_at`` (wall-clock seconds) and one task wakes them. A woken
operation re-reads the wall clock, so no attempt ever starts before its time.
It also owns the optional global limits of batch hosts: at most
``max_concurrency`` generations streaming at once, and at most
``requests_per_second`` generation POSTs started per second.

Shared waits (:meth:`Scheduler.wait_released`: the end of a rate-limit pause that every
operation of an account waits for) are released a few per round of the event loop, not
all at once. Thousands of operations released together each start a POST (about 2 ms of
Python each over SSE) in one round: measured with 2,000 operations, rounds of 0.6 and
3.7 s in which no other task ran, so an operation due then woke seconds late and the
heartbeat's renewals waited behind them. The quota adapts to what a released operation
costs: halved when a round took longer than :data:`ROUND_TARGET`, doubled when it did
not; every due :meth:`Scheduler.wait_until` is woken first, in every round.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Final

import trio

# A round of the event loop that releases shared waits should take about this long
# (seconds of the process's own time): a precise wake due meanwhile is that late at most.
ROUND_TARGET: Final = 0.004
RELEASE_QUOTA_MAX: Final = 256  # shared waits released in one round, at most


class Scheduler:
    def __init__(
        self,
        wall_clock: Callable[[], float],
        *,
        max_concurrency: int | None = None,
        requests_per_second: float | None = None,
        round_clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``round_clock`` measures how long a round that ran released shared waits took
        (the process's own time; a test may pass a clock of its own)."""
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if requests_per_second is not None and not (
            math.isfinite(requests_per_second) and requests_per_second > 0
        ):
            raise ValueError("requests_per_second must be a positive number")
        self._wall = wall_clock
        self._round_clock = round_clock
        self._heap: list[tuple[float, int, trio.Event]] = []
        self._shared: list[tuple[float, int, trio.Event]] = []  # wait_released
        self._quota = 16  # shared waits released per round (adapted: see the module)
        self._seq = itertools.count()
        self._rescan = trio.Event()
        self._limiter = trio.CapacityLimiter(max_concurrency) if max_concurrency else None
        self._rate = requests_per_second
        self._next_slot = 0.0  # trio time at which the next POST may start (rate limit)
        self.woken = 0
        self.released = 0  # shared waits released (wait_released)

    @property
    def waiting(self) -> int:
        return len(self._heap) + len(self._shared)

    @property
    def next_wake_at(self) -> float | None:
        """Wall-clock time at which the earliest waiting operation wakes, if any."""
        return self._heap[0][0] if self._heap else None

    async def wait_until(self, at: float) -> None:
        """Return once ``wall_clock() >= at`` (never earlier)."""
        while self._wall() < at:
            await self._park(self._heap, at).wait()

    async def wait_released(self, at: float) -> None:
        """Return once ``wall_clock() >= at`` (never earlier), for a wait that many tasks
        share (the end of a shared pause): released a quota per round of the event loop,
        after the round's due :meth:`wait_until` wakes (see the module docstring)."""
        while self._wall() < at:
            await self._park(self._shared, at).wait()

    def _park(self, heap: list[tuple[float, int, trio.Event]], at: float) -> trio.Event:
        """Enter a wait until ``at`` in ``heap``; its event is set when it is due. (A plain
        function, not a coroutine: a parked operation keeps no extra frame alive.)"""
        event = trio.Event()
        entry = (at, next(self._seq), event)
        heapq.heappush(heap, entry)
        if heap[0] is entry:
            self._rescan.set()
        return event

    def recheck(self) -> None:
        """Look at the wall clock again now. The timer sleeps on Trio's clock until the
        earliest wait is due; after the wall clock steps forward (a test steps its own),
        this wakes what is now due without waiting for that timer."""
        self._rescan.set()

    def _wake_due(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= now:
            heapq.heappop(heap)[2].set()
            self.woken += 1

    async def run(self) -> None:
        """The single timer task (started by the runtime's supervisor nursery)."""
        heap, shared = self._heap, self._shared
        released_at: float | None = None  # when the last round's release was handed out
        while True:
            now = self._wall()
            self._wake_due(now)
            if shared and shared[0][0] <= now:
                if released_at is not None:  # the round that ran what was released
                    took = self._round_clock() - released_at
                    self._quota = (max(1, self._quota // 2) if took > ROUND_TARGET
                                   else min(RELEASE_QUOTA_MAX, self._quota * 2))
                for _ in range(self._quota):
                    if not shared or shared[0][0] > now:
                        break
                    heapq.heappop(shared)[2].set()
                    self.released += 1
                if shared and shared[0][0] <= now:
                    # More are due: let these run first. They run in the next round,
                    # where this task may run before them (a round's order is not
                    # fixed): it comes back after a second checkpoint, so the time it
                    # measures covers the round that ran them.
                    released_at = self._round_clock()
                    await trio.lowlevel.checkpoint()
                    self._wake_due(self._wall())
                    await trio.lowlevel.checkpoint()
                    continue
            released_at = None
            due = min(heap[0][0] if heap else math.inf, shared[0][0] if shared else math.inf)
            with trio.move_on_after(due - now):
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
