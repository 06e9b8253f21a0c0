"""Clients against the fixture's background responses (issue 15): the provider as its own
process (knobs, control endpoints), the official openai SDK, WebSocket mode's refusal, and
this library's present transports."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import msgspec
import pytest
import trio
from background_helpers import background_body, client
from transport_helpers import SCHEMA

from recoverable.testing import FixtureProvider, Reply

__all__ = ["client"]  # the fixture, imported for its tests


# -- the provider as its own process: the knobs and the control endpoints ------------------
PROVIDER = [sys.executable, "-c", "import sys; from recoverable.fixture.provider import "
            "fixture_main; sys.exit(fixture_main(sys.argv[1:]))"]


async def test_process_knobs_and_control_endpoints(client: httpx.AsyncClient) -> None:
    process = await trio.lowlevel.open_process(
        [*PROVIDER, "--port", "0", "--event-delay", "0", "--background-ttl", "600",
         "--faults", "retrieve_404=0.0,seed=3"], stdout=subprocess.PIPE)
    try:
        with trio.fail_after(60):  # generous: a loaded two-core machine starts it slowly
            assert process.stdout is not None
            line = b""
            while not line.endswith(b"\n"):
                line += await process.stdout.receive_some(4096)
            info = json.loads(line)
            base = info["http_url"]
            answer = await client.post(base + "/responses", content=background_body())
            rid = json.loads(answer.text.split("data: ", 2)[1].split("\n")[0])["response"]["id"]
            script = await client.post(info["retrievals_url"].replace(
                "retrievals", "resume-script"), json=[{"kind": "not_found"}])
            assert script.status_code == 200
            assert (await client.get(f"{base}/responses/{rid}")).status_code == 404
            assert (await client.get(f"{base}/responses/{rid}")).json()["status"] == "completed"
            expire = info["retrievals_url"].replace("retrievals", "expire")
            assert (await client.post(expire, json={"response_id": rid})).json() == {"expired": 1}
            assert (await client.get(f"{base}/responses/{rid}")).status_code == 404
            stored = (await client.get(expire.replace("expire", "stored"))).json()
            assert stored == []  # expired; the listing itself is not recorded
            await client.post(base + "/responses", content=background_body())
            (listed,) = (await client.get(expire.replace("expire", "stored"))).json()
            assert listed["status"] == "completed" and listed["produced"] == listed["events"]
            assert listed["usage"]["output_tokens"] > 0
            bad = await client.post(expire, json=[1])
            assert bad.status_code == 400
            log = (await client.get(info["retrievals_url"])).json()
            assert [(r["kind"], r["answer"]) for r in log] == [
                ("retrieve", "not_found"), ("retrieve", "object"), ("retrieve", "not_found")]
            assert len((await client.get(info["requests_url"])).json()) == 2  # POSTs only
    finally:
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            await process.wait()


@pytest.mark.parametrize("argument", [["--event-delay", "-1"], ["--event-delay", "x"],
                                      ["--background-ttl", "0"], ["--faults", "resume_x=1"]])
def test_process_refuses_bad_knobs(argument: list[str]) -> None:
    result = subprocess.run([*PROVIDER, "--port", "0", *argument], capture_output=True,
                            timeout=60, check=False)
    assert result.returncode == 2


# -- item 4: the official openai SDK parses all of it ----------------------------------------
SDK_CLIENT = Path(__file__).with_name("openai_sdk_background.py")


async def run_sdk(provider: FixtureProvider, mode: str) -> dict[str, Any]:
    result = await trio.run_process(
        [sys.executable, str(SDK_CLIENT), provider.http_url, mode, json.dumps(SCHEMA)],
        capture_stdout=True, capture_stderr=True, check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    report: dict[str, Any] = json.loads(result.stdout.decode().strip().splitlines()[-1])
    assert report["strict_errors"] == []
    assert report["unknown"] == [404, "dict"]
    return report


async def test_openai_sdk_resumes_retrieves_and_cancels() -> None:
    async with FixtureProvider.serve() as provider:
        report = await run_sdk(provider, "resume")
        assert report["first"] == ["ResponseCreatedEvent", "ResponseInProgressEvent",
                                   "ResponseOutputItemAddedEvent"]
        assert report["rest"][0] == "ResponseContentPartAddedEvent"
        assert report["rest"][-1] == "ResponseCompletedEvent"
        assert "ResponseTextDeltaEvent" in report["rest"]
        assert report["rest_sequence"] == list(range(3, 3 + len(report["rest"])))
        value = json.loads(report["final_text"])
        assert jsonschema_rs.validator_for(SCHEMA).is_valid(value)
        assert report["retrieved"] == ["completed", report["final_text"], True]
        assert report["cancel_finished"] == "completed"
        assert len(provider.requests) == 1
        body = json.loads(provider.requests[0].body)
        assert body["background"] is True and body["store"] is True
        assert [(r.kind, r.starting_after) for r in provider.retrievals] == [
            ("resume", 2), ("retrieve", None), ("cancel", None), ("retrieve", None)]


async def test_openai_sdk_cancels_a_live_response() -> None:
    # Slow enough that the SDK's cancel comes long before the end (400 events, 0.2 s
    # apart: 80 s; the client needs well under a second even on a loaded machine).
    async with FixtureProvider.serve(event_delay=0.2, deltas=(400, 400)) as provider:
        report = await run_sdk(provider, "cancel")
        assert report["cancel"] == ["in_progress", "cancelled", "cancelled"]
        (stored,) = [provider.stored_response(r.response_id) for r in provider.retrievals[:1]]
        assert stored is not None and stored.status == "cancelled"
        assert stored.produced < len(stored.events)


def test_events_of_background_kinds_match_the_sdk_models_strictly() -> None:
    import pydantic
    from openai.types.responses import Response, ResponseStreamEvent

    from recoverable.fixture.background import StoredResponse
    from recoverable.fixture.replies import events_for

    events_adapter: pydantic.TypeAdapter[object] = pydantic.TypeAdapter(ResponseStreamEvent)
    response_adapter: pydantic.TypeAdapter[object] = pydantic.TypeAdapter(Response)
    request = json.loads(background_body())
    for reply in (Reply.failed("server_error", after_events=6, disconnect_after=3),
                  Reply.failed("server_error", after_events=100), Reply.synthesize(),
                  Reply.incomplete()):
        events = events_for(reply, request, serial=1, created_at=1700000000, deltas=8)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        for event in events:
            events_adapter.validate_python(event)
        stored = StoredResponse("resp_x", events, expires_at=float("inf"))
        for produced in (1, len(events)):
            stored.advance(produced)
            response_adapter.validate_python(stored.snapshot())
        stored.advance(1)
        stored.cancel()
        response_adapter.validate_python(stored.snapshot())


# -- item 5: no background mode over WebSocket ---------------------------------------------
async def test_websocket_refuses_background_and_stays_usable() -> None:
    from trio_websocket import open_websocket_url

    async with FixtureProvider.serve() as provider:
        provider.script([Reply.complete({"answer": 1})])
        async with open_websocket_url(provider.websocket_url,
                                      extra_headers=[("authorization", "Bearer k")]) as ws:
            create = msgspec.json.decode(background_body())
            create.pop("stream")
            await ws.send_message(json.dumps({"type": "response.create", **create}))
            refused = json.loads(await ws.get_message())
            assert refused["type"] == "error" and refused["status"] == 400
            assert refused["error"]["type"] == "invalid_request_error"
            assert refused["error"]["code"] == "unsupported_parameter"
            assert refused["error"]["param"] == "background"
            # the same connection still answers a create without background
            create["background"] = False
            await ws.send_message(json.dumps({"type": "response.create", **create}))
            got: list[dict[str, Any]] = []
            while not got or got[-1]["type"] != "response.completed":
                got.append(json.loads(await ws.get_message()))
        assert [r.reply_kind for r in provider.requests] == ["bad_request", "complete"]
        assert provider.retrievals == [] and provider.stored_response(
            got[0]["response"]["id"]) is None


# -- the library's present transports against it ---------------------------------------------
@pytest.mark.parametrize("reply", [Reply.synthesize(), Reply.disconnect(after_events=3)])
async def test_library_sse_backend_streams_a_background_post(reply: Reply) -> None:
    from recoverable.transport import Completed, Interruption, ResponsesBackend, StaticCredentials

    body = msgspec.json.encode(msgspec.json.decode(background_body()), order="sorted")
    async with FixtureProvider.serve() as provider:
        provider.script([reply])
        backend = ResponsesBackend(provider.http_url, credentials=StaticCredentials("k"),
                                   mode="sse")
        async with backend:
            outcome = await backend.stream(body, attempt_id="op.1", token="k")
        stored = provider.stored_response(f"resp_fixture{1:012d}")
        assert stored is not None and stored.status == "completed"
        if reply.kind == "synthesize":
            assert isinstance(outcome, Completed) and outcome.response_id == stored.id
        else:  # the client learns the id and the last sequence number: what it resumes from
            assert isinstance(outcome, Interruption) and outcome.kind == "disconnected"
            assert outcome.response_id == stored.id and outcome.sequence_number == 2


async def test_library_websocket_backend_gets_the_refusal_typed() -> None:
    from recoverable.transport import Interruption, ResponsesBackend, StaticCredentials

    body = msgspec.json.encode(msgspec.json.decode(background_body()), order="sorted")
    async with FixtureProvider.serve() as provider:
        backend = ResponsesBackend(provider.http_url, credentials=StaticCredentials("k"),
                                   mode="websocket")
        async with backend:
            outcome = await backend.stream(body, attempt_id="op.1", token="k")
        assert isinstance(outcome, Interruption), outcome
        assert outcome.kind == "http_rejected" and outcome.http_status == 400
        assert outcome.provider_code == "unsupported_parameter"
        assert [r.reply_kind for r in provider.requests] == ["bad_request"]
