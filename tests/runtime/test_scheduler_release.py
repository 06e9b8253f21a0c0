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
import trio.testing

from recoverable.actors.scheduler import RELEASE_QUOTA_MAX, Scheduler

from .conftest import ShiftedWall

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


class RoundClock:
    """A round clock that only the herd advances: each released task adds what it costs,
    so the scheduler's measure of a round does not depend on how loaded the machine is."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def release_herd(
    size: int, cost: float, precise_at: float | None = None, *, counted: bool = False
) -> tuple[list[int], list[tuple[int, int]]]:
    """``size`` tasks share one wait, each costing ``cost`` s once released: CPU time
    burnt, or (``counted``) seconds added to a round clock of the test's own. One precise
    wake ``precise_at`` s after the shared wait, if given. Returns the round in which each
    released task ran, and (its round, how many were released before it) for the precise
    one."""
    rounds = Rounds()
    trio.lowlevel.add_instrument(rounds)
    round_clock = RoundClock()
    # The herd parks an hour ahead; the test steps the clock there once every task has
    # parked (on a loaded machine, tasks still starting when a near deadline passed
    # would not park at all).
    wall = ShiftedWall()
    scheduler = (Scheduler(wall, round_clock=round_clock) if counted else Scheduler(wall))
    released: list[int] = []
    precise: list[tuple[int, int]] = []
    try:
        # A herd that is never released fails here, with a reason, and leaves the
        # event loop sound for the next test (a pytest-timeout inside it does not).
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(scheduler.run)
                at = wall() + 3600

                async def herd_member() -> None:
                    await scheduler.wait_released(at)
                    assert wall() >= at
                    released.append(rounds.count)
                    if counted:
                        round_clock.now += cost
                    else:
                        burn(cost)

                async def due_meanwhile(offset: float) -> None:
                    await scheduler.wait_until(at + offset)
                    assert wall() >= at + offset
                    precise.append((rounds.count, len(released)))

                async with trio.open_nursery() as waiters:
                    for _ in range(size):
                        waiters.start_soon(herd_member)
                    if precise_at is not None:
                        waiters.start_soon(due_meanwhile, precise_at)
                    await trio.testing.wait_all_tasks_blocked()
                    assert scheduler.waiting == size + (precise_at is not None)
                    assert not released
                    wall.shift = at - time.time()  # the shared wait is due now
                    # The scheduler's timer sleeps on Trio's clock: tell it the wall clock
                    # stepped. (A precise wait parked 1 ms ahead did this before, and hung
                    # the test for good when its task started more than 1 ms later.)
                    scheduler.recheck()
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


def round_sizes(released: list[int]) -> list[int]:
    """How many tasks each round ran, in the order of the rounds."""
    per_round = collections.Counter(released)
    return [per_round[number] for number in sorted(per_round)]


async def test_cheap_shared_waits_are_released_in_few_rounds() -> None:
    """A quota that doubles while rounds stay short: a herd that costs nothing is not
    slowed to a trickle."""
    released, _ = await release_herd(1000, 0.0, counted=True)
    assert len(released) == 1000
    assert round_sizes(released) == [16, 32, 64, 128, 256, 256, 248]


async def test_a_costly_round_halves_the_quota_and_a_short_one_doubles_it() -> None:
    # 1.5 ms a task against a 4 ms target: 16, 8 and 4 tasks (24, 12, 6 ms) each halve
    # the quota; 2 tasks (3 ms) are under the target and double it.
    released, _ = await release_herd(40, 0.0015, counted=True)
    assert round_sizes(released)[:6] == [16, 8, 4, 2, 4, 2]
    assert sum(round_sizes(released)) == 40
