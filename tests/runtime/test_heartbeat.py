"""The runtime's heartbeat (actors/heartbeat.py, issue 14): one store write renews every
lease the runtime holds; a lost lease stops its execution; a renewal that cannot be written
stops an execution once its lease reaches the safety margin, and so does one the store never
answers; an owner woken past its expiry renews what nobody claimed. Real LMDB store; the
wall clock is driven explicitly where it decides."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing
from recoverable.actors.heartbeat import LeaseKeeper, check_lease_seconds
from recoverable.storage import RecoveryStore, acquire_lease, release_lease

from recoverable import errors
from recoverable.records import LeaseRecord

from ..storage.storage_helpers import make_op


class Wall:
    """A wall clock the test moves (the expiry is wall-clock time)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RecoveryStore]:
    with RecoveryStore.open(str(tmp_path / "store")) as opened:
        yield opened


async def take(store: RecoveryStore, op: str, now: float, seconds: float = 30.0) -> LeaseRecord:
    await store.write(lambda t: t.put_operation(make_op(op)))
    return await store.write(lambda t: acquire_lease(t, op, now, lease_seconds=seconds))


async def test_one_write_renews_every_held_lease(store: RecoveryStore) -> None:
    wall = Wall(1000.0)
    keeper = LeaseKeeper(store, lease_seconds=30.0, wall_clock=wall)
    stopped: list[str] = []
    held = [
        keeper.hold(await take(store, op, wall.now), lambda op=op: stopped.append(op))
        for op in ("a", "b", "c")
    ]
    wall.now = 1010.0
    commits = store.stats()["commits"]
    assert await keeper.renew() is True
    assert store.stats()["commits"] == commits + 1 and keeper.renewal_writes == 1
    for h in held:
        assert h.lease.expires_at == 1040.0 and not h.lost
        assert store.get_lease(h.lease.operation_id) == h.lease
    assert stopped == []


async def test_a_lost_lease_stops_its_execution_and_only_it(store: RecoveryStore) -> None:
    wall = Wall(1000.0)
    keeper = LeaseKeeper(store, lease_seconds=30.0, wall_clock=wall)
    stopped: list[str] = []
    kept = keeper.hold(await take(store, "kept", wall.now), lambda: stopped.append("kept"))
    taken_lease = await take(store, "taken", wall.now)
    taken = keeper.hold(taken_lease, lambda: stopped.append("taken"))
    # Another owner took "taken" over (here: released and claimed again, a higher fence).
    await store.write(lambda t: release_lease(t, "taken", taken_lease.token))
    newer = await store.write(lambda t: acquire_lease(t, "taken", 1001.0, lease_seconds=30.0))
    reached = False
    with keeper.transport_scope(taken) as transport:
        assert await keeper.renew() is True
        await trio.lowlevel.checkpoint()  # the transport scope was cancelled: this raises
        reached = True
    assert transport.cancelled_caught and not reached
    assert stopped == ["taken"] and taken.lost and not kept.lost and keeper.lost == 1
    assert store.get_lease("taken") == newer  # the heartbeat never touches another's lease
    assert await keeper.renew() is True  # a lost lease is not renewed again
    assert stopped == ["taken"]


async def test_an_unwritable_renewal_stops_an_execution_at_its_safety_margin(
    tmp_path: Path,
) -> None:
    wall = Wall(1000.0)
    with RecoveryStore.open(str(tmp_path / "s")) as store:
        lease = await take(store, "op", wall.now, seconds=30.0)
    # The store is closed now: every write raises StorageUnavailable.
    keeper = LeaseKeeper(store, lease_seconds=30.0, wall_clock=wall)
    stopped: list[str] = []
    held = keeper.hold(lease, lambda: stopped.append("op"))
    wall.now = 1024.9  # margin = 5 s: still before expires_at - margin = 1025
    assert await keeper.renew() is False
    assert stopped == [] and keeper.renewal_failures == 1
    wall.now = 1025.0
    assert await keeper.renew() is False
    assert stopped == ["op"] and held.lost


async def test_an_expired_lease_nobody_claimed_is_renewed_and_its_work_goes_on(
    store: RecoveryStore,
) -> None:
    """The owner was stopped past its expiry (SIGSTOP) and nobody claimed the operation:
    its token and fence are still current, so the first beat renews it (every claim,
    sweep or command that acts on an expiry changes the fence or removes the row)."""
    wall = Wall(1000.0)
    keeper = LeaseKeeper(store, lease_seconds=30.0, wall_clock=wall)
    stopped: list[str] = []
    held = keeper.hold(await take(store, "op", wall.now), lambda: stopped.append("op"))
    wall.now = 1100.0  # long past expires_at (1030)
    with keeper.transport_scope(held) as transport:
        assert await keeper.renew() is True
        await trio.lowlevel.checkpoint()  # not cut
    assert not transport.cancelled_caught and not held.lost and stopped == []
    assert held.lease.expires_at == 1130.0 and store.get_lease("op") == held.lease


