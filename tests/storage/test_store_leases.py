"""Leases that die with their owner (SIGKILL included) and generation fences."""

from __future__ import annotations

import fcntl
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest
from storage_helpers import make_op, read_line, spawn_child

from recoverable.errors import (
    FenceMismatch,
    InvalidRequest,
    LeaseLost,
    OperationBusy,
    RecoveryError,
    StateUnavailable,
)
from recoverable.records import LeaseRecord
from recoverable.storage import RecoveryStore, acquire_lease, release_lease, renew_leases
from recoverable.storage.keys import operation_key

pytestmark = pytest.mark.both_stores


async def test_acquisition_increments_the_fence_and_a_second_task_is_busy(
    store: RecoveryStore,
) -> None:
    await store.write(lambda t: t.put_operation(make_op("op")))
    first = await store.write(lambda t: acquire_lease(t, "op", 1.0))
    assert first.fence == 1 and first.owner_id == store.owner_id
    assert store.get_operation("op").fence == 1  # type: ignore[union-attr]
    assert store.get_lease("op") == first and store.lease_is_live(first)
    with pytest.raises(OperationBusy):
        await store.write(lambda t: acquire_lease(t, "op", 2.0))
    assert store.get_operation("op").fence == 1  # type: ignore[union-attr]
    assert await store.write(lambda t: release_lease(t, "op", first.token)) is True
    assert not store.lease_is_live(first) and store.get_lease("op") is None
    second = await store.write(lambda t: acquire_lease(t, "op", 3.0))
    assert second.fence == 2 and second.token != first.token
    assert await store.write(lambda t: release_lease(t, "op", first.token)) is False  # stale
    assert store.get_lease("op") == second


async def test_two_acquisitions_in_one_batch_exclude_each_other(store: RecoveryStore) -> None:
    import trio

    await store.write(lambda t: t.put_operation(make_op("race")))
    results: list[object] = []

    async def take() -> None:
        try:
            results.append(await store.write(lambda t: acquire_lease(t, "race", 1.0)))
        except OperationBusy as exc:
            results.append(exc)

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(take)
    leases = [r for r in results if isinstance(r, LeaseRecord)]
    assert len(leases) == 1 and len(results) == 20
    assert store.get_operation("race").fence == 1  # type: ignore[union-attr]


async def test_missing_operation_is_state_unavailable(store: RecoveryStore) -> None:
    with pytest.raises(StateUnavailable):
        await store.write(lambda t: acquire_lease(t, "nope", 1.0))
    assert store.get_lease("nope") is None


async def test_a_stale_owners_fenced_write_is_refused_after_a_newer_acquisition(
    store: RecoveryStore,
) -> None:
    await store.write(lambda t: t.put_operation(make_op("op")))
    stale = await store.write(lambda t: acquire_lease(t, "op", 1.0))
    # the first owner loses its lease (as if its task died) and a newer owner takes over
    await store.write(lambda t: release_lease(t, "op", stale.token))
    newer = await store.write(lambda t: acquire_lease(t, "op", 2.0))
    assert newer.fence == stale.fence + 1
    late = make_op("op", phase="completed", completed_at=9.0, fence=stale.fence)
    with pytest.raises(FenceMismatch):
        await store.write(lambda t: t.put_operation(late, expect_fence=stale.fence))
    with pytest.raises(FenceMismatch):
        await store.write(lambda t: t.delete_operation("op", expect_fence=stale.fence))
    current = store.get_operation("op")
    assert current is not None and current.phase == "prepared" and current.fence == newer.fence
    progressed = make_op("op", phase="authorizing", fence=newer.fence)
    await store.write(lambda t: t.put_operation(progressed, expect_fence=newer.fence))
    assert store.get_operation("op") == progressed
    with pytest.raises(FenceMismatch):
        await store.write(lambda t: t.put_operation(make_op("new"), expect_fence=0))


