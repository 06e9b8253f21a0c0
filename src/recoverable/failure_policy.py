"""What happens after a failed attempt: the one file that answers "and after a 429?".

The machine (``recoverable.machine``) asks :func:`classify` whether a failed attempt may
be replaced, and :func:`backoff_delay` how long to wait first. Everything those answers
depend on lives here: the host's saved :class:`RetryPolicy` and its default statuses, the
provider words that mean quota exhaustion (terminal, even at HTTP 429) or a temporary
rate limit (judged like a 429), and the interruption kinds that are always replaceable.

This module imports nothing else of the package: it is the ground floor the failure
values (``recoverable.outcome``), the records and the machine stand on. It reads a
failure through :class:`FailureFacts`, the fields of ``outcome.Interruption`` it needs.
"""

from __future__ import annotations

import math
from typing import Final, Literal, Protocol

import msgspec

__all__ = [
    "CLASSIFIED_REASONS",
    "QUOTA_CODES",
    "RATE_LIMIT_NAMES",
    "RETRYABLE_STATUSES",
    "TRANSPORT_KINDS",
    "FailureFacts",
    "FailureReason",
    "RetryPolicy",
    "backoff_delay",
    "classify",
    "is_quota",
    "is_rate_limit",
    "provider_key",
]

# Why an operation ended for good (``OperationRecord.failure_reason``).
FailureReason = Literal[
    "exhausted",  # budget spent on replacement-eligible failures
    "quota",  # quota/credit/spending limit: never replaced
    "rejected",  # 403 and other nonretryable HTTP rejections
    "provider_failed",  # response.failed with a code not allowed for replacement
    "invalid_output",  # invalid JSON / schema violation / refusal
    "incomplete",  # response.incomplete
    "tool_activity",  # tool call seen: nothing executed, never replaced
    "response_too_large",  # a configured size bound was passed: a replacement would too
    "authentication_required",  # 401 and renewal unavailable
    "token_budget_exhausted",  # maximum_output_tokens_total reached: no replacement
    "cost_budget_exhausted",  # maximum_cost_total reached (reported usage x price)
    "interrupted",  # on_interruption="fail": an interrupted attempt ends the operation
    "owner_lost",  # the recovery sweep found its owner gone, and no replacement may follow
    "expired",  # the recovery sweep found its owner gone after expires_at
    "no_worker",  # no live worker of its account and endpoint within its unclaimed bound
    # a worker's standing authorization policy raised (or did not answer True/False):
    # nothing was spent; nobody else would hear of it (docs/workers.md)
    "authorization_failed",
]

# The reasons :func:`classify` gives: the provider's answer decided them. The execution
# that meets one raises ``ProviderError`` with the attempt's failure.
CLASSIFIED_REASONS: Final[frozenset[FailureReason]] = frozenset({
    "tool_activity", "quota", "response_too_large", "rejected", "provider_failed",
    "incomplete", "invalid_output",
})

# HTTP statuses replaced by default (the seed's failure table: 429 follows the retry
# policy, other statuses only when configured): request timeout, conflict, rate limit and
# the gateway/server errors that say nothing about the request itself (docs/failures.md).
RETRYABLE_STATUSES: Final = frozenset({408, 409, 429, 500, 502, 503, 504})

