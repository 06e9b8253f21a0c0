"""A real loopback Responses provider for tests: HTTP SSE and WebSocket on one port.

HTTP/1.1 (h11, keep-alive): ``POST /v1/responses`` streams SSE;
``GET /_fixture/requests`` lists recorded requests; ``POST /_fixture/script``
sets the script. ``GET /v1/responses`` with ``Upgrade: websocket`` switches to
wsproto: several ``response.create`` per connection, one at a time. The WebSocket
handshake answer carries ``x-accepts-client-request-id-field: 1``: a client that sees
it puts the attempt id of a request sent over a *reused* connection (which has no
handshake of its own) in the message's ``client_request_id`` field, which the
fixture records and strips. The real API sends no such header and never gets the field.

Every generation request is recorded (transport, attempt id, headers with the
authorization replaced by a fingerprint, canonical body bytes, reply kind)
*before* any reply byte is sent, so a client killed mid-stream is counted once.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Literal

import attrs
import h11
import msgspec
import trio
import wsproto
import wsproto.events as wse
from recoverable.transport.base import token_fingerprint
from recoverable.transport.fixture_replies import (
    HTTP_KINDS,
    CannotSynthesize,
    FaultSpec,
    Reply,
    events_for,
    http_rejection,
    schema_rejection,
)
from recoverable.transport.ratelimit import estimate_tokens, format_duration
from wsproto import ConnectionType

from recoverable.errors import InvalidRequest

__all__ = ["FaultSpec", "FixtureProvider", "RecordedRequest", "Reply", "fixture_main"]

MAX_REQUEST_BYTES = 32 * 2**20
_RECV = 65536


@attrs.frozen
class RecordedRequest:
    """One generation request as the provider received it.

    ``body`` is canonical: the received JSON minus ``type`` and ``stream``,
    encoded with sorted keys and no spaces — byte-equal to the client's frozen
    body. ``attempt_id`` is the ``x-client-request-id`` header; on a reused
    WebSocket connection the first request carries it on the handshake and later
    ones in the message's ``client_request_id`` field (``None`` if a client sent
    neither). ``connection`` numbers the TCP connection the request came on (per
    provider, from 1) and ``sequence`` its place on that connection (from 1), so a
    request can also be tied to a connection and its order there. A refused
    WebSocket handshake is recorded with an empty body (the create message was
    never sent).
    """

    transport: Literal["sse", "websocket"]
    attempt_id: str | None
    headers: Mapping[str, str]
    body: bytes
    reply_kind: str
    received_at: float
    connection: int = 0
    sequence: int = 0
    finished_at: float | None = None  # the reply was fully sent (or the stream dropped)

    def to_json(self) -> dict[str, Any]:
        return {
            "transport": self.transport,
            "attempt_id": self.attempt_id,
            "headers": dict(self.headers),
            "body": self.body.decode("utf-8", "replace"),
            "reply_kind": self.reply_kind,
            "received_at": self.received_at,
            "finished_at": self.finished_at,
            "connection": self.connection,
            "sequence": self.sequence,
        }


def _redacted_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for k, v in raw:
        name = bytes(k).decode("latin-1").lower()
        value = bytes(v).decode("latin-1")
        if name == "authorization":
            scheme, _, token = value.partition(" ")
            value = f"{scheme} {token_fingerprint(token or scheme)}"
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return headers


# The WebSocket handshake header that invites a client to carry the attempt id of a
# request on a reused connection in the message's ``CLIENT_REQUEST_ID_FIELD``.
ACCEPTS_ID_FIELD_HEADER = (b"x-accepts-client-request-id-field", b"1")
CLIENT_REQUEST_ID_FIELD = "client_request_id"


def canonical_body(data: bytes) -> tuple[bytes, dict[str, Any]]:
    """(canonical bytes, decoded object) of a create request; raises ValueError."""
    obj = msgspec.json.decode(data)
    if not isinstance(obj, dict):
        raise ValueError("request body is not a JSON object")
    obj.pop("type", None)
    obj.pop("stream", None)
    obj.pop(CLIENT_REQUEST_ID_FIELD, None)
    return msgspec.json.encode(obj, order="sorted"), obj


class _PeerGone(Exception):
    pass


class FixtureProvider:
    """The in-process provider. Start it with ``FixtureProvider.serve()``."""

    def __init__(
        self,
        *,
        faults: FaultSpec | None = None,
        reply_delay: float = 0.0,
        tpm_limit: int | None = None,
        rate_burst_seconds: float = 60.0,
    ) -> None:
        if not reply_delay >= 0.0:
            raise InvalidRequest("reply_delay must be >= 0 seconds")
        if tpm_limit is not None and (
            isinstance(tpm_limit, bool) or not isinstance(tpm_limit, int) or tpm_limit < 1
        ):
            raise InvalidRequest("tpm_limit must be a positive integer (tokens per minute)")
        if not 0.0 < rate_burst_seconds <= 3600.0:
            raise InvalidRequest("rate_burst_seconds must be in (0, 3600]")
        self.faults = faults
        self.reply_delay = reply_delay
        # The tokens-per-minute limit it enforces (None: none), as a token bucket holding
        # ``rate_burst_seconds`` of budget, full at start, refilled continuously.
        self.tpm_limit = tpm_limit
        self.rate_burst_seconds = rate_burst_seconds
        self._tokens_level: float | None = None
        self._tokens_at = 0.0
        self._rng: random.Random = faults.chooser() if faults else random.Random(0)
        self._script: deque[Reply] = deque()
        self.requests: list[RecordedRequest] = []
        self._changed = trio.Event()
        self._serial = 0
        self._connections = 0
        self.host = "127.0.0.1"
        self.port = 0
        self.handler_errors: list[str] = []  # exception types of connections dropped

    # -- public surface ------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"http://{self._netloc}/v1"

    @property
    def websocket_url(self) -> str:
        return f"ws://{self._netloc}/v1/responses"

    @property
    def requests_url(self) -> str:
        return f"http://{self._netloc}/_fixture/requests"

    @property
    def _netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def script(self, replies: Iterable[Reply]) -> None:
        """Replace the queue of scripted replies (used in order, one per request).

        Once it is empty, each request gets ``synthesize()`` unless a fault is drawn.
        """
        replies = list(replies)
        for reply in replies:
            if not isinstance(reply, Reply):
                raise InvalidRequest("script() takes Reply values")
        self._script = deque(replies)

    @property
    def pending_script(self) -> tuple[Reply, ...]:
        return tuple(self._script)

    async def wait_for_requests(self, n: int) -> list[RecordedRequest]:
        """Return once at least ``n`` generation requests have been received."""
        while len(self.requests) < n:
            await self._changed.wait()
        return list(self.requests)

    @classmethod
    @asynccontextmanager
    async def serve(
        cls,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: FaultSpec | None = None,
        reply_delay: float = 0.0,
        tpm_limit: int | None = None,
        rate_burst_seconds: float = 60.0,
    ) -> AsyncIterator[FixtureProvider]:
        """Serve until exit. ``reply_delay``: seconds every generation request is held
        after it is recorded and before its reply starts (a slow provider: it makes
        requests overlap, so client-side concurrency limits show in the log).

        ``tpm_limit``: tokens per minute it allows. A request is counted at arrival for
        ``estimate_tokens(body)`` (a quarter of its bytes plus its ``max_output_tokens``)
        and, after its reply, for the reported usage beyond that; one that would take more
        than the bucket holds is answered 429 with Retry-After. Every answer carries the
        ``x-ratelimit-*-tokens`` headers."""
        provider = cls(faults=faults, reply_delay=reply_delay, tpm_limit=tpm_limit,
                       rate_burst_seconds=rate_burst_seconds)
        listeners = await trio.open_tcp_listeners(port, host=host, backlog=4096)
        provider.host = host
        provider.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, provider._handle, listeners)
            try:
                yield provider
            finally:
                nursery.cancel_scope.cancel()

    # -- the tokens-per-minute limit --------------------------------------------------------
    def _tokens_now(self, now: float) -> float:
        assert self.tpm_limit is not None
        capacity = self.tpm_limit * self.rate_burst_seconds / 60.0
        if self._tokens_level is None:
            return capacity
        return min(capacity, self._tokens_level + (now - self._tokens_at) * self.tpm_limit / 60.0)

    def _admit_tokens(self, canonical: bytes) -> Reply | None:
        """Count a request against the limit, or the 429 that refuses it (nothing counted)."""
        if self.tpm_limit is None:
            return None
        now = trio.current_time()
        capacity = self.tpm_limit * self.rate_burst_seconds / 60.0
        cost = min(float(estimate_tokens(canonical)), capacity)
        level = self._tokens_now(now)
        if level < cost:
            # Whole milliseconds, rounded up: the wait it names is always long enough.
            return Reply.rate_limited(math.ceil((cost - level) * 60e3 / self.tpm_limit) / 1e3)
        self._tokens_level, self._tokens_at = level - cost, now
        return None

    def _charge_usage(self, events: list[dict[str, Any]], canonical: bytes) -> None:
        """After a reply: the reported usage beyond the arrival estimate is counted too."""
        if self.tpm_limit is None or not events:
            return
        response = events[-1].get("response")
        usage = response.get("usage") if isinstance(response, Mapping) else None
        total = usage.get("total_tokens") if isinstance(usage, Mapping) else None
        if not isinstance(total, int):
            return
        extra = total - estimate_tokens(canonical)
        if extra > 0:
            now = trio.current_time()
            self._tokens_level, self._tokens_at = self._tokens_now(now) - extra, now

    def rate_limit_headers(self) -> list[tuple[str, str]]:
        """The ``x-ratelimit-*-tokens`` headers of an answer sent now (none without a limit)."""
        if self.tpm_limit is None:
            return []
        level = self._tokens_now(trio.current_time())
        capacity = self.tpm_limit * self.rate_burst_seconds / 60.0
        return [
            ("x-ratelimit-limit-tokens", str(self.tpm_limit)),
            ("x-ratelimit-remaining-tokens", str(max(0, int(level)))),
            ("x-ratelimit-reset-tokens",
             format_duration((capacity - level) * 60.0 / self.tpm_limit)),
        ]

    # -- replies and records -------------------------------------------------------------
    def script_for(self, chooser: Callable[[str], Reply | None] | None) -> None:
        """Choose replies by attempt id (``x-client-request-id``) before the script.

        ``chooser(attempt_id)`` returns a Reply, or None to fall back to the script,
        the faults and synthesis. Requests without an attempt id skip it.
        """
        self._chooser = chooser

    def next_reply(self, attempt_id: str | None = None) -> Reply:
        chooser: Callable[[str], Reply | None] | None = getattr(self, "_chooser", None)
        if chooser is not None and attempt_id is not None:
            chosen = chooser(attempt_id)
            if chosen is not None:
                return chosen
        if self._script:
            return self._script.popleft()
        if self.faults is not None:
            fault = self.faults.pick(self._rng)
            if fault is not None:
                return fault
        return Reply.synthesize()

    def _record(
        self,
        transport: Literal["sse", "websocket"],
        headers: dict[str, str],
        body: bytes,
        reply_kind: str,
        attempt_id: str | None,
        where: tuple[int, int] = (0, 0),
    ) -> None:
        self.requests.append(
            RecordedRequest(transport, attempt_id, headers, body, reply_kind, time.time(),
                            connection=where[0], sequence=where[1])
        )
        self._changed.set()
        self._changed = trio.Event()

    async def _replying(self) -> int:
        """After ``_record``: the recorded request's index, once the reply may start."""
        index = len(self.requests) - 1
        if self.reply_delay:
            await trio.sleep(self.reply_delay)
        return index

    def _finished(self, index: int) -> None:
        self.requests[index] = attrs.evolve(self.requests[index], finished_at=time.time())

    def _events(self, reply: Reply, request: Mapping[str, Any]) -> list[dict[str, Any]]:
        self._serial += 1
        return events_for(reply, request, serial=self._serial, created_at=int(time.time()))

    # -- HTTP ------------------------------------------------------------------------------
    async def _handle(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        self._connections += 1
        where = [self._connections, 0]  # (connection, generation requests on it so far)
        try:
            while True:
                event = await self._next_event(conn, stream)
                if not isinstance(event, h11.Request):
                    return
                keep_going = await self._route(conn, stream, event, where)
                if not keep_going or conn.our_state is not h11.DONE:
                    return
                if conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (_PeerGone, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        except Exception as exc:
            # A request this provider cannot answer (a defect in a reply or in answer
            # synthesis) drops that one connection, never the provider with every other
            # client on it (an embedded provider shares the host's process).
            self.handler_errors.append(type(exc).__name__)
            return
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _next_event(self, conn: h11.Connection, stream: trio.SocketStream) -> Any:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(_RECV)
                conn.receive_data(data)
                continue
            return event

    async def _read_body(self, conn: h11.Connection, stream: trio.SocketStream) -> bytes | None:
        body = bytearray()
        while True:
            event = await self._next_event(conn, stream)
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_REQUEST_BYTES:
                    return None
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            else:
                raise _PeerGone

    async def _send(self, conn: h11.Connection, stream: trio.SocketStream, *events: Any) -> None:
        data = b"".join(conn.send(e) or b"" for e in events)
        await stream.send_all(data)

    async def _simple(
        self,
        conn: h11.Connection,
        stream: trio.SocketStream,
        status: int,
        body: bytes,
        headers: Iterable[tuple[str, str]] = (("content-type", "application/json"),),
    ) -> None:
        hdrs = [*headers, ("content-length", str(len(body)))]
        await self._send(
            conn, stream, h11.Response(status_code=status, headers=hdrs), h11.Data(data=body),
            h11.EndOfMessage(),
        )

    async def _route(
        self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request,
        where: list[int],
    ) -> bool:
        target = request.target.split(b"?", 1)[0]
        method = request.method
        headers = {k.lower(): v for k, v in request.headers}
        if target == b"/v1/responses" and method == b"GET" and (
            headers.get(b"upgrade", b"").lower() == b"websocket"
        ):
            await self._read_body(conn, stream)
            await self._websocket(conn, stream, request, where)
            return False
        body = await self._read_body(conn, stream)
        if body is None:
            await self._simple(conn, stream, 413, b'{"error":{"message":"too large",'
                               b'"type":"invalid_request_error","param":null,"code":null}}')
            return False
        if target == b"/v1/responses" and method == b"POST":
            where[1] += 1
            return await self._sse(conn, stream, request, body, (where[0], where[1]))
        if target == b"/_fixture/requests" and method == b"GET":
            listing = [r.to_json() for r in self.requests]
            await self._simple(conn, stream, 200, json.dumps(listing).encode())
            return True
        if target == b"/_fixture/script" and method == b"POST":
            try:
                specs = msgspec.json.decode(body)
                if not isinstance(specs, list):
                    raise InvalidRequest("the script is a JSON list of reply specs")
                self.script([Reply.from_spec(s) for s in specs])
            except (msgspec.DecodeError, InvalidRequest) as exc:
                err = {"error": {"message": str(exc), "type": "invalid_request_error",
                                 "param": None, "code": "invalid_script"}}
                await self._simple(conn, stream, 400, msgspec.json.encode(err))
                return True
            await self._simple(conn, stream, 200, b'{"ok":true}')
            return True
        await self._simple(conn, stream, 404, b'{"error":{"message":"not found",'
                           b'"type":"invalid_request_error","param":null,"code":null}}')
        return True

    async def _sse(
        self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request, body: bytes,
        where: tuple[int, int],
    ) -> bool:
        headers = _redacted_headers(request.headers)
        attempt_id = headers.get("x-client-request-id")
        try:
            canonical, obj = canonical_body(body)
        except (ValueError, msgspec.DecodeError):
            self._record("sse", headers, body, "bad_request", attempt_id, where)
            err = {"error": {"message": "We could not parse the JSON body of your request.",
                             "type": "invalid_request_error", "param": None, "code": None}}
            await self._simple(conn, stream, 400, msgspec.json.encode(err))
            return True
        reply = self._admit_tokens(canonical) or self.next_reply(attempt_id)
        self._record("sse", headers, canonical, reply.kind, attempt_id, where)
        index = await self._replying()
        try:
            return await self._sse_reply(conn, stream, reply, obj, canonical)
        finally:
            self._finished(index)

    async def _sse_reply(
        self, conn: h11.Connection, stream: trio.SocketStream, reply: Reply, obj: dict[str, Any],
        canonical: bytes = b"",
    ) -> bool:
        if reply.kind in HTTP_KINDS:
            rejection = http_rejection(reply)
            await self._simple(conn, stream, rejection.status, rejection.body,
                               [*rejection.headers, *self.rate_limit_headers()])
            return True
        try:
            events = self._events(reply, obj)
            self._charge_usage(events, canonical)
        except CannotSynthesize as exc:  # a schema no value can answer: the API's 400
            rejection = schema_rejection(exc)
            await self._simple(conn, stream, rejection.status, rejection.body, rejection.headers)
            return True
        await self._send(
            conn, stream,
            h11.Response(status_code=200, headers=[
                ("content-type", "text/event-stream; charset=utf-8"),
                ("cache-control", "no-cache"),
                ("x-request-id", f"req_fixture{self._serial:012d}"),
                *self.rate_limit_headers(),
            ]),
        )
        limit = self._prefix(reply, events)
        if reply.kind == "lenient":
            events = [_lenient(event) for event in events]
        # One write for the whole (prefix of the) stream: the bytes are exactly the
        # real API's frames; only their pacing is compressed.
        frames = b"".join(
            _sse_frame(event, with_event_line=reply.kind != "lenient" or i % 2 == 0)
            for i, event in enumerate(events[:limit])
        )
        if reply.kind == "lenient":
            frames += b"data: [DONE]\n\n"
        if reply.kind == "keepalive":
            await self._send(conn, stream, h11.Data(data=frames))
            await self._keepalives(reply, lambda: self._send(conn, stream, h11.Data(
                data=b": ping\n\n")))
            rest = b"".join(_sse_frame(event) for event in events[limit:])
            await self._send(conn, stream, h11.Data(data=rest), h11.EndOfMessage())
            return True
        if reply.kind in ("disconnect", "stall"):
            await self._send(conn, stream, h11.Data(data=frames))
            if reply.kind == "stall":
                await self._until_peer_gone(stream)
            return False  # a disconnect drops the connection mid-body
        await self._send(conn, stream, h11.Data(data=frames), h11.EndOfMessage())
        return True

    @staticmethod
    def _prefix(reply: Reply, events: list[dict[str, Any]]) -> int:
        if reply.kind in ("disconnect", "stall", "keepalive"):
            return min(reply.after_events or 0, len(events) - 1)
        return len(events)

    @staticmethod
    async def _keepalives(reply: Reply, send: Callable[[], Any]) -> None:
        """Silence for ``reply.pause`` seconds, broken only by a keepalive every ``every``."""
        assert reply.pause is not None and reply.every is not None
        end = trio.current_time() + reply.pause
        while True:
            await trio.sleep(min(reply.every, max(0.0, end - trio.current_time())))
            if trio.current_time() >= end:
                return
            await send()

    @staticmethod
    async def _until_peer_gone(stream: trio.SocketStream) -> None:
        try:
            while await stream.receive_some(_RECV):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    # -- WebSocket ------------------------------------------------------------------------
    async def _websocket(
        self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request,
        where: list[int],
    ) -> None:
        ws = wsproto.WSConnection(ConnectionType.SERVER)
        ws.initiate_upgrade_connection(list(request.headers), request.target)
        trailing, _closed = conn.trailing_data
        if trailing:
            ws.receive_data(trailing)
        headers = _redacted_headers(request.headers)
        attempt_id = headers.get("x-client-request-id")
        pending: Reply | None = None
        accepted = False
        parts: list[str] = []
        size = 0
        while True:
            for event in ws.events():
                if isinstance(event, wse.Request):
                    reply = self.next_reply(attempt_id)
                    if reply.kind in HTTP_KINDS:
                        where[1] += 1
                        self._record("websocket", headers, b"", reply.kind, attempt_id,
                                     (where[0], where[1]))
                        rejection = http_rejection(reply)
                        hdrs = [(k.encode(), v.encode()) for k, v in rejection.headers]
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
                            (k.encode(), v.encode()) for k, v in self.rate_limit_headers()
                        )])))
                elif isinstance(event, wse.Ping):
                    await stream.send_all(ws.send(event.response()))
                elif isinstance(event, wse.CloseConnection):
                    if ws.state is wsproto.connection.ConnectionState.REMOTE_CLOSING:
                        await stream.send_all(ws.send(event.response()))
                    return
                elif isinstance(event, wse.BytesMessage):
                    await self._ws_send(ws, stream, {"type": "error", "error": {
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
                    keep = await self._ws_create(
                        ws, stream, headers, attempt_id, text, reply_used, where
                    )
                    attempt_id = None  # later requests on this connection carry no header
                    if not keep:
                        return
            if not accepted and ws.state is not wsproto.connection.ConnectionState.CONNECTING:
                return
            data = await stream.receive_some(_RECV)
            if not data:
                return
            ws.receive_data(data)

    async def _ws_send(
        self, ws: wsproto.WSConnection, stream: trio.SocketStream, event: dict[str, Any]
    ) -> None:
        await stream.send_all(ws.send(wse.TextMessage(data=msgspec.json.encode(event).decode())))

    async def _ws_create(
        self,
        ws: wsproto.WSConnection,
        stream: trio.SocketStream,
        headers: dict[str, str],
        attempt_id: str | None,
        text: str,
        reply: Reply | None,
        where: list[int],
    ) -> bool:
        try:
            decoded = msgspec.json.decode(text)
            if not isinstance(decoded, dict) or decoded.get("type") != "response.create":
                raise ValueError("not a response.create")
            canonical, obj = canonical_body(text.encode())
            carried = decoded.get(CLIENT_REQUEST_ID_FIELD)
            if attempt_id is None and isinstance(carried, str):
                attempt_id = carried  # a request on a reused connection
        except (ValueError, msgspec.DecodeError):
            await self._ws_send(ws, stream, {"type": "error", "status": 400, "error": {
                "type": "invalid_request_error", "code": "invalid_request",
                "message": "Expected a response.create message.", "param": None}})
            return True
        limited = self._admit_tokens(canonical)
        if limited is not None:
            reply = limited
        elif reply is None:
            reply = self.next_reply(attempt_id)
        where[1] += 1
        self._record("websocket", headers, canonical, reply.kind, attempt_id,
                     (where[0], where[1]))
        index = await self._replying()
        try:
            return await self._ws_reply(ws, stream, reply, obj, canonical)
        finally:
            self._finished(index)

    async def _ws_reply(
        self, ws: wsproto.WSConnection, stream: trio.SocketStream, reply: Reply,
        obj: dict[str, Any], canonical: bytes = b"",
    ) -> bool:
        if reply.kind in HTTP_KINDS:
            rejection = http_rejection(reply)
            await self._ws_send(ws, stream, {
                "type": "error",
                "status": rejection.status,
                "error": msgspec.json.decode(rejection.body).get("error"),
                "headers": {k: v for k, v in [*rejection.headers, *self.rate_limit_headers()]
                            if k != "content-type"},
            })
            return True
        try:
            events = self._events(reply, obj)
            self._charge_usage(events, canonical)
        except CannotSynthesize as exc:  # a schema no value can answer: the API's 400
            rejection = schema_rejection(exc)
            await self._ws_send(ws, stream, {
                "type": "error", "status": rejection.status,
                "error": msgspec.json.decode(rejection.body).get("error"),
            })
            return True
        limit = self._prefix(reply, events)
        if reply.kind == "lenient":
            events = [_lenient(event) for event in events]
        await stream.send_all(b"".join(
            ws.send(wse.TextMessage(data=msgspec.json.encode(event).decode()))
            for event in events[:limit]
        ))
        if reply.kind == "keepalive":
            async def ping() -> None:
                await stream.send_all(ws.send(wse.Ping(payload=b"keepalive")))

            await self._keepalives(reply, ping)
            await stream.send_all(b"".join(
                ws.send(wse.TextMessage(data=msgspec.json.encode(event).decode()))
                for event in events[limit:]
            ))
            return True
        if reply.kind == "disconnect":
            return False  # TCP dropped without a close frame (client sees 1006)
        if reply.kind == "stall":
            await self._until_peer_gone(stream)
            return False
        return True


def _sse_frame(event: Mapping[str, Any], *, with_event_line: bool = True) -> bytes:
    data = b"data: " + msgspec.json.encode(event) + b"\n\n"
    if not with_event_line:
        return data
    return b"event: " + str(event["type"]).encode() + b"\n" + data


def _lenient(event: dict[str, Any]) -> dict[str, Any]:
    """An event with the unknown top-level fields a lenient proxy adds."""
    return {**event, "provider_specific_fields": {"upstream": "fixture"}, "x_trace": "t-1"}


# -- separate process ----------------------------------------------------------------------
def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in 0..65535 (0: any free port): {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="recoverable fixture-provider",
        description="Run the loopback fixture Responses provider (SSE and WebSocket).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=0)
    parser.add_argument("--script", help="JSON file: a list of reply specs, used in order")
    parser.add_argument("--faults", help='e.g. "disconnect=0.1,rate_limited=0.05,seed=7"')
    parser.add_argument(
        "--reply-delay", type=float, default=0.0, metavar="SECONDS",
        help="hold every generation request this long before replying (a slow provider)",
    )
    parser.add_argument(
        "--tpm-limit", type=int, default=None, metavar="N",
        help="enforce N tokens per minute: a request over the budget gets a 429 with "
        "Retry-After and x-ratelimit-* headers",
    )
    parser.add_argument(
        "--rate-burst-seconds", type=float, default=60.0, metavar="SECONDS",
        help="the budget the --tpm-limit bucket holds, in seconds of refill (default 60)",
    )
    return parser


def fixture_main(argv: list[str]) -> int:
    """Run the provider until SIGTERM/SIGINT; print one JSON line with its URLs first."""
    args = _parser().parse_args(argv)
    try:
        faults = FaultSpec.parse(args.faults) if args.faults else None
        script: list[Reply] = []
        if args.script:
            with open(args.script, "rb") as fh:
                specs = msgspec.json.decode(fh.read())
            if not isinstance(specs, list):
                raise InvalidRequest("the script file holds a JSON list of reply specs")
            script = [Reply.from_spec(s) for s in specs]
    except (OSError, msgspec.DecodeError, InvalidRequest) as exc:
        print(f"fixture-provider: {exc}", file=sys.stderr)
        return 2

    async def run() -> None:
        import os

        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with FixtureProvider.serve(
                host=args.host, port=args.port, faults=faults, reply_delay=args.reply_delay,
                tpm_limit=args.tpm_limit, rate_burst_seconds=args.rate_burst_seconds,
            ) as provider:
                provider.script(script)
                line = {
                    "http_url": provider.http_url,
                    "websocket_url": provider.websocket_url,
                    "requests_url": provider.requests_url,
                    "pid": os.getpid(),
                }
                sys.stdout.write(json.dumps(line) + "\n")
                sys.stdout.flush()
                async for _ in signals:
                    break

    try:
        trio.run(run)
    except (OSError, OverflowError) as exc:
        # The address is in use, the host does not resolve or is not local, ...
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"fixture-provider: cannot listen on {args.host} port {args.port}: {reason}",
              file=sys.stderr)
        return 2
    return 0
