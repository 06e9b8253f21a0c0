"""Issue 18: threads — turns as operations whose frozen body carries the committed
history; one turn in flight; a turn commits when the host says so; a turn that failed on
stream failures is continued with its history (earlier receipts reused, never
regenerated); a newer turn cancels a pending continuation."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

import recoverable
from recoverable import errors
from recoverable.actors.worker import run_worker
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, Answer, Authorizer, generation_requests, make_backend
from .test_continuation import DROPS, FAST, Wall, record, until

pytestmark = pytest.mark.both_stores


def sent_input(provider: FixtureProvider, operation_id: str) -> list[Any]:
    """The ``input`` of the last generation request of an operation, as the provider got it."""
    request = generation_requests(provider, operation_id)[-1]
    body: dict[str, Any] = json.loads(request.body)
    items: list[Any] = body["input"]
    return items


def thread(rt: recoverable.Runtime, name: str = "t1") -> Any:
    return rt.thread(name, response=Answer, model="gpt-test", instructions="Be brief.",
                     maximum_attempts=2, retry_policy=FAST)


async def test_each_turn_carries_the_committed_history_and_one_turn_is_in_flight(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.complete({"answer": 1, "note": "one"}),
                     Reply.complete({"answer": 2, "note": "two"})])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        chat = thread(rt)
        first = await chat.turn("first question")
        assert await chat.turn("first question") == first  # the same input: the same turn
        with pytest.raises(errors.ThreadTurnActive):
            await chat.turn("too early")  # the first turn is not even sent
        assert await chat.send(first, authorize=Authorizer()) == Answer(1, "one")
        with pytest.raises(errors.ThreadTurnActive):
            await chat.turn("still too early")  # completed, not committed by the host
        await chat.commit(first)
        await chat.commit(first)  # idempotent
        second = await chat.turn("second question")
        assert await chat.send(second, authorize=Authorizer()) == Answer(2, "two")
        assert [(t.number, t.state) for t in chat.turns()] == [(1, "committed"),
                                                               (2, "completed")]
    assert sent_input(provider, first.operation_id) == [
        {"role": "user", "content": "first question"}]
    assert sent_input(provider, second.operation_id) == [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": json.dumps({"answer": 1, "note": "one"},
                                                    separators=(",", ":"))},
        {"role": "user", "content": "second question"},
    ]
    assert len(provider.requests) == 2  # the first turn's receipt was reused, not regenerated


async def test_server_side_state_is_an_unsupported_form(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        with pytest.raises(errors.InvalidRequest, match="server_state"):
            rt.thread("t", response=Answer, model="gpt-test", server_state=True)
        with pytest.raises(errors.CompletionUnavailable):
            chat = thread(rt)
            turn = await chat.turn("q")
            await chat.commit(turn)  # nothing to commit yet


async def test_a_failed_turn_is_continued_with_its_history(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Criteria 2 and 7: the second turn's stream drops until its budget is spent; a worker
    continues it once; the first turn's saved result is reused in the successor's body."""
    wall = Wall()
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=30)
    provider.script([Reply.complete({"answer": 1, "note": "one"}), *DROPS,
                     Reply.complete({"answer": 2, "note": "two"})])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT,
                                        wall_clock=wall) as rt:
        chat = thread(rt)
        first = await chat.turn("first")
        await chat.send(first, authorize=Authorizer())
        await chat.commit(first)
        second = await chat.turn("second", queue=True)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: run_worker(rt, concurrency=2, authorize=Authorizer(),
                                                  stop=stop))
            await until(lambda: (record(store, second.operation_id).continuation
                                 is not None), "the failed turn was decided")
            assert [(t.number, t.state) for t in chat.turns()] == [
                (1, "committed"), (2, "continuation_pending")]
            wall.now += 30
            value = await rt.wait(second, response=Answer)
            stop.set()
        assert value == Answer(2, "two")
        decided = record(store, second.operation_id).continuation
        assert decided is not None and decided.successor_id is not None
        await chat.commit(second)  # through the lineage: the successor is committed
        assert record(store, decided.successor_id).thread_committed
        assert [(t.number, t.state, t.operation_id) for t in chat.turns()] == [
            (1, "committed", first.operation_id), (2, "committed", decided.successor_id)]
        third = await chat.turn("third")  # the history now holds both turns
        assert record(store, third.operation_id).input_revision == "turn-000003"
    assert len(generation_requests(provider, first.operation_id)) == 1
    assert sent_input(provider, decided.successor_id) == sent_input(provider,
                                                                    second.operation_id)
    assert sent_input(provider, decided.successor_id)[:2] == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": json.dumps({"answer": 1, "note": "one"},
                                                    separators=(",", ":"))},
    ]


async def test_a_newer_turn_cancels_a_pending_continuation(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Criterion 6: the user asked something new: the failed turn is not continued."""
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    provider.script(DROPS)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        chat = thread(rt)
        failed = await chat.turn("lost question")
        with pytest.raises(errors.AttemptsExhausted):
            await rt.send_recovering(failed, response=Answer, authorize=Authorizer())
        pending = record(store, failed.operation_id).continuation
        assert pending is not None and pending.state == "pending"
        newer = await chat.turn("new question")  # the user asked again: that wins
        assert record(store, newer.operation_id).input_revision == "turn-000002"
        stopped = record(store, failed.operation_id).continuation
        assert stopped is not None and (stopped.state, stopped.reason) == (
            "cancelled", "newer_turn")
        assert [(t.number, t.state) for t in chat.turns()] == [(1, "failed"), (2, "active")]
        with pytest.raises(errors.ThreadTurnActive):
            await chat.turn("and again")  # the new turn is in flight now
    assert len(provider.requests) == 2


async def test_dispatch_sees_a_newer_turn(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """The newer-turn check itself: a later turn created while the continuation was
    pending (another process, a race) cancels it at dispatch with ``newer_turn``."""
    from recoverable.actors.continuation import dispatch_continuation

    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    provider.script(DROPS)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        chat = thread(rt)
        failed = await chat.turn("lost question")
        with pytest.raises(errors.AttemptsExhausted):
            await rt.send_recovering(failed, response=Answer, authorize=Authorizer())
        later = chat.admit(
            recoverable.StructuredRequest(model="gpt-test", input="raced"), "turn-000002")

        def put(txn: Any) -> None:
            from recoverable.actors.prepare import put_new_operation

            put_new_operation(txn, *later)

        await store.write(put)
        assert rt.backend is not None
        result = await dispatch_continuation(store, rt.telemetry, failed.operation_id,
                                             account=ACCOUNT,
                                             endpoint_id=rt.backend.endpoint_id, now=rt.now())
        assert (result.outcome, result.reason) == ("cancelled", "newer_turn")
