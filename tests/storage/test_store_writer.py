"""The group-committing writer: batching, isolation of failures, shielded waits."""

from __future__ import annotations

import collections
import hashlib
import threading

import pytest
import trio
import trio.lowlevel
import trio.testing
from storage_helpers import make_op

from recoverable.errors import StorageUnavailable
from recoverable.storage import RecoveryStore, WriteTxn


async def test_a_thousand_concurrent_writers_share_few_commits_and_all_survive_reopen(
    store_path: str,
) -> None:
    with RecoveryStore.open(store_path) as store:
        before = store.stats()
        results: dict[int, str] = {}

        async def one(i: int) -> None:
            def mutation(txn: WriteTxn) -> str:
                body = b"%d" % i  # the record binds its body's digest (issue 11.4)
                digest = hashlib.sha256(body).hexdigest()
                txn.put_operation(make_op(f"op-{i:04d}", body_hash=digest))
                txn.put_payload(f"op-{i:04d}", "body", body)
                return f"ok-{i}"

            results[i] = await store.write(mutation)

        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(one, i)
        after = store.stats()
        writes = after["writes"] - before["writes"]
        commits = after["commits"] - before["commits"]
        assert writes == 1000
        assert commits <= writes / 5, (commits, writes)
        assert after["largest_batch"] > 1
        # No mutation raised: every batch ran once, without a child transaction per write.
        assert after["isolated_reruns"] == before["isolated_reruns"]
        assert results == {i: f"ok-{i}" for i in range(1000)}
    with RecoveryStore.open(store_path) as store:
        readable, unreadable = store.inventory()
        assert sorted(r.operation_id for r in readable) == [f"op-{i:04d}" for i in range(1000)]
        assert unreadable == []
        assert all(store.get_payload(f"op-{i:04d}", "body") == b"%d" % i for i in range(1000))
        assert store.check_integrity() == []


async def test_a_failing_mutation_is_rolled_back_alone_within_its_batch(
    store: RecoveryStore,
) -> None:
    entered, release = threading.Event(), threading.Event()
    outcomes: dict[int, object] = {}

    def blocker(txn: WriteTxn) -> None:
        entered.set()
        release.wait(30)

    async def one(i: int) -> None:
        def mutation(txn: WriteTxn) -> int:
            txn.put_operation(make_op(f"b-{i}", body_hash=hashlib.sha256(b"x").hexdigest()))
            txn.put_payload(f"b-{i}", "body", b"x")
            if i % 3 == 0:
                raise ValueError(f"mutation {i} refuses")
            return i

        try:
            outcomes[i] = await store.write(mutation)
        except ValueError as exc:
            outcomes[i] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.write, blocker)
        await trio.to_thread.run_sync(entered.wait, 30)
        commits_before = store.stats()["commits"]
        reruns_before = store.stats()["isolated_reruns"]
        for i in range(12):
            nursery.start_soon(one, i)
        await trio.testing.wait_all_tasks_blocked()  # all twelve are queued behind the blocker
        assert store.engine.writer is not None and store.engine.writer.queued == 12
        release.set()
    assert store.stats()["commits"] - commits_before == 2  # the blocker's batch, then one batch
    assert store.stats()["largest_batch"] == 12
    # The batch first ran without child transactions; the first failure discarded that run
    # and the batch ran once more, each mutation in its own child transaction.
    assert store.stats()["isolated_reruns"] - reruns_before == 1
    for i in range(12):
        if i % 3 == 0:
            assert isinstance(outcomes[i], ValueError)
            assert store.get_operation(f"b-{i}") is None
            assert store.get_payload(f"b-{i}", "body") is None
        else:
            assert outcomes[i] == i
            assert store.get_operation(f"b-{i}") is not None
    assert store.check_integrity() == []  # bytes_used counted only the committed ones


async def test_a_cancelled_caller_still_learns_the_durable_outcome(store: RecoveryStore) -> None:
    got: list[str] = []
    with trio.CancelScope() as scope:
        scope.cancel()
        got.append(await store.write(lambda t: (t.put_operation(make_op("shielded")), "done")[1]))
        await (
            trio.lowlevel.checkpoint()
        )  # the pending cancellation is delivered at the next checkpoint
        got.append("not reached")
    assert scope.cancelled_caught
    assert got == ["done"]
    assert store.get_operation("shielded") == make_op("shielded")


def test_write_sync_returns_and_raises_like_the_mutation(store: RecoveryStore) -> None:
    assert store.write_sync(lambda t: (t.put_payload("s", "body", b"1"), 42)[1]) == 42
    with pytest.raises(KeyError):
        store.write_sync(lambda t: {}["missing"])
    with pytest.raises(RuntimeError, match="deadlock"):
        store.write_sync(lambda t: store.write_sync(lambda t2: None))
    assert store.get_payload("s", "body") == b"1"


