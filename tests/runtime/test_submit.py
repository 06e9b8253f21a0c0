"""Issue 14 (w-worker, item 1): ``runtime.submit`` (prepare + enqueue in one transaction,
idempotent by job key) and ``runtime.wait`` (the saved value or the typed terminal error)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb
import pytest
import trio

import recoverable
from recoverable import errors
from recoverable.machine import evolve, idle_phase
from recoverable.storage.queue import entry as queue_entry
from recoverable.storage.store import WriteTxn
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend

OTHER_REQUEST = recoverable.StructuredRequest(
    model="gpt-test", instructions="Answer briefly.", input="What is seven times six?"
)


async def test_submit_is_idempotent_by_job_key_and_queues_once(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        first = await rt.submit(REQUEST, response=Answer, job_id="j1", input_revision="r1",
                                maximum_attempts=3, scope="s")
        again = await rt.submit(REQUEST, response=Answer, job_id="j1", input_revision="r1",
                                maximum_attempts=3, scope="s")
        assert again == first
        queued = store.queued()
        assert [e.operation_id for e in queued] == [first.operation_id]
        # Another revision (or scope) is another job.
        other = await rt.submit(REQUEST, response=Answer, job_id="j1", input_revision="r2",
                                maximum_attempts=3, scope="s")
        assert other.operation_id != first.operation_id
        # Another body under the same key: typed conflict, nothing written.
        before = store.stats()["entries"]
        with pytest.raises(errors.JobConflict) as caught:
            await rt.submit(OTHER_REQUEST, response=Answer, job_id="j1", input_revision="r1",
                            maximum_attempts=3, scope="s")
        assert caught.value.code == "job_conflict"
        assert caught.value.operation_id == first.operation_id
        assert store.stats()["entries"] == before
        status = await rt.status(first)
        assert status.state == "prepared" and status.job_id == "j1"
    assert generation_requests(provider, first.operation_id) == []  # submit never sends
    assert store.check_integrity() == []


async def test_wait_returns_the_value_once_the_operation_ran_elsewhere(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.submit(REQUEST, response=Answer, job_id="j", maximum_attempts=2)
        result: list[Answer] = []

        async def waiter() -> None:
            result.append(await rt.wait(handle, response=Answer))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.sleep(0.05)  # the waiter is polling (not a correctness mechanism)
            assert result == []
            # Run it detached, as a worker does (no caller attached).
            execution = rt.start_operation(handle, response=Answer, authorize=Authorizer())
            await execution.finished.wait()
        assert isinstance(result[0], Answer)
        assert (await rt.receipt(handle)).operation_id == handle.operation_id
        # A submit after completion returns the same handle and never queues it again.
        store_queue = store.queued()
        assert await rt.submit(REQUEST, response=Answer, job_id="j", maximum_attempts=2) == handle
        assert store.queued() == store_queue
        assert await rt.wait(handle, response=Answer) == result[0]
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_wait_raises_the_typed_terminal_error(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    rejected = {"error": {"type": "invalid_request_error", "message": "bad"}}
    provider.script([Reply.http_error(400, rejected)] * 2)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        failed = await rt.submit(REQUEST, response=Answer, job_id="f", maximum_attempts=2)
        execution = rt.start_operation(failed, response=Answer, authorize=Authorizer())
        await execution.finished.wait()
        with trio.fail_after(5):  # generous: a failed record is read at once
            with pytest.raises(errors.PermanentlyFailed):
                await rt.wait(failed, response=Answer)
        cancelled = await rt.submit(REQUEST, response=Answer, job_id="c", maximum_attempts=2)
        await rt.cancel(cancelled)
        with trio.fail_after(5), pytest.raises(errors.OperationCancelled):
            await rt.wait(cancelled, response=Answer)
        suspended = await rt.submit(REQUEST, response=Answer, job_id="s", maximum_attempts=2)
        await rt.suspend(suspended)
        with trio.fail_after(5), pytest.raises(errors.OperationSuspended):
            await rt.wait(suspended, response=Answer)
        wrong = recoverable.JsonSchema("other", {"type": "object", "properties": {},
                                                 "required": [], "additionalProperties": False})
        with trio.fail_after(5), pytest.raises(errors.FormatMismatch):
            await rt.wait(suspended, response=wrong)


async def test_a_worker_suspension_is_flagged_for_resumption_and_wait_goes_on(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.submit(REQUEST, response=Answer, job_id="w", maximum_attempts=2)
        await rt.suspend(handle)

        def flag(txn: WriteTxn) -> int:
            return txn.enqueue(handle.operation_id, resume=True)

        serial = await store.write(flag)
        entry = queue_entry(store, handle.operation_id)
        assert entry is not None and entry.resume and entry.serial == serial
        with trio.move_on_after(0.3):  # still waiting: a worker will resume it
            await rt.wait(handle, response=Answer)
            raise AssertionError("wait returned for a suspension a worker will resume")


async def test_a_worker_claiming_between_reads_is_never_taken_for_a_host_suspension(
    provider: FixtureProvider, store: recoverable.RecoveryStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker claims a suspended operation by spending its resume mark and reopening
    the record in one commit. ``wait`` read the record and the queue row in two reads:
    a claim committed between them showed a suspended record with no mark, and the
    rerun of a stopped ``batch --workers 1`` failed "suspended from outside" (CI). The
    claim is committed here right after ``wait``'s read of the record."""
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.submit(REQUEST, response=Answer, job_id="c", maximum_attempts=2)
        await rt.suspend(handle)
        await store.write(lambda txn: txn.enqueue(handle.operation_id, resume=True))
        read_rows = store.get_raw_rows
        claimed: list[bool] = []

        def claim(txn: WriteTxn) -> None:
            record = txn.get_operation(handle.operation_id)
            assert record is not None and record.phase == "suspended"
            assert txn.spend_resume_mark(handle.operation_id)
            txn.put_operation(evolve(record, phase=idle_phase(record)))

        def read_then_claim(wanted: list[tuple[Any, bytes]]) -> list[bytes | None]:
            rows = read_rows(wanted)
            if not claimed:
                claimed.append(True)
                store.write_sync(claim)
            return rows

        monkeypatch.setattr(store, "get_raw_rows", read_then_claim)
        with trio.move_on_after(0.3):  # still waiting: the worker that claimed it runs it
            await rt.wait(handle, response=Answer)
            raise AssertionError("wait returned for an operation a worker claimed")
        assert claimed


