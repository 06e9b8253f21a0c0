"""Opt-in continuation after a terminal stream failure (seed 002): the pure rules.

An operation that ended ``failed`` because its budget was spent on *confirmed stream
failures* may get ONE automatic successor per failed run, through the manual-retry
lineage with ``selection="preserve"`` (the same frozen body, model, account and
endpoint), after a persisted delay, within a small continuation budget counted across
the whole lineage. Everything here decides from typed fields only (interruption kinds,
transport codes, provider codes, failure reasons): never from message text. No I/O, no
clock: callers pass ``now`` and what they read.

- :func:`eligibility` reads a failed record's attempt failure chain (bounded to the last
  :data:`MAX_FAILURE_CHAIN` attempts) and says whether it qualifies, with a stable reason;
- :func:`decide` is what the fenced write that ended the operation records on it
  (``pending`` with a due time, or ``declined`` with the reason) when the store-wide
  preference is on;
- :func:`invalidation` is the check made again, atomically, at dispatch: any newer intent
  or state (stop, preference off, a newer revision or thread turn, a disposal, a manual
  retry, a live lease, a pending command) cancels the pending continuation;
- :func:`cancelled` / :func:`dispatched` are the record edits.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from recoverable.outcome import UNRECOGNIZED_CODE, Interruption
from recoverable.records import ContinuationRecord, OperationRecord
from recoverable.types import SupersededReason

__all__ = [
    "ACTION_ID",
    "DEFAULT_BUDGET",
    "DEFAULT_DELAY",
    "EXCLUDED_CODES",
    "GENERIC_CODES",
    "MAX_BUDGET",
    "MAX_DELAY",
    "MAX_FAILURE_CHAIN",
    "POLICY_WORDS",
    "STREAM_ERROR_CODES",
    "Reason",
    "budget_left",
    "cancelled",
    "decide",
    "dispatched",
    "eligibility",
    "failure_chain",
    "invalidation",
    "is_pending",
    "is_stream_failure",
    "names_policy",
    "unreadable",
]

# The continuation budget: automatic continuations per lineage (documented default 2,
# at most 10); the delay before a pending continuation may be dispatched (seconds).
DEFAULT_BUDGET: Final = 2
MAX_BUDGET: Final = 10
DEFAULT_DELAY: Final = 60.0
MAX_DELAY: Final = 24 * 3600.0
# Only the last attempts count as evidence (a record holds at most 1000 attempts).
MAX_FAILURE_CHAIN: Final = 64
# The retry action id of every continuation: with the source id it derives the one
# deterministic successor id (``actors/retry.plan_retry``), like a manual retry.
ACTION_ID: Final = "recoverable:continuation"

# A stream error event's codes that name the stream itself failing (the ``error`` event
# or ``response.failed`` without an HTTP status).
STREAM_ERROR_CODES: Final = frozenset({
    "stream_error", "stream_disconnected", "response_stream_disconnected",
    "responseStreamDisconnected", "stream_closed", "connection_closed",
})
# Uninformative final codes: they qualify only AFTER confirmed stream failures, never alone.
# ``unrecognized`` (``outcome.UNRECOGNIZED_CODE``: a provider word that was not a short
# token, so nobody can read it) is NOT one: it is no evidence at all (fail closed).
GENERIC_CODES: Final = frozenset({
    "other", "unknown", "unknown_error", "server_error", "internal_error",
})
# An ``error.type`` that says nothing more than "an error" (the flat error event's own
# type, a generic API error): beside a generic code it keeps the failure generic.
_GENERIC_TYPES: Final = GENERIC_CODES | {"error", "api_error"}
# Provider words that are never continued, whatever came before them (criterion 8),
# in the code OR the ``error.type``.
EXCLUDED_CODES: Final = frozenset({
    "server_is_overloaded", "overloaded", "rate_limit_exceeded", "rate_limit_error",
    "insufficient_quota", "context_length_exceeded", "invalid_api_key", "cyber_policy",
    "content_policy_violation", "content_filter", "safety", "misalignment",
})
# Parts of a provider word (code or ``error.type``, lower-cased, ``-.:/`` read as ``_``)
# that name an explicit policy, safety or misalignment decision: it needs review, and is
# never continued (``type=cyber_policy, code=other`` included).
POLICY_WORDS: Final = (
    "policy", "misalign", "safety", "moderation", "content_filter", "contentfilter",
    "cyber", "guardrail",
)
_SEPARATORS: Final = str.maketrans("-.:/", "____")
# Transport codes of a "timeout" that are not a stream going quiet: nothing was read yet
# (connect), or the host's own elapsed-time bound cut it (the attempt's
# hard ``attempt_timeout``: a successor has the same bound, so it is never continued).
_HARD_TIMEOUT: Final = "hard_timeout"
_NOT_STREAM_TIMEOUTS: Final = frozenset({"connect_timeout", _HARD_TIMEOUT})

Reason = Literal[
    # eligible
    "stream_failures_exhausted",  # every attempt a confirmed stream failure, budget spent
    "stream_failures_then_generic",  # stream failures, then a generic final code
    # declined: the failure does not qualify
    "excluded_failure",  # quota, auth, rate limit, context, overload, policy, output, ...
    "changed_failure",  # a failure of another kind in the chain, or after the stream ones
    "no_evidence",  # no typed attempt history (e.g. a version-1 record), a generic alone,
    # or a provider word nobody can read (``unrecognized``)
    "budget_spent",  # the lineage used its continuation budget
    "expired",  # past expires_at: no new attempt may be authorized
    # cancelled before dispatch
    "cancelled", "suspended", "disabled", "newer_revision", "newer_turn", "manual_retry",
    "disposed", "not_failed", "lease_live", "command_pending",
    # a source-bound operation's source changed or was deleted: a successor
    # bound to a digest that is no longer current would be superseded at birth
    "source_changed", "source_deleted",
]

ELIGIBLE: Final[frozenset[Reason]] = frozenset(
    {"stream_failures_exhausted", "stream_failures_then_generic"}
)


def _words(failure: Interruption) -> tuple[str, ...]:
    """The provider's own words on a failure: its code and its ``error.type`` (both are
    bounded codes, ``outcome.bounded_code``)."""
    return tuple(word for word in (failure.provider_code, failure.provider_type)
                 if word is not None)


def unreadable(failure: Interruption) -> bool:
    """The provider sent a code or ``error.type`` nobody can read (too long, spaces, ...:
    kept as ``unrecognized``): it could name anything, a policy included, so it is never
    evidence for a continuation."""
    return UNRECOGNIZED_CODE in _words(failure)


def names_policy(word: str) -> bool:
    """A provider word naming an explicit policy, safety or misalignment decision."""
    normalized = word.lower().translate(_SEPARATORS)
    return any(part in normalized for part in POLICY_WORDS)


def is_stream_failure(failure: Interruption) -> bool:
    """A confirmed stream failure: a dropped stream, a premature EOF, an idle timeout,
    or a stream error event naming the stream (typed fields only)."""
    match failure.kind:
        case "disconnected" | "premature_eof":
            return not failure.had_tool_activity
        case "timeout":
            return failure.transport_code not in _NOT_STREAM_TIMEOUTS
        case "provider_failed":
            return (failure.http_status is None and failure.provider_key in STREAM_ERROR_CODES
                    and not unreadable(failure))
    return False


def _is_generic(failure: Interruption) -> bool:
    """A provider failure without an HTTP status whose code says nothing (or is absent)
    and whose ``error.type`` says nothing more (absent, generic, or a stream word)."""
    if failure.kind != "provider_failed" or failure.http_status is not None:
        return False
    code, kind = failure.provider_code, failure.provider_type
    return (code is None or code in GENERIC_CODES) and (
        kind is None or kind in _GENERIC_TYPES or kind in STREAM_ERROR_CODES
    )


def _is_excluded(failure: Interruption) -> bool:
    """Never continued: overload, limits, quota, auth, context, an explicit policy or
    safety word — in the code or in the ``error.type`` — or the host's hard timeout."""
    words = _words(failure)
    return (any(word in EXCLUDED_CODES or names_policy(word) for word in words)
            or failure.http_status in (401, 403, 429)
            or failure.is_quota or failure.is_rate_limit
            or (failure.kind == "timeout" and failure.transport_code == _HARD_TIMEOUT))


