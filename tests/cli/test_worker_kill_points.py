"""Issue 14 evidence (w-worker): a worker killed (SIGKILL) at each durable checkpoint of an
operation it claimed; another worker adopts it, with a higher generation fence.

The first worker process is started with ``RECOVERABLE_KILL_AT=<point>`` and kills itself
there; the test checks the durable state it left, then starts a second worker (no kill
point) and waits for the result from its own process. POSTs are counted by the provider
(its own process), per attempt id: the exact attempts that reached it, so none after a
saved receipt and none beyond the budget.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import recoverable

from .cli_helpers import REPO, SMALL_SCHEMA, child_env, cli_command

ACCOUNT = recoverable.AccountBinding("acct-k", "api-key")
SCHEMA = recoverable.JsonSchema("label", SMALL_SCHEMA)
REQUEST = recoverable.StructuredRequest(
    model="gpt-test", instructions="Label the text.", input="the only text"
)

# kill point -> (the phase the dead worker left, the attempt numbers the provider sees in
# all, the attempts spent in all). The first attempt reached the provider unless the
# worker died before sending it; a receipt saved is never generated again.
CHECKPOINTS = {
    "attempt.pending_saved": ("authorizing", [1], 1),  # pending id reused, nothing spent
    "attempt.consumed_saved": ("transmitting", [2], 2),  # spent before its first byte
    "stream.completed_unreceived": ("transmitting", [1, 2], 2),
    "receipt.before_save": ("transmitting", [1, 2], 2),
    "receipt.saved": ("completed", [1], 1),  # never generated again
}


@pytest.fixture
def provider() -> Iterator[dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "recoverable", "fixture-provider", "--port", "0"],
        stdout=subprocess.PIPE, text=True, env=child_env(),
    )
    assert proc.stdout is not None
    info: dict[str, Any] = json.loads(proc.stdout.readline())
    try:
        yield info
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def worker(store: Path, info: dict[str, Any], kill_at: str | None) -> subprocess.Popen[str]:
    env = {**child_env(), "WORKER_TEST_KEY": "sk-kill-points"}
    if kill_at is not None:
        env["RECOVERABLE_KILL_AT"] = kill_at
    return subprocess.Popen(
        cli_command(
            "worker", "--store", str(store), "--endpoint", info["http_url"], "--mode", "sse",
            "--api-key-env", "WORKER_TEST_KEY", "--account", ACCOUNT.account_id,
            "--concurrency", "1",
        ),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
    )


def provider_log(info: dict[str, Any]) -> list[dict[str, Any]]:
    log: list[dict[str, Any]] = httpx.get(info["requests_url"], timeout=10).json()
    return log


@pytest.mark.parametrize("point", list(CHECKPOINTS))
async def test_a_worker_killed_at_a_checkpoint_is_adopted_by_another(
    tmp_path: Path, provider: dict[str, Any], point: str
) -> None:
    left_phase, attempts_seen, spent = CHECKPOINTS[point]
    path = tmp_path / "store"
    store = recoverable.RecoveryStore.open(str(path))
    backend = recoverable.ResponsesBackend(
        provider["http_url"], mode="sse",
        credentials=recoverable.StaticCredentials("sk-kill-points", account=ACCOUNT),
    )
    try:
        async with recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
            handle = await rt.submit(REQUEST, response=SCHEMA, job_id="only",
                                     maximum_attempts=3)
            first = worker(path, provider, point)
            with trio.fail_after(60):  # generous: process start-up on a loaded machine
                while first.poll() is None:  # noqa: ASYNC110 (another process: no Event)
                    await trio.sleep(0.01)
            assert first.returncode == -9, first.stderr.read() if first.stderr else ""
            dead = store.get_operation(handle.operation_id)
            assert dead is not None and dead.phase == left_phase
            lease = store.get_lease(handle.operation_id)
            assert lease is None or not store.lease_is_live(lease)  # its owner died
            second = worker(path, provider, None)
            try:
                with trio.fail_after(60):  # generous
                    value = await rt.wait(handle, response=SCHEMA)
                    # The adopting worker removes the finished operation from the queue
                    # (also one whose first worker died after saving its receipt).
                    while store.queued():  # noqa: ASYNC110 (another process: no Event)
                        await trio.sleep(0.01)
            finally:
                second.terminate()
                second.wait(timeout=30)
            assert value["label"] in ("a", "b")
            done = store.get_operation(handle.operation_id)
            assert done is not None and done.has_completion
            assert done.attempts_used == spent
            if left_phase != "completed":
                assert done.fence > dead.fence  # adopted under a newer generation
        log = provider_log(provider)
        numbers = sorted(int(r["attempt_id"].rsplit(".", 1)[1]) for r in log
                         if r["attempt_id"].startswith(handle.operation_id + "."))
        if point == "attempt.consumed_saved":
            # Killed after spending attempt 1 and before its first byte: the provider
            # may or may not have received it (kernel buffers), never twice.
            assert numbers in ([2], [1, 2]), numbers
        else:
            assert numbers == attempts_seen, numbers
        assert store.queued() == []
        assert store.check_integrity() == []
    finally:
        store.close()
