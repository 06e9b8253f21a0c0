"""The operation state machine: every rule of an operation's life, in one pure module.

Rule 1: everything that decides what an operation may do next lives here. No
I/O, no clock, no Trio: callers pass ``now`` and the facts they observed, and
get back a :class:`Transition` — the next record and ONE action.

Theory of operation
-------------------
The driver (``actors/operation.py``) always **persists the returned record
first** (a conditional write fenced by the lease's generation) and only then
performs the action. That single ordering rule is what makes every row of the
crash table hold:

=============================  ====================================================
action                         what was made durable before it
=============================  ====================================================
``AskHost(attempt)``           the pending attempt id (replays reuse it)
``Transmit(attempt_id)``       the consumed attempt (never refunded)
``WaitUntil(at)``              ``next_attempt_at`` (reopening waits the same time)
``Deliver()``                  the validated completion (the receipt)
``Stop(error)``                the terminal/blocked/suspended state, if it changed
=============================  ====================================================

The phases (``storage.records.Phase``) and the transitions allowed out of them::

    prepared ──open/wake──▶ authorizing ──approved──▶ transmitting ──completed──▶ completed
        ▲                      │  denied: back to idle,      │  failed (eligible, budget)
        │                      ▼  pending id kept            ▼
        └──────────────── waiting ◀──────────────────────────┘
    any non-terminal ──suspend──▶ suspended ──open──▶ (as above; budget never reset)
    any ──cancel──▶ cancelled (terminal: no generation, no delivery)
    transmitting ──terminal failure / budget spent──▶ failed

An event that does not apply to the record's phase raises
:class:`InvalidTransition`; it is never a silent no-op.
"""

from __future__ import annotations

import math
from typing import Final

import attrs
import msgspec

from recoverable import errors
from recoverable.outcome import MAX_USAGE_TOKENS, Interruption, Usage
from recoverable.records import (
    AttemptRecord,
    CommandKind,
    FailureReason,
    OperationRecord,
    PendingAttempt,
)
from recoverable.types import (
    AccountBinding,
    Attempt,
    AttemptReason,
    AttemptSummary,
    Availability,
    Blocker,
    RetryPolicy,
    State,
    Status,
    SuggestedAction,
    to_datetime,
)

MAX_ATTEMPTS: Final = 1000
# The largest accepted ``maximum_output_tokens_total`` (every attempt may report up to
# MAX_USAGE_TOKENS, so a larger budget could never be reached).
MAX_OUTPUT_TOKENS_TOTAL: Final = MAX_ATTEMPTS * MAX_USAGE_TOKENS
MAX_METADATA_CHARS: Final = 1024

# Interruption kinds that are always replacement-eligible: the attempt produced no
# published output and no tool effect, so a tool-free replacement is safe.
TRANSPORT_KINDS: Final = frozenset(
    {"disconnected", "timeout", "premature_eof", "malformed", "interrupted"}
)


class InvalidTransition(RuntimeError):
    """An event was fed to the machine in a phase where it has no meaning (a bug)."""


# --- actions -----------------------------------------------------------------------


@attrs.frozen
class AskHost:
    """Ask the host's ``authorize`` callback about this attempt."""

    attempt: Attempt


@attrs.frozen
class Transmit:
    """Send the frozen body; the attempt is consumed. ``renew`` asks for fresh credentials."""

    attempt_id: str
    renew: bool


@attrs.frozen
class WaitUntil:
    """Sleep until the persisted ``next_attempt_at`` (then feed :func:`wake`)."""

    at: float


@attrs.frozen
class Deliver:
    """Return the saved completion to the caller."""


@attrs.frozen
class Stop:
    """End this execution by raising ``error`` (state already persisted)."""

    error: errors.RecoveryError


Action = AskHost | Transmit | WaitUntil | Deliver | Stop


@attrs.frozen
class Transition:
    record: OperationRecord
    action: Action | None
    changed: bool


@attrs.frozen
class Context:
    """What the driver observed right now (everything the machine may not look up itself)."""

    now: float
    account: AccountBinding | None  # the runtime's current account (None: signed out)
    credentials_account: AccountBinding | None = None  # the backend's credentials' account
    endpoint_id: str | None = None
    command: CommandKind | None = None  # a pending lifecycle command for this operation
    body_available: bool = True  # the frozen request body is present in the store


def _t(old: OperationRecord, new: OperationRecord, action: Action | None) -> Transition:
    return Transition(new, action, new != old)


def attempt_id_for(operation_id: str, number: int) -> str:
    """Attempt ids are derived, so they are stable across callback replays and crashes."""
    return f"{operation_id}.{number}"


# --- preparation -------------------------------------------------------------------


