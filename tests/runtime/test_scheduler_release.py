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


async def release_herd(
    size: int, cost: float, precise_at: float | None = None
) -> tuple[list[int], list[tuple[int, int]]]:
    """``size`` tasks share one wait 0.1 s from now, each costing ``cost`` s of CPU once
    released; one precise wake ``precise_at`` s after it, if given. Returns the round in
    which each released task ran, and (its round, how many were released before it) for
    the precise one."""
    rounds = Rounds()
    trio.lowlevel.add_instrument(rounds)
    scheduler = Scheduler(time.time)
    released: list[int] = []
    precise: list[tuple[int, int]] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(scheduler.run)
            at = time.time() + 0.1

            async def herd_member() -> None:
                await scheduler.wait_released(at)
                assert time.time() >= at
                released.append(rounds.count)
                burn(cost)

            async def due_meanwhile(offset: float) -> None:
                await scheduler.wait_until(at + offset)
                assert time.time() >= at + offset
                precise.append((rounds.count, len(released)))

            async with trio.open_nursery() as waiters:
                for _ in range(size):
                    waiters.start_soon(herd_member)
                if precise_at is not None:
                    waiters.start_soon(due_meanwhile, precise_at)
            assert scheduler.waiting == 0
            nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(rounds)
    return released, precise


async def test_a_shared_wait_is_released_a_quota_per_round_and_a_precise_wake_goes_first(
) -> None:
    # The herd takes >= 0.2 s of CPU; the precise wake is due 0.05 s into it.
    released, precise = await release_herd(HERD, 0.001, precise_at=0.05)
    per_round = collections.Counter(released)
    assert len(released) == HERD
    assert max(per_round.values()) <= 16 < RELEASE_QUOTA_MAX  # never the whole herd at once
    assert len(per_round) >= HERD // 16  # over many rounds: 1 ms each halves the quota
    (_, released_before), = precise
    assert released_before < HERD - 50  # not behind the whole herd


async def test_cheap_shared_waits_are_released_in_few_rounds() -> None:
    """A quota that grows while rounds stay short: a herd that costs nothing is not
    slowed to a trickle."""
    released, _ = await release_herd(1000, 0.0)
    assert len(released) == 1000
    assert len(collections.Counter(released)) <= 12  # 16, 32, 64, ... 256 a round
