"""A mutation that raises inside a PostgreSQL write batch costs the batch nothing more.

Its writes are buffered in memory until the batch flushes them, so when none of them was
sent, forgetting them undoes it whole: the other mutations of the batch commit in the
same transaction, with no savepoint round trips and no rerun. Only a mutation whose
writes already reached the server (a cursor flushed them) needs the savepoint rerun. With
two workers racing for the same queued operations a refused claim was in almost every
batch, and under the fleet's writers' lock each rerun cost a round trip per mutation.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable

import trio
import trio.testing

from recoverable.storage import RecoveryStore, WriteTxn
from tests.storage.storage_helpers import make_op

_BODY_HASH = hashlib.sha256(b"x").hexdigest()


async def _one_batch(
    store: RecoveryStore, mutations: list[Callable[[WriteTxn], int]]
) -> dict[int, object]:
    """Run ``mutations`` as one batch (queued behind a blocker); their outcomes."""
    entered, release = threading.Event(), threading.Event()
    outcomes: dict[int, object] = {}

    def blocker(txn: WriteTxn) -> None:
        entered.set()
        release.wait(30)

    async def one(index: int, mutation: Callable[[WriteTxn], int]) -> None:
        try:
            outcomes[index] = await store.write(mutation)
        except ValueError as exc:
            outcomes[index] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.write, blocker)
        await trio.to_thread.run_sync(entered.wait, 30)
        for index, mutation in enumerate(mutations):
            nursery.start_soon(one, index, mutation)
        await trio.testing.wait_all_tasks_blocked()
        writer = store.engine.writer
        assert writer is not None and writer.queued == len(mutations)
        release.set()
    return outcomes


def _writer(index: int, aborted: list[int], *, scan: bool) -> Callable[[WriteTxn], int]:
    def mutation(txn: WriteTxn) -> int:
        txn.on_abort(lambda: aborted.append(index))
        txn.put_operation(make_op(f"b-{index}", body_hash=_BODY_HASH))
        txn.put_payload(f"b-{index}", "body", b"x")
        if scan:
            # A raw cursor (what a scan without a prefix of its own would use): the
            # writes so far are sent first.
            txn._txn.cursor(txn._dbs["payloads"]).set_range(b"b-")
        if index % 3 == 0:
            raise ValueError(f"mutation {index} refuses")
        return index

    return mutation


def _assert_outcomes(store: RecoveryStore, outcomes: dict[int, object]) -> None:
    for index in range(12):
        if index % 3 == 0:
            assert isinstance(outcomes[index], ValueError)
            assert store.get_operation(f"b-{index}") is None
            assert store.get_payload(f"b-{index}", "body") is None
        else:
            assert outcomes[index] == index
            assert store.get_operation(f"b-{index}") is not None
            assert store.get_payload(f"b-{index}", "body") == b"x"
    assert store.check_integrity() == []  # bytes_used counted the committed ones only


async def test_a_failing_mutation_is_undone_in_memory_and_its_batch_commits_once(
    pg_url: str,
) -> None:
    with RecoveryStore.open(pg_url) as store:
        before = store.stats()
        aborted: list[int] = []
        outcomes = await _one_batch(store, [_writer(i, aborted, scan=False) for i in range(12)])
        after = store.stats()
        assert after["commits"] - before["commits"] == 2  # the blocker's batch, then one
        assert after["largest_batch"] == 12
        # No rerun: the four refusals were forgotten in memory, the batch went on.
        assert after["isolated_reruns"] == before["isolated_reruns"]
        assert after["reruns"] == before["reruns"]
        # Each failed mutation's abort hooks ran, and only theirs.
        assert sorted(aborted) == [0, 3, 6, 9]
        _assert_outcomes(store, outcomes)
    with RecoveryStore.open(pg_url) as store:  # what committed is what a new owner reads
        _assert_outcomes(store, outcomes)


async def test_a_failing_mutation_whose_writes_were_sent_is_undone_by_a_savepoint(
    pg_url: str,
) -> None:
    with RecoveryStore.open(pg_url) as store:
        before = store.stats()
        aborted: list[int] = []
        outcomes = await _one_batch(store, [_writer(i, aborted, scan=True) for i in range(12)])
        after = store.stats()
        # The first failure had sent its writes: the run was discarded (the hooks of its
        # mutations so far ran) and the batch ran again, each mutation in its own
        # savepoint (the failing ones' hooks ran again).
        assert after["isolated_reruns"] - before["isolated_reruns"] == 1
        assert after["commits"] - before["commits"] == 2
        assert {0, 3, 6, 9} <= set(aborted) and len(aborted) > 4
        _assert_outcomes(store, outcomes)
