"""Every reply kind, over both transports, against the real loopback fixture provider."""

from __future__ import annotations

from typing import Any

import jsonschema_rs
import msgspec
import pytest
import trio
from transport_helpers import SCHEMA, make_body

from recoverable.testing import FixtureProvider, Reply
from recoverable.transport import (
    Completed,
    Interruption,
    Progress,
    ResponsesBackend,
    StaticCredentials,
    StreamLimits,
)
from recoverable.transport.base import token_fingerprint

MODES = ["sse", "websocket"]
BODY = make_body()
VALIDATOR = jsonschema_rs.validator_for(SCHEMA)


def backend_for(provider: FixtureProvider, mode: str, **kw: Any) -> ResponsesBackend:
    return ResponsesBackend(
        provider.http_url, credentials=StaticCredentials("sk-test"), mode=mode, **kw  # type: ignore[arg-type]
    )


# (reply, expected fields of the outcome)
CASES: list[tuple[Reply, dict[str, Any]]] = [
    (Reply.synthesize(), {"completed": True}),
    (Reply.complete({"answer": 42}), {"completed": True, "text": '{"answer":42}'}),
    (Reply.disconnect(after_events=3),
     {"kind": "disconnected", "sequence_number": 2, "had_output": True}),
    (Reply.disconnect(after_events=0), {"kind": "disconnected", "response_id": None}),
    (Reply.rate_limited(retry_after=2.5),
     {"kind": "http_rejected", "http_status": 429, "provider_code": "rate_limit_exceeded",
      "retry_after": 2.5, "is_rate_limit": True, "is_quota": False}),
    (Reply.quota_exceeded(),
     {"kind": "http_rejected", "http_status": 429, "provider_type": "insufficient_quota",
      "is_quota": True, "is_rate_limit": False}),
    (Reply.unauthorized(), {"kind": "http_rejected", "http_status": 401}),
    (Reply.forbidden(), {"kind": "http_rejected", "http_status": 403}),
    (Reply.http_error(503, body={"error": {"type": "server_error", "code": "slow_down",
                                           "message": "slow"}},
                      headers={"retry-after": "7"}),
     {"kind": "http_rejected", "http_status": 503, "provider_code": "slow_down",
      "retry_after": 7.0}),
    (Reply.http_error(500, body="not an error object"),
     {"kind": "http_rejected", "http_status": 500, "provider_code": None}),
    (Reply.failed("server_is_overloaded"),
     {"kind": "provider_failed", "provider_code": "server_is_overloaded", "sequence_number": 2}),
    (Reply.failed("insufficient_quota"), {"kind": "provider_failed", "is_quota": True}),
    (Reply.incomplete("content_filter"),
     {"kind": "incomplete", "provider_code": "content_filter", "had_output": True}),
    (Reply.tool_call(), {"kind": "tool_activity", "had_tool_activity": True}),
    (Reply.refusal(), {"kind": "refusal", "had_output": True}),
    (Reply.invalid_json(), {"completed": True, "not_json": True}),
    (Reply.schema_violation(), {"completed": True, "schema_invalid": True}),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("reply", "expected"), CASES, ids=[c[0].kind + str(i)
                                                           for i, c in enumerate(CASES)])
async def test_reply_kind_gives_typed_outcome(
    provider: FixtureProvider, mode: str, reply: Reply, expected: dict[str, Any]
) -> None:
    provider.script([reply])
    async with backend_for(provider, mode) as backend:
        outcome = await backend.stream(BODY, attempt_id="att-1", token="sk-test")
    assert len(provider.requests) == 1
    recorded = provider.requests[0]
    assert recorded.reply_kind == reply.kind
    assert recorded.transport == mode
    assert recorded.attempt_id == "att-1"
    assert recorded.headers["authorization"] == "Bearer " + token_fingerprint("sk-test")
    assert "sk-test" not in repr(recorded)
    expected = dict(expected)
    if expected.pop("completed", False):
        assert isinstance(outcome, Completed), outcome
        assert outcome.response_id is not None and outcome.response_id.startswith("resp_")
        assert recorded.body == BODY  # byte-equal canonical body
        if "text" in expected:
            assert outcome.text == expected["text"]
        elif expected.get("not_json"):
            with pytest.raises(msgspec.DecodeError):
                msgspec.json.decode(outcome.text)
        elif expected.get("schema_invalid"):
            assert not VALIDATOR.is_valid(msgspec.json.decode(outcome.text))
        else:
            assert VALIDATOR.is_valid(msgspec.json.decode(outcome.text))
        return
    assert isinstance(outcome, Interruption), outcome
    for name, value in expected.items():
        assert getattr(outcome, name) == value, (name, outcome)
    if outcome.kind not in ("http_rejected",) and expected.get("response_id", 1) is not None:
        assert outcome.response_id is not None and outcome.response_id.startswith("resp_")
    if outcome.kind == "http_rejected":
        assert outcome.response_id is None and not outcome.had_output


