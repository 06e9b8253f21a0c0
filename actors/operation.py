"""The OperationActor: drives one execution of an operation through the machine.

It owns the operation's lease for the whole execution, applies the one rule of
the machine (persist the returned record, fenced by the lease generation, THEN
act), runs every step that may block (the host callback, the stream, a
cooldown) inside the monitor's cancel scope, and releases the lease only after
everything has unwound. It runs as a task of the runtime's supervisor nursery
(``actors/supervisor.py``); a Trio cancellation of that task (its last caller went
away, or the runtime closed) suspends the operation. It sees the runtime only
through :class:`~recoverable.actors.host.OperationHost`; its transactions are the
named functions of ``actors/fenced.py``. Its layers: ``operation_core.py`` (lease,
fenced writes, interruptible steps) → ``transmit.py`` (one attempt's send and outcome)
→ this module (the loop over the machine's actions, the host's answer, delivery).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import attrs
import msgspec
import trio

from recoverable import _killpoints, errors, machine
from recoverable.actors.heartbeat import lease_lost_transition
from recoverable.actors.operation_core import Authorize, Cut
from recoverable.actors.reattach import Reattacher
from recoverable.actors.supervisor import is_cancellation
from recoverable.records import CommandKind, OperationRecord
from recoverable.storage.migration import saved_completion
from recoverable.transport.base import validate_api_key
from recoverable.types import Attempt

__all__ = ["Authorize", "OperationActor"]


class OperationActor(Reattacher):
    """One execution of an operation: the loop over the machine's actions."""

    # The authorization callback is a standing policy with no caller to tell (a detached
    # execution: a worker's): a failure of it is saved as the operation's failure.
    standing_policy: bool = False

    # --- the loop -------------------------------------------------------------------

    async def run(
        self, *, expected_contract_version: str | None, check_contract_version: bool
    ) -> Any:
        self._expected_contract_version = expected_contract_version
        self._check_contract_version = check_contract_version
        try:
            # A bound method, not a closure (no cells per execution to collect).
            opening = await self._acquire(self._open_step)
            try:
                with self.guard.scope:  # cancelled by the heartbeat: the lease is lost
                    return await self._drive(opening)
                raise await self._lease_lost()
            except BaseException as exc:
                if is_cancellation(exc):
                    await self._suspend_on_cancel()
                raise
        finally:
            await self._release()

    # What ``run`` was asked to check at the opening (read by ``_open_step``).
    _expected_contract_version: str | None = None
    _check_contract_version: bool = False

    def _open_step(
        self, record: OperationRecord, cancel: CommandKind | None, body_available: bool
    ) -> machine.Transition:
        """The opening transition, run inside the acquisition's transaction."""
        return machine.open_operation(
            record,
            attrs.evolve(self._ctx(cancel), body_available=body_available),
            format_hash=self.contract.format_hash,
            expected_contract_version=self._expected_contract_version,
            check_contract_version=self._check_contract_version,
        )

    async def _lease_lost(self) -> errors.LeaseLost:
        """The lease expired or was taken over: close an in-flight attempt honestly and give
        the lease back, both fenced (refused if a newer owner exists), then stop."""
        if self.record is not None and self.lease is not None:
            closing = lease_lost_transition(self.record, self._ctx(), self._sending)
            with trio.CancelScope(shield=True):
                try:
                    await self._persist(closing, check_commands=False, release=True)
                except errors.RecoveryError:
                    pass  # a newer owner's fence: nothing of this execution is written
        self.host.telemetry.emit("operation.lease_lost", self.operation_id)
        return errors.LeaseLost(operation_id=self.operation_id)

    async def _suspend_on_cancel(self) -> None:
        """Trio cancellation of the actor's task suspends the operation (budget kept)."""
        record = self.record
        if record is None or self.lease is None:
            return
        with trio.CancelScope(shield=True):
            try:
                # The task's cancellation stands for a suspend; a permanent cancel seen
                # as it went away wins (a cancel is never downgraded).
                seen = self.watch.command if self.watch is not None else None
                stop = machine.command_observed(record, machine.merge_command(seen, "suspend"))
                await self._persist(stop, check_commands=False, release=True)
                self.host.telemetry.emit("operation.suspended", self.operation_id)
            except errors.RecoveryError:
                pass  # the lease dies with us; a stale in-flight attempt reads as interrupted

    async def _drive(self, transition: machine.Transition) -> Any:
        op_id = self.operation_id
        telemetry = self.host.telemetry
        while True:
            current = transition.record
            match transition.action:
                case machine.Stop(error=error):
                    telemetry.emit_stop(op_id, error)
                    if current.reattach and isinstance(
                        error, (errors.OperationCancelled, errors.OperationSuperseded)
                    ):
                        await self._cancel_on_server(current)  # best effort
                    raise error
                case machine.Deliver():
                    return await self._deliver(current)
                case _ if self._watch().account_stop is not None:
                    # Signed out or switched between two steps: stop before the next one.
                    transition = await self._on_stop(current)
                case machine.WaitUntil(at=at):
                    telemetry.emit("operation.waiting", op_id, until=at)
                    waited = await self._interruptible(self.host.scheduler.wait_until(at))
                    if isinstance(waited, Cut):
                        transition = await self._on_stop(current)
                    else:
                        transition = await self._advance(functools.partial(self._wake, current))
                case machine.AskHost(attempt=attempt):
                    transition = await self._ask_host(current, attempt)
                case machine.Reattach() as reattach:  # no new POST, no budget
                    transition = await self._reattach(current, reattach)
                case _:
                    raise machine.InvalidTransition(f"no action after {current.phase}")

    async def _ask_host(self, current: OperationRecord, attempt: Attempt) -> machine.Transition:
        host = self.host
        _killpoints.hit("attempt.pending_saved")
        host.telemetry.emit("attempt.reserved", self.operation_id, attempt=attempt.number,
                          reason=attempt.reason, model=current.model)

        async def ask() -> bool:
            # A callback exception escapes unchanged: nothing spent, no renewal, no retry.
            # A plain ``def`` is accepted too: it runs inline and cannot be interrupted.
            reply = self.authorize(attempt)
            answer = await reply if inspect.isawaitable(reply) else reply
            if type(answer) is not bool:  # only True authorizes; "yes" is a host defect
                raise errors.AuthorizationFailed(
                    f"it returned {type(answer).__name__}", operation_id=self.operation_id,
                    attempt_id=attempt.attempt_id,
                )
            return answer

        try:
            approved = await self._interruptible(ask())
        except Exception as exc:
            if not self.standing_policy:
                raise
            # A worker's policy: nobody would hear the error, so it is saved (nothing spent).
            detail = (
                exc.args[0] if isinstance(exc, errors.AuthorizationFailed)
                else f"it raised {type(exc).__name__}"
            )
            failed = await self._advance(
                lambda _: machine.authorization_failed(current, attempt.attempt_id, detail)
            )
            assert isinstance(failed.action, machine.Stop)
            host.telemetry.emit_stop(self.operation_id, failed.action.error)
            raise failed.action.error from exc
        if isinstance(approved, Cut) or self._watch().account_stop is not None:
            # A late answer after a sign-out authorizes nothing (nothing is spent).
            return await self._on_stop(current)
        token: str | None = None
        if approved:
            backend = host.backend
            if backend is None:
                raise errors.ConfigurationUnavailable(
                    "no backend: this runtime can only read receipts",
                    operation_id=current.operation_id,
                )
            renew = attempt.reason == "authentication_reissue"
            try:
                token = await backend.credentials.token(renew=renew)
            except trio.Cancelled:
                raise
            except Exception as exc:  # renewal unavailable: a sign-in blocker, nothing spent
                if not renew:
                    raise
                blocked = await self._advance(
                    lambda _: machine.credentials_unavailable(current, attempt.attempt_id)
                )
                host.telemetry.emit("operation.authentication_required", self.operation_id)
                assert isinstance(blocked.action, machine.Stop)
                raise blocked.action.error from exc
        if self._watch().account_stop is not None:
            return await self._on_stop(current)  # signed out while fetching the token
        if not approved:
            return await self._advance(
                lambda command: machine.authorization_answered(
                    current, attempt.attempt_id, False, self._ctx(command)
                )
            )
        assert token is not None
        # A token that cannot be sent in a header is a typed error before anything is spent.
        validate_api_key(token, what="the credentials' token")
        # Recheck now (lifecycle, account, expiry, budget): connect only for an attempt that
        # could be consumed. The same check is repeated, atomically, at consumption.
        approve = functools.partial(self._approved, current, attempt.attempt_id)
        if not isinstance(approve(self._watch().command).action, machine.Transmit):
            return await self._advance(approve)
        return await self._transmit(current, attempt.attempt_id, token)

    async def _deliver(self, current: OperationRecord) -> Any:
        watch = self._watch()
        if watch.command == "cancel":
            await self._advance(lambda _: machine.command_observed(current, "cancel"))
            raise errors.OperationCancelled(operation_id=self.operation_id)
        if watch.account_stop is not None or self.host.account != current.account:
            # Signed out (or switched) while the receipt was being saved: it stays saved
            # for its own account and is delivered to nobody now.
            error = errors.AccountChanged(
                "signed out" if self.host.account is None else "account changed",
                operation_id=self.operation_id,
            )
            self.host.telemetry.emit_stop(self.operation_id, error)
            raise error
        payload = self._payload
        if payload is None:
            # A version-1 record delivered by a runtime that did not upgrade it (no
            # backend) keeps its completion inline: read it from there.
            payload = saved_completion(self.host.store, current)
            if payload is None:
                # Fail closed: a missing receipt is never permission to regenerate.
                raise errors.CompletionUnavailable(
                    "the saved completion is missing", operation_id=self.operation_id
                )
            self.host.telemetry.emit("receipt.retrieved", self.operation_id)
        try:
            return self.contract.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise errors.FormatMismatch(
                "the saved completion does not decode with the requested type",
                operation_id=self.operation_id,
            ) from exc
