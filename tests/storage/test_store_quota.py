"""Quotas come from counters in the store; a refused write changes nothing; no eviction."""

from __future__ import annotations

from pathlib import Path

import pytest
from storage_helpers import make_op

from recoverable.errors import StorageLimitExceeded
from recoverable.storage import RecoveryStore, WriteTxn

pytestmark = pytest.mark.both_stores

CHUNK = 9_000


@pytest.fixture
def small(tmp_path: Path) -> RecoveryStore:
    store = RecoveryStore.open(tmp_path / "small", max_bytes=100_000, max_record_bytes=10_000)
    yield store  # type: ignore[misc]
    store.close()


def state(store: RecoveryStore) -> tuple[int, int, int, list[str]]:
    stats = store.stats()
    return (
        stats["bytes_used"],
        stats["entries"],
        store.last_command_serial(),
        store.check_integrity(),
    )


async def test_a_value_over_max_record_bytes_is_refused_and_changes_nothing(
    small: RecoveryStore,
) -> None:
    await small.write(lambda t: t.put_payload("a", "body", b"x" * 10_000))  # exactly the limit
    before = state(small)

    def too_big(txn: WriteTxn) -> None:
        txn.put_payload("b", "body", b"small")  # part of the same mutation: rolled back too
        txn.put_payload("b", "completion", b"y" * 10_001)

    with pytest.raises(StorageLimitExceeded):
        await small.write(too_big)
    assert state(small) == before
    assert small.get_payload("b", "body") is None
    assert before[3] == []


async def test_total_quota_refuses_without_evicting_and_frees_on_delete(
    small: RecoveryStore,
) -> None:
    written = []
    with pytest.raises(StorageLimitExceeded):
        for i in range(100):
            await small.write(
                lambda t, i=i: t.put_payload(f"p{i}", "completion", bytes([i]) * CHUNK)
            )
            written.append(i)
    assert 5 <= len(written) < 12
    used = small.stats()["bytes_used"]
    assert used <= small.max_bytes
    before = state(small)
    # a composite write (operation + indexes + command counter) fails as a whole
    with pytest.raises(StorageLimitExceeded):
        await small.write(lambda t: t.put_payload("again", "completion", b"z" * CHUNK))
    big_op = make_op("big", model="m" * 9_900, phase="waiting", next_attempt_at=5.0)
    with pytest.raises(StorageLimitExceeded):
        await small.write(lambda t: t.put_operation(big_op))
    assert state(small) == before
    assert small.get_operation("big") is None and small.inventory() == ([], [])
    for i in written:  # nothing was evicted
        assert small.get_payload(f"p{i}", "completion") == bytes([i]) * CHUNK
    # deleting is always allowed and frees room; overwriting smaller is allowed (not a
    # frozen body: that one is immutable, issue 14.2, so these payloads are completions)
    assert await small.write(lambda t: t.delete_payload("p0", "completion"))
    await small.write(lambda t: t.put_payload("p1", "completion", b"s"))
    await small.write(lambda t: t.put_payload("again", "completion", b"z" * CHUNK))
    assert small.check_integrity() == []


async def test_command_counter_is_unchanged_when_the_command_is_refused(
    small: RecoveryStore,
) -> None:
    await small.write(lambda t: t.put_command("first", "suspend", 1.0))
    fill = small.max_bytes - small.stats()["bytes_used"] - 20
    for i in range(fill // CHUNK + 1):
        size = min(CHUNK, fill - i * CHUNK)
        if size > 0:
            await small.write(
                lambda t, i=i, size=size: t.put_raw("payloads", b"f%d\0body" % i, b"f" * (size - 7))
            )
    before = state(small)
    with pytest.raises(StorageLimitExceeded):
        await small.write(lambda t: t.put_command("second", "cancel", 2.0))
    assert state(small) == before
    assert small.last_command_serial() == 1


async def test_counter_matches_stored_bytes_after_mixed_writes(store: RecoveryStore) -> None:
    def mixed(txn: WriteTxn) -> None:
        txn.put_operation(make_op("m1", phase="waiting", next_attempt_at=3.0))
        txn.put_payload("m1", "completion", b"b" * 1000)
        txn.put_payload("m1", "completion", b"b" * 10)  # overwrite smaller
        txn.put_command("m1", "suspend", 1.0)
        txn.put_operation(make_op("m1", phase="completed"))
        txn.delete_payload("m1", "completion")

    await store.write(mixed)
    assert store.check_integrity() == []  # includes bytes_used == sum of stored key+value sizes
    assert store.stats()["bytes_used"] > 0


async def test_map_grows_when_full_and_every_write_lands(tmp_path: Path) -> None:
    import trio

    with RecoveryStore.open(tmp_path / "grow", initial_map_size=2**20) as store:
        async with trio.open_nursery() as nursery:
            for i in range(48):
                nursery.start_soon(
                    store.write, lambda t, i=i: t.put_payload(f"g{i}", "body", bytes([i]) * 65_536)
                )
        stats = store.stats()
        assert stats["map_growths"] >= 1 and stats["map_size"] > 2**20
        for i in range(48):
            assert store.get_payload(f"g{i}", "body") == bytes([i]) * 65_536
        assert store.check_integrity() == []
