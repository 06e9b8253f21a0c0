"""Issue 29, item 16: a thread's committed history survives the seed-000 acknowledge step.

Acknowledging (or abandoning) a thread turn removes its record and content; the thread's
row (``storage/threads.py``) keeps what the thread needs, in the same transaction: the
turn numbering goes on and the next turn's body carries the committed history. Purging
the account removes the row with the rest.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import recoverable
from recoverable import errors
from recoverable.storage.threads import read_row, row_id
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, Answer, Authorizer, make_backend
from .test_continuation import DROPS, FAST, record
from .test_thread import sent_input

pytestmark = pytest.mark.both_stores  # the row is a payload row: both stores


def _answer(answer: int, note: str) -> str:
    return json.dumps({"answer": answer, "note": note}, separators=(",", ":"))


def _thread(rt: recoverable.Runtime, name: str = "t1") -> Any:
    return rt.thread(name, response=Answer, model="gpt-test", instructions="Be brief.",
                     maximum_attempts=2, retry_policy=FAST)


@pytest.mark.parametrize("dispose", ["acknowledge", "abandon"])
async def test_disposing_the_latest_committed_turn_keeps_numbering_and_context(
    provider: FixtureProvider, store: recoverable.RecoveryStore, dispose: str
) -> None:
    provider.script([Reply.complete({"answer": 1, "note": "one"}),
                     Reply.complete({"answer": 2, "note": "two"}),
                     Reply.complete({"answer": 3, "note": "three"})])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        chat = _thread(rt)
        first = await chat.turn("first")
        await chat.send(first, authorize=Authorizer())
        await chat.commit(first)
        await getattr(rt, dispose)(first)  # the host's seed-000 step after its commit
        assert store.get_operation(first.operation_id) is None  # the content went
        assert [(t.number, t.state, t.operation_id) for t in chat.turns()] == [
            (1, "committed", first.operation_id)]
        second = await chat.turn("second")
        assert record(store, second.operation_id).input_revision == "turn-000002"
        await chat.send(second, authorize=Authorizer())
        await chat.commit(second)
        await getattr(rt, dispose)(second)
        third = await chat.turn("third")  # every turn's records are gone now
        assert record(store, third.operation_id).input_revision == "turn-000003"
        await chat.send(third, authorize=Authorizer())
    assert sent_input(provider, second.operation_id) == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": _answer(1, "one")},
        {"role": "user", "content": "second"},
    ]
    assert sent_input(provider, third.operation_id) == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": _answer(1, "one")},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": _answer(2, "two")},
        {"role": "user", "content": "third"},
    ]


async def test_a_disposed_uncommitted_turn_keeps_its_number_not_its_content(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """A turn that failed for good, abandoned: the next turn still gets the next number,
    and its history stops at the last committed turn (the abandoned one is not in it)."""
    provider.script([Reply.complete({"answer": 1, "note": "one"}), *DROPS,
                     Reply.complete({"answer": 3, "note": "three"})])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        chat = _thread(rt)
        first = await chat.turn("first")
        await chat.send(first, authorize=Authorizer())
        await chat.commit(first)
        lost = await chat.turn("lost")
        with pytest.raises(errors.AttemptsExhausted):
            await chat.send(lost, authorize=Authorizer())
        await rt.abandon(lost)
        third = await chat.turn("third")
        assert record(store, third.operation_id).input_revision == "turn-000003"
        await chat.send(third, authorize=Authorizer())
    assert sent_input(provider, third.operation_id) == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": _answer(1, "one")},
        {"role": "user", "content": "third"},
    ]


async def test_purging_the_account_removes_the_threads_row(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.complete({"answer": 1, "note": "one"})])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        chat = _thread(rt)
        first = await chat.turn("first")
        await chat.send(first, authorize=Authorizer())
        await chat.commit(first)
        await rt.acknowledge(first)
        row = read_row(store, ACCOUNT, "t1")
        assert row is not None and (row.latest_turn, row.committed_turn) == (1, 1)
        store.purge_account(ACCOUNT)
        assert store.get_payload(row_id(ACCOUNT, "t1"), "request") is None
        fresh = await chat.turn("again")  # a purged thread starts over
        assert record(store, fresh.operation_id).input_revision == "turn-000001"