async def test_a_store_without_the_queue_table_opens_and_checks_clean(tmp_path: Path) -> None:
    path = tmp_path / "old"
    store = recoverable.RecoveryStore.open(str(path))
    store.close()
    env = lmdb.open(str(path), max_dbs=16, subdir=True)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"queue", txn=txn), delete=True)
        txn.delete(b"queue_serial", db=env.open_db(b"meta", txn=txn))
    with env.begin() as txn:
        assert txn.get(b"queue", db=None) is None  # the table is gone
    env.close()
    store = recoverable.RecoveryStore.open(str(path))
    try:
        assert store.queued() == [] and store.check_integrity() == []
        async with FixtureProvider.serve() as provider:
            async with recoverable.open_runtime(
                store, make_backend(provider), account=ACCOUNT
            ) as rt:
                handle = await rt.submit(REQUEST, response=Answer, job_id="x",
                                         maximum_attempts=2)
        assert [e.operation_id for e in store.queued()] == [handle.operation_id]
        assert store.check_integrity() == []
    finally:
        store.close()


async def test_the_queue_counts_against_the_quota_and_dequeue_gives_it_back(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        before = store.stats()["bytes_used"]

        def enqueue(txn: WriteTxn) -> int:
            return txn.enqueue(handle.operation_id)

        def dequeue(txn: WriteTxn) -> bool:
            return txn.dequeue(handle.operation_id)

        await store.write(enqueue)
        assert store.stats()["bytes_used"] > before
        assert store.check_integrity() == []
        assert await store.write(dequeue) is True
        assert store.stats()["bytes_used"] == before
        assert await store.write(dequeue) is False
        assert store.check_integrity() == []
