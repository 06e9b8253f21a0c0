"""``recoverable batch`` as a real process: faults, Ctrl-C, SIGKILL, bad lines, reruns."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

import recoverable
from recoverable.cli.provider import FIXTURE_ACCOUNT

from .cli_helpers import (
    EXAMPLE,
    assert_exactly_once,
    job_line,
    read_results,
    run_cli,
    start_cli,
    wait_for_lines,
    write_jobs,
)


def _example_keys() -> set[tuple[str, str]]:
    lines = [json.loads(line) for line in EXAMPLE.read_text().splitlines() if line.strip()]
    return {(j["id"], j["revision"]) for j in lines}


def _store_snapshot(store_dir: Path) -> dict[tuple[str, str], tuple[str, bool, int]]:
    """(job, revision) -> (operation id, has saved completion, attempts used) of live records."""
    store = recoverable.RecoveryStore.open(str(store_dir))
    try:
        records, unreadable = store.inventory(account=FIXTURE_ACCOUNT, scope="batch")
        assert unreadable == []
        snapshot = {}
        for r in records:
            assert r.job_id is not None and r.input_revision is not None
            snapshot[(r.job_id, r.input_revision)] = (
                r.operation_id, r.has_completion, r.attempts_used
            )
        return snapshot
    finally:
        store.close()


def _dispositions(store_dir: Path, op_ids: list[str]) -> dict[str, tuple[str, int] | None]:
    store = recoverable.RecoveryStore.open(str(store_dir))
    try:
        out: dict[str, tuple[str, int] | None] = {}
        for op_id in op_ids:
            d = store.get_disposition(op_id)
            out[op_id] = None if d is None else (d.disposition, d.attempts_used)
        return out
    finally:
        store.close()


def test_bundled_example_commits_every_job_exactly_once_under_faults(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    proc = run_cli(
        "batch", str(EXAMPLE), "--out", str(out), "--backoff", "0.05",
        "--faults", "disconnect=0.2,rate_limited=0.1,seed=3",
    )
    assert proc.returncode == 0, proc.stderr
    results = read_results(out)
    assert_exactly_once(results, _example_keys())
    assert all(isinstance(r["result"], dict) and r["operation_id"].startswith("op_")
               for r in results)
    assert "POSTs (attempts spent)" in proc.stdout
    # Every committed operation was acknowledged after its line was written.
    marks = _dispositions(Path(str(out) + ".store"), [r["operation_id"] for r in results])
    assert all(m is not None and m[0] == "acknowledged" for m in marks.values())
    assert _store_snapshot(Path(str(out) + ".store")) == {}

    # A rerun writes nothing and sends nothing.
    before = out.read_bytes()
    again = run_cli("batch", str(EXAMPLE), "--out", str(out), "--mode", "sse")
    assert again.returncode == 0, again.stderr
    assert out.read_bytes() == before
    assert _stat(again.stdout, "POSTs (attempts spent)") == "0"
    assert _stat(again.stdout, "committed (earlier runs)") == str(len(results))


def _stat(summary: str, name: str) -> str:
    for line in summary.splitlines():
        if line.startswith(name):
            return line[len(name):].strip()
    raise AssertionError(f"{name!r} not in the summary:\n{summary}")


def _interrupted_then_rerun(tmp_path: Path, sig: signal.Signals) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(200)])
    keys = {(f"gen-{i:04d}", "r1") for i in range(200)}
    out = tmp_path / "out.jsonl"
    store_dir = tmp_path / "store"
    args = ("batch", str(jobs), "--out", str(out), "--store", str(store_dir),
            "--rps", "60", "--backoff", "0.05", "--faults", "disconnect=0.1,seed=5")
    proc = start_cli(*args)
    try:
        wait_for_lines(out, 25, proc)
        proc.send_signal(sig)
        _stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == signal.SIGINT:
        assert proc.returncode == 130, stderr
        assert "interrupted" in stderr
    else:
        assert proc.returncode == -signal.SIGKILL
    first = read_results(out)
    assert 25 <= len(first) < 200
    assert_exactly_once(first, {(r["id"], r["revision"]) for r in first})

    before = _store_snapshot(store_dir)
    saved = {k: v for k, v in before.items() if v[1]}
    if sig == signal.SIGINT:
        # Cancellation suspended every running operation: none is left in flight.
        store = recoverable.RecoveryStore.open(str(store_dir))
        try:
            phases = {store.get_operation(v[0]).phase for v in before.values()}  # type: ignore[union-attr]
        finally:
            store.close()
        assert not phases & {"authorizing", "transmitting"}, phases

    rerun = run_cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    results = read_results(out)
    assert_exactly_once(results, keys)
    assert results[: len(first)] == first  # earlier lines untouched, nothing rewritten
    by_key = {(r["id"], r["revision"]): r["operation_id"] for r in results}
    # Operations prepared before the interruption were resumed, never prepared again ...
    for key, (op_id, _, _) in before.items():
        assert by_key[key] == op_id
    # ... and those whose receipt was saved spent no new attempt.
    marks = _dispositions(store_dir, [v[0] for v in saved.values()])
    for op_id, _, attempts in saved.values():
        assert marks[op_id] == ("acknowledged", attempts)
    assert _store_snapshot(store_dir) == {}


def test_ctrl_c_suspends_and_a_rerun_finishes_each_job_exactly_once(tmp_path: Path) -> None:
    _interrupted_then_rerun(tmp_path, signal.SIGINT)


def test_sigkill_mid_batch_and_rerun_finishes_each_job_exactly_once(tmp_path: Path) -> None:
    _interrupted_then_rerun(tmp_path, signal.SIGKILL)


@pytest.mark.parametrize("kill_at", ["receipt.saved@15", "host.committed@15"])
def test_death_between_receipt_and_acknowledgement_generates_nothing_again(
    tmp_path: Path, kill_at: str
) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(40)])
    keys = {(f"gen-{i:04d}", "r1") for i in range(40)}
    out = tmp_path / "out.jsonl"
    store_dir = tmp_path / "store"
    args = ("batch", str(jobs), "--out", str(out), "--store", str(store_dir), "--concurrency", "8")
    killed = run_cli(*args, env={"RECOVERABLE_KILL_AT": kill_at})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    first = read_results(out)
    before = _store_snapshot(store_dir)
    saved = {k: v for k, v in before.items() if v[1]}
    assert saved, "the kill point leaves at least one saved, unacknowledged receipt"
    committed_unacknowledged = [k for k in saved if k in {(r["id"], r["revision"]) for r in first}]
    if kill_at.startswith("host.committed"):
        assert committed_unacknowledged
    rerun = run_cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    results = read_results(out)
    assert_exactly_once(results, keys)
    assert results[: len(first)] == first
    by_key = {(r["id"], r["revision"]): r["operation_id"] for r in results}
    marks = _dispositions(store_dir, [v[0] for v in saved.values()])
    for key, (op_id, _, attempts) in saved.items():
        assert by_key[key] == op_id
        assert marks[op_id] == ("acknowledged", attempts)
    assert _stat(rerun.stdout, "acknowledged late") == str(len(committed_unacknowledged))


def test_bad_lines_are_reported_with_line_numbers_and_skipped(tmp_path: Path) -> None:
    loose = dict(job_line(5))
    loose["schema"] = {"type": "object", "properties": {"x": {"type": "string"}}}
    lines: list[object] = [
        job_line(1),
        "{not json",
        {**job_line(3), "surprise": 1},
        "",
        loose,
        job_line(1),  # duplicate (id, revision) of line 1: run once
        job_line(1, revision="r2"),  # a newer revision: supersedes line 1 (issue 16)
        {**job_line(8), "max_attempts": 0},
        "x" * (2**20 + 10),
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)  # type: ignore[arg-type]
    out = tmp_path / "out.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out))
    assert proc.returncode == 1, proc.stderr
    for lineno in (2, 3, 5, 8, 9):
        assert f"jobs.jsonl:{lineno}: skipped" in proc.stderr
    assert "jobs.jsonl:6: duplicate of line 1" in proc.stderr
    assert "jobs.jsonl:4" not in proc.stderr  # a blank line is not an error
    assert "additionalProperties" in proc.stderr
    # Issue 16 changed this on purpose: a newer revision of an id supersedes the older
    # line instead of running both.
    assert "jobs.jsonl:1: superseded by line 7" in proc.stderr
    assert_exactly_once(read_results(out), {("gen-0001", "r2")})
    assert _stat(proc.stdout, "skipped lines") == "5"


def test_a_job_the_provider_answers_invalidly_fails_with_exit_1(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(3)])
    out = tmp_path / "out.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out), "--faults", "schema_violation=1.0")
    assert proc.returncode == 1
    assert read_results(out) == []
    assert _stat(proc.stdout, "failed") == "3"
    assert ":invalid_output:schema_violation  3" in proc.stdout
    assert "(line 1) failed" in proc.stderr
    # Failed operations are kept (not acknowledged) and a rerun spends nothing on them.
    again = run_cli("batch", str(jobs), "--out", str(out))
    assert again.returncode == 1
    assert _stat(again.stdout, "POSTs (attempts spent)") == "0"
    assert _stat(again.stdout, "operations resumed") == "3"
    # New content under the same revision is refused, never mixed with the saved operation.
    changed = write_jobs(tmp_path / "jobs.jsonl",
                         [job_line(0, input="different text"), job_line(1), job_line(2)])
    third = run_cli("batch", str(changed), "--out", str(out))
    assert third.returncode == 1
    assert _stat(third.stdout, "  revision_conflict") == "1"
    assert "(line 1) failed: revision_conflict" in third.stderr


def test_usage_and_input_file_errors_exit_2(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    missing = run_cli("batch", str(tmp_path / "nope.jsonl"), "--out", str(out))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    bad_faults = run_cli("batch", str(EXAMPLE), "--out", str(out), "--faults", "meteor=1")
    assert bad_faults.returncode == 2 and "unknown fault" in bad_faults.stderr
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"something": "else"}\n')
    not_a_log = run_cli("batch", str(EXAMPLE), "--out", str(foreign))
    assert not_a_log.returncode == 2 and "not a line written by recoverable batch" in (
        not_a_log.stderr)
    no_key = run_cli("batch", str(EXAMPLE), "--out", str(out), "--endpoint",
                     "http://127.0.0.1:9/v1", "--api-key-env", "RECOVERABLE_TEST_UNSET_KEY")
    assert no_key.returncode == 2 and "RECOVERABLE_TEST_UNSET_KEY" in no_key.stderr
