"""The pure rules of source-bound operations (recoverable.sources_rules, issue 16) and how
the machine treats a ``superseded`` record (terminal: nothing runs, nothing is delivered,
no command changes it)."""

from __future__ import annotations

import math

import pytest

from recoverable import errors, machine
from recoverable.records import AttemptRecord, OperationRecord
from recoverable.sources_rules import (
    check_attempt_timeout,
    check_source,
    needs_superseding,
    receipt_refusal,
    supersede,
)
from recoverable.types import SourceRef

from ..storage.storage_helpers import make_op

DOC = SourceRef("doc-1", "sha256:v1")


def _bound(**changes: object) -> OperationRecord:
    return make_op("op", source=DOC, attempt_timeout=10.0, **changes)


def test_receipt_refusal_follows_the_manifest() -> None:
    record = _bound()
    assert receipt_refusal(record, "sha256:v1") is None
    assert receipt_refusal(record, "sha256:v2") == "source_changed"
    assert receipt_refusal(record, None) == "source_deleted"
    assert receipt_refusal(make_op("plain"), None) is None  # not source-bound


@pytest.mark.parametrize(("timeout", "lease", "expected"), [
    (None, 30.0, 20.0), (29.9, 30.0, 29.9), (1, 30.0, 1.0),
])
def test_the_hard_timeout_is_shorter_than_the_lease(
    timeout: float | None, lease: float, expected: float
) -> None:
    assert check_attempt_timeout(timeout, lease_seconds=lease, source=DOC) == expected
    assert check_attempt_timeout(None, lease_seconds=lease, source=None) is None


@pytest.mark.parametrize("timeout", [30.0, 31.0, 0.0, -1.0, math.nan, math.inf, True, "5"])
def test_a_hard_timeout_not_shorter_than_the_lease_is_refused(timeout: object) -> None:
    with pytest.raises(errors.InvalidParameter) as refused:
        check_attempt_timeout(timeout, lease_seconds=30.0, source=DOC)
    assert refused.value.parameter == "attempt_timeout"


def test_check_source() -> None:
    assert check_source(None) is None
    assert check_source(DOC) is DOC
    too_wide = SourceRef("é" * 200, "d")  # 200 characters, 400 UTF-8 bytes
    for bad in (("doc-1", "d"), SourceRef("", "d"), SourceRef("k", "a b"), too_wide,
                SourceRef("\ud800", "d")):
        with pytest.raises(errors.InvalidParameter):
            check_source(bad)


def test_supersede_closes_the_attempt_in_flight_and_drops_the_completion() -> None:
    in_flight = AttemptRecord("op.1", 1, "initial", 1.0)
    record = _bound(phase="transmitting", attempts_used=1, attempts=(in_flight,))
    new = supersede(record, "source_changed")
    assert (new.phase, new.superseded_reason, new.completed_at) == (
        "superseded", "source_changed", None
    )
    last = new.attempts[-1]
    assert last.outcome == "interrupted" and last.failure is not None
    assert last.failure.transport_code == "superseded" and last.usage is None
    done = supersede(_bound(phase="completed", completed_at=5.0), "source_deleted")
    assert not done.has_completion


@pytest.mark.parametrize("phase", [
    "prepared", "authorizing", "transmitting", "waiting", "completed", "suspended",
])
def test_what_a_manifest_change_supersedes(phase: str) -> None:
    assert needs_superseding(_bound(phase=phase))


@pytest.mark.parametrize("phase", ["failed", "cancelled", "superseded"])
def test_what_it_leaves_alone(phase: str) -> None:
    assert not needs_superseding(_bound(phase=phase))


def test_a_superseded_record_is_terminal_for_the_machine() -> None:
    record = supersede(_bound(), "source_changed")
    ctx = machine.Context(now=1.0, account=record.account, credentials_account=None,
                          endpoint_id="fixture", command="cancel")
    opened = machine.open_operation(record, ctx, format_hash=record.format_hash,
                                    expected_contract_version=None,
                                    check_contract_version=False)
    assert isinstance(opened.action, machine.Stop) and not opened.changed
    assert isinstance(opened.action.error, errors.OperationSuperseded)
    assert opened.action.error.reason == "source_changed"
    for kind in ("cancel", "suspend"):
        applied = machine.command_on_idle(record, kind)  # type: ignore[arg-type]
        assert applied.record == record
    assert machine.owner_lost(record, now=2.0).record == record
    with pytest.raises(errors.OperationSuperseded):
        machine.check_acknowledge(record)
    with pytest.raises(errors.RetryNotAllowed):
        machine.check_retry_source(record, now=1.0, endpoint_id="fixture")
    status = machine.derive_status(record, now=1.0, lease_live=False, viewer=record.account,
                                   command="cancel", payloads=frozenset({"body"}))
    assert (status.state, status.availability, status.blockers) == (
        "superseded", "superseded", frozenset()
    )
    assert status.suggested_actions == ("abandon",) and status.source == DOC
