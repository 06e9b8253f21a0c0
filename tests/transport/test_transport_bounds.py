"""Hostile servers: raw sockets (SSE) and a bare trio-websocket server (WS).

Each test proves a bound turns into a typed outcome without a crash or
unbounded memory, against a real server on 127.0.0.1.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trio_websocket
from transport_helpers import make_body

from recoverable.transport import (
    Completed,
    Interruption,
    ResponsesBackend,
    StaticCredentials,
    StreamLimits,
)

BODY = make_body()
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"connection: close\r\n\r\n"
)
CREATED = b'data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_raw"}}\n\n'
COMPLETED = (
    b'data: {"type":"response.completed","response":{"id":"resp_raw","output":[{"type":'
    b'"message","content":[{"type":"output_text","text":"{}"}]}]}}\n\n'
)

Handler = Callable[[trio.SocketStream], Awaitable[None]]


async def _read_request(stream: trio.SocketStream) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    while len(rest) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return
        rest += chunk


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[str]:
    async def wrapped(stream: trio.SocketStream) -> None:
        try:
            await _read_request(stream)
            await handler(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, wrapped, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}/v1"
        nursery.cancel_scope.cancel()


async def run_sse(url: str, limits: StreamLimits) -> Interruption:
    backend = ResponsesBackend(url, credentials=StaticCredentials("k"), mode="sse", limits=limits)
    try:
        outcome = await backend.stream(BODY, attempt_id="a", token="k")
    finally:
        await backend.aclose()
    assert isinstance(outcome, Interruption), outcome
    return outcome


async def test_sse_oversized_frame_is_response_too_large_with_bounded_memory() -> None:
    chunk = b"x" * 65536

    async def handler(stream: trio.SocketStream) -> None:
        await stream.send_all(SSE_HEAD + CREATED + b"data: ")
        for _ in range(320):  # 20 MiB in one frame, if nobody stops it
            await stream.send_all(chunk)

    tracemalloc.start()
    try:
        async with raw_server(handler) as url:
            out = await run_sse(url, StreamLimits(max_frame_bytes=256 * 1024))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (out.kind, out.transport_code) == ("response_too_large", "frame_too_large")
    assert out.response_id == "resp_raw" and out.sequence_number == 0
    assert peak < 4 * 2**20, peak


async def test_sse_endless_small_events_hit_event_bound() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await stream.send_all(SSE_HEAD + CREATED)
        event = b'data: {"type":"response.in_progress"}\n\n' * 100
        while True:
            await stream.send_all(event)

    async with raw_server(handler) as url:
        out = await run_sse(url, StreamLimits(max_events=5000))
    assert (out.kind, out.transport_code) == ("response_too_large", "too_many_events")


async def test_sse_endless_comments_hit_total_bytes_bound() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await stream.send_all(SSE_HEAD + CREATED)
        while True:
            await stream.send_all(b": keep-alive\n" * 1000)

    async with raw_server(handler) as url:
        out = await run_sse(url, StreamLimits(max_total_bytes=2**20))
    assert (out.kind, out.transport_code) == ("response_too_large", "stream_too_large")


async def test_sse_comments_reset_the_idle_timer() -> None:
    # Issue 10.15 (was: comments did not reset it). A server that keeps a silent stream
    # alive with ``: ping`` comments for 3x the idle bound: the attempt completes. Margins
    # are generous on purpose (a ping every 0.1 s against a 0.6 s bound) so a loaded
    # machine does not turn a late ping into a false timeout.
    async def handler(stream: trio.SocketStream) -> None:
        await stream.send_all(SSE_HEAD + CREATED)
        for _ in range(18):
            await stream.send_all(b": ping\n\n")
            await trio.sleep(0.1)  # pacing of the server, not a test barrier
        await stream.send_all(COMPLETED)

    async with raw_server(handler) as url:
        backend = ResponsesBackend(url, credentials=StaticCredentials("k"), mode="sse",
                                   limits=StreamLimits(idle_timeout=0.6))
        try:
            outcome = await backend.stream(BODY, attempt_id="a", token="k")
        finally:
            await backend.aclose()
    assert isinstance(outcome, Completed), outcome
    assert outcome.text == "{}"


async def test_sse_silence_without_pings_still_times_out() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await stream.send_all(SSE_HEAD + CREATED)
        await trio.sleep_forever()

    async with raw_server(handler) as url:
        out = await run_sse(url, StreamLimits(idle_timeout=0.3))
    assert (out.kind, out.transport_code) == ("timeout", "idle_timeout")
    assert out.response_id == "resp_raw"


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (b"\x00\xff\xfe garbage that is not HTTP\r\n\r\n", "disconnected"),
        (SSE_HEAD + b"data: \x00\xffgarbage\x01\n\n", "malformed"),
        (SSE_HEAD + CREATED + b'data: {"type":"response.output_text.delta","del\n\n', "malformed"),
        (SSE_HEAD + CREATED + b'data: {"type":"response.output_text.delta"', "premature_eof"),
        (SSE_HEAD + CREATED, "premature_eof"),
        (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
         "malformed"),
    ],
    ids=["not-http", "garbage-data", "truncated-json", "truncated-at-eof", "no-terminal",
         "wrong-content-type"],
)
async def test_sse_garbage_and_truncation(payload: bytes, kind: str) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await stream.send_all(payload)

    async with raw_server(handler) as url:
        out = await run_sse(url, StreamLimits(idle_timeout=5.0))
    assert out.kind == kind, out


async def test_sse_huge_error_body_is_read_bounded() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        body = b'{"error":{"type":"server_error","code":"x"}}' + b" " * (8 * 2**20)
        await stream.send_all(
            b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 5\r\n"
            b"content-length: %d\r\n\r\n" % len(body)
        )
        await stream.send_all(body)

    async with raw_server(handler) as url:
        out = await run_sse(url, StreamLimits())
    assert (out.kind, out.http_status, out.retry_after) == ("http_rejected", 503, 5.0)
    assert out.provider_code is None  # the body was cut at the bound, never parsed whole


# -- WebSocket ---------------------------------------------------------------------

WsHandler = Callable[[trio_websocket.WebSocketConnection], Awaitable[None]]


@asynccontextmanager
async def ws_server(handler: WsHandler | None = None, *, reject: int | None = None,
                    ) -> AsyncIterator[str]:
    async def serve(request: trio_websocket.WebSocketRequest) -> None:
        if reject is not None:
            await request.reject(reject, extra_headers=[(b"retry-after-ms", b"2500")],
                                 body=b'{"error":{"type":"requests","code":"rate_limit_exceeded"}}')
            return
        ws = await request.accept()
        await ws.get_message()  # the response.create
        assert handler is not None
        try:
            await handler(ws)
        except trio_websocket.ConnectionClosed:
            pass

    async with trio.open_nursery() as nursery:
        server = await nursery.start(trio_websocket.serve_websocket, serve, "127.0.0.1", 0, None)
        yield f"http://127.0.0.1:{server.port}/v1"
        nursery.cancel_scope.cancel()


async def run_ws(url: str, limits: StreamLimits) -> Interruption:
    async with ResponsesBackend(url, credentials=StaticCredentials("k"), mode="websocket",
                                limits=limits) as backend:
        outcome = await backend.stream(BODY, attempt_id="a", token="k")
    assert isinstance(outcome, Interruption), outcome
    return outcome


CREATED_TEXT = CREATED[len(b"data: "):].strip().decode()


async def test_ws_oversized_message_is_response_too_large() -> None:
    async def handler(ws: trio_websocket.WebSocketConnection) -> None:
        await ws.send_message(CREATED_TEXT)
        await ws.send_message("x" * (2 * 2**20))
        await ws.get_message()

    async with ws_server(handler) as url:
        out = await run_ws(url, StreamLimits(max_frame_bytes=2**20))
    assert (out.kind, out.transport_code) == ("response_too_large", "frame_too_large")
    assert out.response_id == "resp_raw"


async def test_ws_default_limit_accepts_messages_above_one_mib() -> None:
    big = '{"type":"response.in_progress","pad":"' + "p" * (3 * 2**20) + '"}'

    async def handler(ws: trio_websocket.WebSocketConnection) -> None:
        await ws.send_message(CREATED_TEXT)
        await ws.send_message(big)
        await ws.send_message('{"type":"response.completed","response":{"id":"resp_raw",'
                              '"output":[{"type":"message","content":[{"type":"output_text",'
                              '"text":"{}"}]}]}}')

    async with ws_server(handler) as url, ResponsesBackend(
        url, credentials=StaticCredentials("k"), mode="websocket"
    ) as backend:
        outcome = await backend.stream(BODY, attempt_id="a", token="k")
    assert not isinstance(outcome, Interruption), outcome
    assert outcome.text == "{}"


@pytest.mark.parametrize(
    ("frames", "kind", "code"),
    [
        ([b"\x00binary"], "disconnected", "ws_binary_frame"),
        (["{truncated"], "malformed", "invalid_json"),
        (['{"type":"response.output_text.delta","delta":null}'], "malformed", "bad_delta"),
        ([], "premature_eof", "ws_close_1000"),
    ],
    ids=["binary", "truncated-json", "wrong-type", "close-before-terminal"],
)
async def test_ws_bad_frames(frames: list[str | bytes], kind: str, code: str) -> None:
    async def handler(ws: trio_websocket.WebSocketConnection) -> None:
        await ws.send_message(CREATED_TEXT)
        for frame in frames:
            await ws.send_message(frame)
        await ws.aclose(1000)

    async with ws_server(handler) as url:
        out = await run_ws(url, StreamLimits(idle_timeout=5.0))
    assert (out.kind, out.transport_code) == (kind, code)


async def test_ws_endless_events_hit_event_bound() -> None:
    async def handler(ws: trio_websocket.WebSocketConnection) -> None:
        await ws.send_message(CREATED_TEXT)
        while True:
            await ws.send_message('{"type":"response.in_progress"}')

    async with ws_server(handler) as url:
        out = await run_ws(url, StreamLimits(max_events=3000))
    assert (out.kind, out.transport_code) == ("response_too_large", "too_many_events")


async def test_ws_refused_handshake_carries_status_and_retry_after() -> None:
    async with ws_server(reject=429) as url:
        out = await run_ws(url, StreamLimits())
    assert (out.kind, out.http_status, out.retry_after) == ("http_rejected", 429, 2.5)
    assert out.provider_code == "rate_limit_exceeded" and out.is_rate_limit
