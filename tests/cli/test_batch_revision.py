"""``recoverable batch`` with a newer revision of a job (issue 16): the older revision's
operation is superseded instead of leaving both. Real processes, real store."""

from __future__ import annotations

from pathlib import Path

import pytest

import recoverable
from recoverable.cli.provider import FIXTURE_ACCOUNT
from recoverable.records import AttemptRecord, OperationRecord

from .cli_helpers import assert_exactly_once, job_line, read_results, run_cli, write_jobs


def _stat(stdout: str, name: str) -> str:
    for line in stdout.splitlines():
        if line.startswith(name + "  ") or line.startswith(name + " "):
            return line[len(name):].strip()
    raise AssertionError(f"{name!r} not in the summary:\n{stdout}")


def test_a_newer_revision_line_supersedes_an_older_line_of_the_same_id(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [
        job_line(1, revision="r1"), job_line(2), job_line(1, revision="r2"),
    ])
    out = tmp_path / "out.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "jobs.jsonl:1: superseded by line 3 (a newer revision of the same id)" in proc.stderr
    assert_exactly_once(read_results(out), {("gen-0001", "r2"), ("gen-0002", "r1")})
    assert _stat(proc.stdout, "superseded (newer revision)") == "1"
    assert _stat(proc.stdout, "jobs") == "2"  # the superseded line is not a job of the run
    assert _stat(proc.stdout, "failed") == "0"


def _older(op_id: str, revision: str, **changes: object) -> OperationRecord:
    fields: dict[str, object] = {
        "operation_id": op_id, "account": FIXTURE_ACCOUNT, "endpoint_id": "fixture",
        "created_at": 1.0, "maximum_attempts": 3, "model": "gpt-test",
        "format_name": "label", "format_hash": "fh", "body_hash": "bh",
        "root_operation_id": op_id, "scope": "batch", "job_id": "gen-0001",
        "input_revision": revision,
    }
    fields.update(changes)
    return OperationRecord(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "workers"])
def test_a_newer_revision_supersedes_older_operations_of_earlier_runs(
    tmp_path: Path, workers: int
) -> None:
    """An earlier run left the job's revision r0 with a saved, unacknowledged receipt (it
    died before writing the line) and r1 prepared; a run with r2 supersedes both (in one
    transaction per job), runs r2, and leaves a failed older revision alone."""
    store_dir = tmp_path / "out.jsonl.store"
    attempt = AttemptRecord("op-r0.1", 1, "initial", 2.0, outcome="completed")
    with recoverable.RecoveryStore.open(str(store_dir)) as store:
        store.write_sync(lambda txn: (
            txn.put_operation(_older("op-r0", "r0", phase="completed", attempts_used=1,
                                     attempts=(attempt,), completed_at=3.0)),
            txn.put_payload("op-r0", "completion", b'{"label": "old"}'),
            txn.put_operation(_older("op-r1", "r1")),
            txn.put_operation(_older("op-rx", "rx", phase="failed",
                                     failure_reason="exhausted")),
        ))
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(1, revision="r2")])
    out = tmp_path / "out.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out), "--workers", str(workers))
    assert proc.returncode == 0, proc.stderr
    assert_exactly_once(read_results(out), {("gen-0001", "r2")})
    assert _stat(proc.stdout, "superseded (newer revision)") == "2"
    for op_id in ("op-r0", "op-r1"):
        assert f"operation {op_id} of an older revision superseded by revision 'r2'" in (
            proc.stderr
        )
    with recoverable.RecoveryStore.open(str(store_dir)) as store:
        for op_id in ("op-r0", "op-r1"):
            record = store.get_operation(op_id)
            assert record is not None
            assert (record.phase, record.superseded_reason) == ("superseded", "newer_revision")
        assert store.get_payload("op-r0", "completion") is None  # never written out
        failed = store.get_operation("op-rx")
        assert failed is not None and failed.phase == "failed"  # no result to protect
    again = run_cli("batch", str(jobs), "--out", str(out), "--workers", str(workers))
    assert again.returncode == 0, again.stderr
    assert _stat(again.stdout, "superseded (newer revision)") == "0"
    assert_exactly_once(read_results(out), {("gen-0001", "r2")})
