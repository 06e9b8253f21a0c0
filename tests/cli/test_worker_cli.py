"""Issue 14 (w-worker, item 2): ``recoverable worker`` as a real process.

The provider runs in its own process (``recoverable fixture-provider``); the test process
submits and waits through its own runtime on the same store (cross-process); workers are
started, SIGTERMed and SIGKILLed as real processes. Barriers are durable state (the
store's records, the provider's request log), never sleeps.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import recoverable
from recoverable.cli import main
from recoverable.cli import worker as worker_cli
from recoverable.storage.queue import entry as queue_entry

from .cli_helpers import REPO, SMALL_SCHEMA, child_env, cli_command

ACCOUNT = recoverable.AccountBinding("acct-w", "api-key")
SCHEMA = recoverable.JsonSchema("label", SMALL_SCHEMA)
KEY_ENV = {"WORKER_TEST_KEY": "sk-worker-test"}


def request(i: int) -> recoverable.StructuredRequest:
    return recoverable.StructuredRequest(
        model="gpt-test", instructions="Label the text.", input=f"text number {i}"
    )


def start_provider(*flags: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "recoverable", "fixture-provider", "--port", "0", *flags],
        stdout=subprocess.PIPE, text=True, env=child_env(),
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def provider() -> Iterator[dict[str, Any]]:
    proc, info = start_provider("--reply-delay", "0.3")
    try:
        yield info
    finally:
        stop(proc)


def start_worker(store: Path, info: dict[str, Any], *flags: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        cli_command(
            "worker", "--store", str(store), "--endpoint", info["http_url"], "--mode", "sse",
            "--api-key-env", "WORKER_TEST_KEY", "--account", ACCOUNT.account_id, *flags,
        ),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**child_env(), **KEY_ENV},
    )
    assert proc.stdout is not None
    ready = proc.stdout.readline()
    assert json.loads(ready)["worker"] == "ready", proc.stderr.read() if proc.stderr else ""
    return proc


def posts(info: dict[str, Any]) -> Counter[str]:
    """Generation POSTs per operation id, from the provider's own log."""
    log = httpx.get(info["requests_url"], timeout=10).json()
    return Counter((r["attempt_id"] or "?").rsplit(".", 1)[0] for r in log)


def backend(info: dict[str, Any]) -> recoverable.ResponsesBackend:
    return recoverable.ResponsesBackend(
        info["http_url"], mode="sse",
        credentials=recoverable.StaticCredentials("sk-worker-test", account=ACCOUNT),
    )


async def submit_all(rt: recoverable.Runtime, count: int) -> list[recoverable.Handle]:
    return [
        await rt.submit(request(i), response=SCHEMA, job_id=f"job-{i}", input_revision="r1",
                        maximum_attempts=4)
        for i in range(count)
    ]


async def wait_all(rt: recoverable.Runtime, handles: list[recoverable.Handle]) -> list[Any]:
    values: list[Any] = [None] * len(handles)

    async def one(i: int) -> None:
        values[i] = await rt.wait(handles[i], response=SCHEMA)

    with trio.fail_after(60):  # generous: a loaded 2-core machine; the work takes ~2 s
        async with trio.open_nursery() as nursery:
            for i in range(len(handles)):
                nursery.start_soon(one, i)
    return values


async def phases_reach(store: recoverable.RecoveryStore, handles: list[recoverable.Handle],
                       phases: set[str], count: int) -> None:
    """Barrier on durable state: at least ``count`` operations are in ``phases``."""
    with trio.fail_after(30):  # generous: a loaded machine
        while sum(  # noqa: ASYNC110 (another process writes it: no Event can say so)
            (record := store.get_operation(h.operation_id)) is not None
            and record.phase in phases
            for h in handles
        ) < count:
            await trio.sleep(0.01)


async def test_a_worker_process_runs_submitted_jobs_and_stops_cleanly(
    tmp_path: Path, provider: dict[str, Any]
) -> None:
    path = tmp_path / "store"
    store = recoverable.RecoveryStore.open(str(path))
    try:
        async with recoverable.open_runtime(store, backend(provider), account=ACCOUNT) as rt:
            handles = await submit_all(rt, 12)
            worker = start_worker(path, provider, "--concurrency", "4")
            try:
                values = await wait_all(rt, handles)
            finally:
                worker.send_signal(signal.SIGTERM)
                out, err = worker.communicate(timeout=30)
        assert worker.returncode == 0, err
        report = json.loads(out.splitlines()[-1])
        assert report["worker"] == "stopped" and report["completed"] == 12
        assert all(v["label"] in ("a", "b") for v in values)
        counts = posts(provider)
        assert all(counts[h.operation_id] == 1 for h in handles), counts
        assert store.queued() == []  # terminal operations left the queue
        assert store.check_integrity() == []
    finally:
        store.close()


