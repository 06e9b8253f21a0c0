"""Global limits (``open_runtime(max_concurrency=..., requests_per_second=...)`` and the
CLI's ``--concurrency``/``--rps``), measured at the provider.

The provider records when each generation request arrived (``received_at``) and when
its reply was fully sent (``finished_at``). The largest number of overlapping
[received, finished] intervals is the concurrency the provider saw; the arrival times
give the request rate. A slow provider (``reply_delay``) makes requests overlap, so a
concurrency limit is what bounds the overlap: the control runs without the limit show
that the measurement would see a broken one.

Tolerances: the rate limiter spaces starts ``1/rate`` apart in the client; the provider
sees them after a loopback connect, which can delay one arrival relative to the next
(scheduling jitter on a loaded machine). So windows get one extra request, and the
total span a small slack; neither bound can be met by an unlimited client.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import recoverable
from recoverable.testing import FixtureProvider

from ..cli.cli_helpers import job_line, read_results, run_cli, write_jobs
from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, make_backend

FAST = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
# Seconds one arrival may be delayed relative to the next (see above). 30 ms proved too
# tight on a loaded 2-core machine (a first connect 34 ms slower than the last was seen);
# an unlimited client spans ~0 s, so 0.1 s of slack still proves the spacing.
JITTER = 0.1


def max_in_flight(intervals: Sequence[tuple[float, float]]) -> int:
    """The largest number of intervals open at one instant (an end before a start at ties)."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals],
                   key=lambda e: (e[0], e[1]))
    now = best = 0
    for _, step in edges:
        now += step
        best = max(best, now)
    return best


def most_in_window(arrivals: Sequence[float], window: float) -> int:
    times = sorted(arrivals)
    best = 0
    j = 0
    for i, t in enumerate(times):
        while times[j] <= t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def test_max_in_flight_counts_overlaps() -> None:
    assert max_in_flight([(0, 1), (1, 2), (2, 3)]) == 1  # touching is not overlapping
    assert max_in_flight([(0, 3), (1, 2), (1.5, 4), (3.5, 5)]) == 3
    assert most_in_window([0.0, 0.1, 0.2, 1.0], 0.25) == 3


async def run_jobs(
    provider: FixtureProvider, store: recoverable.RecoveryStore, jobs: int, **limits: Any
) -> None:
    async with recoverable.open_runtime(
        store, make_backend(provider), account=ACCOUNT, **limits
    ) as rt:
        handles = [
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=1, retry_policy=FAST)
            for _ in range(jobs)
        ]

        async def one(handle: recoverable.Handle) -> None:
            assert isinstance(
                await rt.send_recovering(handle, response=Answer, authorize=Authorizer()),
                Answer,
            )

        async with trio.open_nursery() as nursery:
            for handle in handles:
                nursery.start_soon(one, handle)


def intervals(provider: FixtureProvider) -> list[tuple[float, float]]:
    spans = [(r.received_at, r.finished_at) for r in provider.requests]
    assert all(end is not None for _, end in spans)
    return [(start, end) for start, end in spans if end is not None]


@pytest.mark.parametrize("limit", [1, 3])
async def test_max_concurrency_bounds_requests_in_flight_at_the_provider(
    tmp_path: Path, limit: int
) -> None:
    # A reply takes 0.15 s: long against a loopback POST, so with 4 * limit jobs the
    # limit is reached (== limit) and, without it, far exceeded (the control below).
    async with FixtureProvider.serve(reply_delay=0.15) as provider:
        with recoverable.RecoveryStore.open(str(tmp_path / "limited")) as store:
            await run_jobs(provider, store, 4 * limit, max_concurrency=limit)
        limited = intervals(provider)
        provider.requests.clear()
        with recoverable.RecoveryStore.open(str(tmp_path / "free")) as store:
            await run_jobs(provider, store, 4 * limit)
        free = intervals(provider)
    assert len(limited) == len(free) == 4 * limit
    assert max_in_flight(limited) == limit
    assert max_in_flight(free) > limit  # the measurement sees an unlimited client


