"""Reattach instead of regenerate: an execution's side of ``machine.Reattach``.

:func:`reattach` is the one step the machine asks for before it would replace an
interrupted attempt of a ``reattach=True`` operation: resume the attempt's saved
background response by its id. The record saved
before this step already has the attempt in flight again and its reattachment counted
(``reattachment.begin``): a crash during the GET is one more try of a bounded number.
It runs under the lease (its hard transport deadline), inside the monitor's cancel scope
(a suspend, a cancel, a sign-out cut it), with the account already checked by the
machine; no authorize call, no rate-governor admission, no budget. The stream is
resumed after the saved cursor (the rest of the events, live or already finished; its
checkpoint written as it goes), and what it ends with is handled exactly like a streamed
attempt's outcome (``send.attempt_ended``: a completion is validated and saved as the
receipt, fenced; a failure goes to the machine, which may resume again or let seed 000
decide). After the operation is cancelled, :func:`cancel_on_server` asks the provider
to stop the background response (best effort, recorded in telemetry).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import msgspec
import trio

from recoverable import _killpoints, errors, machine
from recoverable.actors.checkpoint import StoppedAtCheckpoint, checkpointed, checkpointed_record
from recoverable.actors.execution import Cut, Execution, Sending
from recoverable.actors.host import OperationHost, reattach_client
from recoverable.actors.send import attempt_ended, settle, within
from recoverable.outcome import Completed, Interruption, Outcome, Progress
from recoverable.records import OperationRecord
from recoverable.storage.base import WriteTransaction
from recoverable.transport.base import validate_api_key
from recoverable.transport.connect import CONNECT_CODES, ConnectKind
from recoverable.transport.ratelimit import estimate_tokens

# A cancel request to the provider after the operation's cancel is durable: bounded, and
# never allowed to hold the execution up longer than this.
SERVER_CANCEL_SECONDS = 10.0
# The terminal phases whose background response is cancelled on the server: cancelled, and
# superseded (a manifest change or a newer revision of its source: its result never counts).
STOPPED = frozenset({"cancelled", "superseded"})


def outcome_connect_code(outcome: Outcome) -> ConnectKind | None:
    """The connect kind of an outcome that never reached the server, else ``None``."""
    if isinstance(outcome, Interruption) and outcome.transport_code in CONNECT_CODES:
        return cast(ConnectKind, outcome.transport_code)
    return None


async def reattach(
    execution: Execution, current: OperationRecord, action: machine.Reattach
) -> machine.Transition:
    """Resume the attempt's saved background response after its saved cursor (no new
    POST, no budget), and handle its outcome like a streamed attempt's."""
    host = execution.host
    operation_id = execution.operation_id
    backend = host.backend
    client = reattach_client(backend)
    if backend is None or client is None:
        raise errors.ConfigurationUnavailable(
            "no backend that can resume a background response (reattach=True)",
            operation_id=operation_id,
        )
    attempt_id = action.attempt_id
    last = current.attempts[-1]
    _killpoints.hit("reattach.saved")
    host.telemetry.emit("attempt.reattaching", operation_id, attempt=last.number,
                        reattachments=last.reattachments, after=action.after)
    token = await execution.interruptible(backend.credentials.token())
    if isinstance(token, Cut) or execution.watching().account_stop is not None:
        return await execution.on_stop(current)
    validate_api_key(token, what="the credentials' token")
    sending = execution.sending = Sending(0)

    def on_progress(report: Progress) -> None:
        sending.progressed = True
        sending.response_id = report.response_id
        sending.sequence_number = report.sequence_number
        if report.background is not None:
            sending.background = report.background

    # The attempt is already consumed (its first POST was): a cut is a hard timeout.
    sending.consumed = machine.Transition(current, None, False)
    hard = current.attempt_timeout  # the hard timeout bounds every call of the attempt

    # Resume tries of one attempt in this execution are spaced by the endpoint's connect
    # backoff (0.5 s, then 1 s by default): the try before this one lost its stream, and
    # the server (or a proxy in front of it) may be restarting.
    resumed_id, resumed = execution.resume_tries
    tried = resumed if resumed_id == attempt_id else 0
    execution.resume_tries = (attempt_id, tried + 1)
    gate = host.endpoint_gate(backend.endpoint_id)

    async def connected(report: Callable[[Progress], None]) -> Outcome:
        """This counted try's GET: one that cannot connect asked nothing and spends
        nothing of the try; it waits on the endpoint's shared connect backoff (as a POST
        does) and is sent again, bounded by the gate's ``unreachable_after``, the lease
        and the attempt's hard timeout."""
        first = True
        while True:
            try:
                ticket = await gate.admit(first=first)
            except errors.EndpointUnavailable as down:
                return Interruption(
                    kind="disconnected", transport_code=down.kind or "connect_failed",
                    response_id=action.response_id, sequence_number=action.after,
                )
            first = False
            outcome: Outcome | None = None
            try:
                outcome = await client.resume(
                    action.response_id, after=action.after, attempt_id=attempt_id,
                    token=token, on_progress=report,
                )
            finally:
                code = None if outcome is None else outcome_connect_code(outcome)
                if outcome is None:
                    gate.abandon(ticket)
                elif code is None:
                    gate.succeeded(ticket)
                else:
                    gate.failed(ticket, code)
            if code is None:
                return outcome
            host.telemetry.emit("endpoint.unavailable", operation_id, kind=code,
                                failures=gate.failures)

    async def resume() -> None:
        if tried:  # interruptible, but no call of the attempt: outside its hard timeout
            await trio.sleep(gate.backoff.delay(tried))
        with execution.guard.transport():  # the hard deadline: the lease's safety margin
            call = checkpointed(execution, attempt_id, on_progress, connected)
            if hard is None:
                sending.result = await call
            else:
                sending.result = await within(execution, hard, call, sending)
        await execution.guard.checkpoint()  # cut by it: stop here (the lease is lost)

    try:
        streamed = await execution.interruptible(resume())
    except StoppedAtCheckpoint as stopped:
        return stopped.transition  # persisted; its Stop says why (superseded)
    current = checkpointed_record(execution, current, attempt_id, sending)
    result = sending.result
    if result is None:
        assert isinstance(streamed, Cut)
        return await execution.on_stop(current)
    host.reattachments += 1
    host.telemetry.emit(
        "attempt.reattached", operation_id, attempt=last.number,
        completed=isinstance(result, Completed),
        kind=None if isinstance(result, Completed) else result.kind,
    )
    # The rate governor's usage correction: the POST's estimate was charged when it was
    # admitted; the tokens the resumed response reports settle the rest (first:
    # ``send.settle``).
    unsettled = await settle(execution, current.account, estimate_tokens(execution.body or b""),
                             result, current.retry_policy.maximum_retry_after)
    transition = await attempt_ended(execution, current, attempt_id, result)
    if unsettled is not None:
        raise unsettled
    return transition


