"""Rows of the core spec that had no integration test (issue 10, "Missing tests").

Against the real fixture provider on 127.0.0.1, both transports where they differ.
"""

from __future__ import annotations

import httpx
import pytest

import recoverable
from recoverable.testing import FixtureProvider, Reply

from .conftest import (
    ACCOUNT,
    REQUEST,
    Answer,
    Authorizer,
    RenewingCredentials,
    generation_requests,
    make_backend,
)


async def test_403_is_terminal_with_no_refresh_and_no_replacement(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    # Seed row: "HTTP 403 or nonretryable HTTP rejection — no blanket refresh or
    # automatic downgrade". Budget for five, a renewing credential: neither is used.
    provider.script([Reply.forbidden(), Reply.complete({"answer": 1, "note": "never"})])
    creds = RenewingCredentials("sk-first", "sk-renewed", ACCOUNT)
    async with recoverable.open_runtime(
        store, make_backend(provider, mode, credentials=creds), account=ACCOUNT
    ) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=5)
        auth = Authorizer()
        with pytest.raises(recoverable.ProviderError) as first:
            await rt.send_recovering(handle, response=Answer, authorize=auth)
        error = first.value
        assert type(error) is recoverable.ProviderError
        assert error.code == "provider_error" and error.operation_id == handle.operation_id
        assert error.kind == "http_rejected" and error.http_status == 403
        assert not error.interruption.is_rate_limit and not error.interruption.is_quota
        assert len(auth.calls) == 1 and creds.renewals == 0
        status = await rt.status(handle)
        assert status.state == "failed" and status.availability == "failed"
        assert status.attempts_used == 1 and status.attempts_remaining == 4
        assert status.last_failure is not None and status.last_failure.http_status == 403
        assert "manual_retry" in status.suggested_actions
        # Reopening does not try again either.
        again = Authorizer()
        with pytest.raises(recoverable.PermanentlyFailed) as reopened:
            await rt.send_recovering(handle, response=Answer, authorize=again)
        assert reopened.value.last_failure is not None
        assert reopened.value.last_failure.http_status == 403
        assert again.calls == []
    assert len(generation_requests(provider, handle.operation_id)) == 1
    assert provider.pending_script == (Reply.complete({"answer": 1, "note": "never"}),)


async def test_401_reissue_sends_the_same_frozen_body_bytes(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    # Seed: "Every replacement uses the saved body, including an authentication reissue."
    provider.script([Reply.unauthorized(), Reply.complete({"answer": 2, "note": "renewed"})])
    creds = RenewingCredentials("sk-first", "sk-renewed", ACCOUNT)
    async with recoverable.open_runtime(
        store, make_backend(provider, mode, credentials=creds), account=ACCOUNT
    ) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        auth = Authorizer()
        assert await rt.send_recovering(handle, response=Answer, authorize=auth) == Answer(
            2, "renewed"
        )
    assert [a.reason for a in auth.calls] == ["initial", "authentication_reissue"]
    frozen = store.get_payload(handle.operation_id, "body")
    assert frozen is not None
    # The fixture's request log, read over its HTTP endpoint (canonical body bytes).
    async with httpx.AsyncClient() as client:
        log = (await client.get(provider.requests_url, timeout=10)).json()
    ids = [f"{handle.operation_id}.1", f"{handle.operation_id}.2"]
    first, reissue = ([r for r in log if r["attempt_id"] == i] for i in ids)
    assert len(first) == 1 and len(reissue) == 1
    assert first[0]["reply_kind"] == "unauthorized"
    assert reissue[0]["body"].encode() == frozen
    if mode == "sse":
        # The rejected POST carried its body: byte-equal to the reissued one.
        assert first[0]["body"] == reissue[0]["body"]
    else:
        # A WebSocket 401 refuses the handshake: the create message (the body) was
        # never sent, so only the reissue carries it.
        assert first[0]["body"] == ""
    sent = generation_requests(provider, handle.operation_id)
    assert sent[-1].body == frozen
    assert sent[0].headers["authorization"] != sent[1].headers["authorization"]
