"""Worker death with a derivative lease (issue 16, seed 004's semantic derivatives).

A real child process (``lease_child.py``) streams a source-bound operation from the
fixture provider (which stalls mid-stream) and is SIGKILLed while it holds the lease. A
plain operation's lease dies with its owner's lock; a derivative's is reclaimed only once
it EXPIRED: before ``expires_at`` another runtime's ``send_recovering`` is
``OperationBusy`` and the sweep leaves it alone, even though its owner is dead; after, the
sweep makes it reclaimable (process death → reclaimable, the in-flight attempt spent and
closed as interrupted) and a new claim completes it with a higher fence.

The parent's wall clock is injected and pinned either side of the durable ``expires_at``
(read from the lease row): no wait on real time, no fixed sleep. Barriers: the provider's
request log and the store's rows.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import recoverable
from recoverable.actors.sweep import sweep
from recoverable.testing import FixtureProvider, Reply

from .conftest import generation_requests, owner_gone
from .lease_child import ACCOUNT, Answer

CHILD = str(Path(__file__).with_name("lease_child.py"))
BOUND = 60.0  # generous: a loaded 2-core machine may deschedule a process for seconds
DOC = recoverable.SourceRef("doc-1", "sha256:v1")
pytestmark = pytest.mark.both_stores


class Pinned:
    """The parent runtime's wall clock, pinned where the test puts it."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


async def _until(predicate: object) -> None:
    """Poll durable state written by another process (a barrier, bounded by BOUND)."""
    with trio.fail_after(BOUND):
        while not predicate():  # type: ignore[operator]  # noqa: ASYNC110 (another process)
            await trio.sleep(0.005)


def _spawn(store: str, provider: FixtureProvider, op: str, report: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, CHILD, "--store", store, "--base-url", provider.http_url,
         "--operation-id", op, "--lease-seconds", "30", "--report", str(report)],
        env={k: v for k, v in os.environ.items() if not k.startswith("RECOVERABLE_KILL")},
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("bound", [True, False], ids=["derivative", "plain"])
async def test_a_dead_workers_derivative_lease_is_reclaimed_only_after_expiry(
    tmp_path: Path, store_location: str, bound: bool
) -> None:
    store_path = store_location  # a directory (LMDB) or a database URL (PostgreSQL)
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.stall(after_events=2), Reply.complete({"answer": 2})])
        with recoverable.RecoveryStore.open(store_path) as store:
            backend = recoverable.ResponsesBackend(
                provider.http_url,
                credentials=recoverable.StaticCredentials("sk-parent", account=ACCOUNT),
                mode="sse", endpoint_id="fixture",
            )
            clock = Pinned(0.0)
            async with backend, recoverable.open_runtime(
                store, backend, account=ACCOUNT, wall_clock=clock
            ) as rt:
                await store.set_source("doc-1", "sha256:v1")
                handle = await rt.prepare(
                    recoverable.StructuredRequest(model="gpt-test", instructions="i", input="x"),
                    response=Answer, maximum_attempts=3,
                    source=DOC if bound else None, attempt_timeout=20.0 if bound else None,
                    retry_policy=recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0),
                )
                op = handle.operation_id
                child = _spawn(store_path, provider, op, tmp_path / "report.json")
                try:
                    await provider.wait_for_requests(1)

                    def streaming() -> bool:
                        record = store.get_operation(op)
                        return record is not None and record.phase == "transmitting"

                    await _until(streaming)
                finally:
                    child.send_signal(signal.SIGKILL)  # the worker dies holding the lease
                    await trio.to_thread.run_sync(child.wait)
                theirs = store.get_lease(op)
                assert theirs is not None and theirs.owner_id != store.owner_id
                assert theirs.expires_at is not None and theirs.fence == 1
                await owner_gone(store, theirs.owner_id)

                clock.now = theirs.expires_at - 0.01  # its owner is dead, its lease unexpired
                if bound:
                    with pytest.raises(recoverable.OperationBusy):
                        await rt.send_recovering(handle, response=Answer, authorize=approve)
                    status = await rt.status(handle)  # still held: shown as running
                    assert status.state == "running" and status.lease_owner == theirs.owner_id
                    await rt.suspend(handle)  # waits in its row; it voids nothing early
                    assert store.get_lease(op) == theirs
                    command = store.get_command(op)
                    assert command is not None and command.kind == "suspend"
                    report = await sweep(store, now=clock.now)
                    assert report.waiting == 0
                    record = store.get_operation(op)
                    assert record is not None and record.phase == "transmitting"
                    assert record.fence == 1 and store.get_lease(op) == theirs  # untouched
                    clock.now = theirs.expires_at + 0.01  # expired: reclaimable now
                    report = await sweep(store, now=clock.now)
                    assert report.waiting == 1  # process death -> reclaimable (not failed)
                    record = store.get_operation(op)
                    assert record is not None and record.phase == "waiting"
                    assert store.get_lease(op) is None
                # A plain operation is reclaimed at once (the dead owner's lock is the
                # fast path); a derivative only now, after its expiry.
                value = await rt.send_recovering(handle, response=Answer, authorize=approve)
                assert value == Answer(2)
                record = store.get_operation(op)
                assert record is not None and record.phase == "completed"
                assert record.attempts_used == 2
                stale = record.attempts[0]
                assert stale.outcome == "interrupted" and stale.usage is None
        assert len(generation_requests(provider, op)) == 2
