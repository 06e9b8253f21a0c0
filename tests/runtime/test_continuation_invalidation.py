"""Issue 18, criterion 6: everything that stands for newer intent cancels a pending
continuation before its dispatch; recovery never resumes a stopped operation, never
bypasses ``authorize`` and never overrides the host."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

import recoverable
from recoverable import errors
from recoverable.actors.continuation import DispatchResult, dispatch_continuation
from recoverable.actors.worker import run_worker
from recoverable.testing import FixtureProvider, Reply

from ..cli.cli_helpers import run_cli
from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend
from .test_continuation import DROPS, FAST, record

pytestmark = pytest.mark.both_stores

Action = Callable[[recoverable.Runtime, recoverable.RecoveryStore, recoverable.Handle],
                  Awaitable[object]]


@asynccontextmanager
async def _exhausted(
    provider: FixtureProvider, store: recoverable.RecoveryStore, **options: Any
) -> AsyncIterator[tuple[recoverable.Runtime, recoverable.Handle]]:
    """Continuation on (no delay); one operation (``prepare``'s options) exhausted its two
    attempts on stream drops. Yields the runtime and its handle."""
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    provider.script(DROPS)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                                  retry_policy=FAST, **options)
        with pytest.raises(errors.AttemptsExhausted):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        yield rt, handle


async def _dispatch(
    rt: recoverable.Runtime, store: recoverable.RecoveryStore, handle: recoverable.Handle
) -> DispatchResult:
    """Dispatch the operation's continuation now, as this runtime's worker would."""
    assert rt.backend is not None
    return await dispatch_continuation(
        store, rt.telemetry, handle.operation_id, account=ACCOUNT,
        endpoint_id=rt.backend.endpoint_id, now=rt.now(),
    )


async def _cancel(rt: recoverable.Runtime, store: recoverable.RecoveryStore,
                  handle: recoverable.Handle) -> object:
    return await rt.cancel(handle)


async def _suspend(rt: recoverable.Runtime, store: recoverable.RecoveryStore,
                   handle: recoverable.Handle) -> object:
    return await rt.suspend(handle)  # a stop, and also a snooze: no suspend(until=) here


async def _disable(rt: recoverable.Runtime, store: recoverable.RecoveryStore,
                   handle: recoverable.Handle) -> object:
    return await recoverable.set_continuation_preference(store, enabled=False)


async def _newer_revision(rt: recoverable.Runtime, store: recoverable.RecoveryStore,
                          handle: recoverable.Handle) -> object:
    newer = recoverable.StructuredRequest(model=REQUEST.model, instructions="Answer again.",
                                          input=REQUEST.input)
    return await rt.prepare(newer, response=Answer, maximum_attempts=2, job_id="job",
                            input_revision="2")


async def _manual_retry(rt: recoverable.Runtime, store: recoverable.RecoveryStore,
                        handle: recoverable.Handle) -> object:
    return await rt.retry(handle, retry_action_id="user-click", maximum_attempts=2,
                          selection="preserve")


async def _abandon(rt: recoverable.Runtime, store: recoverable.RecoveryStore,
                   handle: recoverable.Handle) -> object:
    return await rt.abandon(handle)


async def _purge(rt: recoverable.Runtime, store: recoverable.RecoveryStore,
                 handle: recoverable.Handle) -> object:
    return store.purge_account(ACCOUNT)


@pytest.mark.parametrize(("action", "reason"), [
    (_cancel, "cancelled"),
    (_suspend, "suspended"),
    (_disable, "disabled"),
    (_newer_revision, "newer_revision"),
    (_manual_retry, "manual_retry"),
    (_abandon, None),  # settled: the record (and its dispatch record) is gone
    (_purge, None),  # deleted
])
async def test_newer_intent_cancels_a_pending_continuation(
    provider: FixtureProvider, store: recoverable.RecoveryStore, action: Action,
    reason: str | None,
) -> None:
    async with _exhausted(provider, store, job_id="job", input_revision="1") as (rt, handle):
        assert [e.operation_id for e in store.queued()] == [handle.operation_id]
        await action(rt, store, handle)
        result = await _dispatch(rt, store, handle)
        assert result.outcome != "dispatched"
        found = store.get_operation(handle.operation_id)
        if reason is None:
            assert found is None
        else:
            assert found is not None and found.continuation is not None
            assert (found.continuation.state, found.continuation.reason) == (
                "cancelled", reason)
            assert found.phase != "suspended" or reason == "suspended"
            status = await rt.status(handle)
            assert status.continuation is not None and status.continuation.state == "cancelled"
            assert status.availability != "continuation_pending"
        assert store.queued() == []
        # No continuation successor exists (a manual one may: the host asked for it).
        for other in store.inventory(ACCOUNT)[0]:
            assert other.continuations_used == 0
    assert len(generation_requests(provider, handle.operation_id)) == 2


async def test_a_suspended_operation_is_never_resumed_by_recovery(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """A worker draining the queue after the host suspended the failed operation: it
    stays as the host left it (no successor, no request)."""
    async with _exhausted(provider, store) as (rt, handle):
        await rt.suspend(handle)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            reports = []

            async def work() -> None:
                reports.append(await run_worker(rt, concurrency=1, authorize=Authorizer(),
                                                stop=stop))

            nursery.start_soon(work)
            with trio.fail_after(30):  # generous: the worker drains an empty queue
                while store.queued():  # noqa: ASYNC110 (durable state)
                    await trio.sleep(0.01)
            stop.set()
        assert reports[0].continued == 0
        assert len(store.inventory(ACCOUNT)[0]) == 1
    assert len(provider.requests) == 2


async def test_the_successor_is_authorized_like_any_attempt(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """A declining host: the successor exists, nothing is sent for it (no bypass)."""
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    provider.script([*DROPS, Reply.complete({"answer": 1, "note": "n"})])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.submit(REQUEST, response=Answer, job_id="j", maximum_attempts=2,
                                 retry_policy=FAST)
        with pytest.raises(errors.AttemptsExhausted):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        deny = Authorizer(approve=False)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: run_worker(rt, concurrency=1, authorize=deny,
                                                  stop=stop))
            with trio.fail_after(30):  # generous
                while not deny.calls:  # noqa: ASYNC110 (the host was asked)
                    await trio.sleep(0.01)
            stop.set()
        decided = record(store, handle.operation_id).continuation
        assert decided is not None and decided.successor_id is not None
        assert deny.calls[0].operation_id == decided.successor_id
        assert record(store, decided.successor_id).attempts_used == 0
    assert generation_requests(provider, decided.successor_id) == []


async def test_a_preference_turned_off_by_another_process_stops_the_dispatch(
    provider: FixtureProvider, store: recoverable.RecoveryStore, store_location: str
) -> None:
    """``recoverable config set continuation.enabled false`` in another process, between the
    decision and the dispatch: this process's next dispatch reads the rows that process
    wrote (on PostgreSQL its writer's row cache must not serve the rows it read before)."""
    async with _exhausted(provider, store, job_id="job", input_revision="1") as (rt, handle):
        decided = store.get_operation(handle.operation_id)
        assert decided is not None and decided.continuation is not None
        assert decided.continuation.state == "pending"
        off = await trio.to_thread.run_sync(functools.partial(
            run_cli, "config", "set", "continuation.enabled", "false", "--store", store_location
        ))
        assert off.returncode == 0, off.stderr
        result = await _dispatch(rt, store, handle)
        # Turning it off cancelled the pending one in the CLI's own transaction: this
        # process's dispatch sees that row, not the one it wrote at the decision.
        assert result.outcome == "not_pending"
        found = store.get_operation(handle.operation_id)
        assert found is not None and found.continuation is not None
        assert (found.continuation.state, found.continuation.reason) == ("cancelled", "disabled")
        assert len(store.inventory(ACCOUNT)[0]) == 1  # no successor
    assert len(generation_requests(provider, handle.operation_id)) == 2