# Quota, credit and spending-limit exhaustion: permanent until the account changes,
# even when the HTTP status is 429 (which otherwise means a temporary rate limit).
QUOTA_CODES: Final[frozenset[str]] = frozenset(
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

# Error types that mean a rate limit (the same as an HTTP 429) when no status says otherwise.
RATE_LIMIT_NAMES: Final[frozenset[str]] = frozenset({"rate_limit_exceeded", "rate_limit_error"})

# Interruption kinds that are always replacement-eligible: the attempt produced no
# published output and no tool effect, so a tool-free replacement is safe.
TRANSPORT_KINDS: Final = frozenset(
    {"disconnected", "timeout", "premature_eof", "malformed", "interrupted",
     "reattach_unavailable"}  # a saved background response that is gone
)


class RetryPolicy(msgspec.Struct, frozen=True, gc=False, kw_only=True, forbid_unknown_fields=True):
    """Saved with the operation: which failures may be replaced, and the backoff.

    Transport interruptions (disconnect, timeout, premature EOF, malformed
    stream, a process interrupted mid-attempt) are always replacement-eligible;
    a response past a configured size bound never is. ``retryable_provider_codes``
    lists the provider error codes (or, without a code, ``error.type`` values) of a
    ``response.failed`` / status-less error that may be replaced: none by default,
    only what the host allows explicitly. A rate limit is judged like HTTP 429.
    The delay before attempt ``n+1`` is
    ``min(maximum_backoff, initial_backoff * multiplier**(n-1))``, or the
    provider's Retry-After when larger (capped at ``maximum_retry_after``).
    """

    initial_backoff: float = 1.0
    maximum_backoff: float = 60.0
    multiplier: float = 2.0
    maximum_retry_after: float = 24 * 3600.0
    retryable_statuses: frozenset[int] = RETRYABLE_STATUSES
    retryable_provider_codes: frozenset[str] = frozenset()
    replace_invalid_output: bool = False
    replace_incomplete: bool = False


class FailureFacts(Protocol):
    """The facts of a failed attempt this file reads (an ``outcome.Interruption``)."""

    @property
    def kind(self) -> str: ...

    @property
    def http_status(self) -> int | None: ...

    @property
    def provider_type(self) -> str | None: ...

    @property
    def provider_code(self) -> str | None: ...

    @property
    def had_tool_activity(self) -> bool: ...


def is_quota(failure: FailureFacts) -> bool:
    """Recognized quota/credit/spending-limit exhaustion (never a rate limit)."""
    return failure.provider_type in QUOTA_CODES or failure.provider_code in QUOTA_CODES


def provider_key(failure: FailureFacts) -> str | None:
    """The provider's own word on the failure: ``provider_code``, else ``provider_type``."""
    return failure.provider_code if failure.provider_code is not None else failure.provider_type


def is_rate_limit(failure: FailureFacts) -> bool:
    """A temporary rate limit: HTTP 429 when there is a status; without one, a
    rate-limit code, or (no code) a rate-limit ``error.type``. Never quota."""
    if is_quota(failure):
        return False
    if failure.http_status is not None:
        return failure.http_status == 429
    return provider_key(failure) in RATE_LIMIT_NAMES


def classify(failure: FailureFacts, policy: RetryPolicy) -> FailureReason | None:
    """``None`` means replacement-eligible; otherwise the terminal reason.

    This is the failure table of the specification, row by row. A provider error is
    judged by its HTTP status when it has one, else by its code, else by its
    ``error.type`` — the same on both transports, so an error frame without a status is
    judged exactly like the HTTP answer it stands for: a rate limit (code or type) like
    a 429, any other code or type only when it is explicitly allowed in
    ``retryable_provider_codes`` (empty by default).
    """
    kind = failure.kind
    if kind == "tool_activity" or failure.had_tool_activity:
        return "tool_activity"  # never replaced: it could repeat effects
    if is_quota(failure):
        return "quota"  # even for HTTP 429
    match kind:
        case "response_too_large":
            return "response_too_large"  # a replacement would pass the same bound again
        case _ if kind in TRANSPORT_KINDS:
            return None
        case "http_rejected" | "provider_failed":
            return _provider_error(failure, policy)
        case "incomplete":
            return None if policy.replace_incomplete else "incomplete"
        case "invalid_output" | "refusal":
            return None if policy.replace_invalid_output else "invalid_output"
        case _:
            return "provider_failed"


def _provider_error(failure: FailureFacts, policy: RetryPolicy) -> FailureReason | None:
    """An HTTP rejection or a provider error event: by status, else by the provider's word."""
    terminal: FailureReason = "rejected" if failure.kind == "http_rejected" else "provider_failed"
    status = failure.http_status
    if status is not None:
        if status == 401:
            return None  # handled by the machine: same-account renewal + reissue
        # The status decides (a 403 carrying a rate-limit code is a 403), and only
        # the configured statuses are replaced — 429 included (it is by default).
        return None if status in policy.retryable_statuses else terminal
    if is_rate_limit(failure):
        return None if 429 in policy.retryable_statuses else terminal
    key = provider_key(failure)
    if key is not None and key in policy.retryable_provider_codes:
        return None
    return terminal  # 403 and other rejections: no refresh, no downgrade


def backoff_delay(policy: RetryPolicy, attempts_used: int, retry_after: float | None) -> float:
    """Delay before the next attempt: the policy's backoff, or Retry-After when larger."""
    exponent = max(0, attempts_used - 1)
    if policy.initial_backoff == 0:
        backoff = 0.0
    else:
        try:
            backoff = policy.initial_backoff * (policy.multiplier**exponent)
        except OverflowError:
            backoff = policy.maximum_backoff
    delay = min(policy.maximum_backoff, backoff)
    if retry_after is not None and math.isfinite(retry_after) and retry_after > 0:
        delay = max(delay, min(retry_after, policy.maximum_retry_after))
    return delay
