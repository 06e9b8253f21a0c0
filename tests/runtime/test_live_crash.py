"""A live operation whose runtime dies or hangs (issue 16; seed 004's live-session row: "if
its runtime disappears, the admitted generation fails and all late events are fenced;
ephemeral deltas never become final evidence").

A real child process (``live_child.py``) runs ``runtime.live`` on an operation streamed by
the fixture provider (this test's event loop, a loopback socket) and prints each partial
view it shows. Then it is SIGKILLed, or stopped (SIGSTOP) while holding the lease:

- SIGKILL: the sweep fails the admitted generation in one transaction (``owner_lost``),
  inventing no completion and no usage;
- SIGSTOP, its lease expires, the sweep fails it; SIGCONT: nothing the stale process
  writes lands (its renewal, its attempt's close, its completion: all fenced);
- in both, no partial view it showed is in the store's files, and a manual retry then
  continues with a linked successor (run live here, to its saved value).

Barriers: the child's printed views, durable state, the kernel's stop notification
(``waitpid`` with ``WUNTRACED``), the provider's request log; the one wait on the wall
clock waits for a known instant (the lease's expiry).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

import recoverable
from recoverable.actors.sweep import sweep
from recoverable.testing import FixtureProvider, Reply

from .conftest import Authorizer, generation_requests, owner_gone, stopped
from .live_child import ACCOUNT, REQUEST, Story
from .live_scan import assert_views_never_stored

CHILD = str(Path(__file__).with_name("live_child.py"))
pytestmark = pytest.mark.both_stores
LEASE_SECONDS = 3.0  # the child's leases: short, so a test waits ~3 s for an expiry
BOUND = 60.0  # generous: a loaded 2-core machine may deschedule a process for seconds


class Child:
    """The live child: its process and the JSON lines it printed."""

    def __init__(self, store: str, provider: FixtureProvider, op: str, mode: str,
                 env: dict[str, str] | None = None) -> None:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("RECOVERABLE_KILL")}
        self.process = subprocess.Popen(
            [sys.executable, CHILD, "--store", store, "--base-url", provider.http_url,
             "--operation-id", op, "--mode", mode, "--lease-seconds", str(LEASE_SECONDS)],
            env={**clean, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        self.lines: list[dict[str, Any]] = []

    async def line(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        with trio.fail_after(BOUND):
            raw = await trio.to_thread.run_sync(self.process.stdout.readline)
        assert raw, self.stderr()
        event: dict[str, Any] = msgspec.json.decode(raw)
        self.lines.append(event)
        return event

    async def shown(self) -> str:
        """Until the child has shown a person some partial output; that text."""
        while not (event := await self.line()).get("view"):
            assert "view" in event, event
        text: str = event["view"]
        return text

    def views(self) -> list[str]:
        return [line["view"] for line in self.lines if "view" in line]

    def stderr(self) -> bytes:
        return self.process.stderr.read() if self.process.stderr else b""

    def reap(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.send_signal(signal.SIGCONT)
            self.process.wait(30)


def backend(provider: FixtureProvider, mode: str = "sse") -> recoverable.ResponsesBackend:
    return recoverable.ResponsesBackend(
        provider.http_url, mode=mode, endpoint_id="fixture",  # type: ignore[arg-type]
        credentials=recoverable.StaticCredentials("sk-live-parent", account=ACCOUNT),
    )


async def _continue_with_a_successor(
    rt: recoverable.Runtime, handle: recoverable.Handle
) -> recoverable.Receipt:
    """The explicit new action: a manual retry, run live to its saved value."""
    status = await rt.status(handle)
    assert status.state == "failed" and status.suggested_actions == ("manual_retry", "abandon")
    successor = await rt.retry(handle, retry_action_id="continue", maximum_attempts=2)
    async with rt.live(successor, response=Story, authorize=Authorizer()) as live:
        async for _ in live:
            pass
    receipt = await rt.receipt(successor)
    assert live.value == msgspec.json.decode(receipt.payload, type=Story)
    assert receipt.previous_operation_id == handle.operation_id
    assert receipt.root_operation_id == handle.operation_id
    return receipt


@pytest.mark.parametrize("mode", ["sse", "websocket"])
async def test_sigkill_mid_stream_the_sweep_fails_it_then_a_successor_continues(
    store_location: str, mode: str
) -> None:
    path = store_location  # a directory (LMDB) or a database URL (PostgreSQL)
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.stall(after_events=6), Reply.synthesize()])
        with recoverable.RecoveryStore.open(str(path)) as store:
            async with backend(provider, mode) as b, recoverable.open_runtime(
                store, b, account=ACCOUNT
            ) as rt:
                handle = await rt.prepare(REQUEST, response=Story, maximum_attempts=3, live=True)
                op = handle.operation_id
                child = Child(str(path), provider, op, mode)
                try:
                    shown = await child.shown()
                    child.process.kill()  # SIGKILL
                    assert await trio.to_thread.run_sync(child.process.wait) == -signal.SIGKILL
                finally:
                    child.reap()
                before = store.get_operation(op)
                assert before is not None and before.phase == "transmitting"
                dead = store.get_lease(op)
                assert dead is not None
                await owner_gone(store, dead.owner_id)
                report = await sweep(store, now=time.time())
                assert report.failed_ids == (op,) and report.waiting == 0
                after = store.get_operation(op)
                assert after is not None and after.phase == "failed"
                assert after.failure_reason == "owner_lost" and after.attempts_used == 1
                last = after.attempts[-1]
                assert last.outcome == "interrupted" and last.failure is not None
                assert last.failure.transport_code == "owner_lost"
                # Nothing invented: no completion, no usage, no response id.
                assert last.usage is None and last.response_id is None
                assert not after.has_completion and store.get_payload(op, "completion") is None
                assert after.fence == before.fence + 1 and store.get_lease(op) is None
                assert shown and child.views()
                assert_views_never_stored(path, child.views(), control=REQUEST.input)
                await _continue_with_a_successor(rt, handle)
        assert len(generation_requests(provider, op)) == 1


@pytest.mark.parametrize("stop_at", ["mid_stream", "receipt.before_save"])
async def test_a_stopped_live_owner_is_failed_by_the_sweep_and_fenced_out(
    store_location: str, stop_at: str
) -> None:
    path = store_location  # a directory (LMDB) or a database URL (PostgreSQL)
    async with FixtureProvider.serve() as provider:
        first = Reply.stall(after_events=6) if stop_at == "mid_stream" else Reply.synthesize()
        provider.script([first, Reply.synthesize()])
        with recoverable.RecoveryStore.open(str(path)) as store:
            async with backend(provider) as b, recoverable.open_runtime(
                store, b, account=ACCOUNT
            ) as rt:
                handle = await rt.prepare(REQUEST, response=Story, maximum_attempts=3, live=True)
                op = handle.operation_id
                env = ({} if stop_at == "mid_stream" else
                       {"RECOVERABLE_KILL_AT": stop_at, "RECOVERABLE_KILL_SIGNAL": "STOP"})
                child = Child(str(path), provider, op, "sse", env)
                try:
                    await _hang(child, store, op, stop_at)
                    lease = store.get_lease(op)
                    assert lease is not None and lease.expires_at is not None
                    while (left := lease.expires_at - time.time()) > 0:  # noqa: ASYNC110
                        await trio.sleep(left)  # waiting for a known instant: the expiry
                    report = await sweep(store, now=time.time())
                    assert report.failed_ids == (op,)
                    failed = store.get_operation(op)
                    assert failed is not None and failed.phase == "failed"
                    assert failed.failure_reason == "owner_lost"
                    assert failed.fence == lease.fence + 1
                    child.process.send_signal(signal.SIGCONT)  # the stale owner goes on
                    with trio.fail_after(BOUND):
                        code = await trio.to_thread.run_sync(child.process.wait)
                    assert code == 0, child.stderr()
                finally:
                    child.reap()
                assert child.process.stdout is not None
                for raw in child.process.stdout.read().splitlines():
                    child.lines.append(msgspec.json.decode(raw))
                # The stale process learnt it lost the operation; nothing it did landed.
                assert child.lines[-1] == {"error": "lease_lost"}, child.lines
                assert store.get_operation(op) == failed
                assert store.get_payload(op, "completion") is None
                assert store.get_lease(op) is None
                assert_views_never_stored(path, _partial(child.views()), control=REQUEST.input)
                await _continue_with_a_successor(rt, handle)
        assert len(generation_requests(provider, op)) == 1


def _partial(views: list[str]) -> list[str]:
    """The views that are not the whole answer. At ``receipt.before_save`` the stale child
    holds the whole validated answer, and tries to save it when it wakes: that write is
    refused (the store has no completion row, checked above), but LMDB does not clear the
    page buffers it reuses, so the aborted write's bytes can remain in the unused space of
    a page that a later, unrelated commit (the child's rate-governor row) writes to the
    data file. A view of the whole answer is that same text; the partial ones must be
    nowhere."""
    return [view for view in views if not _whole(view)]


def _whole(text: str) -> bool:
    try:
        msgspec.json.decode(text, type=Story)
    except msgspec.DecodeError:
        return False
    return True


async def _hang(child: Child, store: recoverable.RecoveryStore, op: str, stop_at: str) -> None:
    """Bring the child to its hung state: stopped while holding the lease."""
    if stop_at != "mid_stream":
        await stopped(child.process.pid)  # it stopped itself with the validated completion in hand
        record = store.get_operation(op)
        assert record is not None and record.phase == "transmitting"
        return
    await child.shown()

    def just_renewed() -> bool:
        # Stop it right after a heartbeat commit (its next write is lease_seconds/3
        # away): a process stopped inside a commit would hold LMDB's write lock.
        lease = store.get_lease(op)
        return lease is not None and lease.expires_at is not None and (
            lease.expires_at > lease.acquired_at + LEASE_SECONDS
        )

    with trio.fail_after(BOUND):
        while not just_renewed():  # noqa: ASYNC110 (another process's durable state)
            await trio.sleep(0.005)
    child.process.send_signal(signal.SIGSTOP)
    await stopped(child.process.pid)
    record = store.get_operation(op)
    assert record is not None and record.phase == "transmitting" and record.attempts_used == 1
