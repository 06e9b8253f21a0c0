"""The sans-IO pieces: SSE decoding, the event parser, retry-after, replies, synthesis."""

from __future__ import annotations

import datetime as dt
import email.utils
from typing import Any

import jsonschema_rs
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from recoverable.errors import InvalidRequest
from recoverable.fixture.replies import events_for
from recoverable.testing import FaultSpec, Reply, synthesize_value
from recoverable.transport import (
    Completed,
    Interruption,
    StaticCredentials,
    StreamLimits,
    Usage,
)
from recoverable.transport.base import normalize_base_url, parse_error_body, parse_retry_after
from recoverable.transport.events import FrameTooLarge, ResponseStream, SseDecoder, SseFrame
from recoverable.types import AccountBinding

# -- SSE decoding -----------------------------------------------------------------

SAMPLE = (
    b"\xef\xbb\xbf: a comment\r\n"
    b"event: response.created\r\n"
    b'data: {"a":\r\n'
    b"data: 1}\r\n"
    b"\r\n"
    b"event:x\rdata:no-space\r\r"
    b"id: 7\nretry: 10\ndata: third\n\n"
    b"data: incomplete-at-end"
)
EXPECTED = [
    SseFrame("response.created", b'{"a":\n1}'),
    SseFrame("x", b"no-space"),
    SseFrame(None, b"third"),
]


def test_sse_decoder_handles_crlf_cr_comments_multiline_bom() -> None:
    assert SseDecoder(1 << 20).feed(SAMPLE) == EXPECTED


@given(st.lists(st.integers(min_value=1, max_value=len(SAMPLE) - 1), max_size=12))
def test_sse_decoder_same_frames_for_any_chunking(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    chunks = [SAMPLE[a:b] for a, b in zip([0, *points], [*points, len(SAMPLE)], strict=True)]
    decoder = SseDecoder(1 << 20)
    frames: list[SseFrame] = []
    for chunk in chunks:
        frames += decoder.feed(chunk)
    assert frames == EXPECTED


def test_sse_decoder_bounds_a_frame_without_newlines() -> None:
    decoder = SseDecoder(1000)
    decoder.feed(b"data: " + b"x" * 900)
    with pytest.raises(FrameTooLarge):
        decoder.feed(b"x" * 200)


def test_sse_decoder_bounds_many_data_lines() -> None:
    decoder = SseDecoder(1000)
    with pytest.raises(FrameTooLarge):
        decoder.feed(b"data: " + b"y" * 100 + b"\n" * 1 + (b"data: " + b"y" * 100 + b"\n") * 10)


# -- the event parser -------------------------------------------------------------


def feed_all(events: list[dict[str, Any]], **kw: Any) -> Any:
    stream = ResponseStream(max_events=kw.pop("max_events", 1000), **kw)
    for event in events:
        out = stream.feed(msgspec.json.encode(event))
        if out is not None:
            return out
    return stream.interrupt("premature_eof")


def test_full_stream_completes_with_text_from_completed_object() -> None:
    events = events_for(Reply.complete({"k": [1, 2]}), {"model": "m"}, serial=1, created_at=0)
    out = feed_all(events)
    # The fixture reports usage (issue 19.3): deterministic from request and answer sizes.
    assert out == Completed(text='{"k":[1,2]}', response_id="resp_fixture000000000001",
                            sequence_number=len(events) - 1,
                            usage=Usage(input_tokens=4, output_tokens=2))


def test_completed_without_output_uses_accumulated_deltas() -> None:
    events = [
        {"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1"}},
        {"type": "response.output_text.delta", "sequence_number": 1, "delta": "ab",
         "output_index": 0, "content_index": 0},
        {"type": "response.output_text.delta", "sequence_number": 2, "delta": "cd",
         "output_index": 0, "content_index": 0},
        {"type": "response.some_future_event", "sequence_number": 3},
        {"type": "response.completed", "sequence_number": 4, "response": {"id": "resp_1"}},
    ]
    assert feed_all(events) == Completed(text="abcd", response_id="resp_1", sequence_number=4)