async def test_the_watch_cuts_a_transport_at_its_margin_when_no_renewal_is_written(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A store that refuses the renewal: the watch asks for a beat at the margin, the beat
    fails, the transport is cut before the lease expires."""
    wall = Wall(1000.0)
    with RecoveryStore.open(str(tmp_path / "s")) as store:
        lease = await take(store, "op", wall.now, seconds=30.0)
    keeper = LeaseKeeper(store, lease_seconds=30.0, wall_clock=wall)  # a closed store
    held = keeper.hold(lease, lambda: None)
    wall.now = 1025.0  # the margin (5 s before 1030)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(keeper.run)
        with keeper.transport_scope(held) as transport:
            await trio.sleep_forever()
        nursery.cancel_scope.cancel()
    assert transport.cancelled_caught and held.lost and keeper.renewal_failures >= 1


class HungStore:
    """A store whose every write never returns (a network partition, a hung server)."""

    async def write(self, fn: object, *, touches: object = ()) -> object:
        await trio.sleep_forever()


async def test_a_hung_store_write_still_cuts_at_the_margin(
    store: RecoveryStore, autojump_clock: trio.testing.MockClock
) -> None:
    """The renewal write never returns: the watch gives it half a margin (2.5 s here),
    then cuts the transport, still before the lease expires."""
    wall = Wall(1000.0)
    lease = await take(store, "op", wall.now, seconds=30.0)
    keeper = LeaseKeeper(HungStore(), lease_seconds=30.0,  # type: ignore[arg-type]
                         wall_clock=wall)
    held = keeper.hold(lease, lambda: None)
    wall.now = 1025.0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(keeper.watch)
        nursery.start_soon(keeper.renew)  # the beat the watch asked for: it hangs
        started = trio.current_time()
        with keeper.transport_scope(held) as transport:
            await trio.sleep_forever()
        assert trio.current_time() - started == pytest.approx(2.5)
        nursery.cancel_scope.cancel()
    assert transport.cancelled_caught and held.lost
    await store.write(lambda t: t.put_operation(make_op("plain")))
    plain = await store.write(lambda t: acquire_lease(t, "plain", wall.now))
    assert keeper.deadline(keeper.hold(plain, lambda: None)) == math.inf  # no expiry


async def test_the_heartbeat_task_renews_on_its_own(store: RecoveryStore) -> None:
    import time

    keeper = LeaseKeeper(store, lease_seconds=1.0, wall_clock=time.time)
    held = keeper.hold(await take(store, "op", time.time(), seconds=1.0), lambda: None)
    first = held.lease.expires_at
    assert first is not None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(keeper.run)
        with trio.fail_after(60):  # generous: a loaded 2-core machine; a beat is 1/3 s
            for _ in range(3):
                await keeper.next_renewal()
        nursery.cancel_scope.cancel()
    assert held.lease.expires_at is not None and held.lease.expires_at > first
    assert store.get_lease("op") == held.lease and not held.lost


@pytest.mark.parametrize("bad", [0.5, 3600.5, 0, -1, math.nan, math.inf, True, "30"])
def test_lease_seconds_is_bounded(bad: object) -> None:
    with pytest.raises(errors.InvalidRequest):
        check_lease_seconds(bad)  # type: ignore[arg-type]
    assert check_lease_seconds(1) == 1.0 and check_lease_seconds(3600) == 3600.0


async def test_a_renewing_owner_is_never_cut_however_long_its_generation_runs(
    tmp_path: Path,
) -> None:
    """Seed 000's "no elapsed-time deadline on a running generation" holds while the
    owner is alive and renewing: a 1-second lease, a stream silent (keepalives only) for
    over three leases, completed and delivered; the heartbeat renewed it meanwhile."""
    import recoverable
    from recoverable.testing import FixtureProvider, Reply

    from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend

    async with FixtureProvider.serve() as provider:
        provider.script([Reply.keepalive(pause=3.5, every=0.25)])
        with recoverable.RecoveryStore.open(str(tmp_path / "store")) as store:
            async with make_backend(provider) as backend, recoverable.open_runtime(
                store, backend, account=ACCOUNT, lease_seconds=1.0
            ) as rt:
                handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
                value = await rt.send_recovering(handle, response=Answer,
                                                 authorize=Authorizer())
                assert isinstance(value, Answer)
                assert rt.leases.renewal_writes >= 3 and rt.leases.lost == 0
                record = store.get_operation(handle.operation_id)
                assert record is not None and record.phase == "completed" and record.fence == 1
        assert len(generation_requests(provider, handle.operation_id)) == 1


@pytest.mark.parametrize("bad", [0.5, 3601.0, math.nan])
async def test_open_runtime_refuses_a_lease_seconds_out_of_bounds(
    store: RecoveryStore, bad: float
) -> None:
    import recoverable

    with pytest.raises(errors.InvalidRequest):
        async with recoverable.open_runtime(store, None, account=None, lease_seconds=bad):
            raise AssertionError("not reached")  # pragma: no cover
    async with recoverable.open_runtime(store, None, account=None, lease_seconds=2) as rt:
        assert rt.leases.lease_seconds == 2.0 and rt.leases.period == pytest.approx(2 / 3)