def validate_preparation(
    *,
    maximum_attempts: int,
    retry_policy: RetryPolicy,
    scope: str | None,
    job_id: str | None,
    input_revision: str | None,
    contract_version: str | None,
    maximum_output_tokens_total: int | None = None,
) -> None:
    m = maximum_output_tokens_total
    if m is not None and (
        not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= MAX_OUTPUT_TOKENS_TOTAL
    ):
        raise errors.InvalidRequest(
            f"maximum_output_tokens_total must be None or an integer in "
            f"1..{MAX_OUTPUT_TOKENS_TOTAL}"
        )
    if (
        not isinstance(maximum_attempts, int)
        or isinstance(maximum_attempts, bool)
        or not 1 <= maximum_attempts <= MAX_ATTEMPTS
    ):
        raise errors.InvalidRequest(f"maximum_attempts must be an integer in 1..{MAX_ATTEMPTS}")
    for name, value in (
        ("scope", scope),
        ("job_id", job_id),
        ("input_revision", input_revision),
        ("contract_version", contract_version),
    ):
        validate_metadata(name, value)
    p = retry_policy
    for name, number in (
        ("initial_backoff", p.initial_backoff),
        ("maximum_backoff", p.maximum_backoff),
        ("maximum_retry_after", p.maximum_retry_after),
    ):
        if not math.isfinite(number) or number < 0:
            raise errors.InvalidRequest(f"retry_policy.{name} must be finite and >= 0")
    if not math.isfinite(p.multiplier) or p.multiplier < 1:
        raise errors.InvalidRequest("retry_policy.multiplier must be finite and >= 1")


def validate_metadata(name: str, value: object) -> None:
    """A host metadata string: ``None`` or at most ``MAX_METADATA_CHARS``, no NUL."""
    if value is not None and (not isinstance(value, str) or len(value) > MAX_METADATA_CHARS):
        raise errors.InvalidRequest(f"{name} must be a string of at most {MAX_METADATA_CHARS}")
    if value is not None and "\0" in value:
        raise errors.InvalidRequest(f"{name} must not contain NUL")


# --- the checks shared by every step -----------------------------------------------


def _account_error(rec: OperationRecord, ctx: Context) -> errors.AccountChanged | None:
    if ctx.account is None:
        return errors.AccountChanged("signed out", operation_id=rec.operation_id)
    if ctx.account != rec.account:
        return errors.AccountChanged("account changed", operation_id=rec.operation_id)
    if ctx.credentials_account is not None and ctx.credentials_account != rec.account:
        return errors.AccountChanged(
            "credentials belong to another account", operation_id=rec.operation_id
        )
    return None


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


def _body_error(rec: OperationRecord, ctx: Context) -> errors.RecoveryError:
    op = rec.operation_id
    if rec.awaiting_upgrade and ctx.endpoint_id is None:
        return errors.ConfigurationUnavailable(
            "no backend: a version-1 request is frozen (upgraded) only by a runtime "
            "with a backend", operation_id=op,
        )
    if rec.awaiting_upgrade:
        return errors.RequestUnavailable(
            "the version-1 request could not be frozen: nothing was sent or spent",
            operation_id=op,
        )
    return errors.RequestUnavailable(
        "the frozen request body is missing from the store: nothing was sent or spent",
        operation_id=op,
    )


def _expired(rec: OperationRecord, now: float) -> bool:
    return rec.expires_at is not None and now >= rec.expires_at


def merge_command(existing: CommandKind | None, new: CommandKind) -> CommandKind:
    """The lifecycle command that stands after ``new`` arrives where ``existing`` stood.

    The one statement of the rule: a cancel is permanent and never downgraded by a later
    suspend; any other command replaces what stood before.
    """
    if existing == "cancel":
        return "cancel"
    return new


def _apply_command(rec: OperationRecord, kind: CommandKind) -> Transition:
    """A lifecycle command observed at a checkpoint: suspend keeps everything, cancel fences."""
    if kind == "cancel":
        new = evolve(_close_in_flight(rec, "cancelled"), phase="cancelled", next_attempt_at=None)
        return _t(rec, new, Stop(errors.OperationCancelled(operation_id=rec.operation_id)))
    new = rec if rec.phase in ("completed", "failed", "cancelled") else _suspended(rec)
    return _t(rec, new, Stop(errors.OperationSuspended(operation_id=rec.operation_id)))


def _close_in_flight(rec: OperationRecord, code: str) -> OperationRecord:
    """An attempt still marked in flight stays spent and becomes an interruption."""
    attempts = rec.attempts
    if not attempts or attempts[-1].outcome != "in_flight":
        return rec
    last = attempts[-1]
    failure = Interruption(
        kind="interrupted",
        response_id=last.response_id,
        sequence_number=last.sequence_number,
        transport_code=code,
    )
    return evolve(
        rec, attempts=(*attempts[:-1], _ended(last, "interrupted", failure)), last_failure=failure
    )


def _suspended(rec: OperationRecord) -> OperationRecord:
    return evolve(_close_in_flight(rec, "suspended"), phase="suspended")


