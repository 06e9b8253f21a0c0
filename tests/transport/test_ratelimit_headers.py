"""Parsing the x-ratelimit-* headers and the token estimate (transport/ratelimit.py)."""

from __future__ import annotations

import msgspec
import pytest

import recoverable
from recoverable.outcome import (
    MAX_RATE_LIMIT_COUNT,
    MAX_RATE_LIMIT_RESET,
    Completed,
    Interruption,
    RateLimits,
)
from recoverable.testing import FixtureProvider
from recoverable.transport.ratelimit import (
    estimate_tokens,
    format_duration,
    parse_duration,
    parse_rate_limit_headers,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1s", 1.0),
        ("6m0s", 360.0),
        ("20ms", 0.02),
        ("1h2m3.5s", 3723.5),
        ("5m30.2s", 330.2),
        ("1m", 60.0),
        ("0s", 0.0),
        ("2.5", 2.5),  # a plain number is seconds
        ("1s500ms", 1.5),
        ("250us", 0.00025),
    ],
)
def test_durations_in_the_providers_format(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text", ["", "abc", "-1s", "1s2m", "s", "ms", "1d", "nan", "inf", "1e400", "1 s",
             "9" * 80 + "s"],
)
def test_malformed_durations_are_ignored(text: str) -> None:
    assert parse_duration(text) is None


def test_durations_are_bounded() -> None:
    assert parse_duration("100000h") == MAX_RATE_LIMIT_RESET
    assert parse_duration("99999999") == MAX_RATE_LIMIT_RESET


def test_format_duration_round_trips() -> None:
    for seconds in (0.02, 0.5, 1.5, 59.0, 61.0, 360.0):
        parsed = parse_duration(format_duration(seconds))
        assert parsed is not None
        assert parsed == pytest.approx(seconds, rel=0.01, abs=0.001)


def test_the_four_headers_case_insensitively_first_value_wins() -> None:
    limits = parse_rate_limit_headers([
        ("X-RateLimit-Remaining-Requests", "59"),
        ("x-ratelimit-remaining-tokens", "149984"),
        ("x-ratelimit-reset-requests", "1s"),
        ("X-Ratelimit-Reset-Tokens", "6m0s"),
        ("x-ratelimit-remaining-requests", "1"),  # a repeat: ignored
        ("content-type", "text/event-stream"),
    ])
    assert limits == RateLimits(remaining_requests=59, remaining_tokens=149984,
                                reset_requests=1.0, reset_tokens=360.0)
    assert parse_rate_limit_headers({"x-ratelimit-remaining-tokens": "0"}) == RateLimits(
        remaining_tokens=0
    )


def test_absent_or_malformed_headers_give_none_field_by_field() -> None:
    assert parse_rate_limit_headers({}) is None
    assert parse_rate_limit_headers({"retry-after": "1"}) is None
    assert parse_rate_limit_headers({
        "x-ratelimit-remaining-requests": "-1", "x-ratelimit-reset-requests": "soon",
    }) is None
    limits = parse_rate_limit_headers({
        "x-ratelimit-remaining-requests": "12abc",
        "x-ratelimit-remaining-tokens": "٣",  # a non-ASCII digit: not a count
        "x-ratelimit-reset-tokens": "20ms",
    })
    assert limits == RateLimits(reset_tokens=0.02)


def test_counts_are_bounded() -> None:
    limits = parse_rate_limit_headers({"x-ratelimit-remaining-tokens": "9" * 40})
    assert limits is not None and limits.remaining_tokens == MAX_RATE_LIMIT_COUNT


def test_estimate_is_a_quarter_of_the_body_plus_max_output_tokens() -> None:
    body = msgspec.json.encode({"input": "x" * 100, "model": "m"})
    assert estimate_tokens(body) == -(-len(body) // 4)
    with_max = msgspec.json.encode({"input": "x" * 100, "max_output_tokens": 500, "model": "m"})
    assert estimate_tokens(with_max) == -(-len(with_max) // 4) + 500
    assert estimate_tokens(b"not json") == 2


# --- surfaced on the outcome by both transports, from a real provider -------------------

BODY = msgspec.json.encode({
    "input": "Six times seven?", "max_output_tokens": 50, "model": "gpt-test",
    "text": {"format": {"type": "json_schema", "name": "a", "strict": True, "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
        "additionalProperties": False}}},
})


@pytest.mark.parametrize("mode", ["sse", "websocket"])
async def test_outcomes_carry_the_rate_limit_headers(mode: str) -> None:
    account = recoverable.AccountBinding("acct-h", "api-key")
    # A bucket of exactly two requests' estimates: the third is refused with a 429. It
    # refills slowly (one token in about half a second), so a loaded machine's delay
    # between the count and the header does not show in the figure.
    cost = estimate_tokens(BODY)
    async with FixtureProvider.serve(tpm_limit=cost, rate_burst_seconds=120.0) as provider:
        async with recoverable.ResponsesBackend(
            provider.http_url, credentials=recoverable.StaticCredentials("sk-h", account=account),
            mode=mode,  # type: ignore[arg-type]
        ) as backend:
            outcomes = [
                await backend.stream(BODY, attempt_id=f"op_h.{i}", token="sk-h")
                for i in (1, 2, 3)
            ]
    first, _, refused = outcomes
    assert isinstance(first, Completed)
    assert first.rate_limits is not None
    # SSE: the headers of the POST's response, sent after this request was counted;
    # WebSocket: the opening handshake's, sent before it was.
    assert first.rate_limits.remaining_tokens in ((cost if mode == "sse" else 2 * cost),
                                                  cost - 1, 2 * cost - 1)
    assert first.rate_limits.reset_tokens is not None
    assert isinstance(refused, Interruption) and refused.http_status == 429
    assert refused.is_rate_limit and refused.retry_after is not None
    assert refused.rate_limits is not None and refused.rate_limits.remaining_tokens is not None
    assert refused.rate_limits.remaining_tokens < cost
