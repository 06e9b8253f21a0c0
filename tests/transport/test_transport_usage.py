"""The ``usage`` of a terminal response: parsed bounded and validated; malformed usage is
ignored and flagged, never a failure of the attempt (issue 19.3)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from recoverable.fixture.replies import events_for
from recoverable.outcome import (
    MAX_USAGE_TOKENS,
    Completed,
    Interruption,
    MalformedUsage,
    Usage,
    parse_usage,
)
from recoverable.testing import Reply
from recoverable.transport.events import ResponseStream

GOOD = {
    "input_tokens": 120,
    "input_tokens_details": {"cached_tokens": 100},
    "output_tokens": 40,
    "output_tokens_details": {"reasoning_tokens": 30},
    "total_tokens": 160,
}


def feed(events: list[dict[str, Any]]) -> Completed | Interruption | None:
    stream = ResponseStream(max_events=1000)
    out = None
    for event in events:
        out = stream.feed(msgspec.json.encode(event))
        if out is not None:
            break
    return out


def with_usage(reply: Reply, usage: object) -> list[dict[str, Any]]:
    events = events_for(reply, {"model": "m"}, serial=1, created_at=0)
    events[-1]["response"]["usage"] = usage
    return events


def test_parse_usage_reads_the_four_counts() -> None:
    assert parse_usage(GOOD) == Usage(
        input_tokens=120, cached_input_tokens=100, output_tokens=40, reasoning_tokens=30
    )
    assert parse_usage(None) is None
    # details may be absent or null (older servers, proxies)
    assert parse_usage({"input_tokens": 3, "output_tokens": 4}) == Usage(
        input_tokens=3, output_tokens=4
    )
    assert parse_usage(
        {"input_tokens": 3, "output_tokens": 4, "input_tokens_details": None}
    ) == Usage(input_tokens=3, output_tokens=4)
    assert Usage(input_tokens=1, output_tokens=2).total_tokens == 3


@pytest.mark.parametrize(
    "usage",
    [
        "lots",
        [1, 2],
        {},
        {"input_tokens": -1, "output_tokens": 1},
        {"input_tokens": 1, "output_tokens": 1.5},
        {"input_tokens": True, "output_tokens": 1},
        {"input_tokens": "10", "output_tokens": 1},
        {"input_tokens": MAX_USAGE_TOKENS + 1, "output_tokens": 1},
        {"input_tokens": 10**40, "output_tokens": 1},
        {"input_tokens": 1, "output_tokens": 1, "input_tokens_details": "x"},
        {"input_tokens": 1, "output_tokens": 1, "input_tokens_details": {"cached_tokens": 2}},
        {"input_tokens": 1, "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 5}},
        {"input_tokens": 1, "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": -1}},
    ],
)
def test_malformed_usage_is_rejected_by_the_parser(usage: object) -> None:
    with pytest.raises(MalformedUsage):
        parse_usage(usage)


def test_completed_carries_the_reported_usage() -> None:
    out = feed(with_usage(Reply.complete({"a": 1}), GOOD))
    assert isinstance(out, Completed)
    assert out.usage == parse_usage(GOOD) and not out.usage_malformed


@pytest.mark.parametrize("usage", [{"input_tokens": -5, "output_tokens": 1}, "junk", 7])
def test_malformed_usage_is_ignored_and_flagged_never_a_failure(usage: object) -> None:
    out = feed(with_usage(Reply.complete({"a": 1}), usage))
    assert isinstance(out, Completed), out  # the attempt still completes
    assert out.text == '{"a":1}'
    assert out.usage is None and out.usage_malformed


def test_incomplete_and_failed_responses_carry_their_usage() -> None:
    out = feed(with_usage(Reply.incomplete(), GOOD))
    assert isinstance(out, Interruption) and out.kind == "incomplete"
    assert out.usage == parse_usage(GOOD)
    failed = feed(with_usage(Reply.failed(), GOOD))
    assert isinstance(failed, Interruption) and failed.kind == "provider_failed"
    assert failed.usage == parse_usage(GOOD)
    bad = feed(with_usage(Reply.failed(), {"output_tokens": "many"}))
    assert isinstance(bad, Interruption) and bad.kind == "provider_failed"
    assert bad.usage is None and bad.usage_malformed


def test_a_disconnect_reports_no_usage() -> None:
    events = events_for(Reply.disconnect(after_events=4), {"model": "m"}, serial=1, created_at=0)
    stream = ResponseStream(max_events=1000)
    for event in events[:4]:
        assert stream.feed(msgspec.json.encode(event)) is None
    cut = stream.interrupt("disconnected")
    assert cut.usage is None and not cut.usage_malformed


def test_fixture_usage_is_deterministic_from_request_and_answer_sizes() -> None:
    small = {"model": "m", "input": "hi"}
    large = {"model": "m", "input": "hi " * 400, "reasoning": {"effort": "high"}}

    def usage_of(request: dict[str, Any], payload: Any) -> Usage:
        out = feed(events_for(Reply.complete(payload), request, serial=1, created_at=0))
        assert isinstance(out, Completed) and out.usage is not None
        return out.usage

    a = usage_of(small, {"x": 1})
    assert a == usage_of(small, {"x": 1})  # deterministic
    b = usage_of(large, {"x": "y" * 400})
    assert b.input_tokens > a.input_tokens and b.output_tokens > a.output_tokens
    assert b.reasoning_tokens == 256 and a.reasoning_tokens == 0
    assert b.reasoning_tokens <= b.output_tokens
