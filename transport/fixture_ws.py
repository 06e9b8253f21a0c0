"""The fixture provider's WebSocket side (wsproto over the upgraded HTTP connection).

Several ``response.create`` per connection, one at a time. The handshake answer carries
``x-accepts-client-request-id-field: 1``: a client that sees it puts the attempt id of a
request sent over a *reused* connection in the message's ``client_request_id`` field,
which the fixture records and strips. The real API sends no such header.

With ``ws_bind_model`` the connection is bound to the model of its first served
``response.create``, as the LiteLLM proxy binds a session: a later create for another
model is recorded and answered with a ``server_error`` event (nothing generated, the
connection stays open).
"""

from __future__ import annotations

from typing import Any

import attrs
import h11
import msgspec
import trio
import wsproto
import wsproto.events as wse
from wsproto import ConnectionType

from recoverable.transport.fixture_replies import (
    HTTP_KINDS,
    CannotSynthesize,
    Reply,
    http_rejection,
    schema_rejection,
)
from recoverable.transport.fixture_state import (
    ACCEPTS_ID_FIELD_HEADER,
    CLIENT_REQUEST_ID_FIELD,
    MAX_REQUEST_BYTES,
    RECV_BYTES,
    ProviderState,
    canonical_object,
    keepalives,
    lenient,
    redacted_headers,
    reply_prefix,
    until_peer_gone,
)

encode = msgspec.json.encode

BACKGROUND_REFUSED: dict[str, Any] = {"type": "error", "status": 400, "error": {
    "type": "invalid_request_error", "code": "unsupported_parameter",
    "message": "Background mode is not supported in WebSocket mode: use HTTP for "
               "'background': true.", "param": "background"}}

__all__ = ["serve_websocket", "text_frame"]

# What a proxy bound to another model answers (an ``error`` event, no status).
MODEL_MISMATCH = Reply.error_event("server_error", "server_error", after_events=0)


@attrs.define
class _Session:
    """What one WebSocket connection remembers across its creates."""

    bound: bool = False
    model: Any = None

    def refuses(self, model: Any) -> bool:
        """Whether a create for ``model`` is refused; the first one binds the session."""
        if not self.bound:
            self.bound, self.model = True, model
            return False
        return bool(model != self.model)


def text_frame(payload: bytes) -> bytes:
    """One whole server text message as a single unmasked frame (RFC 6455 section 5.2):
    the bytes ``wsproto`` makes for ``TextMessage`` on a connection without extensions,
    built here directly (the fixture frames thousands of events a second; ``payload`` is
    UTF-8 JSON from msgspec)."""
    length = len(payload)
    if length < 126:
        return bytes((0x81, length)) + payload
    if length < 65536:
        return b"\x81\x7e" + length.to_bytes(2, "big") + payload
    return b"\x81\x7f" + length.to_bytes(8, "big") + payload

async def serve_websocket(
    state: ProviderState, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request,
    where: list[int],
) -> None:
    ws = wsproto.WSConnection(ConnectionType.SERVER)
    ws.initiate_upgrade_connection(list(request.headers), request.target)
    trailing, _closed = conn.trailing_data
    if trailing:
        ws.receive_data(trailing)
    headers = redacted_headers(request.headers)
    attempt_id = headers.get("x-client-request-id")
    pending: Reply | None = None
    session = _Session()
    accepted = False
    parts: list[str] = []
    size = 0
    while True:
        for event in ws.events():
            if isinstance(event, wse.Request):
                reply = state.next_reply(attempt_id)
                if reply.kind in HTTP_KINDS:
                    where[1] += 1
                    state._record("websocket", headers, b"", reply.kind, attempt_id,
                                 (where[0], where[1]))
                    rejection = http_rejection(reply)
                    hdrs = [(name.encode(), value.encode()) for name, value in rejection.headers]
                    hdrs.append((b"content-length", str(len(rejection.body)).encode()))
                    data = ws.send(wse.RejectConnection(
                        status_code=rejection.status, headers=hdrs, has_body=True))
                    data += ws.send(wse.RejectData(data=rejection.body))
                    await stream.send_all(data)
                    return
                pending = reply
                accepted = True
                await stream.send_all(ws.send(wse.AcceptConnection(
                    extra_headers=[ACCEPTS_ID_FIELD_HEADER, *(
                        (name.encode(), value.encode())
                        for name, value in state.rate_limit_headers()
                    )])))
            elif isinstance(event, wse.Ping):
                await stream.send_all(ws.send(event.response()))
            elif isinstance(event, wse.CloseConnection):
                if ws.state is wsproto.connection.ConnectionState.REMOTE_CLOSING:
                    await stream.send_all(ws.send(event.response()))
                return
            elif isinstance(event, wse.BytesMessage):
                await _ws_send(ws, stream, {"type": "error", "error": {
                    "type": "invalid_request_error", "code": "binary_not_supported",
                    "message": "Binary frames are not supported.", "param": None}})
            elif isinstance(event, wse.TextMessage):
                parts.append(event.data)
                size += len(event.data)
                if size > MAX_REQUEST_BYTES:
                    await stream.send_all(ws.send(wse.CloseConnection(code=1009)))
                    return
                if not event.message_finished:
                    continue
                text = "".join(parts)
                parts, size = [], 0
                reply_used = pending
                pending = None
                keep = await _ws_create(
                    state, ws, stream, headers, attempt_id, text, reply_used, where, session
                )
                attempt_id = None  # later requests on this connection carry no header
                if keep is None:  # refused before any reply: the next create gets it
                    pending = reply_used
                elif not keep:
                    return
        if not accepted and ws.state is not wsproto.connection.ConnectionState.CONNECTING:
            return
        data = await stream.receive_some(RECV_BYTES)
        if not data:
            return
        ws.receive_data(data)