@pytest.mark.parametrize(
    ("event", "fields"),
    [
        ({"type": "error", "code": "rate_limit_exceeded", "message": "m", "param": None},
         {"kind": "provider_failed", "provider_code": "rate_limit_exceeded"}),
        ({"type": "error", "error": {"type": "insufficient_quota", "code": None, "message": "m"}},
         {"kind": "provider_failed", "provider_type": "insufficient_quota", "is_quota": True}),
        ({"type": "error", "status": 429,
          "error": {"type": "requests", "code": "rate_limit_exceeded", "message": "m"},
          "headers": {"Retry-After-Ms": "1500"}},
         {"kind": "http_rejected", "http_status": 429, "retry_after": 1.5, "is_rate_limit": True,
          "is_quota": False}),
        ({"type": "error", "status": 429,
          "error": {"type": "insufficient_quota", "code": "insufficient_quota", "message": "m"}},
         {"kind": "http_rejected", "http_status": 429, "is_quota": True,
          "is_rate_limit": False}),
        ({"type": "response.failed", "response": {"id": "r", "error": {"code": "slow_down"}}},
         {"kind": "provider_failed", "provider_code": "slow_down", "response_id": "r"}),
        ({"type": "response.incomplete",
          "response": {"id": "r", "incomplete_details": {"reason": "max_output_tokens"}}},
         {"kind": "incomplete", "provider_code": "max_output_tokens"}),
        ({"type": "response.output_item.added", "item": {"type": "custom_tool_call"}},
         {"kind": "tool_activity", "had_tool_activity": True}),
        ({"type": "response.output_item.added", "item": {"type": "web_search_call"}},
         {"kind": "tool_activity"}),
        ({"type": "response.function_call_arguments.delta", "delta": "{"},
         {"kind": "tool_activity"}),
        ({"type": "response.completed",
          "response": {"output": [{"type": "function_call", "name": "f"}]}},
         {"kind": "tool_activity"}),
        ({"type": "response.completed", "response": {"output": [
            {"type": "message", "content": [{"type": "refusal", "refusal": "no"}]}]}},
         {"kind": "refusal", "had_output": True}),
        ({"type": 5}, {"kind": "malformed", "transport_code": "event_without_type"}),
        ({"type": "response.output_text.delta", "delta": 3},
         {"kind": "malformed", "transport_code": "bad_delta"}),
        ({"type": "response.created", "sequence_number": "1"},
         {"kind": "malformed", "transport_code": "bad_sequence_number"}),
        ({"type": "response.created", "response": {"id": 12}},
         {"kind": "malformed", "transport_code": "bad_response_id"}),
        ({"type": "response.output_item.added", "item": "x"},
         {"kind": "malformed", "transport_code": "bad_output_item"}),
    ],
)
def test_terminal_and_violating_events(event: dict[str, Any], fields: dict[str, Any]) -> None:
    out = feed_all([event])
    assert isinstance(out, Interruption)
    for name, value in fields.items():
        assert getattr(out, name) == value, (name, out)


@pytest.mark.parametrize("raw", [b"{not json", b"[1,2]", b'"str"', b"", b"\xff\xfe"])
def test_invalid_frames_are_malformed(raw: bytes) -> None:
    stream = ResponseStream(max_events=10)
    out = stream.feed(raw)
    assert isinstance(out, Interruption) and out.kind == "malformed"


def test_event_count_bound() -> None:
    stream = ResponseStream(max_events=5)
    outs = [stream.feed(b'{"type":"response.in_progress"}') for _ in range(6)]
    assert outs[:5] == [None] * 5
    assert isinstance(outs[5], Interruption) and outs[5].transport_code == "too_many_events"


# -- retry-after, errors, URLs ------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after-ms": "1500"}, 1.5),
        ({"Retry-After-Ms": "250.5", "retry-after": "9"}, 0.2505),
        ({"retry-after-ms": "garbage", "retry-after": "3"}, 3.0),
        ({"retry-after-ms": "-5", "retry-after": "4"}, 4.0),
        ({"retry-after": "2"}, 2.0),
        ({"retry-after": "0"}, 0.0),
        ({"retry-after": "-1"}, None),
        ({"retry-after": "soon"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after": "inf"}, None),
        ({"retry-after": ""}, None),
        ({}, None),
    ],
)
def test_retry_after_parsing(headers: dict[str, str], expected: float | None) -> None:
    got = parse_retry_after(headers)
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_retry_after_http_date() -> None:
    now = dt.datetime(2030, 1, 1, tzinfo=dt.UTC).timestamp()
    later = email.utils.format_datetime(dt.datetime(2030, 1, 1, 0, 0, 30, tzinfo=dt.UTC),
                                        usegmt=True)
    earlier = email.utils.format_datetime(dt.datetime(2029, 12, 31, tzinfo=dt.UTC), usegmt=True)
    assert parse_retry_after({"retry-after": later}, now=now) == 30.0
    assert parse_retry_after({"retry-after": earlier}, now=now) == 0.0
    assert parse_retry_after([("Retry-After", "Mon, 99 Foo 2030 99:00:00 GMT")], now=now) is None


def test_parse_error_body() -> None:
    assert parse_error_body(b'{"error":{"type":"insufficient_quota","code":null}}') == (
        "insufficient_quota", None)
    assert parse_error_body(b"<html>") == (None, None)
    assert parse_error_body(b'{"error":"x"}') == (None, None)
    assert parse_error_body(b" " * (1 << 20)) == (None, None)


def test_normalize_base_url() -> None:
    assert normalize_base_url("HTTP://LocalHost:80/v1/") == "http://localhost/v1"
    assert normalize_base_url("https://api.example.com:443/v1") == "https://api.example.com/v1"
    assert normalize_base_url("wss://h:8443/v1") == "https://h:8443/v1"
    for bad in ["ftp://x/v1", "http://u:p@h/v1", "http://h/v1?x=1", "not a url"]:
        with pytest.raises(InvalidRequest):
            normalize_base_url(bad)


