"""Supervision of operation actors: the runtime's nursery runs every active operation.

Each active operation is one :class:`Running`: a task of the runtime's supervisor
nursery running the operation's execution (``actors/execution.py``,
``actors/operation.py``) inside a cancel scope of its own. The execution holds
the operation's lease for the whole task and releases it before the execution is
marked finished, so whoever waits for the execution sees the lease gone.

``send_recovering`` starts an *attached* execution and awaits its outcome as its
caller. When the caller — the last one — goes away (Trio cancellation), the
execution's scope is cancelled, the actor suspends the operation durably (exactly as
when it ran in the caller's task) and the caller re-raises its ``Cancelled`` only
after the actor has unwound. A *detached* execution (:meth:`Supervisor.start` with
``attached=False``) runs with no caller at all, until it ends or the runtime closes
(which suspends it the same way); callers may still wait for its outcome.

One execution per operation per runtime: a second start while one runs raises
``OperationBusy`` (the seed: "a second sender receives operationBusy, never a
competing generation"); across runtimes and processes the lease says the same.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from recoverable import errors


def is_cancellation(exc: BaseException) -> bool:
    """Trio cancellation, also when an inner nursery grouped several ``Cancelled``."""
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        return rest is None
    return False


class Running:
    """One running execution of an operation, as its callers and the supervisor see it."""

    def __init__(self, operation_id: str, *, attached: bool) -> None:
        self.operation_id = operation_id
        self.attached = attached  # the last caller going away stops (suspends) it
        self.cancel_scope = trio.CancelScope()
        self.finished = trio.Event()
        self.callers = 0
        self.value: Any = None
        self.error: BaseException | None = None

    def stop(self) -> None:
        """Cancel the actor (it suspends the operation, then releases its lease)."""
        self.cancel_scope.cancel()

    async def outcome(self) -> Any:
        """Wait as a caller; return the actor's value or raise its error as itself.

        Cancelled while waiting: if this was the last caller of an attached execution,
        the actor is stopped and awaited (shielded) before the cancellation goes on.
        """
        self.callers += 1
        try:
            await self.finished.wait()
        except BaseException:
            self.callers -= 1
            if self.attached and self.callers == 0:
                self.stop()
                with trio.CancelScope(shield=True):
                    await self.finished.wait()
            raise
        self.callers -= 1
        if self.error is not None:
            if is_cancellation(self.error):
                # Stopped by the runtime closing (never by a caller still waiting): the
                # operation was suspended; this caller's own task was not cancelled.
                raise errors.OperationSuspended(
                    "the runtime closed", operation_id=self.operation_id
                ) from None
            raise self.error
        return self.value


class Supervisor:
    """The runtime's registry of running executions, over its supervisor nursery."""

    def __init__(self) -> None:
        self._nursery: trio.Nursery | None = None
        self.running: dict[str, Running] = {}

    def open(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    def close(self) -> None:
        """The runtime is closing: no new execution; running ones are cancelled with it."""
        self._nursery = None

    def start(
        self, operation_id: str, run: Callable[[], Awaitable[Any]], *, attached: bool
    ) -> Running:
        """Start ``run`` (an actor's whole execution) as a task of the supervisor nursery."""
        if self._nursery is None:
            raise errors.ConfigurationUnavailable(
                "the runtime is closed: open_runtime's block has ended",
                operation_id=operation_id,
            )
        if operation_id in self.running:
            raise errors.OperationBusy(operation_id=operation_id)
        execution = Running(operation_id, attached=attached)
        self.running[operation_id] = execution
        self._nursery.start_soon(self._supervise, execution, run)
        return execution

    async def _supervise(self, execution: Running, run: Callable[[], Awaitable[Any]]) -> None:
        try:
            with execution.cancel_scope:
                try:
                    execution.value = await run()
                except BaseException as exc:
                    # Every outcome goes to the callers, raised there as itself: nothing
                    # escapes into the supervisor nursery (it would end the runtime).
                    # A ``Cancelled`` stored here is never re-raised as such (see
                    # ``outcome``).
                    execution.error = exc
        finally:
            if self.running.get(execution.operation_id) is execution:
                del self.running[execution.operation_id]
            execution.finished.set()
