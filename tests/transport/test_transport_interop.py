"""What lenient third-party Responses servers send (issue 10, items 4 and 14 to 17).

Against the real loopback fixture provider (both transports) and, for frames the
fixture does not make, a bare server on 127.0.0.1. Each outcome is also fed to the
state machine's ``classify`` so "the same on both transports" is checked end to end.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jsonschema_rs
import msgspec
import pytest
import trio
import trio_websocket
from transport_helpers import SCHEMA, make_body

from recoverable.machine import classify
from recoverable.outcome import (
    MAX_CODE_CHARS,
    MAX_RESPONSE_ID_CHARS,
    UNRECOGNIZED_CODE,
    bounded_response_id,
)
from recoverable.testing import FixtureProvider, Reply
from recoverable.transport import (
    Completed,
    Interruption,
    ResponsesBackend,
    StaticCredentials,
    StreamLimits,
)
from recoverable.transport.base import parse_error_body
from recoverable.transport.events import ResponseStream
from recoverable.types import RetryPolicy

MODES = ["sse", "websocket"]
BODY = make_body()
VALIDATOR = jsonschema_rs.validator_for(SCHEMA)
DEFAULT = RetryPolicy()
OPTED_IN = RetryPolicy(retryable_provider_codes=frozenset({"server_error"}))


async def stream_once(
    provider: FixtureProvider, mode: str, reply: Reply, limits: StreamLimits | None = None
) -> Completed | Interruption:
    provider.script([reply])
    async with ResponsesBackend(
        provider.http_url, credentials=StaticCredentials("sk-test"),
        mode=mode,  # type: ignore[arg-type]
        limits=limits or StreamLimits(),
    ) as backend:
        return await backend.stream(BODY, attempt_id="att-1", token="sk-test")


# -- 10.14: status, then code, then error.type; the same on both transports -----------------


@pytest.mark.parametrize("mode", MODES)
async def test_error_frame_with_only_a_rate_limit_type_is_a_rate_limit_like_an_http_429(
    provider: FixtureProvider, mode: str
) -> None:
    # LiteLLM forwards an upstream 429 as {"type":"error","error":{"type":
    # "rate_limit_exceeded",...}}: no status, no code.
    out = await stream_once(provider, mode, Reply.error_event(error_type="rate_limit_exceeded"))
    assert isinstance(out, Interruption), out
    assert (out.kind, out.http_status, out.provider_code) == ("provider_failed", None, None)
    assert out.provider_type == "rate_limit_exceeded"
    assert out.is_rate_limit and not out.is_quota
    http_429 = await stream_once(provider, "sse", Reply.rate_limited(retry_after=0.0))
    assert isinstance(http_429, Interruption) and http_429.is_rate_limit
    assert classify(out, DEFAULT) is None
    assert classify(out, DEFAULT) == classify(http_429, DEFAULT)
    # A policy that does not replace 429 does not replace this one either.
    no_429 = RetryPolicy(retryable_statuses=frozenset({500}))
    assert classify(out, no_429) is not None and classify(http_429, no_429) is not None


@pytest.mark.parametrize("mode", MODES)
async def test_server_error_type_without_status_or_code_needs_the_explicit_opt_in(
    provider: FixtureProvider, mode: str
) -> None:
    out = await stream_once(provider, mode, Reply.error_event(error_type="server_error"))
    assert isinstance(out, Interruption), out
    assert (out.kind, out.provider_type, out.provider_code) == (
        "provider_failed", "server_error", None)
    assert not out.is_rate_limit
    assert classify(out, DEFAULT) == "provider_failed"  # library default: nothing allowed
    assert classify(out, OPTED_IN) is None


@pytest.mark.parametrize("mode", MODES)
async def test_openai_5xx_shape_server_error_type_null_code_is_judged_by_status(
    provider: FixtureProvider, mode: str
) -> None:
    # OpenAI's own 5xx: {"error": {"type": "server_error", "code": null}} — over SSE an HTTP
    # 500, over WebSocket an error frame carrying status 500. Both: the status decides.
    body = {"error": {"type": "server_error", "code": None, "message": "oops", "param": None}}
    http = await stream_once(provider, mode, Reply.http_error(500, body=body))
    frame = await stream_once(
        provider, mode, Reply.error_event(error_type="server_error", status=500)
    )
    for out in (http, frame):
        assert isinstance(out, Interruption), out
        assert (out.kind, out.http_status, out.provider_type, out.provider_code) == (
            "http_rejected", 500, "server_error", None)
        assert classify(out, DEFAULT) is None


@pytest.mark.parametrize("mode", MODES)
async def test_rate_limit_code_in_an_error_frame_without_status(
    provider: FixtureProvider, mode: str
) -> None:
    out = await stream_once(
        provider, mode, Reply.error_event(error_type="requests", code="rate_limit_exceeded")
    )
    assert isinstance(out, Interruption) and out.is_rate_limit
    assert classify(out, DEFAULT) is None


# -- 10.15: any bytes reset the idle timer -----------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_keepalives_during_a_pause_longer_than_the_idle_bound_keep_the_attempt(
    provider: FixtureProvider, mode: str
) -> None:
    # A 1.8 s silence (3x the 0.6 s idle bound) broken only by SSE ": ping" comments or
    # WebSocket ping frames every 0.1 s. Generous margins on purpose: a keepalive would
    # have to be 6x late on a loaded machine for a false timeout.
    limits = StreamLimits(idle_timeout=0.6)
    out = await stream_once(provider, mode, Reply.keepalive(pause=1.8, every=0.1), limits)
    assert isinstance(out, Completed), out
    assert VALIDATOR.is_valid(msgspec.json.decode(out.text))


@pytest.mark.parametrize("mode", MODES)
async def test_silence_without_keepalives_still_times_out(
    provider: FixtureProvider, mode: str
) -> None:
    # The bound is the idle timeout (0.3 s), not the connect deadline: events that arrived
    # before the stream's byte hook was set once left the WebSocket waiting for
    # connect_timeout + idle_timeout (15.3 s). 5 s is far above 0.3 s and far below that.
    with trio.fail_after(5):
        out = await stream_once(provider, mode, Reply.stall(after_events=2),
                                StreamLimits(idle_timeout=0.3))
    assert isinstance(out, Interruption)
    assert (out.kind, out.transport_code) == ("timeout", "idle_timeout")


async def test_ws_control_frame_flood_still_hits_the_total_bytes_bound() -> None:
    # Pings/pongs reset the idle timer, but they count against max_total_bytes: a server
    # cannot keep an attempt alive forever with control frames.
    async def serve(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.get_message()
        await ws.send_message('{"type":"response.created","response":{"id":"resp_flood"}}')
        try:
            while True:
                await ws.pong(b"x" * 100)
        except trio_websocket.ConnectionClosed:
            pass

    async with trio.open_nursery() as nursery:
        server = await nursery.start(trio_websocket.serve_websocket, serve, "127.0.0.1", 0, None)
        url = f"http://127.0.0.1:{server.port}/v1"
        async with ResponsesBackend(
            url, credentials=StaticCredentials("k"), mode="websocket",
            limits=StreamLimits(max_total_bytes=256 * 1024, idle_timeout=30.0),
        ) as backend:
            with trio.fail_after(20):  # far above the expected < 1 s; a hang is the bug
                out = await backend.stream(BODY, attempt_id="a", token="k")
        nursery.cancel_scope.cancel()
    assert isinstance(out, Interruption), out
    assert (out.kind, out.transport_code) == ("response_too_large", "stream_too_large")
    assert out.response_id == "resp_flood"


# -- 10.16: a non-2xx body framed as SSE keeps its error type and code --------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_sse_framed_error_body_of_a_non_2xx_keeps_type_and_code(
    provider: FixtureProvider, mode: str
) -> None:
    body = {"error": {"type": "server_error", "code": "upstream_unavailable",
                      "message": "LiteLLM: upstream failed", "param": None}}
    out = await stream_once(provider, mode, Reply.http_error(500, body=body, framing="sse"))
    assert isinstance(out, Interruption), out
    assert (out.kind, out.http_status, out.provider_type, out.provider_code) == (
        "http_rejected", 500, "server_error", "upstream_unavailable")


def test_parse_error_body_reads_either_framing() -> None:
    plain = b'{"error":{"type":"invalid_request_error","code":"bad"}}'
    assert parse_error_body(plain) == ("invalid_request_error", "bad")
    assert parse_error_body(b"data: " + plain + b"\n\n") == ("invalid_request_error", "bad")
    assert parse_error_body(b"event: error\r\ndata: " + plain) == ("invalid_request_error", "bad")
    assert parse_error_body(b": hi\n\ndata: [DONE]\n\ndata: " + plain + b"\n\n") == (
        "invalid_request_error", "bad")
    assert parse_error_body(b'data: {"type":"error","code":"flat"}\n\n') == (None, "flat")
    assert parse_error_body(b"data: nonsense\n\n") == (None, None)
    assert parse_error_body(b"<html>502</html>") == (None, None)


# -- 10.17: what lenient servers add -------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_lenient_stream_completes(provider: FixtureProvider, mode: str) -> None:
    # Unknown top-level fields on every event, event: lines on every other SSE frame,
    # "data: [DONE]" after response.completed.
    out = await stream_once(provider, mode, Reply.lenient())
    assert isinstance(out, Completed), out
    assert VALIDATOR.is_valid(msgspec.json.decode(out.text))
    assert out.response_id is not None and out.response_id.startswith("resp_fixture")


@pytest.mark.parametrize("mode", MODES)
async def test_very_long_response_id_is_kept_bounded(provider: FixtureProvider, mode: str) -> None:
    long_id = "resp_" + "bGl0ZWxsbTpjdXN0b21fbGxtX3Byb3ZpZGVy" * 300  # ~11,000 characters
    out = await stream_once(provider, mode, Reply.lenient(response_id=long_id))
    assert isinstance(out, Completed), out
    assert out.response_id is not None
    assert len(out.response_id) == MAX_RESPONSE_ID_CHARS
    assert out.response_id == bounded_response_id(long_id)  # deterministic
    assert out.response_id.startswith("resp_bGl0")
    assert out.response_id.endswith(hashlib.sha256(long_id.encode()).hexdigest()[:32])
    # an id within the bound is kept exactly
    fits = "resp_" + "a" * (MAX_RESPONSE_ID_CHARS - 5)
    assert bounded_response_id(fits) == fits
    assert bounded_response_id(fits + "b") != bounded_response_id(fits + "c")


def test_done_sentinel_is_ignored_after_completion_and_is_an_eof_before() -> None:
    stream = ResponseStream(max_events=100)
    assert stream.feed(b'{"type":"response.created","response":{"id":"r"}}') is None
    # an event line only: the JSON has no "type", the SSE event name supplies it
    assert stream.feed(b'{"delta":"{}","output_index":0,"content_index":0}',
                       event_name="response.output_text.delta") is None
    out = stream.feed(b'{"type":"response.completed","extra":1,"response":{"id":"r"}}')
    assert isinstance(out, Completed) and out.text == "{}"


def test_an_event_with_only_an_error_object_is_an_error_event() -> None:
    # LiteLLM streams a mid-stream failure as ``data: {"error": {...}}`` (no "type").
    stream = ResponseStream(max_events=10)
    out = stream.feed(b'{"error":{"type":"rate_limit_exceeded","code":null,"message":"m"}}')
    assert isinstance(out, Interruption) and out.kind == "provider_failed"
    assert out.provider_type == "rate_limit_exceeded" and out.is_rate_limit


async def test_sse_done_before_the_terminal_event_is_a_premature_eof() -> None:
    from test_transport_bounds import CREATED, SSE_HEAD, raw_server, run_sse

    async def handler(stream: trio.SocketStream) -> None:
        await stream.send_all(SSE_HEAD + CREATED + b"data: [DONE]\n\n")
        await trio.sleep_forever()

    async with raw_server(handler) as url:
        out = await run_sse(url, StreamLimits(idle_timeout=5.0))
    assert (out.kind, out.transport_code) == ("premature_eof", "done_sentinel")


# -- 10.4: every provider string is bounded at the adapter --------------------------------------

HUGE = "x" * 500_000


@pytest.mark.parametrize(
    ("event", "field"),
    [
        ({"type": "response.failed", "response": {"id": "r", "error": {"code": HUGE}}},
         "provider_code"),
        ({"type": "response.failed", "response": {"id": "r", "error": {"type": HUGE}}},
         "provider_type"),
        ({"type": "error", "code": HUGE}, "provider_code"),
        ({"type": "error", "status": 429, "error": {"type": HUGE, "code": "a b"}},
         "provider_type"),
        ({"type": "response.incomplete", "response": {
            "id": "r", "incomplete_details": {"reason": HUGE}}}, "provider_code"),
    ],
)
def test_provider_strings_become_bounded_codes(event: dict[str, Any], field: str) -> None:
    stream = ResponseStream(max_events=10)
    out = stream.feed(msgspec.json.encode(event))
    assert isinstance(out, Interruption), out
    assert getattr(out, field) == UNRECOGNIZED_CODE
    assert len(msgspec.json.encode(out)) < 1024


def test_interruption_bounds_its_own_strings_for_any_backend() -> None:
    # A custom backend (or an old record) cannot carry an unbounded string either.
    out = Interruption(kind="provider_failed", provider_code=HUGE, provider_type="ok_type",
                       transport_code="bad\ncode", response_id="r" * 100_000)
    assert out.provider_code == UNRECOGNIZED_CODE and out.provider_type == "ok_type"
    assert out.transport_code == UNRECOGNIZED_CODE
    assert out.response_id is not None and len(out.response_id) == MAX_RESPONSE_ID_CHARS
    decoded = msgspec.json.decode(
        msgspec.json.encode({"kind": "provider_failed", "provider_code": HUGE}),
        type=Interruption,
    )
    assert decoded.provider_code == UNRECOGNIZED_CODE
    kept = "c" * MAX_CODE_CHARS
    assert Interruption(kind="provider_failed", provider_code=kept).provider_code == kept
    assert Interruption(kind="provider_failed", provider_code=kept + "c").provider_code == (
        UNRECOGNIZED_CODE)
    assert Completed(text="{}", response_id="r" * 100_000).response_id is not None
    assert len(Completed(text="{}", response_id="r" * 100_000).response_id or "") == 512

