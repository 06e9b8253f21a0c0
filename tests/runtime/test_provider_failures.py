"""Provider failures end to end: real runtime, real LMDB store, real fixture provider.

Issue 10, items 4 (bounded provider strings in records), 5 (no provider code replaced
without an opt-in), 6 (a response too large is terminal, a truncated one is replaced) and
14 (an error frame without status or code is classified like the HTTP answer).
"""

from __future__ import annotations

import pytest

import recoverable
from recoverable.outcome import UNRECOGNIZED_CODE
from recoverable.storage.store import operation_key
from recoverable.testing import FixtureProvider, Reply
from recoverable.transport import StreamLimits

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend

FAST = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)


def backend(provider: FixtureProvider, mode: str, **limits: int) -> recoverable.ResponsesBackend:
    return recoverable.ResponsesBackend(
        provider.http_url,
        credentials=recoverable.StaticCredentials("sk-test-secret", account=ACCOUNT),
        mode=mode,  # type: ignore[arg-type]
        endpoint_id="fixture",
        limits=StreamLimits(**limits),
    )


async def test_a_huge_provider_code_never_reaches_the_record(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    # Observed before: a 500,000-character code gave a 1,001,512-byte operation record.
    provider.script([Reply.failed("E" * 500_000)])
    async with recoverable.open_runtime(store, make_backend(provider, mode),
                                        account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3,
                                  retry_policy=FAST)
        with pytest.raises(recoverable.ProviderError) as raised:
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert raised.value.provider_code == UNRECOGNIZED_CODE
        assert "EEEE" not in str(raised.value)
        status = await rt.status(handle)
    raw = store.get_raw("operations", operation_key(handle.operation_id))
    assert raw is not None
    assert len(raw) < 4096, len(raw)
    assert b"EEEE" not in raw
    assert status.last_failure is not None
    assert status.last_failure.provider_code == UNRECOGNIZED_CODE
    assert status.state == "failed" and status.attempts_used == 1


async def test_provider_codes_are_not_replaced_by_default(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.failed("server_error"), Reply.synthesize()])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3,
                                  retry_policy=FAST)
        with pytest.raises(recoverable.ProviderError) as raised:
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert (raised.value.kind, raised.value.provider_code) == (
            "provider_failed", "server_error")
        assert len(generation_requests(provider, handle.operation_id)) == 1
        # Explicitly allowed: replaced.
        opted = await rt.prepare(
            REQUEST, response=Answer, maximum_attempts=3,
            retry_policy=recoverable.RetryPolicy(
                initial_backoff=0.0, maximum_backoff=0.0,
                retryable_provider_codes=frozenset({"server_error"}),
            ),
        )
        provider.script([Reply.failed("server_error"), Reply.synthesize()])
        value = await rt.send_recovering(opted, response=Answer, authorize=Authorizer())
        assert isinstance(value, Answer)
        assert len(generation_requests(provider, opted.operation_id)) == 2


async def test_a_response_past_the_size_bound_is_terminal_not_replaced(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    big = {"answer": 1, "note": "n" * 20_000}
    provider.script([Reply.complete(big), Reply.complete(big), Reply.complete(big)])
    async with recoverable.open_runtime(
        store, backend(provider, mode, max_frame_bytes=8192), account=ACCOUNT
    ) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3,
                                  retry_policy=FAST)
        authorize = Authorizer()
        with pytest.raises(recoverable.ProviderError) as raised:
            await rt.send_recovering(handle, response=Answer, authorize=authorize)
        assert raised.value.kind == "response_too_large"
        assert raised.value.interruption.transport_code == "frame_too_large"
        assert len(authorize.calls) == 1
        assert len(generation_requests(provider, handle.operation_id)) == 1
        status = await rt.status(handle)
        assert status.state == "failed" and status.availability == "failed"
        assert status.attempts_used == 1 and status.attempts_remaining == 2
        assert status.last_failure is not None
        assert status.last_failure.kind == "response_too_large"
        with pytest.raises(recoverable.PermanentlyFailed):
            await rt.send_recovering(handle, response=Answer, authorize=authorize)
        assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_a_truncated_stream_stays_replaceable(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    provider.script([Reply.disconnect(after_events=4), Reply.synthesize()])
    async with recoverable.open_runtime(
        store, backend(provider, mode, max_frame_bytes=8192), account=ACCOUNT
    ) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3,
                                  retry_policy=FAST)
        value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert isinstance(value, Answer)
        assert len(generation_requests(provider, handle.operation_id)) == 2


async def test_rate_limit_error_frame_without_status_is_replaced_like_a_429(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    # LiteLLM forwards an upstream 429 over WebSocket with only error.type; over SSE the
    # same error event. Both: a rate limit, replaced after backoff within the budget.
    provider.script([Reply.error_event(error_type="rate_limit_exceeded"), Reply.synthesize()])
    async with recoverable.open_runtime(store, make_backend(provider, mode),
                                        account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                                  retry_policy=FAST)
        value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert isinstance(value, Answer)
        status = await rt.status(handle)
        first = status.attempts[0].failure
        assert first is not None and first.is_rate_limit
        assert first.provider_type == "rate_limit_exceeded" and first.http_status is None
    assert len(generation_requests(provider, handle.operation_id)) == 2


async def test_a_very_long_response_id_is_stored_bounded(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    long_id = "resp_" + "Z" * 50_000
    provider.script([Reply.lenient(response_id=long_id)])
    async with recoverable.open_runtime(store, make_backend(provider, mode),
                                        account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1,
                                  retry_policy=FAST)
        value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert isinstance(value, Answer)
        receipt = await rt.receipt(handle)
        status = await rt.status(handle)
    assert receipt.response_id == status.response_id
    assert status.response_id is not None and len(status.response_id) == 512
    assert status.response_id.startswith("resp_ZZZ")
    raw = store.get_raw("operations", operation_key(handle.operation_id))
    assert raw is not None and len(raw) < 8192, len(raw)
