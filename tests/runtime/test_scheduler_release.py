"""The scheduler's shared waits (``Scheduler.wait_released``): the end of a pause that
every operation of an account waits for releases a quota of them per round of the event
loop, adapted to what they cost, and a precise wake due meanwhile goes first.

Measured before (bench/scheduler_lateness.py, 2,000 operations over SSE): the end of the
shared 429 pause released every operation in one round; their POSTs took rounds of 0.6
and 3.7 s in which nothing else ran, and operations due then woke seconds late."""

from __future__ import annotations

import collections
import time

import trio
import trio.lowlevel

from recoverable.actors.scheduler import RELEASE_QUOTA_MAX, Scheduler

HERD = 200


class Rounds(trio.abc.Instrument):
    """Counts the event loop's rounds (one I/O wait each)."""

    def __init__(self) -> None:
        self.count = 0

    def before_io_wait(self, timeout: float) -> None:
        self.count += 1


def burn(seconds: float) -> None:
    """The Python work of starting a POST, stood in for by CPU time."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_a_shared_wait_is_released_a_quota_per_round_and_a_precise_wake_goes_first(
) -> None:
    rounds = Rounds()
    trio.lowlevel.add_instrument(rounds)
    scheduler = Scheduler(time.time)
    released: list[int] = []  # the round in which each released task ran
    precise: list[tuple[int, int]] = []  # (its round, released before it)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(scheduler.run)
            at = time.time() + 0.1

            async def herd_member() -> None:
                await scheduler.wait_released(at)
                released.append(rounds.count)
                burn(0.001)

            async def due_meanwhile() -> None:
                await scheduler.wait_until(at + 0.05)  # the herd takes >= 0.2 s of CPU
                assert time.time() >= at + 0.05
                precise.append((rounds.count, len(released)))

            async with trio.open_nursery() as waiters:
                for _ in range(HERD):
                    waiters.start_soon(herd_member)
                waiters.start_soon(due_meanwhile)
            assert scheduler.waiting == 0
            nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(rounds)
    per_round = collections.Counter(released)
    assert len(released) == HERD
    assert max(per_round.values()) <= 16 < RELEASE_QUOTA_MAX  # never the whole herd at once
    assert len(per_round) >= HERD // 16  # over many rounds: 1 ms each halves the quota
    (_, released_before), = precise
    assert released_before < HERD - 50  # not behind the whole herd


async def test_cheap_shared_waits_are_released_in_few_rounds() -> None:
    """A quota that grows while rounds stay short: a herd that costs nothing is not
    slowed to a trickle."""
    rounds = Rounds()
    trio.lowlevel.add_instrument(rounds)
    scheduler = Scheduler(time.time)
    released: list[int] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(scheduler.run)
            at = time.time() + 0.05

            async def herd_member() -> None:
                await scheduler.wait_released(at)
                assert time.time() >= at
                released.append(rounds.count)

            async with trio.open_nursery() as waiters:
                for _ in range(1000):
                    waiters.start_soon(herd_member)
            nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(rounds)
    assert len(released) == 1000
    assert len(collections.Counter(released)) <= 12  # 16, 32, 64, ... 256 a round
