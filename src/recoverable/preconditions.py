"""What an operation must satisfy before the machine lets it run, be retried or be
acknowledged: the bounds of a preparation, the endpoint and expiry checks, and the
source-condition table of manual retry. Pure functions over records; no I/O.
"""

from __future__ import annotations

import math
from typing import Final, get_args

from recoverable import errors
from recoverable.failure_policy import RetryPolicy
from recoverable.outcome import MAX_USAGE_TOKENS
from recoverable.records import OnInterruption, OperationRecord

__all__ = [
    "DEFAULT_UNCLAIMED_AFTER",
    "MAX_ATTEMPTS",
    "MAX_COST_TOTAL",
    "MAX_METADATA_CHARS",
    "MAX_OUTPUT_TOKENS_TOTAL",
    "ON_INTERRUPTION",
    "check_acknowledge",
    "check_retry_source",
    "check_unclaimed_after",
    "endpoint_blocked",
    "endpoint_matches",
    "is_expired",
    "validate_metadata",
    "validate_preparation",
]

MAX_ATTEMPTS: Final = 1000
# The largest accepted ``maximum_output_tokens_total`` (every attempt may report up to
# MAX_USAGE_TOKENS, so a larger budget could never be reached).
MAX_OUTPUT_TOKENS_TOTAL: Final = MAX_ATTEMPTS * MAX_USAGE_TOKENS
# The largest accepted ``maximum_cost_total``, USD: a bound on a typo, not a spending advice.
MAX_COST_TOTAL: Final = 1_000_000.0
MAX_METADATA_CHARS: Final = 1024
# The interruption policies a preparation may save (records.OnInterruption).
ON_INTERRUPTION: Final[frozenset[str]] = frozenset(get_args(OnInterruption))
# The unclaimed bound ``submit`` saves when the host names none (seconds;
# docs/workers.md): once no live worker of its account and endpoint has served it for this
# long, any sweep ends a submitted operation ``no_worker``. An hour is 120 leases of 30 s
# and far longer than a worker restart or a deploy, so a served queue never meets it; yet
# a host whose workers serve another account or endpoint learns it within the hour
# (``status`` says why at once), not never.
DEFAULT_UNCLAIMED_AFTER: Final = 3600.0


