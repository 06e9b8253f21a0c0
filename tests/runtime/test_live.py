"""Live operations in a Trio application (issue 16): ``runtime.live`` shows ephemeral
partial views while the operation streams, over both transports; the final value is the
saved receipt's; a slow consumer never blocks the transport and never misses the value;
an interruption is never replaced: its typed error is raised from the loop, and no
partial view is ever in the store (the files are scanned).

Barriers: the provider's pacing (a keepalive pause or a stall after N events: the stream
is silent there, so the consumer — woken by the delta that came before — always runs
first), durable state and Trio events. No fixed sleep decides anything."""

from __future__ import annotations

import functools

import msgspec
import pytest
import trio

import recoverable
from recoverable import errors
from recoverable.testing import FixtureProvider, Reply

from .conftest import Authorizer, generation_requests
from .live_child import ACCOUNT, REQUEST, Story
from .live_scan import assert_views_never_stored

pytestmark = pytest.mark.both_stores

FAST = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)


def backend(provider: FixtureProvider, mode: str) -> recoverable.ResponsesBackend:
    return recoverable.ResponsesBackend(
        provider.http_url, mode=mode, endpoint_id="fixture",  # type: ignore[arg-type]
        credentials=recoverable.StaticCredentials("sk-live-test", account=ACCOUNT),
    )


def saved(store: recoverable.RecoveryStore, handle: recoverable.Handle) -> bool:
    record = store.get_operation(handle.operation_id)
    return record is not None and record.has_completion


def is_prefix_view(shown: object, final: object) -> bool:
    """``partial`` shows a prefix of the final value: fields complete or cut short."""
    if isinstance(final, dict):
        return isinstance(shown, dict) and all(
            key in final and is_prefix_view(value, final[key]) for key, value in shown.items()
        )
    if isinstance(final, str):
        return isinstance(shown, str) and final.startswith(shown)
    return shown == final


async def test_a_trio_app_shows_partial_views_then_the_saved_value(
    store_location: str, mode: str
) -> None:
    path = store_location  # a directory (LMDB) or a database URL (PostgreSQL)
    screen: list[recoverable.PartialView] = []  # what the app showed a person
    async with FixtureProvider.serve() as provider:
        # Two of four deltas, then the stream is silent for a moment (keepalives only).
        provider.script([Reply.keepalive(pause=0.2, every=0.05, after_events=6)])
        with recoverable.RecoveryStore.open(str(path)) as store:
            async with backend(provider, mode) as b, recoverable.open_runtime(
                store, b, account=ACCOUNT
            ) as rt:
                handle = await rt.prepare(REQUEST, response=Story, maximum_attempts=2, live=True)
                results: list[Story] = []

                async def show(task_status: trio.TaskStatus[None]) -> None:
                    async with rt.live(handle, response=Story, authorize=Authorizer()) as live:
                        with pytest.raises(errors.CompletionUnavailable):
                            live.value  # noqa: B018 (not before the loop has ended)
                        task_status.started()
                        async for view in live:
                            screen.append(view)
                        results.append(live.value)

                async with trio.open_nursery() as app:
                    await app.start(show)
                [value] = results
                receipt = await rt.receipt(handle)
                final = receipt.payload
                # The value is the saved receipt's (saved before it became available).
                assert value == msgspec.json.decode(final, type=Story)
        assert len(generation_requests(provider, handle.operation_id)) == 1
    assert screen, "no partial view was shown"
    whole = msgspec.json.decode(final)
    # At least one view came before the end (during the pause), with fields parsed so far.
    assert any(len(view.text) < len(final) for view in screen)
    for view in screen:
        assert final.startswith(view.text.encode()) and view.attempt == 1
        assert view.partial is None or is_prefix_view(view.partial, whole)
    assert [view.sequence for view in screen] == sorted({view.sequence for view in screen})
    assert any(isinstance(view.partial, dict) and view.partial for view in screen)
    assert_views_never_stored(path, [view.text for view in screen], control=REQUEST.input,
                              receipt=final)


async def test_a_slow_consumer_never_blocks_the_transport_nor_misses_the_value(
    store_location: str, mode: str
) -> None:
    async with FixtureProvider.serve(deltas=(40, 40)) as provider:
        with recoverable.RecoveryStore.open(store_location) as store:
            async with backend(provider, mode) as b, recoverable.open_runtime(
                store, b, account=ACCOUNT
            ) as rt:
                handle = await rt.prepare(REQUEST, response=Story, maximum_attempts=1, live=True)
                async with rt.live(handle, response=Story, authorize=Authorizer()) as live:
                    # The consumer does not read until the receipt is durable: the whole
                    # stream (40 deltas) went through without it.
                    with trio.fail_after(60):  # generous: a loaded 2-core machine
                        while not saved(store, handle):  # noqa: ASYNC110 (durable state)
                            await trio.sleep(0.005)
                    views = [view async for view in live]
                    value = live.value
                final = store.get_payload(handle.operation_id, "completion")
        assert final is not None
        assert value == msgspec.json.decode(final, type=Story)
        # Every intermediate view was dropped: one view, the latest text, then the value.
        assert len(views) == 1 and live.views == 1
        assert views[0].text.encode() == final and views[0].sequence == 41  # begin + deltas
        assert views[0].partial == msgspec.json.decode(final)


