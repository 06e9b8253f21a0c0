"""Every option of ``recoverable batch`` means the same with and without workers.

Each case runs the same jobs with the same options twice, as real processes: in the
batch process (``--workers 0``) and in one worker process (``--workers 1``), against the
embedded fixture with faults at rate 0 or 1 (so the outcome does not depend on the order
of the POSTs). The exit code, the summary's counts, the lines of ``--out`` and
``--errors`` (without their operation ids) and what each operation was saved with must
be the same both ways. The probe that filed this found ``--on-interruption fail``
ignored by workers (``failed 0, POSTs 88`` against ``failed 20, POSTs 60``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

import recoverable

from .cli_helpers import job_line, run_cli, write_jobs

JOBS = 3
OPERATION_ID = re.compile(r"op_[0-9a-f]{32}")
# (extra options, expected exit code): the outcome must also not be vacuous.
CASES: dict[str, tuple[list[str], int]] = {
    "on-interruption-fail": (
        ["--faults", "disconnect=1.0", "--max-attempts", "4", "--on-interruption", "fail"], 1,
    ),
    "max-attempts": (["--faults", "disconnect=1.0", "--max-attempts", "2"], 1),
    "retry-provider-codes-none": (
        ["--faults", "failed=1.0", "--max-attempts", "3", "--retry-provider-codes", ""], 1,
    ),
    "retry-provider-codes-default": (["--faults", "failed=1.0", "--max-attempts", "2"], 1),
    "output-format-and-errors": (["--output-format", "openai-batch", "--backoff", "0.01"], 0),
    "idle-timeout": (["--faults", "stall=1.0", "--idle-timeout", "0.3", "--max-attempts", "1"], 1),
}
SUMMARY_ROWS = (
    "committed (this run)", "failed", "unfinished", "operations prepared",
    "POSTs (attempts spent)",
)


def _summary(stdout: str) -> dict[str, str]:
    rows: dict[str, str] = {}
    for line in stdout.splitlines():
        for name in SUMMARY_ROWS:
            if line.startswith(name + " "):
                rows[name] = line[len(name):].strip()
        if line.startswith("  ") and not line.startswith("   "):  # a failure reason row
            reason, _, count = line.strip().rpartition(" ")
            rows["failed " + reason.strip()] = count
    return rows


def _without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            key: _without_ids(item) for key, item in value.items()
            if key not in ("operation_id", "id", "created_at", "completed_at", "hint")
        }
    if isinstance(value, list):
        return [_without_ids(item) for item in value]
    if isinstance(value, str):
        return OPERATION_ID.sub("op_…", value)
    return value


def _lines(path: Path) -> list[Any]:
    if not path.exists():
        return []
    return sorted(
        (_without_ids(json.loads(line)) for line in path.read_text().splitlines()),
        key=lambda line: json.dumps(line, sort_keys=True),
    )


def _saved_with(store_path: Path) -> list[tuple[Any, ...]]:
    with recoverable.RecoveryStore.open(str(store_path)) as store:
        records, unreadable = store.inventory()
    assert unreadable == []
    return sorted(
        (record.job_id, record.on_interruption, record.maximum_attempts,
         record.retry_policy, record.phase, record.failure_reason, record.attempts_used)
        for record in records
    )


def _run(tmp_path: Path, workers: int, options: list[str]) -> dict[str, Any]:
    folder = tmp_path / f"workers-{workers}"
    folder.mkdir()
    jobs = write_jobs(folder / "jobs.jsonl", [job_line(i) for i in range(JOBS)])
    out, errors = folder / "out.jsonl", folder / "errors.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out), "--errors", str(errors),
                   "--workers", str(workers), *options)
    return {
        "exit code": proc.returncode,
        "summary": _summary(proc.stdout),
        "out": _lines(out),
        "errors": _lines(errors),
        "saved with": _saved_with(Path(str(out) + ".store")),
        "stderr": proc.stderr,
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_option_means_the_same_with_and_without_workers(tmp_path: Path, case: str) -> None:
    options, expected_exit = CASES[case]
    here = _run(tmp_path, 0, options)
    workers = _run(tmp_path, 1, options)
    assert here["exit code"] == expected_exit, here["stderr"]
    for part in ("exit code", "summary", "out", "errors", "saved with"):
        assert workers[part] == here[part], (part, here["stderr"], workers["stderr"])
