"""WebSocket transport: ``response.create`` over ``ws(s)://…/v1/responses`` (trio-websocket).

Each connection lives in a small keeper task (``open_websocket_url`` needs a
nursery for its reader). With a long-lived nursery (the backend entered with
``async with``) finished connections go back to an idle pool keyed by
(url, token fingerprint, model) and are reused; one response is in flight per
connection, and a connection whose stream ended in any interruption is closed.
Without that nursery every stream uses its own connection.

The model is part of the key because a proxy may bind a WebSocket session to the model
of its first ``response.create`` (LiteLLM does): a request for another model on that
socket is answered with an ``error`` event and never reaches the upstream, so reusing
it across models would spend an attempt.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Final
from urllib.parse import urlsplit

import attrs
import msgspec
import trio
import trio_websocket

from recoverable.outcome import Completed, Interruption, Outcome, Progress
from recoverable.transport.base import (
    MAX_ERROR_BODY_BYTES,
    USER_AGENT,
    StreamLimits,
    parse_error_body,
    parse_retry_after,
    token_fingerprint,
)
from recoverable.transport.connect import classify_connect_error
from recoverable.transport.events import ResponseStream, response_stream
from recoverable.transport.idle import IdleTimer
from recoverable.transport.ratelimit import parse_rate_limit_headers
from recoverable.transport.sse import add_field

__all__ = ["WebSocketTransport", "body_model", "websocket_url"]

# A pooled connection's key: (WebSocket URL, token fingerprint, model).
PoolKey = tuple[str, str, str]

_DISCONNECT_TIMEOUT = 2.0
# A server that says so in its handshake answer (the fixture provider; never the real
# API) gets the attempt id of a request on a reused connection inside the message: the
# handshake's ``x-client-request-id`` named only the connection's first request.
_ACCEPTS_ID_FIELD = (b"x-accepts-client-request-id-field", b"1")


def _with_request_id(ws: trio_websocket.WebSocketConnection, message: str, attempt_id: str) -> str:
    if _ACCEPTS_ID_FIELD not in ws.handshake_headers:
        return message
    return '{"client_request_id":' + msgspec.json.encode(attempt_id).decode() + "," + message[1:]


class _Model(msgspec.Struct):
    model: str | None = None


# Only the top-level ``model`` is decoded: msgspec skips every other member (the input
# included) without building it, so this costs about as much as one scan of the body.
_decode_model: Final = msgspec.json.Decoder(_Model).decode


def body_model(body: bytes) -> str:
    """The ``model`` of a frozen create body, part of its connection's pool key.

    A body whose model cannot be read (none, not a string, not JSON) gets ``""``: it
    still streams, and shares its pooled connections only with other such bodies.
    """
    try:
        return _decode_model(body).model or ""
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""


def websocket_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    if base.startswith("https://"):
        base = "wss://" + base[len("https://") :]
    elif base.startswith("http://"):
        base = "ws://" + base[len("http://") :]
    return base + "/responses"


@attrs.define(eq=False)
class _Connection:
    ws: trio_websocket.WebSocketConnection
    release: trio.Event
    scope: trio.CancelScope
    key: PoolKey

    def close(self) -> None:
        """Graceful close (close handshake, bounded by the disconnect timeout)."""
        self.release.set()

    def abort(self) -> None:
        """Drop the TCP connection now: it ended mid-response, its state is unknown."""
        self.release.set()
        self.scope.cancel()

    @property
    def usable(self) -> bool:
        return self.ws.closed is None and not self.release.is_set()


class _ActivityStream(trio.abc.Stream):
    """The connection's byte stream, seen through: every received chunk is reported.

    trio-websocket answers ping frames inside its reader task and never hands them to
    us, so a server that keeps a silent stream alive with pings would look idle. The
    reader reads ``ws._stream`` on every loop, so replacing it with this wrapper (once
    per connection) lets ``on_bytes`` see every chunk after the swap: pings, pongs and
    message bytes alike.
    """

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.on_bytes: Callable[[int], None] | None = None

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self.inner.receive_some(max_bytes)
        callback = self.on_bytes
        if data and callback is not None:
            callback(len(data))
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __getattr__(self, name: str) -> Any:  # e.g. ``socket``, for ws.local / ws.remote
        return getattr(self.inner, name)


def _watch(ws: trio_websocket.WebSocketConnection) -> _ActivityStream | None:
    current = getattr(ws, "_stream", None)
    if isinstance(current, _ActivityStream):
        return current
    if not isinstance(current, trio.abc.Stream):
        return None  # an unknown trio-websocket layout: messages alone reset the idle timer
    watched = _ActivityStream(current)
    ws._stream = watched
    return watched


class _Rejected(Exception):
    def __init__(self, outcome: Interruption) -> None:
        super().__init__(outcome.kind)
        self.outcome = outcome


def _handshake_failure(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The rejection or the timeout that ended a handshake, from the reader's group."""
    for kind in (trio_websocket.ConnectionRejected, trio.TooSlowError):
        matched, _ = group.split(kind)
        if matched is not None:
            return _first(matched)
    return None


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class WebSocketTransport:
    def __init__(self, base_url: str, *, limits: StreamLimits, max_connections: int) -> None:
        self.url = websocket_url(base_url)
        parts = urlsplit(self.url)
        self._tls = parts.scheme == "wss"
        assert parts.hostname is not None
        self._host = parts.hostname
        self._port = parts.port or (443 if self._tls else 80)
        self._host_header = parts.netloc
        self._resource = parts.path or "/"
        self._ssl_context: ssl.SSLContext | None = None
        self._limits = limits
        self._max_idle = max_connections
        self._idle: dict[PoolKey, list[_Connection]] = {}
        self._idle_count = 0
        self._nursery: trio.Nursery | None = None
        self._closed = False

    def attach(self, nursery: trio.Nursery | None) -> None:
        """Give the transport a long-lived nursery; pooling is on while one is attached
        (attaching one again after :meth:`aclose` reopens the pool)."""
        self._nursery = nursery
        if nursery is not None:
            self._closed = False

    async def aclose(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        self._idle_count = 0

    # -- connections -----------------------------------------------------------
    async def _open_stream(self) -> trio.SocketStream | trio.SSLStream[trio.SocketStream]:
        """TCP, then TLS for ``wss``, with the handshake done here so that a TLS failure
        is reported as such (trio-websocket would only see it as a handshake timeout)."""
        tcp = await trio.open_tcp_stream(self._host, self._port)
        if not self._tls:
            return tcp
        if self._ssl_context is None:
            self._ssl_context = ssl.create_default_context()
        tls = trio.SSLStream(
            tcp, self._ssl_context, server_hostname=self._host, https_compatible=True
        )
        try:
            await tls.do_handshake()
        except BaseException:
            await trio.aclose_forcefully(tcp)
            raise
        return tls

    async def _keeper(
        self,
        headers: list[tuple[bytes, bytes]],
        release: trio.Event,
        *,
        task_status: trio.TaskStatus[
            tuple[trio_websocket.WebSocketConnection, trio.CancelScope]
        ],
    ) -> None:
        started = False
        unwrapped: BaseException | None = None
        try:
            with trio.CancelScope() as scope:
                # One bound for TCP + TLS + the opening handshake together.
                deadline = trio.current_time() + self._limits.connect_timeout
                with trio.fail_at(deadline):
                    stream = await self._open_stream()
                try:
                    async with trio.open_nursery() as inner:
                        with trio.fail_at(deadline):
                            ws = await trio_websocket.wrap_client_stream(
                                inner, stream, self._host_header, self._resource,
                                extra_headers=headers,
                                max_message_size=self._limits.max_frame_bytes,
                            )
                        task_status.started((ws, scope))
                        started = True
                        try:
                            await release.wait()
                        finally:
                            if not scope.cancel_called:
                                # Graceful close handshake, bounded by the disconnect timeout
                                # (skipped at once when the keeper itself is cancelled).
                                with trio.move_on_after(_DISCONNECT_TIMEOUT):
                                    await ws.aclose()
                            inner.cancel_scope.cancel()
                finally:
                    await trio.aclose_forcefully(stream)
        except BaseException as exc:
            # Before ``started`` the error belongs to the caller (nursery.start raises it);
            # afterwards a failing close must not take the shared nursery down.
            if not started:
                if isinstance(exc, BaseExceptionGroup):
                    # The reader's nursery groups what ended the handshake: unwrap the
                    # rejection or the timeout; anything else stays a protocol failure.
                    unwrapped = _handshake_failure(exc)
                if unwrapped is None:
                    raise
            elif not isinstance(exc, Exception):
                raise
        if unwrapped is not None:
            # Raised here, after the handler, not inside it: there it would get the group
            # that holds it as its __context__, a reference cycle that kept every frame,
            # task and nursery of the failed handshake (about 165 objects per rejected
            # connection) for the full collector, whose passes then stalled the event loop
            # for hundreds of milliseconds with thousands of operations parked. Nor may a
            # local name it once raised (this frame is in its traceback).
            try:
                raise unwrapped
            finally:
                del unwrapped

    async def _connect(
        self, nursery: trio.Nursery, token: str, attempt_id: str, state: ResponseStream,
        key: PoolKey,
    ) -> _Connection:
        headers = [
            (b"authorization", f"Bearer {token}".encode()),
            (b"x-client-request-id", attempt_id.encode()),
            (b"user-agent", USER_AGENT.encode()),
        ]
        release = trio.Event()
        try:
            ws, scope = await nursery.start(self._keeper, headers, release)
        except trio_websocket.ConnectionRejected as exc:
            raise _Rejected(self._rejection(exc, state)) from None
        except (trio.TooSlowError, trio_websocket.ConnectionTimeout):
            raise _Rejected(state.interrupt("timeout", transport_code="connect_timeout")) from None
        except (OSError, trio.BrokenResourceError) as exc:
            # Nothing was established: refused, name not resolved, TLS failed, unreachable.
            code = classify_connect_error(exc)
            raise _Rejected(state.interrupt(
                "timeout" if code == "connect_timeout" else "disconnected", transport_code=code
            )) from None
        except Exception as exc:
            # A peer that breaks the HTTP/WebSocket handshake protocol (h11/wsproto errors,
            # possibly grouped by the reader's nursery): a typed outcome, never a crash.
            code = classify_connect_error(exc, default="handshake_failed")
            raise _Rejected(state.interrupt(
                "malformed" if code == "handshake_failed" else "disconnected", transport_code=code
            )) from None
        if ws.closed is not None:
            # The peer closed during the opening handshake: never established.
            scope.cancel()
            release.set()
            raise _Rejected(state.interrupt("malformed", transport_code="handshake_failed"))
        return _Connection(ws, release, scope, key)

    @staticmethod
    def _rejection(exc: trio_websocket.ConnectionRejected, state: ResponseStream) -> Interruption:
        headers = [
            (bytes(name).decode("latin-1"), bytes(value).decode("latin-1"))
            for name, value in exc.headers or ()
        ]
        body = bytes(exc.body or b"")[:MAX_ERROR_BODY_BYTES]
        ptype, pcode = parse_error_body(body)
        return state.interrupt(
            "http_rejected",
            http_status=exc.status_code,
            provider_type=ptype,
            provider_code=pcode,
            retry_after=parse_retry_after(headers),
            rate_limits=parse_rate_limit_headers(headers),
        )

    def _take_idle(self, key: PoolKey) -> _Connection | None:
        conns = self._idle.get(key)
        while conns:
            conn = conns.pop()
            self._idle_count -= 1
            if conn.usable:
                return conn
            conn.abort()
        return None

    def _give_back(self, conn: _Connection) -> None:
        if self._closed or self._nursery is None or not conn.usable:
            conn.close()
            return
        if self._idle_count >= self._max_idle:
            conn.close()
            return
        self._idle.setdefault(conn.key, []).append(conn)
        self._idle_count += 1

    # -- streaming -------------------------------------------------------------
    async def stream(
        self,
        body: bytes,
        *,
        attempt_id: str,
        token: str,
        on_progress: Callable[[Progress], None] | None = None,
        before_send: Callable[[], Awaitable[None]] | None = None,
        on_delta: Callable[[str], None] | None = None,
    ) -> Outcome:
        """Stream one generation. ``before_send`` runs once a connection is open (TCP, TLS,
        WebSocket handshake; or a pooled one) and before ``response.create`` is sent. A
        handshake answered with an HTTP status counts as established (the rejection is the
        attempt's outcome). If no connection could be established it is never called and
        the interruption's ``transport_code`` is a connect code."""
        message = add_field(body, b'"type":"response.create"').decode("utf-8")
        key = (self.url, token_fingerprint(token), body_model(body))
        if self._nursery is not None:
            return await self._stream_in(
                self._nursery, message, attempt_id, token, key, on_progress, before_send,
                on_delta,
            )
        try:
            async with trio.open_nursery() as nursery:
                result = await self._stream_in(
                    nursery, message, attempt_id, token, key, on_progress, before_send,
                    on_delta,
                )
                # Unpooled: the connection's closing handshake gets a bounded grace, then it
                # is dropped — a peer that never answers the close must not hold the caller.
                nursery.cancel_scope.deadline = trio.current_time() + _DISCONNECT_TIMEOUT
        except BaseExceptionGroup as group:
            # This private nursery must not change what the caller sees: an error raised by
            # ``before_send`` (a stop at consumption, a storage error) reaches it as itself,
            # exactly as on a pooled connection.
            if len(group.exceptions) == 1 and not isinstance(
                group.exceptions[0], trio.Cancelled
            ):
                raise group.exceptions[0] from None
            raise
        return result

    async def _stream_in(
        self,
        nursery: trio.Nursery,
        message: str,
        attempt_id: str,
        token: str,
        key: PoolKey,
        on_progress: Callable[[Progress], None] | None,
        before_send: Callable[[], Awaitable[None]] | None,
        on_delta: Callable[[str], None] | None = None,
    ) -> Outcome:
        limits = self._limits
        state = response_stream(
            max_events=limits.max_events, on_progress=on_progress, on_delta=on_delta
        )
        hooked = False

        async def established() -> None:
            nonlocal hooked
            if not hooked:
                hooked = True
                if before_send is not None:
                    await before_send()

        idle = trio.CancelScope()
        idle.deadline = trio.current_time() + limits.connect_timeout + limits.idle_timeout
        conn: _Connection | None = None
        fresh: _Connection | None = None
        outcome: Outcome | None = None
        try:
            with idle:
                try:
                    conn = self._take_idle(key)
                    if conn is not None:
                        await established()
                        try:
                            await conn.ws.send_message(
                                _with_request_id(conn.ws, message, attempt_id)
                            )
                        except trio_websocket.ConnectionClosed:
                            conn.abort()  # went stale while idle; nothing was sent
                            conn = None
                    if conn is None:
                        conn = fresh = await self._connect(
                            nursery, token, attempt_id, state, key
                        )
                        await established()
                        try:
                            await conn.ws.send_message(message)
                        except trio_websocket.ConnectionClosed as exc:
                            outcome = self._closed_outcome(exc, state)
                    if outcome is None:
                        outcome = await self._receive(conn, state, idle)
                except _Rejected as rejected:
                    outcome = rejected.outcome
                    if outcome.kind == "http_rejected":
                        await established()  # the server answered: the attempt is spent
            if idle.cancelled_caught:
                outcome = state.interrupt("timeout", transport_code="idle_timeout")
            assert outcome is not None
            if fresh is not None and outcome.rate_limits is None:
                # The x-ratelimit-* headers of this connection's own opening handshake (a
                # reused connection's handshake speaks of an earlier request: not used).
                seen = parse_rate_limit_headers(
                    (bytes(name).decode("latin-1"), bytes(value).decode("latin-1"))
                    for name, value in fresh.ws.handshake_headers
                )
                if seen is not None:
                    outcome = msgspec.structs.replace(outcome, rate_limits=seen)
            if conn is not None:
                if isinstance(outcome, Completed):
                    self._give_back(conn)
                else:
                    conn.abort()
                conn = None
            return outcome
        finally:
            if conn is not None:  # cancelled or crashed mid-stream: never reuse
                conn.abort()

    @staticmethod
    def _closed_outcome(
        exc: trio_websocket.ConnectionClosed, state: ResponseStream
    ) -> Interruption:
        code = exc.reason.code if exc.reason is not None else 1006
        if code == 1009:
            return state.interrupt("response_too_large", transport_code="frame_too_large")
        if code == 1000:
            return state.interrupt("premature_eof", transport_code="ws_close_1000")
        return state.interrupt("disconnected", transport_code=f"ws_close_{code}")

    async def _receive(
        self, conn: _Connection, state: ResponseStream, idle: trio.CancelScope
    ) -> Outcome:
        """Read events until an outcome. Any bytes received (a ping frame included)
        reset the idle timer; all of them count against ``max_total_bytes``."""
        limits = self._limits
        flood = trio.CancelScope()
        received = 0
        timer = IdleTimer(idle, limits.idle_timeout)

        def on_bytes(count: int) -> None:
            nonlocal received
            received += count
            if received > limits.max_total_bytes:
                flood.cancel()
            else:
                timer.touch()

        watched = _watch(conn.ws)
        if watched is not None:
            watched.on_bytes = on_bytes
        # Bytes that arrived before the hook was set (read by trio-websocket's reader while
        # the request was being sent) re-armed nothing: the idle bound starts now, not at
        # the connect deadline (``connect_timeout`` + ``idle_timeout``).
        timer.touch()
        outcome: Outcome | None = None
        try:
            with flood:
                # With the byte stream watched, every message's bytes already re-armed the
                # timer as they arrived: the messages need not do it again.
                outcome = await self._messages(conn, state, timer if watched is None else None)
        finally:
            if watched is not None:
                watched.on_bytes = None
        if outcome is None:
            return state.interrupt("response_too_large", transport_code="stream_too_large")
        return outcome

    async def _messages(
        self, conn: _Connection, state: ResponseStream, timer: IdleTimer | None
    ) -> Outcome:
        limits = self._limits
        total = 0
        while True:
            try:
                msg = await conn.ws.get_message()
            except trio_websocket.ConnectionClosed as exc:
                return self._closed_outcome(exc, state)
            if isinstance(msg, bytes):
                return state.interrupt("disconnected", transport_code="ws_binary_frame")
            total += len(msg)
            if total > limits.max_total_bytes:
                return state.interrupt("response_too_large", transport_code="stream_too_large")
            outcome = state.feed(msg)
            if outcome is not None:
                return outcome
            if timer is not None:
                timer.touch()
