"""The fenced reattachment checkpoint of a streaming attempt.

For an operation prepared with ``reattach=True``, the attempt's response id is saved as
soon as ``response.created`` arrives and its cursor (the last ``sequence_number``) at
bounded intervals (``reattachment.checkpoint_due``), each a fenced write of the actor
(a stale owner's write is refused). The stream's progress callback is synchronous, so
:class:`Checkpointer` keeps the latest report and a task of the stream's nursery writes
it; the write is shielded (a record half-known to this actor would let a later step
save an older cursor). The default operation never gets one: no task, no write.

:func:`checkpointed` runs one background stream of an execution with its checkpoint
writer beside it: the background POST (``actors/send.py``, :func:`background_post`) and
the resumption of a saved response (``actors/reattach.py``) both stream through it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from recoverable import _killpoints, errors, machine, reattachment
from recoverable.actors.execution import Execution, Sending
from recoverable.actors.host import reattach_client
from recoverable.outcome import Outcome, Progress
from recoverable.records import AttemptRecord, OperationRecord

Persist = Callable[[machine.Transition], Awaitable[None]]


class Checkpointer:
    """Saves the latest progress report of one attempt as its reattachment checkpoint."""

    def __init__(
        self,
        attempt_id: str,
        *,
        record: Callable[[], OperationRecord | None],
        persist: Persist,
        now: Callable[[], float],
    ) -> None:
        self._record = record  # the actor's latest saved record
        self._persist = persist  # the actor's fenced write (no command check)
        self._attempt_id = attempt_id
        self._now = now
        self._signal = trio.Event()
        self._closed = False
        self._response_id: str | None = None
        self._sequence_number: int | None = None
        self._background: bool | None = None  # what the response object said (Progress)
        self._saved_at = now()
        self.writes = 0  # checkpoint writes of this attempt (bench/reattach.py counts them)

    def note(self, report: Progress) -> None:
        """The stream's progress callback: keep the report; wake the writer when due."""
        if report.response_id is not None and self._response_id is None:
            self._response_id = report.response_id
        if report.sequence_number is not None:
            self._sequence_number = report.sequence_number
        if report.background is not None and self._background is None:
            self._background = report.background
        saved = self._saved()
        if saved is None:
            return
        since = 0
        if self._sequence_number is not None and saved.sequence_number is not None:
            since = self._sequence_number - saved.sequence_number
        if reattachment.checkpoint_due(
            saved, self._response_id, self._sequence_number,
            events_since=since, seconds_since=self._now() - self._saved_at,
        ):
            self._signal.set()

    def _saved(self) -> AttemptRecord | None:
        record = self._record()
        if record is None or record.phase != "transmitting" or not record.attempts:
            return None
        last = record.attempts[-1]
        if last.attempt_id != self._attempt_id or last.outcome != "in_flight":
            return None
        return last

    def close(self) -> None:
        """The stream ended: the writer finishes (the final cursor goes with the outcome)."""
        self._closed = True
        self._signal.set()

    async def run(self) -> None:
        """The writer task: one fenced write per wake-up, until :meth:`close`."""
        while True:
            await self._signal.wait()
            self._signal = trio.Event()
            if self._closed:
                return
            record = self._record()
            if record is None or self._saved() is None:
                continue
            step = reattachment.checkpoint(
                record, self._attempt_id, self._response_id, self._sequence_number,
                self._now(), self._background,
            )
            if not step.changed:
                continue
            with trio.CancelScope(shield=True):
                # Fenced by the lease: a newer owner's fence refuses it (LeaseLost).
                await self._persist(step)
            self.writes += 1
            self._saved_at = self._now()


class StoppedAtCheckpoint(Exception):
    """Raised from a background stream: a checkpoint write found the operation ended
    meanwhile (e.g. superseded; the write deleted the cancel command that was to
    tell the monitor) and persisted a Stop instead; ``transition`` is that Stop."""

    def __init__(self, transition: machine.Transition) -> None:
        super().__init__(transition.record.phase)
        self.transition = transition


async def background_post(
    execution: Execution,
    body: bytes,
    attempt_id: str,
    token: str,
    on_progress: Callable[[Progress], None],
    before_send: Callable[[], Awaitable[None]],
) -> Outcome:
    """The background POST over HTTP SSE (also for a WebSocket backend), with its fenced
    checkpoint written while it streams."""
    client = reattach_client(execution.host.backend)
    if client is None:
        raise errors.ConfigurationUnavailable(
            "the backend cannot stream background responses (reattach=True)",
            operation_id=execution.operation_id,
        )
    return await checkpointed(execution, attempt_id, on_progress, lambda report: client.stream(
        body, attempt_id=attempt_id, token=token, on_progress=report,
        before_send=before_send,
    ))


async def checkpointed(
    execution: Execution,
    attempt_id: str,
    on_progress: Callable[[Progress], None],
    call: Callable[[Callable[[Progress], None]], Awaitable[Outcome]],
) -> Outcome:
    """Run one background stream (``call``) with its checkpoint writer beside it; what
    the stream raises is raised as itself, never inside an ExceptionGroup."""
    stops: list[machine.Transition] = []
    host = execution.host

    async def persist(step: machine.Transition) -> None:
        written = await execution.persist(step, check_commands=False)
        if isinstance(written.action, machine.Stop):  # ended meanwhile (superseded)
            stops.append(written)
            nursery.cancel_scope.cancel()
            return
        _killpoints.hit("reattach.checkpoint_saved")
        saved = step.record.attempts[-1]
        host.telemetry.emit("attempt.checkpointed", execution.operation_id,
                            attempt=saved.number, sequence_number=saved.sequence_number)

    checkpointer = Checkpointer(
        attempt_id, record=lambda: execution.record, now=host.now, persist=persist
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
    execution.checkpoint_writes += checkpointer.writes
    if refused:
        raise refused[0]
    if stops:
        raise StoppedAtCheckpoint(stops[0])
    if raised:
        raise raised[0]
    assert outcome is not None
    return outcome


def checkpointed_record(
    execution: Execution, consumed: OperationRecord, attempt_id: str, sending: Sending
) -> OperationRecord:
    """The record after a background stream: its saved checkpoints (``execution.record``)
    and the last cursor seen, merged in memory (never backwards)."""
    current = execution.record if execution.record is not None else consumed
    if sending.progressed:
        current = reattachment.checkpoint(
            current, attempt_id, sending.response_id, sending.sequence_number,
            execution.host.now(), sending.background,
        ).record
        execution.record = current
    return current
