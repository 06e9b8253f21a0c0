"""Issue 18, criterion 7: delegated operations — children fan out, the parent is prepared
from their saved results by the host's deterministic builder (fan-in), each child's result
reaches the parent exactly once; a recovering child never completes the parent early; a
recovering parent reuses the children's results; a child that failed for good stops the
fan-in with its own typed error."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec
import pytest
import trio

import recoverable
from recoverable import errors
from recoverable.actors.worker import run_worker
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, Answer, Authorizer, generation_requests, make_backend
from .test_continuation import DROPS, FAST, Wall, record, until

pytestmark = pytest.mark.both_stores


def combine(values: Mapping[str, Any]) -> recoverable.StructuredRequest:
    """The host's deterministic builder: the children's values, in key order."""
    return recoverable.StructuredRequest(
        model="gpt-test", instructions="Combine the answers.",
        input=msgspec.json.encode({key: values[key] for key in sorted(values)}).decode(),
    )


def ask(text: str) -> recoverable.StructuredRequest:
    return recoverable.StructuredRequest(model="gpt-test", instructions="Answer.", input=text)


def parent_input(provider: FixtureProvider, operation_id: str) -> Any:
    body = json.loads(generation_requests(provider, operation_id)[-1].body)
    return json.loads(body["input"] if isinstance(body["input"], str)
                      else body["input"][0]["content"])


async def test_fan_out_fan_in_delivers_each_child_once(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.complete({"answer": 1, "note": "a"}),
                     Reply.complete({"answer": 2, "note": "b"}),
                     Reply.complete({"answer": 3, "note": "sum"})])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        group = rt.delegate("g1", builder=combine, response=Answer, maximum_attempts=2)
        kids = {key: await group.child(key, ask(key), response=Answer) for key in ("a", "b")}
        assert await group.child("a", ask("a"), response=Answer) == kids["a"]  # idempotent
        with pytest.raises(errors.JobConflict):
            await group.child("a", ask("changed"), response=Answer)
        parent = await group.fan_in(kids, authorize=Authorizer())
        results = []

        async def again() -> None:
            results.append(await group.fan_in(kids, authorize=Authorizer()))

        async with trio.open_nursery() as nursery:  # concurrent fan-ins: one parent
            for _ in range(4):
                nursery.start_soon(again)
        assert {handle.operation_id for handle in results} == {parent.operation_id}
        assert await group.send(parent, authorize=Authorizer()) == Answer(3, "sum")
        assert len(store.inventory(ACCOUNT)[0]) == 3
    assert parent_input(provider, parent.operation_id) == {
        "a": {"answer": 1, "note": "a"}, "b": {"answer": 2, "note": "b"}}
    assert [len(generation_requests(provider, kid.operation_id)) for kid in kids.values()] == [
        1, 1]


async def test_a_recovering_child_never_completes_the_parent_early(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    wall = Wall()
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=30)
    provider.script([Reply.complete({"answer": 1, "note": "a"}), *DROPS,
                     Reply.complete({"answer": 2, "note": "b again"}),
                     Reply.complete({"answer": 3, "note": "sum"})])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT,
                                        wall_clock=wall) as rt:
        group = rt.delegate("g2", builder=combine, response=Answer, maximum_attempts=2,
                            retry_policy=FAST)
        kids = {key: await group.child(key, ask(key), response=Answer, maximum_attempts=2,
                                       queue=True) for key in ("a", "b")}
        parents: list[recoverable.Handle] = []
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: run_worker(rt, concurrency=1, authorize=Authorizer(),
                                                  stop=stop))

            async def fan_in() -> None:
                parents.append(await group.fan_in(kids, queue=True))

            nursery.start_soon(fan_in)
            await until(lambda: (record(store, kids["b"].operation_id).continuation
                                 is not None), "child b failed and waits for its continuation")
            # Child b is recovering: the parent does not exist yet.
            assert store.get_operation(group.parent_id()) is None
            assert not parents
            wall.now += 30
            await until(lambda: bool(parents), "fan-in after b recovered")
            value = await rt.wait(parents[0], response=Answer)
            stop.set()
        assert value == Answer(3, "sum")
        decided = record(store, kids["b"].operation_id).continuation
        assert decided is not None and decided.successor_id is not None
    # b's result reached the parent once: the successor's value, not twice, not the failure.
    assert parent_input(provider, parents[0].operation_id) == {
        "a": {"answer": 1, "note": "a"}, "b": {"answer": 2, "note": "b again"}}
    assert len(generation_requests(provider, kids["a"].operation_id)) == 1


async def test_a_recovering_parent_reuses_the_children_results(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    provider.script([Reply.complete({"answer": 1, "note": "a"}), *DROPS,
                     Reply.complete({"answer": 3, "note": "sum"})])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        group = rt.delegate("g3", builder=combine, response=Answer, maximum_attempts=2,
                            retry_policy=FAST)
        kid = await group.child("a", ask("a"), response=Answer)
        parent = await group.fan_in({"a": kid}, authorize=Authorizer())
        # The parent's stream drops until its budget is spent; its continuation runs here.
        assert await group.send(parent, authorize=Authorizer()) == Answer(3, "sum")
        successor = group.settled_parent(parent)
        assert successor != parent.operation_id
        assert record(store, successor).body_hash == record(store, parent.operation_id).body_hash
    assert len(generation_requests(provider, kid.operation_id)) == 1  # never regenerated
    assert parent_input(provider, successor) == {"a": {"answer": 1, "note": "a"}}


async def test_a_child_that_failed_for_good_stops_the_fan_in_with_its_reason(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    provider.script([Reply.complete({"answer": 1, "note": "a"}), Reply.quota_exceeded()])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        group = rt.delegate("g4", builder=combine, response=Answer)
        kids = {key: await group.child(key, ask(key), response=Answer) for key in ("a", "b")}
        with pytest.raises(errors.ProviderError) as failed:
            await group.fan_in(kids, authorize=Authorizer())
        assert failed.value.operation_id == kids["b"].operation_id
        assert store.get_operation(group.parent_id()) is None
        decided = record(store, kids["b"].operation_id).continuation
        assert decided is not None and (decided.state, decided.reason) == (
            "declined", "excluded_failure")


async def test_a_nondeterministic_builder_is_refused(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    calls: list[int] = []

    def drifting(values: Mapping[str, Any]) -> recoverable.StructuredRequest:
        calls.append(1)
        return recoverable.StructuredRequest(model="gpt-test", input=f"call {len(calls)}")

    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        group = rt.delegate("g5", builder=drifting, response=Answer)
        kid = await group.child("a", ask("a"), response=Answer)
        with pytest.raises(errors.InvalidRequest, match="deterministic"):
            await group.fan_in({"a": kid}, authorize=Authorizer())
        assert store.get_operation(group.parent_id()) is None
