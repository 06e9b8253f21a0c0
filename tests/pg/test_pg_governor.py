"""The rate governor's shared pause on the PostgreSQL store (issue 17): without limits, an
admission only reads the pause row, and on PostgreSQL that read is a round trip on the
event loop, so a process keeps it for ``ADVISORY_READ_SECONDS``: another process's pause
is seen at most that late, this process's own at once."""

from __future__ import annotations

import pytest

from recoverable.actors.governor import RateGovernor
from recoverable.outcome import Interruption
from recoverable.storage import RecoveryStore
from recoverable.storage.pg_engine import ADVISORY_READ_SECONDS
from recoverable.telemetry import Telemetry
from tests.pg.fixtures import other_owner_url
from tests.storage.storage_helpers import ACCOUNT


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


async def _admit(gov: RateGovernor, clock: Clock, tokens: int = 1) -> list[tuple[str, float]]:
    waits: list[tuple[str, float]] = []

    async def wait_until(at: float) -> None:
        waits.append((gov.waiting["op"][0], round(at - clock.now, 6)))
        clock.now = at
        if len(waits) > 5:  # still refused after 5 waits: it never would be admitted
            raise AssertionError(f"never admitted: {waits}")

    await gov.admit("op", "fixture", ACCOUNT, tokens, wait_until)
    return waits


RATE_LIMITED = Interruption(kind="http_rejected", http_status=429, retry_after=4.0)


@pytest.mark.parametrize("stale", [False, True], ids=["read_again", "kept"])
async def test_another_processs_pause_is_seen_within_the_advisory_window(
    pg_url: str, stale: bool
) -> None:
    clock = Clock()
    mine = RecoveryStore.open(pg_url)
    other = RecoveryStore.open(other_owner_url(pg_url))  # another process's store
    try:
        gov = RateGovernor(mine, wall_clock=clock, telemetry=Telemetry(None))
        theirs = RateGovernor(other, wall_clock=clock, telemetry=Telemetry(None))
        for _ in range(5):  # many admissions, one read
            assert await _admit(gov, clock) == []
        assert gov.pause_reads == 1
        await theirs.settle("op", "fixture", ACCOUNT, estimate=0, maximum_pause=60.0,
                            outcome=RATE_LIMITED)
        if stale:
            # Within the window this process may still admit: the pause is advisory.
            clock.now += ADVISORY_READ_SECONDS / 2
            assert await _admit(gov, clock) == []
        else:
            clock.now += ADVISORY_READ_SECONDS
            assert await _admit(gov, clock) == [("paused", 4.0 - ADVISORY_READ_SECONDS)]
    finally:
        other.close()
        mine.close()


async def test_this_processs_own_pause_counts_at_once(pg_url: str) -> None:
    clock = Clock()
    with RecoveryStore.open(pg_url) as store:
        gov = RateGovernor(store, wall_clock=clock, telemetry=Telemetry(None))
        assert await _admit(gov, clock) == []
        await gov.settle("op", "fixture", ACCOUNT, estimate=0, maximum_pause=60.0,
                         outcome=RATE_LIMITED)
        assert await _admit(gov, clock) == [("paused", 4.0)]
        # Its own write was known without a read; the one read after the wait is the
        # pause's end, looked up again once the window passed.
        assert gov.pause_reads == 2


async def test_a_bucket_smaller_than_one_request_is_shared_by_two_processes(
    pg_url: str,
) -> None:
    """Issue 29.6/29.9 on PostgreSQL: ``rpm=1`` (a bucket of 0.95 requests) admits one
    request per 60 / 0.95 s, and two processes' governors share that one budget: what
    one admitted, the other waits for."""
    clock = Clock()
    mine = RecoveryStore.open(pg_url)
    other = RecoveryStore.open(other_owner_url(pg_url))  # another process's store
    period = round(60 / 0.95, 6)
    try:
        gov = RateGovernor(mine, wall_clock=clock, telemetry=Telemetry(None),
                           requests_per_minute=1, tokens_per_minute=6000, burst_seconds=1.0)
        theirs = RateGovernor(other, wall_clock=clock, telemetry=Telemetry(None),
                              requests_per_minute=1, tokens_per_minute=6000,
                              burst_seconds=1.0)
        assert await _admit(gov, clock, 500) == []  # both buckets start full
        # The requests bucket refills in 63 s; the 500 tokens (the bucket holds 95) in 5.3.
        assert await _admit(theirs, clock, 500) == [("requests", period)]
        assert await _admit(gov, clock, 500) == [("requests", period)]
    finally:
        other.close()
        mine.close()
