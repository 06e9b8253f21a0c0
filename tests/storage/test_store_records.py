"""Round trips, deterministic encoding, indexes and the upgrader hook."""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from storage_helpers import ACCOUNT, OTHER, make_op, spawn_child

from recoverable.errors import (
    AdmissionChanged,
    CorruptRecord,
    InvalidRequest,
    UnsupportedRecordVersion,
)
from recoverable.outcome import Interruption
from recoverable.records import (
    AttemptRecord,
    CommandRecord,
    DispositionRecord,
    LeaseRecord,
    OperationRecord,
    PendingAttempt,
    RetryReservation,
)
from recoverable.storage import (
    RecoveryStore,
    WriteTxn,
    codec,
    register_operation_upgrader,
    unregister_operation_upgrader,
)
from recoverable.storage.keys import operation_key, payload_key

pytestmark = pytest.mark.both_stores


def full_op(op_id: str) -> OperationRecord:
    return make_op(
        op_id,
        phase="waiting",
        next_attempt_at=1_700_000_100.5,
        attempts_used=2,
        attempts=(
            AttemptRecord(
                attempt_id="att-1",
                number=1,
                reason="initial",
                consumed_at=1.5,
                outcome="failed",
                response_id="resp_1",
                sequence_number=7,
                failure=Interruption(kind="http_rejected", http_status=429, retry_after=2.0),
            ),
        ),
        pending=PendingAttempt("att-2", 2, "replacement"),
        expires_at=1_800_000_000.0,
        scope="campaign",
        job_id="job-7",
        input_revision="r3",
        contract_version="v2",
        retry_reservation=RetryReservation("act", "succ", "hash"),
        last_failure=Interruption(kind="disconnected", had_output=True),
    )


def test_every_record_type_and_payload_round_trips_across_reopen(store_path: str) -> None:
    body = bytes(range(256)) * 10
    # The record binds its body's digest (check_integrity verifies it, issue 11.4).
    op = msgspec.structs.replace(full_op("op-1"), body_hash=hashlib.sha256(body).hexdigest())
    lease = LeaseRecord(operation_id="op-1", owner_id="o" * 32, token="t", fence=3, acquired_at=2.0)
    disposition = DispositionRecord(
        operation_id="op-1", disposition="acknowledged", at=3.0, account=ACCOUNT, scope=None
    )
    with RecoveryStore.open(store_path) as store:

        def write_all(txn: WriteTxn) -> CommandRecord:
            txn.put_operation(op)
            txn.put_lease(lease)
            txn.put_disposition(disposition)
            txn.put_payload("op-1", "body", body)
            txn.put_payload("op-1", "completion", b"")
            return txn.put_command("op-1", "suspend", 4.0)

        command = store.write_sync(write_all)
        assert command.serial == 1 and command.kind == "suspend"
    with RecoveryStore.open(store_path) as store:
        assert store.get_operation("op-1") == op
        assert store.get_lease("op-1") == lease
        assert store.get_disposition("op-1") == disposition
        assert store.get_command("op-1") == command
        assert store.commands() == [command]
        assert store.get_payload("op-1", "body") == body
        assert store.get_payload("op-1", "completion") == b""
        assert store.get_payload("op-1", "request") is None
        assert store.get_operation("missing") is None
        assert store.check_integrity() == []


def test_same_record_gives_same_bytes_in_every_process() -> None:
    op = make_op("op-det", scope="s", job_id="j")
    here = codec.encode(op)
    assert codec.encode(msgspec.structs.replace(op)) == here
    assert codec.decode_operation(here) == op
    outputs = set()
    for seed in ("1", "2", "3"):  # set order follows the (per-process) string hash seed
        proc = spawn_child("encode", env={"PYTHONHASHSEED": seed})
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outputs.add(out.strip())
    assert outputs == {here.hex()}


def test_encoding_refuses_to_write_a_foreign_version() -> None:
    with pytest.raises(ValueError, match="version"):
        codec.encode(make_op("x", version=1))


