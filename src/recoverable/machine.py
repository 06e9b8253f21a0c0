"""The operation state machine: every rule of an operation's life, in one pure module.

Rule 1: everything that decides what an operation may do next lives here (and in the
values it owns: ``failure_policy`` says what a failed attempt means, ``preconditions``
what must hold before a run, a retry or an acknowledgement, ``status`` how a record
reads to a host). No I/O, no clock, no Trio: callers pass ``now`` and the facts they
observed, and get back a :class:`Transition` — the next record and ONE action.

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

The phases (``records.Phase``) and the transitions allowed out of them::

    prepared ──open/wake──▶ authorizing ──approved──▶ transmitting ──completed──▶ completed
        ▲                      │  denied: back to idle,      │  failed (eligible, budget)
        │                      ▼  pending id kept            ▼
        └──────────────── waiting ◀──────────────────────────┘
    any non-terminal ──suspend──▶ suspended ──open──▶ (as above; budget never reset)
    any ──cancel──▶ cancelled (terminal: no generation, no delivery)
    transmitting ──terminal failure / budget spent──▶ failed

Which event applies in which phase is the table :data:`EVENT_PHASES`
(``transitions.py``), checked in one place (``transitions.require_phase``): an event
that does not apply to the record's phase raises :class:`InvalidTransition`; it is
never a silent no-op.

Lifecycle commands (suspend, cancel) are stated in ``lifecycle.py`` and re-exported
here: :func:`merge_command` (a
cancel is never downgraded), and what a pending command means when an execution opens
(:func:`command_at_open`), when a record is written (:func:`command_folded`), when a
host issues one (:func:`command_to_store`, :func:`command_on_idle`), and when the
caller goes away (:func:`caller_cancelled`).
"""

from __future__ import annotations

import msgspec

from recoverable import errors, reattachment
from recoverable.endpoint_rules import endpoint_given_up, endpoint_refusal, endpoint_unreachable
from recoverable.failure_errors import ended_error, terminal_error
from recoverable.failure_policy import TRANSPORT_KINDS, backoff_delay, classify
from recoverable.lifecycle import (
    apply_command,
    caller_cancelled,
    cancel_fences,
    command_at_open,
    command_folded,
    command_observed,
    command_on_idle,
    command_on_top,
    command_spent_at_open,
    command_to_store,
    interrupted_locally,
    merge_command,
)
from recoverable.outcome import Interruption, Usage
from recoverable.preconditions import (
    MAX_ATTEMPTS,
    MAX_METADATA_CHARS,
    MAX_OUTPUT_TOKENS_TOTAL,
    check_acknowledge,
    check_retry_source,
    endpoint_blocked,
    endpoint_matches,
    is_expired,
    validate_metadata,
    validate_preparation,
)
from recoverable.records import AttemptRecord, FailureReason, OperationRecord, PendingAttempt
from recoverable.sources_rules import superseded_error
from recoverable.status import SUGGESTED_ACTIONS, derive_status, redacted_status, suggested_actions
from recoverable.transitions import (
    EVENT_PHASES,
    FINISHED,
    OWNED,
    Action,
    AskHost,
    Context,
    Deliver,
    Event,
    InvalidTransition,
    Reattach,
    Stop,
    Transition,
    Transmit,
    WaitUntil,
    attempt_id_for,
    close_in_flight,
    close_interrupted,
    evolve,
    idle_phase,
    interrupted_error,
    moved,
    require_in_flight,
    require_pending,
    require_phase,
    stopped,
    with_last_attempt,
)
from recoverable.types import Attempt, AttemptReason

__all__ = [
    "EVENT_PHASES",
    "MAX_ATTEMPTS",
    "MAX_METADATA_CHARS",
    "MAX_OUTPUT_TOKENS_TOTAL",
    "SUGGESTED_ACTIONS",
    "Action",
    "AskHost",
    "Context",
    "Deliver",
    "Event",
    "InvalidTransition",
    "Reattach",
    "Stop",
    "Transition",
    "Transmit",
    "WaitUntil",
    "account_stopped",
    "attempt_failed",
    "attempt_id_for",
    "authorization_answered",
    "authorization_failed",
    "backoff_delay",
    "caller_cancelled",
    "cancel_fences",
    "check_acknowledge",
    "check_retry_source",
    "classify",
    "command_at_open",
    "command_folded",
    "command_observed",
    "command_on_idle",
    "command_spent_at_open",
    "command_to_store",
    "completion_validated",
    "credentials_unavailable",
    "derive_status",
    "ended_error",
    "endpoint_blocked",
    "endpoint_given_up",
    "endpoint_matches",
    "endpoint_refusal",
    "endpoint_unreachable",
    "evolve",
    "interrupted_locally",
    "merge_command",
    "open_operation",
    "owner_lost",
    "progress",
    "redacted_status",
    "suggested_actions",
    "terminal_error",
    "unclaimed",
    "unclaimed_since",
    "validate_metadata",
    "validate_preparation",
    "wake",
]


