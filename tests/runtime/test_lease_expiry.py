"""A hung owner (SIGSTOP) and time-bounded leases, end to end (issue 14, seed 004's
"expired-lease reclamation"): a real child process runs a runtime streaming from the
fixture provider (served by this test's event loop on a loopback socket) and is stopped.
Before its lease expires, another runtime's ``send_recovering`` is ``OperationBusy``;
after, it takes the operation over with a higher fence and completes it. Sent SIGCONT, the
stale owner can neither checkpoint nor finish: its late writes are refused, its caller gets
``LeaseLost``, and no POST beyond the budget was made.

Barriers: durable state (the store's rows), the kernel's stop notification (``waitpid``
with ``WUNTRACED``) and the provider's request log; no fixed sleep decides anything (the
one wait on the wall clock waits for a known instant: the lease's expiry).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import trio

import recoverable
from recoverable.records import LeaseRecord
from recoverable.testing import FixtureProvider, Reply

from .conftest import generation_requests, stopped
from .lease_child import ACCOUNT, Answer

CHILD = str(Path(__file__).with_name("lease_child.py"))
LEASE_SECONDS = 3.0  # the child's leases: short, so the test waits ~3 s for an expiry
BOUND = 60.0  # generous: a loaded 2-core machine may deschedule a process for seconds


class Clock:
    """The parent runtime's wall clock: real, or pinned to an instant for one check."""

    def __init__(self) -> None:
        self.pinned: float | None = None

    def __call__(self) -> float:
        return time.time() if self.pinned is None else self.pinned


def backend(provider: FixtureProvider) -> recoverable.ResponsesBackend:
    return recoverable.ResponsesBackend(
        provider.http_url,
        credentials=recoverable.StaticCredentials("sk-lease-parent", account=ACCOUNT),
        mode="sse", endpoint_id="fixture",
    )


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


async def _wait_for(predicate: object, what: str) -> None:
    """Poll durable state until ``predicate()`` holds (a barrier, bounded by BOUND)."""
    with trio.fail_after(BOUND):
        while not predicate():  # type: ignore[operator]  # noqa: ASYNC110 (another process)
            await trio.sleep(0.005)


def _spawn(store: str, provider: FixtureProvider, op: str, report: Path,
           env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, CHILD, "--store", store, "--base-url", provider.http_url,
         "--operation-id", op, "--lease-seconds", str(LEASE_SECONDS), "--report", str(report)],
        env={**{k: v for k, v in os.environ.items() if not k.startswith("RECOVERABLE_KILL")},
             **env},
        stderr=subprocess.PIPE,
    )


@pytest.mark.parametrize("stop_at", ["mid_stream", "receipt.before_save"])
async def test_a_stopped_owner_is_reclaimed_after_expiry_and_fenced_out(
    tmp_path: Path, stop_at: str
) -> None:
    store_path = str(tmp_path / "store")
    report = tmp_path / "report.json"
    clock = Clock()
    async with FixtureProvider.serve() as provider:
        first = Reply.stall(after_events=2) if stop_at == "mid_stream" else Reply.complete(
            {"answer": 1}
        )
        provider.script([first, Reply.complete({"answer": 2})])
        with recoverable.RecoveryStore.open(store_path) as store:
            async with backend(provider) as parent_backend, recoverable.open_runtime(
                store, parent_backend, account=ACCOUNT, wall_clock=clock
            ) as rt:
                handle = await rt.prepare(
                    recoverable.StructuredRequest(model="gpt-test", instructions="i", input="x"),
                    response=Answer, maximum_attempts=3,
                    retry_policy=recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0),
                )
                op = handle.operation_id
                env = ({} if stop_at == "mid_stream" else
                       {"RECOVERABLE_KILL_AT": stop_at, "RECOVERABLE_KILL_SIGNAL": "STOP"})
                child = _spawn(store_path, provider, op, report, env)
                try:
                    await _hang(child, store, provider, op, stop_at)
                    theirs = store.get_lease(op)
                    assert theirs is not None and theirs.owner_id != store.owner_id
                    assert theirs.expires_at is not None and theirs.fence == 1
                    await _reclaim(rt, handle, clock, theirs)
                    # SIGCONT: the stale owner goes on where it stopped.
                    child.send_signal(signal.SIGCONT)
                    with trio.fail_after(BOUND):
                        code = await trio.to_thread.run_sync(child.wait)
                    assert code == 0, child.stderr.read() if child.stderr else b""
                finally:
                    if child.poll() is None:
                        child.kill()
                        child.send_signal(signal.SIGCONT)
                        child.wait(30)
                # Its caller got LeaseLost; the store kept the new owner's receipt.
                assert msgspec.json.decode(report.read_bytes()) == {"error": "lease_lost"}
                record = store.get_operation(op)
                assert record is not None and record.phase == "completed"
                assert record.fence == 2 and record.attempts_used == 2
                stale = record.attempts[0]
                assert stale.outcome == "interrupted" and stale.usage is None
                assert stale.failure is not None and stale.failure.kind == "interrupted"
                assert store.get_payload(op, "completion") == b'{"answer":2}'
                assert await rt.send_recovering(handle, response=Answer,
                                                authorize=approve) == Answer(2)
                assert store.get_lease(op) is None
        # Two POSTs (one per owner), within the budget of 3; none after the receipt.
        assert len(generation_requests(provider, op)) == 2


