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

import attrs
import msgspec
import pytest
import trio
from recoverable.actors.sweep import sweep

import recoverable
from recoverable import errors
from recoverable.reattachment import MAX_REATTACHMENTS
from recoverable.telemetry import TelemetryEvent
from recoverable.testing import FixtureProvider, Reply, ResumeFault

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend

STORE_KINDS = ("lmdb", "postgresql")  # one suite, two stores (issue 17)

FAST = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
LONG = {"answer": 42, "note": "n" * 400}  # with deltas=(200, 200): 200 delta events
EXPECTED = Answer(answer=42, note="n" * 400)


def _cut(after_events: int) -> Reply:
    """The long answer, its connection dropped after ``after_events`` events (a background
    response goes on generating on the server)."""
    return attrs.evolve(Reply.complete(LONG), disconnect_after=after_events)


class Events:
    """A telemetry sink that remembers every event and wakes waiters by name."""

    def __init__(self) -> None:
        self.seen: list[TelemetryEvent] = []
        self._changed = trio.Event()

    def __call__(self, event: TelemetryEvent) -> None:
        self.seen.append(event)
        self._changed.set()
        self._changed = trio.Event()

    def named(self, name: str) -> list[TelemetryEvent]:
        return [event for event in self.seen if event.name == f"recovery.{name}"]

    async def wait_for(self, name: str, count: int = 1) -> None:
        while len(self.named(name)) < count:
            await self._changed.wait()


def _resumes(provider: FixtureProvider, kind: str = "resume") -> list[Any]:
    return [retrieval for retrieval in provider.retrievals if retrieval.kind == kind]


def _posts(provider: FixtureProvider, operation_id: str) -> int:
    return len(generation_requests(provider, operation_id))


async def _prepare(rt: recoverable.Runtime, **options: Any) -> recoverable.Handle:
    options.setdefault("maximum_attempts", 3)
    options.setdefault("retry_policy", FAST)
    return await rt.prepare(REQUEST, response=Answer, reattach=True, **options)


async def test_a_disconnect_mid_stream_resumes_after_the_saved_cursor(
    store: recoverable.RecoveryStore,
) -> None:
    events = Events()
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.002) as provider:
        provider.script([_cut(60)])
        authorize = Authorizer()
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT, telemetry=events
        ) as rt:
            handle = await _prepare(rt)
            value = await rt.send_recovering(handle, response=Answer, authorize=authorize)
            assert value == EXPECTED
            status = await rt.status(handle)
            receipt = await rt.receipt(handle)
    assert _posts(provider, handle.operation_id) == 1  # no replacement POST
    resumes = _resumes(provider)
    assert len(resumes) == 1
    # Resumed after the cursor the dropped stream had reached (never from the start).
    assert resumes[0].starting_after is not None and resumes[0].starting_after >= 50
    assert len(authorize.calls) == 1  # a reattachment asks nobody and spends nothing
    assert status.attempts_used == 1 and status.reattached and status.reattachments == 1
    assert receipt.reattached and receipt.reattachments == 1
    # The saved cursor never went backwards.
    saved = [event.fields["sequence_number"] for event in events.named("attempt.checkpointed")]
    assert saved == sorted(saved) and saved
    record = store.get_operation(handle.operation_id)
    assert record is not None and record.attempts[-1].sequence_number is not None
    assert record.attempts[-1].sequence_number > resumes[0].starting_after


async def test_a_response_finished_server_side_is_read_with_one_get(
    store: recoverable.RecoveryStore,
) -> None:
    # event_delay 0: the whole response is generated at once, the client reads 5 events.
    async with FixtureProvider.serve(deltas=(200, 200)) as provider:
        provider.script([_cut(5)])
        async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
            handle = await _prepare(rt)
            value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    assert value == EXPECTED
    assert _posts(provider, handle.operation_id) == 1
    assert len(provider.retrievals) == 1 and provider.retrievals[0].kind == "resume"


@pytest.mark.parametrize("fault", [ResumeFault.not_found(), ResumeFault.expired()],
                         ids=["404", "expired"])
