"""Issue 29 (items 14, 15, 17): the continuation rules that leaked.

- a policy named by ``error.type`` (and a provider word nobody can read) is never
  continued, end to end through the transport;
- cancelling or suspending an operation applies to the continuation successors dispatched
  after it: an idle one is stopped in the same transaction (no worker runs it), a running
  one through the normal command path (the lifecycle monitor), a successor's successor too;
- ``AttemptsExhausted`` says so when a continuation is pending;
- a signed-out runtime's worker dispatches nothing;
- ``fan_in`` refuses an operation that is not that child of the group, ``Thread.commit``
  another thread's turn;
- ``receipt`` and ``wait`` read the one cancel-fence rule (``machine.cancel_fences``).

Progress is observed as durable state (records, command rows) or events; the wall clock
is injected (``Wall``); nothing waits for a fixed time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

import recoverable
from recoverable import errors, machine
from recoverable.actors import worker as worker_module
from recoverable.actors.continuation import dispatch_continuation
from recoverable.actors.worker import run_worker
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend
from .test_continuation import DROPS, FAST, T0, Wall, record, until

DONE = Reply.complete({"answer": 42, "note": "n"})


async def _dispatch(rt: recoverable.Runtime, source_id: str) -> str:
    """Dispatch the source's pending continuation now (as a worker would); its successor."""
    assert rt.backend is not None
    result = await dispatch_continuation(rt.store, rt.telemetry, source_id, account=ACCOUNT,
                                         endpoint_id=rt.backend.endpoint_id, now=rt.now())
    assert result.outcome == "dispatched", result
    assert result.successor_id is not None
    return result.successor_id


@asynccontextmanager
async def _worker(rt: recoverable.Runtime, authorize: Any) -> AsyncIterator[list[Any]]:
    reports: list[Any] = []
    stop = trio.Event()

    async def work() -> None:
        reports.append(await run_worker(rt, concurrency=2, authorize=authorize, stop=stop))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(work)
        yield reports
        stop.set()


async def _exhausted(rt: recoverable.Runtime) -> recoverable.Handle:
    """An operation that spent its two attempts on stream drops (continuation pending)."""
    handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, retry_policy=FAST)
    with pytest.raises(errors.AttemptsExhausted):
        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    return handle


# -- 14: error.type and unreadable words, through the transport ------------------------------

@pytest.mark.parametrize(("last", "reason"), [
    (Reply.error_event(error_type="cyber_policy", code="other"), "excluded_failure"),
    (Reply.error_event(error_type="misalignment", code="other"), "excluded_failure"),
    (Reply.error_event(code="cyber policy violation"), "no_evidence"),  # has spaces
    (Reply.error_event(code="x" * 80), "no_evidence"),  # over-long
])
async def test_a_policy_type_or_an_unreadable_code_after_a_drop_is_not_continued(
    provider: FixtureProvider, store: recoverable.RecoveryStore, last: Reply, reason: str
) -> None:
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    provider.script([Reply.disconnect(after_events=2), last])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                                  retry_policy=FAST)
        with pytest.raises(errors.ProviderError):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        failed = record(store, handle.operation_id)
        assert failed.attempts[0].failure is not None
        assert failed.attempts[0].failure.kind == "disconnected"
        assert failed.continuation is not None
        assert (failed.continuation.state, failed.continuation.reason) == ("declined", reason)
        assert store.queued() == []
    assert len(provider.requests) == 2


# -- 15: user intent on a lineage member applies to its successors ----------------------------

@pytest.mark.parametrize(("stop", "phase", "error"), [
    ("cancel", "cancelled", errors.OperationCancelled),
    ("suspend", "suspended", errors.OperationSuspended),
])
async def test_stopping_the_source_stops_its_idle_successor_before_any_worker(
    provider: FixtureProvider, store: recoverable.RecoveryStore, stop: str, phase: str,
    error: type[Exception],
) -> None:
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    provider.script([*DROPS, DONE])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        source = await _exhausted(rt)
        successor_id = await _dispatch(rt, source.operation_id)
        assert record(store, successor_id).phase == "prepared"
        await getattr(rt, stop)(source)
        # The same transaction stopped the successor: nothing is left for a worker.
        assert record(store, successor_id).phase == phase
        authorize = Authorizer()
        async with _worker(rt, authorize):
            with pytest.raises(error):
                await rt.wait(source, response=Answer)
            with pytest.raises(error):
                await rt.wait(recoverable.Handle(successor_id), response=Answer)
            await until(lambda: all(e.operation_id != successor_id or stop == "suspend"
                                    for e in store.queued()), "the worker let it be")
        assert record(store, successor_id).phase == phase
        assert authorize.calls == []
    assert generation_requests(provider, successor_id) == []
    assert len(provider.requests) == 2