def test_a_lease_of_a_sigkilled_process_is_free_at_once(
    store: RecoveryStore, store_kind: str
) -> None:
    store.write_sync(lambda t: t.put_operation(make_op("shared")))
    child = spawn_child("hold-lease", store.path, "shared")
    lmdb = store_kind == "lmdb"
    lock_file = os.path.join(store.path, "owners")
    try:
        line = read_line(child)
        assert line.startswith("ready ")
        theirs = msgspec.json.decode(line.split(" ", 1)[1], type=LeaseRecord)
        assert theirs.owner_id != store.owner_id and theirs.fence == 1
        assert store.get_lease("shared") == theirs
        assert store.lease_is_live(theirs)
        with pytest.raises(OperationBusy):
            store.write_sync(lambda t: acquire_lease(t, "shared", 2.0))
        lock_file = os.path.join(store.path, "owners", f"{theirs.owner_id}.lock")
        assert os.path.exists(lock_file) or not lmdb
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    if lmdb:
        assert os.path.exists(lock_file)  # nobody cleaned it: liveness does not need that
    else:
        # PostgreSQL: the owner's advisory lock goes with its connection, which the server
        # closes when it reads the dead process's EOF (milliseconds; the owner's heartbeat
        # expiry, 10 s, is not waited for). Generous bound: a loaded 2-core machine.
        deadline = time.monotonic() + 5.0
        while store.lease_is_live(theirs) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not store.lease_is_live(theirs)
    ours = store.write_sync(lambda t: acquire_lease(t, "shared", 3.0))
    assert ours.fence == 2 and ours.owner_id == store.owner_id


def test_opening_removes_dead_owners_lock_files_but_not_held_ones(store_path: str) -> None:
    owners = os.path.join(store_path, "owners")
    os.makedirs(owners, mode=0o700)
    dead = os.path.join(owners, "0" * 32 + ".lock")
    abandoned_tmp = os.path.join(owners, ".tmp-" + "1" * 32)
    held = os.path.join(owners, "2" * 32 + ".lock")
    for path in (dead, abandoned_tmp, held):
        with open(path, "w"):
            pass
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another owner, alive
    try:
        with RecoveryStore.open(store_path) as store:
            names = sorted(os.listdir(owners))
            assert names == sorted([f"{store.owner_id}.lock", "2" * 32 + ".lock"])
            fake = LeaseRecord(
                operation_id="x", owner_id="2" * 32, token="t", fence=1, acquired_at=0.0
            )
            assert store.lease_is_live(fake)
            bad = LeaseRecord(
                operation_id="x", owner_id="../../etc", token="t", fence=1, acquired_at=0.0
            )
            assert not store.lease_is_live(bad)
        assert sorted(os.listdir(owners)) == ["2" * 32 + ".lock"]  # ours removed at close
    finally:
        os.close(fd)


# --- time-bounded leases (issue 14.1) ---------------------------------------------------


async def test_an_expiring_lease_is_reclaimed_only_from_its_expiry_with_a_higher_fence(
    store: RecoveryStore,
) -> None:
    await store.write(lambda t: t.put_operation(make_op("op")))
    first = await store.write(lambda t: acquire_lease(t, "op", 100.0, lease_seconds=10.0))
    assert first.expires_at == 110.0 and first.fence == 1
    assert store.get_lease("op") == first
    # Its owner (this store) is alive and its token active: only the expiry ends it.
    assert store.lease_is_live(first, 109.999)
    assert not store.lease_is_live(first, 110.0)
    with pytest.raises(OperationBusy):
        await store.write(lambda t: acquire_lease(t, "op", 109.999, lease_seconds=10.0))
    assert store.get_operation("op").fence == 1  # type: ignore[union-attr]
    second = await store.write(lambda t: acquire_lease(t, "op", 110.0, lease_seconds=10.0))
    assert second.fence == 2 and second.token != first.token and second.expires_at == 120.0
    assert store.get_operation("op").fence == 2  # type: ignore[union-attr]
    # The stale owner can neither checkpoint nor finish: its fenced writes are refused.
    late = make_op("op", phase="completed", completed_at=111.0, fence=first.fence)
    with pytest.raises(FenceMismatch):
        await store.write(lambda t: t.put_operation(late, expect_fence=first.fence))
    current = store.get_operation("op")
    assert current is not None and current.phase == "prepared" and current.fence == 2
    # ... and it cannot renew what it lost.
    renewed, lost = await store.write(lambda t: renew_leases(t, [first], 111.0, 10.0))
    assert renewed == [] and lost == [first]
    assert store.get_lease("op") == second


