"""The machine's rule table (issue 13.1): which events apply in which phases, checked in
one place. An event fed in a phase outside ``EVENT_PHASES`` raises ``InvalidTransition``
and changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

import pytest

from recoverable import failure_policy, outcome, reattachment, records, types
from recoverable import machine as m
from recoverable.machine import InvalidTransition, Transition
from recoverable.records import OperationRecord, Phase

from .test_machine import DISCONNECT, T0, ctx, open_, record, spent

PHASES: tuple[Phase, ...] = get_args(Phase)


def _in(phase: Phase) -> OperationRecord:
    """A record in ``phase`` whose pending and in-flight attempt are number 1 when the
    phase has them (so only the phase can make an event inapplicable)."""
    match phase:
        case "authorizing":
            return m.open_operation(
                record(), ctx(), format_hash=record().format_hash,
                expected_contract_version=None, check_contract_version=False,
            ).record
        case "transmitting":
            return record(phase="transmitting", **spent(1, last_in_flight=True))
        case _:
            return record(phase=phase)


ATTEMPT = m.attempt_id_for("op-1", 1)

EVENTS: dict[m.Event, Callable[[OperationRecord], Transition]] = {
    "open": lambda rec: open_(rec),
    "wake": lambda rec: m.wake(rec, ctx()),
    "authorization_answered": lambda rec: m.authorization_answered(rec, ATTEMPT, True, ctx()),
    "authorization_failed": lambda rec: m.authorization_failed(rec, ATTEMPT, "it raised"),
    "endpoint_unreachable": lambda rec: m.endpoint_unreachable(rec, ATTEMPT, "connect_refused"),
    "endpoint_given_up": lambda rec: m.endpoint_given_up(
        rec, ATTEMPT, "connect_refused", 300.0, None
    ),
    "credentials_unavailable": lambda rec: m.credentials_unavailable(rec, ATTEMPT),
    "progress": lambda rec: m.progress(rec, ATTEMPT, "resp_1", 3),
    "checkpoint": lambda rec: reattachment.checkpoint(rec, ATTEMPT, "resp_1", 3, T0),
    "completion_validated": lambda rec: m.completion_validated(
        rec, ATTEMPT, ctx(), response_id="resp_1", sequence_number=3
    ),
    "attempt_failed": lambda rec: m.attempt_failed(rec, ATTEMPT, DISCONNECT, ctx()),
    "account_stopped": lambda rec: m.account_stopped(rec, "signed_out", ctx()),
    "interrupted_locally": m.interrupted_locally,
    "command_observed": lambda rec: m.command_observed(rec, "suspend"),
    "command_on_idle": lambda rec: m.command_on_idle(rec, "suspend"),
    "owner_lost": lambda rec: m.owner_lost(rec, now=T0),
    "unclaimed": lambda rec: m.unclaimed(rec, now=T0, unclaimed_after=0.0),
}


def test_every_event_has_a_row_and_a_function() -> None:
    assert set(m.EVENT_PHASES) == set(get_args(m.Event)) == set(EVENTS)


@pytest.mark.parametrize("event", list(EVENTS))
@pytest.mark.parametrize("phase", PHASES)
def test_an_event_applies_exactly_in_the_phases_of_its_row(event: m.Event, phase: Phase) -> None:
    rec = _in(phase)
    assert rec.phase == phase
    if phase in m.EVENT_PHASES[event]:
        EVENTS[event](rec)  # applies: returns a transition, never raises InvalidTransition
    else:
        with pytest.raises(InvalidTransition, match=f"{event} in phase {phase}"):
            EVENTS[event](rec)


def test_what_happens_after_a_429_is_one_file() -> None:
    """The retryable-status default, the quota and rate-limit words and the failure table
    are failure_policy's; the other modules only re-export them."""
    assert types.RetryPolicy is failure_policy.RetryPolicy
    assert types.RetryPolicy().retryable_statuses == failure_policy.RETRYABLE_STATUSES
    assert 429 in failure_policy.RETRYABLE_STATUSES
    assert outcome.QUOTA_CODES is failure_policy.QUOTA_CODES
    assert records.FailureReason is failure_policy.FailureReason
    assert m.classify is failure_policy.classify and m.backoff_delay is failure_policy.backoff_delay
    quota_429 = outcome.Interruption(
        kind="http_rejected", http_status=429, provider_type="insufficient_quota"
    )
    assert quota_429.is_quota and not quota_429.is_rate_limit
    assert m.classify(quota_429, types.RetryPolicy()) == "quota"
