"""A composite helper's failure can never be committed half-done."""

from __future__ import annotations

import pytest
from storage_helpers import make_op

from recoverable.errors import FenceMismatch, StorageUnavailable
from recoverable.storage import RecoveryStore, WriteTxn

pytestmark = pytest.mark.both_stores


async def test_a_mutation_that_swallows_a_helper_error_is_rolled_back_whole(
    store: RecoveryStore,
) -> None:
    await store.write(lambda txn: txn.put_operation(make_op("op-a", fence=3)))
    before = store.stats()["bytes_used"]

    def sloppy(txn: WriteTxn) -> str:
        txn.put_payload("op-a", "body", b"x" * 100)
        try:
            txn.put_operation(make_op("op-a", attempts_used=1), expect_fence=99)
        except FenceMismatch:
            pass  # a careless caller carries on
        return "committed?"

    with pytest.raises(StorageUnavailable):
        await store.write(sloppy)
    assert store.get_payload("op-a", "body") is None
    record = store.get_operation("op-a")
    assert record is not None and record.attempts_used == 0 and record.fence == 3
    assert store.stats()["bytes_used"] == before
    assert store.check_integrity() == []


async def test_reads_within_a_mutation_see_its_own_writes(store: RecoveryStore) -> None:
    def write_then_read(txn: WriteTxn) -> tuple[int, bytes | None, bool]:
        txn.put_operation(make_op("op-b"))
        txn.put_operation(make_op("op-b", attempts_used=2))
        # (Not the body: a frozen body is immutable, issue 14.2.)
        txn.put_payload("op-b", "request", b"one")
        txn.put_payload("op-b", "request", b"two")
        assert txn.get_payload("op-b", "request") == b"two"
        record = txn.get_operation("op-b")
        assert record is not None
        txn.delete_payload("op-b", "request")
        return (
            record.attempts_used,
            txn.get_payload("op-b", "request"),
            txn.delete_operation("op-b"),
        )

    assert await store.write(write_then_read) == (2, None, True)
    assert store.get_operation("op-b") is None
    assert store.check_integrity() == []