def failure_chain(rec: OperationRecord) -> tuple[Interruption | None, ...]:
    """The typed failure of each of the last :data:`MAX_FAILURE_CHAIN` attempts (``None``:
    the attempt has no recorded failure — completed, or no evidence)."""
    return tuple(attempt.failure for attempt in rec.attempts[-MAX_FAILURE_CHAIN:])


def eligibility(rec: OperationRecord) -> Reason:
    """Whether a failed record's run qualifies for a continuation, and why (or why not)."""
    if rec.phase != "failed" or rec.has_completion:
        return "not_failed"
    if rec.failure_reason not in ("exhausted", "provider_failed"):
        return "excluded_failure"  # quota, rejected, auth, token budget, output, tools, ...
    if rec.upgraded_from is not None and rec.upgraded_from < 2:
        return "no_evidence"  # a version-1 record never kept its attempts' failures
    chain = failure_chain(rec)
    if not chain or any(failure is None for failure in chain):
        return "no_evidence"
    failures = [failure for failure in chain if failure is not None]
    if any(_is_excluded(failure) for failure in failures):
        return "excluded_failure"  # overload, limits, auth, policy: never continued
    if any(unreadable(failure) for failure in failures):
        return "no_evidence"  # a word nobody can read proves nothing (it may be a policy)
    *earlier, final = failures
    if any(not is_stream_failure(failure) for failure in earlier):
        return "changed_failure"
    if is_stream_failure(final) and rec.failure_reason == "exhausted":
        return "stream_failures_exhausted"
    if is_stream_failure(final) or _is_generic(final):
        # A stream error event that ended the run before its budget was spent, or a
        # generic final code: each qualifies only AFTER confirmed stream evidence.
        return "stream_failures_then_generic" if earlier else "no_evidence"
    if final.kind in ("disconnected", "premature_eof", "timeout", "malformed", "interrupted"):
        return "changed_failure"
    if final.kind == "http_rejected" and (final.http_status or 0) >= 500:
        return "changed_failure"  # a server error answer: not the stream failing
    return "excluded_failure"


