"""A failure reported by an ``error`` event reads as one, not as ``response.failed``.

Both end an attempt as ``provider_failed`` (an ``error`` event without an HTTP status is
how a proxy such as LiteLLM forwards an upstream failure) and both are judged alike by
the failure policy; only the sentence a person reads differs. The parser marks the error
event (``transport_code="error_event"``), the mark is saved with the failure, and the
stable error codes stay as they were.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

import recoverable
from recoverable import errors
from recoverable.failure_policy import RetryPolicy, classify
from recoverable.failure_text import describe_interruption
from recoverable.outcome import ERROR_EVENT, Interruption
from recoverable.testing import FixtureProvider, Reply
from recoverable.transport.events import ResponseStream

OP = "op_text1"
ACCOUNT = recoverable.AccountBinding("acct-error-event", "api-key")
REQUEST = recoverable.StructuredRequest(
    model="gpt-test", instructions="Answer briefly.", input="What is six times seven?"
)


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


def parsed(event: dict[str, Any]) -> Interruption:
    stream = ResponseStream(max_events=100)
    outcome = stream.feed(msgspec.json.encode(event))
    assert isinstance(outcome, Interruption), outcome
    return outcome


ERROR_EVENTS = [
    {"type": "error", "error": {"type": "server_error", "code": "server_error", "message": "m"}},
    {"type": "error", "code": "server_error", "message": "m", "param": None},  # flat shape
    {"error": {"type": "server_error", "code": "server_error", "message": "m"}},  # as proxies
]


@pytest.mark.parametrize("event", ERROR_EVENTS)
def test_an_error_event_without_a_status_says_error_event_not_response_failed(
    event: dict[str, Any],
) -> None:
    failure = parsed(event)
    assert (failure.kind, failure.http_status) == ("provider_failed", None)
    assert failure.provider_code == "server_error"
    assert failure.transport_code == ERROR_EVENT
    text = describe_interruption(failure)
    assert text == "the provider sent an error event (code server_error)"
    first = errors.ProviderError("provider_failed", operation_id=OP, interruption=failure)
    ended = errors.PermanentlyFailed("provider_failed", operation_id=OP, last_failure=failure)
    exhausted = errors.AttemptsExhausted(operation_id=OP, last_failure=failure)
    for error in (first, ended, exhausted):
        assert "the provider sent an error event (code server_error)" in str(error), error
        assert "response.failed" not in str(error) and "response failed" not in str(error)
        assert "error_event" not in str(error)  # the mark is said in words, not as a code
    # The stable codes and the failure policy's judgement are those of response.failed.
    assert (first.code, ended.code, exhausted.code) == (
        "provider_error", "permanently_failed", "attempts_exhausted")
    policy = RetryPolicy()
    assert classify(failure, policy) == classify(
        Interruption(kind="provider_failed", provider_type="server_error",
                     provider_code="server_error"), policy) == "provider_failed"


def test_a_response_failed_still_says_response_failed() -> None:
    failure = parsed({"type": "response.failed",
                      "response": {"id": "resp_1", "error": {"code": "server_error"}}})
    assert (failure.kind, failure.transport_code) == ("provider_failed", None)
    assert describe_interruption(failure) == (
        "the provider reported response.failed (code server_error)")
    ended = str(errors.PermanentlyFailed("provider_failed", operation_id=OP,
                                         last_failure=failure))
    assert "the provider reported that the response failed (code server_error)" in ended
    assert "error event" not in ended
    first = str(errors.ProviderError("provider_failed", operation_id=OP, interruption=failure))
    assert "response.failed" in first and "error event" not in first


def test_an_error_event_with_a_status_is_still_the_http_rejection_it_wraps() -> None:
    failure = parsed({"type": "error", "status": 500,
                      "error": {"type": "server_error", "code": "server_error"}})
    assert (failure.kind, failure.http_status, failure.transport_code) == (
        "http_rejected", 500, None)
    assert describe_interruption(failure).startswith("the provider rejected it (HTTP 500")


@pytest.mark.parametrize("mode", ["sse", "websocket"])
@pytest.mark.parametrize(
    ("reply", "words"),
    [
        (Reply.error_event(error_type="server_error", code="server_error"),
         "the provider sent an error event (code server_error)"),
        (Reply.failed("server_error"), "the provider reported"),
    ],
)
async def test_the_real_provider_s_error_event_is_named_when_raised_and_after_reopening(
    tmp_path: Path, mode: str, reply: Reply, words: str
) -> None:
    """Over real sockets: the first failure (``ProviderError``) and the saved one read on
    reopening the store (``PermanentlyFailed``) both name what the provider sent."""
    is_error_event = reply.kind == "error_event"

    async def allow(attempt: recoverable.Attempt) -> bool:
        return True

    path = str(tmp_path / "store")
    async with FixtureProvider.serve() as provider:
        provider.script([reply])

        def backend() -> recoverable.ResponsesBackend:
            creds = recoverable.StaticCredentials("sk-test", account=ACCOUNT)
            return recoverable.ResponsesBackend(
                provider.http_url, credentials=creds, mode=mode,  # type: ignore[arg-type]
                endpoint_id="fixture",
            )

        with recoverable.RecoveryStore.open(path) as store:
            async with recoverable.open_runtime(store, backend(), account=ACCOUNT) as rt:
                handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
                with pytest.raises(errors.ProviderError) as first:
                    await rt.send_recovering(handle, response=Answer, authorize=allow)
        with recoverable.RecoveryStore.open(path) as store:
            record = store.get_operation(handle.operation_id)
            assert record is not None and record.last_failure is not None
            assert record.failure_reason == "provider_failed"
            assert record.last_failure.transport_code == (ERROR_EVENT if is_error_event
                                                          else None)
            async with recoverable.open_runtime(store, backend(), account=ACCOUNT) as rt:
                with pytest.raises(errors.PermanentlyFailed) as reopened:
                    await rt.send_recovering(handle, response=Answer, authorize=allow)
        assert len(provider.requests) == 1  # never replaced: the code is not allowed
    assert (first.value.code, reopened.value.code) == ("provider_error", "permanently_failed")
    for error in (first.value, reopened.value):
        text = str(error)
        assert words in text, text
        assert ("error event" in text) == is_error_event, text
        assert ("response.failed" in text or "the response failed" in text) == (
            not is_error_event), text
