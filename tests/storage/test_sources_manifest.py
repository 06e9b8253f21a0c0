"""The source manifest and its index (issue 16): storage/sources.py over real LMDB."""

from __future__ import annotations

import pytest
from storage_helpers import make_op

from recoverable import errors
from recoverable.records import AttemptRecord, DispositionRecord
from recoverable.storage import RecoveryStore
from recoverable.storage.sources import change_source
from recoverable.types import SourceRef

pytestmark = pytest.mark.both_stores

NOW = 1_700_000_100.0
DOC = SourceRef("doc-1", "sha256:aaa")


def _bound(op_id: str, source: SourceRef = DOC, **changes: object) -> object:
    return make_op(op_id, source=source, attempt_timeout=10.0, **changes)


def test_the_manifest_holds_one_digest_per_key(store: RecoveryStore) -> None:
    assert store.get_source("doc-1") is None
    change = store.set_source_sync("doc-1", "sha256:aaa", now=NOW)
    assert (change.previous, change.current, change.superseded) == (None, "sha256:aaa", ())
    assert store.get_source("doc-1") == "sha256:aaa"
    store.set_source_sync("doc-1", "sha256:bbb", now=NOW)
    assert store.get_source("doc-1") == "sha256:bbb"
    deleted = store.set_source_sync("doc-1", None, now=NOW)
    assert (deleted.previous, deleted.current) == ("sha256:bbb", None)
    assert store.get_source("doc-1") is None
    assert store.check_integrity() == []


@pytest.mark.parametrize("key", ["", "a\0b", "line\nbreak", "x" * 257, "€" * 200, 7])
def test_a_bad_source_key_is_refused_before_anything_is_written(
    store: RecoveryStore, key: object
) -> None:
    with pytest.raises(errors.InvalidParameter) as caught:
        store.set_source_sync(key, "sha256:aaa", now=NOW)  # type: ignore[arg-type]
    assert caught.value.parameter == "source.key"
    assert store.stats()["entries"] == 0


@pytest.mark.parametrize("digest", ["", "has space", "é", "d" * 129])
def test_a_bad_digest_is_refused(store: RecoveryStore, digest: str) -> None:
    with pytest.raises(errors.InvalidParameter) as caught:
        store.set_source_sync("doc-1", digest, now=NOW)
    assert caught.value.parameter == "source.digest"
    assert store.get_source("doc-1") is None


def test_a_new_digest_supersedes_pending_work_and_unacknowledged_receipts(
    store: RecoveryStore,
) -> None:
    store.set_source_sync("doc-1", "sha256:aaa", now=NOW)
    attempt = AttemptRecord("op-run.1", 1, "initial", NOW, outcome="completed")
    store.write_sync(lambda txn: (
        txn.put_operation(_bound("op-prepared")),
        txn.put_operation(_bound("op-waiting", phase="waiting", attempts_used=1)),
        txn.put_operation(_bound("op-receipt", phase="completed", attempts_used=1,
                                 attempts=(attempt,), completed_at=NOW)),
        txn.put_payload("op-receipt", "completion", b'{"answer": 1}'),
        txn.put_operation(_bound("op-failed", phase="failed", failure_reason="exhausted")),
        txn.put_operation(_bound("op-current", source=SourceRef("doc-1", "sha256:bbb"))),
        txn.put_operation(_bound("op-other", source=SourceRef("doc-2", "sha256:aaa"))),
        txn.put_operation(make_op("op-unbound")),
    ))
    change = store.set_source_sync("doc-1", "sha256:bbb", now=NOW)
    assert sorted(change.superseded) == ["op-prepared", "op-receipt", "op-waiting"]
    for op_id in change.superseded:
        record = store.get_operation(op_id)
        assert record is not None
        assert (record.phase, record.superseded_reason) == ("superseded", "source_changed")
        assert not record.has_completion
    assert store.get_payload("op-receipt", "completion") is None  # never readable again
    for op_id, phase in (("op-failed", "failed"), ("op-current", "prepared"),
                         ("op-other", "prepared"), ("op-unbound", "prepared")):
        record = store.get_operation(op_id)
        assert record is not None and record.phase == phase
    assert store.check_integrity() == []


def test_deletion_supersedes_with_its_own_reason_and_history_is_left_alone(
    store: RecoveryStore,
) -> None:
    store.set_source_sync("doc-1", "sha256:aaa", now=NOW)
    acknowledged = DispositionRecord(
        operation_id="op-acked", disposition="acknowledged", at=NOW,
        account=make_op("x").account,
    )
    store.write_sync(lambda txn: (
        txn.put_operation(_bound("op-pending")),
        # Acknowledged, its removal not finished yet: history, never superseded.
        txn.put_operation(_bound("op-acked", phase="completed", completed_at=NOW)),
        txn.put_disposition(acknowledged),
    ))
    change = store.set_source_sync("doc-1", None, now=NOW)
    assert change.superseded == ("op-pending",)
    pending = store.get_operation("op-pending")
    assert pending is not None and pending.superseded_reason == "source_deleted"
    acked = store.get_operation("op-acked")
    assert acked is not None and acked.phase == "completed"


def test_the_index_follows_the_records(store: RecoveryStore) -> None:
    store.write_sync(lambda txn: txn.put_operation(_bound("op-a")))
    assert store.write_sync(lambda txn: txn.source_bound("doc-1")) == ["op-a"]
    store.write_sync(lambda txn: txn.delete_operation("op-a"))
    assert store.write_sync(lambda txn: txn.source_bound("doc-1")) == []
    assert store.check_integrity() == []


def test_a_superseded_operation_leaves_the_index_and_the_queue(store: RecoveryStore) -> None:
    store.set_source_sync("doc-1", "sha256:aaa", now=NOW)
    store.write_sync(lambda txn: (txn.put_operation(_bound("op-q")), txn.enqueue("op-q")))
    store.set_source_sync("doc-1", "sha256:bbb", now=NOW)
    assert store.write_sync(lambda txn: txn.source_bound("doc-1")) == []
    assert store.queued() == []


def test_source_and_attempt_timeout_are_admission_fields(store: RecoveryStore) -> None:
    store.write_sync(lambda txn: txn.put_operation(_bound("op-a")))
    moved = _bound("op-a", source=SourceRef("doc-1", "sha256:zzz"))
    with pytest.raises(errors.AdmissionChanged) as caught:
        store.write_sync(lambda txn: txn.put_operation(moved))  # type: ignore[arg-type]
    assert caught.value.field == "source"


def test_change_source_is_one_transaction(store: RecoveryStore) -> None:
    """A refused write inside the change (here: the quota) leaves the manifest as it was."""
    store.set_source_sync("doc-1", "sha256:aaa", now=NOW)

    def change_then_fail(txn: object) -> None:
        change_source("doc-1", "sha256:bbb", NOW, txn)  # type: ignore[arg-type]
        raise errors.StorageUnavailable("simulated failure after the change")

    with pytest.raises(errors.StorageUnavailable):
        store.write_sync(change_then_fail)  # type: ignore[arg-type]
    assert store.get_source("doc-1") == "sha256:aaa"