# --- the record's own facts --------------------------------------------------------


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


def _body_error(rec: OperationRecord, ctx: Context) -> errors.RecoveryError:
    operation_id = rec.operation_id
    if rec.awaiting_upgrade and ctx.endpoint_id is None:
        return errors.ConfigurationUnavailable(
            "no backend: a version-1 request is frozen (upgraded) only by a runtime "
            "with a backend", operation_id=operation_id,
        )
    if rec.awaiting_upgrade:
        return errors.RequestUnavailable(
            "the version-1 request could not be frozen: nothing was sent or spent",
            operation_id=operation_id,
        )
    return errors.RequestUnavailable(
        "the frozen request body is missing from the store: nothing was sent or spent",
        operation_id=operation_id,
    )


def _budget_spent(rec: OperationRecord) -> FailureReason | None:
    """Which saved budget forbids another attempt: the attempts, the output tokens, then
    the cost."""
    if rec.attempts_remaining == 0:
        return "exhausted"
    if rec.token_budget_spent:
        return "token_budget_exhausted"
    if rec.cost_budget_spent:
        return "cost_budget_exhausted"
    return None


def _stored_failure(failure: Interruption) -> Interruption:
    """The failure as the record keeps it: its usage lives on the attempt, not here."""
    if failure.usage is None and not failure.usage_malformed and failure.rate_limits is None:
        return failure
    return msgspec.structs.replace(failure, usage=None, usage_malformed=False, rate_limits=None)


# --- the next step -----------------------------------------------------------------


def _next_step(rec: OperationRecord, ctx: Context) -> Transition:
    """From an idle, generation-capable record: wait, or ask the host for the next attempt."""
    spent = _budget_spent(rec)
    if spent is not None:
        failed = evolve(rec, phase="failed", failure_reason=spent, pending=None)
        return stopped(rec, failed, terminal_error(failed))
    if is_expired(rec, ctx.now):
        return stopped(rec, rec, errors.StateExpired(operation_id=rec.operation_id))
    if rec.next_attempt_at is not None and rec.next_attempt_at > ctx.now:
        return moved(rec, evolve(rec, phase="waiting"), WaitUntil(rec.next_attempt_at))
    pending = rec.pending
    number = rec.attempts_used + 1
    if pending is None or pending.number != number:
        reason: AttemptReason
        if rec.attempts_used == 0:
            reason = "initial"
        elif rec.renew_next:
            reason = "authentication_reissue"
        else:
            reason = "replacement"
        pending = PendingAttempt(attempt_id_for(rec.operation_id, number), number, reason)
    authorizing = evolve(rec, phase="authorizing", pending=pending, next_attempt_at=None)
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
    return moved(rec, authorizing, AskHost(attempt))


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
    require_phase("open", rec)
    operation_id = rec.operation_id
    account_error = _account_error(rec, ctx)
    if account_error is not None:
        return stopped(rec, rec, account_error)  # nothing about it, not even a cancel
    if rec.phase == "superseded":  # terminal: nothing runs or is delivered
        return stopped(rec, rec, superseded_error(rec))
    if rec.phase == "cancelled" or ctx.command == "cancel":
        return apply_command(rec, "cancel")
    if format_hash != rec.format_hash:
        return stopped(rec, rec, errors.FormatMismatch(
            "the requested response format differs from the saved one",
            operation_id=operation_id,
        ))
    if check_contract_version and expected_contract_version != rec.contract_version:
        return stopped(rec, rec, errors.FormatMismatch(
            "the expected contract version differs from the saved one",
            operation_id=operation_id,
        ))
    if rec.has_completion:
        completed = evolve(rec, phase="completed") if rec.phase != "completed" else rec
        return moved(rec, completed, Deliver())
    if rec.phase == "failed" and rec.failure_reason != "authentication_required":
        return stopped(rec, rec, terminal_error(rec))
    refusal = endpoint_refusal(rec, ctx.endpoint_id)
    if refusal is not None:
        return stopped(rec, rec, refusal)
    if not ctx.body_available:
        # Found before the host is asked and before an attempt is spent (fail closed).
        return stopped(rec, rec, _body_error(rec, ctx))
    resumed = reattachment.at_open(rec, ctx)  # reattach: resume before replacing
    if resumed is not None:
        return resumed
    work = rec
    if work.phase == "failed":  # authentication_required: a blocker, reopened after sign-in
        work = evolve(work, phase="waiting", failure_reason=None, renew_next=True)
    # The previous execution died (or was cancelled) while an attempt was in flight: it
    # stays spent; its outcome is unknown, so it reads as an interruption (which ends
    # the operation under on_interruption="fail").
    work = close_interrupted(work, "owner_lost")
    if work.phase == "failed":
        return stopped(rec, work, terminal_error(work))
    if work.phase in ("authorizing", "transmitting", "suspended"):
        work = evolve(work, phase=idle_phase(work))
    step = _next_step(work, ctx)
    return Transition(step.record, step.action, step.record != rec)


