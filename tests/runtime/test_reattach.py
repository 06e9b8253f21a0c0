"""Issue 15, in process: ``prepare(..., reattach=True)`` end to end over HTTP SSE against the
real fixture provider (its background responses keep generating after the client went
away; every POST, resume GET, retrieve and cancel is in its own request log).

A disconnect mid-stream is resumed after the saved cursor with no new POST; a response
already finished server-side is read with one GET; a gone (404 / expired), failed or
cancelled response falls back to seed 000's replacement within the budget; resume GETs
are bounded; cancel reaches the server; a stale owner (a lower fence) cannot save the
result; the default path sends ``store: false`` and does none of this.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

import recoverable
from recoverable import errors
from recoverable.actors.sweep import sweep
from recoverable.reattachment import MAX_REATTACHMENTS
from recoverable.testing import FixtureProvider, Reply, ResumeFault

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend
from .reattach_helpers import (
    EXPECTED,
    FAST,
    LONG,
    Events,
    cut,
    fixture_runtime,
    interrupt_at_checkpoint,
    posts,
    prepare,
    resumes,
    suspended_mid_stream,
)

pytestmark = pytest.mark.both_stores


async def _send(
    store: recoverable.RecoveryStore,
    provider: FixtureProvider,
    backend: recoverable.ResponsesBackend | None = None,
    **options: Any,
) -> tuple[recoverable.Handle, Answer, recoverable.Status]:
    """Prepare one operation (``prepare``'s options) on a runtime over ``backend`` (the
    provider's SSE backend unless told), send it to its end: its handle, value and status."""
    backend = backend or make_backend(provider)
    async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
        handle = await prepare(rt, **options)
        value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        status = await rt.status(handle)
    return handle, value, status


async def test_a_disconnect_mid_stream_resumes_after_the_saved_cursor(
    store: recoverable.RecoveryStore,
) -> None:
    events = Events()
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.002) as provider:
        provider.script([cut(60)])
        authorize = Authorizer()
        async with fixture_runtime(store, provider, events) as rt:
            handle = await prepare(rt)
            value = await rt.send_recovering(handle, response=Answer, authorize=authorize)
            assert value == EXPECTED
            status = await rt.status(handle)
            receipt = await rt.receipt(handle)
    assert posts(provider, handle.operation_id) == 1  # no replacement POST
    resumed = resumes(provider)
    assert len(resumed) == 1
    # Resumed after the cursor the dropped stream had reached (never from the start).
    assert resumed[0].starting_after is not None and resumed[0].starting_after >= 50
    assert len(authorize.calls) == 1  # a reattachment asks nobody and spends nothing
    assert status.attempts_used == 1 and status.reattached and status.reattachments == 1
    assert receipt.reattached and receipt.reattachments == 1
    # The saved cursor never went backwards.
    saved = [event.fields["sequence_number"] for event in events.named("attempt.checkpointed")]
    assert saved == sorted(saved) and saved
    record = store.get_operation(handle.operation_id)
    assert record is not None and record.attempts[-1].sequence_number is not None
    assert record.attempts[-1].sequence_number > resumed[0].starting_after


async def test_a_response_finished_server_side_is_read_with_one_get(
    store: recoverable.RecoveryStore,
) -> None:
    # event_delay 0: the whole response is generated at once, the client reads 5 events.
    async with FixtureProvider.serve(deltas=(200, 200)) as provider:
        provider.script([cut(5)])
        handle, value, _ = await _send(store, provider)
    assert value == EXPECTED
    assert posts(provider, handle.operation_id) == 1
    assert len(provider.retrievals) == 1 and provider.retrievals[0].kind == "resume"


@pytest.mark.parametrize("fault", [ResumeFault.not_found(), ResumeFault.expired()],
                         ids=["404", "expired"])
async def test_a_gone_response_falls_back_to_a_replacement_within_budget(
    store: recoverable.RecoveryStore, fault: ResumeFault
) -> None:
    async with FixtureProvider.serve(deltas=(20, 20)) as provider:
        provider.script([Reply.disconnect(after_events=5), Reply.complete(LONG)])
        provider.script_resumes([fault])
        handle, value, status = await _send(store, provider)
    assert value == EXPECTED
    assert posts(provider, handle.operation_id) == 2  # seed 000: one replacement
    assert len(resumes(provider)) == 1
    assert status.attempts_used == 2 and not status.reattached
    first = status.attempts[0]
    assert first.failure is not None and first.failure.kind == "reattach_unavailable"
    assert first.failure.http_status == 404 and first.reattachments == 1