async def test_static_credentials_never_show_the_key() -> None:
    creds = StaticCredentials("sk-secret", account=AccountBinding("acct", "api-key"))
    assert await creds.token() == "sk-secret"
    assert await creds.token(renew=True) == "sk-secret"
    assert creds.account == AccountBinding("acct", "api-key")
    assert "sk-secret" not in repr(creds)
    with pytest.raises(InvalidRequest):
        StaticCredentials("")


def test_stream_limits_validate() -> None:
    with pytest.raises(InvalidRequest):
        StreamLimits(max_events=0)
    with pytest.raises(InvalidRequest):
        StreamLimits(idle_timeout=-1.0)


# -- replies, faults, synthesis ----------------------------------------------------


@pytest.mark.parametrize(
    "reply",
    [
        Reply.complete({"a": [1, None]}), Reply.synthesize(), Reply.disconnect(after_events=5),
        Reply.stall(), Reply.http_error(502, body={"x": 1}, headers={"retry-after": "1"}),
        Reply.rate_limited(retry_after=0.5), Reply.quota_exceeded(), Reply.unauthorized(),
        Reply.forbidden(), Reply.failed("slow_down"), Reply.incomplete("content_filter"),
        Reply.invalid_json(), Reply.schema_violation(), Reply.tool_call(), Reply.refusal("no"),
        Reply.error_event(error_type="rate_limit_exceeded"),
        Reply.error_event(error_type="server_error", code="x", status=500, after_events=1),
        Reply.keepalive(pause=2.0, every=0.5), Reply.lenient(), Reply.lenient("resp_long"),
        Reply.http_error(500, body={"error": {}}, framing="sse"),
    ],
)
def test_reply_spec_round_trip(reply: Reply) -> None:
    spec = msgspec.json.decode(msgspec.json.encode(reply.to_spec()))
    assert Reply.from_spec(spec) == reply


@pytest.mark.parametrize(
    "spec",
    [{"kind": "nope"}, {"kind": "disconnect", "after_events": -1}, {"kind": "complete"},
     {"kind": "stall", "payload": 1}, {"kind": "http_error", "status": 200}, "x", {"kind": 3},
     {"kind": "rate_limited", "retry_after": "soon"},
     {"kind": "keepalive", "pause": 0, "every": 1}, {"kind": "error_event", "status": 200},
     {"kind": "http_error", "status": 500, "framing": "xml"}],
)
def test_bad_reply_specs_are_rejected(spec: Any) -> None:
    with pytest.raises(InvalidRequest):
        Reply.from_spec(spec)


def test_fault_spec_parse_and_seeded_draws() -> None:
    spec = FaultSpec.parse("disconnect=0.1, rate_limited=0.05,stall=0.01,seed=7")
    assert dict(spec.rates) == {"disconnect": 0.1, "rate_limited": 0.05, "stall": 0.01}
    assert spec.seed == 7
    draws = [spec.pick(r) for r in [spec.chooser()] for _ in range(2000)]
    again = [spec.pick(r) for r in [spec.chooser()] for _ in range(2000)]
    assert draws == again
    kinds = [d.kind for d in draws if d is not None]
    assert 100 < kinds.count("disconnect") < 300
    assert 40 < kinds.count("rate_limited") < 160
    for bad in ["disconnect=2", "boom=0.1", "disconnect", "seed=x", "a=0.6,b=0.6",
                "disconnect=0.6,stall=0.6"]:
        with pytest.raises(InvalidRequest):
            FaultSpec.parse(bad)


SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5}},
     "required": ["a"], "additionalProperties": False},
    {"type": "object", "additionalProperties": False, "required": ["n", "e", "c", "b", "x"],
     "properties": {
         "n": {"type": ["number", "null"], "exclusiveMaximum": 0},
         "e": {"enum": ["red", "green"]}, "c": {"const": 3}, "b": {"type": "boolean"},
         "x": {"anyOf": [{"type": "string", "minLength": 20}, {"type": "null"}]}}},
    {"type": "object", "additionalProperties": False, "required": ["tree"],
     "properties": {"tree": {"$ref": "#/$defs/Node"}},
     "$defs": {"Node": {"type": "object", "additionalProperties": False,
                        "required": ["v", "kids"],
                        "properties": {"v": {"type": "string", "format": "date-time"},
                                       "kids": {"type": "array",
                                                "items": {"$ref": "#/$defs/Node"}}}}}},
    {"type": "object", "additionalProperties": False, "required": ["l"],
     "properties": {"l": {"type": "array", "minItems": 3, "maxItems": 3,
                          "items": {"type": "integer", "multipleOf": 7, "minimum": 1}}}},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_synthesized_values_are_schema_valid_and_deterministic(schema: dict[str, Any]) -> None:
    value = synthesize_value(schema)
    assert jsonschema_rs.validator_for(schema).is_valid(value), value
    assert synthesize_value(schema) == value
    violation = events_for(Reply.schema_violation(),
                           {"text": {"format": {"type": "json_schema", "schema": schema}}},
                           serial=1, created_at=0)
    text = violation[-1]["response"]["output"][0]["content"][0]["text"]
    assert not jsonschema_rs.validator_for(schema).is_valid(msgspec.json.decode(text))
