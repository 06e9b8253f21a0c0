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
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import h11
import msgspec
import trio

from recoverable.errors import InvalidRequest
from recoverable.transport.fixture_background import (
    BACKGROUND_NEEDS_STORE,
    DEFAULT_BACKGROUND_TTL,
    BackgroundProvider,
    RecordedRetrieval,
)
from recoverable.transport.fixture_replies import (
    HTTP_KINDS,
    CannotSynthesize,
    FaultSpec,
    Reply,
    http_rejection,
    schema_rejection,
)
from recoverable.transport.fixture_script import ResumeFault
from recoverable.transport.fixture_state import (
    MAX_DELTAS,
    MAX_REQUEST_BYTES,
    RECV_BYTES,
    RecordedRequest,
    canonical_body,
    keepalives,
    lenient,
    redacted_headers,
    reply_prefix,
    sse_frame,
    until_peer_gone,
)
from recoverable.transport.fixture_ws import serve_websocket

__all__ = [
    "FaultSpec",
    "FixtureProvider",
    "RecordedRequest",
    "RecordedRetrieval",
    "Reply",
    "ResumeFault",
    "fixture_main",
]


class _PeerGone(Exception):
    pass


class FixtureProvider(BackgroundProvider):
    """The in-process provider. Start it with ``FixtureProvider.serve()``."""

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
    def retrievals_url(self) -> str:
        """``GET`` it for the JSON list of ``retrievals`` (resume, retrieve, cancel)."""
        return f"http://{self._netloc}/_fixture/retrievals"

    @property
    def _netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


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
        deltas: tuple[int, int] | None = None,
        event_delay: float = 0.0,
        background_ttl: float = DEFAULT_BACKGROUND_TTL,
        ws_bind_model: bool = False,
    ) -> AsyncIterator[FixtureProvider]:
        """Serve until exit. ``reply_delay``: seconds every generation request is held
        after it is recorded and before its reply starts (a slow provider: it makes
        requests overlap, so client-side concurrency limits show in the log).

        ``tpm_limit``: tokens per minute it allows. A request is counted at arrival for
        ``estimate_tokens(body)`` (a quarter of its bytes plus its ``max_output_tokens``)
        and, after its reply, for the reported usage beyond that; one that would take more
        than the bucket holds is answered 429 with Retry-After. Every answer carries the
        ``x-ratelimit-*-tokens`` headers.

        ``deltas=(low, high)``: every text answer streams in ``low``..``high`` delta events
        (chosen per reply; fewer if the text is shorter) instead of four, as real answers
        of hundreds of tokens do.

        ``event_delay``: seconds between two events of a background response's generation
        (0: all at once); ``background_ttl``: seconds a background response stays
        retrievable (``expire()`` ends one at once). See ``fixture_background``.

        ``ws_bind_model``: act like the LiteLLM proxy, which binds a WebSocket session to
        the model of its first ``response.create``: a later create for another model on
        that connection is recorded and answered with a ``server_error`` ``error`` event
        (reply kind ``error_event``; nothing generated, no token counted)."""
        provider = cls(faults=faults, reply_delay=reply_delay, tpm_limit=tpm_limit,
                       rate_burst_seconds=rate_burst_seconds, deltas=deltas,
                       event_delay=event_delay, background_ttl=background_ttl,
                       ws_bind_model=ws_bind_model)
        listeners = await trio.open_tcp_listeners(port, host=host, backlog=4096)
        provider.host = host
        provider.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            provider._nursery = nursery  # background responses are generated here
            await nursery.start(provider._listen, listeners)
            try:
                yield provider
            finally:
                nursery.cancel_scope.cancel()

    # -- a restart ---------------------------------------------------------------------------
    async def _listen(
        self, listeners: list[trio.SocketListener],
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        stopped = trio.Event()
        self._listening = (trio.CancelScope(), stopped)
        try:
            with self._listening[0]:
                await trio.serve_listeners(self._handle, listeners, task_status=task_status)
        finally:
            stopped.set()

    async def stop_listening(self) -> None:
        """The first half of a restart (a proxy restarted in front of the provider):
        the port is closed (a connect is refused) and every open connection dropped; the
        stored background responses keep generating. :meth:`listen_again` reopens it."""
        scope, stopped = self._listening
        scope.cancel()
        await stopped.wait()

    async def listen_again(self) -> None:
        """The second half of a restart: listen on the same port again."""
        assert self._nursery is not None
        listeners = await trio.open_tcp_listeners(self.port, host=self.host, backlog=4096)
        await self._nursery.start(self._listen, listeners)

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
                data = await stream.receive_some(RECV_BYTES)
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

    async def _route(
        self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request,
        where: list[int],
    ) -> bool:
        target = request.target.split(b"?", 1)[0]
        method = request.method
        headers = {name.lower(): value for name, value in request.headers}
        if target == b"/v1/responses" and method == b"GET" and (
            headers.get(b"upgrade", b"").lower() == b"websocket"
        ):
            await self._read_body(conn, stream)
            await serve_websocket(self, conn, stream, request, where)
            return False
        body = await self._read_body(conn, stream)
        if body is None:
            await self._simple(conn, stream, 413, b'{"error":{"message":"too large",'
                               b'"type":"invalid_request_error","param":null,"code":null}}')
            return False
        if target == b"/v1/responses" and method == b"POST":
            where[1] += 1
            return await self._sse(conn, stream, request, body, (where[0], where[1]))
        if target.startswith(b"/v1/responses/"):
            return await self._stored_route(conn, stream, request)
        if target == b"/_fixture/requests" and method == b"GET":
            listing = [recorded.to_json() for recorded in self.requests]
            await self._simple(conn, stream, 200, json.dumps(listing).encode())
            return True
        if target == b"/_fixture/retrievals" and method == b"GET":
            listing = [retrieval.to_json() for retrieval in self.retrievals]
            await self._simple(conn, stream, 200, json.dumps(listing).encode())
            return True
        if target == b"/_fixture/stored" and method == b"GET":
            await self._simple(conn, stream, 200, msgspec.json.encode(self.stored_listing()))
            return True
        if target in (b"/_fixture/expire", b"/_fixture/resume-script") and method == b"POST":
            return await self._control(conn, stream, target, body)
        if target == b"/_fixture/script" and method == b"POST":
            try:
                specs = msgspec.json.decode(body)
                if not isinstance(specs, list):
                    raise InvalidRequest("the script is a JSON list of reply specs")
                self.script([Reply.from_spec(spec) for spec in specs])
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

    async def _control(
        self, conn: h11.Connection, stream: trio.SocketStream, target: bytes, body: bytes,
    ) -> bool:
        """``POST /_fixture/expire`` (``{"response_id": id}``, or ``{}`` for every stored
        response) and ``POST /_fixture/resume-script`` (a list of resume fault specs)."""
        try:
            spec = msgspec.json.decode(body or b"{}")
            if target == b"/_fixture/expire":
                rid = spec.get("response_id") if isinstance(spec, dict) else None
                if not isinstance(spec, dict) or not isinstance(rid, str | None):
                    raise InvalidRequest('expire takes {"response_id": "..."} or {}')
                answer: dict[str, Any] = {"expired": self.expire(rid)}
            else:
                if not isinstance(spec, list):
                    raise InvalidRequest("the resume script is a JSON list of fault specs")
                self.script_resumes([ResumeFault.from_spec(item) for item in spec])
                answer = {"ok": True}
        except (msgspec.DecodeError, InvalidRequest) as exc:
            err = {"error": {"message": str(exc), "type": "invalid_request_error",
                             "param": None, "code": "invalid_script"}}
            await self._simple(conn, stream, 400, msgspec.json.encode(err))
            return True
        await self._simple(conn, stream, 200, msgspec.json.encode(answer))
        return True

    async def _sse(
        self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request, body: bytes,
        where: tuple[int, int],
    ) -> bool:
        headers = redacted_headers(request.headers)
        attempt_id = headers.get("x-client-request-id")
        try:
            canonical, obj = canonical_body(body)
        except (ValueError, msgspec.DecodeError):
            self._record("sse", headers, body, "bad_request", attempt_id, where)
            err = {"error": {"message": "We could not parse the JSON body of your request.",
                             "type": "invalid_request_error", "param": None, "code": None}}
            await self._simple(conn, stream, 400, msgspec.json.encode(err))
            return True
        if obj.get("background") is True and obj.get("store", True) is not True:
            self._record("sse", headers, canonical, "bad_request", attempt_id, where)
            await self._simple(conn, stream, 400, BACKGROUND_NEEDS_STORE)
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
        if obj.get("background") is True and not self.ignore_background:
            # Stored, generated whether or not it is read.
            return await self._background_sse(conn, stream, reply, events)
        await self._sse_head(conn, stream)
        limit = reply_prefix(reply, events)
        if reply.kind == "lenient":
            events = [lenient(event) for event in events]
        # One write for the whole (prefix of the) stream: the bytes are exactly the
        # real API's frames; only their pacing is compressed.
        frames = b"".join(
            sse_frame(event, with_event_line=reply.kind != "lenient" or index % 2 == 0)
            for index, event in enumerate(events[:limit])
        )
        if reply.kind == "lenient":
            frames += b"data: [DONE]\n\n"
        if reply.kind == "keepalive":
            await self._send(conn, stream, h11.Data(data=frames))
            await keepalives(reply, lambda: self._send(conn, stream, h11.Data(
                data=b": ping\n\n")))
            rest = b"".join(sse_frame(event) for event in events[limit:])
            await self._send(conn, stream, h11.Data(data=rest), h11.EndOfMessage())
            return True
        if reply.kind in ("disconnect", "stall") or reply.disconnect_after is not None:
            await self._send(conn, stream, h11.Data(data=frames))
            if reply.kind == "stall":
                await until_peer_gone(stream)
            return False  # a disconnect drops the connection mid-body
        await self._send(conn, stream, h11.Data(data=frames), h11.EndOfMessage())
        return True









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
    parser.add_argument(
        "--deltas", type=_deltas, default=None, metavar="LOW:HIGH",
        help="stream every text answer in LOW..HIGH delta events (default: four)",
    )
    parser.add_argument(
        "--event-delay", type=_seconds(60.0), default=0.0, metavar="SECONDS",
        help="generate the events of a background response this far apart (default 0: "
        "all at once)",
    )
    parser.add_argument(
        "--background-ttl", type=_seconds(None), default=DEFAULT_BACKGROUND_TTL,
        metavar="SECONDS",
        help="how long a background response stays retrievable (default "
        f"{DEFAULT_BACKGROUND_TTL:g})",
    )
    parser.add_argument(
        "--ws-bind-model", action="store_true",
        help="bind a WebSocket connection to the model of its first response.create, as "
        "the LiteLLM proxy does: a create for another model on it gets a server_error event",
    )
    parser.add_argument(
        "--resumes-as-objects", action="store_true",
        help="answer every resume GET (stream=true) with the response object as JSON, as a "
        "server that drops stream and starting_after does (the LiteLLM proxy)",
    )
    parser.add_argument(
        "--ignore-background", action="store_true",
        help="answer a background POST as a plain one (nothing stored; background: false), "
        "as a server that accepts the flag and ignores it",
    )
    return parser


def _seconds(most: float | None) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        if not (value >= 0.0 if most is not None else value > 0.0) or (
            most is not None and value > most
        ) or value != value:
            bounds = f"within 0..{most:g}" if most is not None else "positive"
            raise argparse.ArgumentTypeError(f"must be {bounds}: {text!r}")
        return value

    return parse


def _deltas(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        pair = (int(low), int(high if sep else low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not LOW:HIGH: {text!r}") from None
    if not 1 <= pair[0] <= pair[1] <= MAX_DELTAS:
        raise argparse.ArgumentTypeError(f"need 1 <= LOW <= HIGH <= {MAX_DELTAS}: {text!r}")
    return pair


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
            script = [Reply.from_spec(spec) for spec in specs]
    except (OSError, msgspec.DecodeError, InvalidRequest) as exc:
        print(f"fixture-provider: {exc}", file=sys.stderr)
        return 2

    async def run() -> None:
        import os

        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with FixtureProvider.serve(
                host=args.host, port=args.port, faults=faults, reply_delay=args.reply_delay,
                tpm_limit=args.tpm_limit, rate_burst_seconds=args.rate_burst_seconds,
                deltas=args.deltas, event_delay=args.event_delay,
                background_ttl=args.background_ttl, ws_bind_model=args.ws_bind_model,
            ) as provider:
                provider.script(script)
                provider.resumes_as_objects = args.resumes_as_objects
                provider.ignore_background = args.ignore_background
                line = {
                    "http_url": provider.http_url,
                    "websocket_url": provider.websocket_url,
                    "requests_url": provider.requests_url,
                    "retrievals_url": provider.retrievals_url,
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