async def test_a_response_failed_on_the_server_falls_back_as_the_table_says(
    store: recoverable.RecoveryStore,
) -> None:
    policy = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0,
                                     retryable_provider_codes=frozenset({"server_error"}))
    async with FixtureProvider.serve(deltas=(20, 20)) as provider:
        provider.script([Reply.failed("server_error", after_events=10, disconnect_after=4),
                         Reply.complete(LONG)])
        handle, value, status = await _send(store, provider, retry_policy=policy)
    assert value == EXPECTED
    assert posts(provider, handle.operation_id) == 2
    first = status.attempts[0]
    assert first.failure is not None and first.failure.kind == "provider_failed"
    assert first.failure.provider_code == "server_error"


async def test_a_server_failure_without_a_replacement_rule_is_terminal(
    store: recoverable.RecoveryStore,
) -> None:
    async with FixtureProvider.serve(deltas=(20, 20)) as provider:
        provider.script([Reply.failed("server_error", after_events=10, disconnect_after=4)])
        async with fixture_runtime(store, provider) as rt:
            handle = await prepare(rt)
            with pytest.raises(errors.ProviderError):
                await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    assert posts(provider, handle.operation_id) == 1
    assert len(resumes(provider)) == 1


async def test_resume_gets_are_bounded_then_seed_000_replaces(
    store: recoverable.RecoveryStore,
) -> None:
    async with FixtureProvider.serve(deltas=(50, 50), event_delay=0.05) as provider:
        provider.script([Reply.disconnect(after_events=3), Reply.complete(LONG)])
        provider.script_resumes([ResumeFault.disconnect(after_events=1)] * MAX_REATTACHMENTS)
        handle, value, status = await _send(store, provider)
    assert isinstance(value, Answer)
    assert len(resumes(provider)) == MAX_REATTACHMENTS  # then the replacement streamed whole
    assert posts(provider, handle.operation_id) == 2
    assert status.attempts[0].reattachments == MAX_REATTACHMENTS
    assert status.attempts[0].outcome == "failed"


async def test_cancel_reaches_the_server(store: recoverable.RecoveryStore) -> None:
    events = Events()
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.05) as provider:
        async with fixture_runtime(store, provider, events) as rt:
            handle = await prepare(rt)
            await interrupt_at_checkpoint(rt, handle, events, lambda: rt.cancel(handle),
                                          errors.OperationCancelled)
            status = await rt.status(handle)
    cancels = resumes(provider, "cancel")
    assert len(cancels) == 1
    rid = status.attempts[-1].response_id
    assert rid is not None and cancels[0].response_id == rid
    stored = provider.stored_response(rid)
    assert stored is not None and stored.status == "cancelled"
    assert status.state == "cancelled" and status.attempts[-1].server_cancel == "cancelled"
    assert [e.fields["result"] for e in events.named("attempt.server_cancel")] == ["cancelled"]


async def test_cancel_of_a_suspended_operation_reaches_the_server(
    store: recoverable.RecoveryStore,
) -> None:
    events = Events()
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.05) as provider:
        async with fixture_runtime(store, provider, events) as rt:
            handle = await prepare(rt)
            await interrupt_at_checkpoint(rt, handle, events, lambda: rt.suspend(handle),
                                          errors.OperationSuspended)
            assert (await rt.status(handle)).state == "suspended"
            await rt.cancel(handle)  # nobody runs it: the runtime asks the provider itself
            status = await rt.status(handle)
    assert len(resumes(provider, "cancel")) == 1
    assert status.attempts[-1].server_cancel == "cancelled"


async def test_a_stale_owner_cannot_save_the_result_and_the_new_owner_reattaches(
    store: recoverable.RecoveryStore,
) -> None:
    events = Events()
    # About 4 s of generation: the sweep takes the fence long before it ends.
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.02) as provider:
        provider.script([Reply.complete(LONG)])
        async with fixture_runtime(store, provider, events) as rt:
            handle = await prepare(rt)

            async def newer_owner() -> None:
                # A newer owner takes the fence (the sweep judges the lease expired).
                report = await sweep(store, now=time.time() + 3600.0)
                assert report.waiting_ids == (handle.operation_id,)

            await interrupt_at_checkpoint(rt, handle, events, newer_owner, errors.LeaseLost)
            record = store.get_operation(handle.operation_id)
            assert record is not None and not record.has_completion  # nothing saved by it
            assert record.phase == "waiting" and record.attempts[-1].response_id is not None
        async with fixture_runtime(store, provider) as rt:
            value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
            status = await rt.status(handle)
    assert value == EXPECTED
    assert posts(provider, handle.operation_id) == 1  # the new owner reattached
    assert len(resumes(provider)) >= 1 and status.reattached


