"""The OperationActor: drives one execution of an operation through the machine.

It owns the operation's lease for the whole execution, applies the one rule of
the machine (persist the returned record, fenced by the lease generation, THEN
act), runs every step that may block (the host callback, the stream, a
cooldown) inside the monitor's cancel scope, and releases the lease only after
everything has unwound. It runs as a task of the runtime's supervisor nursery
(``actors/supervisor.py``); a Trio cancellation of that task (its last caller went
away, or the runtime closed) suspends the operation. It sees the runtime only
through :class:`~recoverable.actors.host.OperationHost`; its transactions are the
named functions of ``actors/fenced.py``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import msgspec
import trio
from recoverable.actors import fenced
from recoverable.actors.heartbeat import ExecutionLease, lease_lost_transition
from recoverable.actors.host import OperationHost, count_usage
from recoverable.actors.monitor import Watch
from recoverable.actors.supervisor import is_cancellation
from recoverable.storage.migration import saved_completion, upgrade_operation
from recoverable.transport.base import validate_api_key
from recoverable.transport.connect import CONNECT_CODES, ConnectKind, EndpointGate
from recoverable.transport.ratelimit import estimate_tokens

from recoverable import _killpoints, errors, machine
from recoverable.contract import OutputInvalid, ResponseContract
from recoverable.outcome import Completed, Interruption, Progress
from recoverable.records import CommandKind, LeaseRecord, OperationRecord
from recoverable.types import Attempt

Authorize = Callable[[Attempt], Awaitable[bool] | bool]
ValueT = TypeVar("ValueT")


class Cut:
    """An interruptible step was cut by the monitor (a command, a sign-out, an account
    change): what :meth:`OperationActor._interruptible` returns instead of a value."""


CUT = Cut()


class _NotTransmitted(Exception):
    """Raised from ``before_send``: the recheck at consumption stopped the attempt."""


class _Try:
    """One connect-and-send try, as its callbacks fill it in."""

    def __init__(self, ticket: int) -> None:
        self.ticket = ticket  # the endpoint gate's admission
        self.reported = False  # the connection was reported to the gate
        self.consumed: machine.Transition | None = None  # the attempt, consumed (persisted)
        self.result: Completed | Interruption | None = None  # how the stream ended
        self.progressed = False  # a progress report arrived
        self.response_id: str | None = None
        self.sequence_number: int | None = None


class OperationActor:
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
        self._sending: _Try | None = None  # the attempt being sent (for an honest close)

    # --- lease ----------------------------------------------------------------------

    async def _acquire(self, open_step: fenced.OpenStep) -> machine.Transition:
        """Take the lease and persist the opening transition (``fenced.acquire``)."""
        op_id = self.operation_id
        try:
            opened = await self.host.store.write(
                functools.partial(fenced.acquire, op_id, self.host.now(), open_step, False,
                                  lease_seconds=self.host.leases.lease_seconds)
            )
        except fenced.NeedsUpgrade:
            # A version-1 record: rewrite it as current (lazily, once), then take the lease.
            backend = self.host.backend
            if backend is not None:
                await upgrade_operation(self.host.store, op_id, endpoint_id=backend.endpoint_id)
            # If it could not be upgraded: still readable, never sent.
            opened = await self.host.store.write(
                functools.partial(fenced.acquire, op_id, self.host.now(), open_step, True,
                                  lease_seconds=self.host.leases.lease_seconds)
            )
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
                    functools.partial(fenced.release, self.operation_id, lease.token)
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
    ) -> None:
        """Write the transition fenced by our lease; refuse if an unseen command arrived.

        With ``release`` the lease goes in the same transaction (the execution ends).
        """
        lease = self.lease if release else None
        if not transition.changed and completion is None and lease is None:
            return
        write = fenced.FencedWrite(
            operation_id=self.operation_id,
            transition=transition,
            fence=self.fence,
            known_serial=self.known_serial,
            check_commands=check_commands,
            completion=completion,
            release_token=lease.token if lease is not None else None,
        )
        try:
            await self.host.store.write(functools.partial(fenced.persist, write))
        except errors.FenceMismatch as exc:
            raise errors.LeaseLost(
                "a newer owner took the operation over", operation_id=self.operation_id
            ) from exc
        self.record = transition.record
        if lease is not None:
            self.lease = None
            self.guard.drop()

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
            await self._persist(
                transition,
                completion=completion if fenced.saves(transition) else None,
                release=fenced.ends(transition),
            )
        except fenced.CommandArrived as arrived:
            self.known_serial = arrived.serial
            self.watch.observe(arrived.kind, arrived.serial)
            transition = step(self.watch.command)
            await self._persist(
                transition,
                completion=completion if fenced.saves(transition) else None,
                check_commands=False,
                release=fenced.ends(transition),
            )
        if self.watch.command_serial is not None:
            self.known_serial = max(self.known_serial, self.watch.command_serial)
        return transition

    # --- the loop -------------------------------------------------------------------

    async def run(
        self, *, expected_contract_version: str | None, check_contract_version: bool
    ) -> Any:
        try:
            opening = await self._acquire(
                lambda record, cancel, body_available: machine.open_operation(
                    record,
                    attrs.evolve(self._ctx(cancel), body_available=body_available),
                    format_hash=self.contract.format_hash,
                    expected_contract_version=expected_contract_version,
                    check_contract_version=check_contract_version,
                )
            )
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
                case _:
                    raise machine.InvalidTransition(f"no action after {current.phase}")

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

    async def _ask_host(self, current: OperationRecord, attempt: Attempt) -> machine.Transition:
        host = self.host
        _killpoints.hit("attempt.pending_saved")
        host.telemetry.emit("attempt.reserved", self.operation_id, attempt=attempt.number,
                          reason=attempt.reason, model=current.model)

        async def ask() -> bool:
            # A callback exception escapes unchanged: nothing spent, no renewal, no retry.
            # A plain ``def`` is accepted too: it runs inline and cannot be interrupted.
            reply = self.authorize(attempt)
            return bool(await reply if inspect.isawaitable(reply) else reply)

        approved = await self._interruptible(ask())
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

    async def _transmit(
        self, current: OperationRecord, attempt_id: str, token: str
    ) -> machine.Transition:
        """Connect, THEN consume the approved attempt, then send the frozen body.

        The attempt is consumed (persisted) in ``before_send``: once a connection to the
        endpoint is established and before the first byte of the request is written. A
        connection that was never established spends nothing: the pending attempt stays
        (same id), the runtime's shared connect backoff for the endpoint is waited (a
        lifecycle command or the caller's cancellation cuts it), and connecting is tried
        again.
        """
        host = self.host
        backend = host.backend
        assert backend is not None
        body = self._body
        if body is None:
            raise errors.CorruptRecord("the frozen body is missing", operation_id=self.operation_id)
        gate = host.endpoint_gate(backend.endpoint_id)
        authorized = current
        while True:
            known = gate.failure
            if known is not None and authorized.endpoint_failure != known:
                # About to wait behind the shared backoff: record why (status, other processes).
                noted = await self._advance(functools.partial(
                    _unreachable, authorized, attempt_id, known
                ))
                authorized = noted.record
            result = await self._connect_and_send(authorized, attempt_id, token, body, gate)
            if isinstance(result, machine.Transition):
                return result
            kind, authorized = result
            if authorized.endpoint_failure != kind:
                noted = await self._advance(functools.partial(
                    _unreachable, authorized, attempt_id, kind
                ))
                authorized = noted.record
            host.telemetry.emit("endpoint.unavailable", self.operation_id, kind=kind,
                              failures=gate.failures)
            # Before the next try: still allowed (account, expiry, budget, commands)?
            recheck = self._approved(authorized, attempt_id, self._watch().command)
            if not isinstance(recheck.action, machine.Transmit):
                return await self._advance(
                    functools.partial(self._approved, authorized, attempt_id)
                )

    async def _connect_and_send(
        self,
        authorized: OperationRecord,
        attempt_id: str,
        token: str,
        body: bytes,
        gate: EndpointGate,
    ) -> machine.Transition | tuple[ConnectKind, OperationRecord]:
        """One try: the transition after the attempt, or the connect failure (nothing spent)."""
        host = self.host
        backend = host.backend
        assert backend is not None
        ticket = await self._interruptible(gate.admit())
        if isinstance(ticket, Cut):
            return await self._on_stop(authorized)
        sending = self._sending = _Try(ticket)

        def on_progress(report: Progress) -> None:
            # The first report comes with the first event: the server has produced its
            # response (the fixture writes it whole), the client has not read its end.
            # Once per attempt, so ``@N`` names the N-th attempt that streamed.
            if not sending.progressed:
                _killpoints.hit("stream.completed_unreceived")
            sending.progressed = True
            sending.response_id = report.response_id
            sending.sequence_number = report.sequence_number

        async def before_send() -> None:
            gate.succeeded(ticket)
            sending.reported = True
            with trio.CancelScope(shield=True):  # the consumption write always completes
                consumed = await self._advance(
                    functools.partial(self._approved, authorized, attempt_id)
                )
            sending.consumed = consumed
            if not isinstance(consumed.action, machine.Transmit):
                raise _NotTransmitted
            host.attempts_consumed += 1
            _killpoints.hit("attempt.consumed_saved")
            host.telemetry.emit("attempt.transmission_authorized", self.operation_id,
                              attempt=consumed.record.attempts_used)

        estimate = estimate_tokens(body)

        async def stream() -> None:
            async with host.scheduler.transmission_slot():
                # The rate governor, before connecting: waiting for budget spends nothing.
                await host.governor.admit(self.operation_id, backend.endpoint_id,
                                        authorized.account, estimate, self._sleep_until)
                with self.guard.transport():  # the hard deadline: the lease's safety margin
                    sending.result = await backend.stream(
                        body, attempt_id=attempt_id, token=token,
                        on_progress=on_progress, before_send=before_send,
                    )
                await self.guard.checkpoint()  # cut by it: stop here (the lease is lost)

        try:
            streamed = await self._interruptible(stream())
        except _NotTransmitted:
            # Persisted; its Stop says why (command, account, expiry, ...).
            assert sending.consumed is not None
            return sending.consumed
        finally:
            if not sending.reported:
                # Give up a probe held without a result (cut, cancelled, raised). The ticket
                # stays valid: a connect failure is still reported with it just below.
                gate.abandon(ticket)
        result = sending.result
        if sending.consumed is None:
            # Never connected: nothing was sent and nothing is spent.
            if isinstance(streamed, Cut) or result is None:
                return await self._on_stop(authorized)
            if isinstance(result, Completed):
                raise errors.ConfigurationUnavailable(
                    "the backend sent a request without reporting the connection first",
                    operation_id=self.operation_id,
                )
            code = result.transport_code
            kind: ConnectKind = (
                code if code in CONNECT_CODES else "connect_failed"  # type: ignore[assignment]
            )
            gate.failed(ticket, kind)
            return kind, authorized
        current = sending.consumed.record
        if sending.progressed:
            current = machine.progress(
                current, attempt_id, sending.response_id, sending.sequence_number
            ).record
            self.record = current
        if result is None:
            assert isinstance(streamed, Cut)
            return await self._on_stop(current)
        # The stream ended before a stop could cut it: its outcome is used as received
        # (a completion is validated and saved; the step applies the stop on top).
        try:
            return await self._attempt_ended(current, attempt_id, result)
        finally:
            # After the attempt's own record is saved: the shared pause (429), the
            # x-ratelimit-* headers and the usage correction, for every operation.
            with trio.CancelScope(shield=True):
                await host.governor.settle(
                    self.operation_id, backend.endpoint_id, authorized.account,
                    estimate=estimate, outcome=result,
                    maximum_pause=current.retry_policy.maximum_retry_after,
                )

    async def _attempt_ended(
        self, current: OperationRecord, attempt_id: str, result: Completed | Interruption
    ) -> machine.Transition:
        """Validate and save a completion, or record the failure (the attempt is spent)."""
        host = self.host
        if isinstance(result, Completed):
            try:
                payload = self.contract.validate(result.text)
            except OutputInvalid as invalid:
                result = Interruption(
                    kind="invalid_output",
                    provider_code=invalid.kind,
                    output_path=invalid.location,
                    response_id=result.response_id,
                    sequence_number=result.sequence_number,
                    had_output=True,
                    usage=result.usage,
                    usage_malformed=result.usage_malformed,
                    rate_limits=result.rate_limits,
                )
            else:
                _killpoints.hit("receipt.before_save")
                count_usage(host, self.operation_id, result.usage, result.usage_malformed)
                done = current
                try:
                    saved = await self._advance(
                        lambda command: machine.completion_validated(
                            done, attempt_id, self._ctx(command),
                            response_id=result.response_id,
                            sequence_number=result.sequence_number,
                            usage=result.usage,
                        ),
                        completion=payload,
                    )
                except errors.StorageLimitExceeded as exc:
                    raise errors.CompletionUnavailable(
                        "the validated completion could not be saved (store full)",
                        operation_id=self.operation_id, unsaved=True,
                    ) from exc
                except errors.StorageUnavailable as exc:
                    raise errors.CompletionUnavailable(
                        "the validated completion could not be saved",
                        operation_id=self.operation_id, unsaved=True,
                    ) from exc
                if saved.record.has_completion:
                    self._payload = payload
                    _killpoints.hit("receipt.saved")
                    host.telemetry.emit("receipt.saved", self.operation_id, bytes=len(payload))
                return saved
        failure = result
        count_usage(host, self.operation_id, failure.usage, failure.usage_malformed)
        host.telemetry.emit("attempt.failed", self.operation_id, kind=failure.kind,
                          http_status=failure.http_status, code=failure.provider_code)
        failed_from = current
        return await self._advance(
            lambda command: machine.attempt_failed(
                failed_from, attempt_id, failure, self._ctx(command)
            )
        )

    async def _sleep_until(self, at: float) -> None:
        """The governor's waits (rare, shared; it checks again after): a plain sleep."""
        await trio.sleep(max(0.0, at - self.host.now()))

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


def _unreachable(
    record: OperationRecord, attempt_id: str, kind: str, command: CommandKind | None
) -> machine.Transition:
    del command  # recorded whatever arrives; the next interruptible step observes a command
    return machine.endpoint_unreachable(record, attempt_id, kind)


