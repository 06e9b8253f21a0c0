"""The machine's vocabulary: which events apply in which phases, the actions a step
returns, and the small record edits every step shares.

:data:`EVENT_PHASES` is the rule table of ``recoverable.machine``: an event fed in a
phase outside it raises :class:`InvalidTransition` (:func:`require_phase` is the one
check). Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal, get_args

import attrs
import msgspec

from recoverable import errors
from recoverable.outcome import Interruption
from recoverable.records import AttemptRecord, CommandKind, OperationRecord, PendingAttempt, Phase
from recoverable.types import AccountBinding, Attempt


class InvalidTransition(RuntimeError):
    """An event was fed to the machine in a phase where it has no meaning (a bug)."""


# --- the rules as data -------------------------------------------------------------

Event = Literal[
    "open",  # send_recovering took the lease
    "wake",  # the persisted next_attempt_at was reached
    "authorization_answered",  # the host approved or denied the pending attempt
    "authorization_failed",  # a worker's standing authorization policy did not answer
    "endpoint_unreachable",  # connecting for the approved attempt failed; nothing sent
    "endpoint_given_up",  # ... and kept failing past the runtime's bound; nothing sent
    "credentials_unavailable",  # renewal for a 401 reissue failed; nothing sent
    "progress",  # response id / cursor of the attempt in flight
    "checkpoint",  # the fenced reattachment checkpoint of the attempt in flight
    "completion_validated",  # the attempt in flight completed with a valid output
    "attempt_failed",  # the attempt in flight ended without a usable completion
    "account_stopped",  # the runtime signed out or changed account
    "interrupted_locally",  # the owning task was cancelled
    "command_observed",  # a lifecycle command reached the live execution
    "command_on_idle",  # a lifecycle command for a record no execution owns
    "owner_lost",  # the recovery sweep found no live owner (dead process, expired lease)
    "unclaimed",  # the recovery sweep found it runnable and unclaimed past its bound
]

EVERY_PHASE: Final[frozenset[Phase]] = frozenset(get_args(Phase))

# Which events apply in which phases; any other pair raises InvalidTransition.
EVENT_PHASES: Final[Mapping[Event, frozenset[Phase]]] = {
    "open": EVERY_PHASE,
    "wake": frozenset({"waiting"}),
    "authorization_answered": frozenset({"authorizing"}),
    "authorization_failed": frozenset({"authorizing"}),
    "endpoint_unreachable": frozenset({"authorizing"}),
    "endpoint_given_up": frozenset({"authorizing"}),
    "credentials_unavailable": frozenset({"authorizing"}),
    "progress": frozenset({"transmitting"}),
    "checkpoint": frozenset({"transmitting"}),
    "completion_validated": frozenset({"transmitting"}),
    "attempt_failed": frozenset({"transmitting"}),
    "account_stopped": EVERY_PHASE,
    "interrupted_locally": EVERY_PHASE,
    "command_observed": EVERY_PHASE,
    "command_on_idle": EVERY_PHASE,
    # Changes only an owned phase (OWNED); in any other phase it is a no-op, so the
    # sweep may apply it to its own result (idempotent).
    "owner_lost": EVERY_PHASE,
    "unclaimed": EVERY_PHASE,  # changes only prepared/waiting; a no-op elsewhere
}

# The phases a live execution drives: only these can be left behind by a lost owner.
OWNED: Final[frozenset[Phase]] = frozenset({"authorizing", "transmitting", "waiting"})

# Phases no event leaves (a suspend or an account change leaves them as they are).
FINISHED: Final[frozenset[Phase]] = frozenset(
    {"completed", "failed", "cancelled", "superseded"}
)


def require_phase(event: Event, rec: OperationRecord) -> None:
    """The one check of :data:`EVENT_PHASES`."""
    if rec.phase not in EVENT_PHASES[event]:
        raise InvalidTransition(f"{event} in phase {rec.phase}")


def require_pending(event: Event, rec: OperationRecord, attempt_id: str) -> PendingAttempt:
    """An event about the pending attempt: it must be the one being authorized."""
    require_phase(event, rec)
    if rec.pending is None or rec.pending.attempt_id != attempt_id:
        raise InvalidTransition(f"{event} for {attempt_id} in phase {rec.phase}")
    return rec.pending


def require_in_flight(event: Event, rec: OperationRecord, attempt_id: str) -> AttemptRecord:
    """An event about the attempt in flight: it must be the last one, still in flight."""
    require_phase(event, rec)
    if not rec.attempts:
        raise InvalidTransition(f"{event} in phase {rec.phase} with no attempt")
    last = rec.attempts[-1]
    if last.attempt_id != attempt_id or last.outcome != "in_flight":
        raise InvalidTransition(f"{event} for {attempt_id}, in flight: {last.attempt_id}")
    return last


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


@attrs.frozen
class Reattach:
    """Reattachment: resume the attempt's saved background response: a GET of its events after
    ``after`` (or of its final state). No new POST, no authorization, no budget; the
    attempt is in flight again and its reattachment is counted (``reattachment.py``)."""

    attempt_id: str
    response_id: str
    after: int | None


Action = AskHost | Transmit | WaitUntil | Deliver | Stop | Reattach


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


def moved(old: OperationRecord, new: OperationRecord, action: Action | None) -> Transition:
    return Transition(new, action, new != old)


def stopped(old: OperationRecord, new: OperationRecord, error: errors.RecoveryError) -> Transition:
    return Transition(new, Stop(error), new != old)


def attempt_id_for(operation_id: str, number: int) -> str:
    """Attempt ids are derived, so they are stable across callback replays and crashes."""
    return f"{operation_id}.{number}"


def evolve(rec: OperationRecord, **changes: object) -> OperationRecord:
    return msgspec.structs.replace(rec, **changes)


# --- record edits every step shares ---------------------------------------------


def idle_phase(rec: OperationRecord) -> Phase:
    """Where a record rests between executions: waiting once an attempt was spent."""
    return "waiting" if rec.attempts_used else "prepared"


def with_last_attempt(
    rec: OperationRecord, attempt: AttemptRecord, **changes: object
) -> OperationRecord:
    return evolve(rec, attempts=(*rec.attempts[:-1], attempt), **changes)


def close_in_flight(rec: OperationRecord, code: str) -> OperationRecord:
    """The one way an attempt still marked in flight is closed without a result: it stays
    spent and becomes an interruption (kind ``interrupted``, ``transport_code=code``)."""
    if not rec.attempts or rec.attempts[-1].outcome != "in_flight":
        return rec
    last = rec.attempts[-1]
    failure = Interruption(
        kind="interrupted",
        response_id=last.response_id,
        sequence_number=last.sequence_number,
        transport_code=code,
    )
    closed = msgspec.structs.replace(last, outcome="interrupted", failure=failure)
    return with_last_attempt(rec, closed, last_failure=failure)


def close_interrupted(rec: OperationRecord, code: str) -> OperationRecord:
    """:func:`close_in_flight`, then the operation's interruption policy: with
    ``on_interruption="fail"`` an attempt closed here ends the operation ``failed``
    (``failure_reason="interrupted"``), never replaced. With "replace" (the default), or
    when nothing was in flight, the record is only closed."""
    closed = close_in_flight(rec, code)
    if closed is rec or rec.on_interruption != "fail":
        return closed
    return interrupted_failure(closed)


def interrupted_failure(rec: OperationRecord) -> OperationRecord:
    """The terminal record of an interruption under ``on_interruption="fail"``."""
    return evolve(rec, phase="failed", failure_reason="interrupted", pending=None,
                  next_attempt_at=None, renew_next=False)


def interrupted_error(rec: OperationRecord) -> errors.PermanentlyFailed:
    """What an execution stopped by :func:`interrupted_failure` raises."""
    return errors.PermanentlyFailed(
        "interrupted", operation_id=rec.operation_id, last_failure=rec.last_failure
    )
