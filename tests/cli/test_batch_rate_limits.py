"""Issue 29 items 6 and 9: the rate governor's limits on the command line.

- 9: a small ``--rpm`` (a bucket smaller than one request: ``--rpm 1`` holds 0.95) sent
  nothing, ever, while the progress line said "running"; it now sends one request per
  period and the progress line says the others wait for rate budget.
- 6: ``--rpm``/``--tpm`` with ``batch --workers N`` (refused before) go to every worker
  (``recoverable worker --rpm/--tpm/--rate-burst-seconds``), and the workers share one
  budget through the store's governor row: the provider's request log shows the
  fleet-wide count within ONE bucket's bound.

Real processes throughout: the provider (``recoverable fixture-provider``, which logs each
POST's arrival time), the batch and its workers. Barriers are the provider's log, the
workers' "ready" lines, the progress line and durable state, never sleeps. The timing
bounds are one-sided (a POST arrives no earlier than the governor admitted it), with a
stated slack for how much later than its admission a POST may arrive (``DELAY``).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
import trio

import recoverable
from recoverable.actors.governor import RateGovernor
from recoverable.cli.progress import ProgressDisplay, Terminal
from recoverable.cli.report import BatchSummary
from recoverable.telemetry import Telemetry

from .cli_helpers import (
    REPO,
    SMALL_SCHEMA,
    child_env,
    cli_command,
    job_line,
    read_results,
    write_jobs,
)

pytestmark = pytest.mark.both_stores
KEY_ENV = {"RATE_TEST_KEY": "sk-rate-test"}
ACCOUNT = recoverable.AccountBinding("acct-rate", "api-key")
SCHEMA = recoverable.JsonSchema("label", SMALL_SCHEMA)
# A POST admitted at t reaches the provider a little later: the first ones of a worker
# open their connections, so on a loaded machine they may arrive up to this much later
# than the next ones (which compresses the arrivals); +1 request per window for the rest.
DELAY = 0.5
# 600 a minute (10 a second; 9.5 with the governor's 5% margin), a bucket of half a
# second (4.75 requests): what the fleet may send at once, then its rate.
RPM, BURST = 600.0, 0.5
RATE, BUCKET = RPM / 60, RPM / 60 * BURST


def most_in_window(arrivals: Sequence[float], window: float) -> int:
    times = sorted(arrivals)
    best = j = 0
    for i, t in enumerate(times):
        while times[j] <= t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def assert_one_budget(arrivals: Sequence[float], jobs: int) -> None:
    """The fleet-wide arrivals keep ONE bucket's bound: no one-second window holds more
    than a second's refill and the bucket, and the whole run took at least
    (jobs - bucket) / rate, both less what ``DELAY`` can shift. Two budgets (one per
    worker) would send 2 buckets at once and then 20 a second: 30 jobs in ~1.1 s."""
    times = sorted(arrivals)
    assert len(times) == jobs
    assert most_in_window(times, 1.0) <= BUCKET + RATE * (1.0 + DELAY) + 1, times
    assert times[-1] - times[0] >= (jobs - BUCKET) / RATE - DELAY, times


@pytest.fixture
def provider() -> Iterator[dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "recoverable", "fixture-provider", "--port", "0",
         "--reply-delay", "0.05"],
        stdout=subprocess.PIPE, text=True, env=child_env(),
    )
    assert proc.stdout is not None
    info: dict[str, Any] = json.loads(proc.stdout.readline())
    try:
        yield info
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def provider_log(info: dict[str, Any]) -> list[dict[str, Any]]:
    log: list[dict[str, Any]] = httpx.get(info["requests_url"], timeout=30).json()
    return log


# -- 9: a bucket smaller than one request ------------------------------------------------


def test_rpm_1_sends_one_request_and_the_progress_line_says_the_others_wait(
    tmp_path: Path,
) -> None:
    """``--rpm 1`` (a bucket of 0.95 requests) was refused (and before that, sent
    nothing for ever). Now the first job goes at once (the bucket starts full) and the
    progress line shows the other as waiting for rate budget, not running, until the
    next request's time (63 s later: 60 / 0.95)."""
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(2)])
    out = tmp_path / "out.jsonl"
    batch = subprocess.Popen(
        cli_command("batch", str(jobs), "--out", str(out), "--rpm", "1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=child_env(),
    )
    # A watchdog, not a correctness sleep: a batch that never shows the wait is killed.
    watchdog = threading.Timer(60.0, batch.kill)
    watchdog.start()
    try:
        assert batch.stdout is not None
        shown = ""
        for line in batch.stdout:  # one progress line per second (when it changes)
            if "waiting for rate budget" in line:
                shown = line
                break
        assert shown, batch.communicate()
        assert "done 1/2  running 0  waiting for rate budget 1 (rpm, next at " in shown, shown
        batch.send_signal(signal.SIGINT)  # Ctrl-C: the waiting job is suspended
        rest, err = batch.communicate(timeout=30)
    finally:
        watchdog.cancel()
        if batch.poll() is None:
            batch.kill()
            batch.wait()
    assert batch.returncode == 130, err
    assert len(read_results(out)) == 1
    assert re.search(r"^POSTs \(attempts spent\)\s+1$", rest, re.M), rest


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])
async def test_the_progress_line_counts_jobs_waiting_for_rate_budget_apart(
    tmp_path: Path, workers: int
) -> None:
    """What the line says while the governor holds jobs back (``--rpm 1``: the first
    request emptied the bucket, the next may go 60 / 0.95 s later). In this process the
    governor's waiting operations are counted apart from "running" (they send nothing);
    with ``--workers`` the workers hold them, so the line says what the shared governor
    row says (a request would wait, until when), without a count."""
    clock = Clock()
    with recoverable.RecoveryStore.open(str(tmp_path / "store")) as store:
        gov = RateGovernor(store, wall_clock=clock, telemetry=Telemetry(None),
                           requests_per_minute=1)
        host = SimpleNamespace(
            summary=BatchSummary(jobs=3, committed=1), running=2, config=SimpleNamespace(
                workers=workers), attempts_spent=lambda: 1,
            rt=SimpleNamespace(
                governor=gov, scheduler=SimpleNamespace(waiting=0, next_wake_at=None),
                backend=SimpleNamespace(endpoint_id="fixture"), account=ACCOUNT,
                endpoint_failure=lambda: None,
            ),
        )
        display = ProgressDisplay(cast(Any, host), Terminal(None, None), live=False,
                                  started=0.0)
        assert "rate budget" not in display.line()  # a full bucket: nothing waits
        display = ProgressDisplay(cast(Any, host), Terminal(None, None), live=False,
                                  started=0.0)  # (the workers' read is kept for 1 s)

        async def no_wait(at: float) -> None:
            raise AssertionError("the bucket starts full")

        await gov.admit("op_sent", "fixture", ACCOUNT, 10, no_wait)
        next_at = time.strftime("%H:%M:%S", time.localtime(clock.now + 60 / 0.95))
        waiting, release = trio.Event(), trio.Event()

        async def wait_until(at: float) -> None:
            waiting.set()
            await release.wait()

        async with trio.open_nursery() as nursery:
            if not workers:  # this process's own job waits in its governor
                nursery.start_soon(gov.admit, "op_held", "fixture", ACCOUNT, 10, wait_until)
                await waiting.wait()
            line = display.line()
            nursery.cancel_scope.cancel()
    if workers:
        assert line.startswith(
            f"done 1/3  running 2  waiting for rate budget (rpm, next at {next_at})  "
            "waiting 0  "), line
    else:
        assert line.startswith(
            f"done 1/3  running 1  waiting for rate budget 1 (rpm, next at {next_at})  "
            "waiting 0  "), line


