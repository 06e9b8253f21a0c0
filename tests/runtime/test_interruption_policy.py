"""``prepare(..., on_interruption=...)`` end to end (issue 14): with ``"fail"`` a real
mid-stream disconnect ends the operation ``failed`` (``interrupted``) after ONE POST, never
replaced; the default ``"replace"`` replaces it; a manual retry keeps the policy. And the
sweep a runtime runs when it opens: a dead owner's orphan is closed before anything runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import recoverable
from recoverable import errors
from recoverable.outcome import Interruption
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend

FAST = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)


async def test_fail_policy_a_disconnect_ends_the_operation_after_one_post(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    provider.script([Reply.disconnect(after_events=3), Reply.complete({"answer": 1, "note": "x"})])
    authorize = Authorizer()
    async with recoverable.open_runtime(store, make_backend(provider, mode), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3,
                                  retry_policy=FAST, on_interruption="fail")
        with pytest.raises(errors.PermanentlyFailed) as raised:
            await rt.send_recovering(handle, response=Answer, authorize=authorize)
        assert raised.value.last_failure is not None
        assert raised.value.last_failure.kind == "disconnected"
        assert "on_interruption" in str(raised.value)
        status = await rt.status(handle)
        assert status.state == "failed" and status.availability == "failed"
        assert status.attempts_used == 1 and status.attempts_remaining == 2
        assert status.suggested_actions == ("manual_retry", "abandon")
        # Reopening: the same terminal answer, no callback, no POST.
        with pytest.raises(errors.PermanentlyFailed):
            await rt.send_recovering(handle, response=Answer, authorize=authorize)
        record = store.get_operation(handle.operation_id)
        assert record is not None and record.failure_reason == "interrupted"
        # A deliberate manual retry is allowed and keeps the policy.
        child = await rt.retry(handle, retry_action_id="again", maximum_attempts=2)
        successor = store.get_operation(child.operation_id)
        assert successor is not None and successor.on_interruption == "fail"
    assert len(authorize.calls) == 1
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_replace_policy_the_same_disconnect_is_replaced(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.disconnect(after_events=3), Reply.complete({"answer": 1, "note": "x"})])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3,
                                  retry_policy=FAST)
        value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert value == Answer(answer=1, note="x")
        record = store.get_operation(handle.operation_id)
        assert record is not None and record.on_interruption == "replace"
    assert len(generation_requests(provider, handle.operation_id)) == 2


@pytest.mark.parametrize("value", ["Fail", "never", None, 0])
async def test_prepare_refuses_an_unknown_policy_and_saves_nothing(
    provider: FixtureProvider, store: recoverable.RecoveryStore, value: object
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        with pytest.raises(errors.InvalidRequest, match="on_interruption"):
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=3,
                             on_interruption=value)  # type: ignore[arg-type]
    assert store.inventory() == ([], [])


async def test_a_runtime_opening_sweeps_a_dead_owners_orphan(tmp_path: Path) -> None:
    """A child runtime is SIGKILLed mid-stream; the next runtime to open on the store
    closes the orphan before anything runs (reported in telemetry)."""
    store_path = str(tmp_path / "store")
    child = str(Path(__file__).with_name("sweep_child.py"))
    env = dict(os.environ)
    env.pop("RECOVERABLE_KILL_AT", None)
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.stall(after_events=2)])
        argv = [sys.executable, child, "--store", store_path, "--base-url", provider.http_url,
                "--op", json.dumps({"job": "a"})]
        with trio.fail_after(120):  # a guard against a hung child, never a barrier
            process = await trio.lowlevel.open_process(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
            )
            try:
                await provider.wait_for_requests(1)  # the attempt is durably consumed
                os.kill(process.pid, signal.SIGKILL)
                assert await process.wait() == -signal.SIGKILL
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
    store = recoverable.RecoveryStore.open(store_path)
    try:
        [before], _ = store.inventory()
        assert before.phase == "transmitting" and store.get_lease(before.operation_id)
        events: list[recoverable.TelemetryEvent] = []
        async with recoverable.open_runtime(
            store, None, account=recoverable.AccountBinding("acct-sweep", "api-key"),
            telemetry=events.append,
        ) as rt:
            after = store.get_operation(before.operation_id)
            assert after is not None and after.phase == "waiting"
            assert store.get_lease(before.operation_id) is None
            assert after.attempts[-1].failure == Interruption(
                kind="interrupted", transport_code="owner_lost"
            )
            status = await rt.status(recoverable.Handle(before.operation_id))
            assert status.attempts[-1].outcome == "interrupted"
        owner_lost = [e for e in events if e.name == "recovery.operation.owner_lost"]
        assert [(e.operation_id, e.fields["state"]) for e in owner_lost] == [
            (before.operation_id, "waiting")
        ]
    finally:
        store.close()
