"""Version-1 records, from real stored bytes: kept ids, budgets, receipts, cancellation."""

from __future__ import annotations

from pathlib import Path

import pytest
from recoverable.storage.store import WriteTxn, operation_key

import recoverable
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, Answer, Authorizer, generation_requests, make_backend

V1_SCHEMA = recoverable.JsonSchema(
    "Answer",
    {
        "type": "object",
        "properties": {"answer": {"type": "integer"}, "note": {"type": "string"}},
        "required": ["answer", "note"],
        "additionalProperties": False,
    },
)
DATA = Path(__file__).resolve().parents[1] / "data" / "version1_records.hex"


def load_records(store: recoverable.RecoveryStore) -> dict[str, bytes]:
    rows: dict[str, bytes] = {}
    for line in DATA.read_text().splitlines():
        if line and not line.startswith("#"):
            op_id, hexed = line.split()
            rows[op_id] = bytes.fromhex(hexed)

    def put(txn: WriteTxn) -> None:
        for op_id, raw in rows.items():
            txn.put_raw("operations", operation_key(op_id), raw)

    store.write_sync(put)
    return rows


async def test_version1_records_upgrade_conservatively_and_unknown_versions_stay_untouched(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    raw = load_records(store)
    records, unreadable = store.inventory()
    assert unreadable == ["op_future"]
    assert {r.operation_id for r in records} == {
        "op_v1completed", "op_v1pending", "op_v1running", "op_v1cancelled"
    }
    assert all(r.upgraded_from == 1 for r in records)
    provider.script([Reply.complete({"answer": 1, "note": "fresh"})])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        # A saved version-1 completion is delivered with no POST and no callback.
        auth = Authorizer()
        value = await rt.send_recovering(
            recoverable.Handle("op_v1completed"), response=V1_SCHEMA, authorize=auth,
            expected_contract_version="v1",
        )
        assert value == {"answer": 42, "note": "from v1"} and auth.calls == []
        receipt = await rt.receipt(recoverable.Handle("op_v1completed"))
        assert receipt.job_id == "legacy-job"
        assert receipt.decode(Answer) == Answer(42, "from v1")
        # Cancellation stays permanent.
        with pytest.raises(recoverable.OperationCancelled):
            await rt.send_recovering(
                recoverable.Handle("op_v1cancelled"), response=V1_SCHEMA, authorize=Authorizer()
            )
        # A running record's consumed attempts stay spent: exhausted, nothing sent.
        with pytest.raises(recoverable.AttemptsExhausted):
            await rt.send_recovering(
                recoverable.Handle("op_v1running"), response=V1_SCHEMA, authorize=Authorizer()
            )
        # A pending record keeps its spent attempt and its pending attempt id.
        pending = await rt.status(recoverable.Handle("op_v1pending"))
        assert pending.attempts_used == 1 and pending.pending_attempt_id == "op_v1pending.2"
        auth = Authorizer()
        value = await rt.send_recovering(
            recoverable.Handle("op_v1pending"), response=V1_SCHEMA, authorize=auth
        )
        assert value == {"answer": 1, "note": "fresh"}
        assert [a.attempt_id for a in auth.calls] == ["op_v1pending.2"]
        status = await rt.status(recoverable.Handle("op_v1pending"))
        assert status.attempts_used == 2 and status.maximum_attempts == 3
        sent = generation_requests(provider, "op_v1pending")
        assert len(sent) == 1 and sent[0].body == store.get_payload("op_v1pending", "body")
        assert status.state == "completed"
        with pytest.raises(recoverable.UnsupportedRecordVersion):
            store.get_operation("op_future")
    assert store.get_raw("operations", operation_key("op_future")) == raw["op_future"]
    assert len(provider.requests) == 1
