"""The default quotas of the seed: a 512 MiB store with a 128 MiB per-record limit."""

from __future__ import annotations

import inspect

import pytest

import recoverable
from recoverable.storage import RecoveryStore
from recoverable.storage.store import WriteTxn

pytestmark = pytest.mark.both_stores

MiB = 2**20


def test_the_default_quotas_are_512_mib_per_store_and_128_mib_per_record(
    store: RecoveryStore,
) -> None:
    assert store.max_bytes == 512 * MiB
    assert store.max_record_bytes == 128 * MiB
    stats = store.stats()
    assert stats["max_bytes"] == 512 * MiB and stats["max_record_bytes"] == 128 * MiB
    # The public entry point carries the same defaults (what docs/retention.md shows).
    params = inspect.signature(recoverable.RecoveryStore.open).parameters
    assert params["max_bytes"].default == 512 * MiB
    assert params["max_record_bytes"].default == 128 * MiB


async def test_a_value_one_byte_over_the_default_record_limit_is_refused_unchanged(
    store: RecoveryStore,
) -> None:
    before = store.stats()["bytes_used"]
    too_big = bytes(128 * MiB + 1)

    def put(txn: WriteTxn) -> None:
        txn.put_payload("op-quota", "completion", too_big)

    with pytest.raises(recoverable.StorageLimitExceeded) as info:
        await store.write(put)
    assert info.value.code == "storage_limit_exceeded"
    assert store.get_payload("op-quota", "completion") is None
    assert store.stats()["bytes_used"] == before
    # A value within the default limit is accepted (a small one: no need to fill disks).

    def put_small(txn: WriteTxn) -> None:
        txn.put_payload("op-quota", "completion", b"x" * 1024)

    await store.write(put_small)
    assert store.get_payload("op-quota", "completion") == b"x" * 1024