def wake(rec: OperationRecord, ctx: Context) -> Transition:
    """The persisted ``next_attempt_at`` was reached while waiting under the lease."""
    require_phase("wake", rec)
    if ctx.command is not None:
        return apply_command(rec, ctx.command)
    account_error = _account_error(rec, ctx)
    if account_error is not None:
        return stopped(rec, rec, account_error)
    return _next_step(rec, ctx)


def authorization_answered(
    rec: OperationRecord, attempt_id: str, approved: bool, ctx: Context
) -> Transition:
    """The host answered. Approval is rechecked against lifecycle, account, expiry, budget."""
    pending = require_pending("authorization_answered", rec, attempt_id)
    idle = evolve(rec, phase=idle_phase(rec))
    if not approved:
        # A denial is not a cancellation: nothing is spent and the pending id stays.
        return stopped(rec, idle, errors.AttemptNotAuthorized(
            operation_id=rec.operation_id, attempt_id=attempt_id
        ))
    if ctx.command is not None:
        return apply_command(idle, ctx.command)
    account_error = _account_error(rec, ctx)
    if account_error is not None:
        return stopped(rec, idle, account_error)
    if is_expired(rec, ctx.now):
        return stopped(rec, idle, errors.StateExpired(operation_id=rec.operation_id))
    spent = _budget_spent(rec)
    if spent is not None:
        failed = evolve(rec, phase="failed", failure_reason=spent, pending=None)
        return stopped(rec, failed, terminal_error(failed))
    consumed = AttemptRecord(
        attempt_id=pending.attempt_id,
        number=pending.number,
        reason=pending.reason,
        consumed_at=ctx.now,
    )
    transmitting = evolve(
        rec,
        phase="transmitting",
        pending=None,
        attempts=(*rec.attempts, consumed),
        attempts_used=rec.attempts_used + 1,
        next_attempt_at=None,
        renew_next=False,
        endpoint_failure=None,
    )
    renew = pending.reason == "authentication_reissue"
    return moved(rec, transmitting, Transmit(pending.attempt_id, renew))


def authorization_failed(rec: OperationRecord, attempt_id: str, detail: str) -> Transition:
    """A worker's standing authorization policy raised or did not answer True/False.

    Nobody waits on a detached execution to hear the error, so it is saved: the operation
    fails (``authorization_failed``), nothing spent, the pending attempt dropped."""
    require_pending("authorization_failed", rec, attempt_id)
    failed = evolve(rec, phase="failed", failure_reason="authorization_failed", pending=None)
    return stopped(rec, failed, errors.AuthorizationFailed(
        detail, operation_id=rec.operation_id, attempt_id=attempt_id
    ))


def credentials_unavailable(rec: OperationRecord, attempt_id: str) -> Transition:
    """Renewal for a 401 reissue failed before anything was spent: a sign-in blocker."""
    require_pending("credentials_unavailable", rec, attempt_id)
    failed = evolve(rec, phase="failed", failure_reason="authentication_required")
    return stopped(rec, failed, errors.AuthenticationRequired(operation_id=rec.operation_id))


