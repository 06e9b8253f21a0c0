"""The official ``openai`` SDK parses the fixture's SSE stream into its own typed events."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema_rs
import trio
from transport_helpers import SCHEMA

from recoverable.testing import FixtureProvider, Reply

CLIENT = Path(__file__).with_name("openai_sdk_client.py")
EXPECTED_CLASSES = [
    "ResponseCreatedEvent",
    "ResponseInProgressEvent",
    "ResponseOutputItemAddedEvent",
    "ResponseContentPartAddedEvent",
    "ResponseTextDeltaEvent",
    "ResponseTextDoneEvent",
    "ResponseContentPartDoneEvent",
    "ResponseOutputItemDoneEvent",
    "ResponseCompletedEvent",
]


async def test_openai_sdk_streams_synthesized_reply(provider: FixtureProvider) -> None:
    provider.script([Reply.synthesize()])
    result = await trio.run_process(
        [sys.executable, str(CLIENT), provider.http_url, json.dumps(SCHEMA)],
        capture_stdout=True, capture_stderr=True, check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    report = json.loads(result.stdout.decode().strip().splitlines()[-1])
    classes = report["classes"]
    # every event became its own typed class (never an unknown / fallback type), in order
    assert [c for i, c in enumerate(classes) if i == 0 or c != classes[i - 1]] == EXPECTED_CLASSES
    assert classes.count("ResponseTextDeltaEvent") >= 2
    assert report["strict_errors"] == []
    value = json.loads(report["final_text"])
    assert jsonschema_rs.validator_for(SCHEMA).is_valid(value), value
    # the SDK's own request was recorded: SSE, stream flag removed from the canonical body
    assert len(provider.requests) == 1
    recorded = provider.requests[0]
    assert recorded.transport == "sse" and recorded.reply_kind == "synthesize"
    assert b'"stream"' not in recorded.body and json.loads(recorded.body)["store"] is False




def test_every_reply_kind_matches_the_sdk_event_models_strictly() -> None:
    import pydantic
    from openai.types.responses import ResponseStreamEvent
    from transport_helpers import make_body

    from recoverable.fixture.replies import events_for

    adapter: pydantic.TypeAdapter[object] = pydantic.TypeAdapter(ResponseStreamEvent)
    request = json.loads(make_body())
    replies = [Reply.synthesize(), Reply.complete([1, 2]), Reply.failed("server_error"),
               Reply.incomplete("max_output_tokens"), Reply.tool_call(), Reply.refusal(),
               Reply.invalid_json(), Reply.schema_violation()]
    for reply in replies:
        events = events_for(reply, request, serial=1, created_at=1700000000)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        for event in events:
            adapter.validate_python(event)  # raises on any missing / mistyped field