async def test_sigterm_suspends_for_the_next_worker_and_sigkill_is_adopted(
    tmp_path: Path, provider: dict[str, Any]
) -> None:
    path = tmp_path / "store"
    store = recoverable.RecoveryStore.open(str(path))
    try:
        async with recoverable.open_runtime(store, backend(provider), account=ACCOUNT) as rt:
            handles = await submit_all(rt, 8)
            first = start_worker(path, provider, "--concurrency", "4")
            await phases_reach(store, handles, {"transmitting"}, 4)
            first.send_signal(signal.SIGTERM)
            out, err = first.communicate(timeout=30)
            assert first.returncode == 0, err
            suspended = [
                h for h in handles
                if (r := store.get_operation(h.operation_id)) is not None
                and r.phase == "suspended"
            ]
            # Every operation it was running when the signal came (4, unless one had
            # just finished) is suspended and flagged; none is left transmitting.
            assert 1 <= len(suspended) == json.loads(out.splitlines()[-1])["resumable"] <= 4
            phases = {store.get_operation(h.operation_id).phase  # type: ignore[union-attr]
                      for h in handles}
            assert not phases & {"authorizing", "transmitting"}, phases
            for h in suspended:  # flagged: the next worker resumes them (no host suspended)
                entry = queue_entry(store, h.operation_id)
                assert entry is not None and entry.resume
                assert store.get_lease(h.operation_id) is None
            second = start_worker(path, provider, "--concurrency", "4")
            await phases_reach(store, handles, {"transmitting"}, 4)
            second.kill()  # SIGKILL mid-stream: its leases die with its owner lock
            second.wait(timeout=30)
            # Its worker row is dead with it: nobody serves the queue until the next one.
            waiting = [(await rt.status(h)).queue for h in handles]
            assert "waiting_for_worker" in waiting and "queued" not in waiting, waiting
            third = start_worker(path, provider, "--concurrency", "8")
            try:
                values = await wait_all(rt, handles)
            finally:
                stop(third)
        assert len(values) == 8 and all(v is not None for v in values)
        counts = posts(provider)
        for h in handles:
            record_posts = counts[h.operation_id]
            assert 1 <= record_posts <= 4, counts  # within the saved budget
        assert store.queued() == []
        assert store.check_integrity() == []
    finally:
        store.close()


def test_a_bad_authorizer_is_a_usage_error(tmp_path: Path) -> None:
    for spec in ("nocolon", "no_such_module_xyz:f", "json:no_such_attribute", "json:__doc__"):
        done = subprocess.run(
            cli_command("worker", "--store", str(tmp_path / "s"), "--authorizer", spec),
            capture_output=True, text=True, timeout=60, cwd=REPO, env=child_env(),
        )
        assert done.returncode == 2, (spec, done.stderr)
        assert "--authorizer" in done.stderr


async def test_a_host_authorizer_declines_and_nothing_is_sent(
    tmp_path: Path, provider: dict[str, Any]
) -> None:
    path = tmp_path / "store"
    marker = tmp_path / "asked"
    store = recoverable.RecoveryStore.open(str(path))
    try:
        async with recoverable.open_runtime(store, backend(provider), account=ACCOUNT) as rt:
            handles = await submit_all(rt, 1)
            proc = subprocess.Popen(  # noqa: ASYNC220 (started, not awaited)
                cli_command(
                    "worker", "--store", str(path), "--endpoint", provider["http_url"],
                    "--mode", "sse", "--api-key-env", "WORKER_TEST_KEY", "--account",
                    ACCOUNT.account_id, "--authorizer", "tests.cli.worker_authorizers:decline",
                ),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                env={**child_env(), **KEY_ENV, "WORKER_TEST_MARKER": str(marker)},
            )
            try:
                with trio.fail_after(30):  # generous: process start on a loaded machine
                    while not marker.exists():  # noqa: ASYNC110 (written by another process)
                        await trio.sleep(0.01)
            finally:
                stop(proc)
            assert proc.returncode == 0
            status = await rt.status(handles[0])
            assert status.attempts_used == 0
        assert posts(provider)[handles[0].operation_id] == 0
    finally:
        store.close()


def test_sigterm_right_after_ready_is_a_clean_stop(tmp_path: Path) -> None:
    """Regression: "ready" was printed before the signal handler was installed, so a
    SIGTERM right after it killed the worker (exit -15) instead of stopping it."""
    proc = subprocess.Popen(
        cli_command("worker", "--store", str(tmp_path / "store")),  # embedded fixture
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=child_env(),
    )
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["worker"] == "ready"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert json.loads(out.splitlines()[-1]) == {
        "worker": "stopped", "claimed": 0, "completed": 0, "failed": 0, "busy": 0,
        "stopped": 0, "removed": 0, "resumable": 0, "continued": 0,
    }