def _stored_failure(failure: Interruption) -> Interruption:
    """The failure as the record keeps it: its usage lives on the attempt, not here."""
    if failure.usage is None and not failure.usage_malformed and failure.rate_limits is None:
        return failure
    return msgspec.structs.replace(failure, usage=None, usage_malformed=False, rate_limits=None)


def _ended(
    a: AttemptRecord, outcome: str, failure: Interruption | None, usage: Usage | None = None
) -> AttemptRecord:
    return AttemptRecord(
        attempt_id=a.attempt_id,
        number=a.number,
        reason=a.reason,
        consumed_at=a.consumed_at,
        outcome=outcome,  # type: ignore[arg-type]
        response_id=a.response_id if failure is None else (failure.response_id or a.response_id),
        sequence_number=(
            a.sequence_number
            if failure is None or failure.sequence_number is None
            else failure.sequence_number
        ),
        failure=failure,
        usage=usage if usage is not None else a.usage,
    )


def evolve(rec: OperationRecord, **changes: object) -> OperationRecord:
    return msgspec.structs.replace(rec, **changes)


def _terminal_error(rec: OperationRecord) -> errors.RecoveryError:
    reason = rec.failure_reason
    if reason == "exhausted":
        return errors.AttemptsExhausted(
            operation_id=rec.operation_id, last_failure=rec.last_failure
        )
    if reason == "authentication_required":
        return errors.AuthenticationRequired(operation_id=rec.operation_id)
    if reason == "token_budget_exhausted":
        return errors.TokenBudgetExhausted(
            f"{rec.usage.output_tokens} output tokens reported, "
            f"maximum_output_tokens_total {rec.maximum_output_tokens_total}",
            operation_id=rec.operation_id,
            last_failure=rec.last_failure,
        )
    return errors.PermanentlyFailed(
        str(reason), operation_id=rec.operation_id, last_failure=rec.last_failure
    )


def _budget_spent(rec: OperationRecord) -> FailureReason | None:
    """Which saved budget forbids another attempt: the attempts, then the output tokens."""
    if rec.attempts_remaining == 0:
        return "exhausted"
    if rec.token_budget_spent:
        return "token_budget_exhausted"
    return None


def _next_step(rec: OperationRecord, ctx: Context) -> Transition:
    """From an idle, generation-capable record: wait, or ask the host for the next attempt."""
    spent = _budget_spent(rec)
    if spent is not None:
        new = evolve(rec, phase="failed", failure_reason=spent, pending=None)
        return _t(rec, new, Stop(_terminal_error(new)))
    if _expired(rec, ctx.now):
        return _t(rec, rec, Stop(errors.StateExpired(operation_id=rec.operation_id)))
    if rec.next_attempt_at is not None and rec.next_attempt_at > ctx.now:
        new = evolve(rec, phase="waiting")
        return _t(rec, new, WaitUntil(rec.next_attempt_at))
    pending = rec.pending
    if pending is None or pending.number != rec.attempts_used + 1:
        number = rec.attempts_used + 1
        reason: AttemptReason = (
            "initial"
            if rec.attempts_used == 0
            else ("authentication_reissue" if rec.renew_next else "replacement")
        )
        pending = PendingAttempt(attempt_id_for(rec.operation_id, number), number, reason)
    new = evolve(rec, phase="authorizing", pending=pending, next_attempt_at=None)
    last = rec.attempts[-1] if rec.attempts else None
    attempt = Attempt(
        operation_id=rec.operation_id,
        attempt_id=pending.attempt_id,
        number=pending.number,
        maximum_attempts=rec.maximum_attempts,
        reason=pending.reason,
        previous_failure=last.failure if last else None,
        previous_response_id=last.response_id if last else None,
        previous_sequence_number=last.sequence_number if last else None,
    )
    return _t(rec, new, AskHost(attempt))


# --- events ------------------------------------------------------------------------


