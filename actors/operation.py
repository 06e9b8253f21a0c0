"""The OperationActor: drives one ``send_recovering`` execution through the machine.

It owns the operation's lease for the whole execution, applies the one rule of
the machine (persist the returned record, fenced by the lease generation, THEN
act), runs every step that may block (the host callback, the stream, a
cooldown) inside the monitor's cancel scope, and releases the lease only after
everything has unwound. It runs in the caller's task, so Trio cancellation of
that task reaches it directly and suspends the operation.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import attrs
import msgspec
import trio
from recoverable.storage.integrity import verify_body
from recoverable.storage.leases import acquire_lease, release_lease
from recoverable.storage.migration import saved_completion, upgrade_operation
from recoverable.transport.base import validate_api_key
from recoverable.transport.connect import CONNECT_CODES, ConnectKind, EndpointGate
from recoverable.transport.ratelimit import estimate_tokens

from recoverable import _killpoints, errors, machine
from recoverable.contract import OutputInvalid, ResponseContract
from recoverable.outcome import Completed, Interruption, Progress, Usage
from recoverable.records import (
    CommandKind,
    LeaseRecord,
    OperationRecord,
)
from recoverable.types import Attempt

if TYPE_CHECKING:
    from recoverable.actors.monitor import Watch
    from recoverable.actors.runtime import Runtime
    from recoverable.storage.base import WriteTransaction as WriteTxn

Authorize = Callable[[Attempt], Awaitable[bool] | bool]


class _NeedsUpgrade(Exception):
    """Raised inside the acquisition: the record is an unmigrated version-1 record."""


class _NotTransmitted(Exception):
    """Raised from ``before_send``: the recheck at consumption stopped the attempt."""


class _CommandArrived(Exception):
    """Raised inside a write transaction: a lifecycle command the step did not account for."""

    def __init__(self, kind: CommandKind, serial: int) -> None:
        super().__init__(kind)
        self.kind = kind
        self.serial = serial


def check_disposition(txn: WriteTxn, operation_id: str) -> None:
    disposition = txn.get_disposition(operation_id)
    if disposition is not None:
        raise errors.StateUnavailable(
            f"operation is {disposition.disposition}", operation_id=operation_id
        )


class OperationActor:
    def __init__(
        self,
        runtime: Runtime,
        operation_id: str,
        contract: ResponseContract,
        authorize: Authorize,
    ) -> None:
        self.rt = runtime
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

    # --- lease ----------------------------------------------------------------------

    async def _acquire(
        self,
        open_step: Callable[[OperationRecord, CommandKind | None, bool], machine.Transition],
    ) -> machine.Transition:
        """Take the lease and persist the opening transition in ONE transaction.

        A suspend written before this execution is spent (reopening is resuming);
        a cancel is folded into the record. When the opening already ends the
        execution (a saved receipt to deliver, a terminal state), the lease is
        released in the same transaction too.
        """
        op_id = self.operation_id
        upgrade_tried = False

        def acquire(
            txn: WriteTxn,
        ) -> tuple[LeaseRecord | None, machine.Transition, int, bool, bytes | None]:
            check_disposition(txn, op_id)
            stored = txn.get_operation(op_id)
            if stored is not None and stored.awaiting_upgrade:
                if not upgrade_tried:
                    raise _NeedsUpgrade
                # It could not be upgraded here (no backend, or its request cannot be
                # frozen). Read it as it is: no lease, no write, since rewriting it would
                # drop the version-1 fields (its request parts, its inline completion).
                # Nothing can generate for it, so a saved completion is delivered and
                # everything else stops (a pending cancel still fences delivery).
                pending = txn.get_command(op_id)
                cancel: CommandKind | None = (
                    "cancel" if pending is not None and pending.kind == "cancel" else None
                )
                return None, open_step(stored, cancel, False), 0, True, None
            lease = acquire_lease(txn, op_id, self.rt.now())
            record = txn.get_operation(op_id)
            assert record is not None
            body = txn.get_payload(op_id, "body")
            if body is not None:  # a tampered body is a corrupt record: never sent
                verify_body(op_id, record.body_hash, body)
            command = txn.get_command(op_id)
            serial = 0
            kind: CommandKind | None = None
            if command is not None:
                serial = command.serial
                if command.kind == "suspend":
                    txn.delete_command(op_id)
                else:
                    kind = command.kind
            t = open_step(record, kind, body is not None)  # a missing body: before the host
            if t.changed:
                if kind is not None and t.record.phase == "cancelled":
                    txn.delete_command(op_id)  # folded into the record's phase
                txn.put_operation(t.record, expect_fence=lease.fence)
            final = _ends(t)
            if final:
                release_lease(txn, op_id, lease.token)
            return lease, t, serial, final, body

        try:
            lease, t, serial, final, body = await self.rt.store.write(acquire)
        except _NeedsUpgrade:
            # A version-1 record: rewrite it as current (lazily, once), then take the lease.
            backend = self.rt.backend
            if backend is not None:
                await upgrade_operation(self.rt.store, op_id, endpoint_id=backend.endpoint_id)
            upgrade_tried = True  # if it could not be upgraded: still readable, never sent
            lease, t, serial, final, body = await self.rt.store.write(acquire)
        self._body = body
        self.fence = lease.fence if lease is not None else 0
        self.lease = None if final else lease
        self.record = t.record
        self.known_serial = serial
        self.watch = self.rt.monitor.watch(op_id, serial, t.record.account)
        current_account = self.rt.account
        if current_account != t.record.account:
            # Signed out (or switched) after the acquisition checked the account and
            # before this watch existed: stop as if the change came a moment later.
            self.watch.stop_for_account(
                "signed_out" if current_account is None else "account_changed"
            )
        return t

    async def _release(self) -> None:
        if self.watch is not None:
            self.rt.monitor.unwatch(self.watch)
        lease = self.lease
        if lease is None:
            return
        self.lease = None
        op_id = self.operation_id

        def release(txn: WriteTxn) -> None:
            release_lease(txn, op_id, lease.token)

        with trio.CancelScope(shield=True):
            try:
                await self.rt.store.write(release)
            except errors.RecoveryError:
                # The lease row names this process; it dies with this store's owner lock.
                pass

    # --- persistence ----------------------------------------------------------------

    def _ctx(self, command: CommandKind | None = None) -> machine.Context:
        credentials = self.rt.backend.credentials if self.rt.backend is not None else None
        return machine.Context(
            now=self.rt.now(),
            account=self.rt.account,
            credentials_account=credentials.account if credentials is not None else None,
            endpoint_id=self.rt.backend.endpoint_id if self.rt.backend is not None else None,
            command=command,
        )

    async def _persist(
        self,
        t: machine.Transition,
        *,
        completion: bytes | None = None,
        check_commands: bool = True,
        release: bool = False,
    ) -> None:
        """Write ``t.record`` fenced by our lease; refuse if an unseen command arrived.

        With ``release`` the lease goes in the same transaction (the execution ends).
        """
        lease = self.lease if release else None
        if not t.changed and completion is None and lease is None:
            return
        record = t.record
        fence = self.fence
        op_id = self.operation_id
        known = self.known_serial
        folds_command = record.phase in ("suspended", "cancelled")

        def write(txn: WriteTxn) -> None:
            command = txn.get_command(op_id)
            if command is not None:
                if check_commands and command.serial > known:
                    raise _CommandArrived(command.kind, command.serial)
                if (folds_command and command.serial <= known
                        and (command.kind != "cancel" or record.phase == "cancelled")):
                    # Folded into the record's phase. A cancel is folded only into a
                    # cancelled record: never lost into a resumable suspension.
                    txn.delete_command(op_id)
            if completion is not None:
                txn.put_payload(op_id, "completion", completion)
            if t.changed or completion is not None:
                txn.put_operation(record, expect_fence=fence)
            if lease is not None:
                release_lease(txn, op_id, lease.token)

        try:
            await self.rt.store.write(write)
        except errors.FenceMismatch as exc:
            raise errors.OperationBusy(
                "the operation's lease was taken over", operation_id=op_id
            ) from exc
        self.record = record
        if lease is not None:
            self.lease = None

    async def _advance(
        self,
        step: Callable[[CommandKind | None], machine.Transition],
        *,
        completion: bytes | None = None,
    ) -> machine.Transition:
        """Compute a transition and persist it; if a lifecycle command arrived meanwhile,
        recompute the same step with that command (the check is atomic with the write)."""
        assert self.watch is not None
        t = step(self.watch.command)
        try:
            await self._persist(
                t, completion=completion if _saves(t) else None, release=_ends(t)
            )
        except _CommandArrived as arrived:
            self.known_serial = arrived.serial
            self.watch.command = arrived.kind
            self.watch.command_serial = arrived.serial
            t = step(arrived.kind)
            await self._persist(t, completion=completion if _saves(t) else None,
                                check_commands=False, release=_ends(t))
        if self.watch.command_serial is not None:
            self.known_serial = max(self.known_serial, self.watch.command_serial)
        return t

    # --- the loop -------------------------------------------------------------------

    async def run(
        self, *, expected_contract_version: str | None, check_contract_version: bool
    ) -> Any:
        try:
            t = await self._acquire(
                lambda record, cancel, body_available: machine.open_operation(
                    record,
                    attrs.evolve(self._ctx(cancel), body_available=body_available),
                    format_hash=self.contract.format_hash,
                    expected_contract_version=expected_contract_version,
                    check_contract_version=check_contract_version,
                )
            )
            try:
                return await self._drive(t)
            except BaseException as exc:
                if _is_cancellation(exc):
                    await self._suspend_on_cancel()
                raise
        finally:
            await self._release()

    async def _suspend_on_cancel(self) -> None:
        """Trio cancellation of the owning task suspends the operation (budget kept)."""
        record = self.record
        if record is None or self.lease is None:
            return
        with trio.CancelScope(shield=True):
            try:
                if self.watch is not None and self.watch.command == "cancel":
                    # A permanent cancel was seen as the caller went away: it wins.
                    t = machine.command_observed(record, "cancel")
                else:
                    t = machine.interrupted_locally(record)
                await self._persist(t, check_commands=False, release=True)
                self.rt.telemetry.emit("operation.suspended", self.operation_id)
            except errors.RecoveryError:
                pass  # the lease dies with us; a stale in-flight attempt reads as interrupted

    async def _drive(self, t: machine.Transition) -> Any:
        rt = self.rt
        op_id = self.operation_id
        while True:
            action = t.action
            current = t.record
            if isinstance(action, machine.Stop):
                rt.telemetry.emit_stop(op_id, action.error)
                raise action.error
            if isinstance(action, machine.Deliver):
                return await self._deliver(current)
            assert self.watch is not None
            if self.watch.account_stop is not None:
                # Signed out or switched between two steps: stop before the next one.
                t = await self._on_stop(current)
                continue
            if isinstance(action, machine.WaitUntil):
                rt.telemetry.emit("operation.waiting", op_id, until=action.at)
                if not await self._interruptible(rt.scheduler.wait_until(action.at)):
                    t = await self._on_stop(current)
                    continue
                t = await self._advance(functools.partial(self._wake, current))
                continue
            if isinstance(action, machine.AskHost):
                t = await self._ask_host(current, action.attempt)
                continue
            raise machine.InvalidTransition(f"no action after {current.phase}")

    def _approved(
        self, rec: OperationRecord, attempt_id: str, command: CommandKind | None
    ) -> machine.Transition:
        return machine.authorization_answered(rec, attempt_id, True, self._ctx(command))

    def _wake(self, current: OperationRecord, command: CommandKind | None) -> machine.Transition:
        return machine.wake(current, self._ctx(command))

    async def _interruptible(self, work: Awaitable[None]) -> bool:
        """Run ``work`` inside the monitor's scope; False if a lifecycle command cut it."""
        assert self.watch is not None
        with self.watch.fresh_scope() as scope:
            await work
        return not scope.cancelled_caught

    async def _on_stop(self, current: OperationRecord) -> machine.Transition:
        """The watch's scope was cancelled: by a lifecycle command, or by the runtime's
        sign-out / account change (a command, when both, decides)."""
        assert self.watch is not None
        kind = self.watch.command
        if kind is not None:
            return await self._advance(lambda _: machine.command_observed(current, kind))
        code = self.watch.account_stop
        assert code is not None
        self.rt.telemetry.emit("operation.account_stopped", self.operation_id, reason=code)
        return await self._advance(
            lambda command: machine.account_stopped(current, code, self._ctx(command))
        )

    async def _ask_host(self, current: OperationRecord, attempt: Attempt) -> machine.Transition:
        rt = self.rt
        _killpoints.hit("attempt.pending_saved")
        rt.telemetry.emit("attempt.reserved", self.operation_id, attempt=attempt.number,
                          reason=attempt.reason, model=current.model)
        answer: list[bool] = []

        async def ask() -> None:
            # A callback exception escapes unchanged: nothing spent, no renewal, no retry.
            # A plain ``def`` is accepted too: it runs inline and cannot be interrupted.
            reply = self.authorize(attempt)
            answer.append(bool(await reply if inspect.isawaitable(reply) else reply))

        assert self.watch is not None
        if not await self._interruptible(ask()) or self.watch.account_stop is not None:
            # A late answer after a sign-out authorizes nothing (nothing is spent).
            return await self._on_stop(current)
        approved = answer[0]
        token: str | None = None
        if approved:
            backend = rt.backend
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
                t = await self._advance(
                    lambda _: machine.credentials_unavailable(current, attempt.attempt_id)
                )
                rt.telemetry.emit("operation.authentication_required", self.operation_id)
                assert isinstance(t.action, machine.Stop)
                raise t.action.error from exc
        if self.watch.account_stop is not None:
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
        assert self.watch is not None
        precheck = machine.authorization_answered(
            current, attempt.attempt_id, True, self._ctx(self.watch.command)
        )
        if not isinstance(precheck.action, machine.Transmit):
            return await self._advance(
                lambda command: machine.authorization_answered(
                    current, attempt.attempt_id, True, self._ctx(command)
                )
            )
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
        rt = self.rt
        backend = rt.backend
        assert backend is not None
        body = self._body
        if body is None:
            raise errors.CorruptRecord("the frozen body is missing", operation_id=self.operation_id)
        gate = rt.endpoint_gate(backend.endpoint_id)
        authorized = current
        while True:
            known = gate.failure
            if known is not None and authorized.endpoint_failure != known:
                # About to wait behind the shared backoff: record why (status, other processes).
                t = await self._advance(functools.partial(
                    _unreachable, authorized, attempt_id, known
                ))
                authorized = t.record
            result = await self._connect_and_send(authorized, attempt_id, token, body, gate)
            if isinstance(result, machine.Transition):
                return result
            kind, authorized = result
            if authorized.endpoint_failure != kind:
                t = await self._advance(functools.partial(
                    _unreachable, authorized, attempt_id, kind
                ))
                authorized = t.record
            rt.telemetry.emit("endpoint.unavailable", self.operation_id, kind=kind,
                              failures=gate.failures)
            # Before the next try: still allowed (account, expiry, budget, commands)?
            assert self.watch is not None
            recheck = machine.authorization_answered(
                authorized, attempt_id, True, self._ctx(self.watch.command)
            )
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
        rt = self.rt
        backend = rt.backend
        assert backend is not None
        tickets: list[int] = []

        async def admitted() -> None:
            tickets.append(await gate.admit())

        if not await self._interruptible(admitted()):
            return await self._on_stop(authorized)
        ticket = tickets[0]
        reported = False
        consumed: list[machine.Transition] = []
        outcome: list[Completed | Interruption] = []
        progress_state: dict[str, Any] = {}

        def on_progress(p: Progress) -> None:
            # The first report comes with the first event: the server has produced its
            # response (the fixture writes it whole), the client has not read its end.
            # Once per attempt, so ``@N`` names the N-th attempt that streamed.
            if not progress_state:
                _killpoints.hit("stream.completed_unreceived")
            progress_state["response_id"] = p.response_id
            progress_state["sequence_number"] = p.sequence_number

        async def before_send() -> None:
            nonlocal reported
            gate.succeeded(ticket)
            reported = True
            with trio.CancelScope(shield=True):  # the consumption write always completes
                t = await self._advance(
                    lambda command: machine.authorization_answered(
                        authorized, attempt_id, True, self._ctx(command)
                    )
                )
            consumed.append(t)
            if not isinstance(t.action, machine.Transmit):
                raise _NotTransmitted
            rt.attempts_consumed += 1
            _killpoints.hit("attempt.consumed_saved")
            rt.telemetry.emit("attempt.transmission_authorized", self.operation_id,
                              attempt=t.record.attempts_used)

        estimate = estimate_tokens(body)

        async def stream() -> None:
            async with rt.scheduler.transmission_slot():
                # The rate governor, before connecting: waiting for budget spends nothing.
                await rt.governor.admit(self.operation_id, backend.endpoint_id,
                                        authorized.account, estimate, self._sleep_until)
                outcome.append(
                    await backend.stream(body, attempt_id=attempt_id, token=token,
                                         on_progress=on_progress, before_send=before_send)
                )

        try:
            completed = await self._interruptible(stream())
        except _NotTransmitted:
            return consumed[0]  # persisted; its Stop says why (command, account, expiry, ...)
        finally:
            if not reported:
                # Give up a probe held without a result (cut, cancelled, raised). The ticket
                # stays valid: a connect failure is still reported with it just below.
                gate.abandon(ticket)
        if not consumed:
            # Never connected: nothing was sent and nothing is spent.
            if not completed:
                return await self._on_stop(authorized)
            result = outcome[0]
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
        current = consumed[0].record
        if progress_state:
            current = machine.progress(
                current, attempt_id, progress_state.get("response_id"),
                progress_state.get("sequence_number"),
            ).record
            self.record = current
        if not outcome:
            assert not completed
            return await self._on_stop(current)
        # The stream ended before a stop could cut it: its outcome is used as received
        # (a completion is validated and saved; the step applies the stop on top).
        result = outcome[0]
        try:
            return await self._attempt_ended(current, attempt_id, result)
        finally:
            # After the attempt's own record is saved: the shared pause (429), the
            # x-ratelimit-* headers and the usage correction, for every operation.
            with trio.CancelScope(shield=True):
                await rt.governor.settle(
                    self.operation_id, backend.endpoint_id, authorized.account,
                    estimate=estimate, outcome=result,
                    maximum_pause=current.retry_policy.maximum_retry_after,
                )

    async def _attempt_ended(
        self, current: OperationRecord, attempt_id: str, result: Completed | Interruption
    ) -> machine.Transition:
        """Validate and save a completion, or record the failure (the attempt is spent)."""
        rt = self.rt
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
                self._count_usage(result.usage, result.usage_malformed)
                done = current
                try:
                    t = await self._advance(
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
                if t.record.has_completion:
                    self._payload = payload
                    _killpoints.hit("receipt.saved")
                    rt.telemetry.emit("receipt.saved", self.operation_id, bytes=len(payload))
                return t
        failure = result
        self._count_usage(failure.usage, failure.usage_malformed)
        rt.telemetry.emit("attempt.failed", self.operation_id, kind=failure.kind,
                          http_status=failure.http_status, code=failure.provider_code)
        failed_from = current
        return await self._advance(
            lambda command: machine.attempt_failed(
                failed_from, attempt_id, failure, self._ctx(command)
            )
        )

    async def _sleep_until(self, at: float) -> None:
        """The governor's waits (rare, shared): a plain sleep to a wall-clock time. The
        scheduler's heap stays for the saved cooldowns of the operations themselves. The
        governor checks again after it (an early wake only waits once more)."""
        await trio.sleep(max(0.0, at - self.rt.now()))

    def _count_usage(self, usage: Usage | None, malformed: bool) -> None:
        """Telemetry for an attempt's reported usage: token counts only (never text)."""
        rt = self.rt
        if malformed:
            rt.usage_malformed += 1
            rt.telemetry.emit("attempt.usage_malformed", self.operation_id)
        if usage is not None:
            rt.telemetry.emit(
                "attempt.usage", self.operation_id,
                input_tokens=usage.input_tokens,
                cached_input_tokens=usage.cached_input_tokens,
                output_tokens=usage.output_tokens,
                reasoning_tokens=usage.reasoning_tokens,
            )

    async def _deliver(self, current: OperationRecord) -> Any:
        assert self.watch is not None
        if self.watch.command == "cancel":
            await self._advance(lambda _: machine.command_observed(current, "cancel"))
            raise errors.OperationCancelled(operation_id=self.operation_id)
        stop = self.watch.account_stop
        if stop is not None or self.rt.account != current.account:
            # Signed out (or switched) while the receipt was being saved: it stays saved
            # for its own account and is delivered to nobody now.
            error = errors.AccountChanged(
                "signed out" if self.rt.account is None else "account changed",
                operation_id=self.operation_id,
            )
            self.rt.telemetry.emit_stop(self.operation_id, error)
            raise error
        payload = self._payload
        if payload is None:
            # A version-1 record delivered by a runtime that did not upgrade it (no
            # backend) keeps its completion inline: read it from there.
            payload = saved_completion(self.rt.store, current)
            if payload is None:
                # Fail closed: a missing receipt is never permission to regenerate.
                raise errors.CompletionUnavailable(
                    "the saved completion is missing", operation_id=self.operation_id
                )
            self.rt.telemetry.emit("receipt.retrieved", self.operation_id)
        try:
            return self.contract.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise errors.FormatMismatch(
                "the saved completion does not decode with the requested type",
                operation_id=self.operation_id,
            ) from exc


def _unreachable(
    rec: OperationRecord, attempt_id: str, kind: str, command: CommandKind | None
) -> machine.Transition:
    del command  # recorded whatever arrives; the next interruptible step observes a command
    return machine.endpoint_unreachable(rec, attempt_id, kind)


def _is_cancellation(exc: BaseException) -> bool:
    """Trio cancellation, also when an inner nursery grouped several ``Cancelled``."""
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        return rest is None
    return False


def _ends(t: machine.Transition) -> bool:
    """The transition ends this execution: its write also releases the lease."""
    return isinstance(t.action, (machine.Deliver, machine.Stop))


def _saves(t: machine.Transition) -> bool:
    return t.record.has_completion and t.record.phase == "completed"
