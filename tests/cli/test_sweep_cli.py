"""``recoverable sweep --store DIR [--unclaimed-after S] [--json]`` (issue 14), run as a
real process on a real store holding what dead owners leave behind: a lease row of an
owner whose lock nobody holds (a dead process), and an in-flight record whose owner
released its lease without closing it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import trio

import recoverable
from recoverable.records import AttemptRecord, LeaseRecord, OperationRecord
from recoverable.storage.base import WriteTransaction
from recoverable.storage.queue import member_key, order_key

from .cli_helpers import run_cli

ACCOUNT = recoverable.AccountBinding("acct-cli", "api-key")
DEAD_OWNER = "0" * 32  # a well-formed owner id whose lock file does not exist


def _record(op_id: str, *, maximum_attempts: int = 3) -> OperationRecord:
    return OperationRecord(
        operation_id=op_id, account=ACCOUNT, endpoint_id="fixture", created_at=1.0,
        phase="transmitting", maximum_attempts=maximum_attempts, attempts_used=1,
        attempts=(AttemptRecord(attempt_id=f"{op_id}.1", number=1, reason="initial",
                                consumed_at=2.0),),
        model="gpt-test", format_name="Answer", format_hash="fh", body_hash="bh",
        root_operation_id=op_id,
        # No cooldown: a swept record is runnable from the sweep's own now.
        retry_policy=recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0),
    )


def _orphans(store_dir: Path) -> None:
    async def write() -> None:
        store = recoverable.RecoveryStore.open(str(store_dir))
        try:
            def put(txn: WriteTransaction) -> None:
                txn.put_operation(_record("op-dead-owner"))
                txn.put_operation(_record("op-no-lease"))
                txn.put_operation(_record("op-last", maximum_attempts=1))
                for op_id in ("op-dead-owner", "op-last"):
                    txn.put_lease(LeaseRecord(
                        operation_id=op_id, owner_id=DEAD_OWNER, token="t" * 32, fence=0,
                        acquired_at=2.0,
                    ))

            await store.write(put)
        finally:
            store.close()

    trio.run(write)


def test_sweep_closes_orphans_then_changes_nothing(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    _orphans(store_dir)
    first = run_cli("sweep", "--store", str(store_dir), "--json")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["examined"] == 3 and report["closed"] == 3 and report["live"] == 0
    assert sorted(report["waiting_ids"]) == ["op-dead-owner", "op-no-lease"]
    assert report["failed_ids"] == ["op-last"] and report["ids_truncated"] is False

    store = recoverable.RecoveryStore.open(str(store_dir))
    try:
        for op_id in ("op-dead-owner", "op-no-lease", "op-last"):
            rec = store.get_operation(op_id)
            assert rec is not None and store.get_lease(op_id) is None
            last = rec.attempts[-1]
            assert last.outcome == "interrupted" and last.failure is not None
            assert last.failure.transport_code == "owner_lost"
            assert last.response_id is None and last.usage is None and not rec.has_completion
        last_rec = store.get_operation("op-last")
        assert last_rec is not None and last_rec.failure_reason == "owner_lost"
    finally:
        store.close()

    second = run_cli("sweep", "--store", str(store_dir))
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith("sweep: examined 0, closed 0")
    assert "nothing to close" in second.stdout


def test_sweep_text_names_what_became_of_each(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    _orphans(store_dir)
    result = run_cli("sweep", "--store", str(store_dir))
    assert result.returncode == 0, result.stderr
    assert "closed 3 (waiting for adoption 2, failed 1)" in result.stdout
    assert "  failed  op-last" in result.stdout
    assert "  waiting op-no-lease" in result.stdout


def test_unclaimed_after_fails_old_runnable_operations(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    _orphans(store_dir)
    assert run_cli("sweep", "--store", str(store_dir)).returncode == 0
    # The two left waiting became runnable at the first sweep's now: 1 hour is not over.
    kept = json.loads(run_cli("sweep", "--store", str(store_dir), "--json",
                              "--unclaimed-after", "3600").stdout)
    assert kept["failed"] == 0 and kept["examined"] == 2
    gone = json.loads(run_cli("sweep", "--store", str(store_dir), "--json",
                              "--unclaimed-after", "0").stdout)
    assert sorted(gone["failed_ids"]) == ["op-dead-owner", "op-no-lease"]
    store = recoverable.RecoveryStore.open(str(store_dir))
    try:
        rec = store.get_operation("op-no-lease")
        assert rec is not None and rec.failure_reason == "no_worker"
    finally:
        store.close()


def test_sweep_names_a_queued_operation_no_worker_would_ever_see(tmp_path: Path) -> None:
    """Issue 29.10: its queue order row is gone, so no worker's scan lists it; the sweep
    said "nothing to close" while ``batch --workers`` waited for it for ever."""
    store_dir = tmp_path / "store"

    def damage(txn: Any) -> None:
        txn.put_operation(msgspec.structs.replace(
            _record("op-lost"), phase="prepared", attempts=(), attempts_used=0))
        serial = txn.enqueue("op-lost")
        txn._delete("queue", order_key(serial))  # raw damage: no public raw delete

    async def write() -> None:
        store = recoverable.RecoveryStore.open(str(store_dir))
        try:
            await store.write(damage)
        finally:
            store.close()

    trio.run(write)
    text = run_cli("sweep", "--store", str(store_dir))
    assert text.returncode == 0, text.stderr
    assert "damaged 1" in text.stdout and "nothing to close" not in text.stdout
    assert f"  damaged queue table, row {member_key('op-lost')!r}: " in text.stdout
    report = json.loads(run_cli("sweep", "--store", str(store_dir), "--json").stdout)
    assert report["damaged_ids"] == ["op-lost"] and report["closed"] == 0


def test_bad_arguments_are_usage_errors(tmp_path: Path) -> None:
    for args in (("--unclaimed-after", "-1"), ("--unclaimed-after", "nan")):
        result = run_cli("sweep", "--store", str(tmp_path), *args)
        assert result.returncode == 2, result.stderr
    missing = run_cli("sweep", "--store", str(tmp_path / "nothing"), "--json")
    assert missing.returncode == 2
    assert json.loads(missing.stderr)["error"] == "usage"
