"""The PostgreSQL writer reads a batch's rows ahead (issue 17): ``store.write(fn,
touches=...)`` names the operations a write reads, the batch's first round trip fetches
them all, and the liveness of every other owner comes with it. No statement is saved at
the cost of a stale answer: what another owner committed is what the batch sees."""

from __future__ import annotations

import time
from typing import Any

import pytest
import trio

from recoverable.actors.lifecycle import write_command
from recoverable.storage import RecoveryStore, acquire_lease, pg_sql
from recoverable.storage.pg_batch import row_id
from recoverable.storage.pg_engine import PgEngine
from tests.storage.storage_helpers import ACCOUNT, make_op


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every statement a snapshot sends one at a time (the writer's lazy reads included)."""
    sent: list[str] = []
    original = pg_sql.SqlSnapshot._rows

    def rows(self: pg_sql.SqlSnapshot, sql: str, params: Any) -> list[Any]:
        sent.append(sql)
        return original(self, sql, params)

    monkeypatch.setattr(pg_sql.SqlSnapshot, "_rows", rows)
    return sent


async def _read_all(store: RecoveryStore, op_ids: list[str], hinted: bool) -> dict[str, Any]:
    """One write per operation, all queued together (one batch): each reads the record,
    the command and the lease."""
    seen: dict[str, Any] = {}

    async def one(op_id: str) -> None:
        def read(txn: Any) -> Any:
            return txn.get_operation(op_id), txn.get_command(op_id), txn.get_lease(op_id)

        seen[op_id] = await store.write(read, touches=(op_id,) if hinted else ())

    async with trio.open_nursery() as nursery:
        for op_id in op_ids:
            nursery.start_soon(one, op_id)
    return seen


async def test_hinted_writes_read_their_rows_in_the_batchs_first_round_trip(
    pg_url: str, statements: list[str]
) -> None:
    ops = [f"op-{i}" for i in range(12)]
    other = RecoveryStore.open(pg_url + "?sslmode=disable")  # another owner (machine)
    mine = RecoveryStore.open(pg_url)
    try:
        assert isinstance(mine.engine, PgEngine)
        for op_id in ops:
            other.write_sync(lambda txn, op_id=op_id: txn.put_operation(make_op(op_id)))
        other.write_sync(lambda txn: txn.put_command("op-3", "suspend", 1.0))
        statements.clear()
        seen = await _read_all(mine, ops, hinted=True)
        assert statements == []  # nothing read one operation at a time
        assert {op_id: record.operation_id for op_id, (record, _c, _l) in seen.items()} == {
            op_id: op_id for op_id in ops
        }
        assert seen["op-3"][1] is not None and seen["op-3"][1].kind == "suspend"
        assert all(seen[op_id][1] is None for op_id in ops if op_id != "op-3")
        # Without the hint, each operation costs the batch one round trip of its own.
        for op_id in ops:
            other.write_sync(lambda txn, op_id=op_id: txn.put_command(op_id, "cancel", 2.0))
        statements.clear()
        unhinted = await _read_all(mine, ops, hinted=False)
        assert len(statements) == len(ops)
        assert all(command.kind == "cancel" for _r, command, _l in unhinted.values())
    finally:
        mine.close()
        other.close()


async def test_a_hinted_read_sees_what_another_owner_committed_since(pg_url: str) -> None:
    """The cached rows of a hinted operation are fetched again under the writers' lock:
    a fence and a command written by another owner since this one's last batch are seen."""
    mine = RecoveryStore.open(pg_url)
    other = RecoveryStore.open(pg_url + "?sslmode=disable")
    try:
        assert isinstance(mine.engine, PgEngine)
        await mine.write(lambda txn: txn.put_operation(make_op("op-1")), touches=("op-1",))
        cache = mine.engine.writer._cache  # type: ignore[union-attr]
        assert cache.rows[row_id("recoverable_operations", b"op-1")] is not None
        lease = other.write_sync(lambda txn: acquire_lease(txn, "op-1", time.time()))
        other.write_sync(lambda txn: txn.put_command("op-1", "cancel", 3.0))
        record, command, stored_lease = await mine.write(
            lambda txn: (txn.get_operation("op-1"), txn.get_command("op-1"),
                         txn.get_lease("op-1")),
            touches=("op-1",),
        )
        assert record.fence == lease.fence == 1
        assert command is not None and command.kind == "cancel"
        assert stored_lease is not None and stored_lease.token == lease.token
    finally:
        other.close()
        mine.close()


async def test_a_batch_knows_which_owners_are_live_without_asking_per_lease(
    pg_url: str, statements: list[str]
) -> None:
    """A cancel of an operation leased by a live owner waits in a command row; once that
    owner is gone, the next cancel applies at once. The liveness comes from the batch's
    first round trip: not one query per lease."""
    mine = RecoveryStore.open(pg_url)
    other = RecoveryStore.open(pg_url + "?sslmode=disable")
    try:
        assert isinstance(mine.engine, PgEngine)
        for op_id in ("op-1", "op-2"):
            other.write_sync(lambda txn, op_id=op_id: txn.put_operation(make_op(op_id)))
            other.write_sync(lambda txn, op_id=op_id: acquire_lease(txn, op_id, time.time()))
        statements.clear()
        command = await mine.write(
            lambda txn: write_command("op-1", "cancel", time.time(), ACCOUNT, txn),
            touches=("op-1",),
        )
        assert command is not None and command.kind == "cancel"  # the owner runs it
        assert mine.engine.liveness_queries == 0 and statements == []
        assert mine.engine.writer.live_owners is None  # type: ignore[union-attr]
        other.close()  # its advisory lock goes with its connection
        applied = await mine.write(
            lambda txn: write_command("op-2", "cancel", time.time(), ACCOUNT, txn),
            touches=("op-2",),
        )
        assert applied is None  # nobody runs it: applied directly
        record = mine.get_operation("op-2")
        assert record is not None and record.phase == "cancelled"
    finally:
        other.close()
        mine.close()


_JOB_SCAN = "SELECT key FROM recoverable_hosts WHERE key >="


async def test_admission_finds_its_job_in_the_range_the_batch_read_first(
    pg_url: str, statements: list[str]
) -> None:
    """"Is this job already here?" (the job index, a prefix of keys) is answered from the
    range the batch's first round trip read for each record about to be created, with the
    batch's own writes laid over it: no buffered write flushed, no scan under the lock.
    Unhinted, it costs one statement (a cursor cost a flush and two)."""
    other = RecoveryStore.open(pg_url + "?sslmode=disable")
    mine = RecoveryStore.open(pg_url)
    try:
        other.write_sync(lambda txn: txn.put_operation(make_op("op-old", job_id="job-1")))
        found: dict[str, list[str]] = {}

        async def admit(op_id: str, job_id: str, hinted: bool) -> None:
            record = make_op(op_id, job_id=job_id)

            def mutation(txn: Any) -> list[str]:
                ids: list[str] = txn.operation_ids_by_job(
                    record.account, record.scope, record.job_id
                )
                if ids:
                    return ids
                txn.put_operation(record)
                return [op_id]

            found[op_id] = await mine.write(mutation, touches=(record,) if hinted else ())

        for hinted, suffix in ((True, "h"), (False, "u")):
            statements.clear()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(admit, f"op-a{suffix}", "job-1", hinted)
                nursery.start_soon(admit, f"op-b{suffix}", f"job-2{suffix}", hinted)
                nursery.start_soon(admit, f"op-c{suffix}", f"job-2{suffix}", hinted)
            scans = [sql for sql in statements if sql.startswith(_JOB_SCAN)]
            if hinted:
                assert statements == []  # nothing read one at a time
            else:  # one statement per admission's scan (a new record's own rows aside)
                assert len(scans) == 3 and all("LIMIT" not in sql for sql in scans), scans
            assert found[f"op-a{suffix}"] == ["op-old"]  # committed by another owner
            # The second admission of job-2 sees the first (same batch or the next).
            assert found[f"op-b{suffix}"] == found[f"op-c{suffix}"]
            assert found[f"op-b{suffix}"][0] in (f"op-b{suffix}", f"op-c{suffix}")
        assert {record.job_id for record in mine.inventory()[0]} == {"job-1", "job-2h", "job-2u"}
        assert len(mine.inventory()[0]) == 3
    finally:
        mine.close()
        other.close()
