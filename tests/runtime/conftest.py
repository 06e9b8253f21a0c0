from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import pytest
import trio

import recoverable
from recoverable.testing import FixtureProvider

ACCOUNT = recoverable.AccountBinding("acct-1", "api-key")
OTHER = recoverable.AccountBinding("acct-2", "api-key")


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


REQUEST = recoverable.StructuredRequest(
    model="gpt-test", instructions="Answer briefly.", input="What is six times seven?"
)


class Authorizer:
    """Records every callback; approves unless told otherwise."""

    def __init__(self, approve: bool = True) -> None:
        self.approve = approve
        self.calls: list[recoverable.Attempt] = []

    async def __call__(self, attempt: recoverable.Attempt) -> bool:
        self.calls.append(attempt)
        return self.approve


class RenewingCredentials:
    """Hands out a first token, and a renewed one on ``renew=True``."""

    def __init__(self, first: str, renewed: str, account: recoverable.AccountBinding) -> None:
        self._first = first
        self._renewed = renewed
        self._account = account
        self.renewals = 0

    @property
    def account(self) -> recoverable.AccountBinding:
        return self._account

    async def token(self, *, renew: bool = False) -> str:
        if renew:
            self.renewals += 1
            return self._renewed
        return self._first


@pytest.fixture
async def provider() -> AsyncIterator[FixtureProvider]:
    async with FixtureProvider.serve() as p:
        yield p


@pytest.fixture(params=["websocket", "sse"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(store_location: str) -> Iterator[recoverable.RecoveryStore]:
    # tmp_path/"store" (LMDB), or also a fresh PostgreSQL database in the modules marked
    # both_stores (tests/pg/fixtures.py; issue 17: one suite, two stores).
    s = recoverable.RecoveryStore.open(store_location)
    try:
        yield s
    finally:
        s.close()


def make_backend(
    provider: FixtureProvider, mode: str = "sse", credentials: Any = None
) -> recoverable.ResponsesBackend:
    creds = credentials or recoverable.StaticCredentials("sk-test-secret", account=ACCOUNT)
    return recoverable.ResponsesBackend(
        provider.http_url, credentials=creds, mode=mode, endpoint_id="fixture"  # type: ignore[arg-type]
    )


def generation_requests(provider: FixtureProvider, operation_id: str) -> list[Any]:
    return [r for r in provider.requests if (r.attempt_id or "").startswith(operation_id + ".")]


async def completed_operations(rt: recoverable.Runtime, count: int) -> list[recoverable.Handle]:
    """``count`` operations prepared and sent to completion (receipts saved, not
    acknowledged)."""
    handles = []
    for _ in range(count):
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        handles.append(handle)
    return handles


async def owner_gone(store: recoverable.RecoveryStore, owner_id: str) -> None:
    """Return once a SIGKILLed process's owner is dead to ``store``: at once on LMDB (its
    lock goes with the process), a few milliseconds after the process is reaped on
    PostgreSQL (the server ends the session when it reads the closed socket)."""
    with trio.fail_after(30):
        while store.owner_is_live(owner_id):  # noqa: ASYNC110
            await trio.sleep(0.005)  # another process's state, on the server


async def stopped(pid: int) -> None:
    """Return once the kernel says the child ``pid`` is stopped (its stop notification,
    not a guess)."""
    _, status = await trio.to_thread.run_sync(os.waitpid, pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), status


class ShiftedWall:
    """The wall clock, moved forward only when the test steps it (``shift``): a wait on
    it ends when the test says, never while a loaded machine is still starting the tasks
    that wait (step it, then call the runtime's ``scheduler.recheck()``)."""

    def __init__(self) -> None:
        self.shift = 0.0

    def __call__(self) -> float:
        return time.time() + self.shift
