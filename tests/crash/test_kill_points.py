"""Real process death (SIGKILL) at every durable boundary of the crash table.

The host driver (``host_driver.py``) runs a realistic host loop against the
fixture provider running as a separate process. It is killed at one named
boundary, then fresh processes resume the same job to the end. Invariants:
exactly one host commit; POSTs within budget; no POST after the receipt was
saved; spent attempts never refunded; every record decodes strictly.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import recoverable
from recoverable import _killpoints

DRIVER = str(Path(__file__).with_name("host_driver.py"))
MAX_ATTEMPTS = 3
RUNS = int(os.environ.get("RECOVERABLE_CRASH_RUNS", "3"))
SUMMARY: dict[str, list[int]] = {}

# Boundaries at or after which the receipt is saved: no further POST is allowed.
AFTER_RECEIPT = {"receipt.saved", "host.committed", "acknowledge.marker_saved"}


@pytest.fixture(scope="module")
def provider_process() -> Iterator[dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from recoverable.transport.fixture import fixture_main;"
         " sys.exit(fixture_main(sys.argv[1:]))", "--port", "0"],
        stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    info: dict[str, Any] = json.loads(line)
    try:
        yield info
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_driver(
    tmp: Path, base_url: str, job: str, kill_at: str | None
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("RECOVERABLE_KILL_AT", None)
    if kill_at is not None:
        env["RECOVERABLE_KILL_AT"] = kill_at
    return subprocess.run(
        [sys.executable, DRIVER, "--store", str(tmp / "store"), "--host-db", str(tmp / "host.db"),
         "--base-url", base_url, "--job", job, "--max-attempts", str(MAX_ATTEMPTS)],
        env=env, capture_output=True, text=True, timeout=60,
    )


def posts_for(requests_url: str, operation_ids: set[str]) -> list[dict[str, Any]]:
    log = httpx.get(requests_url, timeout=10).json()
    return [r for r in log if (r.get("attempt_id") or "").rsplit(".", 1)[0] in operation_ids]


@pytest.mark.parametrize("run", range(RUNS))
@pytest.mark.parametrize("point", _killpoints.POINTS)
def test_sigkill_at_boundary_then_resume_commits_exactly_once(
    provider_process: dict[str, Any], tmp_path: Path, point: str, run: int
) -> None:
    job = f"job-{point}-{run}"
    killed = run_driver(tmp_path, provider_process["http_url"], job, point)
    violations = 0
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    try:
        before = {r.operation_id: r.attempts_used for r in store.inventory()[0]}
    finally:
        store.close()
    finished = run_driver(tmp_path, provider_process["http_url"], job, None)
    assert finished.returncode == 0, finished.stderr[-3000:]
    operation_id = json.loads(finished.stdout.strip().splitlines()[-1])["operation_id"]

    db = sqlite3.connect(tmp_path / "host.db")
    commits = db.execute("SELECT COUNT(*) FROM commit_log WHERE job=?", (job,)).fetchone()[0]
    db.close()
    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    try:
        records, unreadable = store.inventory()
        problems = store.check_integrity()
        disposition = store.get_disposition(operation_id)
        after = {r.operation_id: r.attempts_used for r in records}
    finally:
        store.close()
    posts = posts_for(provider_process["requests_url"], {operation_id} | set(before))
    checks = [
        commits == 1,
        len(posts) <= MAX_ATTEMPTS,
        point not in AFTER_RECEIPT or len(posts) == 1,
        all(after.get(op, used) >= used for op, used in before.items()),  # never refunded
        not unreadable and not problems,
        disposition is not None and disposition.disposition == "acknowledged",
        disposition is not None and disposition.removal_complete,
        # Orphans are reconciled: the killed run's record is the one that finished.
        point not in ("prepare.saved",) or operation_id in before,
    ]
    violations = checks.count(False)
    SUMMARY.setdefault(point, [0, 0])
    SUMMARY[point][0] += 1
    SUMMARY[point][1] += violations
    assert violations == 0, (point, checks, len(posts), commits)


def teardown_module() -> None:
    if SUMMARY:
        lines = ["", "crash table: boundary -> runs, invariant violations"]
        for point in _killpoints.POINTS:
            runs, bad = SUMMARY.get(point, [0, 0])
            lines.append(f"  {point:32s} runs={runs:2d} violations={bad}")
        print("\n".join(lines))