async def test_a_lease_without_expiry_lives_as_long_as_its_owner(store: RecoveryStore) -> None:
    await store.write(lambda t: t.put_operation(make_op("op")))
    lease = await store.write(lambda t: acquire_lease(t, "op", 100.0))
    assert lease.expires_at is None
    assert store.lease_is_live(lease, 1e12) and store.lease_is_live(lease)


async def test_a_lease_row_written_before_expiry_existed_decodes_and_lives_with_its_owner(
    store: RecoveryStore,
) -> None:
    await store.write(lambda t: t.put_operation(make_op("op")))
    lease = await store.write(lambda t: acquire_lease(t, "op", 100.0))
    # The bytes older code wrote: the same map without the expires_at key.
    fields = msgspec.structs.asdict(lease)
    del fields["expires_at"]
    old_row = msgspec.msgpack.encode(fields)
    await store.write(lambda t: t.put_raw("leases", operation_key("op"), old_row))
    read = store.get_lease("op")
    assert read == lease and read is not None and read.expires_at is None
    assert store.lease_is_live(read, 1e12)
    with pytest.raises(OperationBusy):
        await store.write(lambda t: acquire_lease(t, "op", 1e12, lease_seconds=5.0))


async def test_renewal_renews_the_current_leases_in_one_commit_and_reports_the_lost(
    store: RecoveryStore,
) -> None:
    for op in ("kept", "taken", "expired", "refenced"):
        await store.write(lambda t, op=op: t.put_operation(make_op(op)))  # type: ignore[misc]
    kept = await store.write(lambda t: acquire_lease(t, "kept", 100.0, lease_seconds=10.0))
    taken = await store.write(lambda t: acquire_lease(t, "taken", 100.0, lease_seconds=10.0))
    expired = await store.write(lambda t: acquire_lease(t, "expired", 90.0, lease_seconds=10.0))
    refenced = await store.write(
        lambda t: acquire_lease(t, "refenced", 100.0, lease_seconds=10.0)
    )
    # "taken": released and claimed again (a new token and fence);
    await store.write(lambda t: release_lease(t, "taken", taken.token))
    newer = await store.write(lambda t: acquire_lease(t, "taken", 101.0, lease_seconds=10.0))
    # "refenced": the record's fence moved under an unchanged lease row.
    bumped = make_op("refenced", fence=refenced.fence + 1)
    await store.write(lambda t: t.put_operation(bumped))
    commits = store.stats()["commits"]
    renewed, lost = await store.write(
        lambda t: renew_leases(t, [kept, taken, expired, refenced], 105.0, 10.0)
    )
    assert store.stats()["commits"] == commits + 1  # one write for all of them
    # "expired": its owner was stopped past the expiry and nobody acted on it (token and
    # fence still current): renewed, so what the owner received is saved (issue 29.12).
    assert renewed == [msgspec.structs.replace(kept, expires_at=115.0),
                       msgspec.structs.replace(expired, expires_at=115.0)]
    assert lost == [taken, refenced]
    assert store.get_lease("kept") == renewed[0]
    assert store.get_lease("expired") == renewed[1]
    assert store.get_lease("taken") == newer  # untouched
    assert store.get_lease("refenced") == refenced
    # Past its first expiry, the renewed lease still holds the operation.
    assert store.lease_is_live(renewed[0], 112.0)
    with pytest.raises(OperationBusy):
        await store.write(lambda t: acquire_lease(t, "kept", 112.0, lease_seconds=10.0))
    assert await store.write(lambda t: renew_leases(t, [], 113.0, 10.0)) == ([], [])


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True])
async def test_lease_seconds_must_be_a_positive_finite_number(
    store: RecoveryStore, bad: float
) -> None:
    await store.write(lambda t: t.put_operation(make_op("op")))
    with pytest.raises(InvalidRequest):
        await store.write(lambda t: acquire_lease(t, "op", 1.0, lease_seconds=bad))
    with pytest.raises(InvalidRequest):
        await store.write(lambda t: renew_leases(t, [], 1.0, bad))
    assert store.get_lease("op") is None and store.get_operation("op").fence == 0  # type: ignore[union-attr]


