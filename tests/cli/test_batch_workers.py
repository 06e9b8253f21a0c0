"""Issue 14 (w-worker, item 3): ``recoverable batch --workers N`` with worker processes
killed (SIGKILL) at random moments: every job committed exactly once, POSTs within each
operation's budget, no generation after a saved receipt, and a rerun changes nothing.

Real processes throughout: the provider (``recoverable fixture-provider``, which logs every
generation request), the batch, and its worker children (found through ``/proc``).
The kill moments are drawn from a seeded RNG as points of progress (lines committed);
barriers are the output file and the process table, never sleeps.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import recoverable

from .cli_helpers import REPO, child_env, cli_command, job_line, read_results, write_jobs

JOBS = 200
SEED = 14
# One suite, two stores (issue 17): the workers share an LMDB directory or, as machines
# of a fleet would, one PostgreSQL database.
pytestmark = pytest.mark.both_stores


def worker_pids(parent: int) -> set[int]:
    """The live ``recoverable worker`` children of ``parent`` (from /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read().split(b"\0")
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z" and b"worker" in cmdline:
            found.add(int(entry))
    return found


def wait_for(predicate: Any, what: str, timeout: float = 60.0) -> Any:
    """Poll ``predicate`` (durable state or the process table) until it is truthy."""
    deadline = time.monotonic() + timeout  # generous: a loaded 2-core machine
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def provider() -> Iterator[dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "recoverable", "fixture-provider", "--port", "0",
         "--reply-delay", "0.1"],
        stdout=subprocess.PIPE, text=True, env=child_env(),
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


def batch_args(
    tmp_path: Path, provider: dict[str, Any], *extra: str, store: str | None = None
) -> list[str]:
    return cli_command(
        "batch", str(tmp_path / "jobs.jsonl"), "--out", str(tmp_path / "out.jsonl"),
        "--store", store or str(tmp_path / "store"), "--endpoint", provider["http_url"],
        "--mode", "sse", "--api-key-env", "BATCH_WORKERS_KEY", "--concurrency", "8",
        "--max-attempts", "8", "--workers", "2", *extra,
    )


def env() -> dict[str, str]:
    return {**child_env(), "BATCH_WORKERS_KEY": "sk-batch-workers"}


def committed_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def provider_log(provider: dict[str, Any]) -> list[dict[str, Any]]:
    log: list[dict[str, Any]] = httpx.get(provider["requests_url"], timeout=30).json()
    return log


def test_batch_workers_survive_sigkills_and_commit_every_job_once(
    tmp_path: Path, provider: dict[str, Any], store_location: str
) -> None:
    write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(JOBS)])
    out = tmp_path / "out.jsonl"
    rng = random.Random(SEED)
    kill_at = sorted(rng.sample(range(5, JOBS - 40), 4))  # lines committed at each kill
    batch = subprocess.Popen(
        batch_args(tmp_path, provider, "--worker-restarts", "10", store=store_location),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env(),
    )
    kills = 0
    try:
        for threshold in kill_at:
            wait_for(lambda t=threshold: committed_lines(out) >= t or batch.poll() is not None,
                     f"{threshold} committed lines")
            pids = wait_for(lambda: worker_pids(batch.pid) or batch.poll() is not None,
                            "a live worker")
            if batch.poll() is not None:
                break
            victim = rng.choice(sorted(pids))
            os.kill(victim, signal.SIGKILL)
            kills += 1
            # The pool replaces it: wait until two workers are alive again.
            wait_for(lambda v=victim: (len(worker_pids(batch.pid) - {v}) >= 2)
                     or batch.poll() is not None, "the replacement worker")
        _, stderr = batch.communicate(timeout=120)
    finally:
        if batch.poll() is None:
            batch.kill()
            batch.wait()
    assert batch.returncode == 0, stderr[-3000:]
    assert kills >= 2, "the batch finished before the kills: slow the provider down"
    assert "starting a replacement" in stderr

    # Every job committed exactly once.
    results = read_results(out)
    keys = Counter((line["id"], line["revision"]) for line in results)
    assert len(keys) == JOBS and set(keys.values()) == {1}, keys.most_common(3)

    # POSTs per operation within its budget; each attempt sent at most once; nothing
    # generated after the receipt (no attempt past the one whose result was saved).
    log = provider_log(provider)
    by_operation: dict[str, list[str]] = defaultdict(list)
    for request in log:
        attempt_id = request["attempt_id"]
        assert attempt_id is not None
        by_operation[attempt_id.rsplit(".", 1)[0]].append(attempt_id)
    store = recoverable.RecoveryStore.open(store_location)
    try:
        for line in results:
            operation_id = line["operation_id"]
            attempts = by_operation[operation_id]
            assert 1 <= len(attempts) <= 8, (operation_id, attempts)
            assert len(set(attempts)) == len(attempts), attempts  # no attempt sent twice
            marker = store.get_disposition(operation_id)
            assert marker is not None and marker.disposition == "acknowledged"
            numbers = [int(a.rsplit(".", 1)[1]) for a in attempts]
            assert max(numbers) == marker.attempts_used, (operation_id, attempts)
        assert set(by_operation) <= {line["operation_id"] for line in results}
        assert store.queued() == []
        assert store.check_integrity() == []
    finally:
        store.close()
    replaced = sum(len(a) - 1 for a in by_operation.values())
    assert replaced >= 1  # the kills did interrupt attempts (replaced within budget)

    # A rerun changes nothing: no POST, the output byte for byte the same.
    before = out.read_bytes()
    rerun = subprocess.run(batch_args(tmp_path, provider, store=store_location),
                           capture_output=True, text=True, cwd=REPO, env=env(), timeout=120)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert out.read_bytes() == before
    assert len(provider_log(provider)) == len(log)


def test_the_restart_bound_stops_the_batch_with_a_typed_reason(
    tmp_path: Path, provider: dict[str, Any]
) -> None:
    write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(400)])
    batch = subprocess.Popen(
        batch_args(tmp_path, provider, "--worker-restarts", "1", "--concurrency", "1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env(),
    )
    try:
        for _ in range(2):
            pids = wait_for(lambda: worker_pids(batch.pid), "a live worker")
            victim = min(pids)
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda v=victim: v not in worker_pids(batch.pid), "the kill")
            if _ == 0:
                wait_for(lambda v=victim: len(worker_pids(batch.pid) - {v}) >= 2,
                         "the replacement worker")
        _, stderr = batch.communicate(timeout=120)
    finally:
        if batch.poll() is None:
            batch.kill()
            batch.wait()
    assert batch.returncode == 1, stderr[-2000:]
    assert "worker_restarts_exhausted" in stderr
    # Nothing committed twice; what was not committed resumes on a rerun.
    results = read_results(tmp_path / "out.jsonl")
    assert len({(r["id"], r["revision"]) for r in results}) == len(results) < 400
    assert worker_pids(batch.pid) == set()