# -- 6: the limits shared by a fleet of workers ----------------------------------------------


def test_batch_workers_share_one_rpm_budget_at_the_provider(
    tmp_path: Path, provider: dict[str, Any]
) -> None:
    """``batch --workers 2 --rpm R --rate-burst-seconds B`` (refused before: "each worker
    would need them"): every worker gets the limits, and together they keep one budget."""
    count = 30
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(count)])
    out = tmp_path / "out.jsonl"
    done = subprocess.run(
        cli_command(
            "batch", str(jobs), "--out", str(out), "--store", str(tmp_path / "store"),
            "--endpoint", provider["http_url"], "--mode", "sse", "--api-key-env",
            "RATE_TEST_KEY", "--concurrency", "16", "--workers", "2", "--rpm", str(RPM),
            "--rate-burst-seconds", str(BURST),
        ),
        capture_output=True, text=True, timeout=120, cwd=REPO, env={**child_env(), **KEY_ENV},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(read_results(out)) == count
    assert_one_budget([r["received_at"] for r in provider_log(provider)], count)


def test_batch_refuses_rps_with_workers_and_says_why(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0)])
    done = subprocess.run(
        cli_command("batch", str(jobs), "--out", str(tmp_path / "out.jsonl"), "--workers",
                    "2", "--rps", "5"),
        capture_output=True, text=True, timeout=60, cwd=REPO, env=child_env(),
    )
    assert done.returncode == 2
    assert "--rps is not available with --workers" in done.stderr
    assert "use --rpm (shared by every worker)" in done.stderr
    assert not (tmp_path / "out.jsonl.store").exists()


