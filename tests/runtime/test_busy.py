"""Abandon and acknowledge of a busy operation (issue 10, "Missing tests").

The defined behaviour (seed: "Stop and await active work first; cleanup never steals
an executing operation's lease"): while any execution holds the operation's lease —
another task of the same runtime, another runtime on the same store, or another
process — ``acknowledge`` and ``abandon`` raise the typed ``OperationBusy`` and change
nothing: the record, its frozen body and the running stream are untouched. Once the
execution has been stopped and has unwound, the same call succeeds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

import recoverable
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend
from .test_cross_process_cancel import ACCOUNT as CHILD_ACCOUNT
from .test_cross_process_cancel import CHILD, LineReader, _idle_backend


async def _refused_and_untouched(
    rt: Any, store: recoverable.RecoveryStore, handle: recoverable.Handle
) -> None:
    op_id = handle.operation_id
    record = store.get_operation(op_id)
    body = store.get_payload(op_id, "body")
    assert record is not None and body is not None
    for action in (rt.acknowledge, rt.abandon):
        with pytest.raises(recoverable.OperationBusy) as info:
            await action(handle)
        assert info.value.code == "operation_busy" and info.value.operation_id == op_id
    assert store.get_operation(op_id) == record
    assert store.get_payload(op_id, "body") == body
    assert store.get_disposition(op_id) is None
    status = await rt.status(handle)
    assert status.state == "running" and status.suggested_actions == ("wait",)


@pytest.mark.parametrize("where", ["same_runtime", "other_runtime"])
async def test_abandon_and_acknowledge_of_a_streaming_operation_raise_operation_busy(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str, where: str
) -> None:
    provider.script([Reply.stall(after_events=2)])
    async with recoverable.open_runtime(
        store, make_backend(provider, mode), account=ACCOUNT
    ) as owner, recoverable.open_runtime(
        store, make_backend(provider, mode), account=ACCOUNT
    ) as other:
        actor = owner if where == "same_runtime" else other
        handle = await owner.prepare(REQUEST, response=Answer, maximum_attempts=3)
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                with pytest.raises(recoverable.OperationSuspended):
                    await owner.send_recovering(handle, response=Answer, authorize=Authorizer())

            nursery.start_soon(send)
            await provider.wait_for_requests(1)
            await _refused_and_untouched(actor, store, handle)
            # Stop the execution, then (after it unwound) abandon succeeds.
            await actor.suspend(handle)
        await actor.abandon(handle)
        assert (await actor.status(handle)).state == "abandoned"
        assert store.get_payload(handle.operation_id, "body") is None
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_abandon_and_acknowledge_while_the_host_is_authorizing_raise_operation_busy(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        entered = trio.Event()

        async def waiting(attempt: recoverable.Attempt) -> bool:
            entered.set()
            await trio.sleep_forever()
            return True

        async with trio.open_nursery() as nursery:

            async def send() -> None:
                with pytest.raises(recoverable.OperationCancelled):
                    await rt.send_recovering(handle, response=Answer, authorize=waiting)

            nursery.start_soon(send)
            await entered.wait()
            await _refused_and_untouched(rt, store, handle)
            await rt.cancel(handle)
        await rt.abandon(handle)
        assert (await rt.status(handle)).state == "abandoned"
    assert generation_requests(provider, handle.operation_id) == []


async def test_abandon_and_acknowledge_of_an_operation_streamed_by_another_process(
    tmp_path: Path,
) -> None:
    """And a second sender in this process is busy by the store's lease across processes
    (the supervisor of this process has no execution to refuse it)."""
    store_path = str(tmp_path / "store")
    env = dict(os.environ)
    env.pop("RECOVERABLE_KILL_AT", None)
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.stall(after_events=2)])
        argv = [sys.executable, CHILD, "--store", store_path, "--base-url", provider.http_url,
                "--count", "1", "--max-attempts", "3"]
        with trio.fail_after(60):  # generous: a whole child process on a loaded machine
            process = await trio.lowlevel.open_process(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
            )
            try:
                assert process.stdout is not None
                lines = LineReader(process.stdout)
                prepared = await lines.next()
                assert prepared["event"] == "prepared", prepared
                handle = recoverable.Handle(prepared["operation_id"])
                await provider.wait_for_requests(1)
                store = recoverable.RecoveryStore.open(store_path)
                try:
                    async with recoverable.open_runtime(
                        store, _idle_backend(provider), account=CHILD_ACCOUNT
                    ) as rt:
                        await _refused_and_untouched(rt, store, handle)
                        # No execution of this process holds it: the store's lease alone
                        # refuses a second sender, before the host is asked.
                        second = Authorizer()
                        with pytest.raises(recoverable.OperationBusy):
                            await rt.send_recovering(handle, response=Answer, authorize=second)
                        assert second.calls == []
                        await rt.cancel(handle)
                        assert (await lines.next())["event"] == "cancelled"
                        assert (await lines.next())["event"] == "done"
                        assert await process.wait() == 0
                        await rt.abandon(handle)
                        assert (await rt.status(handle)).state == "abandoned"
                finally:
                    store.close()
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
    assert len(provider.requests) == 1
