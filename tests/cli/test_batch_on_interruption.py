"""``recoverable batch --on-interruption fail`` (issue 14): an interrupted attempt fails the
job after ONE POST (``failure_reason="interrupted"``), never replaced; the default
replaces it within the budget."""

from __future__ import annotations

from pathlib import Path

import recoverable

from .cli_helpers import job_line, read_results, run_cli, write_jobs


def _stat(stdout: str, label: str) -> str:
    for line in stdout.splitlines():
        if line.strip().startswith(label):
            return line.split()[-1]
    raise AssertionError(f"no {label!r} in:\n{stdout}")


def test_fail_policy_one_post_per_job_and_the_jobs_fail(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(3)])
    out = tmp_path / "out.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out), "--faults", "disconnect=1.0",
                   "--max-attempts", "4", "--on-interruption", "fail")
    assert proc.returncode == 1, proc.stderr
    assert read_results(out) == []
    assert _stat(proc.stdout, "failed") == "3"
    assert _stat(proc.stdout, "POSTs (attempts spent)") == "3"  # one per job, no replacement
    store = recoverable.RecoveryStore.open(str(out) + ".store")
    try:
        records, unreadable = store.inventory()
        assert unreadable == [] and len(records) == 3
        for rec in records:
            assert rec.on_interruption == "fail" and rec.failure_reason == "interrupted"
            assert rec.attempts_used == 1 and rec.attempts[0].failure is not None
            assert rec.attempts[0].failure.kind == "disconnected"
    finally:
        store.close()


def test_replace_policy_spends_the_budget_on_replacements(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0)])
    out = tmp_path / "out.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out), "--faults", "disconnect=1.0",
                   "--max-attempts", "3")
    assert proc.returncode == 1, proc.stderr
    assert _stat(proc.stdout, "POSTs (attempts spent)") == "3"


def test_an_unknown_policy_is_a_usage_error(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0)])
    proc = run_cli("batch", str(jobs), "--out", str(tmp_path / "o.jsonl"),
                   "--on-interruption", "never")
    assert proc.returncode == 2
