"""The operation actor's core: its lease, its fenced writes, and its interruptible steps.

``OperationCore`` holds what every step of an execution shares: taking and giving back
the lease (``_acquire``/``_release``), the one rule of the machine (``_persist``: write
the returned record fenced by the lease generation, THEN act; ``_advance``: recompute a
step when a lifecycle command arrived meanwhile), and running a step that may block
inside the monitor's cancel scope (``_interruptible``, ``_on_stop``). Sending an attempt
is ``actors/transmit.py``; the loop over the machine's actions is ``actors/operation.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from recoverable import _killpoints, errors, machine
from recoverable.actors import fenced
from recoverable.actors.heartbeat import ExecutionLease
from recoverable.actors.host import OperationHost
from recoverable.actors.monitor import Watch
from recoverable.contract import ResponseContract
from recoverable.outcome import Completed, Interruption
from recoverable.records import CommandKind, LeaseRecord, OperationRecord
from recoverable.storage.migration import upgrade_operation
from recoverable.types import Attempt

Authorize = Callable[[Attempt], Awaitable[bool] | bool]
ValueT = TypeVar("ValueT")


class Cut:
    """An interruptible step was cut by the monitor (a command, a sign-out, an account
    change): what :meth:`OperationActor._interruptible` returns instead of a value."""


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


class OperationCore:
    def __init__(
        self,
        host: OperationHost,
        operation_id: str,
        contract: ResponseContract,
        authorize: Authorize,
    ) -> None:
        self.host = host
        self.operation_id = operation_id
        self.contract = contract
        self.authorize = authorize
        self.lease: LeaseRecord | None = None
        self.record: OperationRecord | None = None
        self.watch: Watch | None = None
        self.fence = 0  # the generation fence of our acquisition (checked by every write)
        self.known_serial = 0  # commands up to this serial are accounted for in the record
        self._payload: bytes | None = None
        self._body: bytes | None = None  # the frozen body, read with the lease
        self.guard = ExecutionLease(host.leases)  # heartbeat-kept; its loss stops this actor
        self._sending: Sending | None = None  # the attempt being sent (for an honest close)
        self.checkpoint_writes = 0  # reattachment checkpoints written

    # --- lease ----------------------------------------------------------------------

    async def _acquire(self, open_step: fenced.OpenStep) -> machine.Transition:
        """Take the lease and persist the opening transition (``fenced.acquire``)."""
        op_id = self.operation_id
        try:
            opened = await self.host.store.write(fenced.Acquisition(
                op_id, self.host.now(), open_step, False, self.host.leases.lease_seconds
            ), touches=(op_id,))
        except fenced.NeedsUpgrade:
            # A version-1 record: rewrite it as current (lazily, once), then take the lease.
            backend = self.host.backend
            if backend is not None:
                await upgrade_operation(self.host.store, op_id, endpoint_id=backend.endpoint_id)
            # If it could not be upgraded: still readable, never sent.
            opened = await self.host.store.write(fenced.Acquisition(
                op_id, self.host.now(), open_step, True, self.host.leases.lease_seconds
            ), touches=(op_id,))
        opening = opened.transition
        self._body = opened.body
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

    async def _release(self) -> None:
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

    # --- persistence ----------------------------------------------------------------

    def _ctx(self, command: CommandKind | None = None) -> machine.Context:
        credentials = self.host.backend.credentials if self.host.backend is not None else None
        return machine.Context(
            now=self.host.now(),
            account=self.host.account,
            credentials_account=credentials.account if credentials is not None else None,
            endpoint_id=self.host.backend.endpoint_id if self.host.backend is not None else None,
            command=command,
        )

    async def _persist(
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

    async def _advance(
        self,
        step: Callable[[CommandKind | None], machine.Transition],
        *,
        completion: bytes | None = None,
    ) -> machine.Transition:
        """Compute a transition and persist it; if a lifecycle command arrived meanwhile,
        recompute the same step with that command (the check is atomic with the write)."""
        assert self.watch is not None
        transition = step(self.watch.command)
        try:
            transition = await self._persist(
                transition,
                completion=completion if fenced.saves(transition) else None,
                release=fenced.ends(transition),
            )
        except fenced.CommandArrived as arrived:
            self.known_serial = arrived.serial
            self.watch.observe(arrived.kind, arrived.serial)
            transition = step(self.watch.command)
            transition = await self._persist(
                transition,
                completion=completion if fenced.saves(transition) else None,
                check_commands=False,
                release=fenced.ends(transition),
            )
        if self.watch.command_serial is not None:
            self.known_serial = max(self.known_serial, self.watch.command_serial)
        return transition

    def _watch(self) -> Watch:
        """The monitor's watch of this execution (it exists once the lease is taken)."""
        assert self.watch is not None
        return self.watch

    def _approved(
        self, record: OperationRecord, attempt_id: str, command: CommandKind | None
    ) -> machine.Transition:
        return machine.authorization_answered(record, attempt_id, True, self._ctx(command))

    def _wake(self, current: OperationRecord, command: CommandKind | None) -> machine.Transition:
        return machine.wake(current, self._ctx(command))

    async def _interruptible(self, work: Awaitable[ValueT]) -> ValueT | Cut:
        """Run ``work`` inside the monitor's scope; ``CUT`` if a lifecycle command, a
        sign-out or an account change cut it."""
        with self._watch().fresh_scope():
            return await work
        return CUT

    async def _on_stop(self, current: OperationRecord) -> machine.Transition:
        """The watch's scope was cancelled: by a lifecycle command, or by the runtime's
        sign-out / account change (a command, when both, decides)."""
        watch = self._watch()
        kind = watch.command
        if kind is not None:
            return await self._advance(lambda _: machine.command_observed(current, kind))
        code = watch.account_stop
        assert code is not None
        self.host.telemetry.emit("operation.account_stopped", self.operation_id, reason=code)
        return await self._advance(
            lambda command: machine.account_stopped(current, code, self._ctx(command))
        )
