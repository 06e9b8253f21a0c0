"""The fenced reattachment checkpoint of a streaming attempt.

For an operation prepared with ``reattach=True``, the attempt's response id is saved as
soon as ``response.created`` arrives and its cursor (the last ``sequence_number``) at
bounded intervals (``reattachment.checkpoint_due``), each a fenced write of the actor
(a stale owner's write is refused). The stream's progress callback is synchronous, so
:class:`Checkpointer` keeps the latest report and a task of the stream's nursery writes
it; the write is shielded (a record half-known to this actor would let a later step
save an older cursor). The default operation never gets one: no task, no write.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from recoverable import machine, reattachment
from recoverable.outcome import Progress
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
