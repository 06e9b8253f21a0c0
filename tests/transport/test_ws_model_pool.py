"""Pooled WebSocket connections are per (URL, token, model): a proxy that binds a session
to the model of its first ``response.create`` (LiteLLM) never sees another model on it.

Real sockets on 127.0.0.1 against the real fixture provider, whose ``ws_bind_model``
option acts like that proxy."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
from transport_helpers import make_body
from trio_websocket import WebSocketConnection, open_websocket_url

import recoverable
from recoverable.fixture.provider import _parser
from recoverable.testing import FixtureProvider
from recoverable.transport import Completed, Interruption, ResponsesBackend, StaticCredentials
from recoverable.transport.events import response_stream
from recoverable.transport.websocket import body_model

ACCOUNT = recoverable.AccountBinding("acct-1", "api-key")
MODELS = ("model-a", "model-b")
# As ``recoverable batch`` does: a ``server_error`` event is replaced (it was, on a socket
# reused across models: an extra attempt for each job of the other model).
RETRY = recoverable.RetryPolicy(
    initial_backoff=0.01, retryable_provider_codes=frozenset({"server_error"})
)


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


def websocket_backend(provider: FixtureProvider) -> ResponsesBackend:
    return ResponsesBackend(
        provider.http_url, credentials=StaticCredentials("sk-test", account=ACCOUNT),
        mode="websocket", endpoint_id="fixture",
    )


def without_model(body: bytes) -> bytes:
    decoded = msgspec.json.decode(body)
    decoded.pop("model")
    return msgspec.json.encode(decoded, order="sorted")


async def create(ws: WebSocketConnection, model: str) -> list[dict[str, Any]]:
    """One ``response.create`` for ``model``; its events up to a terminal one."""
    message = {"type": "response.create", **msgspec.json.decode(make_body(model=model))}
    await ws.send_message(json.dumps(message))
    events: list[dict[str, Any]] = []
    while not events or events[-1]["type"] not in ("response.completed", "error"):
        events.append(json.loads(await ws.get_message()))
    return events


# -- the regression: a mixed batch, one attempt per job ------------------------------------
async def test_a_mixed_batch_on_a_model_bound_proxy_spends_one_attempt_per_job(
    tmp_path: Path,
) -> None:
    """Jobs alternating two models, one at a time, through a pooling WebSocket backend and
    a proxy that binds each session to its first model: every job completes with its one
    generation request (a socket reused across models got a ``server_error`` event and the
    job a second attempt: 19 requests for 10 jobs), and each model keeps one socket."""
    jobs = 10
    async with FixtureProvider.serve(ws_bind_model=True) as provider:
        backend = websocket_backend(provider)
        with recoverable.RecoveryStore.open(str(tmp_path / "store")) as store:
            async with backend, recoverable.open_runtime(
                store, backend, account=ACCOUNT, max_concurrency=1
            ) as rt:
                models: dict[str, str] = {}
                for index in range(jobs):
                    model = MODELS[index % 2]
                    request = recoverable.StructuredRequest(
                        model=model, instructions="Answer briefly.", input=f"Job {index}?"
                    )
                    handle = await rt.prepare(
                        request, response=Answer, maximum_attempts=3, retry_policy=RETRY
                    )
                    models[handle.operation_id] = model
                    value = await rt.send_recovering(handle, response=Answer, authorize=approve)
                    assert isinstance(value, Answer)
    recorded = provider.requests
    assert len(recorded) == jobs, [(r.attempt_id, r.reply_kind) for r in recorded]
    per_operation: dict[str, int] = defaultdict(int)
    for request in recorded:
        assert request.attempt_id is not None
        per_operation[request.attempt_id.rpartition(".")[0]] += 1
    assert per_operation == {operation: 1 for operation in models}
    # One socket per model, reused by every later job of that model.
    sockets: dict[int, set[str]] = defaultdict(set)
    for request in recorded:
        sockets[request.connection].add(body_model(request.body))
    assert sorted(sockets.values(), key=sorted) == [{"model-a"}, {"model-b"}]


# -- the key ---------------------------------------------------------------------------------
async def test_the_same_url_and_token_with_another_model_takes_another_pooled_socket(
    provider: FixtureProvider,
) -> None:
    async with websocket_backend(provider) as backend:
        for index, model in enumerate(["model-a", "model-b", "model-a", "model-b"]):
            outcome = await backend.stream(
                make_body(model=model), attempt_id=f"a{index}", token="sk-test"
            )
            assert isinstance(outcome, Completed)
        # A body whose model cannot be read still streams, on a socket of its own.
        for index in range(2):
            outcome = await backend.stream(
                without_model(make_body()), attempt_id=f"n{index}", token="sk-test"
            )
            assert isinstance(outcome, Completed)
    assert [(r.attempt_id, r.connection, r.sequence) for r in provider.requests] == [
        ("a0", 1, 1), ("a1", 2, 1), ("a2", 1, 2), ("a3", 2, 2), ("n0", 3, 1), ("n1", 3, 2),
    ]


def test_the_model_of_a_body_is_its_top_level_model_or_empty() -> None:
    assert body_model(make_body()) == "fixture-model"
    assert body_model(make_body(model="gpt-x")) == "gpt-x"
    # Only the top level counts (a "model" key inside the input or schema is not it).
    nested = msgspec.json.encode({"input": [{"model": "inner"}], "text": {"model": "t"}})
    assert body_model(nested) == ""
    for unreadable in (b'{"model":5}', b'{"model":null}', b"{}", b"{not json}",
                       without_model(make_body())):
        assert body_model(unreadable) == ""


# -- the fixture's model-bound sessions ------------------------------------------------------
async def test_a_model_bound_fixture_session_refuses_another_model_with_a_server_error() -> None:
    async with FixtureProvider.serve(ws_bind_model=True) as provider, open_websocket_url(
        provider.websocket_url, extra_headers=[("authorization", "Bearer k")]
    ) as ws:
        assert (await create(ws, "model-a"))[-1]["type"] == "response.completed"
        refused = await create(ws, "model-b")
        assert len(refused) == 1 and refused[0]["type"] == "error"
        assert "status" not in refused[0]
        assert {key: refused[0]["error"][key] for key in ("type", "code")} == {
            "type": "server_error", "code": "server_error"}
        # The connection stays open and still serves its own model.
        assert (await create(ws, "model-a"))[-1]["type"] == "response.completed"
    assert [(r.reply_kind, body_model(r.body), r.connection) for r in provider.requests] == [
        ("synthesize", "model-a", 1), ("error_event", "model-b", 1),
        ("synthesize", "model-a", 1),
    ]


async def test_by_default_a_fixture_session_serves_any_model(provider: FixtureProvider) -> None:
    async with open_websocket_url(
        provider.websocket_url, extra_headers=[("authorization", "Bearer k")]
    ) as ws:
        for model in ("model-a", "model-b"):
            assert (await create(ws, model))[-1]["type"] == "response.completed"
    assert [r.reply_kind for r in provider.requests] == ["synthesize", "synthesize"]


async def test_the_library_reads_the_refusal_as_a_provider_failure() -> None:
    """Unpooled streams each open their own socket, so only a pooled socket reused for
    another model could meet the refusal; it is a ``provider_failed`` server error."""
    async with FixtureProvider.serve(ws_bind_model=True) as provider, open_websocket_url(
        provider.websocket_url, extra_headers=[("authorization", "Bearer k")]
    ) as ws:
        await create(ws, "model-a")
        refused = await create(ws, "model-b")
    state = response_stream(max_events=100, on_progress=None, on_delta=None)
    outcome = state.feed(json.dumps(refused[0]))
    assert isinstance(outcome, Interruption) and outcome.kind == "provider_failed"
    assert (outcome.provider_type, outcome.provider_code) == ("server_error", "server_error")


def test_the_cli_flag_turns_model_bound_sessions_on() -> None:
    assert _parser().parse_args([]).ws_bind_model is False
    assert _parser().parse_args(["--ws-bind-model"]).ws_bind_model is True
