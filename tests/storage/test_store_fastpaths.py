"""The lean write path of issue 20 (wave 3) still refuses everything the full path refused.

- The write transaction's hot read takes the key of a plain ``str`` id from the key cache
  without ``operation_key``'s frame: every id ``operation_key`` refuses is still refused.
- Composite helpers are atomic by an inline ``try``/``except`` (no context manager per
  call): a mutation that swallows any of their errors is still rolled back whole.
- A ``FencedWrite`` is itself the mutation handed to ``store.write`` (no ``partial``):
  a stale fence, a newer command and a changed admission field are still refused, and a
  refused write changes nothing.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
from storage_helpers import make_op

from recoverable import machine
from recoverable.actors import fenced
from recoverable.errors import (
    AdmissionChanged,
    CorruptRecord,
    FenceMismatch,
    InvalidRequest,
    StorageUnavailable,
)
from recoverable.records import AttemptRecord, OperationRecord
from recoverable.storage import RecoveryStore, WriteTxn
from recoverable.storage.queue import member_key

pytestmark = pytest.mark.both_stores


class _Id(str):
    """A ``str`` subclass: not the key cache's fast case, the same key."""


@pytest.mark.parametrize("bad", ["", 123, None, b"op-a", "a\0b", "x" * 401])
async def test_ids_operation_key_refuses_are_refused_inside_a_write(
    store: RecoveryStore, bad: Any
) -> None:
    with pytest.raises(InvalidRequest):
        await store.write(lambda txn: txn.get_operation(bad))


async def test_a_str_subclass_id_reads_the_same_record(store: RecoveryStore) -> None:
    await store.write(lambda txn: txn.put_operation(make_op("op-a", fence=2)))

    def read(txn: WriteTxn) -> tuple[OperationRecord | None, OperationRecord | None]:
        return txn.get_operation(_Id("op-a")), txn.get_operation("op-a")

    by_subclass, by_str = await store.write(read)
    assert by_subclass is not None and by_subclass == by_str and by_subclass.fence == 2


async def test_a_swallowed_delete_operation_failure_rolls_the_mutation_back(
    store: RecoveryStore,
) -> None:
    await store.write(lambda txn: txn.put_operation(make_op("op-a", fence=3)))
    before = store.stats()["bytes_used"]

    def sloppy(txn: WriteTxn) -> None:
        txn.put_payload("op-a", "request", b"r" * 50)
        try:
            txn.delete_operation("op-a", expect_fence=99)
        except FenceMismatch:
            pass  # a careless caller carries on

    with pytest.raises(StorageUnavailable):
        await store.write(sloppy)
    assert store.get_payload("op-a", "request") is None
    assert store.get_operation("op-a") is not None
    assert store.stats()["bytes_used"] == before


async def test_a_swallowed_enqueue_failure_rolls_the_mutation_back(
    store: RecoveryStore,
) -> None:
    await store.write(lambda txn: txn.put_operation(make_op("op-q")))
    await store.write(lambda txn: txn.put_raw("queue", member_key("op-q"), b"\xff junk"))
    before = store.stats()["bytes_used"]

    def sloppy(txn: WriteTxn) -> None:
        txn.put_payload("op-q", "request", b"r" * 50)
        try:
            txn.enqueue("op-q")
        except CorruptRecord:
            pass  # the queue row is unreadable; a careless caller carries on

    with pytest.raises(StorageUnavailable):
        await store.write(sloppy)
    assert store.get_payload("op-q", "request") is None
    assert store.stats()["bytes_used"] == before


def _running(op_id: str, fence: int) -> OperationRecord:
    attempt = AttemptRecord(f"{op_id}.1", 1, "initial", 1.0)
    return make_op(op_id, phase="transmitting", attempts_used=1, attempts=(attempt,),
                   fence=fence)


def _completion_write(
    stored: OperationRecord, *, fence: int, known_serial: int = 0, **changes: Any
) -> fenced.FencedWrite:
    done = machine.evolve(
        stored, phase="completed", completed_at=2.0,
        attempts=(AttemptRecord(f"{stored.operation_id}.1", 1, "initial", 1.0,
                                outcome="completed"),),
        **changes,
    )
    return fenced.FencedWrite(
        operation_id=stored.operation_id,
        transition=machine.Transition(done, machine.Deliver(), True),
        fence=fence, known_serial=known_serial, check_commands=True,
        completion=b'{"answer":1}',
    )


async def test_a_fenced_write_is_the_mutation_and_refuses_a_stale_fence(
    store: RecoveryStore,
) -> None:
    stored = _running("op-f", fence=4)
    await store.write(lambda txn: txn.put_operation(stored))
    with pytest.raises(FenceMismatch):
        await store.write(_completion_write(stored, fence=3))  # a newer owner took it
    assert store.get_operation("op-f") == stored
    assert store.get_payload("op-f", "completion") is None
    persisted = await store.write(_completion_write(stored, fence=4))
    assert isinstance(persisted, fenced.Persisted)
    assert persisted.transition.record.phase == "completed"
    assert store.get_operation("op-f") == persisted.transition.record
    assert store.get_payload("op-f", "completion") == b'{"answer":1}'


async def test_a_fenced_write_refuses_a_command_newer_than_it_knows(
    store: RecoveryStore,
) -> None:
    stored = _running("op-c", fence=1)
    await store.write(lambda txn: txn.put_operation(stored))
    command = await store.write(lambda txn: txn.put_command("op-c", "cancel", 5.0))
    with pytest.raises(fenced.CommandArrived) as arrived:
        await store.write(_completion_write(stored, fence=1, known_serial=command.serial - 1))
    assert (arrived.value.kind, arrived.value.serial) == ("cancel", command.serial)
    assert store.get_operation("op-c") == stored
    assert store.get_payload("op-c", "completion") is None
    # Knowing it, the write goes through (the machine decided with the command in view).
    await store.write(_completion_write(stored, fence=1, known_serial=command.serial))
    assert store.get_operation("op-c").phase == "completed"  # type: ignore[union-attr]


async def test_a_fenced_write_refuses_a_changed_admission_field(
    store: RecoveryStore,
) -> None:
    stored = _running("op-m", fence=2)
    await store.write(lambda txn: txn.put_operation(stored))
    with pytest.raises(AdmissionChanged):
        await store.write(_completion_write(stored, fence=2, model="another-model"))
    assert store.get_operation("op-m") == stored
    assert store.get_payload("op-m", "completion") is None


async def test_a_write_transactions_read_caches_are_never_tracked_by_the_collector(
    store: RecoveryStore,
) -> None:
    """Issue 20: keyed by bytes and holding bytes, ``None`` and ``gc=False`` records only,
    the caches of a batch (alive for the whole batch) add nothing for the collector to
    walk, however many rows a batch reads."""
    await store.write(lambda txn: txn.put_operation(make_op("op-g", fence=1)))
    await store.write(lambda txn: txn.put_payload("op-g", "request", b"r"))

    def busy(txn: WriteTxn) -> tuple[bool, ...]:
        assert txn.get_operation("op-g") is not None
        txn.get_lease("op-g")
        txn.get_command("op-g")
        txn.get_disposition("op-g")
        txn.get_payload("op-g", "request")
        txn.put_operation(make_op("op-g", fence=1, attempts_used=1), expect_fence=1)
        txn.delete_payload("op-g", "request")
        caches = [value for value in vars(txn).values() if isinstance(value, dict)]
        assert len(caches) >= 2
        return tuple(gc.is_tracked(cache) for cache in caches)

    tracked = await store.write(busy)
    assert tracked and not any(tracked)
