"""Records written before the interruption policy (issue 14) decode unchanged: the new
field ``OperationRecord.on_interruption`` is optional, and an old record reads as
``"replace"`` (seed 000's rule); the new value round-trips and stays strict."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from storage_helpers import make_op

from recoverable import machine
from recoverable.errors import CorruptRecord
from recoverable.storage import codec

DATA = Path(__file__).resolve().parents[1] / "data"


def _rows(name: str) -> list[tuple[str, bytes]]:
    lines = [ln for ln in (DATA / name).read_text().splitlines() if ln and not ln.startswith("#")]
    return [(op_id, bytes.fromhex(hexed)) for op_id, hexed in (ln.split() for ln in lines)]


def test_a_version_2_record_without_the_field_reads_as_replace() -> None:
    for op_id, data in _rows("version2_before_usage.hex"):
        assert b"on_interruption" not in data
        rec = codec.decode_operation(data, operation_id=op_id)
        assert rec.on_interruption == "replace"
        # Written again by this version: the field is present and the record round-trips.
        again = codec.encode(rec)
        assert b"on_interruption" in again
        assert codec.decode_operation(again, operation_id=op_id) == rec


def test_version_1_records_read_through_the_upgrader_as_replace() -> None:
    from recoverable.storage import migration  # registers the version-1 upgrader

    assert migration is not None
    rows = [row for row in _rows("version1_records.hex") if row[0].startswith("op_v1")]
    assert len(rows) == 4
    for op_id, data in rows:
        assert codec.decode_operation(data, operation_id=op_id).on_interruption == "replace"


def test_fail_round_trips_and_an_unknown_value_is_a_corrupt_record() -> None:
    rec = make_op("op-fail", on_interruption="fail")
    data = codec.encode(rec)
    back = codec.decode_operation(data, operation_id="op-fail")
    assert back == rec and back.on_interruption == "fail"
    raw = msgspec.msgpack.decode(data)
    for bad in ("retry", 1, None):
        raw["on_interruption"] = bad
        with pytest.raises(CorruptRecord):
            codec.decode_operation(msgspec.msgpack.encode(raw), operation_id="op-fail")


def test_an_old_record_still_follows_the_replacement_rule() -> None:
    op_id, data = _rows("version2_before_usage.hex")[0]
    rec = codec.decode_operation(data, operation_id=op_id)
    transmitting = msgspec.structs.replace(rec, phase="transmitting", completed_at=None)
    # An orphan of an old record is replacement-eligible, never failed "interrupted".
    status = machine.derive_status(transmitting, now=10.0, lease_live=False,
                                   viewer=rec.account)
    assert status.availability != "failed"
