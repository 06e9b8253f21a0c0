"""Issue 11, the batch side: an unfriendly but realistic user, as real processes.

Output files that were never result logs, torn and unterminated tails, content changed
under the same revision, one job that breaks in an unexpected way, a broken, full or
closed stdout, jobs run by another process, and the rough edges of the command line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb
import pytest

import recoverable
from recoverable.cli import main

from .cli_helpers import (
    EXAMPLE,
    REPO,
    assert_exactly_once,
    child_env,
    cli_command,
    job_line,
    read_results,
    run_cli,
    write_jobs,
)

ACCOUNT = ("--account", "batch")
MAXIMUM_RETRY_AFTER = 600.0  # the bound docs/cli.md documents


def _stat(summary: str, name: str) -> str:
    for line in summary.splitlines():
        if line.startswith(name):
            return line[len(name):].strip()
    raise AssertionError(f"{name!r} not in the summary:\n{summary}")


def _keys(n: int) -> set[tuple[str, str]]:
    return {(f"gen-{i:04d}", "r1") for i in range(n)}


# -- 11.1: the output file -------------------------------------------------------------------


def test_an_output_file_that_is_not_a_result_log_is_refused_never_truncated(
    tmp_path: Path,
) -> None:
    first_job = EXAMPLE.read_text().splitlines()[0]
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(first_job + "\n")
    # A copy of a job line without its newline: a complete JSON line, not a result line.
    same = tmp_path / "same.jsonl"
    same.write_bytes(first_job.encode())
    proc = run_cli("batch", str(jobs), "--out", str(same))
    assert proc.returncode == 2, proc.stderr
    assert "not a file written by recoverable batch" in proc.stderr
    assert same.read_bytes() == first_job.encode()  # untouched
    # Any other last line that is not the torn beginning of a result line: refused too.
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"my notes\nmore notes")
    assert run_cli("batch", str(jobs), "--out", str(notes)).returncode == 2
    assert notes.read_bytes() == b"my notes\nmore notes"
    assert not (tmp_path / "same.jsonl.store").exists()  # refused before anything ran


def test_the_jobs_file_itself_is_refused_as_output(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.jsonl"
    # Without a trailing newline: the old code cut it as a "torn tail" and replaced it.
    jobs.write_bytes(json.dumps(job_line(1)).encode())
    before = jobs.read_bytes()
    proc = run_cli("batch", str(jobs), "--out", str(jobs))
    assert proc.returncode == 2 and "is the jobs file itself" in proc.stderr
    link = tmp_path / "results.jsonl"
    os.link(jobs, link)  # another name, the same inode
    proc = run_cli("batch", str(jobs), "--out", str(link))
    assert proc.returncode == 2 and "is the jobs file itself" in proc.stderr
    assert jobs.read_bytes() == before


def test_a_committed_line_without_its_newline_is_kept_and_a_torn_one_is_cut(
    tmp_path: Path,
) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(3)])
    out = tmp_path / "out.jsonl"
    args = ("batch", str(jobs), "--out", str(out))
    assert run_cli(*args).returncode == 0
    full = out.read_bytes()
    # ``truncate -s -1``: the last committed line lost only its newline.
    os.truncate(out, len(full) - 1)
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr
    assert out.read_bytes() == full  # kept, newline added
    assert _stat(again.stdout, "POSTs (attempts spent)") == "0"
    assert _stat(again.stdout, "committed (earlier runs)") == "3"
    assert "missing newline added" in again.stdout
    # A torn last line after its job was acknowledged: cut, and the job reported as
    # done before (its result was lost outside the batch; nothing is generated again).
    last = full.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    os.truncate(out, len(full) - len(last) // 2)
    torn = run_cli(*args)
    assert torn.returncode == 1
    assert "torn output tail cut" in torn.stdout
    assert "already_acknowledged" in torn.stderr
    assert _stat(torn.stdout, "POSTs (attempts spent)") == "0"
    assert len(read_results(out)) == 2


def test_a_line_torn_by_a_crash_before_its_acknowledgement_is_cut_and_committed_again(
    tmp_path: Path,
) -> None:
    # The batch dies right after the third line's write, before that job is acknowledged
    # (what a crash inside the write leaves, once the torn half is on disk).
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(3)])
    out = tmp_path / "out.jsonl"
    args = ("batch", str(jobs), "--out", str(out), "--concurrency", "1")
    killed = run_cli(*args, env={"RECOVERABLE_KILL_AT": "host.committed@3"})
    assert killed.returncode == -signal.SIGKILL
    full = out.read_bytes()
    assert full.count(b"\n") == 3
    last = full.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    os.truncate(out, len(full) - len(last) // 2)
    torn = run_cli(*args)
    assert torn.returncode == 0, torn.stderr
    assert "torn output tail cut" in torn.stdout
    assert _stat(torn.stdout, "POSTs (attempts spent)") == "0"  # from its saved receipt
    assert_exactly_once(read_results(out), _keys(3))


# -- 11.8: content changed under the same revision ----------------------------------------------


def test_a_committed_job_with_new_content_under_the_same_revision_is_a_conflict(
    tmp_path: Path,
) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(3)])
    out = tmp_path / "out.jsonl"
    assert run_cli("batch", str(jobs), "--out", str(out)).returncode == 0
    before = out.read_bytes()
    changed = write_jobs(
        tmp_path / "jobs.jsonl",
        [job_line(0), job_line(1, input="other text"), job_line(2)],
    )
    proc = run_cli("batch", str(changed), "--out", str(out))
    assert proc.returncode == 1, proc.stdout
    assert _stat(proc.stdout, "  revision_conflict") == "1"
    assert _stat(proc.stdout, "committed (earlier runs)") == "2"
    assert "(line 2) failed: revision_conflict" in proc.stderr
    where = [r["id"] for r in read_results(out)].index("gen-0001") + 1
    assert f"out.jsonl:{where})" in proc.stderr  # where it was committed
    assert out.read_bytes() == before
    assert _stat(proc.stdout, "POSTs (attempts spent)") == "0"


def test_two_lines_with_the_same_revision_and_different_content_conflict(
    tmp_path: Path,
) -> None:
    jobs = write_jobs(
        tmp_path / "jobs.jsonl",
        [job_line(1), job_line(2), job_line(1), job_line(2, input="changed")],
    )
    out = tmp_path / "out.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out))
    assert proc.returncode == 1
    assert "jobs.jsonl:3: duplicate of line 1" in proc.stderr  # identical: a duplicate
    assert "jobs.jsonl:4: revision_conflict: same id and revision as line 2" in proc.stderr
    assert _stat(proc.stdout, "duplicate lines") == "1"
    assert _stat(proc.stdout, "  revision_conflict") == "1"
    assert_exactly_once(read_results(out), {("gen-0001", "r1"), ("gen-0002", "r1")})


# -- 11.5: one job's failure never ends the batch ----------------------------------------------


def test_a_job_that_breaks_unexpectedly_does_not_end_the_batch(tmp_path: Path) -> None:
    # A schema whose only property refers to itself: no finite instance. The embedded
    # provider's answer synthesis recursed without bound (RecursionError) inside the
    # batch's own process and ended the whole batch with a traceback, on every rerun.
    cyclic = {
        **job_line(1),
        "schema": {
            "type": "object",
            "properties": {"x": {"$ref": "#/properties/x"}},
            "required": ["x"],
            "additionalProperties": False,
        },
    }
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0), cyclic, job_line(2)])
    out = tmp_path / "out.jsonl"
    args = ("batch", str(jobs), "--out", str(out), "--backoff", "0.01", "--max-attempts", "2")
    for _ in range(2):  # the rerun too
        proc = run_cli(*args)
        assert proc.returncode == 1, proc.stderr
        assert "Traceback" not in proc.stderr
        assert "jobs" in proc.stdout and "failed" in proc.stdout  # the summary
        # Rejected at prepare (a skipped line) or failed as a job: never the batch.
        assert "jobs.jsonl:2: skipped" in proc.stderr or "(line 2) failed" in proc.stderr
        assert_exactly_once(read_results(out), {("gen-0000", "r1"), ("gen-0002", "r1")})


# -- 11.6: a broken, full or closed stdout -----------------------------------------------------


def _slow_batch(tmp_path: Path, n: int = 24) -> tuple[Path, Path, list[str]]:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(n)])
    out = tmp_path / "out.jsonl"
    # --rps 8: the batch runs for ~3 s and draws a progress line every second.
    return jobs, out, cli_command("batch", str(jobs), "--out", str(out), "--rps", "8")


def test_a_stdout_pipe_closed_by_its_reader_does_not_stop_the_batch(tmp_path: Path) -> None:
    _jobs, out, command = _slow_batch(tmp_path)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=REPO, env=child_env())
    assert proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdout.readline()  # `| head -1`: one line, then the reader is gone
        proc.stdout.close()
        stderr = proc.stderr.read().decode()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr
    assert "stdout failed" in stderr
    assert "committed (this run)" in stderr  # the summary went to stderr
    assert_exactly_once(read_results(out), _keys(24))


def test_a_full_stdout_does_not_stop_the_batch(tmp_path: Path) -> None:
    _jobs, out, command = _slow_batch(tmp_path, n=6)
    with open("/dev/full", "w") as full:
        proc = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True,
                              cwd=REPO, env=child_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "No space left on device" in proc.stderr
    assert "committed (this run)" in proc.stderr
    assert_exactly_once(read_results(out), _keys(6))


def test_a_closed_stdout_does_not_stop_the_batch(tmp_path: Path) -> None:
    _jobs, out, command = _slow_batch(tmp_path, n=6)
    # `>&-`: descriptor 1 is closed when the process starts.
    proc = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", *command],
                          stderr=subprocess.PIPE, text=True, cwd=REPO, env=child_env(),
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "stdout is closed" in proc.stderr
    assert "committed (this run)" in proc.stderr
    assert_exactly_once(read_results(out), _keys(6))  # nothing was written into it


# -- 11.9: wrong advice and rough edges ------------------------------------------------------


@contextmanager
def _stalled_batch(tmp_path: Path) -> Iterator[tuple[Path, Path, str]]:
    """A batch process whose one job streams and stalls (it holds the operation)."""
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(1)])
    store_dir = tmp_path / "store"
    proc = subprocess.Popen(
        cli_command("batch", str(jobs), "--out", str(tmp_path / "a.jsonl"), "--store",
                    str(store_dir), "--faults", "stall=1.0"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO, env=child_env(),
    )
    try:
        deadline = time.monotonic() + 30
        op_id = None
        while op_id is None:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the first batch never started its job"
            listing = run_cli("inventory", "--store", str(store_dir), *ACCOUNT, "--json")
            if listing.returncode == 0:
                ops = json.loads(listing.stdout)["operations"]
                if ops and ops[0]["availability"] == "running":
                    op_id = ops[0]["operation_id"]
            if op_id is None:
                time.sleep(0.05)  # polling durable state, not a correctness sleep
        yield jobs, store_dir, op_id
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_second_batch_on_a_running_store_is_refused_and_suspend_is_requested(
    tmp_path: Path,
) -> None:
    """A second batch on the store of a running one, with another result log, is refused
    before anything runs (one store, one result log), naming the first's; the first keeps
    running. ``suspend`` next to it is requested, never "is now running"."""
    with _stalled_batch(tmp_path) as (jobs, store_dir, op_id):
        other = tmp_path / "b.jsonl"
        second = run_cli("batch", str(jobs), "--out", str(other), "--store", str(store_dir))
        assert second.returncode == 2, second.stderr
        assert f"in {tmp_path / 'a.jsonl'}" in second.stderr
        assert "another --store" in second.stderr and "abandon" not in second.stderr
        assert other.read_bytes() == b""  # nothing was run or written
        listing = run_cli("inventory", "--store", str(store_dir), *ACCOUNT, "--json")
        (operation,) = json.loads(listing.stdout)["operations"]
        assert operation["availability"] == "running"  # the first batch still holds it
        # suspend/cancel next to the running process: requested, never "is now running".
        suspended = run_cli("suspend", "--store", str(store_dir), *ACCOUNT, op_id)
        assert suspended.returncode == 0, suspended.stderr
        assert "is now running" not in suspended.stdout
        assert "requested" in suspended.stdout and "another process" in suspended.stdout


def test_json_usage_errors_are_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--store", str(tmp_path), "--json"]) == 2  # no OPERATION_ID
    error = json.loads(capsys.readouterr().err)
    assert error["error"] == "usage" and "OPERATION_ID" in error["message"]
    assert main(["inventory", "--store", str(tmp_path / "none"), *ACCOUNT, "--json"]) == 2
    assert json.loads(capsys.readouterr().err)["error"] == "usage"


def test_inventory_json_survives_undecodable_ids(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    recoverable.RecoveryStore.open(str(store_dir)).close()
    # A damaged store: an operation key that is not UTF-8, with an unreadable record.
    env = lmdb.open(str(store_dir), subdir=True, max_dbs=32)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(b"operations", txn=txn, create=False)
            txn.put(b"op_\xff\xfe-damaged", b"\x00not a record", db=db)
    finally:
        env.close()
    as_json = run_cli("inventory", "--store", str(store_dir), *ACCOUNT, "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert len(json.loads(as_json.stdout)["unreadable"]) == 1
    text = run_cli("inventory", "--store", str(store_dir), *ACCOUNT)
    assert text.returncode == 0, text.stderr
    assert "unreadable record: op_" in text.stdout


def _free_port_in_use() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_bad_endpoints_hosts_and_ports_are_clear_usage_errors(tmp_path: Path) -> None:
    bad_url = run_cli("batch", str(EXAMPLE), "--out", str(tmp_path / "o.jsonl"),
                      "--endpoint", "http://[::1", env={"OPENAI_API_KEY": "sk-x"})
    assert bad_url.returncode == 2 and "--endpoint" in bad_url.stderr
    assert "Traceback" not in bad_url.stderr
    busy = _free_port_in_use()
    try:
        cases = [
            ("--port", "-1"),
            ("--port", "99999"),  # was silently wrapped to 34463
            ("--port", str(busy.getsockname()[1])),
            ("--host", "no-such-host.invalid"),
        ]
        for option, value in cases:
            proc = run_cli("fixture-provider", option, value, timeout=30)
            assert proc.returncode == 2, (option, value, proc.stdout, proc.stderr)
            assert "Traceback" not in proc.stderr, proc.stderr
            assert proc.stdout == ""  # it never announced a URL
    finally:
        busy.close()


def test_a_bom_on_line_1_is_named(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_bytes(b"\xef\xbb\xbf" + json.dumps(job_line(1)).encode() + b"\n"
                     + json.dumps(job_line(2)).encode() + b"\n")
    proc = run_cli("batch", str(jobs), "--out", str(tmp_path / "out.jsonl"))
    assert proc.returncode == 1
    assert "jobs.jsonl:1: skipped" in proc.stderr and "BOM" in proc.stderr


def test_dev_null_and_absurd_rates_are_refused_before_anything_runs(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    proc = run_cli("batch", str(EXAMPLE), "--out", "/dev/null", "--store", str(store_dir))
    assert proc.returncode == 2 and "not a regular file" in proc.stderr
    assert not store_dir.exists()  # refused before the store was opened, before any POST
    for rps in ("1e-300", "0.001", "1e9"):
        proc = run_cli("batch", str(EXAMPLE), "--out", str(tmp_path / "o.jsonl"),
                       "--rps", rps)
        assert proc.returncode == 2 and "--rps" in proc.stderr, rps


def _provider(script: list[dict[str, Any]], tmp_path: Path) -> tuple[subprocess.Popen[str], str]:
    script_file = tmp_path / "script.json"
    script_file.write_text(json.dumps(script))
    proc = subprocess.Popen(
        cli_command("fixture-provider", "--script", str(script_file)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=child_env(),
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())["http_url"]


def test_a_huge_retry_after_is_bounded_and_shown(tmp_path: Path) -> None:
    provider, url = _provider([{"kind": "rate_limited", "retry_after": 999999999}], tmp_path)
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(1)])
    store_dir = tmp_path / "store"
    batch = subprocess.Popen(
        cli_command("batch", str(jobs), "--out", str(tmp_path / "out.jsonl"), "--store",
                    str(store_dir), "--endpoint", url, "--mode", "sse"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**child_env(), "OPENAI_API_KEY": "sk-test"},
    )
    started = time.time()
    # A watchdog, not a correctness sleep: a batch that never shows the wait is killed.
    watchdog = threading.Timer(60.0, batch.kill)
    watchdog.start()
    try:
        assert batch.stdout is not None
        shown = ""
        for line in batch.stdout:  # one progress line per second while it waits
            if "waiting until" in line:
                shown = line
                break
        assert shown, batch.communicate()
        batch.send_signal(signal.SIGINT)
        batch.communicate(timeout=30)
        assert batch.returncode == 130
    finally:
        watchdog.cancel()
        for proc in (batch, provider):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    store = recoverable.RecoveryStore.open(str(store_dir))
    try:
        records, _ = store.inventory()
    finally:
        store.close()
    (record,) = records
    assert record.next_attempt_at is not None
    # Bounded by the batch (not 31 years away); generous slack for a loaded machine.
    assert record.next_attempt_at <= started + MAXIMUM_RETRY_AFTER + 60


def test_identical_failures_are_counted_not_printed_hundreds_of_times(tmp_path: Path) -> None:
    # Every job fails the same way (here: the provider answers invalidly; in the report,
    # a store failing every write): each is counted, a few are shown, then one line.
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(40)])
    proc = run_cli("batch", str(jobs), "--out", str(tmp_path / "out.jsonl"),
                   "--faults", "schema_violation=1.0")
    assert proc.returncode == 1
    assert _stat(proc.stdout, "failed") == "40"
    assert proc.stderr.count(") failed: ") == 5
    assert "and 35 more job(s) failed with" in proc.stderr


def test_the_script_entry_point_still_prints_usage_on_bad_arguments() -> None:
    proc = subprocess.run([sys.executable, "-m", "recoverable", "nope"], capture_output=True,
                          text=True, cwd=REPO, env=child_env(), timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_every_cut_of_a_result_line_is_torn_and_other_lines_are_not() -> None:
    from recoverable.cli.result_log import _is_torn_result_line

    line = json.dumps(
        {"id": 'g"1\\', "revision": "r1", "operation_id": "op_1", "input_sha256": "ab",
         "result": {"label": "a"}},
        separators=(",", ":"),
    ).encode()
    for cut in range(len(line)):  # every proper prefix, down to the empty one
        assert _is_torn_result_line(line[:cut]), line[:cut]
    old_format = b'{"id":"g","revision":"r1","operation_id":"op_1","result":{"label":"a"'
    assert _is_torn_result_line(old_format)
    job = json.dumps(job_line(1)).encode()  # with spaces: never written by the batch
    assert not any(_is_torn_result_line(job[:cut]) for cut in range(8, len(job)))
    compact_job = json.dumps(job_line(1), separators=(",", ":")).encode()
    assert not _is_torn_result_line(compact_job[:-1])  # "model" where operation_id goes
    assert not _is_torn_result_line(b"my notes")