async def _hang(child: subprocess.Popen[bytes], store: recoverable.RecoveryStore,
                provider: FixtureProvider, op: str, stop_at: str) -> None:
    """Bring the child to its hung state (stopped while holding the lease)."""
    if stop_at != "mid_stream":
        await stopped(child.pid)  # it stopped itself at the crash point, lease held
        record = store.get_operation(op)
        assert record is not None and record.phase == "transmitting"
        return
    await provider.wait_for_requests(1)

    def streaming_and_just_renewed() -> bool:
        # Stop it right after a heartbeat commit (its next write is lease_seconds/3
        # away): a process stopped inside a commit would hold LMDB's write lock.
        lease = store.get_lease(op)
        return lease is not None and lease.expires_at is not None and (
            lease.expires_at > lease.acquired_at + LEASE_SECONDS
        )

    await _wait_for(streaming_and_just_renewed, "the child's first renewal")
    child.send_signal(signal.SIGSTOP)
    await stopped(child.pid)
    record = store.get_operation(op)
    assert record is not None and record.phase == "transmitting" and record.attempts_used == 1


async def _reclaim(rt: recoverable.Runtime, handle: recoverable.Handle, clock: Clock,
                   theirs: LeaseRecord) -> None:
    """Busy before the expiry (its lock is held); taken over, and completed, after it."""
    assert theirs.expires_at is not None
    clock.pinned = theirs.expires_at - 0.01  # any instant before the expiry
    with pytest.raises(recoverable.OperationBusy):
        await rt.send_recovering(handle, response=Answer, authorize=approve)
    assert (await rt.status(handle)).lease_owner == theirs.owner_id
    clock.pinned = None
    while (left := theirs.expires_at - time.time()) > 0:  # noqa: ASYNC110
        await trio.sleep(left)  # waiting for a known instant on the wall clock
    status = await rt.status(handle)
    assert status.state == "interrupted" and status.lease_owner is None
    assert await rt.send_recovering(handle, response=Answer, authorize=approve) == Answer(2)


@pytest.mark.parametrize("command", ["cancel", "suspend"])
async def test_a_command_applied_over_an_expired_lease_fences_out_its_stale_owner(
    tmp_path: Path, command: str
) -> None:
    """A lease that expired while its owner lives (hung) is not live, so a command is
    applied to the record directly; the stale owner may still wake up, so that write
    raises the fence: the stale owner's next fenced write is refused, never overwriting
    the command."""
    from recoverable.storage import acquire_lease

    with recoverable.RecoveryStore.open(str(tmp_path / "store")) as store:
        async with FixtureProvider.serve() as provider, backend(
            provider
        ) as idle, recoverable.open_runtime(store, idle, account=ACCOUNT) as rt:
            handle = await rt.prepare(
                recoverable.StructuredRequest(model="gpt-test", instructions="i", input="x"),
                response=Answer, maximum_attempts=3,
            )
            op = handle.operation_id
            # A hung owner's lease (here, this process's own acquisition), long expired.
            stale = await store.write(
                lambda t: acquire_lease(t, op, time.time() - 60.0, lease_seconds=1.0)
            )
            await (rt.cancel(handle) if command == "cancel" else rt.suspend(handle))
            record = store.get_operation(op)
            assert record is not None
            assert record.phase == ("cancelled" if command == "cancel" else "suspended")
            assert record.fence == stale.fence + 1 and store.get_lease(op) is None
            late = msgspec.structs.replace(record, phase="authorizing", fence=stale.fence)
            with pytest.raises(recoverable.errors.FenceMismatch):
                await store.write(lambda t: t.put_operation(late, expect_fence=stale.fence))
            assert store.get_operation(op) == record


