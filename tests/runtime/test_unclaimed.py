"""Issue 29 items 4 and 11: submitted work has an unclaimed bound, saved with it.

Unclaimed means "no live worker of its account and endpoint", never "not claimed yet":
once no worker of its account and endpoint has lived for the operation's
``unclaimed_after`` seconds, any runtime's sweep (and the poller of a runtime waiting for
it) ends it ``failed``/``no_worker`` and ``wait`` raises ``PermanentlyFailed``; an
operation a live worker serves is never ended so, however long it has been queued.

The wall clock is a value the test moves (the store, the leases, the poller and the
sweep all read it); the barriers are durable rows (a worker row, a saved record)."""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import trio
import trio.testing

import recoverable
from recoverable import errors
from recoverable.actors.sweep import sweep
from recoverable.actors.worker import run_worker
from recoverable.preconditions import DEFAULT_UNCLAIMED_AFTER
from recoverable.storage.queue import SERVED_GRACE
from recoverable.testing import FixtureProvider
from recoverable.types import to_datetime

from .conftest import ACCOUNT, OTHER, REQUEST, Answer, generation_requests, make_backend

pytestmark = pytest.mark.both_stores  # worker rows and served marks: both stores


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


def _backend(
    provider: FixtureProvider, *, endpoint_id: str = "fixture",
    account: recoverable.AccountBinding = ACCOUNT,
) -> recoverable.ResponsesBackend:
    return recoverable.ResponsesBackend(
        provider.http_url, mode="sse", endpoint_id=endpoint_id,
        credentials=recoverable.StaticCredentials("sk-test", account=account),
    )


def _request(index: int) -> recoverable.StructuredRequest:
    return recoverable.StructuredRequest(
        model="gpt-test", instructions="Answer briefly.", input=f"question {index}"
    )


async def _until_a_worker_row(store: recoverable.RecoveryStore) -> None:
    with trio.fail_after(30):  # generous: a worker registers as it starts
        while not store.workers():  # noqa: ASYNC110
            await trio.sleep(0.01)  # (a store row: no Event says it)


def _phase(store: recoverable.RecoveryStore, handle: recoverable.Handle) -> tuple[str, Any]:
    record = store.get_operation(handle.operation_id)
    assert record is not None
    return record.phase, record.failure_reason


async def test_submit_saves_its_unclaimed_bound_with_the_operation(
    store: recoverable.RecoveryStore,
) -> None:
    async with FixtureProvider.serve() as provider:
        async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
            default = await rt.submit(REQUEST, response=Answer, job_id="d", maximum_attempts=2)
            bounded = await rt.submit(REQUEST, response=Answer, job_id="b", maximum_attempts=2,
                                      unclaimed_after=90)
            prepared = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
            for bad in (-1, float("nan"), float("inf"), True, "60"):
                with pytest.raises(errors.InvalidRequest, match="unclaimed_after"):
                    await rt.submit(REQUEST, response=Answer, job_id="x", maximum_attempts=2,
                                    unclaimed_after=bad)
            assert rt.status_of(default.operation_id).queue == "waiting_for_worker"
    records = {h: store.get_operation(h.operation_id) for h in (default, bounded, prepared)}
    assert records[default] is not None and records[bounded] is not None
    assert records[default].unclaimed_after == DEFAULT_UNCLAIMED_AFTER == 3600.0
    assert records[bounded].unclaimed_after == 90.0
    assert records[prepared] is not None and records[prepared].unclaimed_after is None
    assert store.ids_by_job(ACCOUNT, None, "x") == []  # a refused bound writes nothing


