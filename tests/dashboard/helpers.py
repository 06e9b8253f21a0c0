"""Helpers of the dashboard tests: a store made by real batch runs, and the dashboard as a
real process (``python -m recoverable dashboard``) on 127.0.0.1."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

import recoverable
from recoverable.storage import acquire_lease

from ..cli.cli_helpers import child_env, cli_command, job_line, run_cli, write_jobs

REPO = Path(__file__).resolve().parents[2]
ACCOUNT_ID = "acct-batch-9911"  # the batch's account (distinctive: it must never show)
OTHER_ACCOUNT_ID = "acct-other-4242"  # another account's operation in the same store
PROMPT_MARKER = "PROMPT-MARKER-q7x"  # in every job's input: it must never show either
ACCOUNT = recoverable.AccountBinding(ACCOUNT_ID, "api-key")
OTHER = recoverable.AccountBinding(OTHER_ACCOUNT_ID, "api-key")


def _prepare(
    store_dir: Path | str, account: recoverable.AccountBinding, jobs: list[str]
) -> list[str]:
    """Operations prepared (never sent) by ``account`` in scope "batch"."""

    async def prepare() -> list[str]:
        store = recoverable.RecoveryStore.open(str(store_dir))
        backend = recoverable.ResponsesBackend(
            "http://127.0.0.1:9/v1",
            credentials=recoverable.StaticCredentials("sk-unused", account=account),
            endpoint_id="fixture",
        )
        try:
            async with recoverable.open_runtime(store, backend, account=account) as rt:
                ids = []
                for job in jobs:
                    line = job_line(0, input=f"{PROMPT_MARKER} {job}")
                    handle = await rt.prepare(
                        recoverable.StructuredRequest(model="gpt-test", input=line["input"]),
                        response=recoverable.JsonSchema("label", line["schema"]),
                        maximum_attempts=3, scope="batch", job_id=job, input_revision="r1",
                    )
                    ids.append(handle.operation_id)
                return ids
        finally:
            store.close()

    return trio.run(prepare)


def make_store(root: Path) -> dict[str, Any]:
    """A store with every kind of operation, made by real batch runs:

    - ``failed``: 2 jobs whose answers broke the schema (1 attempt each);
    - ``saved``: 1 job whose batch was SIGKILLed right after its receipt was saved
      (completed, not acknowledged);
    - ``done``: 3 jobs committed and acknowledged by the batch (markers);
    - ``idle``: 3 prepared operations; ``other``: 1 of another account.
    """
    store_dir = root / "store"
    out = root / "out.jsonl"
    common = ("--out", str(out), "--store", str(store_dir), "--account", ACCOUNT_ID)
    jobs = [job_line(i, input=f"{PROMPT_MARKER} text {i}") for i in range(1, 7)]
    failing = write_jobs(root / "failing.jsonl", jobs[0:2])
    run = run_cli("batch", str(failing), *common, "--faults", "schema_violation=1.0",
                  "--max-attempts", "1")
    assert run.returncode == 1, run.stderr
    saved = write_jobs(root / "saved.jsonl", jobs[2:3])
    killed = run_cli("batch", str(saved), *common, env={"RECOVERABLE_KILL_AT": "receipt.saved"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    done = write_jobs(root / "done.jsonl", jobs[3:6])
    ok = run_cli("batch", str(done), *common)
    assert ok.returncode == 0, ok.stderr
    idle = _prepare(store_dir, ACCOUNT, ["idle-1", "idle-2", "idle-3"])
    other = _prepare(store_dir, OTHER, ["other-1"])
    return {"store": store_dir, "idle": idle, "other": other}


def copy_store(made: dict[str, Any], root: Path) -> Path:
    """A private copy of a made store (no process has it open while it is copied)."""
    target = root / "store-copy"
    shutil.copytree(made["store"], target, ignore=shutil.ignore_patterns("owners"))
    return target


@contextmanager
def dashboard(store: Path | str, *extra: str) -> Iterator[dict[str, Any]]:
    """``recoverable dashboard`` as a real process; yields its JSON line (+ ``proc``,
    ``base``). At exit: SIGTERM, and it must end with exit code 0."""
    proc = subprocess.Popen(
        cli_command("dashboard", "--store", str(store), *extra), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=REPO, env=child_env(),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        raise AssertionError(f"the dashboard did not start: {proc.stderr.read()}")  # type: ignore[union-attr]
    info: dict[str, Any] = json.loads(line)
    info["proc"] = proc
    info["base"] = info["url"].split("/?token=")[0]
    try:
        yield info
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)  # generous: a loaded 2-core machine
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        info["stderr"] = proc.stderr.read() if proc.stderr else ""
        assert code == 0, info["stderr"]


@contextmanager
def signed_in(info: dict[str, Any]) -> Iterator[httpx.Client]:
    """A client holding the session cookie (the token was used once)."""
    with httpx.Client(base_url=info["base"], timeout=30, follow_redirects=False) as client:
        first = client.get(info["url"])
        assert first.status_code == 303, first.text
        yield client


def wait_for(predicate: Any, what: str, timeout: float = 30.0) -> Any:
    """Poll durable state (through the dashboard's API) until ``predicate`` holds."""
    deadline = time.monotonic() + timeout  # generous: a loaded 2-core machine
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def make_small_store(root: Path) -> dict[str, Any]:
    """A store of one failed operation (a batch whose answer broke the schema) and two
    prepared ones: the operations the action rules are tried on."""
    store_dir = root / "store"
    failing = write_jobs(root / "failing.jsonl", [job_line(1, input=f"{PROMPT_MARKER} x")])
    run = run_cli("batch", str(failing), "--out", str(root / "out.jsonl"), "--store",
                  str(store_dir), "--account", ACCOUNT_ID, "--faults", "schema_violation=1.0",
                  "--max-attempts", "1")
    assert run.returncode == 1, run.stderr
    idle = _prepare(store_dir, ACCOUNT, ["idle-1", "idle-2"])
    return {"store": store_dir, "idle": idle}


@contextmanager
def lease_held(store_dir: Path | str, operation_id: str) -> Iterator[str]:
    """This test process holds the operation's lease (as a running batch would) until the
    block ends: another process than the dashboard runs it. Yields the lease's owner id."""
    store = recoverable.RecoveryStore.open(str(store_dir))
    try:
        lease = store.write_sync(lambda txn: acquire_lease(txn, operation_id, time.time()))
        yield lease.owner_id
    finally:
        store.close()
