"""The recovery sweep over real processes (issue 14; seed 004's "kill a live TurnServer,
run TurnRecovery, every durable active row becomes terminal without fabricated
completion; re-running recovery is a no-op").

A child runtime (``sweep_child.py``, a real separate process with its own store handle
and owner lock) streams operations that the provider (in this test's event loop, on a
real loopback socket) stalls mid-stream. The barrier is durable state: the provider has
received every POST, and each attempt is saved as consumed before its POST is sent.
Then the child is killed with SIGKILL (its flock is released by the kernel) and the
sweep runs in this process on the same LMDB store.
"""

from __future__ import annotations

import json
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
from recoverable import errors
from recoverable.actors.sweep import MAX_REPORT_IDS, SweepReport, sweep
from recoverable.outcome import Interruption
from recoverable.records import AttemptRecord, OperationRecord
from recoverable.testing import FixtureProvider, Reply

from .sweep_child import ACCOUNT, Answer

CHILD = str(Path(__file__).with_name("sweep_child.py"))
OWNER_LOST = Interruption(kind="interrupted", transport_code="owner_lost")
# Seconds; only a guard against a hung child on a loaded 2-core machine, never a barrier.
GUARD = 120


class Child:
    """The child runtime: its JSON lines and its process."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        assert process.stdout is not None
        self._stdout = process.stdout
        self._buffer = b""

    async def line(self) -> dict[str, Any]:
        while b"\n" not in self._buffer:
            chunk = await self._stdout.receive_some(65536)
            if not chunk:
                raise EOFError("the child closed its stdout")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\n", 1)
        event: dict[str, Any] = json.loads(raw)
        return event

    async def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        assert await self.process.wait() == -signal.SIGKILL


async def _start(
    store_path: str, provider: FixtureProvider, ops: list[dict[str, Any]], mode: str = "sse"
) -> tuple[Child, dict[str, str]]:
    """Start the child; return it and job -> operation id once every POST has arrived."""
    env = dict(os.environ)
    env.pop("RECOVERABLE_KILL_AT", None)
    argv = [sys.executable, CHILD, "--store", store_path, "--base-url", provider.http_url,
            "--mode", mode]
    for op in ops:
        argv += ["--op", json.dumps(op)]
    process = await trio.lowlevel.open_process(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    child = Child(process)
    ids: dict[str, str] = {}
    for _ in ops:
        event = await child.line()
        assert event["event"] == "prepared", event
        ids[event["job"]] = event["operation_id"]
    # The barrier: every POST reached the provider, so every attempt is durably consumed.
    await provider.wait_for_requests(len(ops))
    return child, ids


def _records(store: recoverable.RecoveryStore, ids: dict[str, str]) -> dict[str, OperationRecord]:
    out: dict[str, OperationRecord] = {}
    for job, op_id in ids.items():
        rec = store.get_operation(op_id)
        assert rec is not None
        out[job] = rec
    return out


def _raw(store: recoverable.RecoveryStore, ids: dict[str, str]) -> dict[str, Any]:
    """Every stored row the sweep could change (records compare field by field, fence
    included)."""
    return {
        op_id: (store.get_operation(op_id), store.get_lease(op_id)) for op_id in ids.values()
    }


def _closed_honestly(before: OperationRecord, after: OperationRecord) -> None:
    """The in-flight attempt is an interruption; nothing the provider did not durably
    report appears (no completion, usage or response id), and nothing is refunded."""
    assert before.phase == "transmitting" and before.attempts[-1].outcome == "in_flight"
    assert after.attempts_used == before.attempts_used == 1
    last = after.attempts[-1]
    assert last.attempt_id == before.attempts[-1].attempt_id
    assert last.outcome == "interrupted" and last.failure == OWNER_LOST
    assert last.usage is None and last.response_id is None and last.sequence_number is None
    assert after.last_failure == OWNER_LOST
    assert not after.has_completion and after.completed_at is None
    assert after.fence == before.fence + 1  # the lost owner is fenced out


@pytest.mark.parametrize("leased_only", [False, True])
async def test_sigkill_mid_stream_then_sweep_closes_every_row_honestly(
    tmp_path: Path, leased_only: bool
) -> None:
    store_path = str(tmp_path / "store")
    t0 = time.time()
    ops = [
        {"job": "replace", "maximum_attempts": 3},
        {"job": "last-attempt", "maximum_attempts": 1},
        {"job": "policy-fail", "maximum_attempts": 3, "on_interruption": "fail"},
        {"job": "expires", "maximum_attempts": 3, "expires_at": t0 + 3600},
    ]
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.stall(after_events=2)] * len(ops))
        with trio.fail_after(GUARD):
            child, ids = await _start(store_path, provider, ops)
            try:
                await child.kill()
            finally:
                if child.process.returncode is None:
                    child.process.kill()
                    await child.process.wait()
        posts = len(provider.requests)
    assert posts == len(ops)

    store = recoverable.RecoveryStore.open(store_path)
    try:
        before = _records(store, ids)
        for job, op_id in ids.items():
            lease = store.get_lease(op_id)
            assert lease is not None and not store.lease_is_live(lease), job
        now = t0 + 7200  # past the "expires" operation's expires_at
        report = await sweep(store, now=now, leased_only=leased_only)
        after = _records(store, ids)
        by_id = {op_id: job for job, op_id in ids.items()}

        assert report.examined == 4 and report.closed == 4 and report.live == 0
        assert report.waiting == 1 and report.failed == 3 and not report.ids_truncated
        assert {by_id[i] for i in report.waiting_ids} == {"replace"}
        assert {by_id[i] for i in report.failed_ids} == {"last-attempt", "policy-fail", "expires"}
        assert sorted(report.closed_ids) == sorted(ids.values())

        for job in ids:
            _closed_honestly(before[job], after[job])
            assert store.get_lease(ids[job]) is None  # the stale lease row is gone
            assert store.get_payload(ids[job], "completion") is None
        # Budget left, replacement allowed, not expired: waiting for adoption, with the
        # retry policy's cooldown (0 here) from the sweep's now.
        assert after["replace"].phase == "waiting" and after["replace"].failure_reason is None
        assert after["replace"].next_attempt_at == now
        assert after["last-attempt"].failure_reason == "owner_lost"
        assert after["policy-fail"].failure_reason == "owner_lost"
        assert after["policy-fail"].on_interruption == "fail"
        assert after["expires"].failure_reason == "expired"
        for job in ("last-attempt", "policy-fail", "expires"):
            assert after[job].phase == "failed" and after[job].next_attempt_at is None

        # A second sweep changes nothing: same report of nothing, same bytes.
        raw = _raw(store, ids)
        again = await sweep(store, now=now)
        assert again == SweepReport() and not again.changed
        assert _raw(store, ids) == raw
        later = await sweep(store, now=now + 10**6)  # later still: nothing owned, no change
        assert later == SweepReport()
        assert _raw(store, ids) == raw
        assert store.check_integrity() == []

        # What a host reads.
        async with recoverable.open_runtime(store, None, account=ACCOUNT) as rt:
            waiting = await rt.status(recoverable.Handle(ids["replace"]))
            assert waiting.state == "interrupted"
            assert waiting.last_failure == OWNER_LOST and waiting.attempts_used == 1
            failed = await rt.status(recoverable.Handle(ids["policy-fail"]))
            assert failed.state == "failed" and failed.availability == "failed"
            assert failed.suggested_actions == ("manual_retry", "abandon")
            expired = await rt.status(recoverable.Handle(ids["expires"]))
            assert expired.state == "failed" and expired.availability == "expired"
            for job in ("last-attempt", "policy-fail", "expires"):
                with pytest.raises(errors.CompletionUnavailable):
                    await rt.receipt(recoverable.Handle(ids[job]))
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["sse", "websocket"])
async def test_a_live_owner_is_untouched_then_its_orphan_is_adopted(
    tmp_path: Path, mode: str
) -> None:
    store_path = str(tmp_path / "store")
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.stall(after_events=2)])  # then: schema-valid completions
        with trio.fail_after(GUARD):
            child, ids = await _start(store_path, provider, [{"job": "a"}], mode)
            op_id = ids["a"]
            store = recoverable.RecoveryStore.open(store_path)
            try:
                try:
                    # The owner is alive and streaming: the sweep must not touch it.
                    raw = _raw(store, ids)
                    report = await sweep(store, now=time.time())
                    assert report.examined == 1 and report.live == 1
                    assert report.closed == 0 and report.closed_ids == ()
                    assert _raw(store, ids) == raw
                    await child.kill()
                finally:
                    if child.process.returncode is None:
                        child.process.kill()
                        await child.process.wait()
                before = store.get_operation(op_id)
                assert before is not None
                report = await sweep(store, now=time.time())
                assert report.closed == 1 and report.waiting_ids == (op_id,)
                after = store.get_operation(op_id)
                assert after is not None and after.phase == "waiting"
                _closed_honestly(before, after)

                # Adoption: a new runtime reopens it; the replacement is attempt 2 of the
                # same budget, and the host is asked about it as a replacement.
                backend = recoverable.ResponsesBackend(
                    provider.http_url,
                    credentials=recoverable.StaticCredentials("sk-adopt", account=ACCOUNT),
                    mode=mode,
                    endpoint_id="fixture",
                )
                asked: list[recoverable.Attempt] = []

                async def authorize(attempt: recoverable.Attempt) -> bool:
                    asked.append(attempt)
                    return True

                async with backend, recoverable.open_runtime(
                    store, backend, account=ACCOUNT
                ) as rt:
                    value = await rt.send_recovering(
                        recoverable.Handle(op_id), response=Answer, authorize=authorize
                    )
                    assert isinstance(value, Answer)
                    status = await rt.status(recoverable.Handle(op_id))
                assert [a.number for a in asked] == [2]
                assert asked[0].reason == "replacement"
                assert asked[0].previous_failure == OWNER_LOST
                assert status.state == "completed" and status.attempts_used == 2
                assert [a.outcome for a in status.attempts] == ["interrupted", "completed"]
                # Nothing left for a sweep.
                assert await sweep(store, now=time.time()) == SweepReport()
            finally:
                store.close()
    assert [r.attempt_id for r in provider.requests] == [f"{op_id}.1", f"{op_id}.2"]


async def test_bad_bounds_are_typed_errors(tmp_path: Path) -> None:
    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    try:
        for bad in (-1.0, float("nan"), float("inf"), True, "60"):
            with pytest.raises(errors.InvalidRequest):
                await sweep(store, now=time.time(), unclaimed_after=bad)
        with pytest.raises(errors.InvalidRequest):
            await sweep(store, now=float("nan"))
        assert await sweep(store, now=time.time()) == SweepReport()
    finally:
        store.close()


def test_report_id_lists_are_bounded_and_counts_exact() -> None:
    from recoverable.actors.sweep import _Tally

    tally = _Tally()
    for i in range(MAX_REPORT_IDS + 5):
        tally.add("closed", f"op-{i}")
        tally.add("failed", f"op-{i}")
    report = tally.report()
    assert report.closed == report.failed == MAX_REPORT_IDS + 5
    assert len(report.closed_ids) == len(report.failed_ids) == MAX_REPORT_IDS
    assert report.ids_truncated and report.waiting_ids == ()


# --- a kill at each durable checkpoint, then the sweep ------------------------------------

# kill point -> (the phase left behind, what the sweep makes of it, attempts spent)
CHECKPOINTS: dict[str, tuple[str, str | None, int]] = {
    "prepare.saved": ("prepared", None, 0),  # no owner ever: not examined
    "attempt.pending_saved": ("authorizing", "prepared", 0),  # nothing spent; id kept
    "attempt.consumed_saved": ("transmitting", "waiting", 1),  # spent, never refunded
    "stream.completed_unreceived": ("transmitting", "waiting", 1),  # generated, lost
    "receipt.before_save": ("transmitting", "waiting", 1),
    # The receipt and the lease release commit together: nothing is left to close.
    "receipt.saved": ("completed", None, 1),
}


@pytest.mark.parametrize("point", list(CHECKPOINTS))
async def test_kill_at_each_durable_checkpoint_then_sweep(tmp_path: Path, point: str) -> None:
    store_path = str(tmp_path / "store")
    left, swept, spent = CHECKPOINTS[point]
    async with FixtureProvider.serve() as provider:
        env = dict(os.environ, RECOVERABLE_KILL_AT=point)
        argv = [sys.executable, CHILD, "--store", store_path, "--base-url", provider.http_url,
                "--op", json.dumps({"job": "k"})]
        with trio.fail_after(GUARD):
            process = await trio.lowlevel.open_process(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
            )
            try:
                assert await process.wait() == -signal.SIGKILL  # it killed itself there
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
        store = recoverable.RecoveryStore.open(store_path)
        try:
            records, unreadable = store.inventory()
            assert unreadable == [] and len(records) == 1
            before = records[0]
            op_id = before.operation_id
            assert before.phase == left and before.attempts_used == spent
            report = await sweep(store, now=time.time())
            after = store.get_operation(op_id)
            assert after is not None
            if swept is None:
                assert report == SweepReport() and after == before
            else:
                assert report.examined == report.closed == 1 and report.closed_ids == (op_id,)
                assert after.phase == swept and after.attempts_used == spent
                assert store.get_lease(op_id) is None and after.fence == before.fence + 1
                assert after.pending == before.pending
                assert after.has_completion == before.has_completion
                assert after.attempts[:-1] == before.attempts[:-1]
                if before.phase == "transmitting":
                    _closed_honestly(before, after)
                else:
                    assert after.attempts == before.attempts
            assert await sweep(store, now=time.time()) == SweepReport()  # a no-op now

            # Whatever the sweep left is adopted (or delivered) within the same budget.
            backend = recoverable.ResponsesBackend(
                provider.http_url,
                credentials=recoverable.StaticCredentials("sk-adopt", account=ACCOUNT),
                mode="sse", endpoint_id="fixture",
            )

            async def authorize(attempt: recoverable.Attempt) -> bool:
                return True

            async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
                with trio.fail_after(GUARD):
                    value = await rt.send_recovering(
                        recoverable.Handle(op_id), response=Answer, authorize=authorize
                    )
                assert isinstance(value, Answer)
                status = await rt.status(recoverable.Handle(op_id))
        finally:
            store.close()
    posted = [r.attempt_id for r in provider.requests]
    assert len(posted) == len(set(posted)) and status.attempts_used <= 3
    if point == "receipt.saved":
        assert posted == [f"{op_id}.1"]  # the saved receipt is delivered: no new POST
    else:
        assert status.attempts_used == spent + 1


# --- unclaimed operations (no worker) ------------------------------------------------------


async def test_unclaimed_after_ends_only_old_unowned_runnable_operations(
    tmp_path: Path,
) -> None:
    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    clock = [1_800_000_000.0]
    try:
        async with FixtureProvider.serve() as provider:
            backend = recoverable.ResponsesBackend(
                provider.http_url,
                credentials=recoverable.StaticCredentials("sk-x", account=ACCOUNT),
                mode="sse", endpoint_id="fixture",
            )
            async with backend, recoverable.open_runtime(
                store, backend, account=ACCOUNT, wall_clock=lambda: clock[0]
            ) as rt:
                request = recoverable.StructuredRequest(
                    model="gpt-test", instructions="i", input="unclaimed"
                )
                old = await rt.prepare(request, response=Answer, maximum_attempts=2)
                clock[0] += 100
                young = await rt.prepare(request, response=Answer, maximum_attempts=2)
                t = clock[0]
                # Without the bound, prepared operations are never examined.
                assert await sweep(store, now=t + 50) == SweepReport()
                report = await sweep(store, now=t + 50, unclaimed_after=120)
                assert report.examined == 2 and report.failed == 1
                assert report.failed_ids == (old.operation_id,)
                rec = store.get_operation(old.operation_id)
                assert rec is not None
                assert rec.phase == "failed" and rec.failure_reason == "no_worker"
                assert rec.attempts_used == 0 and not rec.has_completion
                young_rec = store.get_operation(young.operation_id)
                assert young_rec is not None and young_rec.phase == "prepared"
                again = await sweep(store, now=t + 50, unclaimed_after=120)
                assert again.closed == 0 and again.examined == 1  # young: examined, kept
                status = await rt.status(old)
                assert status.state == "failed" and status.availability == "failed"
                with pytest.raises(errors.PermanentlyFailed, match="worker"):
                    await rt.send_recovering(old, response=Answer, authorize=_approve)
        assert provider.requests == []
    finally:
        store.close()


async def _approve(attempt: recoverable.Attempt) -> bool:
    return True


async def test_an_in_flight_row_without_a_lease_row_needs_the_full_sweep(
    tmp_path: Path,
) -> None:
    """An owner whose last write failed released its lease with the record still in
    flight: the cheap sweep (lease rows only) leaves it, the full sweep closes it."""
    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    try:
        attempt = AttemptRecord(attempt_id="op-x.1", number=1, reason="initial",
                                consumed_at=10.0)
        rec = OperationRecord(
            operation_id="op-x", account=ACCOUNT, endpoint_id="fixture", created_at=1.0,
            phase="transmitting", maximum_attempts=2, attempts_used=1, attempts=(attempt,),
            model="gpt-test", format_name="Answer", format_hash="fh", body_hash="bh",
            root_operation_id="op-x",
        )
        await store.write(lambda txn: txn.put_operation(rec))
        assert await sweep(store, now=20.0, leased_only=True) == SweepReport()
        report = await sweep(store, now=20.0)
        assert report.waiting_ids == ("op-x",)
        after = store.get_operation("op-x")
        assert after is not None and after.phase == "waiting"
        assert after.attempts[-1].failure == OWNER_LOST and after.fence == rec.fence + 1
        assert await sweep(store, now=20.0) == SweepReport()
        with pytest.raises(errors.InvalidRequest):
            await sweep(store, now=20.0, leased_only=True, unclaimed_after=5.0)
    finally:
        store.close()


async def test_the_sweep_fences_out_the_owner_it_took_the_operation_from(
    tmp_path: Path,
) -> None:
    """An owner whose lease is no longer live but who is still running (a hung process
    whose lease expired; simulated here by forgetting the acquisition's token) can write
    nothing after the sweep: the fence moved, so its checkpoint and its completion are
    refused (``FenceMismatch``)."""
    from recoverable.storage.leases import acquire_lease

    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    try:
        attempt = AttemptRecord(attempt_id="op-h.1", number=1, reason="initial",
                                consumed_at=10.0)
        rec = OperationRecord(
            operation_id="op-h", account=ACCOUNT, endpoint_id="fixture", created_at=1.0,
            phase="transmitting", maximum_attempts=2, attempts_used=1, attempts=(attempt,),
            model="gpt-test", format_name="Answer", format_hash="fh", body_hash="bh",
            root_operation_id="op-h",
        )
        await store.write(lambda txn: txn.put_operation(rec))
        lease = await store.write(lambda txn: acquire_lease(txn, "op-h", 11.0))
        live = await sweep(store, now=12.0)
        assert live.live == 1 and live.closed == 0  # its owner is live: untouched
        await store.write(lambda txn: txn.unregister_token(lease.token))  # no longer live
        report = await sweep(store, now=12.0)
        assert report.waiting_ids == ("op-h",)
        swept = store.get_operation("op-h")
        assert swept is not None and swept.fence == lease.fence + 1
        # The lost owner wakes up: a checkpoint or a completion under its fence is refused.
        completed = msgspec.structs.replace(swept, phase="completed", completed_at=13.0)
        with pytest.raises(errors.FenceMismatch):
            await store.write(
                lambda txn: txn.put_operation(completed, expect_fence=lease.fence)
            )
        assert store.get_operation("op-h") == swept
    finally:
        store.close()
