"""Issue 29 item 10: damaged queue or lease rows fail closed, like a damaged record.

Each damage below used to leave ``wait`` waiting for ever (no worker would ever run the
operation), ``status`` saying ``waiting_for_worker`` and ``sweep`` "nothing to close".
Now ``wait`` raises ``CorruptRecord`` naming the row, ``status`` shows the blocker
``incompatible_record`` and the sweep reports the row; nothing is sent."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import recoverable
from recoverable import errors
from recoverable.actors.sweep import sweep
from recoverable.actors.worker import run_worker
from recoverable.storage.copy import copy_store
from recoverable.storage.keys import operation_key
from recoverable.storage.queue import (
    META_QUEUE_SERIAL,
    encode_member,
    member_key,
    order_key,
)
from recoverable.storage.queue import entry as queue_entry
from recoverable.testing import FixtureProvider

from .conftest import ACCOUNT, REQUEST, Answer, generation_requests, make_backend

pytestmark = pytest.mark.both_stores  # the same rows in both stores


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


def _delete_order_row(op_id: str, serial: int, txn: Any) -> None:
    txn._delete("queue", order_key(serial))  # raw damage: no public raw delete


def _flip_serial(op_id: str, serial: int, txn: Any) -> None:
    txn.put_raw("queue", member_key(op_id), encode_member(serial ^ 0x40, resume=False))


def _flip_lease(op_id: str, serial: int, txn: Any) -> None:
    txn.put_raw("leases", operation_key(op_id), b"\x82\xa7version\x01\xa5owner\xc3")


DAMAGE: dict[str, tuple[Callable[[str, int, Any], None], str, str]] = {
    # damage -> (the raw write, the row the error names, status's queue_reason)
    "order_row_deleted": (_delete_order_row, "queue table, row", "damaged_queue_row"),
    "serial_flipped": (_flip_serial, "queue table, row", "damaged_queue_row"),
    "lease_row_flipped": (_flip_lease, "leases table, row", "damaged_lease_row"),
}


@pytest.mark.parametrize("when", ["before_wait", "while_waiting"])
@pytest.mark.parametrize("damage", list(DAMAGE))
async def test_a_damaged_queue_or_lease_row_fails_closed(
    store: recoverable.RecoveryStore, damage: str, when: str
) -> None:
    write, named, reason = DAMAGE[damage]
    async with FixtureProvider.serve() as provider:
        async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
            handle = await rt.submit(REQUEST, response=Answer, job_id="d", maximum_attempts=2)
            op_id = handle.operation_id
            entry = queue_entry(store, op_id)
            assert entry is not None
            damaged = functools.partial(write, op_id, entry.serial)
            caught: list[BaseException] = []

            async def waiter() -> None:
                try:
                    await rt.wait(handle, response=Answer)
                except errors.RecoveryError as exc:
                    caught.append(exc)

            stop = trio.Event()
            with trio.fail_after(20):  # generous: the poller looks at every row once a second
                async with trio.open_nursery() as nursery:
                    if when == "before_wait":
                        await store.write(damaged)
                    nursery.start_soon(waiter)
                    await trio.testing.wait_all_tasks_blocked()
                    if when == "while_waiting":
                        await store.write(damaged)
                    # A worker of its account and endpoint runs meanwhile: it never sees
                    # the operation (or skips its unreadable lease), and never sends it.
                    nursery.start_soon(functools.partial(
                        run_worker, rt, concurrency=1, authorize=approve, stop=stop
                    ))
                    while not caught:  # noqa: ASYNC110
                        await trio.sleep(0.01)  # (the waiter's own outcome)
                    stop.set()
            assert isinstance(caught[0], errors.CorruptRecord), caught
            assert caught[0].operation_id == op_id
            assert named in str(caught[0])
            status = await rt.status(handle)
            assert "incompatible_record" in status.blockers
            assert status.availability == "blocked" and status.queue is None
            assert status.queue_reason == reason
            assert "abandon" in status.suggested_actions
            (listed,) = (await rt.inventory()).operations
            assert listed.queue_reason == reason
        report = await sweep(store, now=time.time())
        assert report.damaged == 1 and report.damaged_ids == (op_id,)
        assert named.split()[0] in report.damaged_rows[0]
        assert generation_requests(provider, op_id) == []
        # Abandon is the repair: the operation and its rows leave the store.
        async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
            await rt.abandon(handle)
        assert (await sweep(store, now=time.time())).damaged == 0


async def test_a_rolled_back_queue_serial_never_takes_a_queued_operations_place(
    store: recoverable.RecoveryStore, tmp_path: Path
) -> None:
    """The counter went back below serials in use: the next new row would overwrite a
    queued operation's order row (it would never be run again). The enqueue fails
    closed instead, naming the counter; the sweep and check_integrity name it too."""
    async with FixtureProvider.serve() as provider:
        async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
            first = await rt.submit(REQUEST, response=Answer, job_id="a", maximum_attempts=2)
            second = await rt.submit(REQUEST, response=Answer, job_id="b", maximum_attempts=2)
            await store.write(lambda txn: txn._put(  # raw damage: meta is the store's own
                "meta", META_QUEUE_SERIAL, (0).to_bytes(8, "big")))
            with pytest.raises(errors.CorruptRecord) as caught:
                await rt.submit(REQUEST, response=Answer, job_id="c", maximum_attempts=2)
            assert "queue_serial" in str(caught.value)
            assert store.ids_by_job(ACCOUNT, None, "c") == []  # nothing written
            queued = [entry.operation_id for entry in store.queued()]
            assert queued == [first.operation_id, second.operation_id]
            report = await sweep(store, now=time.time())
            assert any("queue_serial" in row for row in report.damaged_rows)
            assert any("queue_serial" in problem for problem in store.check_integrity())
        # The repair: a copy of the store (recoverable migrate-store) carries the counter
        # past every serial in use.
        with recoverable.RecoveryStore.open(str(tmp_path / "copy")) as copy:
            copy_store(store, copy)
            assert copy.check_integrity() == []
            async with recoverable.open_runtime(
                copy, make_backend(provider), account=ACCOUNT
            ) as rt:
                third = await rt.submit(REQUEST, response=Answer, job_id="c", maximum_attempts=2)
            assert [entry.operation_id for entry in copy.queued()] == [
                first.operation_id, second.operation_id, third.operation_id
            ]