def open_operation(
    rec: OperationRecord,
    ctx: Context,
    *,
    format_hash: str,
    expected_contract_version: str | None,
    check_contract_version: bool,
) -> Transition:
    """``send_recovering`` took the lease. A pending *suspend* command was cleared by the
    acquisition (reopening is resuming); a pending *cancel* is passed in ``ctx.command``."""
    account_error = _account_error(rec, ctx)
    if account_error is not None:
        return _t(rec, rec, Stop(account_error))  # nothing about it, not even a cancel
    if rec.phase == "cancelled" or ctx.command == "cancel":
        return _apply_command(rec, "cancel")
    if format_hash != rec.format_hash:
        return _t(rec, rec, Stop(errors.FormatMismatch(
            "the requested response format differs from the saved one",
            operation_id=rec.operation_id,
        )))
    if check_contract_version and expected_contract_version != rec.contract_version:
        return _t(rec, rec, Stop(errors.FormatMismatch(
            "the expected contract version differs from the saved one",
            operation_id=rec.operation_id,
        )))
    if rec.has_completion:
        new = evolve(rec, phase="completed") if rec.phase != "completed" else rec
        return _t(rec, new, Deliver())
    if rec.phase == "failed" and rec.failure_reason != "authentication_required":
        return _t(rec, rec, Stop(_terminal_error(rec)))
    if endpoint_blocked(rec, ctx.endpoint_id):
        return _t(rec, rec, Stop(errors.ConfigurationUnavailable(
            "the operation was prepared for another endpoint", operation_id=rec.operation_id
        )))
    if not ctx.body_available:
        # Found before the host is asked and before an attempt is spent (fail closed).
        return _t(rec, rec, Stop(_body_error(rec, ctx)))
    work = rec
    if work.phase == "failed":  # authentication_required: a blocker, reopened after sign-in
        work = evolve(work, phase="waiting", failure_reason=None, renew_next=True)
    if work.attempts and work.attempts[-1].outcome == "in_flight":
        # The previous execution died (or was cancelled) while this attempt was in flight.
        # It stays spent; its outcome is unknown, so it reads as an interruption.
        last = work.attempts[-1]
        failure = Interruption(
            kind="interrupted",
            response_id=last.response_id,
            sequence_number=last.sequence_number,
            transport_code="owner_lost",
        )
        work = evolve(
            work,
            attempts=(*work.attempts[:-1], _ended(last, "interrupted", failure)),
            last_failure=failure,
        )
    if work.phase in ("authorizing", "transmitting", "suspended"):
        work = evolve(work, phase="waiting" if work.attempts_used else "prepared")
    step = _next_step(work, ctx)
    return Transition(step.record, step.action, step.record != rec)


def wake(rec: OperationRecord, ctx: Context) -> Transition:
    """The persisted ``next_attempt_at`` was reached while waiting under the lease."""
    if rec.phase != "waiting":
        raise InvalidTransition(f"wake in phase {rec.phase}")
    if ctx.command is not None:
        return _apply_command(rec, ctx.command)
    account_error = _account_error(rec, ctx)
    if account_error is not None:
        return _t(rec, rec, Stop(account_error))
    return _next_step(rec, ctx)


def authorization_answered(
    rec: OperationRecord, attempt_id: str, approved: bool, ctx: Context
) -> Transition:
    """The host answered. Approval is rechecked against lifecycle, account, expiry, budget."""
    if rec.phase != "authorizing" or rec.pending is None or rec.pending.attempt_id != attempt_id:
        raise InvalidTransition(f"authorization answer for {attempt_id} in phase {rec.phase}")
    idle_phase = "waiting" if rec.attempts_used else "prepared"
    if not approved:
        # A denial is not a cancellation: nothing is spent and the pending id stays.
        new = evolve(rec, phase=idle_phase)
        return _t(rec, new, Stop(errors.AttemptNotAuthorized(
            operation_id=rec.operation_id, attempt_id=attempt_id
        )))
    if ctx.command is not None:
        return _apply_command(evolve(rec, phase=idle_phase), ctx.command)
    account_error = _account_error(rec, ctx)
    if account_error is not None:
        return _t(rec, evolve(rec, phase=idle_phase), Stop(account_error))
    if _expired(rec, ctx.now):
        return _t(rec, evolve(rec, phase=idle_phase), Stop(
            errors.StateExpired(operation_id=rec.operation_id)
        ))
    spent = _budget_spent(rec)
    if spent is not None:
        new = evolve(rec, phase="failed", failure_reason=spent, pending=None)
        return _t(rec, new, Stop(_terminal_error(new)))
    pending = rec.pending
    consumed = AttemptRecord(
        attempt_id=pending.attempt_id,
        number=pending.number,
        reason=pending.reason,
        consumed_at=ctx.now,
    )
    new = evolve(
        rec,
        phase="transmitting",
        pending=None,
        attempts=(*rec.attempts, consumed),
        attempts_used=rec.attempts_used + 1,
        next_attempt_at=None,
        renew_next=False,
        endpoint_failure=None,
    )
    return _t(rec, new, Transmit(pending.attempt_id, pending.reason == "authentication_reissue"))


def endpoint_unreachable(rec: OperationRecord, attempt_id: str, kind: str) -> Transition:
    """Connecting for the approved pending attempt failed before anything was sent.

    Nothing is spent: the phase stays ``authorizing`` with the same pending attempt id
    (the driver waits in the runtime's shared connect backoff and tries again); the
    typed kind is recorded so that status reads ``endpoint_unavailable``, also from
    another process and after this execution ends.
    """
    if rec.phase != "authorizing" or rec.pending is None or rec.pending.attempt_id != attempt_id:
        raise InvalidTransition(f"endpoint_unreachable in phase {rec.phase}")
    return _t(rec, evolve(rec, endpoint_failure=kind), None)


