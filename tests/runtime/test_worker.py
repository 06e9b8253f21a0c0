"""Issue 14 (w-worker, item 2): ``run_worker`` in one process — what it claims, its
concurrency bound, and what it leaves alone."""

from __future__ import annotations

import pytest
import trio
import trio.lowlevel

import recoverable
from recoverable import errors
from recoverable.actors.worker import run_worker
from recoverable.storage.queue import entry as queue_entry
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, OTHER, REQUEST, Answer, generation_requests, make_backend

pytestmark = pytest.mark.both_stores


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


async def test_the_worker_runs_its_account_and_endpoint_only_within_its_concurrency(
    store: recoverable.RecoveryStore,
) -> None:
    async with FixtureProvider.serve(reply_delay=0.05) as provider:
        other_account = recoverable.ResponsesBackend(
            provider.http_url, mode="sse", endpoint_id="fixture",
            credentials=recoverable.StaticCredentials("k", account=OTHER),
        )
        async with recoverable.open_runtime(store, other_account, account=OTHER) as rt:
            foreign = await rt.submit(REQUEST, response=Answer, job_id="x", maximum_attempts=2)
        elsewhere = recoverable.ResponsesBackend(
            provider.http_url, mode="sse", endpoint_id="elsewhere",
            credentials=recoverable.StaticCredentials("k", account=ACCOUNT),
        )
        async with recoverable.open_runtime(store, elsewhere, account=ACCOUNT) as rt:
            other_endpoint = await rt.submit(REQUEST, response=Answer, job_id="e",
                                             maximum_attempts=2)
        async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
            handles = [
                await rt.submit(REQUEST, response=Answer, job_id=f"j{i}", maximum_attempts=2)
                for i in range(9)
            ]
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                reports = []

                async def work() -> None:
                    reports.append(await run_worker(rt, concurrency=3, authorize=approve,
                                                    stop=stop))

                nursery.start_soon(work)
                with trio.fail_after(30):  # generous: 9 short generations
                    for handle in handles:
                        assert isinstance(await rt.wait(handle, response=Answer), Answer)
                stop.set()
        assert reports[0].completed == 9
        # Never more than 3 generations in flight at the provider.
        spans = sorted(
            (r.received_at, r.finished_at or r.received_at) for r in provider.requests
        )
        assert max(sum(1 for s, e in spans if s <= start < e) for start, _ in spans) <= 3
        for handle in handles:
            assert len(generation_requests(provider, handle.operation_id)) == 1
        # Another account's and another endpoint's operations stay queued, untouched.
        assert {e.operation_id for e in store.queued()} == {
            foreign.operation_id, other_endpoint.operation_id
        }
        assert generation_requests(provider, foreign.operation_id) == []
        assert generation_requests(provider, other_endpoint.operation_id) == []


async def test_a_host_suspension_is_not_resumed_by_a_worker(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        held = await rt.submit(REQUEST, response=Answer, job_id="held", maximum_attempts=2)
        await rt.suspend(held)
        runs = await rt.submit(REQUEST, response=Answer, job_id="runs", maximum_attempts=2)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: run_worker(rt, concurrency=2, authorize=approve,
                                                  stop=stop))
            with trio.fail_after(30):  # generous
                await rt.wait(runs, response=Answer)
            stop.set()
        with pytest.raises(errors.OperationSuspended):
            await rt.wait(held, response=Answer)
    assert generation_requests(provider, held.operation_id) == []


async def test_run_worker_checks_its_arguments(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        for bad in (0, -1, 10_001, True, 1.5):
            with pytest.raises(errors.InvalidRequest, match="concurrency"):
                await run_worker(rt, concurrency=bad, authorize=approve)  # type: ignore[arg-type]
        with pytest.raises(errors.InvalidRequest, match="authorize"):
            await run_worker(rt, concurrency=1, authorize=None)  # type: ignore[arg-type]
    async with recoverable.open_runtime(store, None, account=ACCOUNT) as rt:
        with pytest.raises(errors.ConfigurationUnavailable):
            await run_worker(rt, concurrency=1, authorize=approve)


async def test_status_says_whether_a_live_worker_serves_a_queued_operation(
    store: recoverable.RecoveryStore,
) -> None:
    # The reply is held 1 s: "queued" lasts that long, which the poll below must see (a
    # status read is a thread's round trip on PostgreSQL; a loaded machine stalls them).
    async with FixtureProvider.serve(reply_delay=1.0) as provider:
        async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
            handle = await rt.submit(REQUEST, response=Answer, job_id="q", maximum_attempts=2)
            assert (await rt.status(handle)).queue == "waiting_for_worker"
            assert (await rt.inventory()).operations[0].queue == "waiting_for_worker"
            prepared = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
            assert (await rt.status(prepared)).queue is None  # not submitted: not queued
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: run_worker(rt, concurrency=1, authorize=approve,
                                                      stop=stop))
                with trio.fail_after(30):  # generous
                    while (await rt.status(handle)).queue != "queued":  # noqa: ASYNC110
                        await trio.sleep(0.01)  # (a store row: no Event says it)
                    await rt.wait(handle, response=Answer)
                assert (await rt.status(handle)).queue is None  # completed: settled
                stop.set()
            later = await rt.submit(REQUEST, response=Answer, job_id="q2", maximum_attempts=2)
            # The worker stopped: its row is gone, nobody serves the queue now.
            assert (await rt.status(later)).queue == "waiting_for_worker"
        assert store.check_integrity() == []


async def test_a_worker_claims_a_marked_suspension_with_its_lease_in_one_commit(
    store: recoverable.RecoveryStore,
) -> None:
    """A stopped worker's mark says "the next worker resumes it". Claiming spends the
    mark in the commit that takes the lease: no committed state in which the operation
    is suspended, unmarked and unheld (what a waiting host reads as "suspended from
    outside", ending its wait), and the mark is gone once it runs."""
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.stall(after_events=2)])
        async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
            handle = await rt.submit(REQUEST, response=Answer, job_id="m", maximum_attempts=2)
            op = handle.operation_id
            await rt.suspend(handle)
            await store.write(lambda txn: txn.enqueue(op, resume=True))
            seen: list[tuple[str, bool, bool]] = []
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: run_worker(rt, concurrency=1, authorize=approve,
                                                      stop=stop))
                with trio.fail_after(30):  # generous: one claim on a loaded machine
                    while True:
                        record = store.get_operation(op)
                        entry = queue_entry(store, op)
                        lease = store.get_lease(op)
                        assert record is not None and entry is not None
                        seen.append((record.phase, entry.resume, lease is not None))
                        if lease is not None and record.phase != "suspended":
                            break
                        await trio.lowlevel.checkpoint()  # every scheduling point of the claim
                await provider.wait_for_requests(1)
                stop.set()
        stranded = [s for s in seen if s == ("suspended", False, False)]
        assert stranded == [], seen
        assert seen[0] == ("suspended", True, False) and seen[-1][1:] == (False, True)