@pytest.mark.parametrize("mode", MODES)
async def test_stall_ends_in_idle_timeout(provider: FixtureProvider, mode: str) -> None:
    provider.script([Reply.stall(after_events=2)])
    limits = StreamLimits(idle_timeout=0.3, connect_timeout=5.0)
    async with backend_for(provider, mode, limits=limits) as backend:
        outcome = await backend.stream(BODY, attempt_id="a", token="sk-test")
    assert isinstance(outcome, Interruption)
    assert (outcome.kind, outcome.transport_code) == ("timeout", "idle_timeout")
    assert outcome.sequence_number == 1
    assert outcome.response_id is not None


async def test_websocket_reuses_connection_and_wrapped_error_frame(
    provider: FixtureProvider,
) -> None:
    provider.script([Reply.complete({"n": 1}), Reply.complete({"n": 2}),
                     Reply.rate_limited(retry_after=1.5)])
    async with backend_for(provider, "websocket") as backend:
        first = await backend.stream(BODY, attempt_id="a1", token="sk-test")
        second = await backend.stream(BODY, attempt_id="a2", token="sk-test")
        third = await backend.stream(BODY, attempt_id="a3", token="sk-test")
    assert isinstance(first, Completed) and first.text == '{"n":1}'
    assert isinstance(second, Completed) and second.text == '{"n":2}'
    # The third went over the reused connection: a wrapped error frame, not a handshake.
    assert isinstance(third, Interruption)
    assert (third.kind, third.http_status, third.retry_after) == ("http_rejected", 429, 1.5)
    assert third.provider_code == "rate_limit_exceeded"
    # One handshake carried a1; the reused connection's requests carried theirs inside the
    # message (the fixture invites it in its handshake answer and strips the field).
    assert [r.attempt_id for r in provider.requests] == ["a1", "a2", "a3"]
    assert [(r.connection, r.sequence) for r in provider.requests] == [(1, 1), (1, 2), (1, 3)]
    assert all(r.body == BODY for r in provider.requests)


async def test_websocket_interrupted_connection_is_not_reused(provider: FixtureProvider) -> None:
    provider.script([Reply.failed("server_error"), Reply.complete({"ok": True})])
    async with backend_for(provider, "websocket") as backend:
        first = await backend.stream(BODY, attempt_id="a1", token="sk-test")
        second = await backend.stream(BODY, attempt_id="a2", token="sk-test")
    assert isinstance(first, Interruption) and first.kind == "provider_failed"
    assert isinstance(second, Completed)
    assert [r.attempt_id for r in provider.requests] == ["a1", "a2"]  # two handshakes


async def test_websocket_pool_is_keyed_by_token(provider: FixtureProvider) -> None:
    async with backend_for(provider, "websocket") as backend:
        await backend.stream(BODY, attempt_id="a1", token="token-one")
        await backend.stream(BODY, attempt_id="a2", token="token-two")
    fingerprints = [r.headers["authorization"] for r in provider.requests]
    assert fingerprints == ["Bearer " + token_fingerprint("token-one"),
                            "Bearer " + token_fingerprint("token-two")]
    assert [r.attempt_id for r in provider.requests] == ["a1", "a2"]