async def test_wait_ends_no_worker_when_only_a_worker_of_another_endpoint_runs(
    store: recoverable.RecoveryStore,
) -> None:
    """The host waits; the only worker serves another endpoint; nobody else sweeps. The
    waiting runtime's poller ends the operation once its bound passed, and says why
    before."""
    clock = [time.time()]
    async with FixtureProvider.serve() as provider:
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT, wall_clock=lambda: clock[0]
        ) as rt:
            handle = await rt.submit(REQUEST, response=Answer, job_id="lonely",
                                     maximum_attempts=2, unclaimed_after=60)
            created = clock[0]
            async with recoverable.open_runtime(
                store, _backend(provider, endpoint_id="elsewhere"), account=ACCOUNT,
                wall_clock=lambda: clock[0],
            ) as elsewhere:
                stop = trio.Event()
                caught: list[BaseException] = []

                async def waiter() -> None:
                    try:
                        await rt.wait(handle, response=Answer)
                    except errors.RecoveryError as exc:
                        caught.append(exc)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(functools.partial(
                        run_worker, elsewhere, concurrency=1, authorize=approve, stop=stop
                    ))
                    await _until_a_worker_row(store)
                    status = await rt.status(handle)
                    assert status.queue == "waiting_for_worker"
                    assert status.queue_reason == "no_worker_for_endpoint"
                    assert status.no_worker_at == to_datetime(created + 60)
                    with trio.fail_after(20):  # generous: the poller looks once a second
                        nursery.start_soon(waiter)
                        await trio.testing.wait_all_tasks_blocked()
                        clock[0] += 61  # the bound passes while it waits
                        while not caught:  # noqa: ASYNC110
                            await trio.sleep(0.01)  # (the waiter's own outcome)
                    stop.set()
            assert isinstance(caught[0], errors.PermanentlyFailed)
            assert "worker" in str(caught[0])
            assert _phase(store, handle) == ("failed", "no_worker")
            assert (await rt.status(handle)).queue is None  # settled
        assert generation_requests(provider, handle.operation_id) == []


async def test_status_says_a_worker_serves_the_endpoint_for_another_account(
    store: recoverable.RecoveryStore,
) -> None:
    async with FixtureProvider.serve() as provider:
        async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
            handle = await rt.submit(REQUEST, response=Answer, job_id="mine", maximum_attempts=2)
            async with recoverable.open_runtime(
                store, _backend(provider, account=OTHER), account=OTHER
            ) as other:
                stop = trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(functools.partial(
                        run_worker, other, concurrency=1, authorize=approve, stop=stop
                    ))
                    await _until_a_worker_row(store)
                    status = await rt.status(handle)
                    assert status.queue == "waiting_for_worker"
                    assert status.queue_reason == "no_worker_for_account"
                    (listed,) = (await rt.inventory()).operations
                    assert listed.queue_reason == "no_worker_for_account"
                    stop.set()


async def test_any_runtime_that_opens_ends_what_no_worker_served_within_its_bound(
    store: recoverable.RecoveryStore,
) -> None:
    """Nobody waits: the next runtime that opens (here one for another endpoint) ends it.
    A runtime of the operation's own account and endpoint does not: it may be the worker
    about to serve it, or the host about to submit it again. An operation that was never
    submitted is never ended by a saved bound."""
    clock = [time.time()]
    async with FixtureProvider.serve() as provider:
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT, wall_clock=lambda: clock[0]
        ) as rt:
            handle = await rt.submit(REQUEST, response=Answer, job_id="j", maximum_attempts=2,
                                     unclaimed_after=60)
            prepared = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        clock[0] += 61
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT, wall_clock=lambda: clock[0]
        ):
            pass
        assert _phase(store, handle) == ("prepared", None)
        async with recoverable.open_runtime(
            store, _backend(provider, endpoint_id="elsewhere"), account=ACCOUNT,
            wall_clock=lambda: clock[0],
        ):
            pass
        assert _phase(store, handle) == ("failed", "no_worker")
        assert _phase(store, prepared) == ("prepared", None)
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT, wall_clock=lambda: clock[0]
        ) as rt:
            with trio.fail_after(5), pytest.raises(errors.PermanentlyFailed):
                await rt.wait(handle, response=Answer)
        assert generation_requests(provider, handle.operation_id) == []


