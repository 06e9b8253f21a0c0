"""Version-1 records, from real stored bytes: kept ids, budgets, receipts, cancellation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import recoverable
from recoverable.storage.store import WriteTxn, operation_key
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


async def test_version1_receipt_is_read_without_a_send_a_backend_or_a_lease(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Issue 10.1: every read path sees a version-1 completion that was never upgraded."""
    raw = load_records(store)
    handle = recoverable.Handle("op_v1completed")
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        status = await rt.status(handle)
        assert status.state == "completed" and status.availability == "completion_saved"
        assert status.has_saved_completion and status.blockers == frozenset()
        receipt = await rt.receipt(handle)
        assert receipt.decode(Answer) == Answer(42, "from v1")
        assert receipt.job_id == "legacy-job" and receipt.contract_version == "v1"
        assert receipt.format_name == "Answer" and receipt.account == ACCOUNT
    # Reading neither upgraded the record nor took (or left) a lease.
    assert store.get_raw("operations", operation_key("op_v1completed")) == raw["op_v1completed"]
    assert store.get_lease("op_v1completed") is None
    # A runtime with no backend (what the CLI opens) reads and delivers it too.
    async with recoverable.open_runtime(store, None, account=ACCOUNT) as reader:
        assert (await reader.receipt(handle)).decode(Answer) == Answer(42, "from v1")
        auth = Authorizer()
        value = await reader.send_recovering(handle, response=V1_SCHEMA, authorize=auth)
        assert value == {"answer": 42, "note": "from v1"} and auth.calls == []
        # Acknowledge behaves as for a current record: after the host's commit of a
        # readable completion it leaves a marker, and the content is gone.
        await reader.acknowledge(handle)
        assert (await reader.status(handle)).state == "acknowledged"
        with pytest.raises(recoverable.StateUnavailable):
            await reader.receipt(handle)
    assert store.get_raw("operations", operation_key("op_v1completed")) is None
    assert provider.requests == []


def test_version1_receipt_from_the_cli(
    store: recoverable.RecoveryStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 10.1: ``recoverable receipt`` (a backend-less runtime) reads a v1 completion."""
    from recoverable.cli import main

    load_records(store)
    store.close()
    store_dir = str(tmp_path / "store")
    assert main(["receipt", "--store", store_dir, "--account", "acct-1", "--json",
                 "op_v1completed"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["result"] == {"answer": 42, "note": "from v1"}
    assert shown["job_id"] == "legacy-job"
    assert main(["status", "--store", store_dir, "--account", "acct-1", "--json",
                 "op_v1completed"]) == 0
    assert json.loads(capsys.readouterr().out)["availability"] == "completion_saved"


async def test_version1_pending_record_reads_as_resumable_and_refuses_a_manual_retry(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Issue 10.2: an un-upgraded pending v1 record is resumed (upgraded lazily), not
    reported as configuration-blocked, and a retry of it reserves nothing."""
    load_records(store)
    handle = recoverable.Handle("op_v1pending")
    provider.script([Reply.complete({"answer": 5, "note": "resumed"})])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        status = await rt.status(handle)
        assert status.blockers == frozenset()
        assert status.availability == "replacement_eligible"
        assert "execute" in status.suggested_actions
        assert "manual_retry" not in status.suggested_actions
        with pytest.raises(recoverable.RetryNotAllowed):
            await rt.retry(handle, retry_action_id="click", maximum_attempts=2)
        assert (await rt.status(handle)).successor_id is None
        record = store.get_operation("op_v1pending")
        assert record is not None and record.retry_reservation is None
        value = await rt.send_recovering(handle, response=V1_SCHEMA, authorize=Authorizer())
        assert value == {"answer": 5, "note": "resumed"}


async def test_version1_exhausted_record_is_retried_from_its_lazily_frozen_body(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Issue 10.2: the source is made cloneable (upgraded) before the reservation."""
    load_records(store)
    source = recoverable.Handle("op_v1running")  # all 3 attempts spent: exhausted
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        assert (await rt.status(source)).availability == "exhausted"
        child = await rt.retry(source, retry_action_id="again", maximum_attempts=1)
        body = store.get_payload("op_v1running", "body")
        assert body is not None
        assert store.get_payload(child.operation_id, "body") == body
        assert (await rt.status(source)).successor_id == child.operation_id
        value = await rt.send_recovering(child, response=V1_SCHEMA, authorize=Authorizer())
        assert set(value) == {"answer", "note"}
        sent = generation_requests(provider, child.operation_id)
        assert [r.body for r in sent] == [body]


async def test_version1_pending_record_survives_a_send_from_a_backendless_runtime(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """A runtime that cannot upgrade a version-1 record must not rewrite it: taking
    the lease would store it as current and drop the parts its body is frozen from."""
    raw = load_records(store)
    handle = recoverable.Handle("op_v1pending")
    async with recoverable.open_runtime(store, None, account=ACCOUNT) as reader:
        auth = Authorizer()
        with pytest.raises(recoverable.ConfigurationUnavailable):
            await reader.send_recovering(handle, response=V1_SCHEMA, authorize=auth)
        assert auth.calls == []
    assert store.get_raw("operations", operation_key("op_v1pending")) == raw["op_v1pending"]
    assert store.get_lease("op_v1pending") is None
    provider.script([Reply.complete({"answer": 6, "note": "later"})])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        value = await rt.send_recovering(handle, response=V1_SCHEMA, authorize=Authorizer())
        assert value == {"answer": 6, "note": "later"}
