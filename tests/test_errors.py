"""Readable errors (issue 19.8): ``str()`` says what happened, to which operation and
what to do; the typed fields and ``.code`` are unchanged; no secret reaches a message."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import msgspec
import pytest

import recoverable
from recoverable import errors
from recoverable.outcome import Interruption
from recoverable.testing import FixtureProvider, Reply

OP = "op_0123456789abcdef"
ACTION_WORDS = ("call ", "create", "retry", "sign ", "restore", "abandon", "check", "wait",
                "correct", "fix", "raise", "pass ", "open ", "free ", "repeat", "continue",
                "send ", "see ", "prepare")
DISCONNECT = Interruption(kind="disconnected", transport_code="ws_close_1006")


def _constructed() -> list[errors.RecoveryError]:
    """Every public error class, built with the arguments its raise sites use."""
    quota = Interruption(kind="http_rejected", http_status=429, provider_type="insufficient_quota",
                         provider_code="insufficient_quota")
    return [
        errors.OperationBusy("stop and await the active execution first", operation_id=OP),
        errors.AttemptsExhausted(operation_id=OP, last_failure=DISCONNECT),
        errors.AttemptNotAuthorized(operation_id=OP, attempt_id=f"{OP}.2"),
        errors.PermanentlyFailed("quota", operation_id=OP, last_failure=quota),
        errors.OperationCancelled(operation_id=OP),
        errors.OperationSuspended(operation_id=OP),
        errors.FormatMismatch("the requested response format differs from the saved one",
                              operation_id=OP),
        errors.StateExpired(operation_id=OP),
        errors.StateUnavailable("no such operation", operation_id=OP),
        errors.UnsupportedRecordVersion("format 99", operation_id=OP),
        errors.CorruptRecord("the frozen body is missing", operation_id=OP),
        errors.StorageLimitExceeded("the LMDB map is full", operation_id=OP),
        errors.StorageUnavailable("the store is closed", operation_id=OP),
        errors.RequestUnavailable(
            "the frozen request body is missing from the store: nothing was sent or spent",
            operation_id=OP),
        errors.FenceMismatch(operation_id=OP),
        errors.CompletionUnavailable("the saved completion is missing", operation_id=OP),
        errors.AccountChanged("signed out", operation_id=OP),
        errors.AuthenticationRequired(operation_id=OP),
        errors.ConfigurationUnavailable("the operation was prepared for another endpoint",
                                        operation_id=OP),
        errors.RetryNotAllowed("the operation can still run: resume it instead",
                               operation_id=OP),
        errors.RetryAlreadyCreated(f"successor {OP}x exists; retry from it", operation_id=OP),
        errors.RetryConfigurationMismatch(operation_id=OP),
        errors.InvalidRequest("operation id collision", operation_id=OP),
        errors.ProviderError("quota", operation_id=OP, interruption=quota),
    ]


def _has_action(text: str) -> bool:
    hint = text.split("; ", 1)[1] if "; " in text else ""
    return any(word in hint for word in ACTION_WORDS)


@pytest.mark.parametrize("error", _constructed(), ids=lambda e: type(e).__name__)
def test_every_error_names_its_operation_and_what_to_do(error: errors.RecoveryError) -> None:
    text = str(error)
    assert text.startswith(f"operation {OP}: "), text
    assert _has_action(text), text
    assert text != error.code


def test_every_public_error_class_is_readable() -> None:
    """Also the classes added later: each one (built generically when the table above
    does not name it) names the operation and gives a hint, never just its code."""
    # Raised by prepare before any operation exists (no id to name); their text names the
    # parameter, input item or field instead (checked below and in their own tests).
    prepare_time = {errors.UnsupportedInputItem, errors.InvalidParameter,
                    errors.UnsupportedOutputType}
    named = {type(e) for e in _constructed()} | prepare_time
    for name in errors.__all__:
        cls = getattr(errors, name)
        if not (inspect.isclass(cls) and issubclass(cls, errors.RecoveryError)):
            continue
        if cls in named or cls is errors.RecoveryError:
            continue
        error = cls(operation_id=OP)
        text = str(error)
        assert text.startswith(f"operation {OP}: ") and _has_action(text), (name, text)
    parameter = errors.InvalidParameter("temperature must be in 0..2", parameter="temperature")
    assert "temperature" in str(parameter) and str(parameter) != parameter.code


def test_typed_fields_and_codes_are_unchanged() -> None:
    exhausted = errors.AttemptsExhausted(operation_id=OP, last_failure=DISCONNECT)
    assert exhausted.code == "attempts_exhausted" and exhausted.last_failure is DISCONNECT
    assert exhausted.operation_id == OP and exhausted.args == ("attempts_exhausted",)
    rate = Interruption(kind="http_rejected", http_status=429, retry_after=2.0)
    provider = errors.ProviderError("rejected", operation_id=OP, interruption=rate)
    assert (provider.code, provider.kind, provider.http_status, provider.retry_after) == (
        "provider_error", "http_rejected", 429, 2.0)
    assert provider.args == ("rejected",) and provider._detail == "rejected"
    denied = errors.AttemptNotAuthorized(operation_id=OP, attempt_id="a.1")
    assert denied.attempt_id == "a.1" and denied.code == "attempt_not_authorized"
    item = errors.UnsupportedInputItem("input item 3 is not a message", item_index=3,
                                       item_type=None)
    assert (item.item_index, item.item_type, item.code) == (3, None, "unsupported_input_item")
    assert str(item).startswith("input item 3 is not a message; ")
    assert isinstance(item, ValueError)
    # Without an operation id the message still says what happened and what to do.
    closed = errors.StorageUnavailable("the store is closed")
    assert str(closed).startswith("the store cannot be read or written (the store is closed); ")


def test_attempts_exhausted_says_what_to_do() -> None:
    text = str(errors.AttemptsExhausted(operation_id=OP, last_failure=DISCONNECT))
    assert text == (
        f"operation {OP}: its whole attempt budget is spent (last failure: the connection "
        "was lost (WebSocket closed with code 1006)); nothing more is sent automatically; "
        "if the user decides to try again, create a manual retry: "
        "runtime.retry(handle, retry_action_id=..., maximum_attempts=...)"
    )


@pytest.mark.parametrize(
    ("interruption", "words"),
    [
        (Interruption(kind="disconnected", transport_code="connect_refused"),
         "connection refused"),
        (Interruption(kind="disconnected", transport_code="connect_failed"), "could not connect"),
        (Interruption(kind="timeout", transport_code="connect_timeout"), "connecting timed out"),
        (Interruption(kind="disconnected", transport_code="tls_handshake_failed"),
         "TLS handshake failed"),
        (Interruption(kind="timeout", transport_code="idle_timeout"), "idle timeout"),
        (Interruption(kind="http_rejected", http_status=429, retry_after=3.0),
         "HTTP 429, retry after 3 s"),
        (Interruption(kind="incomplete", provider_code="max_output_tokens"),
         "incomplete (code max_output_tokens)"),
    ],
)
def test_connection_failures_say_refused_timeout_or_tls(
    interruption: Interruption, words: str
) -> None:
    text = str(errors.AttemptsExhausted(operation_id=OP, last_failure=interruption))
    assert words in text, text


def test_provider_codes_are_bounded_to_code_characters() -> None:
    odd = Interruption(kind="provider_failed", provider_code="x" * 500 + " <b>hi</b>\n")
    text = str(errors.ProviderError("provider_failed", operation_id=OP, interruption=odd))
    assert "<" not in text and "\n" not in text and "x" * 65 not in text


# --- raised for real: the messages of a real run against the fixture provider --------

SECRET_PROMPT = "PROMPT-SECRET-7f3a9c"
SECRET_OUTPUT = "OUTPUT-SECRET-b81d2e"
SECRET_ACCOUNT = "ACCOUNT-SECRET-51c0aa"
SECRET_SCOPE = "SCOPE-SECRET-e4e4e4"
SECRET_JOB = "JOB-SECRET-90909a"
SECRET_KEY = "sk-KEY-SECRET-123456"
SECRETS = (SECRET_PROMPT, SECRET_OUTPUT, SECRET_ACCOUNT, SECRET_SCOPE, SECRET_JOB, SECRET_KEY)


class Note(msgspec.Struct, frozen=True):
    note: str


async def test_real_failures_name_the_operation_and_leak_nothing(tmp_path: Path) -> None:
    account = recoverable.AccountBinding(SECRET_ACCOUNT, "api-key")
    request = recoverable.StructuredRequest(
        model="gpt-test", instructions=f"Say {SECRET_PROMPT}.", input=SECRET_PROMPT
    )
    fast = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)

    async def allow(attempt: recoverable.Attempt) -> bool:
        return True

    async def deny(attempt: recoverable.Attempt) -> bool:
        return False

    messages: list[str] = []
    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    try:
        async with FixtureProvider.serve() as provider:
            provider.script([
                Reply.disconnect(after_events=3), Reply.disconnect(after_events=3),
                Reply.http_error(403, {"error": {"type": "invalid_request_error",
                                                 "code": "forbidden",
                                                 "message": SECRET_OUTPUT}}),
            ])
            creds = recoverable.StaticCredentials(SECRET_KEY, account=account)
            backend = recoverable.ResponsesBackend(provider.http_url, credentials=creds,
                                                   mode="sse", endpoint_id="fixture")
            async with recoverable.open_runtime(store, backend, account=account) as rt:
                exhausted = await rt.prepare(request, response=Note, maximum_attempts=2,
                                             retry_policy=fast, scope=SECRET_SCOPE,
                                             job_id=SECRET_JOB)
                with pytest.raises(errors.AttemptsExhausted) as caught:
                    await rt.send_recovering(exhausted, response=Note, authorize=allow)
                messages.append(str(caught.value))
                assert exhausted.operation_id in str(caught.value)
                assert "runtime.retry(" in str(caught.value)
                rejected = await rt.prepare(request, response=Note, maximum_attempts=2,
                                            scope=SECRET_SCOPE, job_id=SECRET_JOB,
                                            input_revision="2")
                with pytest.raises(errors.ProviderError) as provider_error:
                    await rt.send_recovering(rejected, response=Note, authorize=allow)
                messages.append(str(provider_error.value))
                assert "HTTP 403" in str(provider_error.value)
                assert rejected.operation_id in str(provider_error.value)
                with pytest.raises(errors.PermanentlyFailed) as reopened:
                    await rt.send_recovering(rejected, response=Note, authorize=allow)
                messages.append(str(reopened.value))
                denied = await rt.prepare(request, response=Note, maximum_attempts=2,
                                          scope=SECRET_SCOPE, job_id=SECRET_JOB,
                                          input_revision="3")
                with pytest.raises(errors.AttemptNotAuthorized) as refused:
                    await rt.send_recovering(denied, response=Note, authorize=deny)
                messages.append(str(refused.value))
                with pytest.raises(errors.RetryNotAllowed) as not_allowed:
                    await rt.retry(denied, retry_action_id="a1", maximum_attempts=1)
                messages.append(str(not_allowed.value))
                with pytest.raises(errors.StateUnavailable) as missing:
                    await rt.status(recoverable.Handle("op_missing"))
                messages.append(str(missing.value))
            # A refused connection spends nothing and raises nothing: the send waits in the
            # shared endpoint backoff (tests/runtime/test_endpoint_unavailable.py); its words
            # are checked in test_connection_failures_say_refused_timeout_or_tls.
    finally:
        store.close()
    for text in messages:
        assert text.startswith("operation op"), text
        assert _has_action(text), text
        for secret in SECRETS:
            assert secret not in text, (secret, text)


def test_message_of_an_unknown_reason_still_has_an_action() -> None:
    error: Any = errors.PermanentlyFailed("something_new", operation_id=OP)
    assert str(error).startswith(f"operation {OP}: it failed permanently (something_new); see ")