def progress(
    rec: OperationRecord, attempt_id: str, response_id: str | None, sequence_number: int | None
) -> Transition:
    """Response id and cursor arrived (diagnostics only; never a promise of retrieval)."""
    last = require_in_flight("progress", rec, attempt_id)
    updated = msgspec.structs.replace(
        last,
        response_id=response_id if response_id is not None else last.response_id,
        sequence_number=sequence_number if sequence_number is not None else last.sequence_number,
    )
    return moved(rec, with_last_attempt(rec, updated), None)


def attempt_failed(
    rec: OperationRecord, attempt_id: str, failure: Interruption, ctx: Context
) -> Transition:
    """The in-flight attempt ended without a usable completion. Partial output is discarded.

    The failure is classified first (terminal, or replacement-eligible with its
    cooldown); a lifecycle command observed at the same time is applied on top,
    so a suspend never turns a terminal failure into a replaceable one and never
    drops a persisted cooldown or a pending 401 reissue.
    """
    resumed = reattachment.after_failure(rec, attempt_id, failure, ctx)  # resume first
    if resumed is not None:
        return resumed
    last = require_in_flight("attempt_failed", rec, attempt_id)
    usage = failure.usage
    failure = _stored_failure(failure)
    ended = reattachment.closed_attempt(
        rec, last, "failed", response_id=failure.response_id,
        sequence_number=failure.sequence_number, failure=failure,
        usage=usage if usage is not None else last.usage,
    )
    base = with_last_attempt(rec, ended, last_failure=failure)
    reason = classify(failure, rec.retry_policy)
    if reason is None and rec.on_interruption == "fail" and (
        failure.kind in TRANSPORT_KINDS or (rec.live and failure.had_output)  # output was shown
    ):
        # Replaceable by kind, but its policy forbids replacing it: an interruption, or a
        # live operation's attempt whose output a person may have seen (docs/live.md).
        reason = "interrupted"
    terminal: errors.RecoveryError | None = None
    if reason is not None:
        new = evolve(base, phase="failed", failure_reason=reason)
        terminal = (
            interrupted_error(new) if reason == "interrupted"
            else errors.ProviderError(reason, operation_id=rec.operation_id, interruption=failure)
        )
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
        terminal = terminal_error(new)
    if ctx.command == "cancel":
        return command_on_top(new, "cancel")
    if terminal is not None:
        return Transition(new, Stop(terminal), True)
    if ctx.command == "suspend":
        return command_on_top(new, "suspend")
    account_error = _account_error(rec, ctx)
    if account_error is not None:
        return Transition(new, Stop(account_error), True)
    step = _next_step(new, ctx)
    return Transition(step.record, step.action, True)


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
    last = require_in_flight("completion_validated", rec, attempt_id)
    done = reattachment.closed_attempt(
        rec, last, "completed", response_id=response_id, sequence_number=sequence_number,
        failure=None, usage=usage,
    )
    base = with_last_attempt(rec, done)
    if ctx.command == "cancel":
        return command_on_top(base, "cancel")
    completed = evolve(base, phase="completed", completed_at=ctx.now, next_attempt_at=None,
                       pending=None)
    account_error = _account_error(rec, ctx)
    if account_error is not None:
        # The attempt was authorized for the record's account and its completion was
        # validated: it is that account's result. Keep it as the receipt (never
        # discard a paid result), but deliver nothing to whoever is signed in now;
        # the original account reads it on reopening, with no new generation.
        return Transition(completed, Stop(account_error), True)
    if ctx.command == "suspend":
        suspended = errors.OperationSuspended(operation_id=rec.operation_id)
        return Transition(completed, Stop(suspended), True)
    return Transition(completed, Deliver(), True)


def account_stopped(rec: OperationRecord, code: str, ctx: Context) -> Transition:
    """The runtime signed out (``code="signed_out"``) or changed its account
    (``"account_changed"``) while this execution was waiting, authorizing or streaming.

    The execution stops with ``AccountChanged``. An attempt in flight stays spent and
    becomes an interruption (kind ``interrupted``, ``transport_code=code``); nothing is
    refunded and no completion is invented. A pending attempt id and a persisted
    cooldown are kept, and the operation is left idle for the original account to
    reopen. A lifecycle command observed at the same time is applied instead. Under
    ``on_interruption="fail"`` an attempt in flight ends the operation (``failed``,
    ``interrupted``); the execution still stops with ``AccountChanged``.
    """
    require_phase("account_stopped", rec)
    if ctx.command is not None:
        return apply_command(rec, ctx.command)
    message = "signed out" if code == "signed_out" else "account changed"
    error = errors.AccountChanged(message, operation_id=rec.operation_id)
    if rec.phase in FINISHED or rec.phase in ("suspended", "prepared"):
        return stopped(rec, rec, error)
    closed = close_interrupted(rec, code)
    if closed.phase == "failed":
        return stopped(rec, closed, error)
    return stopped(rec, evolve(closed, phase=idle_phase(closed)), error)


