"""The transactions of one execution: take the lease, write fenced, release.

Named transaction functions run by ``store.write`` for an operation's execution:
:func:`acquire` takes the operation's lease and persists the opening transition in one
transaction; :func:`persist` writes a transition fenced by the lease's generation and
refuses (:class:`CommandArrived`) when a lifecycle command the step did not account
for has arrived; :func:`release` gives the lease back.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from recoverable import errors, machine
from recoverable.actors.checks import check_disposition
from recoverable.actors.continuation import decide_on_failure
from recoverable.actors.prepare import create_operation
from recoverable.records import CommandKind, ContinuationRecord, LeaseRecord, OperationRecord
from recoverable.sources_rules import receipt_refusal, supersede, superseded_error
from recoverable.storage.base import WriteTransaction as WriteTxn
from recoverable.storage.integrity import verify_body
from recoverable.storage.leases import acquire_lease, release_lease
from recoverable.types import SupersededReason

OpenStep = Callable[[OperationRecord, CommandKind | None, bool], machine.Transition]


class NeedsUpgrade(Exception):
    """Raised inside the acquisition: the record is an unmigrated version-1 record."""


class JobAdopted(Exception):
    """Raised inside an acquisition that was to create its operation (:class:`Creation`):
    another operation already stands for the job (prepared by another process meanwhile);
    nothing was written, and the caller sends that one instead."""

    def __init__(self, operation_id: str) -> None:
        super().__init__(operation_id)
        self.operation_id = operation_id


class CommandArrived(Exception):
    """Raised inside a write transaction: a lifecycle command the step did not account for."""

    def __init__(self, kind: CommandKind, serial: int) -> None:
        super().__init__(kind)
        self.kind = kind
        self.serial = serial


def ends(transition: machine.Transition) -> bool:
    """The transition ends this execution: its write also releases the lease."""
    return isinstance(transition.action, (machine.Deliver, machine.Stop))


def saves(transition: machine.Transition) -> bool:
    """The transition saves the validated completion (its payload goes in the same write)."""
    return transition.record.has_completion and transition.record.phase == "completed"


class Opened(msgspec.Struct, frozen=True, gc=False):
    """What :func:`acquire` took and decided.

    The per-write values of this module (``Opened``, :class:`FencedWrite`,
    :class:`Persisted`) are ``gc=False`` structs: one of each is alive per write in flight,
    and nothing they hold refers back to them (no cycle), so the collector need not walk
    them."""

    lease: LeaseRecord | None  # None: read as it is, without a lease (see acquire)
    transition: machine.Transition
    serial: int  # commands up to this serial are accounted for in the record
    final: bool  # the opening ends the execution: the lease is already released
    body: bytes | None


class Creation(msgspec.Struct, frozen=True, gc=False):
    """A new operation an acquisition creates first, in the same transaction: what
    ``prepare`` would have written alone (``actors/prepare.py``, ``new_admission``)."""

    record: OperationRecord
    body: bytes
    stored: bytes


class Acquisition(msgspec.Struct, frozen=True, gc=False):
    """The mutation of :func:`acquire`, handed to ``store.write`` as is (no
    ``functools.partial`` with its keywords dict per execution; untracked by the collector)."""

    operation_id: str
    now: float
    open_step: OpenStep
    upgrade_tried: bool
    lease_seconds: float | None = None
    create: Creation | None = None

    def __call__(self, txn: WriteTxn) -> Opened:
        if self.create is not None:
            create = self.create
            chosen = create_operation(create.record, create.body, create.stored, txn)
            if chosen is not create.record:
                raise JobAdopted(chosen.operation_id)  # nothing of ours was written
        return acquire(self.operation_id, self.now, self.open_step, self.upgrade_tried, txn,
                       lease_seconds=self.lease_seconds)


def acquire(
    operation_id: str,
    now: float,
    open_step: OpenStep,
    upgrade_tried: bool,
    txn: WriteTxn,
    *,
    lease_seconds: float | None = None,
) -> Opened:
    """Take the lease and persist the opening transition in ONE transaction.

    A suspend written before this execution is spent (reopening is resuming); a cancel
    is folded into the record. When the opening already ends the execution (a saved
    receipt to deliver, a terminal state), the lease is released in the same transaction.
    """
    check_disposition(txn, operation_id)
    stored = txn.get_operation(operation_id)
    if stored is not None and stored.awaiting_upgrade:
        if not upgrade_tried:
            raise NeedsUpgrade
        # It could not be upgraded here (no backend, or its request cannot be frozen).
        # Read it as it is: no lease, no write, since rewriting it would drop the
        # version-1 fields (its request parts, its inline completion). Nothing can
        # generate for it, so a saved completion is delivered and everything else stops
        # (a pending cancel still fences delivery).
        pending = txn.get_command(operation_id)
        cancel: CommandKind | None = (
            "cancel" if pending is not None and pending.kind == "cancel" else None
        )
        return Opened(None, open_step(stored, cancel, False), 0, True, None)
    lease = acquire_lease(txn, operation_id, now, lease_seconds=lease_seconds)
    record = txn.get_operation(operation_id)
    assert record is not None
    if record.phase == "suspended":
        # Claimed with the lease, in one commit: no moment in which it is neither marked
        # for the next worker nor held (a waiter would read "suspended from outside"),
        # and a later suspension by a host is not resumed by a worker.
        txn.spend_resume_mark(operation_id)
    body = txn.get_payload(operation_id, "body")
    if body is not None:  # a tampered body is a corrupt record: never sent
        verify_body(operation_id, record.body_hash, body)
    command = txn.get_command(operation_id)
    serial = 0
    kind: CommandKind | None = None
    if command is not None:
        serial = command.serial
        if command.kind == "suspend":
            txn.delete_command(operation_id)  # spent: reopening is resuming
        else:
            kind = command.kind
    opening = open_step(record, kind, body is not None)  # a missing body: before the host
    if opening.changed:
        if kind is not None and opening.record.phase in ("cancelled", "superseded"):
            txn.delete_command(operation_id)  # folded into the record's phase
        txn.put_operation(opening.record, expect_fence=lease.fence)
    final = ends(opening)
    if final:
        release_lease(txn, operation_id, lease.token)
    return Opened(lease, opening, serial, final, body)


class FencedWrite(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One write of an execution: a transition, fenced by the lease's generation.

    It is itself the mutation handed to ``store.write`` (calling it runs :func:`persist`):
    no ``functools.partial`` per write."""

    operation_id: str
    transition: machine.Transition
    fence: int
    known_serial: int  # commands up to this serial are accounted for
    check_commands: bool  # refuse (CommandArrived) if a newer command arrived
    completion: bytes | None = None  # the validated completion, saved with the record
    release_token: str | None = None  # the execution ends: release the lease too
    # The writer's wall clock: a record that ends ``failed`` here gets its
    # continuation decided in this same write (``actors/continuation.py``)
    now: float | None = None

    def __call__(self, txn: WriteTxn) -> Persisted:
        return persist(self, txn)