async def test_a_gone_response_falls_back_to_a_replacement_within_budget(
    store: recoverable.RecoveryStore, fault: ResumeFault
) -> None:
    async with FixtureProvider.serve(deltas=(20, 20)) as provider:
        provider.script([Reply.disconnect(after_events=5), Reply.complete(LONG)])
        provider.script_resumes([fault])
        async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
            handle = await _prepare(rt)
            value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
            status = await rt.status(handle)
    assert value == EXPECTED
    assert _posts(provider, handle.operation_id) == 2  # seed 000: one replacement
    assert len(_resumes(provider)) == 1
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
        async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
            handle = await _prepare(rt, retry_policy=policy)
            value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
            status = await rt.status(handle)
    assert value == EXPECTED
    assert _posts(provider, handle.operation_id) == 2
    first = status.attempts[0]
    assert first.failure is not None and first.failure.kind == "provider_failed"
    assert first.failure.provider_code == "server_error"


async def test_a_server_failure_without_a_replacement_rule_is_terminal(
    store: recoverable.RecoveryStore,
) -> None:
    async with FixtureProvider.serve(deltas=(20, 20)) as provider:
        provider.script([Reply.failed("server_error", after_events=10, disconnect_after=4)])
        async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
            handle = await _prepare(rt)
            with pytest.raises(errors.ProviderError):
                await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    assert _posts(provider, handle.operation_id) == 1
    assert len(_resumes(provider)) == 1


async def test_resume_gets_are_bounded_then_seed_000_replaces(
    store: recoverable.RecoveryStore,
) -> None:
    async with FixtureProvider.serve(deltas=(50, 50), event_delay=0.05) as provider:
        provider.script([Reply.disconnect(after_events=3), Reply.complete(LONG)])
        provider.script_resumes([ResumeFault.disconnect(after_events=1)] * MAX_REATTACHMENTS)
        async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
            handle = await _prepare(rt)
            value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
            status = await rt.status(handle)
    assert isinstance(value, Answer)
    assert len(_resumes(provider)) == MAX_REATTACHMENTS  # then the replacement streamed whole
    assert _posts(provider, handle.operation_id) == 2
    assert status.attempts[0].reattachments == MAX_REATTACHMENTS
    assert status.attempts[0].outcome == "failed"


async def test_cancel_reaches_the_server(store: recoverable.RecoveryStore) -> None:
    events = Events()
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.05) as provider:
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT, telemetry=events
        ) as rt:
            handle = await _prepare(rt)
            async with trio.open_nursery() as nursery:
                async def send() -> None:
                    with pytest.raises(errors.OperationCancelled):
                        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())

                nursery.start_soon(send)
                await events.wait_for("attempt.checkpointed")  # the response id is saved
                await rt.cancel(handle)
            status = await rt.status(handle)
    cancels = _resumes(provider, "cancel")
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
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT, telemetry=events
        ) as rt:
            handle = await _prepare(rt)
            async with trio.open_nursery() as nursery:
                async def send() -> None:
                    with pytest.raises(errors.OperationSuspended):
                        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())

                nursery.start_soon(send)
                await events.wait_for("attempt.checkpointed")
                await rt.suspend(handle)
            assert (await rt.status(handle)).state == "suspended"
            await rt.cancel(handle)  # nobody runs it: the runtime asks the provider itself
            status = await rt.status(handle)
    assert len(_resumes(provider, "cancel")) == 1
    assert status.attempts[-1].server_cancel == "cancelled"


async def test_a_stale_owner_cannot_save_the_result_and_the_new_owner_reattaches(
    store: recoverable.RecoveryStore,
) -> None:
    events = Events()
    # About 4 s of generation: the sweep takes the fence long before it ends.
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.02) as provider:
        provider.script([Reply.complete(LONG)])
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT, telemetry=events
        ) as rt:
            handle = await _prepare(rt)
            async with trio.open_nursery() as nursery:
                async def stale() -> None:
                    with pytest.raises(errors.LeaseLost):
                        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())

                nursery.start_soon(stale)
                await events.wait_for("attempt.checkpointed")
                # A newer owner takes the fence (the sweep judges the lease expired).
                report = await sweep(store, now=time.time() + 3600.0)
                assert report.waiting_ids == (handle.operation_id,)
            record = store.get_operation(handle.operation_id)
            assert record is not None and not record.has_completion  # nothing saved by it
            assert record.phase == "waiting" and record.attempts[-1].response_id is not None
        async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
            value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
            status = await rt.status(handle)
    assert value == EXPECTED
    assert _posts(provider, handle.operation_id) == 1  # the new owner reattached
    assert len(_resumes(provider)) >= 1 and status.reattached


