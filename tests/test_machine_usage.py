"""The usage ledger and the output-token budget in the pure machine (issue 19.3):
record + event -> decision, no I/O."""

from __future__ import annotations

from typing import Any

import pytest

from recoverable import errors
from recoverable import machine as m
from recoverable.machine import Deliver, Stop, Transmit, WaitUntil
from recoverable.outcome import Interruption, ModelPrice, Usage
from recoverable.records import OperationRecord
from recoverable.types import RetryPolicy

from .test_machine import OP, T0, asked, ctx, open_, record, run_to_transmit, stopped

FAST = RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0, replace_incomplete=True)


def used(inp: int, out: int, *, cached: int = 0, reasoning: int = 0) -> Usage:
    return Usage(input_tokens=inp, cached_input_tokens=cached, output_tokens=out,
                 reasoning_tokens=reasoning)


def fail_with(rec: OperationRecord, aid: str, usage: Usage | None, kind: str = "incomplete",
              now: float = T0) -> m.Transition:
    failure = Interruption(kind=kind, usage=usage)  # type: ignore[arg-type]
    return m.attempt_failed(rec, aid, failure, ctx(now))


def replace(t: m.Transition) -> tuple[OperationRecord, str]:
    t2 = m.authorization_answered(t.record, asked(t).attempt_id, True, ctx())
    assert isinstance(t2.action, Transmit)
    return t2.record, t2.action.attempt_id


def test_usage_is_saved_per_attempt_across_a_replacement() -> None:
    rec, aid = run_to_transmit(record(retry_policy=FAST))
    t = fail_with(rec, aid, used(100, 40, cached=60, reasoning=10))
    first = t.record.attempts[0]
    assert first.usage == used(100, 40, cached=60, reasoning=10)
    # The usage lives on the attempt; the persisted failure carries none.
    assert first.failure is not None and first.failure.usage is None
    assert t.record.last_failure is not None and t.record.last_failure.usage is None
    rec2, aid2 = replace(t)
    assert rec2.attempts[0].usage == first.usage and rec2.attempts[1].usage is None
    done = m.completion_validated(rec2, aid2, ctx(), response_id="resp_2", sequence_number=9,
                                  usage=used(100, 20))
    assert done.action == Deliver()
    assert [a.usage for a in done.record.attempts] == [first.usage, used(100, 20)]
    assert done.record.usage == used(200, 60, cached=60, reasoning=10)
    status = m.derive_status(done.record, now=T0, lease_live=False, viewer=done.record.account)
    assert status.usage == used(200, 60, cached=60, reasoning=10)
    assert [a.usage for a in status.attempts] == [first.usage, used(100, 20)]


def test_an_attempt_without_reported_usage_counts_nothing() -> None:
    rec, aid = run_to_transmit(record(retry_policy=FAST))
    t = fail_with(rec, aid, None, kind="disconnected")
    assert t.record.attempts[0].usage is None and t.record.usage == Usage()


def test_output_token_budget_stops_replacement_when_reached() -> None:
    rec, aid = run_to_transmit(record(retry_policy=FAST, maximum_output_tokens_total=100))
    t = fail_with(rec, aid, used(10, 60))
    assert not isinstance(t.action, Stop)  # 60 < 100: a replacement is asked for
    rec2, aid2 = replace(t)
    t2 = fail_with(rec2, aid2, used(10, 40))  # 60 + 40 reaches 100
    err = stopped(t2, errors.TokenBudgetExhausted)
    assert isinstance(err, errors.AttemptsExhausted)  # the same remedy: a manual retry
    assert err.code == "token_budget_exhausted"
    assert t2.record.phase == "failed"
    assert t2.record.failure_reason == "token_budget_exhausted"
    assert t2.record.attempts_used == 2 and t2.record.attempts_remaining == 1
    assert t2.record.next_attempt_at is None
    status = m.derive_status(t2.record, now=T0, lease_live=False, viewer=t2.record.account)
    assert status.availability == "exhausted" and status.state == "failed"
    assert status.maximum_output_tokens_total == 100
    assert "manual_retry" in status.suggested_actions
    # Reopening stops the same way and asks nobody.
    again = open_(t2.record, ctx(T0 + 1000))
    stopped(again, errors.TokenBudgetExhausted)
    assert again.record == t2.record
    m.check_retry_source(t2.record, now=T0, endpoint_id=None)  # a successor is allowed


def test_token_budget_is_rechecked_before_any_new_attempt() -> None:
    # A record whose reported tokens already reached the budget (e.g. written, then the
    # process died before the terminal state): no host callback, no attempt.
    rec, aid = run_to_transmit(record(retry_policy=FAST))
    t = fail_with(rec, aid, used(10, 500))
    assert not isinstance(t.action, Stop)
    spent = m.evolve(t.record, maximum_output_tokens_total=500, phase="waiting", pending=None)
    reopened = open_(spent)
    stopped(reopened, errors.TokenBudgetExhausted)
    assert reopened.record.attempts_used == 1
    status = m.derive_status(spent, now=T0, lease_live=False, viewer=spent.account)
    assert status.availability == "exhausted"
    # the host's approval is rechecked against the token budget too
    authorizing = m.evolve(t.record, maximum_output_tokens_total=500)
    t3 = m.authorization_answered(authorizing, asked(t).attempt_id, True, ctx())
    stopped(t3, errors.TokenBudgetExhausted)
    assert t3.record.attempts_used == 1


