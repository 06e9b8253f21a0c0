"""Lifecycle commands (suspend, cancel): what a pending or arriving command means.

A cancel is permanent and never downgraded (:func:`merge_command`, said once); a
suspend keeps everything (the request, the spent budget, the cooldown, a saved
completion). The functions here answer each point where the actors meet a command:
opening an execution (:func:`command_at_open`, :func:`command_spent_at_open`), writing
a record (:func:`command_folded`), a host issuing one (:func:`command_to_store`,
:func:`command_on_idle`), the live execution observing one (:func:`command_observed`)
and the caller going away (:func:`caller_cancelled`). Pure; no I/O.
"""

from __future__ import annotations

import attrs

from recoverable import errors
from recoverable.reattachment import reattach_target
from recoverable.records import CommandKind, OperationRecord
from recoverable.sources_rules import superseded_error
from recoverable.transitions import (
    FINISHED,
    Transition,
    close_in_flight,
    close_interrupted,
    evolve,
    interrupted_error,
    moved,
    require_phase,
    stopped,
)


def suspended_record(rec: OperationRecord) -> OperationRecord:
    """Suspension keeps everything; an attempt in flight stays spent and is interrupted.
    Under ``on_interruption="fail"`` that interruption ends the operation instead
    (``failed``, ``interrupted``): a suspension never opens a way to replace it."""
    closed = close_interrupted(rec, "suspended")
    if closed.phase == "failed" and reattach_target(close_in_flight(rec, "suspended")):
        # Reattachment: the attempt can still be resumed by its saved response id (no
        # replacement): resuming the operation reattaches to it first.
        closed = close_in_flight(rec, "suspended")
    return closed if closed.phase == "failed" else evolve(closed, phase="suspended")


def _suspended(rec: OperationRecord, new: OperationRecord) -> Transition:
    """Stop after a suspension: ``OperationSuspended``, or the terminal error when the
    interruption policy ended the operation."""
    if new.phase == "failed" and rec.phase != "failed":
        return stopped(rec, new, interrupted_error(new))
    return stopped(rec, new, errors.OperationSuspended(operation_id=rec.operation_id))


def merge_command(existing: CommandKind | None, new: CommandKind) -> CommandKind:
    """The lifecycle command that stands after ``new`` arrives where ``existing`` stood.

    The one statement of the rule: a cancel is permanent and never downgraded by a later
    suspend; any other command replaces what stood before.
    """
    if existing == "cancel":
        return "cancel"
    return new


def apply_command(rec: OperationRecord, kind: CommandKind) -> Transition:
    """A lifecycle command observed at a checkpoint: suspend keeps everything, cancel fences.
    A superseded record stays as it is: it already fences everything."""
    if rec.phase == "superseded":
        return stopped(rec, rec, superseded_error(rec))
    match kind:
        case "cancel":
            cancelled = evolve(
                close_in_flight(rec, "cancelled"), phase="cancelled", next_attempt_at=None
            )
            return stopped(rec, cancelled, errors.OperationCancelled(operation_id=rec.operation_id))
        case _:
            new = rec if rec.phase in FINISHED else suspended_record(rec)
            return _suspended(rec, new)


def command_on_top(rec: OperationRecord, kind: CommandKind) -> Transition:
    """A command applied on top of a step that already changed the record."""
    return attrs.evolve(apply_command(rec, kind), changed=True)


def command_at_open(pending: CommandKind | None) -> CommandKind | None:
    """The stored command an opening execution applies (``ctx.command`` of
    :func:`open_operation`): a pending suspend is spent by reopening (reopening is
    resuming; the driver deletes its row), a pending cancel stands and fences."""
    match pending:
        case "cancel":
            return "cancel"
        case _:
            return None


def command_spent_at_open(pending: CommandKind | None) -> bool:
    """The stored command row is spent by the opening itself (delete it in the same
    transaction): a suspend, since reopening is resuming. A cancel row stays until a
    cancelled record says it (:func:`command_folded`)."""
    return pending == "suspend"


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
            return rec.phase in ("cancelled", "superseded")
        case _:
            return rec.phase in ("suspended", "cancelled", "superseded")


def cancel_fences(rec: OperationRecord, command: CommandKind | None) -> bool:
    """Nothing may be delivered or read as a receipt: the record is cancelled, or a cancel
    command is pending (it is permanent from the moment it is written)."""
    return rec.phase == "cancelled" or command == "cancel"


def interrupted_locally(rec: OperationRecord) -> Transition:
    """The owning task was cancelled (Trio cancellation, or a suspend command observed).

    Suspension preserves the request, the spent budget, the cooldown and any saved
    completion. An in-flight attempt stays spent and is marked interrupted (under
    ``on_interruption="fail"`` it ends the operation: ``failed``, ``interrupted``).
    """
    require_phase("interrupted_locally", rec)
    new = rec if rec.phase in FINISHED else suspended_record(rec)
    return _suspended(rec, new)


def command_observed(rec: OperationRecord, kind: CommandKind) -> Transition:
    """A lifecycle command reached the live execution (via the monitor or a write check)."""
    require_phase("command_observed", rec)
    match kind:
        case "cancel":
            return apply_command(rec, "cancel")
        case _:
            return interrupted_locally(rec)


def caller_cancelled(rec: OperationRecord, command: CommandKind | None) -> Transition:
    """The owning task was cancelled (Trio cancellation) with ``command`` observed by its
    watch: a permanent cancel seen as the caller went away wins; anything else suspends."""
    match command:
        case "cancel":
            return command_observed(rec, "cancel")
        case _:
            return interrupted_locally(rec)


def command_on_idle(rec: OperationRecord, kind: CommandKind) -> Transition:
    """Apply suspend/cancel directly to a record no live execution owns."""
    require_phase("command_on_idle", rec)
    match kind:
        case "cancel":
            return apply_command(rec, "cancel")
        case _ if rec.phase in FINISHED or rec.phase == "suspended":
            return moved(rec, rec, None)
        case _:
            return moved(rec, suspended_record(rec), None)
