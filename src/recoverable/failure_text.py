"""How a failure reads to a person: the sentences ``recoverable.errors`` builds from a
failure reason and a typed :class:`~recoverable.outcome.Interruption`.

Only the library's own text and bounded typed fields (statuses, codes, ids) are used,
never provider message text, prompts, outputs or credentials.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from recoverable.outcome import ERROR_EVENT, Interruption

__all__ = [
    "REASONS",
    "bounded",
    "describe_interruption",
    "interruption_facts",
    "reason_todo",
    "reason_what",
]

_CODE_CHARS = re.compile(r"[^A-Za-z0-9_.:/-]")


def bounded(value: object, limit: int = 64) -> str:
    """A code-like value, bounded and restricted to code characters."""
    return _CODE_CHARS.sub("?", str(value))[:limit]


# Terminal failure reasons (``machine.classify``): (what happened, what to do).
_RETRY = "runtime.retry(handle, retry_action_id=..., maximum_attempts=...)"
REASONS: Final[Mapping[str, tuple[str, str]]] = {
    "quota": (
        "the account's quota, credit or spending limit is exhausted",
        f"raise the limit or add credit, then create a deliberate manual retry with {_RETRY}",
    ),
    "rejected": (
        "the provider rejected the request",
        f"fix the authorization or configuration, then create a manual retry with {_RETRY}",
    ),
    "provider_failed": (
        "the provider reported that the response failed",
        f"if the failure may be transient, create a manual retry with {_RETRY}",
    ),
    "incomplete": (
        "the response ended incomplete",
        "raise max_output_tokens or opt in with RetryPolicy(replace_incomplete=True), then "
        f"create a manual retry with {_RETRY}",
    ),
    "invalid_output": (
        "the output was not valid for the response schema",
        "fix or migrate the contract, or opt in with RetryPolicy(replace_invalid_output=True); "
        f"a manual retry is {_RETRY}",
    ),
    "tool_activity": (
        "the model started a tool call (nothing was executed, and it is never replaced)",
        "fix the request or integration: recoverable sends tool-free requests only",
    ),
    "authentication_required": (
        "the provider rejected the credentials (HTTP 401), even after renewing them",
        "sign in to the same account again, then call send_recovering with the same handle",
    ),
    "interrupted": (
        "an attempt was interrupted and the operation's policy (on_interruption=\"fail\") "
        "forbids replacing it",
        f"if the work is still wanted, create a deliberate manual retry with {_RETRY}",
    ),
    "owner_lost": (
        "the process that owned it was lost and no replacement may follow (its budget is "
        "spent, or its policy on_interruption=\"fail\" forbids replacing an interrupted "
        "attempt)",
        f"if the work is still wanted, create a deliberate manual retry with {_RETRY}",
    ),
    "expired": (
        "the process that owned it was lost after its attempt permission (expires_at) ran out",
        f"create a manual retry with a later expiry: {_RETRY}",
    ),
    "authorization_failed": (
        "the worker's authorization policy did not answer (it raised, or returned "
        "something other than True or False); nothing was spent",
        f"fix the policy (recoverable worker --authorizer), then create a manual retry with "
        f"{_RETRY}",
    ),
    "no_worker": (
        "no live worker of its account and endpoint served it within its unclaimed bound "
        "(unclaimed_after, or the sweep's --unclaimed-after)",
        "start a worker for its account and endpoint, then create a manual retry with "
        f"{_RETRY}",
    ),
}


def reason_what(reason: str, failure: Interruption | None) -> str:
    """What happened, for a terminal failure reason listed in :data:`REASONS`: its
    sentence, naming the error event that reported it when it was one, and the typed
    facts of the failure."""
    what = REASONS[reason][0]
    if reason == "provider_failed" and failure is not None and _is_error_event(failure):
        what = _ERROR_EVENT_TEXT
    facts = interruption_facts(failure) if failure is not None else ()
    return what + (f" ({', '.join(facts)})" if facts else "")


def reason_todo(reason: str) -> str:
    """What to do after a terminal failure reason."""
    if reason in REASONS:
        return REASONS[reason][1]
    return f"see docs/failures.md; a deliberate manual retry is {_RETRY}"


_KINDS: dict[str, str] = {
    "disconnected": "the connection was lost",
    "timeout": "it timed out",
    "premature_eof": "the stream ended without a final event",
    "http_rejected": "the provider rejected it",
    "provider_failed": "the provider reported response.failed",
    "incomplete": "the response was incomplete",
    "tool_activity": "the model started a tool call",
    "malformed": "the stream broke the protocol or a bound",
    "refusal": "the model refused",
    "invalid_output": "the output was not valid JSON for the schema",
    "interrupted": "the attempt was interrupted",
    "reattach_unavailable": "its saved response could not be resumed (gone, expired or "
    "cancelled on the provider)",
}

# ``provider_failed`` also comes from an ``error`` event without an HTTP status (as a proxy
# forwards an upstream failure): naming ``response.failed`` then would send a person
# looking for an event the provider never sent.
_ERROR_EVENT_TEXT: Final = "the provider sent an error event"


def _is_error_event(failure: Interruption) -> bool:
    return failure.kind == "provider_failed" and failure.transport_code == ERROR_EVENT


_TRANSPORT_CODES: dict[str, str] = {
    "connect_refused": "connection refused",
    "connect_failed": "could not connect",
    "connect_timeout": "connecting timed out",
    "idle_timeout": "no event within the idle timeout",
    "http_timeout": "the HTTP exchange timed out",
    "read_error": "reading failed",
    "http_protocol_error": "the server broke the HTTP exchange",
    "transport_error": "a transport error",
    "handshake_protocol_error": "the server broke the WebSocket handshake",
    "frame_too_large": "an event was larger than the bound",
    "stream_too_large": "the stream was larger than the bound",
    "too_many_events": "the stream had more events than the bound",
    "invalid_json": "an event was not valid JSON",
    "write_error": "writing failed",
    "signed_out": "signed out",
    "account_changed": "the account changed",
    "owner_lost": "the process that owned it was lost",
    "suspended": "it was suspended",
    "cancelled": "it was cancelled",
}


def _transport_text(code: str) -> str:
    if code in _TRANSPORT_CODES:
        return _TRANSPORT_CODES[code]
    if code.startswith("tls") or "certificate" in code or code.startswith("ssl"):
        return f"TLS handshake failed: {bounded(code)}"
    if code.startswith("dns") or code.startswith("name_resolution"):
        return f"the host name did not resolve: {bounded(code)}"
    if code.startswith("ws_close_"):
        return f"WebSocket closed with code {bounded(code[len('ws_close_'):])}"
    return bounded(code)


def describe_interruption(interruption: Interruption) -> str:
    """A short readable description of a typed interruption (bounded codes only)."""
    if _is_error_event(interruption):
        text = _ERROR_EVENT_TEXT
    else:
        text = _KINDS.get(interruption.kind, bounded(interruption.kind))
    facts = interruption_facts(interruption)
    return f"{text} ({', '.join(facts)})" if facts else text


def interruption_facts(interruption: Interruption) -> tuple[str, ...]:
    """The typed facts of a failure, each readable and bounded (HTTP status, code, ...)."""
    facts: list[str] = []
    if interruption.http_status is not None:
        facts.append(f"HTTP {interruption.http_status}")
    if interruption.provider_code:
        facts.append(f"code {bounded(interruption.provider_code)}")
    elif interruption.provider_type:
        facts.append(f"type {bounded(interruption.provider_type)}")
    # The error-event marker is not a fact of its own: the sentence before the facts names it.
    if interruption.transport_code and not _is_error_event(interruption):
        facts.append(_transport_text(interruption.transport_code))
    if interruption.retry_after is not None:
        facts.append(f"retry after {interruption.retry_after:g} s")
    if interruption.output_path is not None:
        where = interruption.output_path
        facts.append(f"at {bounded(where, 160)}" if where else "at the root of the output")
    return tuple(facts)