async def cancel_on_server(host: OperationHost, record: OperationRecord) -> str | None:
    """Ask the provider to cancel the last attempt's background response of a cancelled
    (or superseded: its result can never count) ``reattach=True`` operation
    (best effort, bounded, never raises). Returns what the provider answered
    (``transport.resume.CancelResult``), or ``None`` when there was nothing to cancel."""
    if record.phase not in STOPPED or not record.reattach or not record.attempts:
        return None
    last = record.attempts[-1]
    if last.response_id is None or last.outcome == "completed":
        return None
    if last.server_cancel in ("cancelled", "ended", "gone"):
        return None  # the provider already answered for good (a cancel is idempotent)
    backend = host.backend
    client = reattach_client(backend)
    if backend is None or client is None:
        return None
    result = "failed"
    # Shielded (the cancel that led here must not cut it), bounded by its own deadline.
    with trio.CancelScope(deadline=trio.current_time() + SERVER_CANCEL_SECONDS, shield=True):
        try:
            token = await backend.credentials.token()
            result = await client.cancel(last.response_id, token=token)
        except Exception:  # best effort: the cancel itself is already durable
            result = "failed"
    host.telemetry.emit("attempt.server_cancel", record.operation_id, attempt=last.number,
                        result=result)
    with trio.CancelScope(shield=True):
        try:
            await host.store.write(functools.partial(
                record_server_cancel, record.operation_id, last.attempt_id, result
            ))
        except errors.RecoveryError:
            pass  # best effort: the telemetry event says what the provider answered
    return result


def record_server_cancel(
    operation_id: str, attempt_id: str, result: str, txn: WriteTransaction
) -> None:
    """Save on the cancelled (or superseded) operation's attempt what the provider answered
    to the cancel of its background response (the operation is terminal: nothing else
    writes it)."""
    record = txn.get_operation(operation_id)
    if record is None or record.phase not in STOPPED or not record.attempts:
        return
    last = record.attempts[-1]
    if last.attempt_id != attempt_id or last.server_cancel == result:
        return
    updated = msgspec.structs.replace(last, server_cancel=result)
    txn.put_operation(msgspec.structs.replace(record, attempts=(*record.attempts[:-1], updated)))