def credentials_unavailable(rec: OperationRecord, attempt_id: str) -> Transition:
    """Renewal for a 401 reissue failed before anything was spent: a sign-in blocker."""
    if rec.phase != "authorizing" or rec.pending is None or rec.pending.attempt_id != attempt_id:
        raise InvalidTransition(f"credentials_unavailable in phase {rec.phase}")
    new = evolve(rec, phase="failed", failure_reason="authentication_required")
    return _t(rec, new, Stop(errors.AuthenticationRequired(operation_id=rec.operation_id)))


def _in_flight(rec: OperationRecord, attempt_id: str) -> AttemptRecord:
    if rec.phase != "transmitting" or not rec.attempts:
        raise InvalidTransition(f"attempt event in phase {rec.phase}")
    last = rec.attempts[-1]
    if last.attempt_id != attempt_id or last.outcome != "in_flight":
        raise InvalidTransition(f"attempt event for {attempt_id}, in flight: {last.attempt_id}")
    return last


def progress(
    rec: OperationRecord, attempt_id: str, response_id: str | None, sequence_number: int | None
) -> Transition:
    """Response id and cursor arrived (diagnostics only; never a promise of retrieval)."""
    last = _in_flight(rec, attempt_id)
    updated = AttemptRecord(
        attempt_id=last.attempt_id,
        number=last.number,
        reason=last.reason,
        consumed_at=last.consumed_at,
        outcome=last.outcome,
        response_id=response_id if response_id is not None else last.response_id,
        sequence_number=sequence_number if sequence_number is not None else last.sequence_number,
        usage=last.usage,
    )
    new = evolve(rec, attempts=(*rec.attempts[:-1], updated))
    return _t(rec, new, None)


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


def classify(failure: Interruption, policy: RetryPolicy) -> FailureReason | None:
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
    if failure.is_quota:
        return "quota"  # even for HTTP 429
    if kind == "response_too_large":
        return "response_too_large"  # a replacement would pass the same bound again
    if kind in TRANSPORT_KINDS:
        return None
    if kind in ("http_rejected", "provider_failed"):
        terminal: FailureReason = "rejected" if kind == "http_rejected" else "provider_failed"
        status = failure.http_status
        if status is not None:
            if status == 401:
                return None  # handled by the caller: same-account renewal + reissue
            # The status decides (a 403 carrying a rate-limit code is a 403), and only
            # the configured statuses are replaced — 429 included (it is by default).
            return None if status in policy.retryable_statuses else terminal
        if failure.is_rate_limit:
            return None if 429 in policy.retryable_statuses else terminal
        key = failure.provider_key
        if key is not None and key in policy.retryable_provider_codes:
            return None
        return terminal  # 403 and other rejections: no refresh, no downgrade
    if kind == "incomplete":
        return None if policy.replace_incomplete else "incomplete"
    if kind in ("invalid_output", "refusal"):
        return None if policy.replace_invalid_output else "invalid_output"
    return "provider_failed"


def attempt_failed(
    rec: OperationRecord, attempt_id: str, failure: Interruption, ctx: Context
) -> Transition:
    """The in-flight attempt ended without a usable completion. Partial output is discarded.

    The failure is classified first (terminal, or replacement-eligible with its
    cooldown); a lifecycle command observed at the same time is applied on top,
    so a suspend never turns a terminal failure into a replaceable one and never
    drops a persisted cooldown or a pending 401 reissue.
    """
    last = _in_flight(rec, attempt_id)
    usage = failure.usage
    failure = _stored_failure(failure)
    ended = _ended(last, "failed", failure, usage)
    base = evolve(rec, attempts=(*rec.attempts[:-1], ended), last_failure=failure)
    reason = classify(failure, rec.retry_policy)
    terminal: errors.RecoveryError | None = None
    if reason is not None:
        new = evolve(base, phase="failed", failure_reason=reason)
        terminal = errors.ProviderError(reason, operation_id=rec.operation_id, interruption=failure)
    elif failure.kind == "http_rejected" and failure.http_status == 401:
        if last.reason == "authentication_reissue":
            # Renewed credentials were rejected too: renewal cannot fix this.
            new = evolve(base, phase="failed", failure_reason="authentication_required")
            terminal = errors.AuthenticationRequired(operation_id=rec.operation_id)
        else:
            new = evolve(base, phase="waiting", renew_next=True, next_attempt_at=None)
    else:
        delay = backoff_delay(rec.retry_policy, base.attempts_used, failure.retry_after)
        new = evolve(base, phase="waiting", next_attempt_at=ctx.now + delay)
    spent = _budget_spent(new)
    if terminal is None and spent is not None:
        # The attempt budget, or the output-token budget (the tokens this attempt
        # reported included), is spent: no replacement is authorized.
        new = evolve(new, phase="failed", failure_reason=spent, renew_next=False,
                     next_attempt_at=None)
        terminal = _terminal_error(new)
    if ctx.command == "cancel":
        return Transition(*_cmd(new, "cancel"), changed=True)
    if terminal is not None:
        return Transition(new, Stop(terminal), True)
    if ctx.command == "suspend":
        return Transition(*_cmd(new, "suspend"), changed=True)
    account_error = _account_error(rec, ctx)
    if account_error is not None:
        return Transition(new, Stop(account_error), True)
    step = _next_step(new, ctx)
    return Transition(step.record, step.action, True)


