"""Only ``True`` authorizes: any other answer of the host's callback sends nothing.

``bool(answer)`` used to decide, so ``"yes"`` (or ``1``, or a non-empty list) authorized a
POST. Now an answer that is not a bool raises ``AuthorizationFailed`` to the caller of
``send_recovering`` before anything is spent; the operation keeps its pending attempt, and
a later call with a working callback sends attempt 1. A callback that raises still raises
its own exception unchanged. A worker's standing policy has no caller: its failure is saved
(``failure_reason="authorization_failed"``, tested with real processes in
``cli/test_worker_authorizer.py``; here in one process).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

import recoverable
from recoverable.actors.worker import run_worker
from recoverable.testing import FixtureProvider

from .conftest import ACCOUNT, REQUEST, Answer, generation_requests, make_backend


@pytest.mark.parametrize("answer", ["yes", 1, None, [True], "True"])
async def test_an_answer_that_is_not_a_bool_authorizes_nothing(
    provider: FixtureProvider, store: recoverable.RecoveryStore, answer: Any
) -> None:
    async def odd(attempt: recoverable.Attempt) -> Any:
        return answer

    async def approve(attempt: recoverable.Attempt) -> bool:
        return True

    async with make_backend(provider) as backend, recoverable.open_runtime(
        store, backend, account=ACCOUNT
    ) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        with pytest.raises(recoverable.AuthorizationFailed) as failed:
            await rt.send_recovering(handle, response=Answer, authorize=odd)
        assert failed.value.attempt_id == f"{handle.operation_id}.1"
        assert type(answer).__name__ in str(failed.value)
        assert generation_requests(provider, handle.operation_id) == []
        status = await rt.status(handle)  # as after a callback that raised: nothing spent
        assert (status.attempts_used, status.state) == (0, "interrupted")
        await rt.send_recovering(handle, response=Answer, authorize=approve)
    (sent,) = generation_requests(provider, handle.operation_id)
    assert sent.attempt_id == f"{handle.operation_id}.1"  # the same attempt, nothing spent


async def test_a_raising_callback_still_raises_its_own_exception(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    class PolicyDown(Exception):
        pass

    async def broken(attempt: recoverable.Attempt) -> bool:
        raise PolicyDown

    async with make_backend(provider) as backend, recoverable.open_runtime(
        store, backend, account=ACCOUNT
    ) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        with pytest.raises(PolicyDown):
            await rt.send_recovering(handle, response=Answer, authorize=broken)
        record = store.get_operation(handle.operation_id)
        assert record is not None and record.failure_reason is None
    assert generation_requests(provider, handle.operation_id) == []


@pytest.mark.parametrize("answer", ["raise", "yes"])
async def test_a_worker_policy_that_does_not_answer_is_saved_as_the_failure(
    provider: FixtureProvider, store: recoverable.RecoveryStore, answer: str
) -> None:
    async def policy(attempt: recoverable.Attempt) -> Any:
        if answer == "raise":
            raise RuntimeError("policy down")
        return answer

    schema = recoverable.JsonSchema("answer", {
        "type": "object", "properties": {"answer": {"type": "integer"},
                                         "note": {"type": "string"}},
        "required": ["answer", "note"], "additionalProperties": False,
    })
    async with make_backend(provider) as backend, recoverable.open_runtime(
        store, backend, account=ACCOUNT
    ) as rt:
        handle = await rt.submit(REQUEST, response=schema, job_id="job-1",
                                 maximum_attempts=2)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: run_worker(rt, concurrency=1, authorize=policy, stop=stop)
            )
            with trio.fail_after(30), pytest.raises(recoverable.AuthorizationFailed):
                await rt.wait(handle, response=schema)
            stop.set()
        record = store.get_operation(handle.operation_id)
        assert record is not None
        assert (record.phase, record.failure_reason, record.attempts_used) == (
            "failed", "authorization_failed", 0,
        )
    assert generation_requests(provider, handle.operation_id) == []