def test_a_completion_is_never_refused_for_the_token_budget() -> None:
    rec, aid = run_to_transmit(record(maximum_output_tokens_total=10))
    done = m.completion_validated(rec, aid, ctx(), response_id=None, sequence_number=None,
                                  usage=used(5, 50))
    assert done.action == Deliver() and done.record.phase == "completed"


def test_a_terminal_failure_keeps_its_own_reason_over_the_token_budget() -> None:
    rec, aid = run_to_transmit(record(maximum_output_tokens_total=10))
    t = fail_with(rec, aid, used(5, 50), kind="refusal")  # invalid_output, not replaced
    assert t.record.failure_reason == "invalid_output"


def test_without_a_token_budget_usage_never_stops_replacement() -> None:
    rec, aid = run_to_transmit(record(retry_policy=FAST))
    t = fail_with(rec, aid, used(10, 10**9))
    assert not isinstance(t.action, Stop)
    assert t.record.failure_reason is None


def test_waiting_cooldown_then_token_budget() -> None:
    slow = RetryPolicy(initial_backoff=5.0, replace_incomplete=True)
    rec, aid = run_to_transmit(record(retry_policy=slow, maximum_output_tokens_total=50))
    t = fail_with(rec, aid, used(1, 49))
    assert isinstance(t.action, WaitUntil)  # 49 < 50: waits for the replacement


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "10", m.MAX_OUTPUT_TOKENS_TOTAL + 1])
def test_invalid_token_budget_is_invalid_request(value: Any) -> None:
    with pytest.raises(errors.InvalidRequest):
        m.validate_preparation(
            maximum_attempts=3, retry_policy=RetryPolicy(), scope=None, job_id=None,
            input_revision=None, contract_version=None, maximum_output_tokens_total=value,
        )
    for ok in (None, 1, m.MAX_OUTPUT_TOKENS_TOTAL):
        m.validate_preparation(
            maximum_attempts=3, retry_policy=RetryPolicy(), scope=None, job_id=None,
            input_revision=None, contract_version=None, maximum_output_tokens_total=ok,
        )


def test_redacted_status_shows_no_usage() -> None:
    rec, aid = run_to_transmit(record(retry_policy=FAST))
    t = fail_with(rec, aid, used(10, 10))
    other = m.derive_status(t.record, now=T0, lease_live=False, viewer=None)
    assert other.redacted and other.usage == Usage() and other.attempts == ()
    assert other.operation_id == OP


@pytest.mark.parametrize("phase,lease_live", [("suspended", False), ("waiting", False)])
def test_a_spent_token_budget_reads_exhausted_while_idle(phase: str, lease_live: bool) -> None:
    rec, aid = run_to_transmit(record(retry_policy=FAST))
    t = fail_with(rec, aid, used(10, 80))
    idle = m.evolve(t.record, phase=phase, maximum_output_tokens_total=80, pending=None)
    status = m.derive_status(idle, now=T0, lease_live=lease_live, viewer=idle.account)
    assert status.availability == "exhausted"
    assert status.attempts_remaining == 2  # the attempt budget is not what is spent
    m.check_retry_source(idle, now=T0, endpoint_id=None)  # a successor is allowed


PRICE = ModelPrice(1000.0, 500.0, 4000.0)  # USD per 1M tokens: 10 input tokens = $0.01


def test_cost_budget_stops_replacement_when_reached() -> None:
    """The same rule as the token budget, on the reported usage at the admitted price."""
    rec, aid = run_to_transmit(record(retry_policy=FAST, maximum_attempts=5,
                                      maximum_cost_total=0.25,
                                      cost_price=PRICE))
    t = fail_with(rec, aid, used(100, 0))  # $0.10 < $0.25: replaced
    assert not isinstance(t.action, Stop)
    rec2, aid2 = replace(t)
    t2 = fail_with(rec2, aid2, used(100, 0))  # $0.20
    assert not isinstance(t2.action, Stop)
    rec3, aid3 = replace(t2)
    t3 = fail_with(rec3, aid3, used(100, 0))  # $0.30 reaches $0.25
    err = stopped(t3, errors.CostBudgetExhausted)
    assert isinstance(err, errors.AttemptsExhausted) and err.code == "cost_budget_exhausted"
    assert t3.record.failure_reason == "cost_budget_exhausted"
    assert t3.record.attempts_used == 3 and t3.record.cost == pytest.approx(0.30)
    status = m.derive_status(t3.record, now=T0, lease_live=False, viewer=t3.record.account)
    assert status.availability == "exhausted" and status.state == "failed"
    assert status.maximum_cost_total == 0.25 and status.cost == pytest.approx(0.30)
    again = open_(t3.record, ctx(T0 + 1000))
    stopped(again, errors.CostBudgetExhausted)
    m.check_retry_source(t3.record, now=T0, endpoint_id=None)  # a successor is allowed


def test_a_cost_budget_without_its_price_fails_closed_and_a_completion_is_kept() -> None:
    # prepare never saves one; a record that has one anyway is not sent again.
    rec, aid = run_to_transmit(record(retry_policy=FAST))
    t = fail_with(rec, aid, used(1, 0))
    stopped(open_(m.evolve(t.record, maximum_cost_total=5.0, phase="waiting", pending=None)),
            errors.CostBudgetExhausted)
    # A validated completion is delivered whatever it cost.
    rec2, aid2 = run_to_transmit(record(maximum_cost_total=0.001, cost_price=PRICE))
    done = m.completion_validated(rec2, aid2, ctx(), response_id=None, sequence_number=None,
                                  usage=used(1000, 1000))
    assert done.action == Deliver()
