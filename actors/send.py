"""Sending one approved attempt: connect, consume it durably, stream, settle.

The step from an approved attempt to its outcome, for an :class:`Execution`: connect to
the endpoint (a connection never established spends nothing), consume the attempt in
``before_send`` (persisted before the first byte of the request), stream under the rate
governor and the lease's transport deadline, then validate and save a completion or
record the failure (:func:`attempt_ended`, shared with the resumption of a background
response in ``actors/reattach.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable
from typing import Any, Final

import trio

from recoverable import _killpoints, errors, machine
from recoverable.actors.checkpoint import (
    StoppedAtCheckpoint,
    background_post,
    checkpointed_record,
)
from recoverable.actors.execution import CUT, Cut, Execution, Sending
from recoverable.actors.host import count_usage
from recoverable.contract import OutputInvalid
from recoverable.outcome import Completed, Interruption, Progress
from recoverable.records import CommandKind, OperationRecord
from recoverable.transport.connect import CONNECT_CODES, ConnectKind, EndpointGate
from recoverable.transport.ratelimit import estimate_tokens
from recoverable.types import AccountBinding

__all__ = ["attempt_ended", "settle", "transmit", "within"]


class _NotTransmitted(Exception):
    """Raised from ``before_send``: the recheck at consumption stopped the attempt."""


class _CutBeforeSending:
    """A transport cut at its lease's margin before anything was sent: try again (the
    lease renewed first), nothing spent."""


CUT_BEFORE_SENDING: Final = _CutBeforeSending()


class _Attempt(Sending):
    """One connect-and-send try of an execution, with its transport callbacks (methods of
    one object, no closures: their cells would be ~15 more objects tracked by the
    collector per attempt in flight)."""

    def __init__(
        self,
        ticket: int,
        execution: Execution,
        gate: EndpointGate,
        authorized: OperationRecord,
        attempt_id: str,
    ) -> None:
        super().__init__(ticket)
        self.execution = execution
        self.gate = gate
        self.authorized = authorized
        self.attempt_id = attempt_id

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
        execution = self.execution
        self.gate.succeeded(self.ticket)
        self.reported = True
        # The consumption write always completes: a store's write refuses cancellation
        # while it waits for its commit (``storage/writer.py``), so no shield of its own.
        consumed = await execution.advance(
            functools.partial(execution.approved, self.authorized, self.attempt_id)
        )
        self.consumed = consumed
        if not isinstance(consumed.action, machine.Transmit):
            raise _NotTransmitted
        execution.host.attempts_consumed += 1
        if execution.live is not None:
            execution.live.begin(consumed.record.attempts_used)
        _killpoints.hit("attempt.consumed_saved")
        execution.host.telemetry.emit("attempt.transmission_authorized",
                                      execution.operation_id,
                                      attempt=consumed.record.attempts_used)


async def transmit(
    execution: Execution, current: OperationRecord, attempt_id: str, token: str
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
    host = execution.host
    backend = host.backend
    assert backend is not None
    body = execution.body
    if body is None:
        raise errors.CorruptRecord(
            "the frozen body is missing", operation_id=execution.operation_id
        )
    gate = host.endpoint_gate(backend.endpoint_id)
    authorized = current
    first = True  # past the gate's bound, this execution's first try still probes
    while True:
        known = gate.failure
        if known is not None and authorized.endpoint_failure != known:
            # About to wait behind the shared backoff: record why (status, other processes).
            noted = await execution.advance(functools.partial(
                _unreachable, authorized, attempt_id, known
            ))
            authorized = noted.record
        result = await _connect_and_send(execution, authorized, attempt_id, token, body,
                                         gate, first)
        first = False
        if isinstance(result, machine.Transition):
            return result
        if isinstance(result, _CutBeforeSending):
            continue  # connecting again waits for the lease's renewal (guard.fresh)
        kind, authorized = result
        if authorized.endpoint_failure != kind:
            noted = await execution.advance(functools.partial(
                _unreachable, authorized, attempt_id, kind
            ))
            authorized = noted.record
        host.telemetry.emit("endpoint.unavailable", execution.operation_id, kind=kind,
                            failures=gate.failures)
        # Before the next try: still allowed (account, expiry, budget, commands)?
        recheck = execution.approved(authorized, attempt_id, execution.watching().command)
        if not isinstance(recheck.action, machine.Transmit):
            return await execution.advance(
                functools.partial(execution.approved, authorized, attempt_id)
            )


async def _connect_and_send(
    execution: Execution,
    authorized: OperationRecord,
    attempt_id: str,
    token: str,
    body: bytes,
    gate: EndpointGate,
    first: bool,
) -> machine.Transition | tuple[ConnectKind, OperationRecord] | _CutBeforeSending:
    """One try: the transition after the attempt, the connect failure, or a cut at the
    lease's margin before sending (both: nothing spent)."""
    host = execution.host
    backend = host.backend
    assert backend is not None
    guard = execution.guard
    if gate.failure is None:
        # An open gate admits at once, without a checkpoint: nothing could interrupt it,
        # so no cancel scope of its own (one less per attempt). A closed one may wait
        # (its shared backoff), interruptibly.
        ticket: int | Cut = await gate.admit()
    else:
        try:
            ticket = await execution.interruptible(gate.admit(first=first))
        except errors.EndpointUnavailable as down:
            # Unreachable past the runtime's bound: this execution ends, nothing spent.
            return await execution.advance(functools.partial(
                machine.endpoint_given_up, authorized, attempt_id,
                down.kind or "connect_failed", gate.unreachable_after,
            ))
    if isinstance(ticket, Cut):
        return await execution.on_stop(authorized)
    sending = execution.sending = _Attempt(ticket, execution, gate, authorized, attempt_id)
    estimate = estimate_tokens(body)
    live = execution.live
    # Only a live operation asks the transport for its deltas: no other stream pays.
    deltas: dict[str, Any] = {} if live is None else {"on_delta": live.push}
    streamed: Cut | None = CUT
    try:
        # The stream, interruptible (``Execution.interruptible`` inline: one coroutine
        # less per attempt in flight): CUT unless it ran to its end.
        with execution.watching().fresh_scope():
            async with host.scheduler.transmission_slot():
                # The rate governor, before connecting: waiting for budget spends nothing.
                # Its shared waits are released by the scheduler a few per round.
                await host.governor.admit(execution.operation_id, backend.endpoint_id,
                                          authorized.account, estimate,
                                          host.scheduler.wait_released)
                # No stream starts on a lease past its margin (late: renewed first).
                await guard.fresh()
                with guard.transport():  # the hard deadline: the lease's safety margin
                    if authorized.reattach:  # reattachable: a background POST, checkpointed
                        call = background_post(
                            execution, body, attempt_id, token, sending.on_progress,
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
                        sending.result = await within(execution, hard, call, sending)
                if guard.cut_late:
                    late = _cut_late(execution, authorized, sending)
                    if late is not None:
                        return late
                await guard.checkpoint()  # cut by it: stop here (the lease is lost)
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
            return await execution.on_stop(authorized)
        if isinstance(result, Completed):
            raise errors.ConfigurationUnavailable(
                "the backend sent a request without reporting the connection first",
                operation_id=execution.operation_id,
            )
        code = result.transport_code
        kind: ConnectKind = (
            code if code in CONNECT_CODES else "connect_failed"  # type: ignore[assignment]
        )
        gate.failed(ticket, kind)
        return kind, authorized
    current = sending.consumed.record
    if authorized.reattach:
        current = checkpointed_record(execution, current, attempt_id, sending)
    elif sending.progressed:
        current = machine.progress(
            current, attempt_id, sending.response_id, sending.sequence_number
        ).record
        execution.record = current
    if result is None:
        assert isinstance(streamed, Cut)
        return await execution.on_stop(current)
    # The stream ended before a stop could cut it: its outcome is used as received (a
    # completion is validated and saved; the step applies the stop on top).
    unsettled = await settle(execution, authorized.account, estimate, result,
                             current.retry_policy.maximum_retry_after)
    transition = await attempt_ended(execution, current, attempt_id, result)
    if unsettled is not None:
        raise unsettled
    return transition


async def settle(
    execution: Execution, account: AccountBinding, estimate: int,
    result: Completed | Interruption, maximum_pause: float,
) -> errors.RecoveryError | None:
    """The rate governor learns how the attempt ended — the shared pause (429), the
    x-ratelimit-* headers, the usage beyond the estimate — before the attempt's own record
    is written: the provider counted those tokens when it answered, so an admission made
    while the receipt is being saved must already see them (a slow disk made that window
    long enough for a 429). Its one write (none on an ungoverned runtime, or when nothing
    changes) refuses cancellation like every store write; a failure to write it never
    stops the outcome from being saved: it is returned, to raise after."""
    host = execution.host
    backend = host.backend
    assert backend is not None
    try:
        await host.governor.settle(
            execution.operation_id, backend.endpoint_id, account, estimate=estimate,
            outcome=result, maximum_pause=maximum_pause,
        )
    except errors.RecoveryError as exc:
        return exc
    return None


async def attempt_ended(
    execution: Execution, current: OperationRecord, attempt_id: str,
    result: Completed | Interruption,
) -> machine.Transition:
    """Validate and save a completion, or record the failure (the attempt is spent)."""
    host = execution.host
    operation_id = execution.operation_id
    if isinstance(result, Completed):
        try:
            payload = execution.contract.validate(result.text)
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
            count_usage(host, operation_id, result.usage, result.usage_malformed)
            done = current
            try:
                saved = await execution.advance(
                    lambda command: machine.completion_validated(
                        done, attempt_id, execution.context(command),
                        response_id=result.response_id,
                        sequence_number=result.sequence_number,
                        usage=result.usage,
                    ),
                    completion=payload,
                )
            except errors.StorageLimitExceeded as exc:
                raise errors.CompletionUnavailable(
                    "the validated completion could not be saved (store full)",
                    operation_id=operation_id, unsaved=True,
                ) from exc
            except errors.StorageUnavailable as exc:
                raise errors.CompletionUnavailable(
                    "the validated completion could not be saved",
                    operation_id=operation_id, unsaved=True,
                ) from exc
            if saved.record.has_completion:
                execution.payload = payload
                _killpoints.hit("receipt.saved")
                host.telemetry.emit("receipt.saved", operation_id, bytes=len(payload))
            return saved
    failure = result
    count_usage(host, operation_id, failure.usage, failure.usage_malformed)
    host.telemetry.emit("attempt.failed", operation_id, kind=failure.kind,
                        http_status=failure.http_status, code=failure.provider_code)
    failed_from = current
    return await execution.advance(
        lambda command: machine.attempt_failed(
            failed_from, attempt_id, failure, execution.context(command)
        )
    )


async def within(
    execution: Execution, seconds: float, call: Awaitable[Completed | Interruption],
    sending: Sending,
) -> Completed | Interruption:
    """Run one attempt's transport (``call``) under its hard timeout: never
    longer than ``seconds``, nor than the executing runtime's lease less its safety margin
    (a worker with a shorter lease than the preparer's still ends the call before its
    claim could expire). Cut, the attempt ends as a ``timeout`` interruption
    (``transport_code="hard_timeout"``: spent once sent, classified like any timeout;
    before the send, nothing was spent: a connect timeout)."""
    keeper = execution.guard.keeper
    limit = min(seconds, keeper.lease_seconds - keeper.margin)
    with trio.move_on_after(limit) as cut:
        return await call
    assert cut.cancelled_caught
    execution.host.telemetry.emit("attempt.hard_timeout", execution.operation_id)
    if sending.consumed is None:
        return Interruption(kind="timeout", transport_code="connect_timeout")
    return Interruption(
        kind="timeout",
        transport_code="hard_timeout",
        response_id=sending.response_id,
        sequence_number=sending.sequence_number,
        had_output=sending.progressed,
    )


def _cut_late(
    execution: Execution, authorized: OperationRecord, sending: _Attempt
) -> _CutBeforeSending | None:
    """The transport was cut at its lease's margin, the lease late but not lost (a busy
    event loop, a slow disk): the attempt ends as an interruption
    (``transport_code="lease_late"``, spent once sent, replaced within the budget after
    the lease is renewed) and the execution goes on; ``LeaseLost`` is only for a lease
    another owner may have taken. A background response is left for whoever holds the
    lease next to resume by its id, as when the lease is lost."""
    execution.host.telemetry.emit("attempt.lease_late", execution.operation_id)
    if authorized.reattach:
        execution.guard.lose()
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


def _unreachable(
    record: OperationRecord, attempt_id: str, kind: str, command: CommandKind | None
) -> machine.Transition:
    del command  # recorded whatever arrives; the next interruptible step observes a command
    return machine.endpoint_unreachable(record, attempt_id, kind)