class Gate:
    """An authorizer that holds the successor's attempt until the test opens it."""

    def __init__(self, held: str) -> None:
        self.held = held
        self.asked = trio.Event()
        self.open = trio.Event()

    async def __call__(self, attempt: recoverable.Attempt) -> bool:
        if attempt.operation_id == self.held:
            self.asked.set()
            await self.open.wait()
        return True


@pytest.mark.parametrize(("stop", "phase", "error"), [
    ("cancel", "cancelled", errors.OperationCancelled),
    ("suspend", "suspended", errors.OperationSuspended),
])
async def test_stopping_the_source_stops_its_running_successor(
    provider: FixtureProvider, store: recoverable.RecoveryStore, stop: str, phase: str,
    error: type[Exception],
) -> None:
    """The successor is running on a worker (its attempt waits for the host's answer):
    the source's cancel (suspend) reaches it through its command row and the lifecycle
    monitor; it sends nothing, and ``wait`` on the source raises the stop."""
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    provider.script([*DROPS, DONE])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        source = await _exhausted(rt)
        successor_id = await _dispatch(rt, source.operation_id)
        gate = Gate(successor_id)
        async with _worker(rt, gate):
            with trio.fail_after(30):
                await gate.asked.wait()  # the worker runs it: its lease is live
            assert store.get_lease(successor_id) is not None
            await getattr(rt, stop)(source)
            await until(lambda: record(store, successor_id).phase == phase,
                        "the running successor stopped")
            with pytest.raises(error):
                await rt.wait(source, response=Answer)
            gate.open.set()
        assert record(store, successor_id).attempts_used == 0
    assert generation_requests(provider, successor_id) == []


async def test_a_successors_successor_is_stopped_too(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Two continuations deep: cancelling the first operation cancels the queued second
    successor; a pending continuation further along is cancelled too."""
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0,
                                                  budget=3)
    provider.script([*DROPS, *DROPS, *DROPS])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        source = await _exhausted(rt)
        first = await _dispatch(rt, source.operation_id)
        with pytest.raises(errors.AttemptsExhausted):
            await rt.send_recovering(recoverable.Handle(first), response=Answer,
                                     authorize=Authorizer())
        second = await _dispatch(rt, first)
        with pytest.raises(errors.AttemptsExhausted):
            await rt.send_recovering(recoverable.Handle(second), response=Answer,
                                     authorize=Authorizer())
        pending = record(store, second).continuation
        assert pending is not None and pending.state == "pending"
        await rt.suspend(source)
        stopped = record(store, second).continuation
        assert stopped is not None and (stopped.state, stopped.reason) == (
            "cancelled", "suspended")
        assert [e.operation_id for e in store.queued()] == []
    assert len(provider.requests) == 6


async def test_cancelling_the_source_cancels_a_queued_successors_successor(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    provider.script([*DROPS, *DROPS])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        source = await _exhausted(rt)
        first = await _dispatch(rt, source.operation_id)
        with pytest.raises(errors.AttemptsExhausted):
            await rt.send_recovering(recoverable.Handle(first), response=Answer,
                                     authorize=Authorizer())
        second = await _dispatch(rt, first)
        await rt.cancel(source)
        assert record(store, second).phase == "cancelled"
        assert record(store, first).phase == "failed"  # settled: nothing runs it again
        with pytest.raises(errors.OperationCancelled):
            await rt.wait(source, response=Answer)
    assert generation_requests(provider, second) == []


async def test_a_completed_successor_is_left_as_it_is(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Only what is pending or running is stopped: a successor whose result is saved keeps
    it (a suspend of the source changes nothing of it)."""
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    provider.script([*DROPS, DONE])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        source = await _exhausted(rt)
        successor_id = await _dispatch(rt, source.operation_id)
        value = await rt.send_recovering(recoverable.Handle(successor_id), response=Answer,
                                         authorize=Authorizer())
        await rt.suspend(source)
        assert record(store, successor_id).phase == "completed"
        assert await rt.wait(source, response=Answer) == value


# -- 17: the smaller ones --------------------------------------------------------------------

async def test_attempts_exhausted_says_a_continuation_is_pending(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=60)
    provider.script(DROPS)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                                  retry_policy=FAST)
        with pytest.raises(errors.AttemptsExhausted) as raised:
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        for exc in (raised.value, machine.terminal_error(record(store, handle.operation_id))):
            assert isinstance(exc, errors.AttemptsExhausted)
            assert exc.continuation_pending
            assert "a continuation is pending" in str(exc)
            assert "nothing more is sent automatically" not in str(exc)
        # Opening it again (a host that calls send_recovering again) says the same.
        with pytest.raises(errors.AttemptsExhausted, match="a continuation is pending"):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        await rt.cancel(handle)  # no longer pending: the plain message again
    cancelled = errors.AttemptsExhausted(operation_id="op")
    assert "nothing more is sent automatically" in str(cancelled)