def test_lease_lost_is_a_typed_error_with_a_stable_code() -> None:
    error = LeaseLost(operation_id="op_1")
    assert error.code == "lease_lost" and isinstance(error, RecoveryError)
    assert str(error).startswith("operation op_1: ")


def _wait_until_stopped(pid: int) -> None:
    """Block until the kernel reports ``pid`` stopped (a barrier, not a sleep)."""
    _, status = os.waitpid(pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP


def test_a_stopped_owner_keeps_its_lease_until_expiry_then_is_fenced_out(
    store: RecoveryStore, tmp_path: Path
) -> None:
    """SIGSTOP a real process holding an expiring lease (issue 14.3, seed 004's
    "expired-lease reclamation"): its lock stays held, so only the expiry frees the
    operation; the reclaim raises the fence, and after SIGCONT every write the stale
    owner tries (renew, checkpoint, finish, release) is refused."""
    store.write_sync(lambda t: t.put_operation(make_op("hung")))
    report = tmp_path / "report.json"
    child = spawn_child("hold-expiring-lease", store.path, "hung", "1.0", str(report))
    try:
        # Barrier on durable state: the child's lease row is committed.
        deadline = time.monotonic() + 60.0  # generous: a loaded 2-core machine
        theirs = store.get_lease("hung")
        while theirs is None or theirs.owner_id == store.owner_id:
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the child never took the lease"
            time.sleep(0.01)
            theirs = store.get_lease("hung")
        assert theirs.fence == 1 and theirs.expires_at == theirs.acquired_at + 1.0
        child.send_signal(signal.SIGSTOP)
        _wait_until_stopped(child.pid)
        # Its owner lock is held (the process lives, stopped): before the expiry the
        # operation is busy for another owner, at any instant up to it.
        for before in (theirs.acquired_at, theirs.expires_at - 0.001):  # type: ignore[operator]
            assert store.lease_is_live(theirs, before)
            with pytest.raises(OperationBusy):
                store.write_sync(
                    lambda t, now=before: acquire_lease(t, "hung", now, lease_seconds=30.0)
                )
        assert store.get_operation("hung").fence == 1  # type: ignore[union-attr]
        # After the expiry, on the real clock (the one every process shares): reclaimed,
        # with a higher fence, while the stale owner is still alive and stopped.
        expires_at = theirs.expires_at
        assert expires_at is not None
        while (left := expires_at - time.time()) > 0:
            time.sleep(left)  # waiting for a known instant on the clock, not for an event
        assert not store.lease_is_live(theirs)
        ours = store.write_sync(
            lambda t: acquire_lease(t, "hung", time.time(), lease_seconds=30.0)
        )
        assert ours.fence == 2 and ours.owner_id == store.owner_id
        assert child.poll() is None  # still alive: the lock did not decide this
        child.send_signal(signal.SIGCONT)
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.wait(60) == 0, child.communicate()
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            child.send_signal(signal.SIGCONT)
            child.wait(30)
    answers = msgspec.json.decode(report.read_bytes())
    assert answers == {
        "live_for_itself": "False",  # its own expiry is past: it knows it lost
        "renew": 'ok:{"renewed":0,"lost":1}',
        "checkpoint": "fence_mismatch",
        "finish": "fence_mismatch",
        "release": "ok:false",  # not its lease any more: nothing deleted
    }
    current = store.get_operation("hung")
    assert current is not None and current.phase == "prepared" and current.fence == 2
    assert store.get_payload("hung", "completion") is None  # its late completion: refused
    assert store.get_lease("hung") == ours and store.lease_is_live(ours)
