"""``Runtime.acknowledge_many``: many acknowledgements in one store write, each operation
acknowledged or refused on its own (the batch host acknowledges the jobs it just
committed this way: cli/acknowledger.py)."""

from __future__ import annotations

import pytest

import recoverable
from recoverable import errors
from recoverable.testing import FixtureProvider

from .conftest import ACCOUNT, REQUEST, Answer, completed_operations, make_backend

pytestmark = pytest.mark.both_stores


async def test_many_are_acknowledged_in_one_write_and_a_refusal_stops_only_its_own(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        done = await completed_operations(rt, 6)
        await rt.acknowledge(done[0])  # already acknowledged: a repeat is no refusal
        waiting = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)  # no result
        missing = recoverable.Handle("op_" + "0" * 40)
        before = store.stats()["writes"]
        refused = await rt.acknowledge_many([*done, waiting, missing])
        assert store.stats()["writes"] == before + 1  # one write for all of them
        assert sorted(refused) == sorted([waiting.operation_id, missing.operation_id])
        assert isinstance(refused[missing.operation_id], errors.StateUnavailable)
        assert isinstance(refused[waiting.operation_id], errors.CompletionUnavailable)
        for handle in done:
            disposition = store.get_disposition(handle.operation_id)
            assert disposition is not None and disposition.disposition == "acknowledged"
            assert store.get_operation(handle.operation_id) is None  # content removed
        status = await rt.status(waiting)
        assert status.state == "prepared"  # untouched by its refusal
        assert await rt.acknowledge_many([]) == {}
    assert store.check_integrity() == []