async def test_a_websocket_backend_sends_reattach_attempts_over_http(
    store: recoverable.RecoveryStore,
) -> None:
    async with FixtureProvider.serve(deltas=(20, 20)) as provider:
        provider.script([Reply.disconnect(after_events=5)])
        backend = make_backend(provider, "websocket")
        async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
            handle = await _prepare(rt)
            value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    assert isinstance(value, Answer)
    posts = generation_requests(provider, handle.operation_id)
    assert [post.transport for post in posts] == ["sse"]
    assert len(_resumes(provider)) == 1


async def test_the_default_path_is_unstored_and_never_reattaches(
    store: recoverable.RecoveryStore,
) -> None:
    events = Events()
    async with FixtureProvider.serve(deltas=(20, 20)) as provider:
        provider.script([Reply.disconnect(after_events=5), Reply.complete(LONG)])
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT, telemetry=events
        ) as rt:
            handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3,
                                      retry_policy=FAST)
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    posts = generation_requests(provider, handle.operation_id)
    assert len(posts) == 2 and provider.retrievals == []
    assert all(msgspec.json.decode(post.body)["store"] is False for post in posts)
    assert all("background" not in msgspec.json.decode(post.body) for post in posts)
    assert not events.named("attempt.checkpointed") and not events.named("attempt.reattaching")


async def test_reattach_is_a_checked_bool_and_needs_a_backend_that_can_resume(
    store: recoverable.RecoveryStore, provider: FixtureProvider
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
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
        async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
            handle = await _prepare(rt)
            value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
            status = await rt.status(handle)
    assert isinstance(value, Answer)
    assert _posts(provider, handle.operation_id) == 1
    assert len(_resumes(provider)) == 1 and status.reattached
    assert status.last_failure is not None and status.last_failure.kind == "timeout"


async def test_suspend_mid_stream_then_resume_reattaches_with_no_new_post(
    store: recoverable.RecoveryStore,
) -> None:
    events = Events()
    # About 6 s of generation: the suspension lands long before it ends.
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.03) as provider:
        provider.script([Reply.complete(LONG)])
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT, telemetry=events
        ) as rt:
            handle = await _prepare(rt, maximum_attempts=1)
            async with trio.open_nursery() as nursery:
                async def send() -> None:
                    with pytest.raises(errors.OperationSuspended):
                        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())

                nursery.start_soon(send)
                await events.wait_for("attempt.checkpointed")
                await rt.suspend(handle)
            suspended = await rt.status(handle)
            assert suspended.state == "suspended" and suspended.availability == "suspended"
            authorize = Authorizer()
            value = await rt.send_recovering(handle, response=Answer, authorize=authorize)
            status = await rt.status(handle)
    assert value == EXPECTED
    assert _posts(provider, handle.operation_id) == 1 and authorize.calls == []
    assert len(_resumes(provider)) == 1
    assert status.attempts_used == 1 and status.reattached


async def test_an_exception_of_a_background_stream_is_raised_as_itself(
    store: recoverable.RecoveryStore, provider: FixtureProvider
) -> None:
    """The checkpoint writer runs in a nursery beside the stream: what the stream raises
    (e.g. the consumption's refusal, ``_NotTransmitted``) must reach the transmitter as
    itself, never wrapped in an ExceptionGroup it would not catch."""
    from recoverable.actors.operation import OperationActor

    from recoverable.contract import contract_for

    class Refused(Exception):
        pass

    async def refuse(report: Any) -> Any:
        raise Refused

    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        actor = OperationActor(rt, "op_x", contract_for(Answer), Authorizer())
        with pytest.raises(Refused):
            await actor._checkpointed("op_x.1", lambda report: None, refuse)
