"""Corrupt and unknown-version records: typed errors, listed, never rewritten or deleted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from storage_helpers import make_op

from recoverable.errors import CorruptRecord, RecoveryError, UnsupportedRecordVersion
from recoverable.records import DispositionRecord, LeaseRecord
from recoverable.storage import RecoveryStore, WriteTxn, acquire_lease
from recoverable.types import AccountBinding

pytestmark = pytest.mark.both_stores

CORRUPT = b"\x85\xa7version\x02\xffnot msgpack at all"
FUTURE = msgspec.msgpack.encode({"version": 99, "operation_id": "future", "shiny": True})
# a current version with a missing required field and an unknown one: strict decoding fails
INVALID = msgspec.msgpack.encode({"version": 2, "operation_id": "invalid", "extra": 1})


@pytest.fixture
async def seeded(store: RecoveryStore) -> RecoveryStore:
    def seed(txn: WriteTxn) -> None:
        txn.put_operation(make_op("good"))
        txn.put_raw("operations", b"corrupt", CORRUPT)
        txn.put_raw("operations", b"future", FUTURE)
        txn.put_raw("operations", b"invalid", INVALID)
        txn.put_raw("leases", b"good", msgspec.msgpack.encode({"version": 7}))
        txn.put_raw("commands", b"good", CORRUPT)
        txn.put_raw("dispositions", b"good", FUTURE)

    await store.write(seed)
    return store


def snapshot(store: RecoveryStore) -> dict[str, Any]:
    raw = {
        (table, key): store.get_raw(table, key)
        for table, key in [
            ("operations", b"corrupt"),
            ("operations", b"future"),
            ("operations", b"invalid"),
            ("leases", b"good"),
            ("commands", b"good"),
            ("dispositions", b"good"),
        ]
    }
    return {
        "raw": raw,
        "bytes_used": store.stats()["bytes_used"],
        "entries": store.stats()["entries"],
    }


async def test_strict_decoding_raises_the_typed_error_with_the_id(seeded: RecoveryStore) -> None:
    with pytest.raises(CorruptRecord) as corrupt:
        seeded.get_operation("corrupt")
    assert corrupt.value.operation_id == "corrupt"
    with pytest.raises(UnsupportedRecordVersion) as future:
        seeded.get_operation("future")
    assert future.value.operation_id == "future"
    with pytest.raises(CorruptRecord):
        seeded.get_operation("invalid")
    with pytest.raises(UnsupportedRecordVersion):
        seeded.get_lease("good")
    with pytest.raises(CorruptRecord):
        seeded.get_command("good")
    with pytest.raises(UnsupportedRecordVersion):
        seeded.get_disposition("good")
    assert seeded.commands() == []  # the monitor's scan skips what it cannot read


async def test_inventory_and_integrity_report_unreadable_records(seeded: RecoveryStore) -> None:
    readable, unreadable = seeded.inventory()
    assert [r.operation_id for r in readable] == ["good"]
    assert sorted(unreadable) == ["corrupt", "future", "invalid"]
    # unreadable ids are listed whatever account filter is asked for
    assert seeded.inventory(account=AccountBinding("nobody"))[1] == unreadable
    problems = seeded.check_integrity()
    for fragment in (
        "operations:b'corrupt'",
        "operations:b'future'",
        "operations:b'invalid'",
        "leases:b'good'",
        "commands:b'good'",
        "dispositions:b'good'",
    ):
        assert any(p.startswith(fragment) for p in problems), (fragment, problems)
    assert len(problems) == 6


REFUSED: list[tuple[str, Callable[[WriteTxn], object], type[RecoveryError]]] = [
    ("put corrupt", lambda t: t.put_operation(make_op("corrupt")), CorruptRecord),
    ("put future", lambda t: t.put_operation(make_op("future")), UnsupportedRecordVersion),
    ("put invalid", lambda t: t.put_operation(make_op("invalid")), CorruptRecord),
    ("delete corrupt", lambda t: t.delete_operation("corrupt"), CorruptRecord),
    ("delete future", lambda t: t.delete_operation("future"), UnsupportedRecordVersion),
    ("lease over future op", lambda t: acquire_lease(t, "future", 1.0), UnsupportedRecordVersion),
    ("lease over bad lease", lambda t: acquire_lease(t, "good", 1.0), UnsupportedRecordVersion),
    (
        "put lease",
        lambda t: t.put_lease(
            LeaseRecord(operation_id="good", owner_id="x", token="t", fence=1, acquired_at=1.0)
        ),
        UnsupportedRecordVersion,
    ),
    ("delete lease", lambda t: t.delete_lease("good"), UnsupportedRecordVersion),
    ("put command", lambda t: t.put_command("good", "cancel", 1.0), CorruptRecord),
    ("delete command", lambda t: t.delete_command("good"), CorruptRecord),
    (
        "put disposition",
        lambda t: t.put_disposition(
            DispositionRecord(
                operation_id="good", disposition="abandoned", at=1.0, account=AccountBinding("a")
            )
        ),
        UnsupportedRecordVersion,
    ),
    ("delete disposition", lambda t: t.delete_disposition("good"), UnsupportedRecordVersion),
]


@pytest.mark.parametrize(("name", "mutation", "error"), REFUSED, ids=[r[0] for r in REFUSED])
async def test_write_helpers_refuse_unreadable_records_and_change_nothing(
    seeded: RecoveryStore,
    name: str,
    mutation: Callable[[WriteTxn], object],
    error: type[RecoveryError],
) -> None:
    before = snapshot(seeded)
    with pytest.raises(error):
        await seeded.write(mutation)
    assert snapshot(seeded) == before
    assert seeded.get_operation("good") == make_op("good")  # fence untouched by the lease try