async def test_an_interruption_is_raised_from_the_loop_and_never_replaced(
    store_location: str, mode: str
) -> None:
    path = store_location  # a directory (LMDB) or a database URL (PostgreSQL)
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.disconnect(after_events=6), Reply.synthesize()])
        authorize = Authorizer()
        seen: list[str] = []
        with recoverable.RecoveryStore.open(str(path)) as store:
            async with backend(provider, mode) as b, recoverable.open_runtime(
                store, b, account=ACCOUNT
            ) as rt:
                handle = await rt.prepare(REQUEST, response=Story, maximum_attempts=3,
                                          retry_policy=FAST, live=True)
                with pytest.raises(errors.PermanentlyFailed) as raised:
                    async with rt.live(handle, response=Story, authorize=authorize) as live:
                        async for view in live:
                            seen.append(view.text)
                assert raised.value.last_failure is not None
                assert raised.value.last_failure.kind == "disconnected"
                record = store.get_operation(handle.operation_id)
                assert record is not None and record.phase == "failed"
                assert record.failure_reason == "interrupted" and record.attempts_used == 1
                assert not record.has_completion
                with pytest.raises(errors.CompletionUnavailable):
                    live.value  # noqa: B018
                status = await rt.status(handle)
                assert status.suggested_actions == ("manual_retry", "abandon")

                # Continuing is one explicit call: a manual retry, a linked successor.
                child = await rt.retry(handle, retry_action_id="try-again", maximum_attempts=2)
                async with rt.live(child, response=Story, authorize=authorize) as again:
                    async for _ in again:
                        pass
                receipt = await rt.receipt(child)
                assert again.value == msgspec.json.decode(receipt.payload, type=Story)
                assert receipt.previous_operation_id == handle.operation_id
                assert receipt.root_operation_id == handle.operation_id
        assert len(generation_requests(provider, handle.operation_id)) == 1  # not replaced
        assert len(authorize.calls) == 2  # one for each operation
    assert seen[0] == "" and seen[-1]  # the attempt began (empty), then its text so far
    assert_views_never_stored(path, seen, control=REQUEST.input, receipt=receipt.payload)


@pytest.mark.parametrize("leave", ["break", "cancel"])
async def test_leaving_the_block_early_stops_a_live_operation_as_failed(
    store_location: str, leave: str
) -> None:
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.stall(after_events=6)])
        with recoverable.RecoveryStore.open(store_location) as store:
            async with backend(provider, "sse") as b, recoverable.open_runtime(
                store, b, account=ACCOUNT
            ) as rt:
                handle = await rt.prepare(REQUEST, response=Story, maximum_attempts=3, live=True)
                with trio.CancelScope() as app:
                    async with rt.live(handle, response=Story, authorize=Authorizer()) as live:
                        async for view in live:
                            if not view.text:
                                continue
                            if leave == "break":
                                break  # the person closed the view
                            app.cancel()  # the app's task is cancelled (its window closed)
                assert app.cancelled_caught == (leave == "cancel")
                # Returned once the actor unwound: durably failed, lease released.
                record = store.get_operation(handle.operation_id)
                assert record is not None and record.phase == "failed"
                assert record.failure_reason == "interrupted"
                assert store.get_lease(handle.operation_id) is None
                with pytest.raises(errors.PermanentlyFailed):
                    await rt.send_recovering(handle, response=Story, authorize=Authorizer())
        assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_only_a_live_operation_runs_live_and_a_receipt_is_delivered_as_is(
    store_location: str,
) -> None:
    async with FixtureProvider.serve() as provider:
        with recoverable.RecoveryStore.open(store_location) as store:
            async with backend(provider, "sse") as b, recoverable.open_runtime(
                store, b, account=ACCOUNT
            ) as rt:
                plain = await rt.prepare(REQUEST, response=Story, maximum_attempts=1)
                authorize = Authorizer()
                with pytest.raises(errors.InvalidRequest, match="live=True"):
                    async with rt.live(plain, response=Story, authorize=authorize):
                        pass
                assert authorize.calls == [] and provider.requests == []

                handle = await rt.prepare(REQUEST, response=Story, maximum_attempts=1, live=True)
                value = await rt.send_recovering(handle, response=Story, authorize=authorize)
                # A saved receipt: no view, no callback, no POST; the same value.
                async with rt.live(handle, response=Story, authorize=authorize) as live:
                    assert [view async for view in live] == []
                assert live.value == value and len(authorize.calls) == 1
                assert len(provider.requests) == 1