def budget_left(rec: OperationRecord, budget: int) -> int:
    return max(0, budget - rec.continuations_used)


def decide(rec: OperationRecord, *, now: float, delay: float, budget: int) -> OperationRecord:
    """The record that ended failed, with its continuation decided (preference on)."""
    if rec.continuation is not None:
        return rec  # one decision per failed run: a duplicate terminal write changes nothing
    reason = eligibility(rec)
    if reason == "not_failed":
        return rec
    if reason in ELIGIBLE and budget_left(rec, budget) == 0:
        reason = "budget_spent"
    if reason in ELIGIBLE and rec.expires_at is not None and rec.expires_at <= now + delay:
        reason = "expired"
    if reason not in ELIGIBLE:
        decision = ContinuationRecord(state="declined", reason=reason, decided_at=now,
                                      budget=budget)
    else:
        decision = ContinuationRecord(state="pending", reason=reason, decided_at=now,
                                      due_at=now + delay, budget=budget)
    return msgspec.structs.replace(rec, continuation=decision)


def is_pending(rec: OperationRecord) -> bool:
    return rec.continuation is not None and rec.continuation.state == "pending"


def invalidation(
    rec: OperationRecord,
    *,
    enabled: bool,
    budget: int,
    now: float,
    command: str | None,
    lease_live: bool,
    newer_revision: bool,
    newer_turn: bool,
    source_refusal: SupersededReason | None = None,
) -> Reason | None:
    """Why a pending continuation may not be dispatched now (None: it may, if due).
    ``source_refusal``: the manifest no longer holds a source-bound operation's digest
    (``sources_rules.receipt_refusal``)."""
    if rec.phase == "cancelled":
        return "cancelled"
    if rec.phase == "suspended":
        return "suspended"
    if rec.phase != "failed" or rec.has_completion:
        return "not_failed"
    if command == "cancel":
        return "cancelled"
    if command == "suspend":
        return "suspended"
    if not enabled:
        return "disabled"
    if rec.retry_reservation is not None and rec.retry_reservation.retry_action_id != ACTION_ID:
        return "manual_retry"
    if newer_revision:
        return "newer_revision"
    if newer_turn:
        return "newer_turn"
    if source_refusal is not None:
        return source_refusal
    if lease_live:
        return "lease_live"
    if budget_left(rec, budget) == 0:
        return "budget_spent"
    if rec.expires_at is not None and rec.expires_at <= now:
        return "expired"
    return None


def cancelled(rec: OperationRecord, reason: Reason, now: float) -> OperationRecord:
    """A pending continuation cancelled before dispatch (unchanged if none is pending)."""
    if not is_pending(rec):
        return rec
    assert rec.continuation is not None
    return msgspec.structs.replace(rec, continuation=msgspec.structs.replace(
        rec.continuation, state="cancelled", reason=reason, decided_at=now
    ))


def dispatched(rec: OperationRecord, successor_id: str, now: float) -> OperationRecord:
    assert rec.continuation is not None
    return msgspec.structs.replace(rec, continuation=msgspec.structs.replace(
        rec.continuation, state="dispatched", successor_id=successor_id, decided_at=now
    ))
