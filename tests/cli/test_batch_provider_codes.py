"""Issue 10.5: the batch CLI opts in to replacing provider codes explicitly (the library
default replaces none): shown in its summary, overridable with ``--retry-provider-codes``."""

from __future__ import annotations

import json
from pathlib import Path

from .cli_helpers import job_line, run_cli, write_jobs


def _stat(summary: str, name: str) -> str:
    for line in summary.splitlines():
        if line.startswith(name + "  "):
            return line[len(name):].strip()
    raise AssertionError(f"{name!r} not in the summary:\n{summary}")


def test_default_opt_in_is_shown_and_replaces_response_failed(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(2)])
    out = tmp_path / "out.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out), "--faults", "failed=1.0",
                   "--max-attempts", "2")
    assert proc.returncode == 1, proc.stderr
    assert _stat(proc.stdout, "replaced provider codes") == (
        "rate_limit_exceeded, server_error, server_is_overloaded, slow_down")
    # server_error is allowed by the batch: each job spends its whole budget of 2.
    assert _stat(proc.stdout, "POSTs (attempts spent)") == "4"
    assert "attempts_exhausted" in proc.stdout


def test_empty_flag_disables_the_opt_in(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(2)])
    out = tmp_path / "out.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out), "--faults", "failed=1.0",
                   "--max-attempts", "2", "--retry-provider-codes", "")
    assert proc.returncode == 1, proc.stderr
    assert _stat(proc.stdout, "replaced provider codes") == "none"
    assert _stat(proc.stdout, "POSTs (attempts spent)") == "2"  # terminal at once
    assert "provider_error:provider_failed" in proc.stdout


def test_custom_codes_and_a_bad_code(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0)])
    out = tmp_path / "out.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out), "--retry-provider-codes",
                   "slow_down, server_is_overloaded")
    assert proc.returncode == 0, proc.stderr
    assert _stat(proc.stdout, "replaced provider codes") == "server_is_overloaded, slow_down"
    bad = run_cli("batch", str(jobs), "--out", str(out), "--retry-provider-codes", "a b")
    assert bad.returncode == 2
    assert "not a provider code" in bad.stderr


def test_a_failed_jobs_reason_is_the_same_label_on_a_rerun(tmp_path: Path) -> None:
    """The run that saw the provider's failure raised ProviderError, the rerun reads the
    saved failure (PermanentlyFailed): one label, printed and in the errors file."""
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0)])
    out, errors_file = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    reasons, codes = [], []
    for _ in range(2):
        proc = run_cli("batch", str(jobs), "--out", str(out), "--faults", "failed=1.0",
                       "--retry-provider-codes", "", "--errors", str(errors_file))
        assert proc.returncode == 1, proc.stderr
        assert "provider_error:provider_failed" in proc.stdout
        assert "permanently_failed" not in proc.stdout
        (line,) = [json.loads(text) for text in errors_file.read_text().splitlines()]
        reasons.append(line["reason"])
        codes.append(line["code"])
    assert reasons == ["provider_error:provider_failed"] * 2
    assert codes == ["provider_error", "permanently_failed"]  # the class may differ
