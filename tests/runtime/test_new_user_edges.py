"""Rough edges a new user hit: a backend reused after its runtime closed, the user agent,
wrong argument types at ``prepare`` (docs/client.md, docs/parameters.md).

Real: an LMDB store on disk, the fixture provider on 127.0.0.1 (its request log holds the
headers it received), no mocks.
"""

from __future__ import annotations

import datetime
import importlib.metadata

import pytest

import recoverable
from recoverable import errors
from recoverable.testing import FixtureProvider, Reply
from recoverable.transport.base import USER_AGENT

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend


async def _one_job(store: recoverable.RecoveryStore, backend: recoverable.ResponsesBackend,
                   job_id: str) -> tuple[str, Answer]:
    async with recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1,
                                  scope="edges", job_id=job_id)
        value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        return handle.operation_id, value


async def test_a_backend_is_reused_after_its_runtime_and_async_with_closed(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    backend = make_backend(provider, mode)
    async with backend:
        await _one_job(store, backend, "first")
    # Closed: the next runtime over the same backend reopens its connections, both
    # outside ``async with`` and inside a second one; each job sends one POST, completed.
    operation_id, value = await _one_job(store, backend, "second")
    assert isinstance(value, Answer)
    assert len(generation_requests(provider, operation_id)) == 1
    async with backend:
        operation_id, _ = await _one_job(store, backend, "third")
    status = store.get_operation(operation_id)
    assert status is not None and status.has_completion and len(status.attempts) == 1
    await backend.aclose()


async def test_every_request_carries_the_recoverable_user_agent(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    assert USER_AGENT == f"recoverable/{importlib.metadata.version('recoverable')}"
    async with make_backend(provider, mode) as backend:
        operation_id, _ = await _one_job(store, backend, "agent")
    (request,) = generation_requests(provider, operation_id)
    assert request.transport == mode
    assert request.headers["user-agent"] == USER_AGENT


@pytest.mark.parametrize("expires_at", ["2030-01-01", datetime.date(2030, 1, 1), 1.5e9, [1],
                                        datetime.datetime(2030, 1, 1)])
async def test_expires_at_of_a_wrong_type_is_refused_at_prepare(
    provider: FixtureProvider, store: recoverable.RecoveryStore, expires_at: object
) -> None:
    async with make_backend(provider) as backend, recoverable.open_runtime(
        store, backend, account=ACCOUNT
    ) as rt:
        with pytest.raises(errors.InvalidParameter) as raised:
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=1,
                             expires_at=expires_at)  # type: ignore[arg-type]
        assert not (await rt.inventory()).operations  # nothing was saved
    assert raised.value.code == "invalid_parameter"
    assert raised.value.parameter == "expires_at"
    assert provider.requests == []


async def test_a_runtime_without_an_account_says_an_account_is_required(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with make_backend(provider) as backend, recoverable.open_runtime(
        store, backend, account=None
    ) as rt:
        with pytest.raises(errors.AccountRequired) as raised:
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
        with pytest.raises(errors.AccountRequired):
            await rt.submit(REQUEST, response=Answer, maximum_attempts=1, job_id="j")
        # Signed out after being signed in: still AccountChanged (the account changed).
        rt.sign_in(ACCOUNT)
        rt.sign_out()
        with pytest.raises(errors.AccountChanged):
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
    assert raised.value.code == "account_required"
    assert "account" in str(raised.value)
    assert provider.requests == []


async def test_status_suggests_the_successor_once_a_manual_retry_made_one(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    from recoverable.cli.formatting import format_status

    async with make_backend(provider) as backend, recoverable.open_runtime(
        store, backend, account=ACCOUNT
    ) as rt:
        provider.script([Reply.disconnect(after_events=2)])
        source = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1, job_id="j")
        with pytest.raises(errors.AttemptsExhausted):
            await rt.send_recovering(source, response=Answer, authorize=Authorizer())
        assert (await rt.status(source)).suggested_actions == ("manual_retry", "abandon")
        successor = await rt.retry(source, retry_action_id="retry-1", maximum_attempts=1)
        status = await rt.status(source)
        assert status.successor_id == successor.operation_id
        assert status.suggested_actions == ("use_successor", "abandon")
        assert f"use_successor {successor.operation_id}, abandon" in format_status(status)
        assert "manual_retry" not in format_status(status)
