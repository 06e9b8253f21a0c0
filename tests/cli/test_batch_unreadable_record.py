"""A job whose operation record cannot be read is reported and never generated again.

The probe: save a receipt without acknowledging it (the batch is killed right after the
save), flip one byte in the middle of that operation's record, rerun the batch. It
exited 0, printed "operations prepared 1 ... POSTs 1" and never mentioned the damage: the
job was prepared and generated a second time. Now the job is reported (``corrupt_record``,
counted as unfinished, exit 1, a line in ``--errors``), nothing is prepared or sent for it,
on both stores, with and without workers, until an operator decides: ``recoverable
abandon`` of the unreadable operation is the documented repair, after which a rerun
prepares the job anew.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

import recoverable
from recoverable.storage.keys import operation_key

from .cli_helpers import child_env, job_line, read_results, run_cli, write_jobs

ACCOUNT = "batch"  # the fixture batch's account


def _stat(stdout: str, name: str) -> str:
    for line in stdout.splitlines():
        if line.startswith(name + " "):
            return line[len(name):].strip()
    raise AssertionError(f"no {name!r} in:\n{stdout}")


def _flip_middle_byte(store_path: str, operation_id: str) -> None:
    async def flip() -> None:
        with recoverable.RecoveryStore.open(store_path) as store:
            key = operation_key(operation_id)
            raw = store.get_raw("operations", key)
            assert raw is not None
            damaged = bytearray(raw)
            damaged[len(damaged) // 2] ^= 0xFF
            await store.write(lambda txn: txn.put_raw("operations", key, bytes(damaged)))

    trio.run(flip)


def _saved_unacknowledged(tmp_path: Path, store: str) -> tuple[Path, Path, str]:
    """Two jobs; the batch is killed right after the second receipt was saved, before
    its line: one committed job, one saved, unacknowledged receipt (its operation id)."""
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0), job_line(1)])
    out = tmp_path / "out.jsonl"
    killed = run_cli("batch", str(jobs), "--out", str(out), "--store", store,
                     "--concurrency", "1", env={**child_env(),
                                                "RECOVERABLE_KILL_AT": "receipt.saved@2"})
    assert killed.returncode == -9, killed.stderr
    assert [line["id"] for line in read_results(out)] == ["gen-0000"]
    with recoverable.RecoveryStore.open(store) as opened:
        records, unreadable = opened.inventory()
    assert unreadable == []
    (pending,) = [record for record in records if record.has_completion]
    assert pending.job_id == "gen-0001"
    return jobs, out, pending.operation_id


def _assert_reported_not_run(
    proc: object, out: Path, errors: Path, operation_id: str
) -> None:
    assert proc.returncode == 1, proc.stderr  # type: ignore[attr-defined]
    stdout: str = proc.stdout  # type: ignore[attr-defined]
    stderr: str = proc.stderr  # type: ignore[attr-defined]
    assert _stat(stdout, "unfinished") == "1"
    assert _stat(stdout, "operations prepared") == "0"
    assert _stat(stdout, "POSTs (attempts spent)") == "0"
    assert f"its operation {operation_id} cannot be read (corrupt_record)" in stderr
    assert "recoverable abandon" in stderr
    assert [line["id"] for line in read_results(out)] == ["gen-0000"]
    (line,) = [json.loads(text) for text in errors.read_text().splitlines()]
    assert (line["id"], line["code"], line["operation_id"]) == (
        "gen-0001", "corrupt_record", operation_id,
    )


@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_corrupt_record_is_reported_and_never_generated_again_lmdb(
    tmp_path: Path, workers: str
) -> None:
    store = str(tmp_path / "store")
    jobs, out, operation_id = _saved_unacknowledged(tmp_path, store)
    _flip_middle_byte(store, operation_id)
    errors = tmp_path / "errors.jsonl"
    for _ in range(2):  # and again: a rerun does not decide for the operator either
        rerun = run_cli("batch", str(jobs), "--out", str(out), "--store", store,
                        "--workers", workers, "--errors", str(errors))
        _assert_reported_not_run(rerun, out, errors, operation_id)
    with recoverable.RecoveryStore.open(store) as opened:
        assert opened.inventory()[1] == [operation_id]  # left untouched


def test_a_corrupt_record_is_reported_and_never_generated_again_postgresql(
    tmp_path: Path, pg_url: str
) -> None:
    jobs, out, operation_id = _saved_unacknowledged(tmp_path, pg_url)
    _flip_middle_byte(pg_url, operation_id)
    errors = tmp_path / "errors.jsonl"
    rerun = run_cli("batch", str(jobs), "--out", str(out), "--store", pg_url,
                    "--workers", "1", "--errors", str(errors))
    _assert_reported_not_run(rerun, out, errors, operation_id)


def test_abandoning_the_unreadable_operation_is_the_repair(tmp_path: Path) -> None:
    """``status`` suggests abandon; ``abandon`` removes what cannot be read (the account's
    job index proves whose it is) and leaves a marker; the next run prepares the job
    anew, once."""
    store = str(tmp_path / "store")
    jobs, out, operation_id = _saved_unacknowledged(tmp_path, store)
    _flip_middle_byte(store, operation_id)
    status = run_cli("status", "--store", store, "--account", ACCOUNT, operation_id)
    assert "incompatible_record" in status.stdout and "abandon" in status.stdout
    other = run_cli("abandon", "--store", store, "--account", "someone-else", operation_id)
    assert other.returncode == 1 and "account_changed" in other.stderr
    acknowledged = run_cli("acknowledge", "--store", store, "--account", ACCOUNT, operation_id)
    assert acknowledged.returncode == 1 and "corrupt_record" in acknowledged.stderr
    abandoned = run_cli("abandon", "--store", store, "--account", ACCOUNT, operation_id)
    assert abandoned.returncode == 0, abandoned.stderr
    with recoverable.RecoveryStore.open(store) as opened:
        assert opened.inventory()[1] == []
        assert opened.check_integrity() == []
        marker = opened.get_disposition(operation_id)
        assert marker is not None and marker.disposition == "abandoned"
    rerun = run_cli("batch", str(jobs), "--out", str(out), "--store", store)
    assert rerun.returncode == 0, rerun.stderr
    assert _stat(rerun.stdout, "operations prepared") == "1"
    assert _stat(rerun.stdout, "POSTs (attempts spent)") == "1"
    assert sorted(line["id"] for line in read_results(out)) == ["gen-0000", "gen-0001"]