def _cmd(rec: OperationRecord, kind: CommandKind) -> tuple[OperationRecord, Action | None]:
    t = _apply_command(rec, kind)
    return t.record, t.action


def completion_validated(
    rec: OperationRecord,
    attempt_id: str,
    ctx: Context,
    *,
    response_id: str | None,
    sequence_number: int | None,
    usage: Usage | None = None,
) -> Transition:
    """A validated completion arrived. The driver saves the payload with this record
    (the receipt) before delivering. A cancel fences it off; a suspend keeps it."""
    last = _in_flight(rec, attempt_id)
    done = AttemptRecord(
        attempt_id=last.attempt_id,
        number=last.number,
        reason=last.reason,
        consumed_at=last.consumed_at,
        outcome="completed",
        response_id=response_id or last.response_id,
        sequence_number=sequence_number if sequence_number is not None else last.sequence_number,
        usage=usage,
    )
    base = evolve(rec, attempts=(*rec.attempts[:-1], done))
    if ctx.command == "cancel":
        return Transition(*_cmd(base, "cancel"), changed=True)
    new = evolve(base, phase="completed", completed_at=ctx.now, next_attempt_at=None,
                       pending=None)
    account_error = _account_error(rec, ctx)
    if account_error is not None:
        # The attempt was authorized for the record's account and its completion was
        # validated: it is that account's result. Keep it as the receipt (never
        # discard a paid result), but deliver nothing to whoever is signed in now;
        # the original account reads it on reopening, with no new generation.
        return Transition(new, Stop(account_error), True)
    if ctx.command == "suspend":
        return Transition(new, Stop(errors.OperationSuspended(operation_id=rec.operation_id)),
                          True)
    return Transition(new, Deliver(), True)


def account_stopped(rec: OperationRecord, code: str, ctx: Context) -> Transition:
    """The runtime signed out (``code="signed_out"``) or changed its account
    (``"account_changed"``) while this execution was waiting, authorizing or streaming.

    The execution stops with ``AccountChanged``. An attempt in flight stays spent and
    becomes an interruption (kind ``interrupted``, ``transport_code=code``); nothing is
    refunded and no completion is invented. A pending attempt id and a persisted
    cooldown are kept, and the operation is left idle for the original account to
    reopen. A lifecycle command observed at the same time is applied instead.
    """
    if ctx.command is not None:
        return _apply_command(rec, ctx.command)
    message = "signed out" if code == "signed_out" else "account changed"
    error = errors.AccountChanged(message, operation_id=rec.operation_id)
    if rec.phase in ("completed", "failed", "cancelled", "suspended", "prepared"):
        return _t(rec, rec, Stop(error))
    closed = _close_in_flight(rec, code)
    idle = "waiting" if closed.attempts_used else "prepared"
    return _t(rec, evolve(closed, phase=idle), Stop(error))


def interrupted_locally(rec: OperationRecord) -> Transition:
    """The owning task was cancelled (Trio cancellation, or a suspend command observed).

    Suspension preserves the request, the spent budget, the cooldown and any saved
    completion. An in-flight attempt stays spent and is marked interrupted.
    """
    if rec.phase in ("completed", "failed", "cancelled"):
        return _t(rec, rec, Stop(errors.OperationSuspended(operation_id=rec.operation_id)))
    return _t(rec, _suspended(rec), Stop(errors.OperationSuspended(operation_id=rec.operation_id)))


def command_observed(rec: OperationRecord, kind: CommandKind) -> Transition:
    """A lifecycle command reached the live execution (via the monitor or a write check)."""
    if kind == "cancel":
        return _apply_command(rec, "cancel")
    return interrupted_locally(rec)


def command_on_idle(rec: OperationRecord, kind: CommandKind) -> Transition:
    """Apply suspend/cancel directly to a record no live execution owns."""
    if kind == "cancel":
        return _apply_command(rec, "cancel")
    if rec.phase in ("completed", "failed", "cancelled", "suspended"):
        return _t(rec, rec, None)
    return _t(rec, _suspended(rec), None)


def command_at_open(pending: CommandKind | None) -> CommandKind | None:
    """The stored command an opening execution applies (``ctx.command`` of
    :func:`open_operation`): a pending suspend is spent by reopening (reopening is
    resuming; the driver deletes its row), a pending cancel stands and fences."""
    match pending:
        case "cancel":
            return "cancel"
        case _:
            return None