async def test_command_serials_increase_and_cancel_is_never_replaced(
    store: RecoveryStore,
) -> None:
    first = await store.write(lambda t: t.put_command("a", "suspend", 1.0))
    second = await store.write(lambda t: t.put_command("b", "cancel", 2.0))
    third = await store.write(lambda t: t.put_command("b", "suspend", 3.0))
    assert (first.serial, second.serial) == (1, 2)
    assert third == second  # the permanent cancel stays
    assert [c.operation_id for c in store.commands()] == ["a", "b"]
    assert store.commands(after_serial=1) == [second]
    assert store.last_command_serial() == 2
    txnid, snapshot = store.commands_snapshot(after_serial=1)
    assert txnid == store.last_txnid() and snapshot == [second]
    assert await store.write(lambda t: t.delete_command("a")) is True
    assert store.get_command("a") is None


async def test_no_schedule_index_is_written_and_next_attempt_at_stays_checked(
    store: RecoveryStore,
) -> None:
    # Issue 13.4: the schedule index was written on every put and read by nothing; it is
    # retired. A waiting record leaves no row beyond itself and its hosts entry.
    waiting = make_op("late", phase="waiting", next_attempt_at=30.0)
    await store.write(lambda t: t.put_operation(waiting))
    await store.write(lambda t: t.put_operation(make_op("idle", next_attempt_at=1.0)))
    stats = store.stats()
    assert stats["entries"] == 4  # two operations, two hosts entries
    assert "waiting" not in dir(store)
    await store.write(
        lambda t: t.put_operation(make_op("late", phase="waiting", next_attempt_at=1.0))
    )
    assert await store.write(lambda t: t.delete_operation("late")) is True
    assert store.stats()["entries"] == 2
    assert store.check_integrity() == []
    # A waiting record's next_attempt_at must still be a finite number.
    for bad in (float("nan"), float("inf")):
        with pytest.raises(InvalidRequest):
            await store.write(
                lambda t, bad=bad: t.put_operation(
                    make_op("nan", phase="waiting", next_attempt_at=bad)
                )
            )
    assert store.get_operation("nan") is None


async def test_hosts_index_tells_none_from_empty_and_follows_changes(store: RecoveryStore) -> None:
    await store.write(lambda t: t.put_operation(make_op("n1", scope=None, job_id=None)))
    await store.write(lambda t: t.put_operation(make_op("e1", scope="", job_id="")))
    await store.write(lambda t: t.put_operation(make_op("j1", scope="s", job_id="job")))
    await store.write(lambda t: t.put_operation(make_op("j2", scope="s", job_id="job")))
    await store.write(
        lambda t: t.put_operation(make_op("o1", account=OTHER, scope="s", job_id="job"))
    )
    assert store.ids_by_job(ACCOUNT, None, None) == ["n1"]
    assert store.ids_by_job(ACCOUNT, "", "") == ["e1"]
    assert sorted(store.ids_by_job(ACCOUNT, "s", "job")) == ["j1", "j2"]
    assert store.ids_by_job(OTHER, "s", "job") == ["o1"]
    # The job id is an admission field (issue 14.2): a rewrite cannot move it ...
    with pytest.raises(AdmissionChanged):
        await store.write(lambda t: t.put_operation(make_op("j2", scope="s", job_id="other")))
    assert sorted(store.ids_by_job(ACCOUNT, "s", "job")) == ["j1", "j2"]
    # ... a deletion and a new record under the same id can (the index follows both).
    await store.write(lambda t: t.delete_operation("j2"))
    await store.write(lambda t: t.put_operation(make_op("j2", scope="s", job_id="other")))
    assert store.ids_by_job(ACCOUNT, "s", "job") == ["j1"]
    assert store.ids_by_job(ACCOUNT, "s", "other") == ["j2"]
    readable, unreadable = store.inventory(account=ACCOUNT, scope="s")
    assert sorted(r.operation_id for r in readable) == ["j1", "j2"] and unreadable == []
    assert len(store.inventory()[0]) == 5
    assert store.check_integrity() == []


