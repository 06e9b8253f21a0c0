"""Damage to the rows that decide whether a worker ever runs a submitted operation (issue
29.10): they fail closed, like a damaged operation record.

A worker finds queued operations through the ``queue`` table's order rows and claims one
only when its lease row says nobody runs it (``storage/queue.py``, ``actors/worker.py``).
So a membership row whose serial names no order row of its operation (the order row was
deleted, or the serial flipped), or a lease row that does not decode, leaves the operation
where no worker will ever run it: ``wait`` would wait for ever. :func:`find_damage` names
such rows (batched reads: a handful for any number of operations); ``wait`` raises the
:class:`RowDamage`'s ``CorruptRecord``, ``status`` shows the blocker ``incompatible_record``
and the sweep reports the row. Nothing here rewrites or deletes a damaged row (abandon is
the repair). A rolled-back queue serial counter is refused by ``WriteTxn.enqueue`` and
named by :func:`counter_damage`.
"""

from __future__ import annotations

from typing import Any, Final, Literal, Protocol

import attrs

from recoverable.errors import CorruptRecord, UnsupportedRecordVersion
from recoverable.storage import codec
from recoverable.storage.keys import operation_key, u64
from recoverable.storage.queue import (
    META_QUEUE_SERIAL,
    counter_problem,
    decode_member,
    member_key,
    member_problem,
    order_key,
)

__all__ = ["QueueLook", "RowDamage", "counter_damage", "find_damage"]

DamagedRow = Literal["damaged_queue_row", "damaged_lease_row"]

_UNREADABLE: Final = (CorruptRecord, UnsupportedRecordVersion)


class ManyReader(Protocol):
    """A store (``storage.base.Store``'s batched getter)."""

    def get_raw_many(self, table: Any, keys: list[bytes]) -> list[bytes | None]: ...


@attrs.frozen
class RowDamage:
    """One operation's damaged queue or lease row: which, and what is wrong with it."""

    operation_id: str
    kind: DamagedRow
    row: str  # "<table> table, row <key>"
    problem: str

    def error(self) -> CorruptRecord:
        return CorruptRecord(
            f"{self.row}: {self.problem}; no worker would ever run the operation (abandon "
            "it, or restore the store)",
            operation_id=self.operation_id,
        )

    def describe(self) -> str:
        return f"{self.row}: {self.problem}"


@attrs.frozen
class QueueLook:
    """What :func:`find_damage` read of some operations."""

    damage: dict[str, RowDamage]  # by operation id: its damaged queue or lease row
    queued: dict[str, bool]  # those with a membership row that is not damaged: its resume flag
    highest_serial: int  # the highest serial of a readable membership row (0: none)


def find_damage(reader: ManyReader, operation_ids: list[str]) -> QueueLook:
    """The damaged queue or lease row of each operation that has one (a queue row first),
    which are queued, and the highest serial in use; three batched reads. An operation
    that is not queued has no queue damage (a row naming a missing operation is not
    damage: removed lazily)."""
    if not operation_ids:
        return QueueLook({}, {}, 0)
    members = reader.get_raw_many("queue", [member_key(op) for op in operation_ids])
    decoded = [None if raw is None else decode_member(raw) for raw in members]
    serials = [member[0] for member in decoded if member is not None]
    orders = iter(reader.get_raw_many("queue", [order_key(serial) for serial in serials]))
    leases = reader.get_raw_many("leases", [operation_key(op) for op in operation_ids])
    found: dict[str, RowDamage] = {}
    queued: dict[str, bool] = {}
    for operation_id, raw, member, lease in zip(
        operation_ids, members, decoded, leases, strict=True
    ):
        order = None if member is None else next(orders)
        if raw is not None:
            problem = member_problem(member, order, operation_key(operation_id))
            if problem is not None:
                found[operation_id] = RowDamage(
                    operation_id, "damaged_queue_row",
                    f"queue table, row {member_key(operation_id)!r}", problem,
                )
                continue
            queued[operation_id] = member is not None and member[1]
        if lease is not None:
            try:
                codec.decode_lease(lease, operation_id=operation_id)
            except _UNREADABLE as exc:
                found[operation_id] = RowDamage(
                    operation_id, "damaged_lease_row",
                    f"leases table, row {operation_key(operation_id)!r}",
                    f"the lease row does not decode ({exc.code}: {exc})",
                )
    _drop_moved(reader, found, dict(zip(operation_ids, members, strict=True)))
    for operation_id in found:
        queued.pop(operation_id, None)
    return QueueLook(found, queued, max(serials, default=0))


def _drop_moved(
    reader: ManyReader, found: dict[str, RowDamage], members: dict[str, bytes | None]
) -> None:
    """Keep only the queue damage that a third read confirms. The membership and order
    rows were read in two snapshots, and an operation may have left the queue between
    them (its two rows go together). Its membership row read again, unchanged, proves
    that did not happen: a new row has a new serial, and an unchanged row always had its
    order row, unless damaged."""
    suspects = [op for op, damage in found.items() if damage.kind == "damaged_queue_row"]
    if not suspects:
        return
    again = reader.get_raw_many("queue", [member_key(op) for op in suspects])
    for operation_id, raw in zip(suspects, again, strict=True):
        if raw != members[operation_id]:
            del found[operation_id]


def counter_damage(reader: ManyReader, highest_serial: int) -> str | None:
    """The queue serial counter's problem (None: none), given the highest serial in use."""
    (raw,) = reader.get_raw_many("meta", [META_QUEUE_SERIAL])
    problem = counter_problem(u64(raw), highest_serial)
    return None if problem is None else f"meta table, row {META_QUEUE_SERIAL!r}: {problem}"
