"""Shared helpers of the in-process ``reattach=True`` tests (issue 15): test_reattach.py,
test_reattach_retry.py and test_reattach_sources.py.

The long scripted answer (and a reply cutting it), a telemetry sink that wakes waiters
by event name, the reattaching prepare, the runtime over the fixture provider, the
provider's request logs, and the step "send in the background until the first checkpoint
(the response id) is saved, then interrupt it" (and that step as a suspension)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import attrs
import pytest
import trio

import recoverable
from recoverable import errors
from recoverable.telemetry import TelemetryEvent
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend

FAST = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
LONG = {"answer": 42, "note": "n" * 400}  # with deltas=(200, 200): 200 delta events
EXPECTED = Answer(answer=42, note="n" * 400)


def cut(after_events: int) -> Reply:
    """The long answer, its connection dropped after ``after_events`` events (a background
    response goes on generating on the server)."""
    return attrs.evolve(Reply.complete(LONG), disconnect_after=after_events)


class Events:
    """A telemetry sink that remembers every event and wakes waiters by name."""

    def __init__(self) -> None:
        self.seen: list[TelemetryEvent] = []
        self._changed = trio.Event()

    def __call__(self, event: TelemetryEvent) -> None:
        self.seen.append(event)
        self._changed.set()
        self._changed = trio.Event()

    def named(self, name: str) -> list[TelemetryEvent]:
        return [event for event in self.seen if event.name == f"recovery.{name}"]

    async def wait_for(self, name: str, count: int = 1) -> None:
        while len(self.named(name)) < count:
            await self._changed.wait()


def resumes(provider: FixtureProvider, kind: str = "resume") -> list[Any]:
    """The provider's retrievals of one kind (``resume`` GETs, or ``cancel``)."""
    return [retrieval for retrieval in provider.retrievals if retrieval.kind == kind]


def posts(provider: FixtureProvider, operation_id: str) -> int:
    """How many generation POSTs the operation made."""
    return len(generation_requests(provider, operation_id))


def fixture_runtime(
    store: recoverable.RecoveryStore, provider: FixtureProvider, telemetry: Events | None = None
) -> AbstractAsyncContextManager[recoverable.Runtime]:
    """A runtime over the provider's SSE backend, for ACCOUNT."""
    return recoverable.open_runtime(
        store, make_backend(provider), account=ACCOUNT, telemetry=telemetry
    )


async def prepare(rt: recoverable.Runtime, **options: Any) -> recoverable.Handle:
    """Prepare REQUEST with ``reattach=True`` (3 attempts, no backoff unless told)."""
    options.setdefault("maximum_attempts", 3)
    options.setdefault("retry_policy", FAST)
    return await rt.prepare(REQUEST, response=Answer, reattach=True, **options)


async def interrupt_at_checkpoint(
    rt: recoverable.Runtime,
    handle: recoverable.Handle,
    events: Events,
    interrupt: Callable[[], Awaitable[object]],
    raises: type[Exception],
) -> None:
    """Send ``handle`` in the background; once its first checkpoint is saved (the response
    id: it can be reattached), run ``interrupt``. The send must end by raising ``raises``."""
    async with trio.open_nursery() as nursery:
        async def send() -> None:
            with pytest.raises(raises):
                await rt.send_recovering(handle, response=Answer, authorize=Authorizer())

        nursery.start_soon(send)
        await events.wait_for("attempt.checkpointed")
        await interrupt()


@asynccontextmanager
async def suspended_mid_stream(
    store: recoverable.RecoveryStore,
) -> AsyncIterator[tuple[FixtureProvider, recoverable.Runtime, recoverable.Handle]]:
    """An operation of one attempt (``maximum_attempts=1``) streaming the long answer,
    suspended once its response id is saved; yields the provider, the open runtime and the
    handle. About 6 s of generation: the suspension lands long before it ends."""
    events = Events()
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.03) as provider:
        provider.script([Reply.complete(LONG)])
        async with fixture_runtime(store, provider, events) as rt:
            handle = await prepare(rt, maximum_attempts=1)
            await interrupt_at_checkpoint(rt, handle, events, lambda: rt.suspend(handle),
                                          errors.OperationSuspended)
            yield provider, rt, handle
