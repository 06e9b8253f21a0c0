"""``recoverable batch`` prepares and acquires a new job's operation in one store write.

The batch keeps no handle of its own (it finds a job's operation by the job's key), so
nothing observes a prepared operation apart from its first acquisition: the operation,
its lease and its opening transition (the pending attempt id) are one write
(``actors/prepare_send.py``). These tests run the crash table's boundaries on that path
with real processes (the batch SIGKILLed at a kill point, then rerun against the same
provider process, which logs every POST), and the race in which another process
prepares the same job first.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

import recoverable
from recoverable.actors import fenced
from recoverable.actors.fenced import JobAdopted
from recoverable.cli import main as cli_main
from recoverable.cli.host import BatchHost
from recoverable.cli.provider import FIXTURE_ACCOUNT
from recoverable.storage import writer as store_writer
from recoverable.testing import FixtureProvider
from recoverable.types import StructuredRequest

from .cli_helpers import assert_exactly_once, job_line, read_results, run_cli, write_jobs
from .test_endpoint_cli import summary_of
from .test_worker_cli import start_provider, stop

JOBS = 5
KEY = {"BATCH_FOLD_KEY": "sk-batch-fold"}

# kill point (hit by the third job; --concurrency 1: the first two are committed, nothing
# else is in flight) -> (POSTs the provider saw over both runs, attempts spent by the
# third job), the crash table's FIRST rows (tests/crash/test_kill_points.py).
POINTS = {
    "prepare.before_save@3": (JOBS, 1),  # nothing saved: prepared afresh by the rerun
    "prepare.saved@3": (JOBS, 1),  # created, leased, pending: adopted, sent once
    "attempt.pending_saved@3": (JOBS, 1),  # reserved, never consumed: not spent
    "attempt.consumed_saved@3": (JOBS, 2),  # spent without a POST: stays spent
    "stream.completed_unreceived@3": (JOBS + 1, 2),  # generated, lost, replaced
    "receipt.saved@3": (JOBS, 1),  # the saved receipt is committed: no new POST
}


def _operations(store_dir: Path) -> dict[str, tuple[str, int]]:
    """job id -> (operation id, attempts used) of the store's live batch operations."""
    with recoverable.RecoveryStore.open(str(store_dir)) as store:
        records, unreadable = store.inventory(scope="batch")
    assert unreadable == []
    return {r.job_id: (r.operation_id, r.attempts_used) for r in records if r.job_id}


@pytest.mark.parametrize("point", list(POINTS))
def test_a_kill_on_the_folded_path_then_the_rerun_sends_each_job_as_the_table_says(
    tmp_path: Path, point: str
) -> None:
    posts, spent = POINTS[point]
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(JOBS)])
    out, store_dir = tmp_path / "out.jsonl", tmp_path / "store"
    provider, info = start_provider()
    try:
        args = ("batch", str(jobs), "--out", str(out), "--store", str(store_dir),
                "--endpoint", info["http_url"], "--api-key-env", "BATCH_FOLD_KEY",
                "--account", "batch", "--concurrency", "1")
        killed = run_cli(*args, env={**KEY, "RECOVERABLE_KILL_AT": point})
        assert killed.returncode == -9, killed.stderr
        left = _operations(store_dir)
        rerun = run_cli(*args, env=KEY)
        sent = httpx.get(info["requests_url"], timeout=30).json()
    finally:
        stop(provider)
    assert rerun.returncode == 0, rerun.stderr
    results = read_results(out)
    assert_exactly_once(results, {(f"gen-{i:04d}", "r1") for i in range(JOBS)})
    assert len(sent) == posts, [r.get("attempt_id") for r in sent]
    third = next(r for r in results if r["id"] == "gen-0002")
    if point != "prepare.before_save@3":
        # The operation the killed run's one write created is the one committed.
        assert third["operation_id"] == left["gen-0002"][0]
        summary = summary_of(rerun.stdout)
        assert summary["operations prepared"] == str(JOBS - 3)
    else:
        assert "gen-0002" not in left  # nothing of it was saved
    with recoverable.RecoveryStore.open(str(store_dir)) as store:
        marker = store.get_disposition(third["operation_id"])
    assert marker is not None and marker.attempts_used == spent