def test_lease_seconds_out_of_bounds_is_a_usage_error(tmp_path: Path) -> None:
    for value in ("0.5", "7200", "nan"):
        done = subprocess.run(
            cli_command("worker", "--store", str(tmp_path / "s"), "--lease-seconds", value),
            capture_output=True, text=True, timeout=60, cwd=REPO, env=child_env(),
        )
        assert done.returncode == 2, (value, done.stderr)
        assert "--lease-seconds" in done.stderr
    assert not (tmp_path / "s").exists()  # refused before the store was created


async def test_a_store_failing_under_a_worker_ends_it_with_one_typed_line(
    tmp_path: Path, provider: dict[str, Any]
) -> None:
    """Issue 28 item 5: lock.mdb removed under a running worker. Every read and write of
    its store is refused from then on; the worker says so in ONE line (the typed code),
    never a traceback, and exits 1. It got the store from ``--store-env``."""
    path = tmp_path / "store"
    store = recoverable.RecoveryStore.open(str(path))
    worker: subprocess.Popen[str] | None = None
    try:
        async with recoverable.open_runtime(store, backend(provider), account=ACCOUNT) as rt:
            handles = await submit_all(rt, 4)
        worker = subprocess.Popen(  # noqa: ASYNC220 (started, not awaited)
            cli_command(
                "worker", "--store-env", "TEST_WORKER_STORE", "--endpoint",
                provider["http_url"], "--mode", "sse", "--api-key-env", "WORKER_TEST_KEY",
                "--account", ACCOUNT.account_id, "--concurrency", "4",
            ),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env={**child_env(), **KEY_ENV, "TEST_WORKER_STORE": str(path)},
        )
        await phases_reach(store, handles, {"transmitting"}, 1)  # it is running them
        store.close()  # this process's own copy: only the worker has it open now
        (path / "lock.mdb").unlink()
        with trio.fail_after(30):  # generous: it fails at its next read or write
            await trio.to_thread.run_sync(worker.wait)
        _, err = worker.communicate(timeout=10)
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait()
        store.close()
    assert worker.returncode == 1, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("recoverable worker: store_lock_replaced: "), err


def test_exactly_one_of_store_and_store_env_is_a_usage_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store = str(tmp_path / "s")
    monkeypatch.setenv("TEST_WORKER_STORE", store)
    monkeypatch.delenv("TEST_WORKER_STORE_UNSET", raising=False)
    cases = [
        ((), "one of the arguments --store --store-env is required"),
        (("--store", store, "--store-env", "TEST_WORKER_STORE"), "not allowed with argument"),
        (("--store-env", "TEST_WORKER_STORE_UNSET"), "TEST_WORKER_STORE_UNSET (--store-env) "
                                                     "is not set"),
    ]
    for args, message in cases:
        assert main(["worker", *args]) == 2, args  # in process: no worker is started
        err = capsys.readouterr().err
        assert message in err, (args, err)
        assert "Traceback" not in err
    assert not (tmp_path / "s").exists()  # refused before any store was opened


def test_an_unexpected_worker_error_is_one_line_naming_its_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A defect (not a typed error), wrapped by Trio's nurseries as it would be: one line
    with its type and a hint to report it; its traceback only with RECOVERABLE_DEBUG=1."""
    try:
        raise ExceptionGroup("nursery", [
            ExceptionGroup("inner", [recoverable.errors.StorageUnavailable("lost")]),
            ValueError("boom\nsecond line"),
        ])
    except ExceptionGroup as raised:  # with its traceback, as trio.run raises it
        failure = raised
    monkeypatch.delenv("RECOVERABLE_DEBUG", raising=False)
    lines: list[str] = []
    err = io.StringIO()
    assert worker_cli._failure(failure, lines.append, err) == 1
    assert lines == [
        "recoverable worker: internal_error: ValueError: boom (a defect of recoverable: "
        "please report it; RECOVERABLE_DEBUG=1 prints the traceback)"
    ]
    assert err.getvalue() == ""
    monkeypatch.setenv("RECOVERABLE_DEBUG", "1")
    assert worker_cli._failure(failure, lines.append, err) == 1
    assert "Traceback" in err.getvalue() and "ValueError: boom" in err.getvalue()
    typed = ExceptionGroup("nursery", [
        recoverable.errors.StoreLockReplaced("gone"),
        ExceptionGroup("inner", [recoverable.errors.StorageUnavailable("lost")]),
    ])
    lines.clear()
    assert worker_cli._failure(typed, lines.append, None) == 1
    assert len(lines) == 1
    assert lines[0].startswith("recoverable worker: store_lock_replaced: ")
    assert lines[0].endswith("(also: storage_unavailable)")