def command_to_store(existing: CommandKind | None, new: CommandKind) -> CommandKind | None:
    """A live owner runs the operation: the command row to write for ``new``, or ``None``
    when the stored row stands unchanged (a stored cancel is never downgraded, nor
    rewritten with a fresh serial)."""
    merged = merge_command(existing, new)
    return None if merged == existing == "cancel" else merged


def command_folded(rec: OperationRecord, kind: CommandKind) -> bool:
    """The record's phase already says what the stored command ``kind`` asked for, so its
    row may be deleted once this record is written: a suspend is said by a suspended or
    cancelled record, a cancel only by a cancelled one (never lost into a resumable
    suspension)."""
    match kind:
        case "cancel":
            return rec.phase == "cancelled"
        case _:
            return rec.phase in ("suspended", "cancelled")


def cancel_fences(rec: OperationRecord, command: CommandKind | None) -> bool:
    """Nothing may be delivered or read as a receipt: the record is cancelled, or a cancel
    command is pending (it is permanent from the moment it is written)."""
    return rec.phase == "cancelled" or command == "cancel"


def caller_cancelled(rec: OperationRecord, command: CommandKind | None) -> Transition:
    """The owning task was cancelled (Trio cancellation) with ``command`` observed by its
    watch: a permanent cancel seen as the caller went away wins; anything else suspends."""
    match command:
        case "cancel":
            return command_observed(rec, "cancel")
        case _:
            return interrupted_locally(rec)


def check_retry_source(rec: OperationRecord, *, now: float, endpoint_id: str | None) -> None:
    """The source-condition table of manual retry, row by row."""
    op = rec.operation_id
    if rec.phase == "cancelled":
        raise errors.RetryNotAllowed("permanently cancelled: terminal", operation_id=op)
    if rec.has_completion:
        raise errors.RetryNotAllowed(
            "a completion is saved: read and commit the receipt", operation_id=op
        )
    if rec.phase == "failed":
        if rec.failure_reason == "tool_activity":
            raise errors.RetryNotAllowed(
                "tool activity: correct the request instead of retrying it", operation_id=op
            )
        if rec.failure_reason == "authentication_required":
            raise errors.RetryNotAllowed(
                "sign in to the same account and resume instead", operation_id=op
            )
        return  # exhausted (attempts or tokens), quota, rejected, provider failure, ...
    if rec.attempts_remaining == 0 or rec.token_budget_spent:
        return  # exhausted (also: suspended and exhausted)
    if _expired(rec, now):
        return  # expired attempt permission
    if endpoint_blocked(rec, endpoint_id):
        return  # configuration-blocked
    raise errors.RetryNotAllowed(
        "the operation can still run: resume it instead", operation_id=op
    )


def check_acknowledge(rec: OperationRecord) -> None:
    """Acknowledge only a saved completion (after the host's own commit)."""
    if rec.phase == "cancelled":
        raise errors.OperationCancelled(operation_id=rec.operation_id)
    if not rec.has_completion:
        raise errors.CompletionUnavailable(
            "nothing to acknowledge: no saved completion", operation_id=rec.operation_id
        )


# --- status ------------------------------------------------------------------------


