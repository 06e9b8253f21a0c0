"""Records written before the usage ledger (issue 19.3) decode unchanged: the new fields
(``AttemptRecord.usage``, ``OperationRecord.maximum_output_tokens_total``,
``Interruption.usage``/``usage_malformed``) are optional with defaults."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from storage_helpers import ACCOUNT, make_op

from recoverable import machine
from recoverable.errors import CorruptRecord
from recoverable.outcome import Usage
from recoverable.records import AttemptRecord, DispositionRecord
from recoverable.storage import codec

DATA = Path(__file__).resolve().parents[1] / "data" / "version2_before_usage.hex"


def old_record() -> tuple[str, bytes]:
    lines = [ln for ln in DATA.read_text().splitlines() if ln and not ln.startswith("#")]
    op_id, hexed = lines[0].split()
    return op_id, bytes.fromhex(hexed)


def test_a_record_written_before_the_usage_fields_decodes_unchanged() -> None:
    op_id, data = old_record()
    assert b"usage" not in data and b"maximum_output_tokens_total" not in data
    rec = codec.decode_operation(data, operation_id=op_id)
    assert rec.version == 2 and rec.attempts_used == 2
    assert [a.usage for a in rec.attempts] == [None, None]
    assert rec.maximum_output_tokens_total is None and not rec.token_budget_spent
    assert rec.usage == Usage()
    first = rec.attempts[0].failure
    assert first is not None and first.kind == "incomplete" and first.usage is None
    status = machine.derive_status(rec, now=10.0, lease_live=False, viewer=rec.account)
    assert status.usage == Usage() and status.state == "completed"
    # Written again by this version, it round-trips with the new fields present.
    again = codec.encode(rec)
    assert codec.decode_operation(again, operation_id=op_id) == rec


def test_the_new_fields_round_trip_and_stay_strict() -> None:
    rec = make_op(
        "op-new",
        attempts_used=1,
        maximum_output_tokens_total=5000,
        attempts=(
            AttemptRecord(
                attempt_id="op-new.1", number=1, reason="initial", consumed_at=1.0,
                outcome="completed",
                usage=Usage(input_tokens=9, cached_input_tokens=4, output_tokens=7,
                            reasoning_tokens=2),
            ),
        ),
    )
    data = codec.encode(rec)
    back = codec.decode_operation(data, operation_id="op-new")
    assert back == rec and back.usage.output_tokens == 7
    # A usage with an unknown key, a wrong type or a negative count is a corrupt record.
    raw = msgspec.msgpack.decode(data)
    raw["attempts"][0]["usage"]["surprise"] = 1
    with pytest.raises(CorruptRecord):
        codec.decode_operation(msgspec.msgpack.encode(raw), operation_id="op-new")
    for bad in ({"input_tokens": "many"}, {"output_tokens": -3}):
        raw["attempts"][0]["usage"] = bad
        with pytest.raises(CorruptRecord):
            codec.decode_operation(msgspec.msgpack.encode(raw), operation_id="op-new")


def test_a_disposition_marker_without_usage_decodes_unchanged() -> None:
    marker = DispositionRecord(
        operation_id="op-d", disposition="acknowledged", at=5.0, account=ACCOUNT,
        usage=Usage(input_tokens=3, output_tokens=2),
    )
    raw = msgspec.msgpack.decode(codec.encode(marker))
    assert raw.pop("usage") == {"input_tokens": 3, "cached_input_tokens": 0,
                                "output_tokens": 2, "reasoning_tokens": 0}
    old = codec.decode_disposition(msgspec.msgpack.encode(raw), operation_id="op-d")
    assert old.usage is None and old.attempts_used == 0
    assert codec.decode_disposition(codec.encode(marker), operation_id="op-d") == marker