def check_unclaimed_after(value: object) -> float:
    """The unclaimed bound as seconds: a finite number >= 0 (``InvalidRequest``)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise errors.InvalidRequest("unclaimed_after must be a finite number of seconds >= 0")
    return float(value)


def _is_integer_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def validate_preparation(
    *,
    maximum_attempts: int,
    retry_policy: RetryPolicy,
    scope: str | None,
    job_id: str | None,
    input_revision: str | None,
    contract_version: str | None,
    maximum_output_tokens_total: int | None = None,
    on_interruption: object = "replace",
    maximum_cost_total: float | None = None,
) -> None:
    """The values a host saves with a new operation, each bounded (``InvalidRequest``)."""
    if not isinstance(on_interruption, str) or on_interruption not in ON_INTERRUPTION:
        raise errors.InvalidRequest('on_interruption must be "replace" or "fail"')
    token_budget = maximum_output_tokens_total
    if token_budget is not None and not _is_integer_in(token_budget, 1, MAX_OUTPUT_TOKENS_TOTAL):
        raise errors.InvalidRequest(
            f"maximum_output_tokens_total must be None or an integer in "
            f"1..{MAX_OUTPUT_TOKENS_TOTAL}"
        )
    cost_budget = maximum_cost_total
    if cost_budget is not None and (
        isinstance(cost_budget, bool) or not isinstance(cost_budget, int | float)
        or not math.isfinite(cost_budget) or not 0 < cost_budget <= MAX_COST_TOTAL
    ):
        raise errors.InvalidRequest(
            f"maximum_cost_total must be None or a number of USD above 0 and at most "
            f"{MAX_COST_TOTAL:,.0f}"
        )
    if not _is_integer_in(maximum_attempts, 1, MAX_ATTEMPTS):
        raise errors.InvalidRequest(f"maximum_attempts must be an integer in 1..{MAX_ATTEMPTS}")
    for name, value in (
        ("scope", scope),
        ("job_id", job_id),
        ("input_revision", input_revision),
        ("contract_version", contract_version),
    ):
        validate_metadata(name, value)
    for name, number in (
        ("initial_backoff", retry_policy.initial_backoff),
        ("maximum_backoff", retry_policy.maximum_backoff),
        ("maximum_retry_after", retry_policy.maximum_retry_after),
    ):
        if not math.isfinite(number) or number < 0:
            raise errors.InvalidRequest(f"retry_policy.{name} must be finite and >= 0")
    if not math.isfinite(retry_policy.multiplier) or retry_policy.multiplier < 1:
        raise errors.InvalidRequest("retry_policy.multiplier must be finite and >= 1")


def validate_metadata(name: str, value: object) -> None:
    """A host metadata string: ``None`` or at most ``MAX_METADATA_CHARS``, no NUL."""
    if value is not None and (not isinstance(value, str) or len(value) > MAX_METADATA_CHARS):
        raise errors.InvalidRequest(f"{name} must be a string of at most {MAX_METADATA_CHARS}")
    if value is not None and "\0" in value:
        raise errors.InvalidRequest(f"{name} must not contain NUL")


def endpoint_matches(stored: str, current: str) -> bool:
    """May an operation saved for endpoint ``stored`` run against endpoint ``current``?

    An endpoint identity is the normalized base URL, or ``label@host`` for a custom
    label (``ResponsesBackend``). A bare label saved before labels were bound to the
    host (no ``@``, no ``://``) still matches that same label on any host.
    """
    if stored == current:
        return True
    legacy = "@" not in stored and "://" not in stored
    return legacy and current.rpartition("@")[0] == stored


def endpoint_blocked(rec: OperationRecord, endpoint_id: str | None) -> bool:
    """The runtime's endpoint is not the operation's (``None``: no backend, not judged).

    A version-1 record awaiting its upgrade recorded no endpoint: it adopts the
    endpoint of the runtime that upgrades it, so it is never blocked by one."""
    return (
        endpoint_id is not None
        and not rec.awaiting_upgrade
        and not endpoint_matches(rec.endpoint_id, endpoint_id)
    )


def is_expired(rec: OperationRecord, now: float) -> bool:
    """The host's attempt permission (``expires_at``) has run out."""
    return rec.expires_at is not None and now >= rec.expires_at


def check_retry_source(rec: OperationRecord, *, now: float, endpoint_id: str | None) -> None:
    """The source-condition table of manual retry, row by row."""
    operation_id = rec.operation_id
    if rec.phase == "cancelled":
        raise errors.RetryNotAllowed("permanently cancelled: terminal", operation_id=operation_id)
    if rec.phase == "superseded":
        raise errors.RetryNotAllowed(
            "superseded: its source changed; prepare a new operation with the current digest",
            operation_id=operation_id,
        )
    if rec.has_completion:
        raise errors.RetryNotAllowed(
            "a completion is saved: read and commit the receipt", operation_id=operation_id
        )
    if rec.phase == "failed":
        match rec.failure_reason:
            case "tool_activity":
                raise errors.RetryNotAllowed(
                    "tool activity: correct the request instead of retrying it",
                    operation_id=operation_id,
                )
            case "authentication_required":
                raise errors.RetryNotAllowed(
                    "sign in to the same account and resume instead", operation_id=operation_id
                )
            case _:
                return  # exhausted (attempts, tokens or cost), quota, rejected, provider failure
    if rec.attempts_remaining == 0 or rec.token_budget_spent or rec.cost_budget_spent:
        return  # exhausted (also: suspended and exhausted)
    if is_expired(rec, now):
        return  # expired attempt permission
    if endpoint_blocked(rec, endpoint_id):
        return  # configuration-blocked
    raise errors.RetryNotAllowed(
        "the operation can still run: resume it instead", operation_id=operation_id
    )


def check_acknowledge(rec: OperationRecord) -> None:
    """Acknowledge only a saved completion (after the host's own commit)."""
    if rec.phase == "cancelled":
        raise errors.OperationCancelled(operation_id=rec.operation_id)
    if rec.phase == "superseded":
        raise errors.OperationSuperseded(
            operation_id=rec.operation_id, reason=rec.superseded_reason
        )
    if not rec.has_completion:
        raise errors.CompletionUnavailable(
            "nothing to acknowledge: no saved completion", operation_id=rec.operation_id
        )
