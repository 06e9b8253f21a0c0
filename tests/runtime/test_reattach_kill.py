"""Issue 15 with real processes: a host streaming a ``reattach=True`` background response
is killed with SIGKILL mid-stream; the rerun (another process's runtime on the same store)
makes **zero new POSTs**, resumes the saved response by GET and commits the result once.
With the response already finished on the server, the rerun reads it with one GET.

The child runs the whole budget of ONE attempt (``maximum_attempts=1``): without
reattachment the rerun could not generate at all (``owner_lost``, exhausted).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import recoverable
from recoverable.testing import FixtureProvider, Reply

from .conftest import stopped
from .reattach_child import ACCOUNT, Answer

CHILD = str(Path(__file__).with_name("reattach_child.py"))
LONG = {"answer": 7, "note": "k" * 400}  # 200 delta events with deltas=(200, 200)
pytestmark = pytest.mark.both_stores


def _child(provider: FixtureProvider, store_path: str, *options: str) -> list[str]:
    """The command line of a reattach_child.py host on the store and the provider."""
    return [sys.executable, CHILD, "--store", store_path, "--base-url", provider.http_url,
            *options]


async def _lines(process: trio.Process) -> Any:
    """The child's stdout, one JSON object per line."""
    assert process.stdout is not None
    buffer = b""
    while True:
        chunk = await process.stdout.receive_some(4096)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield json.loads(line)


async def _kill_after_checkpoint(
    provider: FixtureProvider, store_path: str, *, finished: bool
) -> str:
    """Run the child until its first checkpoint (the response id) is durable, optionally
    until the server finished generating, then SIGKILL it. Returns the operation id."""
    env = dict(os.environ)
    env.pop("RECOVERABLE_KILL_AT", None)
    argv = _child(provider, store_path)
    operation_id = ""
    rid = ""
    with trio.fail_after(120):  # a guard against a hung child, never a barrier
        process = await trio.lowlevel.open_process(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
        )
        try:
            async for line in _lines(process):
                if line["event"] == "prepared":
                    operation_id = line["operation_id"]
                if line["event"] == "checkpointed":
                    rid = line["response_id"]
                    break  # the response id is saved (the write committed)
            assert rid and len(await provider.wait_for_requests(1)) == 1
            if finished:
                # Stopped first: streaming live, a running child would receive the end of
                # the response as it is generated and might save its receipt before the
                # kill. Stopped, it receives nothing; the provider generates on.
                os.kill(process.pid, signal.SIGSTOP)
                await stopped(process.pid)
                await provider.wait_generated(rid)  # the whole response exists server-side
            os.kill(process.pid, signal.SIGKILL)
            assert await process.wait() == -signal.SIGKILL
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert operation_id
    return operation_id


@asynccontextmanager
async def _rerun(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> AsyncIterator[recoverable.Runtime]:
    """The rerun: this process's runtime (another owner than the killed child's) on the
    store, over its own SSE backend."""
    backend = recoverable.ResponsesBackend(
        provider.http_url, mode="sse", endpoint_id="fixture",
        credentials=recoverable.StaticCredentials("sk-rerun", account=ACCOUNT),
    )
    async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
        yield rt


@pytest.mark.parametrize("finished", [False, True], ids=["mid_generation", "finished"])
async def test_sigkill_mid_stream_then_the_rerun_reattaches_with_zero_new_posts(
    store_location: str, finished: bool
) -> None:
    store_path = store_location  # a directory (LMDB) or a database URL (PostgreSQL)
    # The stream is slow enough to be killed mid-way (200 deltas, 20 ms apart: about 4 s).
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.02) as provider:
        provider.script([Reply.complete(LONG)])
        operation_id = await _kill_after_checkpoint(provider, store_path, finished=finished)
        assert len(provider.requests) == 1
        with recoverable.RecoveryStore.open(store_path) as store:
            saved = store.get_operation(operation_id)
            assert saved is not None and not saved.has_completion
            assert saved.attempts[-1].response_id is not None
            commits: list[Answer] = []
            calls: list[recoverable.Attempt] = []

            async def authorize(attempt: recoverable.Attempt) -> bool:
                calls.append(attempt)
                return True

            async with _rerun(provider, store) as rt:
                handle = recoverable.Handle(operation_id)
                value = await rt.send_recovering(handle, response=Answer, authorize=authorize)
                commits.append(value)
                status = await rt.status(handle)
                # Reopening delivers the receipt: no GET, no POST, no second commit source.
                assert await rt.send_recovering(handle, response=Answer,
                                                authorize=authorize) == value
                await rt.acknowledge(handle)
    assert commits == [Answer(**LONG)]
    assert len(provider.requests) == 1  # zero new POSTs
    assert calls == []  # a reattachment authorizes nothing
    resumes = [r for r in provider.retrievals if r.kind == "resume"]
    assert len(provider.retrievals) == len(resumes) >= 1
    if finished:
        assert len(resumes) == 1  # the finished response is read with one GET
    assert resumes[0].starting_after is not None  # after the saved cursor
    assert status.attempts_used == 1 and status.reattached and status.reattachments == 1


async def test_a_kill_after_the_reattachment_is_counted_is_one_more_try_of_the_bound(
    store_location: str,
) -> None:
    """The rerun is itself killed at ``reattach.saved`` (its reattachment is counted and
    saved, its GET not sent): the next rerun reattaches again, still with zero new POSTs."""
    store_path = store_location
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.02) as provider:
        provider.script([Reply.complete(LONG)])
        operation_id = await _kill_after_checkpoint(provider, store_path, finished=False)
        env = dict(os.environ, RECOVERABLE_KILL_AT="reattach.saved")
        with trio.fail_after(120):  # a guard against a hung child, never a barrier
            killed = await trio.run_process(_child(provider, store_path, "--resume", operation_id),
                                            env=env, check=False,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert killed.returncode == -signal.SIGKILL
        assert provider.retrievals == []  # killed before its GET
        with recoverable.RecoveryStore.open(store_path) as store:
            saved = store.get_operation(operation_id)
            assert saved is not None and saved.attempts[-1].reattachments == 1

            async def authorize(attempt: recoverable.Attempt) -> bool:
                raise AssertionError("a reattachment authorizes nothing")

            async with _rerun(provider, store) as rt:
                handle = recoverable.Handle(operation_id)
                value = await rt.send_recovering(handle, response=Answer, authorize=authorize)
                status = await rt.status(handle)
    assert value == Answer(**LONG)
    assert len(provider.requests) == 1
    assert [r.kind for r in provider.retrievals] == ["resume"]
    assert status.reattachments == 2 and status.reattached
