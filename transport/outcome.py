"""Typed facts about how one streamed generation ended.

The transport fills these; the operation state machine decides what they mean
for the budget. Nothing here is parsed from message strings. ``Interruption``
is also persisted inside operation records, so it is a ``msgspec.Struct`` with
only bounded, non-sensitive fields (no provider message text, no headers).
"""

from __future__ import annotations

from typing import Literal

import msgspec

InterruptionKind = Literal[
    "disconnected",  # the connection dropped / closed before a terminal event
    "timeout",  # idle time between events (or connect) passed its bound
    "premature_eof",  # the stream ended cleanly but without a terminal event
    "http_rejected",  # an HTTP (or WS handshake / WS wrapped error with status) rejection
    "provider_failed",  # response.failed, or an error event without an HTTP status
    "incomplete",  # response.incomplete (incomplete_details.reason in provider_code)
    "tool_activity",  # a function/tool call item appeared: stopped, nothing executed
    "malformed",  # a frame or event broke the protocol or a bound (size, count, bytes)
    "refusal",  # the model refused (response.refusal.*) instead of producing output
    "invalid_output",  # completed, but the text is not valid JSON / not schema-valid
    "interrupted",  # the local process died or was cancelled while the attempt was in flight
]

# Quota, credit and spending-limit exhaustion: permanent until the account changes,
# even when the HTTP status is 429 (which otherwise means a temporary rate limit).
QUOTA_CODES: frozenset[str] = frozenset(
    {
        "insufficient_quota",
        "quota_exceeded",
        "credit_balance_exhausted",
        "organization_spend_limit_exceeded",
        "project_spend_limit_exceeded",
        "organization_usage_limit_exceeded",
        "billing_hard_limit_reached",
    }
)


class Interruption(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Why an attempt did not produce a completed response."""

    kind: InterruptionKind
    http_status: int | None = None
    provider_type: str | None = None  # error.type, e.g. "insufficient_quota"
    provider_code: str | None = None  # error.code, or incomplete_details.reason
    retry_after: float | None = None  # seconds, from retry-after-ms / retry-after / WS headers
    response_id: str | None = None
    sequence_number: int | None = None
    had_output: bool = False
    had_tool_activity: bool = False
    transport_code: str | None = None  # e.g. "ws_close_1006", "connect_refused", "frame_too_large"

    @property
    def is_quota(self) -> bool:
        """Recognized quota/credit/spending-limit exhaustion (never a rate limit)."""
        return (self.provider_type in QUOTA_CODES) or (self.provider_code in QUOTA_CODES)

    @property
    def is_rate_limit(self) -> bool:
        return not self.is_quota and (
            self.http_status == 429 or self.provider_code == "rate_limit_exceeded"
        )


class Completed(msgspec.Struct, frozen=True, kw_only=True):
    """The stream reached ``response.completed``; ``text`` is the final output text."""

    text: str
    response_id: str | None = None
    sequence_number: int | None = None


Outcome = Completed | Interruption


class Progress(msgspec.Struct, frozen=True, kw_only=True):
    """Reported to the caller as the stream advances (response id, cursor)."""

    response_id: str | None
    sequence_number: int | None
    had_output: bool