@pytest.mark.parametrize("mode", MODES)
async def test_without_entering_backend_each_stream_works(
    provider: FixtureProvider, mode: str
) -> None:
    backend = backend_for(provider, mode)
    try:
        for i in range(3):
            outcome = await backend.stream(BODY, attempt_id=f"a{i}", token="sk-test")
            assert isinstance(outcome, Completed)
    finally:
        await backend.aclose()
    assert [r.attempt_id for r in provider.requests] == ["a0", "a1", "a2"]


@pytest.mark.parametrize("mode", MODES)
async def test_progress_reports_response_id_immediately(
    provider: FixtureProvider, mode: str
) -> None:
    provider.script([Reply.disconnect(after_events=1)])
    seen: list[Progress] = []
    async with backend_for(provider, mode) as backend:
        outcome = await backend.stream(BODY, attempt_id="a", token="sk-test",
                                       on_progress=seen.append)
    assert isinstance(outcome, Interruption)
    assert seen and seen[0].response_id == outcome.response_id
    assert seen[0].sequence_number == 0 and not seen[0].had_output


@pytest.mark.parametrize("mode", MODES)
async def test_cancellation_propagates_and_closes_connection(
    provider: FixtureProvider, mode: str
) -> None:
    provider.script([Reply.stall(after_events=2), Reply.complete({"after": "cancel"})])
    seen = trio.Event()

    def progress(p: Progress) -> None:
        seen.set()

    async with backend_for(provider, mode) as backend:
        async with trio.open_nursery() as nursery:
            cancelled = False

            async def run() -> None:
                nonlocal cancelled
                try:
                    await backend.stream(BODY, attempt_id="a", token="sk-test",
                                         on_progress=progress)
                except trio.Cancelled:
                    cancelled = True
                    raise

            nursery.start_soon(run)
            await seen.wait()
            nursery.cancel_scope.cancel()
        assert cancelled
        after = await backend.stream(BODY, attempt_id="b", token="sk-test")
    assert isinstance(after, Completed) and after.text == '{"after":"cancel"}'


async def test_connect_refused_is_typed() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()
    for mode in MODES:
        backend = ResponsesBackend(f"http://127.0.0.1:{port}/v1",
                                   credentials=StaticCredentials("k"), mode=mode)  # type: ignore[arg-type]
        outcome = await backend.stream(BODY, attempt_id="a", token="k")
        await backend.aclose()
        assert isinstance(outcome, Interruption)
        assert (outcome.kind, outcome.transport_code) == ("disconnected", "connect_refused")


@pytest.mark.parametrize("mode", MODES)
async def test_many_concurrent_streams(provider: FixtureProvider, mode: str) -> None:
    results: list[Any] = []
    async with backend_for(provider, mode) as backend:
        async def one(i: int) -> None:
            results.append(await backend.stream(BODY, attempt_id=f"a{i}", token="sk-test"))

        async with trio.open_nursery() as nursery:
            for i in range(300):
                nursery.start_soon(one, i)
    assert len(results) == 300 and all(isinstance(r, Completed) for r in results)
    assert len(provider.requests) == 300
    assert len({r.response_id for r in results}) == 300


@pytest.mark.parametrize("mode", MODES)
async def test_seeded_faults_when_script_is_empty(mode: str) -> None:
    from recoverable.testing import FaultSpec

    faults = FaultSpec.parse("disconnect=0.3,rate_limited=0.2,seed=11")
    rng = faults.chooser()
    expected = [(f.kind if (f := faults.pick(rng)) else "synthesize") for _ in range(40)]
    async with FixtureProvider.serve(faults=faults) as provider, backend_for(
        provider, mode
    ) as backend:
        outcomes = [await backend.stream(BODY, attempt_id=f"a{i}", token="sk-test")
                    for i in range(40)]
        await provider.wait_for_requests(40)
    assert [r.reply_kind for r in provider.requests] == expected
    assert {"disconnect", "rate_limited", "synthesize"} <= set(expected)
    for kind, outcome in zip(expected, outcomes, strict=True):
        if kind == "synthesize":
            assert isinstance(outcome, Completed)
        elif kind == "disconnect":
            assert isinstance(outcome, Interruption) and outcome.kind == "disconnected"
        else:
            assert isinstance(outcome, Interruption) and outcome.is_rate_limit
            assert outcome.retry_after == pytest.approx(0.2)