def derive_status(
    rec: OperationRecord,
    *,
    now: float,
    lease_live: bool,
    viewer: AccountBinding | None,
    endpoint_id: str | None = None,
    command: CommandKind | None = None,
    payloads: frozenset[str] | None = None,
    endpoint_down: str | None = None,
) -> Status:
    """Every dimension of the operation, derived from the record (no lease, no I/O).

    ``payloads`` are the payload kinds present in the store (``None``: not looked
    at). A missing frozen body (while the operation could still generate) or a
    missing saved completion is the ``storage_unavailable`` blocker.

    ``endpoint_down`` is the viewing runtime's own knowledge that its endpoint cannot
    be connected to (its shared connect backoff); it applies to a live execution.
    """
    if viewer is None or viewer != rec.account:
        return redacted_status(rec.operation_id)
    phase = rec.phase
    if command == "cancel" and not lease_live:
        phase = "cancelled"
    remaining = rec.attempts_remaining
    spent = rec.token_budget_spent
    blockers: set[Blocker] = set()
    if endpoint_blocked(rec, endpoint_id):
        blockers.add("configuration_unavailable")
    if rec.failure_reason == "authentication_required":
        blockers.add("authentication_required")
    if payloads is not None and not rec.awaiting_upgrade and phase != "cancelled":
        needed = "completion" if rec.has_completion else "body"
        if needed not in payloads:
            blockers.add("storage_unavailable")
    state: State
    availability: Availability
    expired = _expired(rec, now)
    if phase == "completed" or (rec.has_completion and phase not in ("cancelled",)):
        state, availability = "completed", "completion_saved"
    elif phase == "cancelled":
        state, availability = "cancelled", "permanently_cancelled"
    elif phase == "failed":
        state = "failed"
        availability = {
            "exhausted": "exhausted",
            "token_budget_exhausted": "exhausted",
            "authentication_required": "authentication_required",
        }.get(rec.failure_reason or "", "failed")  # type: ignore[assignment]
    elif phase == "suspended":
        state = "suspended"
        availability = "suspended" if remaining and not spent else "exhausted"
    elif lease_live and phase in ("authorizing", "transmitting", "waiting"):
        state = "running"
        availability = "waiting" if phase == "waiting" else "running"
    elif phase == "prepared":
        state, availability = "prepared", "ready"
    else:  # authorizing / transmitting / waiting with no live owner
        state = "interrupted"
        if remaining == 0 or spent:
            availability = "exhausted"
        elif rec.next_attempt_at is not None and rec.next_attempt_at > now:
            availability = "waiting"
        else:
            availability = "replacement_eligible" if rec.attempts_used else "ready"
    if expired and availability in ("ready", "waiting", "replacement_eligible", "suspended"):
        availability = "expired"
    if blockers and availability in ("ready", "waiting", "replacement_eligible"):
        availability = "blocked"
    if "storage_unavailable" in blockers and availability in ("suspended", "completion_saved"):
        availability = "blocked"
    endpoint_failure = rec.endpoint_failure or (
        endpoint_down if lease_live and rec.phase == "authorizing" else None
    )
    if endpoint_failure is not None and availability in (
        "ready", "waiting", "replacement_eligible", "running", "suspended"
    ):
        # Nothing was spent for it; the budget is intact and the job is not failed.
        blockers.add("endpoint_unavailable")
        availability = "endpoint_unavailable"
    else:
        endpoint_failure = None
    return Status(
        operation_id=rec.operation_id,
        state=state,
        availability=availability,
        blockers=frozenset(blockers),
        has_saved_completion=rec.has_completion,
        attempts_used=rec.attempts_used,
        maximum_attempts=rec.maximum_attempts,
        attempts_remaining=remaining,
        next_attempt_at=to_datetime(rec.next_attempt_at),
        expires_at=to_datetime(rec.expires_at),
        root_operation_id=rec.root_operation_id,
        previous_operation_id=rec.previous_operation_id,
        successor_id=rec.retry_reservation.successor_id if rec.retry_reservation else None,
        attempts=tuple(
            AttemptSummary(
                attempt_id=a.attempt_id,
                number=a.number,
                reason=a.reason,
                outcome="interrupted" if (a.outcome == "in_flight" and not lease_live)
                else a.outcome,
                response_id=a.response_id,
                sequence_number=a.sequence_number,
                failure=a.failure,
                usage=a.usage,
            )
            for a in rec.attempts
        ),
        response_id=rec.attempts[-1].response_id if rec.attempts else None,
        sequence_number=rec.attempts[-1].sequence_number if rec.attempts else None,
        last_failure=rec.last_failure,
        suggested_actions=suggested_actions(availability, rec, frozenset(blockers)),
        model=rec.model,
        job_id=rec.job_id,
        input_revision=rec.input_revision,
        scope=rec.scope,
        pending_attempt_id=rec.pending.attempt_id if rec.pending else None,
        endpoint_failure=endpoint_failure,
        usage=rec.usage,
        maximum_output_tokens_total=rec.maximum_output_tokens_total,
    )


def suggested_actions(
    availability: Availability,
    rec: OperationRecord,
    blockers: frozenset[Blocker] = frozenset(),
) -> tuple[SuggestedAction, ...]:
    table: dict[str, tuple[SuggestedAction, ...]] = {
        "ready": ("execute", "abandon"),
        "replacement_eligible": ("execute", "abandon"),
        "waiting": ("wait", "execute", "abandon"),
        "running": ("wait",),
        "completion_saved": ("read_receipt", "acknowledge", "abandon"),
        "suspended": ("resume", "abandon"),
        "exhausted": ("manual_retry", "abandon"),
        "authentication_required": ("sign_in", "abandon"),
        "permanently_cancelled": ("abandon",),
        "failed": ("manual_retry", "abandon"),
        "expired": ("manual_retry", "abandon"),
        "blocked": ("manual_retry", "abandon"),
        "endpoint_unavailable": ("wait", "resume", "abandon"),
        "acknowledged": (),
        "abandoned": (),
    }
    actions = table[availability]
    if "storage_unavailable" in blockers:
        # The frozen request (or the saved completion) is gone: nothing can run, be
        # cloned or be read. Restore the store, or abandon and decide on a new request.
        actions = tuple(a for a in actions if a in ("wait", "abandon"))
    return actions


def redacted_status(operation_id: str) -> Status:
    """What another account (or a signed-out viewer) may see: that it exists, nothing else."""
    return Status(
        operation_id=operation_id,
        state="prepared",
        availability="blocked",
        blockers=frozenset({"account_mismatch"}),
        redacted=True,
        suggested_actions=("sign_in",),
    )
