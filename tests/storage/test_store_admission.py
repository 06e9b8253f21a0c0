"""Admission fields are immutable in storage (issue 14.2).

What an operation was admitted with (account, endpoint, model, effort, body, budget,
policy, expiry, format, contract, scope, job, revision) is fixed by ``prepare``: the write
transaction itself refuses a ``put_operation`` that changes any of it, and a frozen body
put over a different one, with ``AdmissionChanged`` — whoever writes, fenced or not.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from storage_helpers import OTHER, make_op

from recoverable.errors import AdmissionChanged
from recoverable.outcome import ModelPrice
from recoverable.records import AttemptRecord, PendingAttempt
from recoverable.storage import RecoveryStore, acquire_lease
from recoverable.storage.txn import ADMISSION_FIELDS
from recoverable.transitions import InvalidTransition
from recoverable.types import RetryPolicy, SourceRef

pytestmark = pytest.mark.both_stores

# A different value for every admission field (a field the record gains later must be
# added here: the test below fails until it is).
CHANGED: dict[str, Any] = {
    "account": OTHER,
    "endpoint_id": "another-endpoint",
    "model": "gpt-other",
    "reasoning_effort": "high",
    "body_hash": "sha256:other",
    "maximum_attempts": 9,
    "maximum_output_tokens_total": 1000,
    "retry_policy": RetryPolicy(initial_backoff=5.0),
    "expires_at": 2_000_000_000.0,
    "format_hash": "sha256:other-format",
    "contract_version": "v2",
    "scope": "another-scope",
    "job_id": "another-job",
    "input_revision": "r2",
    "on_interruption": "fail",
    # issue 16: the source it derives from and its attempts' hard timeout
    "source": SourceRef("doc-1", "sha256:aaa"),
    "attempt_timeout": 10.0,
    "reattach": True,  # issue 15
    "live": True,  # issue 16: chosen at prepare (it fixed on_interruption="fail")
    "unclaimed_after": 60.0,  # issue 29.4: chosen at submit
    "maximum_cost_total": 2.5,  # the cost budget and its frozen price
    "cost_price": ModelPrice(1.0, 0.5, 4.0),
    "service_tier": "flex",
}


def test_the_admission_fields_are_the_decided_ones() -> None:
    decided = {
        "account", "endpoint_id", "model", "reasoning_effort", "body_hash",
        "maximum_attempts", "maximum_output_tokens_total", "retry_policy", "expires_at",
        "format_hash", "contract_version", "scope", "job_id", "input_revision",
        # issues 15 and 16: chosen at prepare, never changed
        "on_interruption", "source", "attempt_timeout", "reattach", "live",
        "unclaimed_after",  # issue 29.4: chosen at submit, never changed
    }
    assert decided <= set(ADMISSION_FIELDS) <= set(CHANGED)


@pytest.mark.parametrize("field", ADMISSION_FIELDS)
@pytest.mark.parametrize("fenced", [False, True], ids=["unfenced", "fenced"])
async def test_a_write_changing_an_admission_field_is_refused(
    store: RecoveryStore, field: str, fenced: bool
) -> None:
    original = make_op("op", scope="s", job_id="j", input_revision="r1")
    await store.write(lambda t: t.put_operation(original))
    changed = msgspec.structs.replace(original, **{field: CHANGED[field]})
    assert getattr(changed, field) != getattr(original, field)
    with pytest.raises(AdmissionChanged) as refused:
        await store.write(
            lambda t: t.put_operation(changed, expect_fence=0 if fenced else None)
        )
    assert refused.value.code == "admission_changed" and refused.value.field == field
    assert refused.value.operation_id == "op"
    assert store.get_operation("op") == original  # nothing written
    assert store.check_integrity() == []  # nor the hosts index touched


async def test_a_lease_holder_changes_progress_but_never_admission(
    store: RecoveryStore,
) -> None:
    original = make_op("op", scope="s", job_id="j")
    await store.write(lambda t: t.put_operation(original))
    lease = await store.write(lambda t: acquire_lease(t, "op", 1.0, lease_seconds=30.0))
    current = store.get_operation("op")
    assert current is not None
    progressed = msgspec.structs.replace(
        current,
        phase="transmitting",
        attempts_used=1,
        attempts=(AttemptRecord("a1", 1, "initial", consumed_at=2.0),),
        pending=PendingAttempt("a2", 2, "replacement"),
        next_attempt_at=None,
        model_override=True,
    )
    await store.write(lambda t: t.put_operation(progressed, expect_fence=lease.fence))
    assert store.get_operation("op") == progressed
    sneaky = msgspec.structs.replace(progressed, maximum_attempts=100)
    with pytest.raises(AdmissionChanged):
        await store.write(lambda t: t.put_operation(sneaky, expect_fence=lease.fence))
    assert store.get_operation("op") == progressed


async def test_a_new_record_may_have_any_admission(store: RecoveryStore) -> None:
    record = make_op("fresh", **{f: CHANGED[f] for f in ADMISSION_FIELDS})
    await store.write(lambda t: t.put_operation(record))
    assert store.get_operation("fresh") == record
    # Deleted and written again (a purge, then an id reused by a test) is a new record.
    await store.write(lambda t: t.delete_operation("fresh"))
    await store.write(lambda t: t.put_operation(make_op("fresh")))


async def test_a_different_body_over_a_saved_one_is_refused(store: RecoveryStore) -> None:
    await store.write(lambda t: t.put_payload("op", "body", b"frozen body"))
    await store.write(lambda t: t.put_payload("op", "body", b"frozen body"))  # same: fine
    before = store.stats()["bytes_used"]
    with pytest.raises(AdmissionChanged) as refused:
        await store.write(lambda t: t.put_payload("op", "body", b"another body"))
    assert refused.value.field == "body" and refused.value.operation_id == "op"
    assert store.get_payload("op", "body") == b"frozen body"
    assert store.stats()["bytes_used"] == before

    def same_mutation(txn: Any) -> None:
        # Read first (the transaction caches it), then the refused put: still unchanged.
        assert txn.get_payload("op", "body") == b"frozen body"
        txn.put_payload("op", "body", b"x" * 100)

    with pytest.raises(AdmissionChanged):
        await store.write(same_mutation)
    assert store.get_payload("op", "body") == b"frozen body"
    # Other payloads are not admission: a completion may be written, the body removed.
    await store.write(lambda t: t.put_payload("op", "completion", b"{}"))
    await store.write(lambda t: t.put_payload("op", "completion", b"{ }"))
    assert await store.write(lambda t: t.delete_payload("op", "body")) is True
    await store.write(lambda t: t.put_payload("op", "body", b"a body after removal"))
    assert store.check_integrity() == []


@pytest.mark.parametrize(
    ("before", "after", "says"),
    [
        ({"fence": 3}, {"fence": 2}, "fence would fall from 3 to 2"),
        ({"attempts_used": 2}, {"attempts_used": 1}, "attempts spent would fall"),
        ({"phase": "failed", "failure_reason": "exhausted"}, {"phase": "prepared"},
         "finished phase failed back to prepared"),
        ({"phase": "cancelled"}, {"phase": "waiting"}, "finished phase cancelled back"),
        ({"phase": "completed"}, {"phase": "transmitting"}, "finished phase completed back"),
    ],
    ids=["fence", "attempts", "failed-reopened", "cancelled-reopened", "completed-reopened"],
)
def test_a_write_that_would_undo_progress_is_refused_and_writes_nothing(
    store: RecoveryStore, before: dict[str, Any], after: dict[str, Any], says: str
) -> None:
    """Every operation write goes through ``put_operation`` (both engines): there the fence
    and the attempts spent never fall and a finished operation never runs again."""
    stored = make_op("op-1", **before)
    store.write_sync(lambda txn: txn.put_operation(stored))
    with pytest.raises(InvalidTransition, match=says):
        store.write_sync(lambda txn: txn.put_operation(msgspec.structs.replace(stored, **after)))
    assert store.get_operation("op-1") == stored


def test_the_ways_out_of_a_finished_phase_the_machine_defines_are_written(
    store: RecoveryStore,
) -> None:
    """A cancel or a superseding source moves a finished operation to another finished
    phase, and a failure that waits for sign-in reopens: these writes pass the check."""
    done = make_op("op-1", phase="completed")
    store.write_sync(lambda txn: txn.put_operation(done))
    for phase in ("superseded", "cancelled"):
        moved = msgspec.structs.replace(done, phase=phase)
        store.write_sync(lambda txn, moved=moved: txn.put_operation(moved))
        assert store.get_operation("op-1") == moved
    waiting = make_op("op-2", phase="failed", failure_reason="authentication_required")
    store.write_sync(lambda txn: txn.put_operation(waiting))
    reopened = msgspec.structs.replace(waiting, phase="waiting", failure_reason=None)
    store.write_sync(lambda txn: txn.put_operation(reopened))
    assert store.get_operation("op-2") == reopened
