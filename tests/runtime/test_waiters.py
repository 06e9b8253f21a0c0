"""``runtime.wait`` on many operations: one poller per runtime reads the queue rows of every
waited operation at once (``actors/waiters.py``), instead of each waiter polling on its own
(a round trip each on the PostgreSQL store)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio

import recoverable
from recoverable import errors
from recoverable.actors.waiters import may_settle
from tests.storage.storage_helpers import make_op

from .conftest import ACCOUNT, Answer, Authorizer, make_backend

pytestmark = pytest.mark.both_stores
WAITERS = 24


def _request(index: int) -> recoverable.StructuredRequest:
    return recoverable.StructuredRequest(
        model="gpt-test", instructions="Answer briefly.", input=f"question {index}"
    )


async def test_many_waiters_share_one_queue_poller(
    provider: Any, store: recoverable.RecoveryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue_reads: list[bytes] = []
    get_raw = store.get_raw

    def counting_get_raw(table: Any, key: bytes) -> bytes | None:
        if table == "queue":
            queue_reads.append(key)
        return get_raw(table, key)

    monkeypatch.setattr(store, "get_raw", counting_get_raw)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handles = [
            await rt.submit(_request(i), response=Answer, job_id=f"j{i}", maximum_attempts=2)
            for i in range(WAITERS)
        ]
        results: dict[str, Answer] = {}

        async def waiter(handle: recoverable.Handle) -> None:
            results[handle.operation_id] = await rt.wait(handle, response=Answer)

        commits_before = store.last_txnid()
        async with trio.open_nursery() as nursery:
            for handle in handles:
                nursery.start_soon(waiter, handle)
            await trio.testing.wait_all_tasks_blocked()
            assert results == {}
            # Run them detached, as a worker does: each leaves the queue when it ends.
            for handle in handles:
                execution = rt.start_operation(handle, response=Answer, authorize=Authorizer())
                await execution.finished.wait()
        assert sorted(results) == sorted(h.operation_id for h in handles)
        assert all(isinstance(value, Answer) for value in results.values())
        # The waiters read no queue row one by one: the poller read them all at once, at
        # most once per commit (not once per waiter per commit).
        assert queue_reads == []
        assert 1 <= rt.queue_watch.scans <= store.last_txnid() - commits_before + 1


async def test_a_state_that_keeps_the_operation_queued_is_still_found(
    provider: Any, store: recoverable.RecoveryStore
) -> None:
    """A host's suspend leaves the operation queued (no worker saw it yet): the watch's
    look at every waited record (once a second, all at once) finds it, and the waiter
    raises the typed error."""
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.submit(_request(0), response=Answer, job_id="j", maximum_attempts=2)

        async def suspend_soon() -> None:
            # Once the waiter waits on the watch (its first read found it queued; on
            # PostgreSQL that read runs in a thread, which looks blocked to Trio).
            while rt.queue_watch.polls < 1:
                await trio.testing.wait_all_tasks_blocked()
            await rt.suspend(handle)

        with trio.fail_after(10):  # generous: the full read comes within a second
            async with trio.open_nursery() as nursery:
                nursery.start_soon(suspend_soon)
                with pytest.raises(errors.OperationSuspended):
                    await rt.wait(handle, response=Answer)
        assert rt.queue_watch.full_scans >= 1


def test_may_settle_names_what_keeps_an_operation_queued() -> None:
    record = make_op("op-1")
    assert not may_settle(record, False, now=0.0)
    assert may_settle(None, False, now=0.0)  # gone (disposed, purged)
    assert may_settle(record, True, now=0.0)  # a command stands
    assert may_settle(msgspec.structs.replace(record, completed_at=1.0), False, now=0.0)
    for phase in ("suspended", "cancelled", "completed", "failed", "superseded"):
        assert may_settle(msgspec.structs.replace(record, phase=phase), False, now=0.0)
    expiring = msgspec.structs.replace(record, expires_at=100.0)
    assert not may_settle(expiring, False, now=99.0)
    assert may_settle(expiring, False, now=100.0)  # idle past its expiry: StateExpired
    running = msgspec.structs.replace(expiring, phase="transmitting")
    assert not may_settle(running, False, now=100.0)


async def test_an_unreachable_store_ends_the_waits_with_the_typed_error_at_once(
    provider: Any, store: recoverable.RecoveryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the poller cannot read the store, every waiter reads again at once and meets
    the typed error itself (not after the watch's long safety bound)."""
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.submit(_request(0), response=Answer, job_id="j", maximum_attempts=2)

        def unreachable(*_args: Any, **_kwargs: Any) -> Any:
            raise errors.StorageUnavailable("the database is unreachable (test)")

        async def cut_soon() -> None:
            await trio.testing.wait_all_tasks_blocked()
            monkeypatch.setattr(store, "last_txnid", unreachable)
            monkeypatch.setattr(store, "get_operation", unreachable)
            monkeypatch.setattr(store, "get_raw_rows", unreachable)  # what wait() reads

        with trio.fail_after(5):  # generous: the poller's next look is within 0.2 s
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cut_soon)
                with pytest.raises(errors.StorageUnavailable):
                    await rt.wait(handle, response=Answer)
        monkeypatch.undo()
