"""A rerun of ``recoverable batch --workers N`` finishes what a stopped run left.

A worker that stops cleanly (the batch's Ctrl-C sends its workers SIGTERM) suspends its
running operations and marks them in the queue for the next worker. The rerun submits
every unfinished job again; that used to clear the mark, so no worker claimed them, and
``wait`` raised ``OperationSuspended``: "suspended from outside; rerun to resume", for
ever. Now a repeated submit keeps the mark, and the rerun completes every job once.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import recoverable

from .cli_helpers import REPO, child_env, cli_command, job_line, read_results, run_cli, write_jobs
from .test_batch_workers import wait_for, worker_pids

JOBS = 4


def _running(store: Path) -> int:
    listing = run_cli("inventory", "--store", str(store), "--account", "batch", "--json")
    if listing.returncode != 0:
        return 0
    return sum(op["availability"] == "running"
               for op in json.loads(listing.stdout)["operations"])


def test_a_rerun_after_ctrl_c_resumes_what_the_workers_suspended(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(JOBS)])
    out, store = tmp_path / "out.jsonl", tmp_path / "out.jsonl.store"
    first = subprocess.Popen(
        cli_command("batch", str(jobs), "--out", str(out), "--workers", "1",
                    "--faults", "stall=1.0"),  # every stream stalls: all stay running
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=child_env(),
    )
    try:
        wait_for(lambda: _running(store) == JOBS, "every job running in the worker")
    finally:
        first.send_signal(signal.SIGINT)
        _, stderr = first.communicate(timeout=60)
    assert first.returncode == 130, stderr
    with recoverable.RecoveryStore.open(str(store)) as opened:
        records, _ = opened.inventory()
        assert sorted(record.phase for record in records) == ["suspended"] * JOBS
        assert all(entry.resume for entry in opened.queued())
    rerun = run_cli("batch", str(jobs), "--out", str(out), "--workers", "1")
    assert rerun.returncode == 0, rerun.stderr
    assert "suspended from outside" not in rerun.stderr
    assert sorted(line["id"] for line in read_results(out)) == [
        f"gen-{i:04d}" for i in range(JOBS)
    ]


def test_workers_stop_with_a_killed_batch_and_a_rerun_finishes(tmp_path: Path) -> None:
    """The probe: workers outlived a SIGKILLed batch, holding operations `running` with
    live leases (the rerun hung at `done 2984/3000 running 16`). A worker started by a
    batch reads its standard input, a pipe only the batch holds: killed, the batch's end
    closes, and its workers stop cleanly (suspended, marked for the next worker)."""
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(JOBS)])
    out, store = tmp_path / "out.jsonl", tmp_path / "out.jsonl.store"
    batch = subprocess.Popen(
        cli_command("batch", str(jobs), "--out", str(out), "--workers", "1",
                    "--faults", "stall=1.0"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO, env=child_env(),
    )
    try:
        wait_for(lambda: _running(store) == JOBS, "every job running in the worker")
        (worker,) = worker_pids(batch.pid)
    finally:
        batch.kill()
        batch.wait(timeout=30)
    wait_for(lambda: not _alive(worker), "the worker stopping with its batch")
    with recoverable.RecoveryStore.open(str(store)) as opened:
        records, _ = opened.inventory()
        assert sorted(record.phase for record in records) == ["suspended"] * JOBS
        assert all(opened.get_lease(record.operation_id) is None for record in records)
    rerun = run_cli("batch", str(jobs), "--out", str(out), "--workers", "1")
    assert rerun.returncode == 0, rerun.stderr
    assert len(read_results(out)) == JOBS


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie, reaped by nobody now its parent is gone, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