async def test_requests_per_second_spaces_posts_at_the_provider(tmp_path: Path) -> None:
    rate, jobs = 20.0, 12
    async with FixtureProvider.serve() as provider:
        with recoverable.RecoveryStore.open(str(tmp_path / "store")) as store:
            await run_jobs(provider, store, jobs, requests_per_second=rate)
        arrivals = sorted(r.received_at for r in provider.requests)
    assert len(arrivals) == jobs
    # Starts are 1/rate apart: the run spans at least (jobs - 1) / rate. Measured from
    # the second arrival, as the CLI's twin below does: the first POST also opens the
    # connection and can arrive late on a loaded machine, shortening the span by as much.
    assert arrivals[-1] - arrivals[1] >= (jobs - 2) / rate - JITTER, arrivals
    # ... and no half-second window holds more than rate/2 + 1 starts (+1 for jitter).
    assert most_in_window(arrivals, 0.5) <= rate * 0.5 + 1 + 1, arrivals


# --- the CLI flags, against the provider in its own process ---------------------------


@pytest.fixture
def slow_provider() -> Iterator[dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "recoverable", "fixture-provider", "--port", "0",
         "--reply-delay", "0.15"],
        stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    info: dict[str, Any] = json.loads(proc.stdout.readline())
    try:
        yield info
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def cli_batch(tmp_path: Path, provider: dict[str, Any], name: str, *flags: str) -> list[Any]:
    """Run ``recoverable batch`` against the provider; return its log of this run."""
    jobs = write_jobs(tmp_path / f"{name}.jsonl", [job_line(i) for i in range(12)])
    out = tmp_path / f"{name}.out.jsonl"
    before = len(httpx.get(provider["requests_url"], timeout=10).json())
    done = run_cli(
        "batch", str(jobs), "--out", str(out), "--store", str(tmp_path / f"{name}.store"),
        "--endpoint", provider["http_url"], "--mode", "sse", *flags,
        env={"OPENAI_API_KEY": "sk-test"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(read_results(out)) == 12
    log: list[Any] = httpx.get(provider["requests_url"], timeout=10).json()[before:]
    assert len(log) == 12
    return log


def test_cli_concurrency_and_rps_hold_at_the_provider(
    tmp_path: Path, slow_provider: dict[str, Any]
) -> None:
    log = cli_batch(tmp_path, slow_provider, "conc", "--concurrency", "3")
    # The provider, in its own process, records a reply finished after its last send
    # returns; the client may already have read it, saved the receipt and sent its next
    # POST, which a provider descheduled in between records first. 20 ms of a reply's end
    # are not counted: a fourth request in flight would overlap by its 0.15 s delay.
    assert max_in_flight(
        [(r["received_at"], r["finished_at"] - 0.02) for r in log]
    ) == 3
    rate = 10.0
    log = cli_batch(tmp_path, slow_provider, "rps", "--concurrency", "12", "--rps", str(rate))
    arrivals = sorted(r["received_at"] for r in log)
    # From the second arrival: the first request may also wait for its connection to be
    # made (one loaded CI run: 43 ms), which shortens a span measured from it; every later
    # one keeps its slot.
    assert arrivals[-1] - arrivals[1] >= 10 / rate - JITTER, arrivals
    assert most_in_window(arrivals, 1.0) <= rate * 1.0 + 1 + 1, arrivals


def test_cli_rpm_spaces_posts_at_the_provider(
    tmp_path: Path, slow_provider: dict[str, Any]
) -> None:
    # 300 a minute (4.75 a second with the governor's 5% margin), a bucket of half a
    # second (2.375 requests): 12 jobs need (12 - 2.375) / 4.75 = 2.03 s; without --rpm
    # they arrive at once. The slack is a fifth of it: a slow first connect on a loaded
    # machine delays the earliest arrivals and so shortens the span seen (0.2 s was seen).
    log = cli_batch(tmp_path, slow_provider, "rpm", "--concurrency", "12",
                    "--rpm", "300", "--rate-burst-seconds", "0.5")
    arrivals = sorted(r["received_at"] for r in log)
    assert arrivals[-1] - arrivals[0] >= 0.8 * (12 - 2.375) / 4.75, arrivals
    assert most_in_window(arrivals, 1.0) <= 5 + 3 + 1, arrivals


@pytest.mark.parametrize("flag", [("--rpm", "0"), ("--tpm", "-5"), ("--tpm", "nan"),
                                  ("--rate-burst-seconds", "7200")])
def test_cli_bad_rate_limits_are_usage_errors(tmp_path: Path, flag: tuple[str, str]) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0)])
    done = run_cli("batch", str(jobs), "--out", str(tmp_path / "out.jsonl"), *flag)
    assert done.returncode == 2, done.stderr
    assert flag[0] in done.stderr
