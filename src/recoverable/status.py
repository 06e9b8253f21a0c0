"""What an operation's record means to a host: its :class:`~recoverable.types.Status`.

Status is derived, never stored: every dimension (state, availability, blockers,
suggested actions) is computed here from the record and what the viewer observed
(is a lease live, which payloads are present, which account is looking). Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from recoverable.preconditions import endpoint_blocked, is_expired
from recoverable.reattachment import reattach_target
from recoverable.records import AttemptRecord, CommandKind, LeaseRecord, OperationRecord
from recoverable.types import (
    AccountBinding,
    AttemptSummary,
    Availability,
    Blocker,
    ContinuationStatus,
    State,
    Status,
    SuggestedAction,
    to_datetime,
)

__all__ = [
    "SETTLED_STATES", "SUGGESTED_ACTIONS", "derive_status", "redacted_status", "suggested_actions",
]

# What a host may do next, by availability (first: the usual next step).
# The states in which nothing more will happen to an operation by itself: its result (or
# its failure) is settled. ``runtime.wait`` stops at them; the dashboard offers no suspend.
SETTLED_STATES: Final[frozenset[State]] = frozenset(
    {"completed", "failed", "cancelled", "superseded", "acknowledged", "abandoned"}
)

SUGGESTED_ACTIONS: Final[Mapping[Availability, tuple[SuggestedAction, ...]]] = {
    "ready": ("execute", "abandon"),
    "running": ("wait",),
    "waiting": ("wait", "execute", "abandon"),
    "replacement_eligible": ("execute", "abandon"),
    "completion_saved": ("read_receipt", "acknowledge", "abandon"),
    "suspended": ("resume", "abandon"),
    "exhausted": ("manual_retry", "abandon"),
    "authentication_required": ("sign_in", "abandon"),
    "permanently_cancelled": ("abandon",),
    "failed": ("manual_retry", "abandon"),
    "expired": ("manual_retry", "abandon"),
    "acknowledged": (),
    "abandoned": (),
    "blocked": ("manual_retry", "abandon"),
    "superseded": ("abandon",),  # prepare a new operation bound to the current digest
    "endpoint_unavailable": ("wait", "resume", "abandon"),
    "continuation_pending": ("wait", "abandon"),
}

# What still makes sense when the frozen request (or the saved completion) is gone:
# nothing can run, be cloned or be read. Restore the store, or abandon.
_WITHOUT_STORAGE: Final = frozenset({"wait", "abandon"})


def suggested_actions(
    availability: Availability,
    rec: OperationRecord,
    blockers: frozenset[Blocker] = frozenset(),
) -> tuple[SuggestedAction, ...]:
    """The host's next steps for this availability (``SUGGESTED_ACTIONS``), minus what a
    ``storage_unavailable`` blocker rules out; ``use_successor`` instead of
    ``manual_retry`` once a manual retry reserved a successor (``Status.successor_id``)."""
    actions = SUGGESTED_ACTIONS[availability]
    if rec.retry_reservation is not None:
        # A manual retry already made (or reserved) its successor: that is where the job
        # goes on (a retry from this source again returns the same successor at best).
        actions = tuple("use_successor" if action == "manual_retry" else action
                        for action in actions)
    if "storage_unavailable" in blockers:
        actions = tuple(action for action in actions if action in _WITHOUT_STORAGE)
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


def _failed_availability(rec: OperationRecord) -> Availability:
    match rec.failure_reason:
        case "exhausted" | "token_budget_exhausted" | "cost_budget_exhausted":
            return "exhausted"
        case "authentication_required":
            return "authentication_required"
        case "expired":
            return "expired"  # the recovery sweep ended it after expires_at
        case _:
            return "failed"  # including interrupted, owner_lost and no_worker


def _state_and_availability(
    rec: OperationRecord, phase: str, *, now: float, lease_live: bool
) -> tuple[State, Availability]:
    """The operation's state and, before blockers, its availability."""
    # Reattachment: an attempt that can still be resumed by its saved response id needs no
    # budget (a reattachment is not a new attempt): executing it again resumes it.
    resumable = reattach_target(rec) is not None
    spent = (
        rec.attempts_remaining == 0 or rec.token_budget_spent or rec.cost_budget_spent
    ) and not resumable
    if phase == "superseded":  # terminal; its completion, if any, is gone
        return "superseded", "superseded"
    if phase == "completed" or (rec.has_completion and phase != "cancelled"):
        return "completed", "completion_saved"
    match phase:
        case "cancelled":
            return "cancelled", "permanently_cancelled"
        case "failed":
            return "failed", _failed_availability(rec)
        case "suspended":
            return "suspended", "exhausted" if spent else "suspended"
        case "authorizing" | "transmitting" | "waiting" if lease_live:
            return "running", "waiting" if phase == "waiting" else "running"
        case "prepared":
            return "prepared", "ready"
    # authorizing / transmitting / waiting with no live owner
    if spent:
        return "interrupted", "exhausted"
    if resumable:
        return "interrupted", "replacement_eligible"
    if rec.on_interruption == "fail" and rec.attempts and rec.attempts[-1].outcome == "in_flight":
        # Its interrupted attempt may not be replaced: reopening (or the sweep) ends it.
        return "interrupted", "failed"
    if rec.next_attempt_at is not None and rec.next_attempt_at > now:
        return "interrupted", "waiting"
    return "interrupted", "replacement_eligible" if rec.attempts_used else "ready"


