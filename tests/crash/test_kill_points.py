"""Real process death (SIGKILL) at every durable boundary of the crash table.

The host driver (``host_driver.py``) runs a realistic host loop against the fixture
provider, which runs as its own process (``recoverable fixture-provider``). The host
is killed at one named boundary, then a fresh process resumes the same job to the
end. The table has two scenarios, each over both transports (SSE and WebSocket):

- ``first``: the provider answers the first attempt; the host is killed at every
  boundary from before the record is saved to after the acknowledgement marker;
- ``replacement``: the provider is scripted to drop the first attempt mid-stream, and
  the host is killed at every boundary of the *replacement* attempt (the n-th hit of
  a kill point when it is also passed during the first attempt).

POSTs are counted from the provider's request log (``GET /_fixture/requests``), per
attempt id, never from the host's own count. Invariants, each of which can fail:

- exactly one host commit;
- the exact attempts that reached the provider, per boundary (which attempt numbers,
  each once), so no POST after the receipt was saved and none beyond the budget;
- the exact number of attempts spent, read from what survives acknowledgement (the
  disposition marker keeps ``attempts_used``): never refunded — a refund of a spent
  attempt shows as fewer spent attempts than the POSTs the provider saw, and than the
  expected count;
- every record decodes strictly, the operation is acknowledged and its content removed;
- an orphan (saved before the host stored its handle) is the record that finishes.

Runs per boundary: ``RECOVERABLE_CRASH_RUNS`` (default 2; the kill points are
deterministic, more runs vary only timing). One run of the table is ~68 processes, ~20 s.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

import recoverable
from recoverable import _killpoints

DRIVER = str(Path(__file__).with_name("host_driver.py"))
ACCOUNT = recoverable.AccountBinding("acct-crash", "api-key")  # host_driver.py's account
MAX_ATTEMPTS = 3
RUNS = int(os.environ.get("RECOVERABLE_CRASH_RUNS", "2"))
TRANSPORTS = ("sse", "websocket")
# (scenario, transport, kill spec) -> [runs, violations]; printed by conftest.py.
SUMMARY: dict[str, list[int]] = {}


@attrs.frozen
class Expect:
    """What the provider and the store must show after kill + resume."""

    posted: tuple[int, ...]  # attempt numbers that reached the provider, each exactly once
    spent: int  # attempts_used on the disposition marker


# The first attempt is answered. Kill points hit once per process.
FIRST: dict[str, Expect] = {
    "prepare.before_save": Expect((1,), 1),  # nothing saved: the resume prepares afresh
    "prepare.saved": Expect((1,), 1),  # the orphan is adopted, not duplicated
    "host.handle_saved": Expect((1,), 1),
    "attempt.pending_saved": Expect((1,), 1),  # reserved, never consumed: not spent
    "attempt.consumed_saved": Expect((2,), 2),  # spent without a POST: stays spent
    "stream.completed_unreceived": Expect((1, 2), 2),  # generated, lost, replaced
    "receipt.before_save": Expect((1, 2), 2),
    "receipt.saved": Expect((1,), 1),  # the saved receipt is delivered: no new POST
    "host.committed": Expect((1,), 1),
    "acknowledge.marker_saved": Expect((1,), 1),
}
# The first attempt is dropped mid-stream and replaced; the kill lands in attempt 2.
# ``@2`` is the second hit in the killed process (the first was attempt 1's).
REPLACEMENT: dict[str, Expect] = {
    "attempt.pending_saved@2": Expect((1, 2), 2),
    "attempt.consumed_saved@2": Expect((1, 3), 3),
    # Hit once per attempt that streamed: attempt 1 streamed two events before its drop.
    "stream.completed_unreceived@2": Expect((1, 2, 3), 3),
    "receipt.before_save": Expect((1, 2, 3), 3),
    "receipt.saved": Expect((1, 2), 2),
    "host.committed": Expect((1, 2), 2),
    "acknowledge.marker_saved": Expect((1, 2), 2),
}
FIRST_FAILS = [{"kind": "disconnect", "after_events": 2}]
# One suite, two stores (issue 17): every boundary of the table runs on LMDB (both
# transports, RUNS times) and on PostgreSQL (SSE, once: the kill points are deterministic
# and the transport does not touch the store; this keeps the suite within its time).
CASES = [
    pytest.param(
        kind, scenario, transport, spec, run,
        id=f"{kind}-{scenario}-{transport}-{spec}-{run}",
    )
    for kind, runs, transports in (("lmdb", RUNS, TRANSPORTS), ("postgresql", 1, ("sse",)))
    for scenario, table in (("first", FIRST), ("replacement", REPLACEMENT))
    for transport in transports
    for spec in table
    for run in range(runs)
]


def test_first_table_covers_every_kill_point() -> None:
    assert tuple(FIRST) == _killpoints.POINTS


@pytest.fixture(scope="module")
def provider_process() -> Iterator[dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "recoverable", "fixture-provider", "--port", "0"],
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
    tmp: Path, base_url: str, mode: str, job: str, kill_at: str | None, store: str
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("RECOVERABLE_KILL_AT", None)
    if kill_at is not None:
        env["RECOVERABLE_KILL_AT"] = kill_at
    return subprocess.run(
        [sys.executable, DRIVER, "--store", store, "--host-db", str(tmp / "host.db"),
         "--base-url", base_url, "--mode", mode, "--job", job,
         "--max-attempts", str(MAX_ATTEMPTS)],
        env=env, capture_output=True, text=True, timeout=60,
    )


def posts_for(requests_url: str, operation_ids: set[str]) -> list[dict[str, Any]]:
    log = httpx.get(requests_url, timeout=10).json()
    return [r for r in log if (r.get("attempt_id") or "").rsplit(".", 1)[0] in operation_ids]


def script(base_url: str, replies: list[dict[str, Any]]) -> None:
    root = base_url.rsplit("/v1", 1)[0]
    httpx.post(f"{root}/_fixture/script", json=replies, timeout=10).raise_for_status()


@pytest.mark.parametrize("kind,scenario,transport,spec,run", CASES)
def test_sigkill_at_boundary_then_resume_commits_exactly_once(
    provider_process: dict[str, Any], tmp_path: Path, kind: str, scenario: str,
    transport: str, spec: str, run: int, request: pytest.FixtureRequest,
) -> None:
    location = (
        str(request.getfixturevalue("pg_url")) if kind == "postgresql" else str(tmp_path / "store")
    )
    expect = (FIRST if scenario == "first" else REPLACEMENT)[spec]
    point = spec.partition("@")[0]
    base_url = provider_process["http_url"]
    job = f"job-{scenario}-{transport}-{spec}-{run}"
    script(base_url, FIRST_FAILS if scenario == "replacement" else [])
    killed = run_driver(tmp_path, base_url, transport, job, spec, location)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    store = recoverable.RecoveryStore.open(location)
    try:
        before = {r.operation_id: r.attempts_used for r in store.inventory()[0]}
    finally:
        store.close()
    finished = run_driver(tmp_path, base_url, transport, job, None, location)
    assert finished.returncode == 0, finished.stderr[-3000:]
    operation_id = json.loads(finished.stdout.strip().splitlines()[-1])["operation_id"]

    db = sqlite3.connect(tmp_path / "host.db")
    commits = db.execute("SELECT COUNT(*) FROM commit_log WHERE job=?", (job,)).fetchone()[0]
    db.close()
    store = recoverable.RecoveryStore.open(location)
    try:
        records, unreadable = store.inventory()
        problems = store.check_integrity()
        disposition = store.get_disposition(operation_id)
    finally:
        store.close()
    # Attempts spent, from what survives acknowledgement (the marker keeps the count).
    spent_after = disposition.attempts_used if disposition is not None else -1
    posts = posts_for(provider_process["requests_url"], {operation_id} | set(before))
    per_attempt = Counter(r["attempt_id"] for r in posts)
    numbers = tuple(sorted(int(a.rsplit(".", 1)[1]) for a in per_attempt))
    checks = {
        "one host commit": commits == 1,
        "only this operation generated": {a.rsplit(".", 1)[0] for a in per_attempt}
        <= {operation_id},
        "each attempt POSTed once": all(n == 1 for n in per_attempt.values()),
        "exact attempts POSTed": numbers == expect.posted,
        "exact attempts spent": spent_after == expect.spent,
        "never refunded": all(spent_after >= used for used in before.values()),
        "POSTs within what was spent": len(posts) <= spent_after <= MAX_ATTEMPTS,
        "first attempt dropped as scripted": scenario == "first"
        or [r["reply_kind"] for r in posts if r["attempt_id"].endswith(".1")] == ["disconnect"],
        "every record decodes": not unreadable and not problems,
        "acknowledged": disposition is not None and disposition.disposition == "acknowledged",
        "content removed": disposition is not None and disposition.removal_complete,
        "no live record left": operation_id not in {r.operation_id for r in records},
        # Orphans are reconciled: the killed run's record is the one that finished.
        "orphan adopted": point != "prepare.saved" or operation_id in before,
    }
    violations = [name for name, ok in checks.items() if not ok]
    key = f"{kind}/{scenario}/{transport}/{spec}"
    SUMMARY.setdefault(key, [0, 0])
    SUMMARY[key][0] += 1
    SUMMARY[key][1] += len(violations)
    assert violations == [], (key, violations, numbers, spent_after, commits)


@pytest.mark.parametrize("kind", ["lmdb", "postgresql"])
def test_sigkill_after_acknowledge_leaves_the_marker_and_the_removal_together(
    provider_process: dict[str, Any], tmp_path: Path, kind: str, request: pytest.FixtureRequest,
) -> None:
    """Acknowledge is ONE transaction: what a SIGKILL right after it leaves, read BEFORE
    anything resumes (no runtime opened, no sweep, no repeated acknowledge): the marker
    saying its removal is complete AND no record, no payload, no control row (the job
    index entry stays, pointing at the marker). A marker without the removal (or the
    removal without the marker) is the half state a split into two transactions would
    leave at this kill point."""
    location = str(request.getfixturevalue("pg_url")) if kind == "postgresql" else str(
        tmp_path / "store"
    )
    job = f"job-acknowledge-one-transaction-{kind}"
    script(provider_process["http_url"], [])
    killed = run_driver(tmp_path, provider_process["http_url"], "sse", job,
                        "acknowledge.marker_saved", location)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    db = sqlite3.connect(tmp_path / "host.db")
    (raw_handle,) = db.execute("SELECT handle FROM handles WHERE job=?", (job,)).fetchone()
    commits = db.execute("SELECT COUNT(*) FROM commit_log WHERE job=?", (job,)).fetchone()[0]
    db.close()
    assert commits == 1  # the host committed; then acknowledged, then died
    operation_id = json.loads(raw_handle)["operation_id"]
    store = recoverable.RecoveryStore.open(location)
    try:
        marker = store.get_disposition(operation_id)
        assert marker is not None and marker.disposition == "acknowledged"
        assert marker.removal_complete  # no marker whose removal is still to come
        assert marker.attempts_used == 1 and marker.job_id == job
        # ... and the removal is really there, in the same commit:
        assert store.get_operation(operation_id) is None
        assert store.get_raw("operations", operation_id.encode()) is None
        assert store.payload_kinds([operation_id]).get(operation_id, frozenset()) == frozenset()
        assert store.get_lease(operation_id) is None
        assert store.get_command(operation_id) is None
        # The job index entry stays with the marker: it is what makes the same job again
        # AlreadyAcknowledged instead of a new operation (cleanup_disposed ends both).
        assert store.ids_by_job(ACCOUNT, None, job) == [operation_id]
        records, unreadable = store.inventory()
        assert operation_id not in {r.operation_id for r in records} and not unreadable
        assert store.check_integrity() == []
    finally:
        store.close()
    posts = posts_for(provider_process["requests_url"], {operation_id})
    assert [r["attempt_id"] for r in posts] == [f"{operation_id}.1"]
