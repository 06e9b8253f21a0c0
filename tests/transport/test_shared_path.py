"""The cheaper per-event work of issue 20, checked against what it replaces: the fixture's
hand-built WebSocket frames are wsproto's bytes and its cached synthesis is the same text."""

from __future__ import annotations

import msgspec
import pytest
import wsproto
import wsproto.events as wse
from recoverable.transport.fixture_replies import synthesize_value
from recoverable.transport.fixture_synth import synthesize_text
from recoverable.transport.fixture_ws import text_frame
from wsproto import ConnectionType


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