async def test_a_closed_store_refuses_reads_and_writes(store_path: str) -> None:
    store = RecoveryStore.open(store_path)
    store.close()
    with pytest.raises(StorageUnavailable):
        await store.write(lambda t: None)
    with pytest.raises(StorageUnavailable):
        store.get_operation("x")
    with pytest.raises(StorageUnavailable):
        store.last_txnid()


def test_last_txnid_moves_with_every_commit(store: RecoveryStore) -> None:
    first = store.last_txnid()
    store.write_sync(lambda t: t.put_payload("t", "body", b"1"))
    assert store.last_txnid() == first + 1


def test_writers_racing_a_close_each_get_an_outcome_and_successes_are_durable(
    store_path: str,
) -> None:
    """The hand-off takes no lock while the writer is busy; a write queued while the store
    closes is either committed (and its caller told so) or refused with the typed error —
    never left waiting for a writer thread that already ended."""
    store = RecoveryStore.open(store_path)
    done: dict[int, list[int]] = {t: [] for t in range(8)}
    refused: dict[int, BaseException] = {}
    going = threading.Barrier(9)

    def writer(t: int) -> None:
        going.wait(30)
        i = 0
        while True:
            try:
                store.write_sync(lambda txn, t=t, i=i: txn.put_payload(f"w{t}-{i}", "body", b"x"))
            except StorageUnavailable as exc:
                refused[t] = exc
                return
            done[t].append(i)
            i += 1

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    going.wait(30)
    while min(len(v) for v in done.values()) < 5:
        threading.Event().wait(0.001)  # polling the writers' progress, not a correctness bound
    store.close()
    for thread in threads:
        thread.join(60)  # generous: a hung caller is the failure this test looks for
        assert not thread.is_alive()
    assert sorted(refused) == list(range(8))
    with RecoveryStore.open(store_path) as reopened:
        for t, indexes in done.items():
            assert all(reopened.get_payload(f"w{t}-{i}", "body") == b"x" for i in indexes)


def test_a_write_appended_after_the_writer_ended_is_refused_not_stranded(
    store_path: str,
) -> None:
    """The exact race of the lock-free hand-off: the caller passed the "closed?" check,
    then the store stopped and its writer thread drained the queue and ended, then the
    caller appended. It must get ``StorageUnavailable`` (nothing ran), not wait forever."""
    store = RecoveryStore.open(store_path)
    writer = store.engine.writer
    assert writer is not None

    class StopFirst(collections.deque):  # type: ignore[type-arg]
        def append(self, job: object) -> None:
            writer.stop()  # joins the writer thread: it ends with the queue empty
            super().append(job)

    writer._queue = StopFirst(writer._queue)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            writer.write_sync(lambda txn: txn.put_payload("late", "body", b"x"))
        except StorageUnavailable as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(60)  # generous: a stranded caller is the failure this test looks for
    assert not caller.is_alive()
    assert len(outcome) == 1 and "closed" in str(outcome[0])
    assert not writer._queue
    store.close()
    with RecoveryStore.open(store_path) as reopened:
        assert reopened.get_payload("late", "body") is None


async def test_the_writes_of_one_batch_share_one_context_and_see_each_other(
    store: RecoveryStore,
) -> None:
    """Issue 20 wave 2: a batch run without child transactions hands one mutation context
    to all its writes (fewer objects per write for the garbage collector). Each write still
    sees the batch's earlier writes through it, and its per-mutation state starts clean."""
    entered, release = threading.Event(), threading.Event()
    contexts: list[int] = []
    seen: dict[int, object] = {}

    def blocker(txn: WriteTxn) -> None:
        entered.set()
        release.wait(30)

    async def one(i: int) -> None:
        def mutation(txn: WriteTxn) -> None:
            contexts.append(id(txn))
            assert not txn._broken  # per-mutation state is reset for every write
            previous = txn.get_operation(f"s-{i - 1}") if i else None
            seen[i] = None if previous is None else previous.operation_id
            txn.put_operation(make_op(f"s-{i}", body_hash=hashlib.sha256(b"x").hexdigest()))
            txn.put_payload(f"s-{i}", "body", b"x")

        await store.write(mutation)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.write, blocker)
        await trio.to_thread.run_sync(entered.wait, 30)
        for i in range(12):
            nursery.start_soon(one, i)
            await trio.testing.wait_all_tasks_blocked()  # queued in order
        assert store.engine.writer is not None and store.engine.writer.queued == 12
        release.set()
    assert store.stats()["largest_batch"] == 12
    assert len(contexts) == 12 and len(set(contexts)) == 1  # one context for the batch
    # Every write read the one queued just before it, written earlier in the same batch.
    assert seen == {0: None, **{i: f"s-{i - 1}" for i in range(1, 12)}}
    assert store.check_integrity() == []  # bytes_used carried across the shared context
