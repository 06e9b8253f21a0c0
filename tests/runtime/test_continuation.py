"""Issue 18: opt-in continuation after a terminal stream failure, end to end in one
process: a real LMDB store, the fixture provider on 127.0.0.1 (both transports), the
worker draining the queue. The wall clock is injected (``Wall``) so the persisted due
time is reached by moving it, never by sleeping; progress is observed as durable state.

What the fixture simulates: the provider drops the stream (TCP close mid-stream) on each
scripted attempt, or sends a stream ``error`` event / ``response.failed`` with a given
code. No real upstream incident (a provider exhausting its own retries) is reproduced.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

import recoverable
from recoverable import errors
from recoverable.actors.continuation import dispatch_continuation
from recoverable.actors.worker import run_worker
from recoverable.records import OperationRecord
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend

pytestmark = pytest.mark.both_stores

T0 = 1_800_000_000.0
FAST = recoverable.RetryPolicy(initial_backoff=0.0)
DROPS = [Reply.disconnect(after_events=2), Reply.disconnect(after_events=2)]


class Wall:
    """An injected wall clock: moves only when the test says so."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


async def until(check: Callable[[], Awaitable[bool] | bool], what: str) -> None:
    """Poll durable state until ``check`` holds (a generous bound: the machine is loaded)."""
    with trio.fail_after(30):  # generous: a few local generations
        while True:
            result = check()
            if result if isinstance(result, bool) else await result:
                return
            await trio.sleep(0.01)
    raise AssertionError(what)  # pragma: no cover


def record(store: recoverable.RecoveryStore, operation_id: str) -> OperationRecord:
    found = store.get_operation(operation_id)
    assert found is not None
    return found


def continued_state(store: recoverable.RecoveryStore, operation_id: str) -> str | None:
    found = store.get_operation(operation_id)
    if found is None or found.continuation is None:
        return None
    return found.continuation.state


@asynccontextmanager
async def worker(rt: recoverable.Runtime, authorize: Any) -> AsyncIterator[None]:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: run_worker(rt, concurrency=4, authorize=authorize, stop=stop))
        yield
        stop.set()


async def submit(rt: recoverable.Runtime, job: str = "job-1", revision: str = "1",
                 attempts: int = 2) -> recoverable.Handle:
    return await rt.submit(REQUEST, response=Answer, job_id=job, input_revision=revision,
                           maximum_attempts=attempts, retry_policy=FAST)


async def test_the_preference_is_off_by_default_persists_and_is_reversible(
    store_location: str,
) -> None:
    path = store_location  # a directory (LMDB) or a fresh database's URL (PostgreSQL)
    with recoverable.RecoveryStore.open(path) as store:
        assert recoverable.continuation_preference(store).enabled is False  # a fresh store
        on = await recoverable.set_continuation_preference(store, enabled=True,
                                                           delay_seconds=5, budget=3)
        assert (on.enabled, on.delay_seconds, on.budget) == (True, 5.0, 3)
    with recoverable.RecoveryStore.open(path) as store:  # it persists
        assert recoverable.continuation_preference(store) == on
        off = await recoverable.set_continuation_preference(store, enabled=False)
        assert (off.enabled, off.delay_seconds, off.budget) == (False, 5.0, 3)  # reversible
        for bad in ({"budget": 11}, {"budget": -1}, {"delay_seconds": -1.0},
                    {"enabled": "yes"}, {"budget": True}):
            with pytest.raises(errors.InvalidRequest):
                await recoverable.set_continuation_preference(store, **bad)
        assert recoverable.continuation_preference(store) == off  # a refusal changes nothing