def _summary(attempt: AttemptRecord, lease_live: bool) -> AttemptSummary:
    # An attempt in flight with no live owner can no longer complete: it reads as interrupted.
    in_flight_lost = attempt.outcome == "in_flight" and not lease_live
    return AttemptSummary(
        attempt_id=attempt.attempt_id,
        number=attempt.number,
        reason=attempt.reason,
        outcome="interrupted" if in_flight_lost else attempt.outcome,
        response_id=attempt.response_id,
        sequence_number=attempt.sequence_number,
        failure=attempt.failure,
        usage=attempt.usage,
        reattachments=attempt.reattachments,
        reattached=attempt.reattached,
        server_cancel=attempt.server_cancel,
        not_resumable=attempt.not_resumable,
    )


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
    lease: LeaseRecord | None = None,
) -> Status:
    """Every dimension of the operation, derived from the record (no lease, no I/O).

    ``lease`` is the operation's lease row as the viewer read it; while ``lease_live``,
    its owner and expiry are shown (``lease_owner``, ``lease_expires_at``).

    ``payloads`` are the payload kinds present in the store (``None``: not looked
    at). A missing frozen body (while the operation could still generate) or a
    missing saved completion is the ``storage_unavailable`` blocker.

    ``endpoint_down`` is the viewing runtime's own knowledge that its endpoint cannot
    be connected to (its shared connect backoff); it applies to a live execution.
    """
    if viewer is None or viewer != rec.account:
        return redacted_status(rec.operation_id)
    phase = rec.phase
    if command == "cancel" and not lease_live and phase != "superseded":
        phase = "cancelled"  # a pending cancel nobody has applied yet: already permanent
    blockers: set[Blocker] = set()
    if endpoint_blocked(rec, endpoint_id):
        blockers.add("configuration_unavailable")
    if rec.failure_reason == "authentication_required":
        blockers.add("authentication_required")
    if payloads is not None and not rec.awaiting_upgrade and phase not in (
        "cancelled", "superseded"
    ):
        needed = "completion" if rec.has_completion else "body"
        if needed not in payloads:
            blockers.add("storage_unavailable")
    state, availability = _state_and_availability(rec, phase, now=now, lease_live=lease_live)
    if is_expired(rec, now) and availability in (
        "ready", "waiting", "replacement_eligible", "suspended"
    ):
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
    if (availability in ("exhausted", "failed") and rec.continuation is not None
            and rec.continuation.state == "pending"):
        availability = "continuation_pending"
    last = rec.attempts[-1] if rec.attempts else None
    return Status(
        operation_id=rec.operation_id,
        state=state,
        availability=availability,
        blockers=frozenset(blockers),
        has_saved_completion=rec.has_completion,
        attempts_used=rec.attempts_used,
        maximum_attempts=rec.maximum_attempts,
        attempts_remaining=rec.attempts_remaining,
        next_attempt_at=to_datetime(rec.next_attempt_at),
        expires_at=to_datetime(rec.expires_at),
        root_operation_id=rec.root_operation_id,
        previous_operation_id=rec.previous_operation_id,
        successor_id=rec.retry_reservation.successor_id if rec.retry_reservation else None,
        attempts=tuple(_summary(attempt, lease_live) for attempt in rec.attempts),
        response_id=last.response_id if last else None,
        sequence_number=last.sequence_number if last else None,
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
        maximum_cost_total=rec.maximum_cost_total,
        cost=rec.cost,
        lease_owner=lease.owner_id if lease is not None and lease_live else None,
        lease_expires_at=(
            to_datetime(lease.expires_at) if lease is not None and lease_live else None
        ),
        fence=rec.fence,
        source=rec.source,
        superseded_reason=rec.superseded_reason,
        reattach=rec.reattach,
        reattachments=rec.reattachments,
        reattached=last is not None and last.reattached,
        continuation=_continuation(rec),
    )


def _continuation(rec: OperationRecord) -> ContinuationStatus | None:
    """The continuation decided for this failed operation, as a host sees it."""
    decided = rec.continuation
    if decided is None:
        return None
    return ContinuationStatus(
        state=decided.state,
        reason=decided.reason,
        due_at=to_datetime(decided.due_at) if decided.state == "pending" else None,
        # What the lineage may still use: a dispatched continuation is spent already.
        budget_left=max(0, decided.budget - rec.continuations_used
                        - (1 if decided.state == "dispatched" else 0)),
        successor_id=decided.successor_id,
    )
