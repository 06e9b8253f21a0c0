"""Issue 29.3 and 29.5: ``recoverable batch`` and its endpoint, with and without workers.

Real processes: the batch, its ``recoverable worker`` children and the fixture provider
(``recoverable fixture-provider``, which logs every generation request it received).

- 29.3: operations saved for another endpoint are refused (``configuration_unavailable``,
  exit 1) the same way with ``--workers N`` as with ``--workers 0``; the host used to
  wait for ever for a worker of the new endpoint that never claims them.
- 29.5: an endpoint that never answers (a closed port) ends the batch once it could not be
  connected to for ``--unreachable-after`` seconds: exit 1, the jobs unfinished, one
  message, nothing spent; the same message with ``--workers N``; a rerun against the
  endpoint once it listens completes every job with its first attempt.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx

import recoverable
from recoverable.records import OperationRecord

from .cli_helpers import (
    REPO,
    TIMEOUT,
    child_env,
    cli_command,
    job_line,
    read_results,
    run_cli,
    write_jobs,
)
from .test_batch_workers import wait_for
from .test_endpoint_cli import closed_port, summary_of
from .test_worker_cli import start_provider, stop

KEY = {"BATCH_ENDPOINT_KEY": "sk-batch-endpoint"}
JOBS = 3


def _records(store: Path) -> list[OperationRecord]:
    """The store's operation records, read in this process (also while a batch runs)."""
    if not store.exists() or not (store / "data.mdb").exists():
        # The batch is creating the store: LMDB makes lock.mdb before data.mdb, and a store
        # with only a lock file is refused as damaged (CI: a poll landed in between).
        return []
    with recoverable.RecoveryStore.open(str(store)) as opened:
        records, unreadable = opened.inventory()
    assert unreadable == []
    return list(records)


def _job_lines(stderr: str, what: str) -> list[str]:
    return sorted(line for line in stderr.splitlines() if line.startswith("job ") and what in line)


def test_workers_refuse_jobs_saved_for_another_endpoint_like_workers_0(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(JOBS)])
    out, store = tmp_path / "out.jsonl", tmp_path / "out.jsonl.store"
    first = subprocess.Popen(  # the embedded fixture (endpoint "fixture"); every stream stalls
        cli_command("batch", str(jobs), "--out", str(out), "--workers", "1",
                    "--faults", "stall=1.0"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=child_env(),
    )
    try:
        wait_for(lambda: sum(record.phase == "transmitting" for record in _records(store))
                 == JOBS, "every job's attempt streaming (stalled) in the worker")
    finally:
        first.send_signal(signal.SIGINT)
        _, stderr = first.communicate(timeout=TIMEOUT)
    assert first.returncode == 130, stderr
    provider, info = start_provider()
    try:
        rerun = ["batch", str(jobs), "--out", str(out), "--endpoint", info["http_url"],
                 "--api-key-env", "BATCH_ENDPOINT_KEY", "--account", "batch"]
        # Used to wait for ever ("running 3"): no worker of this endpoint claims them.
        workers = run_cli(*rerun, "--workers", "1", env=KEY)
        in_process = run_cli(*rerun, "--workers", "0", env=KEY)
        sent = httpx.get(info["requests_url"], timeout=30).json()
    finally:
        stop(provider)
    assert workers.returncode == 1, workers.stderr
    assert in_process.returncode == 1, in_process.stderr
    refused = _job_lines(workers.stderr, "failed: configuration_unavailable")
    assert len(refused) == JOBS, workers.stderr
    assert refused == _job_lines(in_process.stderr, "failed: configuration_unavailable")
    assert all("prepared for another endpoint" in line for line in refused)
    assert summary_of(workers.stdout)["failed"] == str(JOBS)
    assert sent == []  # nothing reached the new endpoint
    # Untouched: the batch on its own endpoint finishes them. (In this process: a worker
    # that resumes them clears their queue mark before it takes their lease, a window in
    # which a host's wait reads "suspended from outside"; reported with issue 29.)
    back = run_cli("batch", str(jobs), "--out", str(out))
    assert back.returncode == 0, back.stderr
    assert sorted(line["id"] for line in read_results(out)) == [
        f"gen-{i:04d}" for i in range(JOBS)
    ]


def test_an_unreachable_endpoint_ends_the_batch_and_a_rerun_sends_attempt_one(
    tmp_path: Path,
) -> None:
    port = closed_port()
    url = f"http://127.0.0.1:{port}/v1"
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(JOBS)])
    out, store = tmp_path / "out.jsonl", tmp_path / "out.jsonl.store"
    args = ["batch", str(jobs), "--out", str(out), "--endpoint", url,
            "--api-key-env", "BATCH_ENDPOINT_KEY", "--unreachable-after", "1"]
    ended: dict[str, subprocess.CompletedProcess[str]] = {}
    for workers in ("0", "2"):  # the same end in this process and in worker processes
        ended[workers] = result = run_cli(*args, "--workers", workers, env=KEY)
        assert result.returncode == 1, (workers, result.stdout, result.stderr)
        summary = summary_of(result.stdout)
        assert summary["unfinished"] == str(JOBS) and summary["failed"] == "0", summary
        assert summary["POSTs (attempts spent)"] == "0"
        assert summary["endpoint unavailable"].startswith("connect_refused")
        records = _records(store)
        assert len(records) == JOBS
        for record in records:  # nothing spent, the same attempt pending
            # --workers 0: as they were (prepared); with workers, those another worker
            # was still waiting on when the batch stopped it are suspended for the next.
            assert record.phase in (("prepared",) if workers == "0" else
                                    ("prepared", "suspended")), (workers, record)
            assert record.attempts_used == 0 and record.attempts == ()
            assert record.endpoint_failure == "connect_refused"
            assert record.pending is not None
            assert record.pending.attempt_id == record.operation_id + ".1"
    told = [line for line in ended["0"].stderr.splitlines()
            if line.startswith("error: endpoint_unavailable")]
    assert told == [
        "error: endpoint_unavailable: the endpoint could not be connected to (connect_refused) "
        "for 1 s (--unreachable-after); nothing was spent: the jobs not done keep their "
        "budgets and count as unfinished; rerun once the endpoint is reachable"
    ]
    assert told[0] in ended["2"].stderr.splitlines()
    assert read_results(out) == []
    provider, info = start_provider("--port", str(port))
    try:
        assert info["http_url"] == url
        rerun = run_cli(*args, "--workers", "1", env=KEY)
        sent = httpx.get(info["requests_url"], timeout=30).json()
    finally:
        stop(provider)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(line["id"] for line in read_results(out)) == [
        f"gen-{i:04d}" for i in range(JOBS)
    ]
    attempts = sorted(request["attempt_id"] for request in sent)
    assert attempts == sorted(record.operation_id + ".1" for record in records)