async def test_off_no_continuation_ever_starts(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    wall = Wall()
    provider.script([*DROPS, Reply.complete({"answer": 42, "note": "late"})])
    async with recoverable.open_runtime(store, make_backend(provider, mode), account=ACCOUNT,
                                        wall_clock=wall) as rt:
        handle = await submit(rt)
        async with worker(rt, Authorizer()):
            with pytest.raises(errors.AttemptsExhausted):
                await rt.wait(handle, response=Answer)
            wall.now += 10 * 3600  # hours pass: nothing is continued
            await until(lambda: not store.queued(), "the failed operation left the queue")
        failed = record(store, handle.operation_id)
        assert failed.continuation is None and failed.retry_reservation is None
        status = await rt.status(handle)
        assert status.availability == "exhausted" and status.continuation is None
    assert len(generation_requests(provider, handle.operation_id)) == 2
    assert len(provider.requests) == 2


async def test_a_stream_failure_run_is_continued_once_after_the_delay(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    """Criterion 2 and 9: failure, delayed eligibility, exactly one continuation (the same
    frozen body, model, account and endpoint), authorized like any attempt."""
    wall = Wall()
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=600)
    provider.script([*DROPS, Reply.complete({"answer": 42, "note": "continued"})])
    authorize = Authorizer()
    events: list[recoverable.TelemetryEvent] = []
    async with recoverable.open_runtime(store, make_backend(provider, mode), account=ACCOUNT,
                                        wall_clock=wall, telemetry=events.append) as rt:
        handle = await submit(rt)
        async with worker(rt, authorize):
            await until(lambda: continued_state(store, handle.operation_id) == "pending",
                        "the failure was decided")
            failed = record(store, handle.operation_id)
            assert (failed.phase, failed.failure_reason) == ("failed", "exhausted")
            assert [a.failure.kind for a in failed.attempts if a.failure] == [
                "disconnected", "disconnected"]
            status = await rt.status(handle)
            assert status.state == "failed"
            assert status.availability == "continuation_pending"
            assert status.continuation is not None
            assert status.continuation.reason == "stream_failures_exhausted"
            assert status.continuation.due_at is not None
            assert status.continuation.due_at.timestamp() == pytest.approx(
                failed.continuation.due_at if failed.continuation else 0)
            assert status.continuation.budget_left == 2
            assert [s.availability for s in (await rt.inventory()).operations] == [
                "continuation_pending"]
            # Not due: the worker keeps it queued and creates nothing.
            assert [e.operation_id for e in store.queued()] == [handle.operation_id]
            assert len(provider.requests) == 2
            wall.now += 600
            value = await rt.wait(handle, response=Answer)  # follows the continuation
            assert value == Answer(42, "continued")
        source = record(store, handle.operation_id)
        assert source.continuation is not None
        assert source.continuation.state == "dispatched"
        successor_id = source.continuation.successor_id
        assert successor_id is not None
        successor = record(store, successor_id)
        assert successor.previous_operation_id == handle.operation_id
        assert successor.root_operation_id == handle.operation_id
        assert (successor.body_hash, successor.model, successor.account,
                successor.endpoint_id) == (source.body_hash, source.model, source.account,
                                           source.endpoint_id)
        assert successor.continuations_used == 1
        assert store.get_payload(successor_id, "body") == store.get_payload(
            handle.operation_id, "body")
        done = await rt.status(handle)
        assert done.successor_id == successor_id
        assert done.continuation is not None
        assert (done.continuation.state, done.continuation.budget_left) == ("dispatched", 1)
        assert done.availability == "exhausted"  # the source itself stays as it ended
        # The successor's attempt was asked for like any other.
        assert [c.operation_id for c in authorize.calls].count(successor_id) == 1
        # Repeating the dispatch (a duplicate event, another worker, a restart) does nothing.
        again = await dispatch_continuation(store, rt.telemetry, handle.operation_id,
                                            account=ACCOUNT, endpoint_id=rt.backend.endpoint_id,
                                            now=wall.now)
        assert again.outcome == "not_pending"
    assert len(generation_requests(provider, handle.operation_id)) == 2
    assert len(generation_requests(provider, successor_id)) == 1
    seen = [(e.name, e.operation_id, e.fields) for e in events
            if e.name.startswith("recovery.continuation.")]
    assert seen == [
        ("recovery.continuation.scheduled", handle.operation_id,
         {"reason": "stream_failures_exhausted", "due_at": T0 + 600, "budget_left": 2}),
        ("recovery.continuation.dispatched", handle.operation_id,
         {"successor_id": successor_id, "model": "gpt-test"}),
    ]
    bodies = {r.body for r in provider.requests}
    assert len(bodies) == 1  # the same frozen body every time: no prompt change


async def test_concurrent_dispatches_create_one_successor(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Criterion 5: concurrent recovery paths meet one durable dispatch record."""
    wall = Wall()
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    provider.script(DROPS)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT,
                                        wall_clock=wall) as rt:
        handle = await submit(rt)
        with pytest.raises(errors.AttemptsExhausted):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert continued_state(store, handle.operation_id) == "pending"
        results = []

        async def one() -> None:
            results.append(await dispatch_continuation(
                store, rt.telemetry, handle.operation_id, account=ACCOUNT,
                endpoint_id=rt.backend.endpoint_id, now=wall.now))

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(one)
        assert sorted(r.outcome for r in results) == ["dispatched"] + ["not_pending"] * 7
        ids = store.inventory(ACCOUNT)[0]
        assert len(ids) == 2  # the source and ONE successor


async def test_the_budget_persists_across_the_lineage_and_never_resets(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Criteria 5 and 9: continuations until the lineage's budget (2) is spent; the last
    failure is declined with ``budget_spent``; a manual retry does not reset the count."""
    wall = Wall()
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=1)
    provider.script(DROPS * 3)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT,
                                        wall_clock=wall) as rt:
        handle = await submit(rt)
        lineage = [handle.operation_id]
        async with worker(rt, Authorizer()):
            for _ in range(2):
                current = lineage[-1]
                await until(lambda c=current: continued_state(store, c) == "pending",  # type: ignore[misc]
                            "pending")
                wall.now += 1

                def successor_known(c: str = current) -> bool:
                    found = store.get_operation(c)
                    return bool(found and found.continuation
                                and found.continuation.state == "dispatched")

                await until(successor_known, "dispatched")
                nxt = record(store, current).continuation
                assert nxt is not None and nxt.successor_id is not None
                lineage.append(nxt.successor_id)
            last = lineage[-1]
            await until(lambda: continued_state(store, last) == "declined", "declined")
            with pytest.raises(errors.AttemptsExhausted):
                await rt.wait(handle, response=Answer)
        final = record(store, last)
        assert final.continuations_used == 2
        assert final.continuation is not None and final.continuation.reason == "budget_spent"
        status = await rt.status(recoverable.Handle(last))
        assert status.availability == "exhausted"
        assert status.continuation is not None and status.continuation.budget_left == 0
        # A deliberate manual retry carries the count: its failure is not continued either.
        provider.script(DROPS)
        retried = await rt.retry(recoverable.Handle(last), retry_action_id="click-1",
                                 maximum_attempts=2, selection="preserve")
        assert record(store, retried.operation_id).continuations_used == 2
        with pytest.raises(errors.AttemptsExhausted):
            await rt.send_recovering(retried, response=Answer, authorize=Authorizer())
        again = record(store, retried.operation_id).continuation
        assert again is not None and (again.state, again.reason) == ("declined", "budget_spent")
    assert len(provider.requests) == 8  # 2 per operation: 3 in the lineage + the manual one


