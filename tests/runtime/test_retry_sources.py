"""Manual retry (issue 14) of a source-bound operation (issue 16) that failed for good and
whose source then changed or was deleted: a failed operation is not superseded by the
manifest change (it has no result to protect), but its successor would be bound to a
digest that is no longer current. The retry is refused BEFORE anything is reserved on
the source ("check first, reserve second", actors/retry.py): no dangling reservation
naming a successor that never existed, and the source stays retryable once its digest is
current again. Real LMDB store, the fixture provider on 127.0.0.1."""

from __future__ import annotations

import pytest

import recoverable
from recoverable import errors
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, make_backend

DOC = recoverable.SourceRef("doc-1", "sha256:v1")


@pytest.mark.parametrize("change", ["set", "delete"])
async def test_a_retry_bound_to_a_stale_digest_is_refused_before_any_reservation(
    provider: FixtureProvider, store: recoverable.RecoveryStore, change: str
) -> None:
    await store.set_source("doc-1", "sha256:v1")
    provider.script([Reply.failed("server_error"), Reply.complete({"answer": 42, "note": "n"})])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1, source=DOC)
        with pytest.raises(errors.ProviderError):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        if change == "set":
            await store.set_source("doc-1", "sha256:v2")
        else:
            await store.delete_source("doc-1")
        with pytest.raises(errors.InvalidParameter) as stale:
            await rt.retry(handle, retry_action_id="user-click", maximum_attempts=1)
        assert (stale.value.parameter, stale.value.reason) == ("source", "not_current")
        source = store.get_operation(handle.operation_id)
        assert source is not None and source.retry_reservation is None
        assert (await rt.status(handle)).successor_id is None
        assert len(store.inventory(ACCOUNT)[0]) == 1  # no successor
        # The digest current again: another action creates the successor (before the
        # fix: RetryAlreadyCreated, naming the dangling successor that never existed).
        await store.set_source("doc-1", "sha256:v1")
        successor = await rt.retry(handle, retry_action_id="another-click", maximum_attempts=1)
        value = await rt.send_recovering(successor, response=Answer, authorize=Authorizer())
    assert value == Answer(answer=42, note="n")
