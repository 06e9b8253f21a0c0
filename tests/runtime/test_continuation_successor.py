"""Issues 18 with 15 and 16: a continuation successor is the manual-retry successor
with ``selection="preserve"``, so it keeps every choice its source was prepared with:
the same frozen body AND the record fields that say how that body is run
(``reattach``: the body asks for a background, stored response; ``live``; ``source``;
``attempt_timeout``; ``on_interruption``). Real LMDB store, the fixture provider on
127.0.0.1; the dispatch is driven directly (no sleeps)."""

from __future__ import annotations

from typing import Any

import pytest

import recoverable
from recoverable import errors
from recoverable.actors.continuation import dispatch_continuation
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, make_backend
from .test_continuation import record

# A stream error event (a confirmed stream failure) that the policy allows to replace:
# two of them spend a budget of two ("stream_failures_exhausted").
STREAM_ERRORS = [Reply.error_event(code="stream_error"), Reply.error_event(code="stream_error")]
REPLACE_STREAM_ERRORS = recoverable.RetryPolicy(
    initial_backoff=0.0, retryable_provider_codes=frozenset({"stream_error"})
)


@pytest.mark.parametrize("choice", [{"reattach": True}, {"live": True}],
                         ids=["reattach", "live"])
async def test_a_continuation_successor_keeps_how_its_body_is_run(
    provider: FixtureProvider, store: recoverable.RecoveryStore, choice: dict[str, Any]
) -> None:
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    provider.script(STREAM_ERRORS)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                                  retry_policy=REPLACE_STREAM_ERRORS, **choice)
        with pytest.raises(errors.AttemptsExhausted):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        failed = record(store, handle.operation_id)
        assert failed.continuation is not None
        assert failed.continuation.state == "pending", failed.continuation
        assert rt.backend is not None
        result = await dispatch_continuation(
            store, rt.telemetry, handle.operation_id, account=ACCOUNT,
            endpoint_id=rt.backend.endpoint_id, now=rt.now(),
        )
        assert result.outcome == "dispatched" and result.successor_id is not None
        successor = record(store, result.successor_id)
        assert store.get_payload(successor.operation_id, "body") == store.get_payload(
            handle.operation_id, "body")
        for field in ("reattach", "live", "source", "attempt_timeout", "on_interruption",
                      "maximum_output_tokens_total", "model", "endpoint_id", "account"):
            assert getattr(successor, field) == getattr(failed, field), field


@pytest.mark.parametrize("change", ["set", "delete"])
async def test_a_source_change_cancels_the_pending_continuation_of_a_bound_operation(
    provider: FixtureProvider, store: recoverable.RecoveryStore, change: str
) -> None:
    """A failed source-bound operation is not superseded by a manifest change (it has no
    result to protect), but its pending continuation must not outlive the digest: the
    successor would be bound to a digest that is no longer current. Before the fix the
    dispatch raised ``InvalidParameter`` (``not_current``) on every worker pass and the
    continuation stayed pending and queued forever (a batch never finished)."""
    await store.set_source("doc-1", "sha256:v1")
    await recoverable.set_continuation_preference(store, enabled=True, delay_seconds=0)
    provider.script(STREAM_ERRORS)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                                  retry_policy=REPLACE_STREAM_ERRORS,
                                  source=recoverable.SourceRef("doc-1", "sha256:v1"))
        with pytest.raises(errors.AttemptsExhausted):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        pending = record(store, handle.operation_id).continuation
        assert pending is not None and pending.state == "pending"
        if change == "set":
            await store.set_source("doc-1", "sha256:v2")
        else:
            await store.delete_source("doc-1")
        assert rt.backend is not None
        result = await dispatch_continuation(
            store, rt.telemetry, handle.operation_id, account=ACCOUNT,
            endpoint_id=rt.backend.endpoint_id, now=rt.now(),
        )
        reason = "source_changed" if change == "set" else "source_deleted"
        assert (result.outcome, result.reason) == ("cancelled", reason)
        decided = record(store, handle.operation_id).continuation
        assert decided is not None
        assert (decided.state, decided.reason) == ("cancelled", reason)
        assert store.queued() == []
        assert len(store.inventory(ACCOUNT)[0]) == 1  # no successor
        status = await rt.status(handle)
        assert status.availability != "continuation_pending"