def test_every_new_job_is_prepared_by_its_first_acquisition(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One write creates, leases and opens each job's operation: no separate
    ``create_operation`` write; each job's writes are that acquisition, the consumed
    attempt, and the receipt with the lease's release (acknowledgements go in groups)."""
    counts: Counter[str] = Counter()
    original = store_writer.Writer.write

    async def write(self: Any, fn: Any, touches: Any = ()) -> Any:
        if isinstance(fn, fenced.Acquisition):
            counts["acquisition+create" if fn.create is not None else "acquisition"] += 1
        elif isinstance(fn, fenced.FencedWrite):
            counts[fn.transition.record.phase] += 1
        elif isinstance(fn, functools.partial):
            counts[fn.func.__name__] += 1
        return await original(self, fn, touches)

    monkeypatch.setattr(store_writer.Writer, "write", write)
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(JOBS)])
    code = cli_main(["batch", str(jobs), "--out", str(tmp_path / "out.jsonl"),
                     "--concurrency", "1"])
    assert code == 0
    assert counts["acquisition+create"] == JOBS
    assert counts["create_operation"] == 0 and counts["acquisition"] == 0
    assert counts["transmitting"] == counts["completed"] == JOBS


async def test_a_job_prepared_elsewhere_meanwhile_is_adopted_with_nothing_written(
    tmp_path: Path,
) -> None:
    """Another process prepared the job between the batch's lookup and its first write:
    the write creates nothing and takes no lease (``JobAdopted`` names that operation)."""
    request = StructuredRequest(model="gpt-test", input="six times seven?")
    schema = recoverable.JsonSchema("n", {
        "type": "object", "properties": {"n": {"type": "integer"}},
        "required": ["n"], "additionalProperties": False,
    })
    job = {"maximum_attempts": 3, "scope": "batch", "job_id": "j-1", "input_revision": "r1"}
    async with FixtureProvider.serve() as provider:
        backend = recoverable.ResponsesBackend(
            provider.http_url, credentials=recoverable.StaticCredentials(
                "sk-fold", account=FIXTURE_ACCOUNT),
        )
        with recoverable.RecoveryStore.open(str(tmp_path / "store")) as store:
            async with backend, recoverable.open_runtime(
                store, backend, account=FIXTURE_ACCOUNT
            ) as rt:
                admission = rt.admit(request, response=schema, **job)
                other = await rt.prepare(request, response=schema, **job)
                with pytest.raises(JobAdopted) as adopted:
                    await rt.send_admitted(admission, response=schema,
                                           authorize=lambda attempt: True)
                assert adopted.value.operation_id == other.operation_id
                assert store.get_operation(admission.handle.operation_id) is None
                assert store.get_lease(other.operation_id) is None
                assert store.get_operation(other.operation_id).phase == "prepared"
        assert provider.requests == []


def test_the_batch_sends_the_operation_another_run_prepared_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The race, end to end: a job's operation exists (a run killed right after its one
    write made it) but this run's lookup missed it (another process's write landing
    between the lookup and this run's own): the batch adopts it, sends it once, and
    commits it under its own id; nothing of the admitted one is written."""
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(JOBS)])
    out, store_dir = tmp_path / "out.jsonl", tmp_path / "store"
    args = ["batch", str(jobs), "--out", str(out), "--store", str(store_dir),
            "--concurrency", "1"]
    killed = run_cli(*args, env={"RECOVERABLE_KILL_AT": "prepare.saved@1"})
    assert killed.returncode == -9, killed.stderr
    (first_id, _), = _operations(store_dir).values()
    async def finds_nothing(self: BatchHost, job: object) -> None:
        return None

    monkeypatch.setattr(BatchHost, "find_existing", finds_nothing)
    assert cli_main(args) == 0
    summary = summary_of(capsys.readouterr().out)
    assert summary["operations prepared"] == str(JOBS - 1)
    assert summary["operations resumed"] == "1"
    assert summary["POSTs (attempts spent)"] == str(JOBS)
    results = read_results(out)
    assert_exactly_once(results, {(f"gen-{i:04d}", "r1") for i in range(JOBS)})
    assert next(r for r in results if r["id"] == "gen-0000")["operation_id"] == first_id


def test_a_committed_job_reads_its_record_once_after_its_send(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a job's send, one read of its record both says where its continuation lineage
    goes and counts its tokens (a read is a round trip on the event loop for PostgreSQL):
    it was two, the same record read twice."""
    reads: Counter[str] = Counter()
    original = recoverable.RecoveryStore.get_operation

    def get_operation(self: recoverable.RecoveryStore, operation_id: str) -> Any:
        reads[operation_id] += 1
        return original(self, operation_id)

    monkeypatch.setattr(recoverable.RecoveryStore, "get_operation", get_operation)
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(JOBS)])
    code = cli_main(["batch", str(jobs), "--out", str(tmp_path / "out.jsonl"),
                     "--store", str(tmp_path / "store"), "--concurrency", "4"])
    assert code == 0
    assert len(reads) == JOBS and set(reads.values()) == {1}, reads
