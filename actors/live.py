"""Live operations: partial views of an operation while it streams.

``Runtime.live(handle, response=..., authorize=...)`` returns a :class:`Live`: an async
context manager that runs the operation like ``send_recovering`` (an attached execution
of the supervisor nursery) and, while it streams, lets the host iterate ephemeral
:class:`~recoverable.partial.PartialView` values. The final value (``live.value``) is the
validated completion, saved as the receipt before it is available.

Between the transport and the consumer sits a :class:`LiveSlot`: the text of the current
attempt so far and a wakeup, nothing else. The transport appends each text delta to it
without awaiting (it never blocks on the consumer); the consumer takes a view of the
latest text when it asks. A slow consumer therefore sees fewer intermediate views (they
are dropped, not queued) and never misses the final value. Nothing of a view is written
to the store or to a receipt. See docs/live.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

import trio

from recoverable import errors
from recoverable.actors.checks import require_owner
from recoverable.actors.host import Authorize
from recoverable.actors.supervisor import Running
from recoverable.partial import PartialView, parse_partial
from recoverable.records import OperationRecord
from recoverable.storage.base import Store as RecoveryStore
from recoverable.types import AccountBinding, Handle, JsonSchema

__all__ = ["Live", "LiveSlot", "live", "require_live"]

ResultT = TypeVar("ResultT")


class Runtime(Protocol):
    """What ``live`` uses of the runtime (``actors/runtime.py`` implements it)."""

    store: RecoveryStore
    account: AccountBinding | None

    def start_operation(
        self,
        handle: Handle,
        *,
        response: type[Any] | JsonSchema,
        authorize: Authorize,
        expected_contract_version: str | None = ...,
        attached: bool = ...,
        live: LiveSlot | None = ...,
    ) -> Running: ...


def live(
    rt: Runtime,
    handle: Handle,
    *,
    response: type[ResultT] | JsonSchema,
    authorize: Authorize,
    **options: Any,
) -> Live[ResultT]:
    """Run a live operation (``prepare(..., live=True)``) and show it as it streams.

    ``async with runtime.live(handle, response=..., authorize=...) as live:``, then
    ``async for view in live: ...`` yields ephemeral ``PartialView`` values; after the
    loop ``live.value`` is the validated value, saved as the receipt first, exactly as
    ``send_recovering`` returns it. An interruption raises the typed terminal error from
    the loop. ``options``: ``send_recovering``'s (``expected_contract_version``).
    An operation not prepared with ``live=True`` is ``InvalidRequest``.
    """

    def start(slot: LiveSlot) -> Running:
        record = rt.store.get_operation(handle.operation_id)
        if record is not None:  # a missing one: the actor says so, as send_recovering's
            require_owner(rt.account, record.account, record.operation_id)
            require_live(record)
        return rt.start_operation(
            handle, response=response, authorize=authorize, attached=True, live=slot, **options
        )

    return Live(handle.operation_id, start)


def require_live(record: OperationRecord) -> None:
    """Only an operation prepared with ``live=True`` runs live: its interruption is
    never replaced, so no view can come from an attempt that a replacement hides."""
    if not record.live:
        raise errors.InvalidRequest(
            "the operation was not prepared with live=True: its interruptions may be "
            "replaced, so it cannot show partial views (use send_recovering)",
            operation_id=record.operation_id,
        )


class LiveSlot:
    """The latest text of a live operation's current attempt, and a wakeup.

    Written by the operation's transport task (``begin``, ``push``: synchronous, they
    never wait), read by the one consumer (``wait``, ``view``). It keeps the text of one
    attempt only: at most what the transport's ``StreamLimits.max_total_bytes`` lets in.
    """

    def __init__(self) -> None:
        self._chunks: list[str] = []
        self._text = ""
        self.attempt = 0  # the attempt number the text belongs to (0: none yet)
        self.updates = 0  # grows with every change (a delta, a new attempt)
        self.closed = False  # the execution ended: no more updates
        self._wake = trio.Event()

    def _changed(self) -> None:
        self.updates += 1
        if not self._wake.is_set():
            self._wake.set()

    def begin(self, attempt: int) -> None:
        """A new attempt was consumed: its text starts empty."""
        self._chunks.clear()
        self._text = ""
        self.attempt = attempt
        self._changed()

    def push(self, delta: str) -> None:
        """A text delta of the current attempt (the transport's ``on_delta``)."""
        self._chunks.append(delta)
        self._changed()

    def close(self) -> None:
        self.closed = True
        if not self._wake.is_set():
            self._wake.set()

    async def wait(self) -> None:
        """Until something changed since the last wait (or the slot closed)."""
        await self._wake.wait()
        self._wake = trio.Event()

    def text(self) -> str:
        if self._chunks:
            self._text += "".join(self._chunks)
            self._chunks.clear()
        return self._text

    def view(self) -> PartialView:
        text = self.text()
        return PartialView(
            text=text, partial=parse_partial(text), attempt=self.attempt, sequence=self.updates
        )

    def closing(self, run: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
        """``run`` (an actor's whole execution), closing this slot when it ends."""

        async def run_then_close() -> Any:
            try:
                return await run()
            finally:
                self.close()

        return run_then_close


class Live(Generic[ResultT]):
    """``async with runtime.live(handle, ...) as live: async for view in live: ...``.

    Entering starts the operation (an attached execution: ``OperationBusy`` if it is
    already running). Iterating yields :class:`PartialView` values while it streams and
    ends when the operation ends: then ``live.value`` is the validated value, saved as
    the receipt before it became available; a terminal error (an interruption of a live
    operation ends it ``failed``, reason ``interrupted``) is raised from the loop itself,
    as ``send_recovering`` raises it. Leaving the block before the loop ended stops the
    operation as a cancelled ``send_recovering`` does (suspended; an attempt in flight is
    interrupted, which ends a live operation ``failed``).
    """

    def __init__(self, operation_id: str, start: Callable[[LiveSlot], Running]) -> None:
        self.operation_id = operation_id
        self._start = start
        self._slot = LiveSlot()
        self._execution: Running | None = None
        self._seen = 0  # the slot's ``updates`` of the last view taken
        self._done = False
        self._value: Any = None
        self.views = 0  # views yielded so far (a slow consumer gets fewer than deltas)

    @property
    def value(self) -> ResultT:
        """The validated, saved value; only once the loop has ended."""
        if not self._done:
            raise errors.CompletionUnavailable(
                "the live operation has not delivered its value: iterate it to the end",
                operation_id=self.operation_id,
            )
        result: ResultT = self._value
        return result

    async def __aenter__(self) -> Live[ResultT]:
        if self._execution is not None:
            raise errors.InvalidRequest("a Live is entered once", operation_id=self.operation_id)
        self._execution = self._start(self._slot)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        execution = self._execution
        if execution is not None and not execution.finished.is_set():
            # Left before the end (a break, an exception, a cancellation): stop the
            # operation as a cancelled caller does, and return once it has unwound.
            execution.stop()
            with trio.CancelScope(shield=True):
                await execution.finished.wait()

    def __aiter__(self) -> Live[ResultT]:
        return self

    async def __anext__(self) -> PartialView:
        execution = self._execution
        if execution is None:
            raise errors.InvalidRequest(
                "iterate a Live inside its async with block", operation_id=self.operation_id
            )
        slot = self._slot
        while not self._done:
            if slot.updates != self._seen and slot.attempt:
                self._seen = slot.updates
                self.views += 1
                return slot.view()
            if slot.closed:
                # The value (or the typed terminal error) as send_recovering gives it.
                self._value = await execution.outcome()
                self._done = True
                break
            await slot.wait()
        raise StopAsyncIteration
