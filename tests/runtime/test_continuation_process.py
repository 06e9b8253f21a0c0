"""Issue 18, criteria 1, 2, 5 and 9 with real processes: ``recoverable config`` turns the
preference on, ``recoverable worker`` processes (two at once) drain the queue with nobody
attached, and ``recoverable batch`` (``--workers 0`` and ``--workers 1``) counts a job with
a pending continuation as unfinished and commits it once it recovered.

The provider is ``recoverable fixture-provider`` in its own process, scripted to drop the
stream (a TCP close mid-stream) on every attempt of the first operation until its budget
is spent. That is all the fixture simulates: no real upstream incident (a provider
exhausting its own retries, a classifier) is reproduced. Barriers are durable state
(store records, the provider's request log), never sleeps; the configured delay is real
wall time (0.3 s) because the worker is another process.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import recoverable

from ..cli.cli_helpers import (
    REPO,
    SMALL_SCHEMA,
    child_env,
    cli_command,
    job_line,
    read_results,
    run_cli,
    write_jobs,
)

ACCOUNT = recoverable.AccountBinding("acct-c", "api-key")
SCHEMA = recoverable.JsonSchema("label", SMALL_SCHEMA)
KEY_ENV = {"CONTINUATION_TEST_KEY": "sk-continuation-test"}
DELAY = 0.3
DROP = {"kind": "disconnect", "after_events": 2}
DONE = {"kind": "complete", "payload": {"label": "a", "score": 7}}
pytestmark = pytest.mark.both_stores


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[dict[str, Any]]:
    script = tmp_path / "script.json"
    script.write_text(json.dumps([DROP, DROP, DONE]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "recoverable", "fixture-provider", "--port", "0",
         "--script", str(script)],
        stdout=subprocess.PIPE, text=True, env=child_env(),
    )
    assert proc.stdout is not None
    try:
        yield json.loads(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def posts(info: dict[str, Any]) -> Counter[str]:
    log = httpx.get(info["requests_url"], timeout=10).json()
    return Counter((r["attempt_id"] or "?").rsplit(".", 1)[0] for r in log)


def turn_on(store_path: Path | str, delay: float = DELAY) -> None:
    recoverable.RecoveryStore.open(str(store_path)).close()  # a fresh store
    got = run_cli("config", "get", "continuation.enabled", "--store", str(store_path), "--json")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["value"] is False  # off by default
    for key, value in (("continuation.enabled", "true"),
                       ("continuation.delay_seconds", str(delay))):
        done = run_cli("config", "set", key, value, "--store", str(store_path))
        assert done.returncode == 0, done.stderr
    got = run_cli("config", "get", "continuation.enabled", "--store", str(store_path))
    assert got.stdout == "continuation.enabled = true\n"


def start_worker(store: Path | str, info: dict[str, Any]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        cli_command("worker", "--store", str(store), "--endpoint", info["http_url"],
                    "--mode", "sse", "--api-key-env", "CONTINUATION_TEST_KEY",
                    "--account", ACCOUNT.account_id),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**child_env(), **KEY_ENV},
    )
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["worker"] == "ready"
    return proc


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_config_cli_rejects_bad_values_and_missing_stores(tmp_path: Path) -> None:
    store = tmp_path / "store"
    recoverable.RecoveryStore.open(str(store)).close()
    for key, value in (("continuation.enabled", "maybe"), ("continuation.budget", "11"),
                       ("continuation.delay_seconds", "-1"), ("continuation.budget", "x")):
        bad = run_cli("config", "set", key, value, "--store", str(store))
        assert bad.returncode == 2, bad.stderr
    missing = run_cli("config", "get", "continuation.enabled", "--store", str(tmp_path / "no"))
    assert missing.returncode == 2
    unknown = run_cli("config", "get", "continuation.other", "--store", str(store))
    assert unknown.returncode == 2
    got = run_cli("config", "get", "continuation.budget", "--store", str(store), "--json")
    assert json.loads(got.stdout)["value"] == 2  # unchanged by the refusals


async def test_workers_continue_a_failed_run_once_with_nobody_attached(
    store_location: str, provider: dict[str, Any]
) -> None:
    store_path = store_location  # a directory (LMDB) or a database URL (PostgreSQL)
    turn_on(store_path)
    backend = recoverable.ResponsesBackend(
        provider["http_url"], mode="sse",
        credentials=recoverable.StaticCredentials("sk-continuation-test", account=ACCOUNT),
    )
    with recoverable.RecoveryStore.open(str(store_path)) as store:
        async with recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
            handle = await rt.submit(
                recoverable.StructuredRequest(model="gpt-test", instructions="Label.",
                                              input="text"),
                response=SCHEMA, job_id="job-1", input_revision="r1", maximum_attempts=2,
                retry_policy=recoverable.RetryPolicy(initial_backoff=0.0),
            )
            workers = [start_worker(store_path, provider) for _ in range(2)]
            try:
                with trio.fail_after(60):  # generous: two loaded worker processes
                    value = await rt.wait(handle, response=SCHEMA)
            finally:
                for proc in workers:
                    stop(proc)
            assert value == {"label": "a", "score": 7}
            source = store.get_operation(handle.operation_id)
            assert source is not None and source.continuation is not None
            decided = source.continuation
            assert decided.state == "dispatched" and decided.successor_id is not None
            assert decided.due_at is not None
            successor = store.get_operation(decided.successor_id)
            assert successor is not None
            # Delayed eligibility: the successor was created at or after the due time.
            assert successor.created_at >= decided.due_at
            assert len(store.inventory(ACCOUNT)[0]) == 2  # one successor for two workers
            status = run_cli("status", handle.operation_id, "--store", str(store_path),
                             "--account", ACCOUNT.account_id, "--json")
            shown = json.loads(status.stdout)["continuation"]
            assert shown["state"] == "dispatched"
            assert shown["successor_id"] == decided.successor_id
            text = run_cli("status", handle.operation_id, "--store", str(store_path),
                           "--account", ACCOUNT.account_id)
            assert "continuation" in text.stdout and "dispatched" in text.stdout
    assert posts(provider) == Counter({handle.operation_id: 2, decided.successor_id: 1})


@pytest.mark.parametrize("workers", ["0", "1"])
def test_batch_finishes_a_job_whose_continuation_recovers(
    tmp_path: Path, store_location: str, provider: dict[str, Any], workers: str
) -> None:
    store_path = store_location  # a directory (LMDB) or a database URL (PostgreSQL)
    turn_on(store_path)
    write_jobs(tmp_path / "jobs.jsonl", [job_line(1)])
    out = tmp_path / "out.jsonl"
    done = run_cli(
        "batch", str(tmp_path / "jobs.jsonl"), "--out", str(out), "--store", str(store_path),
        "--endpoint", provider["http_url"], "--mode", "sse", "--api-key-env",
        "CONTINUATION_TEST_KEY", "--max-attempts", "2", "--backoff", "0",
        "--workers", workers, env=KEY_ENV, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = read_results(out)
    assert len(results) == 1
    counted = posts(provider)
    assert sorted(counted.values()) == [1, 2]  # the failed run, then its one continuation
    successor = next(op for op, count in counted.items() if count == 1)
    assert results[0]["operation_id"] == successor
    with recoverable.RecoveryStore.open(str(store_path)) as store:
        # The committed successor was acknowledged; the failed source keeps its record.
        assert store.get_disposition(successor) is not None


def run_doomed_worker(store_path: Path | str, info: dict[str, Any], point: str) -> int:
    """A worker that SIGKILLs itself at ``point``; its exit status."""
    doomed = subprocess.run(
        cli_command("worker", "--store", str(store_path), "--endpoint", info["http_url"],
                    "--mode", "sse", "--api-key-env", "CONTINUATION_TEST_KEY",
                    "--account", ACCOUNT.account_id),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO, timeout=60,
        env={**child_env(), **KEY_ENV, "RECOVERABLE_KILL_AT": point}, check=False,
    )
    return doomed.returncode


@pytest.mark.parametrize("point", ["continuation.decided", "continuation.dispatched"])
async def test_a_worker_killed_around_the_dispatch_leaves_exactly_one_continuation(
    store_location: str, provider: dict[str, Any], point: str
) -> None:
    """Criterion 5, restarts: a worker SIGKILLed right after the terminal write that
    decided the continuation, or right after its dispatch; another worker finishes with
    exactly one successor and one generation for it."""
    store_path = store_location  # a directory (LMDB) or a database URL (PostgreSQL)
    turn_on(store_path, delay=0)
    backend = recoverable.ResponsesBackend(
        provider["http_url"], mode="sse",
        credentials=recoverable.StaticCredentials("sk-continuation-test", account=ACCOUNT),
    )
    with recoverable.RecoveryStore.open(str(store_path)) as store:
        async with recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
            handle = await rt.submit(
                recoverable.StructuredRequest(model="gpt-test", instructions="Label.",
                                              input="text"),
                response=SCHEMA, job_id="job-k", input_revision="r1", maximum_attempts=2,
                retry_policy=recoverable.RetryPolicy(initial_backoff=0.0),
            )
            assert run_doomed_worker(store_path, provider, point) == -signal.SIGKILL
            source = store.get_operation(handle.operation_id)
            assert source is not None and source.continuation is not None
            expected = "pending" if point == "continuation.decided" else "dispatched"
            assert source.continuation.state == expected
            survivor = start_worker(store_path, provider)
            try:
                with trio.fail_after(60):  # generous: a loaded worker process
                    value = await rt.wait(handle, response=SCHEMA)
            finally:
                stop(survivor)
            assert value == {"label": "a", "score": 7}
            assert len(store.inventory(ACCOUNT)[0]) == 2
            source = store.get_operation(handle.operation_id)
            assert source is not None and source.continuation is not None
            successor_id = source.continuation.successor_id
    assert posts(provider) == Counter({handle.operation_id: 2, successor_id: 1})


def _stat(summary: str, name: str) -> str:
    for line in summary.splitlines():
        if line.startswith(name):
            return line[len(name):].strip()
    raise AssertionError(f"{name!r} not in the summary:\n{summary}")


def _pending_continuation(store_path: Path) -> bool:
    with recoverable.RecoveryStore.open(str(store_path)) as store:
        records, _unreadable = store.inventory()
        return any(r.continuation is not None and r.continuation.state == "pending"
                   for r in records)


def test_an_interrupted_batch_counts_a_pending_continuation_unfinished_and_a_rerun_finishes_it(
    tmp_path: Path, provider: dict[str, Any]
) -> None:
    store_path = tmp_path / "store"
    # Long enough to interrupt the batch while it waits (the due time is persisted at the
    # decision), short enough for the rerun to wait it out.
    turn_on(store_path, delay=8)
    write_jobs(tmp_path / "jobs.jsonl", [job_line(1)])
    out = tmp_path / "out.jsonl"
    args = ("batch", str(tmp_path / "jobs.jsonl"), "--out", str(out), "--store",
            str(store_path), "--endpoint", provider["http_url"], "--mode", "sse",
            "--api-key-env", "CONTINUATION_TEST_KEY", "--max-attempts", "2", "--backoff", "0",
            "--workers", "0")
    batch = subprocess.Popen(cli_command(*args), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=REPO,
                             env={**child_env(), **KEY_ENV})
    try:
        deadline = time.monotonic() + 60  # generous: a loaded machine; a durable barrier
        while not _pending_continuation(store_path):
            assert batch.poll() is None, batch.communicate()
            assert time.monotonic() < deadline, "the continuation was never decided"
            time.sleep(0.05)
        batch.send_signal(signal.SIGINT)
        summary, stderr = batch.communicate(timeout=60)
    finally:
        if batch.poll() is None:
            batch.kill()
            batch.wait()
    assert batch.returncode == 130, stderr
    assert (_stat(summary, "failed"), _stat(summary, "unfinished")) == ("0", "1")
    assert read_results(out) == []
    # The rerun waits for the persisted due time, dispatches and commits the successor.
    rerun = run_cli(*args, env=KEY_ENV, timeout=120)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    results = read_results(out)
    assert len(results) == 1 and results[0]["result"] == {"label": "a", "score": 7}
    counted = posts(provider)
    assert sorted(counted.values()) == [1, 2]
    assert results[0]["operation_id"] == next(op for op, n in counted.items() if n == 1)
