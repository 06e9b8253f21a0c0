"""A Retry-After a proxy renamed is honoured: LiteLLM's ``llm_provider-retry-after``.

LiteLLM's proxy forwards every upstream response header with an ``llm_provider-`` prefix
(its docs/proxy/response_headers.md), so a 429 the upstream sent with ``retry-after: 5``
reaches the client as ``llm_provider-retry-after: 5`` (BerriAI/litellm#21553). The
standard headers keep precedence; the values are validated and bounded the same way.

Timing (the job test): the real clock, as tests/runtime/test_governor.py explains (the
cooldown is saved by the store's writer thread, which MockClock's autojump would take
for idleness). The bound that matters is one-sided and exact: the replacement's POST
reaches the provider no earlier than the delay after the 429 was recorded there.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
from transport_helpers import make_body

import recoverable
from recoverable.errors import InvalidRequest
from recoverable.fixture.replies import http_rejection
from recoverable.outcome import Completed, Interruption
from recoverable.testing import FixtureProvider, Reply
from recoverable.transport.events import ResponseStream
from recoverable.transport.ratelimit import RETRY_AFTER_HEADERS, parse_retry_after

ACCOUNT = recoverable.AccountBinding("acct-proxy", "api-key")
REQUEST = recoverable.StructuredRequest(
    model="gpt-test", instructions="Answer briefly.", input="What is six times seven?"
)
NO_BACKOFF = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
TEN_YEARS = 10 * 365 * 24 * 3600.0  # parse_retry_after's cap (the policy caps far lower)


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


def backend_for(provider: FixtureProvider, mode: str) -> recoverable.ResponsesBackend:
    creds = recoverable.StaticCredentials("sk-test", account=ACCOUNT)
    return recoverable.ResponsesBackend(
        provider.http_url, credentials=creds, mode=mode,  # type: ignore[arg-type]
        endpoint_id="fixture",
    )


# -- parse_retry_after: the spellings, their precedence, their bounds -----------------------


def test_the_accepted_spellings_in_their_order() -> None:
    assert [name for name, _ in RETRY_AFTER_HEADERS] == [
        "retry-after-ms", "retry-after", "llm_provider-retry-after-ms",
        "llm_provider-retry-after",
    ]


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"llm_provider-retry-after": "7"}, 7.0),
        ({"llm_provider-retry-after": " 2.5 "}, 2.5),
        ({"LLM_Provider-Retry-After": "3"}, 3.0),  # names match case-insensitively
        ({"llm_provider-retry-after-ms": "1500"}, 1.5),
        ([("llm_provider-retry-after", "4"), ("llm_provider-retry-after", "9")], 4.0),
    ],
)
def test_litellm_s_renamed_headers_are_read(headers: Any, expected: float) -> None:
    assert parse_retry_after(headers) == pytest.approx(expected)


def test_a_renamed_http_date_is_read_like_the_standard_one() -> None:
    now = dt.datetime(2030, 1, 1, tzinfo=dt.UTC).timestamp()
    later = email.utils.format_datetime(dt.datetime(2030, 1, 1, 0, 0, 30, tzinfo=dt.UTC),
                                        usegmt=True)
    assert parse_retry_after({"llm_provider-retry-after": later}, now=now) == 30.0


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        # The standard header wins over the proxy's, whichever comes first on the wire.
        ([("llm_provider-retry-after", "9"), ("retry-after", "2")], 2.0),
        ({"retry-after-ms": "500", "llm_provider-retry-after-ms": "9000"}, 0.5),
        ({"retry-after": "0", "llm_provider-retry-after": "9"}, 0.0),
        # Milliseconds before seconds, within the proxy's pair as within the standard one.
        ({"llm_provider-retry-after": "9", "llm_provider-retry-after-ms": "250"}, 0.25),
        # An unusable standard value does not hide a usable renamed one.
        ({"retry-after": "soon", "llm_provider-retry-after": "6"}, 6.0),
        ({"retry-after-ms": "-1", "retry-after": "nan", "llm_provider-retry-after-ms": "800"},
         0.8),
    ],
)
def test_precedence(headers: Any, expected: float) -> None:
    assert parse_retry_after(headers) == pytest.approx(expected)


@pytest.mark.parametrize(
    "value", ["-1", "nan", "inf", "-inf", "1e400", "soon", "", "0x10", "Mon, 99 Foo 2030"]
)
@pytest.mark.parametrize("name", ["llm_provider-retry-after", "llm_provider-retry-after-ms"])
def test_unusable_renamed_values_are_ignored(name: str, value: str) -> None:
    assert parse_retry_after({name: value}) is None


def test_a_huge_renamed_value_is_bounded_like_the_standard_one() -> None:
    for name, huge in (("llm_provider-retry-after", "1e12"),
                       ("llm_provider-retry-after-ms", "1e15")):
        got = parse_retry_after({name: huge})
        assert got == TEN_YEARS == parse_retry_after({"retry-after": "1e12"})
        assert got is not None and math.isfinite(got)


@pytest.mark.parametrize(
    "name", ["x-upstream-retry-after", "llm_provider-x-ms-retry-after-ms", "retry_after",
             "x-ratelimit-reset-after"],
)
def test_other_spellings_are_not_guessed(name: str) -> None:
    assert parse_retry_after({name: "5"}) is None


def test_a_websocket_error_event_with_the_renamed_header_carries_it() -> None:
    """The WebSocket mode wraps an HTTP error in an ``error`` event with its headers."""
    stream = ResponseStream(max_events=10)
    out = stream.feed(msgspec.json.encode({
        "type": "error", "status": 429,
        "error": {"type": "requests", "code": "rate_limit_exceeded", "message": "m"},
        "headers": {"LLM_Provider-Retry-After": "4"},
    }))
    assert isinstance(out, Interruption)
    assert (out.kind, out.http_status, out.retry_after) == ("http_rejected", 429, 4.0)


# -- the fixture provider's renamed 429 ------------------------------------------------------


def test_the_fixture_sends_only_the_named_header_in_its_unit() -> None:
    def sent(reply: Reply) -> dict[str, str]:
        return {name: value for name, value in http_rejection(reply).headers
                if name != "content-type"}

    assert sent(Reply.rate_limited(3.0)) == {"retry-after": "3", "retry-after-ms": "3000"}
    assert sent(Reply.rate_limited(3.0, retry_after_header="llm_provider-retry-after")) == {
        "llm_provider-retry-after": "3"}
    assert sent(Reply.rate_limited(1.5, retry_after_header="llm_provider-retry-after-ms")) == {
        "llm_provider-retry-after-ms": "1500"}
    reply = Reply.rate_limited(2.0, retry_after_header="llm_provider-retry-after")
    assert Reply.from_spec(reply.to_spec()) == reply
    for bad in ("", "Retry-After", "retry after", "x" * 65, 7):
        with pytest.raises(InvalidRequest):
            Reply.rate_limited(1.0, retry_after_header=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["sse", "websocket"])
async def test_a_renamed_429_reaches_the_outcome_over_real_sockets(mode: str) -> None:
    """SSE: the POST's 429. WebSocket: the refused opening handshake (the first request),
    then the ``error`` event wrapping a 429 on the connection opened since (the third)."""
    renamed = Reply.rate_limited(4.0, retry_after_header="llm_provider-retry-after")
    async with FixtureProvider.serve() as provider:
        provider.script([renamed, Reply.complete({"answer": 1}), renamed,
                         Reply.rate_limited(4.0, retry_after_header="x-upstream-retry-after")])
        async with backend_for(provider, mode) as backend:
            outcomes = [
                await backend.stream(make_body(), attempt_id=f"op_proxy.{number}",
                                     token="sk-test")
                for number in (1, 2, 3, 4)
            ]
        requests = list(provider.requests)
    if mode == "websocket":  # the paths claimed above, as the provider saw them
        assert requests[0].body == b""  # answered at the handshake
        assert (requests[2].connection, requests[2].sequence) == (requests[1].connection, 2)
    first, completed, third, unknown = outcomes
    assert isinstance(completed, Completed)
    for refused in (first, third):
        assert isinstance(refused, Interruption), refused
        assert (refused.kind, refused.http_status) == ("http_rejected", 429)
        assert refused.is_rate_limit and refused.retry_after == 4.0
    # A spelling nobody documents is not guessed: the policy's own backoff applies.
    assert isinstance(unknown, Interruption) and unknown.http_status == 429
    assert unknown.retry_after is None


# -- a job behind the proxy waits what the upstream asked -----------------------------------


@pytest.mark.parametrize("mode", ["sse", "websocket"])
async def test_a_job_waits_the_renamed_retry_after_before_its_replacement(
    tmp_path: Path, mode: str
) -> None:
    delay = 2.0  # the only wait: the policy's own backoff is zero
    async with FixtureProvider.serve() as provider:
        provider.script([
            Reply.rate_limited(delay, retry_after_header="llm_provider-retry-after"),
            Reply.complete({"answer": 42, "note": "ok"}),
        ])
        waiting = trio.Event()

        def sink(event: recoverable.TelemetryEvent) -> None:
            if event.name == "recovery.operation.waiting":
                waiting.set()

        async def allow(attempt: recoverable.Attempt) -> bool:
            return True

        with recoverable.RecoveryStore.open(str(tmp_path / "store")) as store:
            async with recoverable.open_runtime(
                store, backend_for(provider, mode), account=ACCOUNT, telemetry=sink
            ) as rt:
                handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3,
                                          retry_policy=NO_BACKOFF)
                saved: list[Any] = []

                async def watch() -> None:
                    await waiting.wait()
                    saved.append(store.get_operation(handle.operation_id))
                    saved.append(await rt.status(handle))

                with trio.fail_after(60):  # a hang guard, not a timing claim
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(watch)
                        value = await rt.send_recovering(handle, response=Answer,
                                                         authorize=allow)
            assert value == Answer(42, "ok")
            final = store.get_operation(handle.operation_id)
        requests = list(provider.requests)
    assert [request.reply_kind for request in requests] == ["rate_limited", "complete"]
    limited_at, replaced_at = requests[0].received_at, requests[1].received_at
    # The replacement came no earlier than the upstream asked (one-sided, exact) ...
    assert replaced_at >= limited_at + delay, (limited_at, replaced_at)
    # ... and the cooldown was saved before the wait: the record and the status say when.
    record, status = saved
    assert record.phase == "waiting" and record.last_failure is not None
    assert record.last_failure.retry_after == delay
    assert record.next_attempt_at is not None and record.next_attempt_at >= limited_at + delay
    assert record.next_attempt_at < limited_at + delay + 60.0  # generous: a loaded machine
    assert status.availability == "waiting" and status.next_attempt_at is not None
    assert status.next_attempt_at.timestamp() == pytest.approx(record.next_attempt_at)
    assert final is not None and final.attempts[0].failure is not None
    assert final.attempts[0].failure.retry_after == delay  # kept with the spent attempt
