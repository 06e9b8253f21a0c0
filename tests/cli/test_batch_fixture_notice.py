"""A batch on the embedded fixture says so, first and in its summary (issue 19.9)."""

from __future__ import annotations

from pathlib import Path

from .cli_helpers import job_line, read_results, run_cli, write_jobs


def test_batch_on_the_embedded_fixture_says_so_first_and_in_the_summary(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(3)])
    out = tmp_path / "results.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "embedded fixture" in lines[0] and "not a model" in lines[0]
    assert "embedded fixture" in lines[-1]  # the summary ends with it
    assert len(read_results(out)) == 3


def test_batch_on_a_real_endpoint_prints_no_fixture_notice(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0)])
    proc = run_cli(
        "batch", str(jobs), "--out", str(tmp_path / "r.jsonl"),
        "--endpoint", "http://127.0.0.1:9/v1",
    )
    assert proc.returncode == 2  # no API key in the environment: a usage error, nothing sent
    assert "fixture" not in proc.stdout