async def test_a_signed_out_runtime_dispatches_nothing(
    provider: FixtureProvider, store: recoverable.RecoveryStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wall = Wall()
    looked = trio.Event()  # the worker looked at the due continuation after the sign-out
    results: list[Any] = []

    async def watched(*args: Any, **kwargs: Any) -> Any:
        result = await dispatch_continuation(*args, **kwargs)
        if kwargs["now"] >= T0 + 3600:
            results.append(result)
            looked.set()
        return result

    monkeypatch.setattr(worker_module, "dispatch_continuation", watched)
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=60)
    provider.script([*DROPS, DONE])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT,
                                        wall_clock=wall) as rt:
        handle = await rt.submit(REQUEST, response=Answer, job_id="j", maximum_attempts=2,
                                 retry_policy=FAST)
        async with _worker(rt, Authorizer()) as reports:
            await until(lambda: record(store, handle.operation_id).continuation is not None,
                        "the failure was decided")
            rt.sign_out()
            wall.now = T0 + 3600  # long past the due time
            with trio.fail_after(30):
                await looked.wait()
        assert reports[0].continued == 0
        assert [result.outcome for result in results] == ["not_mine"]
        decided = record(store, handle.operation_id).continuation
        assert decided is not None and decided.state == "pending"
        assert len(store.inventory(ACCOUNT)[0]) == 1  # no successor
    assert len(provider.requests) == 2


async def test_fan_in_refuses_an_operation_that_is_not_that_child(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([DONE] * 4)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        group = rt.delegate("g1", builder=lambda values: REQUEST, response=Answer)
        other_group = rt.delegate("g2", builder=lambda values: REQUEST, response=Answer)
        child = await group.child("a", REQUEST, response=Answer)
        stranger = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
        foreign = await other_group.child("a", REQUEST, response=Answer)
        for handles in ({"a": stranger}, {"a": foreign}, {"b": child}):
            with pytest.raises(errors.InvalidRequest, match="not that child"):
                await group.fan_in(handles, authorize=Authorizer())
        assert store.get_operation(group.parent_id()) is None  # no parent
    assert provider.requests == []  # refused before anything ran


async def test_a_thread_commits_only_its_own_turns(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([DONE])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        mine = rt.thread("mine", response=Answer, model="gpt-test")
        theirs = rt.thread("theirs", response=Answer, model="gpt-test")
        turn = await mine.turn("question")
        await mine.send(turn, authorize=Authorizer())
        with pytest.raises(errors.InvalidRequest, match="another thread"):
            await theirs.commit(turn)
        assert not record(store, turn.operation_id).thread_committed
        await mine.commit(turn)
        assert record(store, turn.operation_id).thread_committed


async def test_receipt_and_wait_read_the_one_cancel_fence_rule(
    provider: FixtureProvider, store: recoverable.RecoveryStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``machine.cancel_fences`` is the rule ``receipt`` and ``wait`` apply (its own test in
    tests/test_machine_commands.py tests the code that runs)."""
    provider.script([DONE])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        asked: list[tuple[str, object]] = []

        def fences(rec: Any, command: Any) -> bool:
            asked.append((rec.operation_id, command))
            return True

        monkeypatch.setattr(machine, "cancel_fences", fences)
        with pytest.raises(errors.OperationCancelled):
            await rt.receipt(handle)
        with pytest.raises(errors.OperationCancelled):
            await rt.wait(handle, response=Answer)
        assert asked == [(handle.operation_id, None)] * 2