def owner_lost(rec: OperationRecord, *, now: float) -> Transition:
    """The recovery sweep's step: no live process owns this operation any more (its owner
    died, or its lease expired) and nobody runs it now.

    Only an owned phase (``authorizing``, ``transmitting``, ``waiting``) changes; any
    other phase is returned unchanged, so applying this to its own result changes
    nothing. An attempt in flight stays spent and is closed as an interruption (kind
    ``interrupted``, ``transport_code="owner_lost"``, the response id and cursor it
    already had): no completion, usage or response id is invented. Then:

    - ``failed`` with ``failure_reason="owner_lost"`` when no budget is left (attempts
      or output tokens), or when an attempt was interrupted and the operation's policy
      is ``on_interruption="fail"``;
    - ``failed`` with ``failure_reason="expired"`` when ``expires_at`` has passed;
    - otherwise idle for adoption: ``waiting`` (``prepared`` if nothing was ever spent),
      a pending attempt id kept, and after an interrupted attempt ``next_attempt_at`` at
      least ``now`` plus the retry policy's cooldown.

    The action is always ``None``: no execution is attached to act on it.
    """
    require_phase("owner_lost", rec)
    if rec.phase not in OWNED or rec.has_completion:
        return moved(rec, rec, None)
    closed = close_in_flight(rec, "owner_lost")
    interrupted = closed is not rec
    reason: FailureReason | None = None
    if reattachment.keeps_through_owner_loss(closed) and not is_expired(closed, now):
        pass  # reattachment: the next owner resumes it first (no budget, no replacement)
    elif _budget_spent(closed) is not None or (interrupted and rec.on_interruption == "fail"):
        reason = "owner_lost"
    elif is_expired(closed, now):
        reason = "expired"
    if reason is not None:
        failed = evolve(closed, phase="failed", failure_reason=reason, pending=None,
                        next_attempt_at=None, renew_next=False)
        return moved(rec, failed, None)
    next_at = closed.next_attempt_at
    if interrupted:
        cooldown = now + backoff_delay(closed.retry_policy, closed.attempts_used, None)
        next_at = cooldown if next_at is None else max(next_at, cooldown)
    phase = closed.phase if closed.phase == "waiting" else idle_phase(closed)
    return moved(rec, evolve(closed, phase=phase, next_attempt_at=next_at), None)



def unclaimed_since(rec: OperationRecord, served_until: float | None = None) -> float:
    """When ``rec``'s wait for a worker began: the latest of its creation, its last consumed
    attempt, its saved ``next_attempt_at`` and ``served_until`` (until when a worker of its
    account and endpoint is known to have served the queue)."""
    return max(
        rec.created_at,
        rec.attempts[-1].consumed_at if rec.attempts else rec.created_at,
        rec.next_attempt_at if rec.next_attempt_at is not None else rec.created_at,
        served_until if served_until is not None else rec.created_at,
    )


def unclaimed(
    rec: OperationRecord, *, now: float, unclaimed_after: float,
    served_until: float | None = None,
) -> Transition:
    """The bound on waiting for a worker (unclaimed work): an operation no live process owns,
    runnable (``prepared``, or ``waiting`` once its cooldown passed) and not served for
    ``unclaimed_after`` seconds since :func:`unclaimed_since` ends ``failed`` with
    ``failure_reason="no_worker"``. Any other phase, or a younger wait, is returned
    unchanged (action ``None``). The caller checks that no live lease exists and that no
    live worker serves its account and endpoint now.
    """
    require_phase("unclaimed", rec)
    if rec.phase not in ("prepared", "waiting") or rec.has_completion:
        return moved(rec, rec, None)
    if now - unclaimed_since(rec, served_until) < unclaimed_after:
        return moved(rec, rec, None)
    failed = evolve(rec, phase="failed", failure_reason="no_worker", pending=None,
                    next_attempt_at=None, renew_next=False)
    return moved(rec, failed, None)
