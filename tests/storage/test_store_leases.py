"""Leases that die with their owner (SIGKILL included) and generation fences."""

from __future__ import annotations

import fcntl
import os
import signal

import msgspec
import pytest
from recoverable.storage import RecoveryStore, acquire_lease, release_lease
from storage_helpers import make_op, read_line, spawn_child

from recoverable.errors import FenceMismatch, OperationBusy, StateUnavailable
from recoverable.records import LeaseRecord


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


def test_a_lease_of_a_sigkilled_process_is_free_at_once(store: RecoveryStore) -> None:
    store.write_sync(lambda t: t.put_operation(make_op("shared")))
    child = spawn_child("hold-lease", store.path, "shared")
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
        assert os.path.exists(lock_file)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    assert os.path.exists(lock_file)  # nobody cleaned it: liveness does not need that
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
