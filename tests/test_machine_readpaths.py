"""The pure rules behind issue 10 items 1, 2, 7 and 9: a missing frozen body, the
storage blocker, version-1 records awaiting their upgrade, endpoint identities."""

from __future__ import annotations

import attrs
import pytest

from recoverable import errors
from recoverable import machine as m
from recoverable.machine import AskHost, Deliver, Stop
from recoverable.records import OperationRecord

from .test_machine import ALICE, EP, OP, T0, ctx, open_, record, spent, stopped, transmitting


@pytest.mark.parametrize(
    "rec",
    [
        record(),
        record(phase="waiting", next_attempt_at=T0 - 1, **spent(1)),
        record(phase="suspended", **spent(1)),
        record(phase="authorizing", pending=None),
        transmitting(1),
        record(phase="failed", failure_reason="authentication_required", **spent(1)),
    ],
    ids=["prepared", "waiting", "suspended", "authorizing", "stale transmitting", "auth"],
)
def test_a_missing_body_stops_before_the_host_is_asked_and_changes_nothing(
    rec: OperationRecord,
) -> None:
    t = open_(rec, attrs.evolve(ctx(endpoint_id=EP), body_available=False))
    error = stopped(t, errors.RequestUnavailable)
    assert isinstance(error, errors.StorageUnavailable)
    assert t.record == rec and not t.changed
    assert isinstance(open_(rec, ctx(endpoint_id=EP)).action, AskHost)  # the control


def test_a_missing_body_does_not_hide_a_receipt_a_cancel_or_a_terminal_failure() -> None:
    no_body = attrs.evolve(ctx(), body_available=False)
    done = record(phase="completed", completed_at=T0, **spent(1))
    assert isinstance(open_(done, no_body).action, Deliver)
    stopped(open_(record(phase="cancelled"), no_body), errors.OperationCancelled)
    exhausted = record(phase="failed", failure_reason="exhausted", **spent(3))
    stopped(open_(exhausted, no_body), errors.AttemptsExhausted)


def test_a_version1_record_awaiting_its_upgrade() -> None:
    v1 = record(phase="waiting", upgraded_from=1, body_hash="", endpoint_id="version-1",
                **spent(1))
    assert v1.awaiting_upgrade
    # Never endpoint-blocked: it adopts the endpoint of the runtime that upgrades it.
    s = m.derive_status(v1, now=T0, lease_live=False, viewer=ALICE, endpoint_id=EP,
                        payloads=frozenset())
    assert s.blockers == frozenset() and s.availability == "replacement_eligible"
    assert "execute" in s.suggested_actions
    with pytest.raises(errors.RetryNotAllowed):
        m.check_retry_source(v1, now=T0, endpoint_id=EP)
    # Opened where it could not be upgraded: typed, and nothing asked or spent.
    no_body = attrs.evolve(ctx(), body_available=False)
    stopped(open_(v1, no_body), errors.ConfigurationUnavailable)  # no backend
    stopped(open_(v1, attrs.evolve(no_body, endpoint_id=EP)), errors.RequestUnavailable)


@pytest.mark.parametrize(
    ("rec", "present", "availability", "actions"),
    [
        (record(), frozenset({"request"}), "blocked", ("abandon",)),
        (record(phase="suspended", **spent(1)), frozenset(), "blocked", ("abandon",)),
        (record(phase="failed", failure_reason="exhausted", **spent(3)), frozenset(),
         "exhausted", ("abandon",)),
        (record(phase="completed", completed_at=T0, **spent(1)), frozenset({"body"}),
         "blocked", ("abandon",)),
    ],
    ids=["prepared", "suspended", "exhausted", "completion lost"],
)
def test_storage_blocker_from_missing_payloads(
    rec: OperationRecord, present: frozenset[str], availability: str,
    actions: tuple[str, ...],
) -> None:
    s = m.derive_status(rec, now=T0, lease_live=False, viewer=ALICE, payloads=present)
    assert s.blockers == frozenset({"storage_unavailable"})
    assert (s.availability, s.suggested_actions) == (availability, actions)
    assert s.has_saved_completion == rec.has_completion
    whole = m.derive_status(rec, now=T0, lease_live=False, viewer=ALICE,
                            payloads=frozenset({"body", "request", "completion"}))
    assert whole.blockers == frozenset()
    # A cancelled record needs nothing: no storage blocker for it.
    cancelled = m.derive_status(record(phase="cancelled"), now=T0, lease_live=False,
                                viewer=ALICE, payloads=frozenset())
    assert cancelled.blockers == frozenset()


def test_endpoint_matches() -> None:
    assert m.endpoint_matches("https://api.example.com/v1", "https://api.example.com/v1")
    assert not m.endpoint_matches("https://a.example.com/v1", "https://b.example.com/v1")
    assert m.endpoint_matches("svc@127.0.0.1", "svc@127.0.0.1")
    assert not m.endpoint_matches("svc@127.0.0.1", "svc@localhost")
    assert m.endpoint_matches("svc", "svc@localhost")  # a bare label saved earlier
    assert not m.endpoint_matches("svc", "other@localhost")
    assert not m.endpoint_matches("svc", "https://svc/v1")
    assert not m.endpoint_matches("https://h/v1", "https://h/v1@x")
    rec = record(endpoint_id="svc")
    assert not m.endpoint_blocked(rec, "svc@h") and m.endpoint_blocked(rec, "x@h")
    assert not m.endpoint_blocked(rec, None)
    assert isinstance(open_(record(endpoint_id="svc"), ctx(endpoint_id="svc@h")).action,
                      AskHost)
    t = open_(record(endpoint_id="svc@a"), ctx(endpoint_id="svc@b"))
    assert isinstance(t.action, Stop)
    assert type(t.action.error) is errors.ConfigurationUnavailable
    assert t.action.error.operation_id == OP