async def test_invalid_ids_and_kinds_are_typed_errors(store: RecoveryStore) -> None:
    for bad in ("", "a\0b", "x" * 401):
        with pytest.raises(InvalidRequest):
            store.get_operation(bad)
    with pytest.raises(InvalidRequest):
        await store.write(lambda t: t.put_payload("op", "secret", b""))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        await store.write(lambda t: t.put_raw("meta", b"bytes_used", b"\0"))


async def test_registered_upgrader_reads_an_old_version_and_allows_rewrite(
    store: RecoveryStore,
) -> None:
    # a version nobody else registers (the real V1 migration registers version 1)
    old = msgspec.msgpack.encode({"version": 101, "id": "v1-op", "attempts": 2})

    def upgrade(data: bytes) -> OperationRecord:
        legacy = msgspec.msgpack.decode(data)
        return make_op(legacy["id"], attempts_used=legacy["attempts"], upgraded_from=101)

    await store.write(lambda t: t.put_raw("operations", b"v1-op", old))
    with pytest.raises(UnsupportedRecordVersion):
        store.get_operation("v1-op")
    register_operation_upgrader(101, upgrade)
    try:
        record = store.get_operation("v1-op")
        assert record is not None and record.upgraded_from == 101 and record.attempts_used == 2
        assert store.inventory()[1] == []
        await store.write(lambda t: t.put_operation(record))  # migration writes version 2
        assert codec.read_version(store.get_raw("operations", b"v1-op") or b"") == 2
    finally:
        unregister_operation_upgrader(101)
    assert store.get_operation("v1-op") == record  # now a current record


def test_failing_upgrader_makes_the_record_corrupt() -> None:
    def broken(data: bytes) -> OperationRecord:
        raise KeyError("id")

    register_operation_upgrader(102, broken)
    try:
        with pytest.raises(CorruptRecord):
            codec.decode_operation(msgspec.msgpack.encode({"version": 102}))
    finally:
        unregister_operation_upgrader(102)
    with pytest.raises(UnsupportedRecordVersion):
        codec.decode_operation(msgspec.msgpack.encode({"version": 102}))
    with pytest.raises(ValueError):
        register_operation_upgrader(2, broken)


def test_get_raw_rows_reads_rows_of_several_tables_in_the_order_asked(
    store: RecoveryStore,
) -> None:
    store.write_sync(lambda txn: (
        txn.put_operation(make_op("op-r")), txn.put_payload("op-r", "completion", b"{}"),
        txn.put_command("op-r", "suspend", 1.0),
    ))
    key = operation_key("op-r")
    wanted = [
        ("payloads", payload_key("op-r", "completion")), ("operations", key),
        ("commands", key), ("leases", key), ("operations", operation_key("op-none")),
        ("operations", key),
    ]
    rows = store.get_raw_rows(wanted)
    assert rows == [
        b"{}", store.get_raw("operations", key), store.get_raw("commands", key), None, None,
        store.get_raw("operations", key),
    ]
    assert rows[1] is not None and rows[2] is not None
    assert store.get_raw_rows([]) == []


def test_ids_by_job_lists_exactly_the_job_s_operations(store: RecoveryStore) -> None:
    store.write_sync(lambda txn: (
        txn.put_operation(make_op("op-1", job_id="job-1", scope="s")),
        txn.put_operation(make_op("op-2", job_id="job-1", scope="s")),
        txn.put_operation(make_op("op-3", job_id="job-10", scope="s")),
        txn.put_operation(make_op("op-4", job_id="job-1", scope="t")),
        txn.put_operation(make_op("op-5", job_id="job-1", scope="s", account=OTHER)),
    ))
    assert sorted(store.ids_by_job(ACCOUNT, "s", "job-1")) == ["op-1", "op-2"]
    assert store.ids_by_job(ACCOUNT, "s", "job-10") == ["op-3"]
    assert store.ids_by_job(ACCOUNT, None, "job-1") == []
    assert store.ids_by_job(OTHER, "s", "job-1") == ["op-5"]
