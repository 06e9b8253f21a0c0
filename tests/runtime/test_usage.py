"""The usage ledger end to end against the real fixture provider (issue 19.3)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

import recoverable
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend

FAST = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)


def expected_input_tokens(store: recoverable.RecoveryStore, operation_id: str) -> int:
    """The fixture's documented rule: about four characters of prompt a token."""
    frozen = store.get_payload(operation_id, "body")
    assert frozen is not None
    body: dict[str, Any] = msgspec.json.decode(frozen)
    prompt = msgspec.json.encode([body.get("instructions"), body.get("input"), body.get("text")])
    return max(1, len(prompt) // 4)


async def test_usage_is_saved_per_attempt_across_a_replacement(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    provider.script(
        [Reply.disconnect(after_events=4), Reply.complete({"answer": 7, "note": "second"})]
    )
    async with recoverable.open_runtime(store, make_backend(provider, mode), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3, retry_policy=FAST)
        value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert value == Answer(7, "second")
        status = await rt.status(handle)
        receipt = await rt.receipt(handle)
    inp = expected_input_tokens(store, handle.operation_id)
    out = len('{"answer":7,"note":"second"}') // 4
    second = recoverable.Usage(input_tokens=inp, output_tokens=out)
    # The disconnected attempt reported nothing; the completed one its usage.
    assert [a.usage for a in status.attempts] == [None, second]
    assert status.usage == second and receipt.usage == second
    # Saved in the store: another runtime (no backend) reads the same ledger.
    async with recoverable.open_runtime(store, None, account=ACCOUNT) as reader:
        again = await reader.status(handle)
        assert [a.usage for a in again.attempts] == [None, second]
        assert (await reader.receipt(handle)).usage == second
        # The acknowledged marker keeps the total (counts only; the content is gone).
        await reader.acknowledge(handle)
        marker = await reader.status(handle)
        assert marker.state == "acknowledged" and marker.usage == second


async def test_tokens_of_replaced_attempts_count_in_the_totals(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.incomplete(), Reply.complete({"answer": 1, "note": "n"})])
    policy = recoverable.RetryPolicy(initial_backoff=0.0, replace_incomplete=True)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3,
                                  retry_policy=policy)
        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        status = await rt.status(handle)
        receipt = await rt.receipt(handle)
    first, second = (a.usage for a in status.attempts)
    assert first is not None and second is not None
    assert first.output_tokens > 0  # the incomplete attempt consumed tokens too
    assert status.usage == first + second == receipt.usage


async def test_output_token_budget_stops_replacement_and_survives_reopening(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.incomplete(), Reply.incomplete(), Reply.incomplete()])
    policy = recoverable.RetryPolicy(initial_backoff=0.0, replace_incomplete=True)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=5,
                                  retry_policy=policy, maximum_output_tokens_total=1)
        with pytest.raises(recoverable.TokenBudgetExhausted) as caught:
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert caught.value.code == "token_budget_exhausted"
        assert isinstance(caught.value, recoverable.AttemptsExhausted)
        status = await rt.status(handle)
    assert len(generation_requests(provider, handle.operation_id)) == 1
    assert status.availability == "exhausted" and status.attempts_remaining == 4
    assert status.maximum_output_tokens_total == 1 and status.usage.output_tokens >= 1
    posts = len(provider.requests)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt2:
        auth = Authorizer()
        with pytest.raises(recoverable.TokenBudgetExhausted):
            await rt2.send_recovering(handle, response=Answer, authorize=auth)
        assert auth.calls == []
        # A deliberate manual retry continues, with the same per-operation token budget.
        child = await rt2.retry(handle, retry_action_id="more", maximum_attempts=2)
        child_status = await rt2.status(child)
        assert child_status.maximum_output_tokens_total == 1
        assert child_status.usage == recoverable.Usage()
    assert len(provider.requests) == posts


async def test_invalid_token_budget_is_refused_at_prepare(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        for bad in (0, -5, True, 2.5):
            with pytest.raises(recoverable.InvalidRequest):
                await rt.prepare(REQUEST, response=Answer, maximum_attempts=1,
                                 maximum_output_tokens_total=bad)
        assert (await rt.inventory()).operations == ()


async def test_malformed_usage_is_ignored_counted_and_never_fails_the_attempt(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    events: list[recoverable.TelemetryEvent] = []
    provider.script([Reply.complete({"answer": 3, "note": "x"},
                                    usage={"input_tokens": -1, "output_tokens": "lots"})])
    async with recoverable.open_runtime(store, make_backend(provider, mode), account=ACCOUNT,
                                        telemetry=events.append) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
        value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert value == Answer(3, "x")
        assert rt.usage_malformed == 1
        status = await rt.status(handle)
    assert status.state == "completed" and status.attempts[0].usage is None
    assert status.usage == recoverable.Usage()
    assert "recovery.attempt.usage_malformed" in {e.name for e in events}


async def test_telemetry_carries_token_counts_and_nothing_else_new(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    events: list[recoverable.TelemetryEvent] = []
    provider.script([Reply.complete({"answer": 4, "note": "secret-output"})])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT,
                                        telemetry=events.append) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    usage_events = [e for e in events if e.name == "recovery.attempt.usage"]
    assert len(usage_events) == 1
    fields = usage_events[0].fields
    assert set(fields) == {"input_tokens", "cached_input_tokens", "output_tokens",
                           "reasoning_tokens"}
    assert all(isinstance(v, int) and not isinstance(v, bool) for v in fields.values())
    dumped = msgspec.json.encode(events).decode()
    for secret in ("secret-output", "six times seven", "sk-test-secret", ACCOUNT.account_id):
        assert secret not in dumped
