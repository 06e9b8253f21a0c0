"""Sending one approved attempt: connect, consume it durably, stream, settle.

``Transmitter`` adds to the actor's core (``actors/operation_core.py``) the path from an
approved attempt to its outcome: connect to the endpoint (a connection never established
spends nothing), consume the attempt in ``before_send`` (persisted before the first byte
of the request), stream under the rate governor and the lease's transport deadline, then
validate and save a completion or record the failure.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

from recoverable import _killpoints, errors, machine, reattachment
from recoverable.actors.checkpoint import Checkpointer
from recoverable.actors.host import count_usage, reattach_client
from recoverable.actors.live import LiveSlot
from recoverable.actors.operation_core import CUT, Cut, OperationCore, Sending
from recoverable.contract import OutputInvalid
from recoverable.outcome import Completed, Interruption, Outcome, Progress
from recoverable.records import CommandKind, OperationRecord
from recoverable.transport.connect import CONNECT_CODES, ConnectKind, EndpointGate
from recoverable.transport.ratelimit import estimate_tokens
from recoverable.types import AccountBinding


class _NotTransmitted(Exception):
    """Raised from ``before_send``: the recheck at consumption stopped the attempt."""


class _CutBeforeSending:
    """A transport cut at its lease's margin before anything was sent: try again (the
    lease renewed first), nothing spent."""


CUT_BEFORE_SENDING: Final = _CutBeforeSending()


class StoppedAtCheckpoint(Exception):
    """Raised from a background stream: a checkpoint write found the operation ended
    meanwhile (e.g. superseded; the write deleted the cancel command that was to
    tell the monitor) and persisted a Stop instead; ``transition`` is that Stop."""

    def __init__(self, transition: machine.Transition) -> None:
        super().__init__(transition.record.phase)
        self.transition = transition


class _Attempt(Sending):
    """One connect-and-send try of a :class:`Transmitter`, with its transport callbacks."""

    def __init__(
        self,
        ticket: int,
        actor: Transmitter,
        gate: EndpointGate,
        authorized: OperationRecord,
        attempt_id: str,
    ) -> None:
        super().__init__(ticket)
        self.actor = actor
        self.gate = gate
        self.authorized = authorized
        self.attempt_id = attempt_id
        self.live = actor.live_slot

    def on_progress(self, report: Progress) -> None:
        # The first report comes with the first event: the server has produced its
        # response (the fixture writes it whole), the client has not read its end.
        # Once per attempt, so ``@N`` names the N-th attempt that streamed.
        if not self.progressed:
            _killpoints.hit("stream.completed_unreceived")
        self.progressed = True
        self.response_id = report.response_id
        self.sequence_number = report.sequence_number
        self.background = report.background

    async def before_send(self) -> None:
        actor = self.actor
        self.gate.succeeded(self.ticket)
        self.reported = True
        with trio.CancelScope(shield=True):  # the consumption write always completes
            consumed = await actor._advance(
                functools.partial(actor._approved, self.authorized, self.attempt_id)
            )
        self.consumed = consumed
        if not isinstance(consumed.action, machine.Transmit):
            raise _NotTransmitted
        actor.host.attempts_consumed += 1
        if self.live is not None:
            self.live.begin(consumed.record.attempts_used)
        _killpoints.hit("attempt.consumed_saved")
        actor.host.telemetry.emit("attempt.transmission_authorized", actor.operation_id,
                                  attempt=consumed.record.attempts_used)


class Transmitter(OperationCore):
    """The actor's core plus the path of one approved attempt to its outcome."""

    # A live operation's consumer (None for every other execution): the text
    # deltas of each consumed attempt go to it, never to the store.
    live_slot: LiveSlot | None = None

    async def _transmit(
        self, current: OperationRecord, attempt_id: str, token: str
    ) -> machine.Transition:
        """Connect, THEN consume the approved attempt, then send the frozen body.

        The attempt is consumed (persisted) in ``before_send``: once a connection to the
        endpoint is established and before the first byte of the request is written. A
        connection that was never established spends nothing: the pending attempt stays
        (same id), the runtime's shared connect backoff for the endpoint is waited (a
        lifecycle command or the caller's cancellation cuts it), and connecting is tried
        again, until the endpoint has been unreachable for the runtime's
        ``unreachable_after``: then the execution ends with ``EndpointUnavailable`` (the
        record rests as it was before the host was asked, nothing spent).
        """
        host = self.host
        backend = host.backend
        assert backend is not None
        body = self._body
        if body is None:
            raise errors.CorruptRecord("the frozen body is missing", operation_id=self.operation_id)
        gate = host.endpoint_gate(backend.endpoint_id)
        authorized = current
        first = True  # past the gate's bound, this execution's first try still probes
        while True:
            known = gate.failure
            if known is not None and authorized.endpoint_failure != known:
                # About to wait behind the shared backoff: record why (status, other processes).
                noted = await self._advance(functools.partial(
                    _unreachable, authorized, attempt_id, known
                ))
                authorized = noted.record
            result = await self._connect_and_send(
                authorized, attempt_id, token, body, gate, first
            )
            first = False
            if isinstance(result, machine.Transition):
                return result
            if isinstance(result, _CutBeforeSending):
                continue  # connecting again waits for the lease's renewal (guard.fresh)
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
        first: bool,
    ) -> machine.Transition | tuple[ConnectKind, OperationRecord] | _CutBeforeSending:
        """One try: the transition after the attempt, the connect failure, or a cut at the
        lease's margin before sending (both: nothing spent)."""
        host = self.host
        backend = host.backend
        assert backend is not None
        if gate.failure is None:
            # An open gate admits at once, without a checkpoint: nothing could interrupt
            # it, so no cancel scope of its own (one less per attempt). A closed one may
            # wait (its shared backoff), interruptibly.
            ticket: int | Cut = await gate.admit()
        else:
            try:
                ticket = await self._interruptible(gate.admit(first=first))
            except errors.EndpointUnavailable as down:
                # Unreachable past the runtime's bound: this execution ends, nothing spent.
                return await self._advance(functools.partial(
                    machine.endpoint_given_up, authorized, attempt_id,
                    down.kind or "connect_failed", gate.unreachable_after,
                ))
        if isinstance(ticket, Cut):
            return await self._on_stop(authorized)
        # The attempt's callbacks are methods of one object (no closures: their cells
        # would be ~15 more objects tracked by the collector per attempt in flight).
        sending = self._sending = _Attempt(ticket, self, gate, authorized, attempt_id)
        estimate = estimate_tokens(body)
        live = sending.live
        # Only a live operation asks the transport for its deltas: no other stream pays.
        deltas: dict[str, Any] = {} if live is None else {"on_delta": live.push}
        streamed: Cut | None = CUT
        try:
            # The stream, interruptible (``_interruptible`` inline: one coroutine less per
            # attempt in flight): CUT unless it ran to its end.
            with self._watch().fresh_scope():
                async with host.scheduler.transmission_slot():
                    # The rate governor, before connecting: waiting for budget spends nothing.
                    await host.governor.admit(self.operation_id, backend.endpoint_id,
                                              authorized.account, estimate, self._sleep_until)
                    # No stream starts on a lease past its margin (late: renewed first).
                    await self.guard.fresh()
                    with self.guard.transport():  # the hard deadline: the lease's safety margin
                        if authorized.reattach:  # reattachable: a background POST, checkpointed
                            call = self._background_post(
                                body, attempt_id, token, sending.on_progress,
                                sending.before_send,
                            )
                        else:
                            call = backend.stream(
                                body, attempt_id=attempt_id, token=token,
                                on_progress=sending.on_progress,
                                before_send=sending.before_send, **deltas,
                            )
                        hard = authorized.attempt_timeout
                        if hard is None:
                            sending.result = await call
                        else:  # the attempt's hard timeout, shorter than the lease
                            sending.result = await self._within(hard, call, sending)
                    if self.guard.cut_late:
                        late = self._cut_late(authorized, sending)
                        if late is not None:
                            return late
                    await self.guard.checkpoint()  # cut by it: stop here (the lease is lost)
                streamed = None
        except _NotTransmitted:
            # Persisted; its Stop says why (command, account, expiry, ...).
            assert sending.consumed is not None
            return sending.consumed
        except StoppedAtCheckpoint as stopped:
            return stopped.transition  # persisted; its Stop says why (superseded)
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
        if authorized.reattach:
            current = self._checkpointed_record(current, attempt_id, sending)
        elif sending.progressed:
            current = machine.progress(
                current, attempt_id, sending.response_id, sending.sequence_number
            ).record
            self.record = current
        if result is None:
            assert isinstance(streamed, Cut)
            return await self._on_stop(current)
        # The stream ended before a stop could cut it: its outcome is used as received
        # (a completion is validated and saved; the step applies the stop on top).
        unsettled = await self._settle(authorized.account, estimate, result,
                                       current.retry_policy.maximum_retry_after)
        transition = await self._attempt_ended(current, attempt_id, result)
        if unsettled is not None:
            raise unsettled
        return transition

    async def _settle(
        self, account: AccountBinding, estimate: int, result: Completed | Interruption,
        maximum_pause: float,
    ) -> errors.RecoveryError | None:
        """The rate governor learns how the attempt ended — the shared pause (429), the
        x-ratelimit-* headers, the usage beyond the estimate — before the attempt's own
        record is written: the provider counted those tokens when it answered, so an
        admission made while the receipt is being saved must already see them (a slow
        disk made that window long enough for a 429). Shielded; a failure to write it
        never stops the outcome from being saved: it is returned, to raise after."""
        backend = self.host.backend
        assert backend is not None
        with trio.CancelScope(shield=True):
            try:
                await self.host.governor.settle(
                    self.operation_id, backend.endpoint_id, account, estimate=estimate,
                    outcome=result, maximum_pause=maximum_pause,
                )
            except errors.RecoveryError as exc:
                return exc
        return None

    # --- reattachment: background responses (``reattach=True``) ---------------------

    async def _background_post(
        self,
        body: bytes,
        attempt_id: str,
        token: str,
        on_progress: Callable[[Progress], None],
        before_send: Callable[[], Awaitable[None]],
    ) -> Outcome:
        """The background POST over HTTP SSE (also for a WebSocket backend), with its
        fenced checkpoint written while it streams."""
        client = reattach_client(self.host.backend)
        if client is None:
            raise errors.ConfigurationUnavailable(
                "the backend cannot stream background responses (reattach=True)",
                operation_id=self.operation_id,
            )
        return await self._checkpointed(attempt_id, on_progress, lambda report: client.stream(
            body, attempt_id=attempt_id, token=token, on_progress=report,
            before_send=before_send,
        ))

    async def _checkpointed(
        self,
        attempt_id: str,
        on_progress: Callable[[Progress], None],
        call: Callable[[Callable[[Progress], None]], Awaitable[Outcome]],
    ) -> Outcome:
        """Run one background stream (``call``) with its checkpoint writer beside it."""
        stops: list[machine.Transition] = []

        async def persist(step: machine.Transition) -> None:
            written = await self._persist(step, check_commands=False)
            if isinstance(written.action, machine.Stop):  # ended meanwhile (superseded)
                stops.append(written)
                nursery.cancel_scope.cancel()
                return
            _killpoints.hit("reattach.checkpoint_saved")
            saved = step.record.attempts[-1]
            self.host.telemetry.emit("attempt.checkpointed", self.operation_id,
                                     attempt=saved.number, sequence_number=saved.sequence_number)

        checkpointer = Checkpointer(
            attempt_id, record=lambda: self.record, now=self.host.now, persist=persist
        )

        def report(progress: Progress) -> None:
            on_progress(progress)
            checkpointer.note(progress)

        refused: list[errors.RecoveryError] = []

        async def write() -> None:
            try:
                await checkpointer.run()
            except errors.RecoveryError as exc:  # a newer owner's fence (LeaseLost), a store
                refused.append(exc)
                nursery.cancel_scope.cancel()

        raised: list[Exception] = []
        outcome: Outcome | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            try:
                outcome = await call(report)
            except Exception as exc:  # raised as itself below, never inside an ExceptionGroup
                raised.append(exc)
            finally:
                checkpointer.close()
        self.checkpoint_writes += checkpointer.writes
        if refused:
            raise refused[0]
        if stops:
            raise StoppedAtCheckpoint(stops[0])
        if raised:
            raise raised[0]
        assert outcome is not None
        return outcome

    def _checkpointed_record(
        self, consumed: OperationRecord, attempt_id: str, sending: Sending
    ) -> OperationRecord:
        """The record after a background stream: its saved checkpoints (``self.record``)
        and the last cursor seen, merged in memory (never backwards)."""
        current = self.record if self.record is not None else consumed
        if sending.progressed:
            current = reattachment.checkpoint(
                current, attempt_id, sending.response_id, sending.sequence_number,
                self.host.now(), sending.background,
            ).record
            self.record = current
        return current

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

    async def _within(
        self, seconds: float, call: Awaitable[Completed | Interruption], sending: Sending
    ) -> Completed | Interruption:
        """Run one attempt's transport under its hard timeout: never longer
        than ``seconds``, nor than the executing runtime's lease less its safety margin
        (a worker with a shorter lease than the preparer's still ends the call before its
        claim could expire). Cut, the attempt ends as a ``timeout`` interruption
        (``transport_code="hard_timeout"``: spent once sent, classified like any timeout;
        before the send, nothing was spent: a connect timeout)."""
        keeper = self.guard.keeper
        limit = min(seconds, keeper.lease_seconds - keeper.margin)
        with trio.move_on_after(limit) as cut:
            return await call
        assert cut.cancelled_caught
        self.host.telemetry.emit("attempt.hard_timeout", self.operation_id)
        if sending.consumed is None:
            return Interruption(kind="timeout", transport_code="connect_timeout")
        return Interruption(
            kind="timeout",
            transport_code="hard_timeout",
            response_id=sending.response_id,
            sequence_number=sending.sequence_number,
            had_output=sending.progressed,
        )

    def _cut_late(self, authorized: OperationRecord, sending: _Attempt) -> _CutBeforeSending | None:
        """The transport was cut at its lease's margin, the lease late but not lost (a
        busy event loop, a slow disk): the attempt ends as an interruption
        (``transport_code="lease_late"``, spent once sent, replaced within the budget
        after the lease is renewed) and the execution goes on; ``LeaseLost`` is only for
        a lease another owner may have taken. A background response is left for whoever
        holds the lease next to resume by its id, as when the lease is lost."""
        self.host.telemetry.emit("attempt.lease_late", self.operation_id)
        if authorized.reattach:
            self.guard.lose()
            return None
        if sending.consumed is None:
            return CUT_BEFORE_SENDING
        sending.result = Interruption(
            kind="interrupted",
            transport_code="lease_late",
            response_id=sending.response_id,
            sequence_number=sending.sequence_number,
            had_output=sending.progressed,
        )
        return None

    async def _sleep_until(self, at: float) -> None:
        """The governor's waits (a pause every operation of the account shares; it checks
        again after): released by the scheduler a few per round, never all at once."""
        await self.host.scheduler.wait_released(at)


def _unreachable(
    record: OperationRecord, attempt_id: str, kind: str, command: CommandKind | None
) -> machine.Transition:
    del command  # recorded whatever arrives; the next interruptible step observes a command
    return machine.endpoint_unreachable(record, attempt_id, kind)