def start_worker(store: str, info: dict[str, Any], *flags: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        cli_command(
            "worker", "--store-env", "RATE_TEST_STORE", "--endpoint", info["http_url"],
            "--mode", "sse", "--api-key-env", "RATE_TEST_KEY", "--account",
            ACCOUNT.account_id, "--concurrency", "16", *flags,
        ),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**child_env(), **KEY_ENV, "RATE_TEST_STORE": store},
    )
    assert proc.stdout is not None
    ready = proc.stdout.readline()
    assert ready and json.loads(ready)["worker"] == "ready", (
        proc.stderr.read() if proc.stderr else "")
    return proc


async def test_two_worker_processes_share_one_rpm_budget(
    store_location: str, provider: dict[str, Any]
) -> None:
    """``recoverable worker --rpm R --rate-burst-seconds B``: two workers, both ready
    before the jobs are queued, both run some of them (their own reports say so), and
    the provider sees one budget's arrivals, on LMDB and on PostgreSQL."""
    count = 30
    limits = ("--rpm", str(RPM), "--rate-burst-seconds", str(BURST))
    workers = [start_worker(store_location, provider, *limits) for _ in range(2)]
    reports = []
    try:
        with recoverable.RecoveryStore.open(store_location) as store:
            backend = recoverable.ResponsesBackend(
                provider["http_url"], mode="sse",
                credentials=recoverable.StaticCredentials("sk-rate-test", account=ACCOUNT),
            )
            async with recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
                handles = [
                    await rt.submit(
                        recoverable.StructuredRequest(model="gpt-test", instructions="Label.",
                                                      input=f"text {i}"),
                        response=SCHEMA, job_id=f"job-{i}", input_revision="r1",
                        maximum_attempts=2,
                    )
                    for i in range(count)
                ]
                with trio.fail_after(60):  # generous: the work takes ~3 s
                    for handle in handles:
                        await rt.wait(handle, response=SCHEMA)
    finally:
        for worker in workers:
            stop(worker)
            out = worker.stdout.read() if worker.stdout is not None else ""
            reports.append(json.loads(out.splitlines()[-1]) if out.strip() else {})
    assert all(worker.returncode == 0 for worker in workers)
    completed = [report.get("completed", 0) for report in reports]
    assert sum(completed) == count and min(completed) > 0, reports  # both sent some
    assert_one_budget([r["received_at"] for r in provider_log(provider)], count)