@pytest.mark.parametrize(("replies", "reason"), [
    ([Reply.rate_limited(0.0), Reply.rate_limited(0.0)], "excluded_failure"),  # 429
    ([Reply.quota_exceeded()], "excluded_failure"),
    ([Reply.unauthorized(), Reply.unauthorized()], "excluded_failure"),  # authentication
    ([Reply.forbidden()], "excluded_failure"),
    ([Reply.failed("server_is_overloaded")], "excluded_failure"),  # overload
    ([Reply.failed("cyber_policy")], "excluded_failure"),  # an explicit policy error
    ([Reply.http_error(400, {"error": {"type": "invalid_request_error",
                                       "code": "context_length_exceeded",
                                       "message": "too long"}})], "excluded_failure"),
    ([Reply.invalid_json()], "excluded_failure"),  # invalid output
    ([Reply.failed("other")], "no_evidence"),  # an unrelated unknown failure
    ([Reply.disconnect(after_events=2), Reply.failed("server_is_overloaded")],
     "excluded_failure"),
    ([Reply.disconnect(after_events=2), Reply.http_error(500)], "changed_failure"),
])
async def test_excluded_failures_are_never_continued(
    provider: FixtureProvider, store: recoverable.RecoveryStore,
    replies: list[Any], reason: str,
) -> None:
    """Criteria 3 and 8: declined with an accurate reason; no successor, no model,
    endpoint or account change."""
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    provider.script(replies)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                                  retry_policy=FAST)
        with pytest.raises(errors.RecoveryError):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        failed = record(store, handle.operation_id)
        assert failed.phase == "failed", failed
        assert failed.continuation is not None
        assert (failed.continuation.state, failed.continuation.reason) == ("declined", reason)
        assert (await rt.status(handle)).continuation is not None
        assert store.queued() == []
        assert len(store.inventory(ACCOUNT)[0]) == 1


async def test_a_generic_final_code_after_stream_failures_is_continued(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Criterion 3: the seed's chain (stream drops, then ``other``) stays distinguishable
    from an unrelated unknown failure (the parametrized ``failed("other")`` above)."""
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    provider.script([Reply.disconnect(after_events=2), Reply.failed("other")])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await submit(rt)
        with pytest.raises(errors.ProviderError):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        decided = record(store, handle.operation_id).continuation
        assert decided is not None
        assert (decided.state, decided.reason) == ("pending", "stream_failures_then_generic")


async def test_success_suspension_and_a_quiet_completion_create_none(
    store: recoverable.RecoveryStore,
) -> None:
    """Criterion 4: a successful run, a slow stream that completes, and a caller that went
    away (a suspension) decide nothing."""
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    async with FixtureProvider.serve(reply_delay=0.3) as provider:
        async with recoverable.open_runtime(store, make_backend(provider),
                                            account=ACCOUNT) as rt:
            fine = await submit(rt, job="fine")
            assert isinstance(await rt.send_recovering(fine, response=Answer,
                                                       authorize=Authorizer()), Answer)
            gone = await submit(rt, job="gone")
            with trio.move_on_after(0.1):  # the caller goes away mid-attempt
                await rt.send_recovering(gone, response=Answer, authorize=Authorizer())
            assert record(store, gone.operation_id).phase == "suspended"
            for handle in (fine, gone):
                assert record(store, handle.operation_id).continuation is None
                assert (await rt.status(handle)).continuation is None


async def test_inflight_and_waiting_operations_are_never_dispatched(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Criterion 4: only a failed record with a pending continuation is dispatched."""
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await submit(rt)
        result = await dispatch_continuation(store, rt.telemetry, handle.operation_id,
                                             account=ACCOUNT, endpoint_id=rt.backend.endpoint_id,
                                             now=rt.now())
        assert result.outcome == "not_pending"
        assert record(store, handle.operation_id).phase == "prepared"