async def test_a_websocket_backend_sends_reattach_attempts_over_http(
    store: recoverable.RecoveryStore,
) -> None:
    async with FixtureProvider.serve(deltas=(20, 20)) as provider:
        provider.script([Reply.disconnect(after_events=5)])
        handle, value, _ = await _send(store, provider, make_backend(provider, "websocket"))
    assert isinstance(value, Answer)
    sent = generation_requests(provider, handle.operation_id)
    assert [post.transport for post in sent] == ["sse"]
    assert len(resumes(provider)) == 1


async def test_the_default_path_is_unstored_and_never_reattaches(
    store: recoverable.RecoveryStore,
) -> None:
    events = Events()
    async with FixtureProvider.serve(deltas=(20, 20)) as provider:
        provider.script([Reply.disconnect(after_events=5), Reply.complete(LONG)])
        async with fixture_runtime(store, provider, events) as rt:
            handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3,
                                      retry_policy=FAST)
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    sent = generation_requests(provider, handle.operation_id)
    assert len(sent) == 2 and provider.retrievals == []
    assert all(msgspec.json.decode(post.body)["store"] is False for post in sent)
    assert all("background" not in msgspec.json.decode(post.body) for post in sent)
    assert not events.named("attempt.checkpointed") and not events.named("attempt.reattaching")


async def test_reattach_is_a_checked_bool_and_needs_a_backend_that_can_resume(
    store: recoverable.RecoveryStore, provider: FixtureProvider
) -> None:
    async with fixture_runtime(store, provider) as rt:
        with pytest.raises(errors.InvalidParameter) as bad:
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=1,
                             reattach="yes")  # type: ignore[arg-type]
        assert bad.value.parameter == "reattach"

    class Plain:  # a custom backend without a reattachment client
        def __init__(self, inner: recoverable.ResponsesBackend) -> None:
            self.endpoint_id = inner.endpoint_id
            self.credentials = inner.credentials
            self.stream = inner.stream

    async with recoverable.open_runtime(
        store, Plain(make_backend(provider)), account=ACCOUNT  # type: ignore[arg-type]
    ) as rt:
        with pytest.raises(errors.InvalidParameter) as refused:
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=1, reattach=True)
        assert refused.value.parameter == "reattach" and refused.value.reason == "refused"


async def test_an_idle_timeout_mid_stream_resumes_the_response(
    store: recoverable.RecoveryStore,
) -> None:
    async with FixtureProvider.serve(deltas=(20, 20)) as provider:
        provider.script([Reply.stall(after_events=4)])  # silent; the server finishes it
        backend = recoverable.ResponsesBackend(
            provider.http_url, mode="sse", endpoint_id="fixture",
            credentials=recoverable.StaticCredentials("sk-test-secret", account=ACCOUNT),
            # Short, so the test is quick: the stalled stream times out after 0.5 s.
            limits=recoverable.StreamLimits(idle_timeout=0.5),
        )
        handle, value, status = await _send(store, provider, backend)
    assert isinstance(value, Answer)
    assert posts(provider, handle.operation_id) == 1
    assert len(resumes(provider)) == 1 and status.reattached
    assert status.last_failure is not None and status.last_failure.kind == "timeout"


async def test_suspend_mid_stream_then_resume_reattaches_with_no_new_post(
    store: recoverable.RecoveryStore,
) -> None:
    async with suspended_mid_stream(store) as (provider, rt, handle):
        suspended = await rt.status(handle)
        assert suspended.state == "suspended" and suspended.availability == "suspended"
        authorize = Authorizer()
        value = await rt.send_recovering(handle, response=Answer, authorize=authorize)
        status = await rt.status(handle)
    assert value == EXPECTED
    assert posts(provider, handle.operation_id) == 1 and authorize.calls == []
    assert len(resumes(provider)) == 1
    assert status.attempts_used == 1 and status.reattached


async def test_an_exception_of_a_background_stream_is_raised_as_itself(
    store: recoverable.RecoveryStore, provider: FixtureProvider
) -> None:
    """The checkpoint writer runs in a nursery beside the stream: what the stream raises
    (e.g. the consumption's refusal, ``_NotTransmitted``) must reach the transmitter as
    itself, never wrapped in an ExceptionGroup it would not catch."""
    from recoverable.actors.checkpoint import checkpointed
    from recoverable.actors.execution import Execution
    from recoverable.contract import contract_for

    class Refused(Exception):
        pass

    async def refuse(report: Any) -> Any:
        raise Refused

    async with fixture_runtime(store, provider) as rt:
        execution = Execution(rt, "op_x", contract_for(Answer), Authorizer())
        with pytest.raises(Refused):
            await checkpointed(execution, "op_x.1", lambda report: None, refuse)