async def _ws_send(
    ws: wsproto.WSConnection, stream: trio.SocketStream, event: dict[str, Any]
) -> None:
    await stream.send_all(ws.send(wse.TextMessage(data=msgspec.json.encode(event).decode())))

async def _ws_create(
    state: ProviderState,
    ws: wsproto.WSConnection,
    stream: trio.SocketStream,
    headers: dict[str, str],
    attempt_id: str | None,
    text: str,
    reply: Reply | None,
    where: list[int],
    session: _Session,
) -> bool | None:
    """Answer one create: whether the connection goes on (None: it does, and ``reply``
    was not used)."""
    try:
        decoded = msgspec.json.decode(text)
        if not isinstance(decoded, dict) or decoded.get("type") != "response.create":
            raise ValueError("not a response.create")
        carried = decoded.get(CLIENT_REQUEST_ID_FIELD)
        canonical, obj = canonical_object(decoded)
        if attempt_id is None and isinstance(carried, str):
            attempt_id = carried  # a request on a reused connection
    except (ValueError, msgspec.DecodeError):
        await _ws_send(ws, stream, {"type": "error", "status": 400, "error": {
            "type": "invalid_request_error", "code": "invalid_request",
            "message": "Expected a response.create message.", "param": None}})
        return True
    if obj.get("background") is True:
        # Background mode is not available over the WebSocket mode: refused like the API
        # refuses an unsupported parameter, nothing generated.
        where[1] += 1
        state._record("websocket", headers, canonical, "bad_request", attempt_id,
                      (where[0], where[1]))
        await _ws_send(ws, stream, BACKGROUND_REFUSED)
        return None
    if state.ws_bind_model and session.refuses(obj.get("model")):
        # Refused before the upstream: no token is counted and no scripted reply is
        # drawn. Never the connection's first served create, so ``reply`` is None here.
        reply = MODEL_MISMATCH
    elif (limited := state._admit_tokens(canonical)) is not None:
        reply = limited
    elif reply is None:
        reply = state.next_reply(attempt_id)
    where[1] += 1
    state._record("websocket", headers, canonical, reply.kind, attempt_id,
                 (where[0], where[1]))
    index = await state._replying()
    try:
        return await _ws_reply(state, ws, stream, reply, obj, canonical)
    finally:
        state._finished(index)


async def _ws_reply(
    state: ProviderState, ws: wsproto.WSConnection, stream: trio.SocketStream, reply: Reply,
    obj: dict[str, Any], canonical: bytes = b"",
) -> bool:
    if reply.kind in HTTP_KINDS:
        rejection = http_rejection(reply)
        await _ws_send(ws, stream, {
            "type": "error",
            "status": rejection.status,
            "error": msgspec.json.decode(rejection.body).get("error"),
            "headers": {
                name: value
                for name, value in [*rejection.headers, *state.rate_limit_headers()]
                if name != "content-type"
            },
        })
        return True
    try:
        events = state._events(reply, obj)
        state._charge_usage(events, canonical)
    except CannotSynthesize as exc:  # a schema no value can answer: the API's 400
        rejection = schema_rejection(exc)
        await _ws_send(ws, stream, {
            "type": "error", "status": rejection.status,
            "error": msgspec.json.decode(rejection.body).get("error"),
        })
        return True
    limit = reply_prefix(reply, events)
    if reply.kind == "lenient":
        events = [lenient(event) for event in events]
    # Each event is encoded once and framed directly (the connection negotiated no
    # extension, so a message is its frame); one write for the whole prefix.
    await stream.send_all(b"".join(text_frame(encode(event)) for event in events[:limit]))
    if reply.kind == "keepalive":
        async def ping() -> None:
            await stream.send_all(ws.send(wse.Ping(payload=b"keepalive")))

        await keepalives(reply, ping)
        await stream.send_all(b"".join(text_frame(encode(event)) for event in events[limit:]))
        return True
    if reply.kind == "disconnect" or reply.disconnect_after is not None:
        return False  # TCP dropped without a close frame (client sees 1006)
    if reply.kind == "stall":
        await until_peer_gone(stream)
        return False
    return True
