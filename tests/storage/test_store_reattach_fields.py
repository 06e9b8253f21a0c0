"""Issue 15: records written before reattachment decode unchanged (``reattach`` False, no
checkpoint time, no reattachments), and the new fields round-trip strictly."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from storage_helpers import make_op

from recoverable.errors import CorruptRecord
from recoverable.records import AttemptRecord
from recoverable.storage import codec

DATA = Path(__file__).resolve().parents[1] / "data"


def _rows(name: str) -> list[tuple[str, bytes]]:
    lines = [ln for ln in (DATA / name).read_text().splitlines() if ln and not ln.startswith("#")]
    return [(op_id, bytes.fromhex(hexed)) for op_id, hexed in (ln.split() for ln in lines)]


def test_a_record_written_before_reattachment_reads_as_not_reattached() -> None:
    for op_id, data in _rows("version2_before_usage.hex"):
        assert b"reattach" not in data
        rec = codec.decode_operation(data, operation_id=op_id)
        assert rec.reattach is False and rec.reattachments == 0
        for attempt in rec.attempts:
            assert attempt.reattachments == 0 and attempt.checkpoint_at is None
            assert not attempt.reattached and attempt.server_cancel is None
        assert codec.decode_operation(codec.encode(rec), operation_id=op_id) == rec


def test_the_reattachment_fields_round_trip_and_stay_strict() -> None:
    attempt = AttemptRecord(attempt_id="op-r.1", number=1, reason="initial", consumed_at=1.0,
                            outcome="completed", response_id="resp_1", sequence_number=300,
                            checkpoint_at=2.0, reattachments=2, server_cancel=None)
    rec = make_op("op-r", reattach=True, attempts=(attempt,), attempts_used=1)
    back = codec.decode_operation(codec.encode(rec), operation_id="op-r")
    assert back == rec and back.reattach and back.attempts[0].reattached
    raw = msgspec.msgpack.decode(codec.encode(rec))
    raw["reattach"] = "yes"
    with pytest.raises(CorruptRecord):
        codec.decode_operation(msgspec.msgpack.encode(raw), operation_id="op-r")