async def test_the_full_sweep_applies_each_saved_bound(store: recoverable.RecoveryStore) -> None:
    clock = [time.time()]
    async with FixtureProvider.serve() as provider:
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT, wall_clock=lambda: clock[0]
        ) as rt:
            short = await rt.submit(REQUEST, response=Answer, job_id="s", maximum_attempts=2,
                                    unclaimed_after=60)
            long = await rt.submit(REQUEST, response=Answer, job_id="l", maximum_attempts=2,
                                   unclaimed_after=600)
            prepared = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
    now = clock[0] + 61
    report = await sweep(store, now=now)  # no --unclaimed-after: the saved bounds
    assert report.failed_ids == (short.operation_id,)
    assert _phase(store, long) == ("prepared", None)
    assert _phase(store, prepared) == ("prepared", None)
    again = await sweep(store, now=now)
    assert again.closed == 0  # a second sweep changes nothing
    later = await sweep(store, now=now + 600)
    assert later.failed_ids == (long.operation_id,)
    assert _phase(store, prepared) == ("prepared", None)


async def test_a_worker_that_starts_late_runs_what_waited_past_its_bound(
    store: recoverable.RecoveryStore,
) -> None:
    """A worker of its account and endpoint is exactly what it waited for: the worker's
    own runtime, opening, and its start-up sweep leave it, and the worker runs it."""
    clock = [time.time()]
    async with FixtureProvider.serve() as provider:
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT, wall_clock=lambda: clock[0]
        ) as rt:
            handle = await rt.submit(REQUEST, response=Answer, job_id="late",
                                     maximum_attempts=2, unclaimed_after=60)
        clock[0] += 61
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT, wall_clock=lambda: clock[0]
        ) as rt:
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(
                    run_worker, rt, concurrency=1, authorize=approve, stop=stop
                ))
                with trio.fail_after(30):  # generous: one short generation
                    assert isinstance(await rt.wait(handle, response=Answer), Answer)
                stop.set()
        assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_the_sweep_never_fails_what_a_live_worker_serves(
    store: recoverable.RecoveryStore,
) -> None:
    """Issue 29.11: ``sweep --unclaimed-after 5`` failed the queued jobs of a live worker's
    queue (queued long ago, not claimed yet) as no_worker."""
    async with FixtureProvider.serve(reply_delay=0.05) as provider:
        past = time.time() - 100  # submitted 100 s ago: older than every bound below
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT, wall_clock=lambda: past
        ) as old:
            handles = [
                await old.submit(_request(i), response=Answer, job_id=f"j{i}",
                                 maximum_attempts=2)
                for i in range(12)
            ]
        async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(
                    run_worker, rt, concurrency=1, authorize=approve, stop=stop
                ))
                with trio.fail_after(30):  # generous
                    await rt.wait(handles[0], response=Answer)  # it serves the queue now
                queued = len(store.queued())
                assert queued >= 5  # one at a time, 50 ms each: most are still queued
                report = await sweep(store, now=time.time(), unclaimed_after=5)
                assert report.failed == 0 and report.failed_ids == ()
                with trio.fail_after(30):  # generous: 12 short generations, one at a time
                    for handle in handles:
                        assert isinstance(await rt.wait(handle, response=Answer), Answer)
                stop.set()
            # The worker stopped just now: its account and endpoint count as served for
            # SERVED_GRACE seconds more; past that the bound applies again.
            past = time.time() - 100
            async with recoverable.open_runtime(
                store, make_backend(provider), account=ACCOUNT, wall_clock=lambda: past
            ) as old:
                late = await old.submit(_request(99), response=Answer, job_id="late",
                                        maximum_attempts=2)
            assert (await sweep(store, now=time.time(), unclaimed_after=5)).failed == 0
            report = await sweep(store, now=time.time() + SERVED_GRACE + 10, unclaimed_after=5)
            assert report.failed_ids == (late.operation_id,)
    for handle in handles:
        assert len(generation_requests(provider, handle.operation_id)) == 1