def test_the_parser_hands_text_deltas_only_to_a_stream_that_asked() -> None:
    """``on_delta`` gets each output text delta (never a refusal's); without it nothing
    changes (the default path)."""
    from recoverable.transport.events import DeltaResponseStream, ResponseStream, response_stream

    got: list[str] = []
    stream = response_stream(max_events=100, on_progress=None, on_delta=got.append)
    plain = response_stream(max_events=100, on_progress=None, on_delta=None)
    assert type(plain) is ResponseStream and isinstance(stream, DeltaResponseStream)
    events = [
        {"type": "response.output_text.delta", "delta": '{"a":', "output_index": 0},
        {"type": "response.refusal.delta", "delta": "no", "output_index": 1},
        {"type": "response.output_text.delta", "delta": "1}", "output_index": 0},
        {"type": "response.completed", "response": {"id": "resp_1", "output": []}},
    ]
    for event in events:
        stream.feed(msgspec.json.encode(event))
        plain.feed(msgspec.json.encode(event))
    assert got == ['{"a":', "1}"]
    assert stream.outcome == plain.outcome  # the outcome does not depend on it


class ErrorAfterOutput:
    """A real SSE server on a loopback socket (the fixture provider sends an error event
    only before any output): two text deltas, then an ``error`` event with status 500 —
    a 5xx that the failure table replaces for any other operation."""

    EVENTS = [
        {"type": "response.created", "response": {"id": "resp_live1", "status": "in_progress"}},
        {"type": "response.output_item.added", "output_index": 0,
         "item": {"id": "msg_1", "type": "message", "role": "assistant", "content": []}},
        {"type": "response.output_text.delta", "output_index": 0, "content_index": 0,
         "delta": '{"closing_paragraph":"The light'},
        {"type": "response.output_text.delta", "output_index": 0, "content_index": 0,
         "delta": 'house stood","headline":"Ke'},
        {"type": "error", "status": 500,
         "error": {"type": "server_error", "code": "server_error", "message": "upstream"}},
    ]

    def __init__(self) -> None:
        self.requests = 0
        self.port = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        received = b""
        while b"\r\n\r\n" not in received:
            received += await stream.receive_some(65536)
        head, _, body = received.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += await stream.receive_some(65536)
        self.requests += 1
        frames = b"".join(b"data: " + msgspec.json.encode(event) + b"\n\n"
                          for event in self.EVENTS)
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                              b"connection: close\r\n\r\n" + frames)
        await stream.aclose()


async def test_a_provider_error_after_shown_output_is_not_replaced_either(
    store_location: str,
) -> None:
    """A 5xx error event mid-stream is replaceable for any other operation; after output
    a person may have seen, a live operation fails instead (one POST)."""
    server = ErrorAfterOutput()
    async with trio.open_nursery() as nursery:
        [listener] = await nursery.start(
            functools.partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1")
        )
        port = listener.socket.getsockname()[1]
        sse = recoverable.ResponsesBackend(
            f"http://127.0.0.1:{port}/v1", mode="sse", endpoint_id="fixture",
            credentials=recoverable.StaticCredentials("sk-live-test", account=ACCOUNT),
        )
        with recoverable.RecoveryStore.open(store_location) as store:
            async with sse, recoverable.open_runtime(store, sse, account=ACCOUNT) as rt:
                handle = await rt.prepare(REQUEST, response=Story, maximum_attempts=3,
                                          retry_policy=FAST, live=True)
                seen: list[str] = []
                with pytest.raises(errors.PermanentlyFailed) as raised:
                    async with rt.live(handle, response=Story, authorize=Authorizer()) as live:
                        async for view in live:
                            seen.append(view.text)
                failure = raised.value.last_failure
                assert failure is not None and failure.kind == "http_rejected"
                assert failure.http_status == 500 and failure.had_output
                record = store.get_operation(handle.operation_id)
                assert record is not None and record.failure_reason == "interrupted"
        nursery.cancel_scope.cancel()
    assert seen[-1] == '{"closing_paragraph":"The lighthouse stood","headline":"Ke'
    assert server.requests == 1  # not replaced


async def test_a_rejection_before_any_output_is_replaced_and_views_restart(
    store_location: str,
) -> None:
    """Nothing was shown: a live operation's 500 before output is replaced as usual, and
    the views of the next attempt start from empty text."""
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.http_error(500), Reply.synthesize()])
        with recoverable.RecoveryStore.open(store_location) as store:
            async with backend(provider, "sse") as b, recoverable.open_runtime(
                store, b, account=ACCOUNT
            ) as rt:
                handle = await rt.prepare(REQUEST, response=Story, maximum_attempts=3,
                                          retry_policy=FAST, live=True)
                async with rt.live(handle, response=Story, authorize=Authorizer()) as live:
                    views = [view async for view in live]
                receipt = await rt.receipt(handle)
        assert live.value == msgspec.json.decode(receipt.payload, type=Story)
        assert views[-1].attempt == 2 and views[-1].text.encode() == receipt.payload
        assert all(view.text == "" for view in views if view.attempt == 1)
        assert len(generation_requests(provider, handle.operation_id)) == 2
