"""Supervised operation actors (issue 13.5).

Every active operation runs as a task of the runtime's supervisor nursery
(``actors/supervisor.py``), owning its lease; ``send_recovering`` is its caller. These
tests pin what that adds — an execution with no caller at all, the runtime closing
under one, the caller's context reaching the host callback — and that the seed's rules
of the caller hold unchanged (its cancellation suspends, durably, after the actor
unwound; a second sender is refused).
"""

from __future__ import annotations

import contextvars

import pytest
import trio

import recoverable
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend

HOST_REQUEST: contextvars.ContextVar[str] = contextvars.ContextVar("host_request")


async def test_a_detached_execution_runs_to_its_receipt_with_no_caller(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        authorizer = Authorizer()
        execution = rt.start_operation(handle, response=Answer, authorize=authorizer)
        assert rt.supervisor.running[handle.operation_id] is execution
        await execution.finished.wait()  # nobody awaits the outcome: it ran anyway
        assert handle.operation_id not in rt.supervisor.running
        status = await rt.status(handle)
        assert status.state == "completed" and status.has_saved_completion
        assert store.get_lease(handle.operation_id) is None
        value = await execution.outcome()  # a late caller still reads the outcome
        assert isinstance(value, Answer)
        assert len(authorizer.calls) == 1
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_a_waiter_going_away_does_not_stop_a_detached_execution(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.stall(after_events=2)])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        execution = rt.start_operation(handle, response=Answer, authorize=Authorizer())
        await provider.wait_for_requests(1)
        with trio.CancelScope() as scope:
            scope.cancel()
            await execution.outcome()
        assert scope.cancelled_caught
        assert not execution.finished.is_set()
        assert (await rt.status(handle)).state == "running"
        await rt.suspend(handle)  # a lifecycle command still stops it
        with pytest.raises(recoverable.OperationSuspended):
            await execution.outcome()
    assert (await rt.status(handle)).state == "suspended"


async def test_the_runtime_closing_suspends_a_detached_execution_durably(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.stall(after_events=2)])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        execution = rt.start_operation(handle, response=Answer, authorize=Authorizer())
        await provider.wait_for_requests(1)
    # The block ended with the execution streaming: it was cancelled with the
    # supervisor nursery, and suspended (a shielded write) before the nursery closed.
    assert execution.finished.is_set()
    with pytest.raises(recoverable.OperationSuspended):
        await execution.outcome()
    assert store.get_lease(handle.operation_id) is None
    record = store.get_operation(handle.operation_id)
    assert record is not None and record.phase == "suspended" and record.attempts_used == 1
    with pytest.raises(recoverable.ConfigurationUnavailable):
        rt.start_operation(handle, response=Answer, authorize=Authorizer())
    # Reopened later, it resumes within the remaining budget.
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as again:
        value = await again.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert isinstance(value, Answer)
    assert len(generation_requests(provider, handle.operation_id)) == 2


async def test_the_operation_runs_in_the_supervisor_nursery_with_the_callers_context(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        caller = trio.lowlevel.current_task()
        seen: set[str] = set()

        async def authorize(attempt: recoverable.Attempt) -> bool:
            task = trio.lowlevel.current_task()
            assert task is not caller  # the actor's own task, not the caller's
            assert rt.supervisor.running[handle.operation_id] is not None
            seen.add(HOST_REQUEST.get())  # the caller's context was copied to it
            return True

        HOST_REQUEST.set("request-7")
        value = await rt.send_recovering(handle, response=Answer, authorize=authorize)
        assert isinstance(value, Answer) and seen == {"request-7"}
        assert handle.operation_id not in rt.supervisor.running


async def test_the_callers_cancellation_suspends_and_returns_after_the_actor_unwound(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.stall(after_events=2)])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        with trio.CancelScope() as scope:

            async def cancel_when_streaming() -> None:
                await provider.wait_for_requests(1)
                scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_when_streaming)
                await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert scope.cancelled_caught
        # The caller's cancellation returned only once the lease was given back and the
        # suspension saved: the next call is not busy.
        assert handle.operation_id not in rt.supervisor.running
        assert store.get_lease(handle.operation_id) is None
        assert (await rt.status(handle)).state == "suspended"
        await rt.abandon(handle)
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_a_second_start_of_a_running_operation_is_busy_without_a_store_write(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.stall(after_events=2)])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        execution = rt.start_operation(handle, response=Answer, authorize=Authorizer())
        await provider.wait_for_requests(1)
        second = Authorizer()
        with pytest.raises(recoverable.OperationBusy):
            await rt.send_recovering(handle, response=Answer, authorize=second)
        assert second.calls == []
        await rt.cancel(handle)
        with pytest.raises(recoverable.OperationCancelled):
            await execution.outcome()
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_only_the_last_caller_going_away_suspends_an_attached_execution(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.stall(after_events=2)])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        op_id = handle.operation_id
        execution = rt.start_operation(
            handle, response=Answer, authorize=Authorizer(), attached=True
        )
        joined: list[Answer] = []

        async def join() -> None:
            joined.append(await execution.outcome())

        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as first:

                async def cancel_when_streaming() -> None:
                    await provider.wait_for_requests(1)
                    first.cancel()

                nursery.start_soon(cancel_when_streaming)
                nursery.start_soon(join)
                await execution.outcome()
            assert first.cancelled_caught
            # Another caller still waits: the execution goes on (it is not suspended).
            assert rt.supervisor.running[op_id] is execution
            assert (await rt.status(handle)).state == "running"
            # The last caller going away suspends it, as the seed says of the caller.
            nursery.cancel_scope.cancel()
        assert joined == []
        assert execution.finished.is_set()
        assert (await rt.status(handle)).state == "suspended"
        assert store.get_lease(op_id) is None
    assert len(generation_requests(provider, op_id)) == 1
