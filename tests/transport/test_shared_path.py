"""The cheaper per-event work of issue 20, checked against what it replaces: the fixture's
hand-built WebSocket frames are wsproto's bytes, its cached synthesis is the same text,
and the lazy idle timer never fires early and at most its slack late (MockClock)."""

from __future__ import annotations

import msgspec
import pytest
import trio
import trio.testing
import wsproto
import wsproto.events as wse
from wsproto import ConnectionType

from recoverable.errors import InvalidRequest
from recoverable.fixture.replies import Reply, events_for, synthesize_value
from recoverable.fixture.state import MAX_DELTAS, ProviderState
from recoverable.fixture.synth import synthesize_text
from recoverable.fixture.ws import text_frame
from recoverable.outcome import Completed
from recoverable.testing import FixtureProvider
from recoverable.transport import ResponsesBackend, StaticCredentials
from recoverable.transport.idle import IdleTimer


def _open_server() -> wsproto.WSConnection:
    """A server-side wsproto connection after a handshake without extensions."""
    client = wsproto.WSConnection(ConnectionType.CLIENT)
    server = wsproto.WSConnection(ConnectionType.SERVER)
    server.receive_data(client.send(wse.Request(host="localhost", target="/v1/responses")))
    request = next(server.events())
    assert isinstance(request, wse.Request)
    client.receive_data(server.send(wse.AcceptConnection()))
    return server


@pytest.mark.parametrize("size", [0, 1, 125, 126, 127, 65535, 65536, 70000])
def test_text_frame_is_the_frame_wsproto_makes(size: int) -> None:
    server = _open_server()
    text = "é" * (size // 2) + "x" * (size % 2)  # two UTF-8 bytes a character
    payload = text.encode()
    assert len(payload) == size
    assert text_frame(payload) == server.send(wse.TextMessage(data=text))


def test_text_frame_reaches_a_wsproto_client_as_one_message() -> None:
    client = wsproto.WSConnection(ConnectionType.CLIENT)
    server = wsproto.WSConnection(ConnectionType.SERVER)
    server.receive_data(client.send(wse.Request(host="localhost", target="/")))
    next(server.events())
    client.receive_data(server.send(wse.AcceptConnection()))
    assert isinstance(next(client.events()), wse.AcceptConnection)
    event = {"type": "response.output_text.delta", "delta": "ü" * 300}
    client.receive_data(text_frame(msgspec.json.encode(event)))
    (message,) = list(client.events())
    assert isinstance(message, wse.TextMessage) and message.message_finished
    assert msgspec.json.decode(message.data) == event


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"answer": {"type": "integer"}, "note": {"type": "string"}},
     "required": ["answer", "note"], "additionalProperties": False},
    {"type": "array", "items": {"type": "number", "minimum": 3}, "minItems": 2},
    True,
])
def test_cached_synthesis_is_the_synthesized_value(schema: object) -> None:
    text = synthesize_text(schema)
    assert msgspec.json.decode(text) == synthesize_value(schema)
    assert synthesize_text(schema) is text or schema is True  # made once per schema


async def _idle_run(touches: int, every: float, bound: float) -> tuple[float, int]:
    """Touch ``touches`` times, ``every`` seconds apart, then fall silent: (seconds from the
    last touch to the cancellation, how many times the deadline moved)."""
    moves = 0
    last = 0.0
    with trio.CancelScope() as scope:
        scope.deadline = trio.current_time() + 1000.0  # a connect allowance far away
        timer = IdleTimer(scope, bound)
        for _ in range(touches):
            before = scope.deadline
            timer.touch()
            last = trio.current_time()
            moves += scope.deadline != before
            await trio.sleep(every)
        await trio.sleep_forever()
    return trio.current_time() - last, moves


def test_idle_timer_never_fires_early_and_at_most_its_slack_late() -> None:
    timeout = 1.6  # slack 0.1
    for touches, every in ((1, 0.0), (40, 0.01), (300, 0.05), (20, 1.5)):
        silent, moves = trio.run(_idle_run, touches, every, timeout,
                                 clock=trio.testing.MockClock(autojump_threshold=0))
        assert timeout <= silent <= timeout + 0.1 + 1e-9, (touches, every, silent)
        # The deadline moves at most once per slack of activity (plus the first pull-in).
        assert moves <= 1 + (touches - 1) * every / 0.1 + 1, (touches, every, moves)


def test_idle_timer_moves_the_deadline_rarely_under_a_stream_of_events() -> None:
    # 1,000 events in 0.5 s against a 120 s timeout: the deadline moves once.
    silent, moves = trio.run(_idle_run, 1000, 0.0005, 120.0,
                             clock=trio.testing.MockClock(autojump_threshold=0))
    assert moves == 1
    assert 120.0 <= silent <= 121.0


# -- long answers: the fixture streams hundreds of deltas (the harness's realistic load) --

LONG_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "note": {"type": "string", "minLength": 1400}},
    "required": ["answer", "note"],
    "additionalProperties": False,
}


def _request() -> dict[str, object]:
    return {"model": "m", "input": "q", "text": {"format": {
        "type": "json_schema", "name": "Essay", "strict": True, "schema": LONG_SCHEMA}}}


@pytest.mark.parametrize("deltas", [1, 200, 500, 5000])
def test_events_for_streams_the_answer_in_that_many_deltas(deltas: int) -> None:
    events = events_for(Reply.synthesize(), _request(), serial=1, created_at=0, deltas=deltas)
    pieces = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    text = synthesize_text(LONG_SCHEMA)
    assert "".join(pieces) == text
    assert len(pieces) == min(deltas, len(text)) and all(pieces)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_deltas_are_bounded() -> None:
    for bad in [(0, 5), (5, 4), (1, MAX_DELTAS + 1), (1.0, 2)]:
        with pytest.raises(InvalidRequest):
            ProviderState(deltas=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["sse", "websocket"])
async def test_a_provider_with_deltas_streams_long_answers_end_to_end(mode: str) -> None:
    body = msgspec.json.encode({**_request(), "store": False})
    async with FixtureProvider.serve(deltas=(200, 500)) as provider:
        backend = ResponsesBackend(provider.http_url, credentials=StaticCredentials("sk-t"),
                                   mode=mode)  # type: ignore[arg-type]
        seen: list[int] = []
        try:
            for i in range(3):
                outcome = await backend.stream(
                    body, attempt_id=f"a{i}", token="sk-t",
                    on_progress=lambda p: seen.append(p.sequence_number or 0),
                )
                assert isinstance(outcome, Completed), outcome
                assert outcome.text == synthesize_text(LONG_SCHEMA)
        finally:
            await backend.aclose()
    # The last reply's events: created, in_progress, item/part added, the deltas, then
    # text done, part done, item done, completed: 8 + deltas, with deltas in 200..500.
    assert 200 + 8 <= max(seen) + 1 <= 500 + 8