async def test_the_sweep_judges_a_lease_expiry_at_its_own_now(tmp_path: Path) -> None:
    """The sweep (w-sweep) reads liveness at the ``now`` it is given: a living owner's
    lease is untouched before its expiry and swept (fenced out) from it."""
    from recoverable.actors.sweep import sweep
    from recoverable.records import AttemptRecord, OperationRecord
    from recoverable.storage import acquire_lease

    with recoverable.RecoveryStore.open(str(tmp_path / "store")) as store:
        attempt = AttemptRecord(attempt_id="op-e.1", number=1, reason="initial",
                                consumed_at=10.0)
        rec = OperationRecord(
            operation_id="op-e", account=ACCOUNT, endpoint_id="fixture", created_at=1.0,
            phase="transmitting", maximum_attempts=2, attempts_used=1, attempts=(attempt,),
            model="gpt-test", format_name="Answer", format_hash="fh", body_hash="bh",
            root_operation_id="op-e",
        )
        await store.write(lambda txn: txn.put_operation(rec))
        lease = await store.write(lambda t: acquire_lease(t, "op-e", 11.0, lease_seconds=5.0))
        before = await sweep(store, now=15.999)
        assert before.live == 1 and before.closed == 0 and before.waiting == 0
        after = await sweep(store, now=16.0)
        assert after.waiting_ids == ("op-e",)
        swept = store.get_operation("op-e")
        assert swept is not None and swept.fence == lease.fence + 1
        assert store.get_lease("op-e") is None


async def test_a_stopped_owner_nobody_claimed_goes_on_and_saves_what_it_received(
    tmp_path: Path,
) -> None:
    """The probe: a ``--workers 0`` batch SIGSTOPped past its lease and woken threw away
    the completions it had received (``lease_lost``) though no other process had taken
    over. Stopped mid-stream past its expiry, with the provider's completion sent
    meanwhile, and woken with nobody having claimed the operation, the owner renews its
    lease (token and fence still current) and saves the receipt: one POST, fence 1."""
    store_path = str(tmp_path / "store")
    report = tmp_path / "report.json"
    async with FixtureProvider.serve() as provider:
        # Silent (keepalives) for 1.5 s after two events, then the rest of the answer: it
        # is all sent while the owner is stopped. The owner is stopped on its first
        # renewal, 1 s (LEASE_SECONDS / 3) into its lease: a 1 s silence left the test
        # a few milliseconds to stop it before the answer arrived; this leaves 0.5 s.
        provider.script([Reply.keepalive(pause=1.5, every=0.25)])
        with recoverable.RecoveryStore.open(store_path) as store:
            async with backend(provider) as parent_backend, recoverable.open_runtime(
                store, parent_backend, account=ACCOUNT
            ) as rt:
                handle = await rt.prepare(
                    recoverable.StructuredRequest(model="gpt-test", instructions="i", input="x"),
                    response=Answer, maximum_attempts=3,
                )
            op = handle.operation_id
            child = _spawn(store_path, provider, op, report, {})
            try:
                await _hang(child, store, provider, op, "mid_stream")
                theirs = store.get_lease(op)
                assert theirs is not None and theirs.expires_at is not None
                while (left := theirs.expires_at + 0.5 - time.time()) > 0:  # noqa: ASYNC110
                    await trio.sleep(left)  # waiting for a known instant: past its expiry
                assert not store.lease_is_live(theirs)  # expired; nobody claims it
                child.send_signal(signal.SIGCONT)
                with trio.fail_after(BOUND):
                    code = await trio.to_thread.run_sync(child.wait)
                assert code == 0, child.stderr.read() if child.stderr else b""
            finally:
                if child.poll() is None:
                    child.kill()
                    child.send_signal(signal.SIGCONT)
                    child.wait(30)
            assert "value" in msgspec.json.decode(report.read_bytes())
            record = store.get_operation(op)
            assert record is not None and record.phase == "completed"
            assert (record.fence, record.attempts_used) == (1, 1)
            assert store.get_lease(op) is None
        assert len(generation_requests(provider, op)) == 1
