"""The batch host's acknowledgements, many per store write.

A job's line is appended to the result log (durable) before its operation is
acknowledged, as always; the acknowledgement itself no longer costs each job its own
store write. Jobs committed while one acknowledgement write runs are acknowledged together
by the next (``Runtime.acknowledge_many``: one write, one wait for the writer, each
operation acknowledged or refused on its own). A batch stopped before a group was written
loses nothing: its lines are durable, and the next run acknowledges them
(``BatchHost.acknowledge_committed``)."""

from __future__ import annotations

from collections.abc import Callable

import trio

from recoverable import errors
from recoverable.actors.runtime import Runtime
from recoverable.types import Handle

__all__ = ["Acknowledger"]

# Operations per write, at most (a write is one transaction: keep it short for the writer
# and for every write queued behind it).
GROUP_MAX = 512


class Acknowledger:
    """Acknowledges committed jobs in groups; :meth:`run` is the task that writes them."""

    def __init__(self, rt: Runtime, say: Callable[[str], None]) -> None:
        self._rt = rt
        self._say = say
        self._pending: list[tuple[str, Handle]] = []  # (job id, handle)
        self._ready = trio.Event()
        self._closing = False
        self.writes = 0  # acknowledgement writes made
        self.acknowledged = 0

    def add(self, job_id: str, handle: Handle) -> None:
        """The job's line is durable: acknowledge its operation with the next group."""
        self._pending.append((job_id, handle))
        self._ready.set()

    def close(self) -> None:
        """No more jobs: :meth:`run` writes what is pending, then returns."""
        self._closing = True
        self._ready.set()

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready = trio.Event()
            while self._pending:
                group, self._pending = self._pending[:GROUP_MAX], self._pending[GROUP_MAX:]
                await self._write(group)
            if self._closing:
                return

    async def _write(self, group: list[tuple[str, Handle]]) -> None:
        self.writes += 1
        try:
            refused = await self._rt.acknowledge_many(handle for _, handle in group)
        except errors.RecoveryError as exc:  # the whole write failed: none acknowledged
            refused = {handle.operation_id: exc for _, handle in group}
        self.acknowledged += len(group) - len(refused)
        for job_id, handle in group:
            failure = refused.get(handle.operation_id)
            if failure is not None:
                # The line is durable: a rerun acknowledges it without writing again.
                self._say(f"warning: job {job_id!r}: acknowledge failed ({failure.code}); "
                          "rerun to finish")
