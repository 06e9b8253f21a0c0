"""The dollar budget beside the token budget: ``maximum_cost_total`` is saved with the
operation at the price it was admitted with and stops replacement like
``maximum_output_tokens_total``; without a price it is refused before anything is saved."""

from __future__ import annotations

import msgspec
import pytest

import recoverable
from recoverable.outcome import ModelPrice
from recoverable.pricing import PriceTable
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend

# USD per 1M tokens: large, so that one fixture attempt (tens of tokens) costs cents.
PRICE = ModelPrice(1000.0, 500.0, 4000.0)
PRICES = PriceTable({"gpt-test": PRICE}, source="test prices")


async def test_cost_budget_stops_replacement_at_the_attempt_that_reached_it(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.incomplete()] * 5)
    policy = recoverable.RetryPolicy(initial_backoff=0.0, replace_incomplete=True)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        # Learn what one attempt costs (the fixture's usage is deterministic), then give
        # a budget of two and a half attempts: the third attempt reaches it.
        probe = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1,
                                 retry_policy=policy, maximum_cost_total=1000.0, prices=PRICES)
        with pytest.raises(recoverable.AttemptsExhausted):
            await rt.send_recovering(probe, response=Answer, authorize=Authorizer())
        one = (await rt.status(probe)).cost
        assert one is not None and one > 0
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=5,
                                  retry_policy=policy, maximum_cost_total=2.5 * one,
                                  prices=PRICES)
        with pytest.raises(recoverable.CostBudgetExhausted) as caught:
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert caught.value.code == "cost_budget_exhausted"
        assert isinstance(caught.value, recoverable.AttemptsExhausted)
        status = await rt.status(handle)
    assert len(generation_requests(provider, handle.operation_id)) == 3
    assert status.availability == "exhausted" and status.attempts_remaining == 2
    assert status.maximum_cost_total == pytest.approx(2.5 * one)
    assert status.cost == pytest.approx(3 * one)
    assert status.cost == pytest.approx(PRICE.cost(status.usage))
    posts = len(provider.requests)
    # Reopened: the saved budget and price still forbid a replacement; nothing is sent.
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt2:
        auth = Authorizer()
        with pytest.raises(recoverable.CostBudgetExhausted):
            await rt2.send_recovering(handle, response=Answer, authorize=auth)
        assert auth.calls == []
        # A deliberate manual retry continues with the same budget, counted from zero.
        child = await rt2.retry(handle, retry_action_id="more", maximum_attempts=2)
        child_status = await rt2.status(child)
        assert child_status.maximum_cost_total == pytest.approx(2.5 * one)
        assert child_status.cost == 0.0
    assert len(provider.requests) == posts


async def test_a_cost_budget_without_a_price_is_refused_before_anything_is_saved(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        for prices in (None, PriceTable({}, source="empty")):  # gpt-test: in no table
            with pytest.raises(recoverable.PriceUnknown) as caught:
                await rt.prepare(REQUEST, response=Answer, maximum_attempts=3,
                                 maximum_cost_total=1.0, prices=prices)
            assert caught.value.code == "price_unknown"
            assert caught.value.model == "gpt-test"
            assert isinstance(caught.value, recoverable.InvalidRequest)
            assert "gpt-test" in str(caught.value)
        with pytest.raises(recoverable.PriceUnknown):
            await rt.submit(REQUEST, response=Answer, job_id="j1", maximum_attempts=3,
                            maximum_cost_total=1.0)
        for bad in (0, -1.0, float("nan"), float("inf"), True, "1"):
            with pytest.raises(recoverable.InvalidRequest):
                await rt.prepare(REQUEST, response=Answer, maximum_attempts=3,
                                 maximum_cost_total=bad, prices=PRICES)  # type: ignore[arg-type]
    records, unreadable = store.inventory()
    assert records == [] and unreadable == []
    assert provider.requests == []


async def test_the_price_is_frozen_at_admission(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """A price list changed after prepare never changes what the budget counts."""
    provider.script([Reply.incomplete()])
    policy = recoverable.RetryPolicy(initial_backoff=0.0, replace_incomplete=True)
    flex = msgspec.structs.replace(REQUEST, service_tier="flex")
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(flex, response=Answer, maximum_attempts=1,
                                  retry_policy=policy, maximum_cost_total=1000.0, prices=PRICES)
        record = store.get_operation(handle.operation_id)
        assert record is not None
        assert record.cost_price == PRICE and record.service_tier == "flex"
        with pytest.raises(recoverable.AttemptsExhausted):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        status = await rt.status(handle)
    assert status.cost == pytest.approx(PRICE.cost(status.usage))