def folds(command: CommandKind, record: OperationRecord) -> bool:
    """The record's phase already says what ``command`` says (the command can go).

    A suspended record stands for a suspend, a cancelled one for a cancel; a command
    is folded when merging it under what the record stands for changes nothing — so a
    cancel is folded only into a cancelled record, never lost into a suspension.
    """
    if record.phase not in ("suspended", "cancelled"):
        return False
    stands: CommandKind = "cancel" if record.phase == "cancelled" else "suspend"
    return machine.merge_command(command, stands) == stands


class Persisted(msgspec.Struct, frozen=True, gc=False):
    """What :func:`persist` wrote: the transition with the record as written (a source-bound
    completion refused becomes the ``superseded`` transition; a record ending
    ``failed`` carries its continuation decision), and that decision, if any."""

    transition: machine.Transition
    continuation: ContinuationRecord | None = None


def persist(write: FencedWrite, txn: WriteTxn) -> Persisted:
    """Write the transition's record fenced by our lease (see :class:`FencedWrite`).

    Returns what was written (:class:`Persisted`): ``write.transition``; for a source-bound
    operation whose completion may not be saved (the manifest no longer holds its digest)
    the ``superseded`` transition written instead (:func:`_refuse_receipt`); and the
    continuation decided for a record that ended ``failed`` here.
    """
    op_id = write.operation_id
    record = write.transition.record
    if record.source is not None:  # a source-bound operation (admission field)
        stored = txn.get_operation(op_id)
        if stored is not None and stored.phase == "superseded":
            # A manifest change superseded it meanwhile (and told us with a cancel
            # command): nothing of this execution is written; the command goes, and the
            # execution stops with the typed error.
            txn.delete_command(op_id)
            if write.release_token is not None:
                release_lease(txn, op_id, write.release_token)
            return Persisted(
                machine.Transition(stored, machine.Stop(superseded_error(stored)), False)
            )
        if write.completion is not None:
            refusal = receipt_refusal(record, txn.get_source(record.source.key))
            if refusal is not None:
                return Persisted(_refuse_receipt(write, refusal, txn))
    command = txn.get_command(op_id)
    if command is not None:
        if write.check_commands and command.serial > write.known_serial:
            raise CommandArrived(command.kind, command.serial)
        if command.serial <= write.known_serial and folds(command.kind, record):
            txn.delete_command(op_id)
    if write.completion is not None:
        txn.put_payload(op_id, "completion", write.completion)
    decided: ContinuationRecord | None = None
    if write.transition.changed or write.completion is not None:
        record, decided = decide_on_failure(txn, record, write.now)
        txn.put_operation(record, expect_fence=write.fence)
    if write.release_token is not None:
        release_lease(txn, op_id, write.release_token)
    if record is write.transition.record:
        return Persisted(write.transition, decided)
    action = write.transition.action
    if decided is not None and isinstance(action, machine.Stop) and isinstance(
        action.error, errors.AttemptsExhausted
    ):
        # The error says what was decided in this write (a pending continuation).
        action = machine.Stop(machine.terminal_error(record))
    return Persisted(machine.Transition(record, action, write.transition.changed), decided)


def _refuse_receipt(
    write: FencedWrite, reason: SupersededReason, txn: WriteTxn
) -> machine.Transition:
    """The manifest no longer holds the bound digest: in the same transaction that would
    have saved the completion, the operation becomes ``superseded`` instead and the
    completion is discarded (never written)."""
    op_id = write.operation_id
    superseded = supersede(write.transition.record, reason)
    txn.put_operation(superseded, expect_fence=write.fence)
    txn.delete_command(op_id)  # nothing left for a command to say
    txn.dequeue(op_id)
    source = superseded.source
    assert source is not None
    txn.unbind_source(source.key, op_id)
    if write.release_token is not None:
        release_lease(txn, op_id, write.release_token)
    return machine.Transition(superseded, machine.Stop(superseded_error(superseded)), True)


def release(operation_id: str, token: str, txn: WriteTxn) -> None:
    release_lease(txn, operation_id, token)
