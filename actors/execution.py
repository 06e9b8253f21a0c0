"""One execution of an operation: its lease, its fence, and the one write rule.

An :class:`Execution` is what every step of an operation's execution shares: taking and
giving back the lease (:meth:`~Execution.acquire`, :meth:`~Execution.release`), the one
rule of the machine (:meth:`~Execution.persist`: write the returned record fenced by the
lease generation, THEN act; :meth:`~Execution.advance`: the single choke point every
step's transition goes through, recomputed when a lifecycle command arrived meanwhile),
and running a step that may block inside the monitor's cancel scope
(:meth:`~Execution.interruptible`, :meth:`~Execution.on_stop`).

The steps are plain functions that take the execution: asking the host
(``actors/authorize.py``), sending an approved attempt (``actors/send.py``), resuming a
background response (``actors/reattach.py``, with its checkpoints in
``actors/checkpoint.py``) and delivering the receipt (``actors/deliver.py``). The loop
over the machine's actions that calls them is ``actors/operation.py``. An execution is a
supervised Trio actor: it runs as a task of the runtime's supervisor nursery
(``actors/supervisor.py``) and sees the runtime only through
:class:`~recoverable.actors.host.OperationHost`.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TypeVar

import attrs
import trio

from recoverable import _killpoints, errors, machine
from recoverable.actors import fenced
from recoverable.actors.heartbeat import ExecutionLease, lease_lost_transition
from recoverable.actors.host import Authorize, OperationHost
from recoverable.actors.live import LiveSlot
from recoverable.actors.monitor import Watch
from recoverable.actors.prepare import emit_prepared
from recoverable.contract import ResponseContract
from recoverable.outcome import Completed, Interruption
from recoverable.records import CommandKind, LeaseRecord, OperationRecord
from recoverable.storage.migration import upgrade_operation

ValueT = TypeVar("ValueT")

__all__ = ["CUT", "Authorize", "Cut", "Execution", "Sending"]


class Cut:
    """An interruptible step was cut by the monitor (a command, a sign-out, an account
    change): what :meth:`Execution.interruptible` returns instead of a value."""


CUT = Cut()


class Sending:
    """One connect-and-send try, as its callbacks fill it in."""

    def __init__(self, ticket: int) -> None:
        self.ticket = ticket  # the endpoint gate's admission
        self.reported = False  # the connection was reported to the gate
        self.consumed: machine.Transition | None = None  # the attempt, consumed (persisted)
        self.result: Completed | Interruption | None = None  # how the stream ended
        self.progressed = False  # a progress report arrived
        self.response_id: str | None = None
        self.sequence_number: int | None = None
        self.background: bool | None = None  # ``Progress.background``


@attrs.define(eq=False, weakref_slot=False)
class Execution:
    """One execution of an operation: the lease it holds, the fence its writes carry, the
    record as last written, and the monitor's watch of it. (Slots, no ``__dict__``: one
    object less for each operation a runtime holds.)"""

    host: OperationHost
    operation_id: str
    contract: ResponseContract
    authorize: Authorize
    # The authorization callback is a standing policy with no caller to tell (a
    # detached execution: a worker's): a failure of it is saved as the failure.
    standing_policy: bool = attrs.field(default=False, kw_only=True)
    # A live operation's consumer (None for every other execution): the text deltas
    # of each consumed attempt go to it, never to the store.
    live: LiveSlot | None = attrs.field(default=None, kw_only=True)
    # What the opening transition checks (``open_step``).
    expected_contract_version: str | None = attrs.field(default=None, kw_only=True)
    check_contract_version: bool = attrs.field(default=False, kw_only=True)
    # A new operation this execution creates in its acquisition
    # (``actors/prepare_send.py``); let go once written.
    create: fenced.Creation | None = attrs.field(default=None, kw_only=True)
    lease: LeaseRecord | None = attrs.field(default=None, init=False)
    record: OperationRecord | None = attrs.field(default=None, init=False)
    watch: Watch | None = attrs.field(default=None, init=False)
    # The generation fence of our acquisition (checked by every write).
    fence: int = attrs.field(default=0, init=False)
    # Commands up to this serial are accounted for in the record.
    known_serial: int = attrs.field(default=0, init=False)
    payload: bytes | None = attrs.field(default=None, init=False)  # the saved completion
    body: bytes | None = attrs.field(default=None, init=False)  # the frozen body, with the lease
    # Heartbeat-kept; its loss stops the run.
    guard: ExecutionLease = attrs.field(init=False)
    # The attempt being sent (for an honest close).
    sending: Sending | None = attrs.field(default=None, init=False)
    checkpoint_writes: int = attrs.field(default=0, init=False)  # reattachment checkpoints
    # (attempt id, resume tries of it started by this execution): spaces the next one.
    resume_tries: tuple[str, int] = attrs.field(default=("", 0), init=False)

    @guard.default
    def _guard(self) -> ExecutionLease:
        return ExecutionLease(self.host.leases)

    # --- lease ----------------------------------------------------------------------

    async def acquire(self) -> machine.Transition:
        """Take the lease and persist the opening transition (``fenced.acquire``); an
        execution that creates its operation (``create``) writes it in the same
        transaction (``fenced.JobAdopted`` when another already stands for its job)."""
        op_id = self.operation_id
        create = self.create
        try:
            if create is None:
                opened = await self.host.store.write(fenced.Acquisition(
                    op_id, self.host.now(), self.open_step, False,
                    self.host.leases.lease_seconds,
                ), touches=(op_id,))
            else:
                opened = await self._create_and_acquire(create)
                self.create = None  # written: its body and request are the store's now
        except fenced.NeedsUpgrade:
            # A version-1 record: rewrite it as current (lazily, once), then take the lease.
            backend = self.host.backend
            if backend is not None:
                await upgrade_operation(self.host.store, op_id, endpoint_id=backend.endpoint_id)
            # If it could not be upgraded: still readable, never sent.
            opened = await self.host.store.write(fenced.Acquisition(
                op_id, self.host.now(), self.open_step, True, self.host.leases.lease_seconds
            ), touches=(op_id,))
        opening = opened.transition
        self.body = opened.body
        self.fence = opened.lease.fence if opened.lease is not None else 0
        self.lease = None if opened.final else opened.lease
        if self.lease is not None:
            self.guard.hold(self.lease)
        self.record = opening.record
        self.known_serial = opened.serial
        self.watch = self.host.monitor.watch(op_id, opened.serial, opening.record.account)
        current_account = self.host.account
        if current_account != opening.record.account:
            # Signed out (or switched) after the acquisition checked the account and
            # before this watch existed: stop as if the change came a moment later.
            self.watch.stop_for_account(
                "signed_out" if current_account is None else "account_changed"
            )
        return opening

    async def _create_and_acquire(self, create: fenced.Creation) -> fenced.Opened:
        """Prepare and acquire in one write: the operation, its lease and its opening
        transition (the pending attempt id) are saved together."""
        record = create.record
        _killpoints.hit("prepare.before_save")
        opened = await self.host.store.write(fenced.Acquisition(
            self.operation_id, self.host.now(), self.open_step, False,
            self.host.leases.lease_seconds, create,
        ), touches=(record,))
        _killpoints.hit("prepare.saved")
        emit_prepared(self.host.telemetry, record)
        return opened

    def open_step(
        self, record: OperationRecord, cancel: CommandKind | None, body_available: bool
    ) -> machine.Transition:
        """The opening transition, run inside the acquisition's transaction (a bound
        method, not a closure: no cells per execution to collect)."""
        return machine.open_operation(
            record,
            attrs.evolve(self.context(cancel), body_available=body_available),
            format_hash=self.contract.format_hash,
            expected_contract_version=self.expected_contract_version,
            check_contract_version=self.check_contract_version,
        )

    async def release(self) -> None:
        self.guard.drop()
        if self.watch is not None:
            self.host.monitor.unwatch(self.watch)
        lease = self.lease
        if lease is None:
            return
        self.lease = None
        with trio.CancelScope(shield=True):
            try:
                await self.host.store.write(
                    functools.partial(fenced.release, self.operation_id, lease.token),
                    touches=(self.operation_id,),
                )
            except errors.RecoveryError:
                # The lease row names this process; it dies with this store's owner lock.
                pass

    async def lease_lost(self) -> errors.LeaseLost:
        """The lease expired or was taken over: close an in-flight attempt honestly and give
        the lease back, both fenced (refused if a newer owner exists), then stop."""
        if self.record is not None and self.lease is not None:
            closing = lease_lost_transition(self.record, self.context(), self.sending)
            with trio.CancelScope(shield=True):
                try:
                    await self.persist(closing, check_commands=False, release=True)
                except errors.RecoveryError:
                    pass  # a newer owner's fence: nothing of this execution is written
        self.host.telemetry.emit("operation.lease_lost", self.operation_id)
        return errors.LeaseLost(operation_id=self.operation_id)

    async def suspend_on_cancel(self) -> None:
        """Trio cancellation of the execution's task suspends the operation (budget kept)."""
        record = self.record
        if record is None or self.lease is None:
            return
        with trio.CancelScope(shield=True):
            try:
                # The task's cancellation stands for a suspend; a permanent cancel seen
                # as it went away wins (a cancel is never downgraded).
                seen = self.watch.command if self.watch is not None else None
                stop = machine.command_observed(record, machine.merge_command(seen, "suspend"))
                await self.persist(stop, check_commands=False, release=True)
                self.host.telemetry.emit("operation.suspended", self.operation_id)
            except errors.RecoveryError:
                pass  # the lease dies with us; a stale in-flight attempt reads as interrupted

    # --- persistence ----------------------------------------------------------------

    def context(self, command: CommandKind | None = None) -> machine.Context:
        credentials = self.host.backend.credentials if self.host.backend is not None else None
        return machine.Context(
            now=self.host.now(),
            account=self.host.account,
            credentials_account=credentials.account if credentials is not None else None,
            endpoint_id=self.host.backend.endpoint_id if self.host.backend is not None else None,
            command=command,
        )

    async def persist(
        self,
        transition: machine.Transition,
        *,
        completion: bytes | None = None,
        check_commands: bool = True,
        release: bool = False,
    ) -> machine.Transition:
        """Write the transition fenced by our lease; refuse if an unseen command arrived.

        With ``release`` the lease goes in the same transaction (the execution ends).
        Returns the transition written (a source-bound completion refused by the
        manifest comes back as the ``superseded`` transition written instead).
        """
        lease = self.lease if release else None
        if not transition.changed and completion is None and lease is None:
            return transition
        write = fenced.FencedWrite(
            operation_id=self.operation_id,
            transition=transition,
            fence=self.fence,
            known_serial=self.known_serial,
            check_commands=check_commands,
            completion=completion,
            release_token=lease.token if lease is not None else None,
            now=self.host.now(),
        )
        if lease is not None:
            # The write that releases the lease ends the execution: the heartbeat lets go
            # of it first, so that a renewal racing with it never reads the row it deletes
            # as a lease taken over (and stops this execution at its very end). No stream
            # runs now; if the write is late past the expiry, its fence still decides.
            self.guard.drop()
        try:
            persisted = await self.host.store.write(  # the write is the mutation
                write, touches=(self.operation_id,)
            )
        except errors.FenceMismatch as exc:
            raise errors.LeaseLost(
                "a newer owner took the operation over", operation_id=self.operation_id
            ) from exc
        written, decided = persisted.transition, persisted.continuation
        if decided is not None:  # a continuation was decided for this failure
            _killpoints.hit("continuation.decided")
            self.host.telemetry.emit(
                "continuation.scheduled" if decided.state == "pending" else "continuation.declined",
                self.operation_id, reason=decided.reason, due_at=decided.due_at,
                budget_left=max(0, decided.budget - transition.record.continuations_used),
            )
        self.record = written.record
        if lease is not None:
            self.lease = None
        return written

    async def advance(
        self,
        step: Callable[[CommandKind | None], machine.Transition],
        *,
        completion: bytes | None = None,
    ) -> machine.Transition:
        """Compute a transition and persist it; if a lifecycle command arrived meanwhile,
        recompute the same step with that command (the check is atomic with the write).
        Every step's transition goes through here."""
        watch = self.watching()
        transition = step(watch.command)
        try:
            transition = await self.persist(
                transition,
                completion=completion if fenced.saves(transition) else None,
                release=fenced.ends(transition),
            )
        except fenced.CommandArrived as arrived:
            self.known_serial = arrived.serial
            watch.observe(arrived.kind, arrived.serial)
            transition = step(watch.command)
            transition = await self.persist(
                transition,
                completion=completion if fenced.saves(transition) else None,
                check_commands=False,
                release=fenced.ends(transition),
            )
        if watch.command_serial is not None:
            self.known_serial = max(self.known_serial, watch.command_serial)
        return transition

    def watching(self) -> Watch:
        """The monitor's watch of this execution (it exists once the lease is taken)."""
        assert self.watch is not None
        return self.watch

    def approved(
        self, record: OperationRecord, attempt_id: str, command: CommandKind | None
    ) -> machine.Transition:
        """The host approved ``attempt_id``: consume it (or stop, when a recheck refuses)."""
        return machine.authorization_answered(record, attempt_id, True, self.context(command))

    def wake(self, current: OperationRecord, command: CommandKind | None) -> machine.Transition:
        return machine.wake(current, self.context(command))

    # --- interruptible steps --------------------------------------------------------

    async def interruptible(self, work: Awaitable[ValueT]) -> ValueT | Cut:
        """Run ``work`` inside the monitor's scope; ``CUT`` if a lifecycle command, a
        sign-out or an account change cut it."""
        with self.watching().fresh_scope():
            return await work
        return CUT

    async def on_stop(self, current: OperationRecord) -> machine.Transition:
        """The watch's scope was cancelled: by a lifecycle command, or by the runtime's
        sign-out / account change (a command, when both, decides)."""
        watch = self.watching()
        kind = watch.command
        if kind is not None:
            return await self.advance(lambda _: machine.command_observed(current, kind))
        code = watch.account_stop
        assert code is not None
        self.host.telemetry.emit("operation.account_stopped", self.operation_id, reason=code)
        return await self.advance(
            lambda command: machine.account_stopped(current, code, self.context(command))
        )
