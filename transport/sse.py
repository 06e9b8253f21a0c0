"""HTTP SSE transport: ``POST {base_url}/responses`` with ``"stream": true`` (httpx on Trio)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Final, cast

import httpx
import msgspec
import trio

from recoverable.outcome import Completed, Interruption, Outcome, Progress, RateLimits
from recoverable.transport.base import (
    MAX_ERROR_BODY_BYTES,
    USER_AGENT,
    StreamLimits,
    parse_error_body,
    parse_retry_after,
)
from recoverable.transport.connect import classify_connect_error
from recoverable.transport.events import (
    FrameTooLarge,
    ResponseStream,
    SseDecoder,
    response_stream,
)
from recoverable.transport.idle import IdleTimer
from recoverable.transport.ratelimit import parse_rate_limit_headers
from recoverable.transport.shards import ClientShards

__all__ = ["RESPONSE_OBJECT", "SseTransport", "add_field"]

# ``exchange``'s code for an answer that was a JSON object, not a stream (``objects``).
RESPONSE_OBJECT = "response_object"


def add_field(body: bytes, field: bytes) -> bytes:
    """Insert ``field`` (``b'"k":v'``) as the first member of the JSON object ``body``."""
    if not body.startswith(b"{") or not body.endswith(b"}"):
        raise ValueError("the frozen request body must be a JSON object")
    inner = body[1:-1].strip()
    return b"{" + field + (b"," + inner if inner else b"") + b"}"


# After a terminal event (``response.completed``, ``response.failed``,
# ``response.incomplete``, ``error``) the body normally ends at once. Reading that end lets
# httpx's own stream generators finish (no ResourceWarning: encode/httpx#3686) and keeps
# the connection for reuse; a server that keeps the body open is cut off after this much.
DRAIN_GRACE_SECONDS = 1.0
DRAIN_MAX_BYTES = 64 * 1024
# Interruptions decided by a terminal event only. ``tool_activity`` is not one of them (a
# tool event mid-stream is followed by more output), nor are the stream's own bounds.
# (``http_rejected`` here is an ``error`` event carrying a status: HTTP statuses are read
# by ``_rejected``, never through the event parser.)
_TERMINAL_INTERRUPTIONS = frozenset({"provider_failed", "incomplete", "refusal", "http_rejected"})


async def _drain_terminal(chunks: AsyncGenerator[bytes, None], outcome: Outcome) -> None:
    if not (isinstance(outcome, Completed) or (
        isinstance(outcome, Interruption) and outcome.kind in _TERMINAL_INTERRUPTIONS
    )):
        return
    total = 0
    # Shielded and short: the outcome is in hand, and no idle timeout, suspend or
    # cancel may turn it into another interruption while the (normally empty) rest is read.
    with trio.CancelScope(deadline=trio.current_time() + DRAIN_GRACE_SECONDS, shield=True):
        try:
            async for chunk in chunks:
                total += len(chunk)
                if total > DRAIN_MAX_BYTES:
                    return
        except httpx.TransportError:
            return  # the completion is already in hand



_CLOSED_STREAM: Final = httpx.ByteStream(b"")


def _unbind(response: httpx.Response) -> None:
    """Cut a closed streamed response from its stream. httpx's streamed ``Response`` and
    the ``BoundAsyncStream`` it reads point at each other: a cycle that keeps the
    request, the pool's request and the connection's stream of every attempt (about 45
    objects) for the full collector. Closed, the stream is never read again (httpx
    raises ``StreamClosed`` first), so the response may drop it and be freed by
    reference counting."""
    response.stream = _CLOSED_STREAM

class SseTransport:
    def __init__(self, base_url: str, *, limits: StreamLimits, max_connections: int) -> None:
        self.url = base_url.rstrip("/") + "/responses"
        self._limits = limits
        # Small pools, not one large one: see transport/shards.py (thousands of waiting operations).
        self._shards = ClientShards(
            max_connections=max_connections, connect_timeout=limits.connect_timeout
        )

    @property
    def clients(self) -> list[httpx.AsyncClient]:
        """The HTTP clients opened so far (one per pool shard)."""
        return self._shards.opened

    def attach(self, nursery: trio.Nursery | None) -> None:
        """Nothing to attach: httpx keeps its pools without background tasks."""

    async def aclose(self) -> None:
        await self._shards.aclose()

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
        """Stream one generation. ``before_send`` runs once a connection is established
        (new or from the pool) and before the first byte of the request is written; if
        the connection cannot be established it is never called and the interruption's
        ``transport_code`` is a connect code (``transport.connect.CONNECT_CODES``)."""
        limits = self._limits
        state = response_stream(
            max_events=limits.max_events, on_progress=on_progress, on_delta=on_delta
        )
        content = add_field(body, b'"stream":true')
        headers = {
            "authorization": f"Bearer {token}",
            "x-client-request-id": attempt_id,
            "content-type": "application/json",
            "accept": "text/event-stream",
            # Raw bytes only: a compressed stream could expand past every bound in one chunk.
            "accept-encoding": "identity",
            "user-agent": USER_AGENT,
        }
        hooked = False

        async def trace(name: str, info: dict[str, Any]) -> None:
            # httpcore calls this with the connection established, before it writes the
            # request line: the one point where "connected" and "nothing sent" both hold.
            nonlocal hooked
            if name.endswith(".send_request_headers.started") and not hooked:
                hooked = True
                if before_send is not None:
                    await before_send()

        request = self._shards.builder.build_request(
            "POST", self.url, content=content, headers=headers, extensions={"trace": trace}
        )
        return await self.exchange(request, state)

    def request(self, method: str, url: str, *, token: str, attempt_id: str | None = None,
                params: dict[str, str] | None = None, stream: bool = False) -> httpx.Request:
        """A request on this transport's client and headers (reattachment: the GETs and the
        cancel POST of a background response; no body)."""
        headers = {
            "authorization": f"Bearer {token}",
            "accept": "text/event-stream" if stream else "application/json",
            "accept-encoding": "identity",
            "user-agent": USER_AGENT,
        }
        if attempt_id is not None:
            headers["x-client-request-id"] = attempt_id
        return self._shards.builder.build_request(method, url, headers=headers, params=params)

    async def fetch(self, request: httpx.Request) -> tuple[int, bytes | None]:
        """Send a small request and read its whole answer: (status, body), the body
        ``None`` when it passed ``max_frame_bytes``. Raises ``httpx.TransportError`` (the
        caller maps it); its time is bounded by the caller."""
        with self._shards.client() as client:
            return await self._fetch(client, request)

    async def _fetch(
        self, client: httpx.AsyncClient, request: httpx.Request
    ) -> tuple[int, bytes | None]:
        response = await client.send(request, stream=True)
        try:
            return response.status_code, await self._whole_body(response)
        finally:
            with trio.CancelScope(shield=True):
                await response.aclose()
                _unbind(response)

    async def _whole_body(self, response: httpx.Response) -> bytes | None:
        """The answer's whole body, ``None`` once it passed ``max_frame_bytes``."""
        body = bytearray()
        raw = cast("AsyncGenerator[bytes, None]", response.aiter_raw())
        async with contextlib.aclosing(raw) as chunks:
            async for chunk in chunks:
                body += chunk
                if len(body) > self._limits.max_frame_bytes:
                    return None
        return bytes(body)

    async def exchange(
        self, request: httpx.Request, state: ResponseStream, objects: list[bytes] | None = None
    ) -> Outcome:
        """Send ``request`` and read its SSE answer into ``state`` under every bound of
        ``StreamLimits`` (connect, idle, frame, total bytes, events); never raises for a
        transport or provider problem.

        ``objects``: a resume GET's answer may be a JSON object instead of a stream (a
        server that drops ``stream``); its body (bounded by ``max_frame_bytes``) is then
        appended to ``objects`` and the outcome is ``malformed`` with
        :data:`RESPONSE_OBJECT` for the caller to read it. Without ``objects`` such an
        answer is ``malformed`` (``unexpected_content_type``)."""
        limits = self._limits
        idle = trio.CancelScope()
        # The first event must arrive within connect + idle; afterwards idle per event.
        idle.deadline = trio.current_time() + limits.connect_timeout + limits.idle_timeout
        outcome: Outcome | None = None
        # Filled once a 4xx/5xx status is seen: a stalled or broken error body must not hide
        # the rejection (its status and retry hints) behind a timeout or a disconnect.
        rejected: list[tuple[httpx.Response, bytearray]] = []
        rate_limits: list[RateLimits] = []
        with idle:
            try:
                with self._shards.client() as client:
                    outcome = await self._exchange(
                        client, request, state, idle, rejected, rate_limits, objects
                    )
            except httpx.ConnectTimeout as exc:
                code = classify_connect_error(exc, default="connect_timeout")
                outcome = state.interrupt(
                    "timeout" if code == "connect_timeout" else "disconnected", transport_code=code
                )
            except httpx.ConnectError as exc:
                code = classify_connect_error(exc)
                outcome = state.interrupt(
                    "timeout" if code == "connect_timeout" else "disconnected", transport_code=code
                )
            except httpx.RemoteProtocolError:
                outcome = state.interrupt("disconnected", transport_code="http_protocol_error")
            except httpx.ReadError:
                outcome = state.interrupt("disconnected", transport_code="read_error")
            except httpx.WriteError:
                outcome = state.interrupt("disconnected", transport_code="write_error")
            except httpx.TimeoutException:
                outcome = state.interrupt("timeout", transport_code="http_timeout")
            except httpx.TransportError:
                outcome = state.interrupt("disconnected", transport_code="transport_error")
        if rejected and (idle.cancelled_caught or not isinstance(outcome, Interruption)
                         or outcome.kind != "http_rejected"):
            response, partial = rejected[0]
            outcome = self._rejection(response, bytes(partial), state)
        elif idle.cancelled_caught:
            outcome = state.interrupt("timeout", transport_code="idle_timeout")
        assert outcome is not None
        if rate_limits:  # the HTTP response's x-ratelimit-* headers, for the rate governor
            outcome = msgspec.structs.replace(outcome, rate_limits=rate_limits[0])
        return outcome

    async def _exchange(
        self,
        client: httpx.AsyncClient,
        request: httpx.Request,
        state: ResponseStream,
        idle: trio.CancelScope,
        rejected: list[tuple[httpx.Response, bytearray]],
        rate_limits: list[RateLimits],
        objects: list[bytes] | None,
    ) -> Outcome:
        limits = self._limits
        response = await client.send(request, stream=True)
        seen = parse_rate_limit_headers(response.headers.multi_items())
        if seen is not None:
            rate_limits.append(seen)
        chunks = cast("AsyncGenerator[bytes, None]", response.aiter_raw())  # closed below
        try:
            if not 200 <= response.status_code < 300:
                body = bytearray()
                rejected.append((response, body))
                return await self._rejected(response, body, state)
            ctype = response.headers.get("content-type", "").lower()
            if objects is not None and ctype.startswith("application/json"):
                whole = await self._whole_body(response)
                if whole is None:
                    return state.interrupt("response_too_large",
                                           transport_code="frame_too_large")
                objects.append(whole)
                return state.interrupt("malformed", http_status=response.status_code,
                                       transport_code=RESPONSE_OBJECT)
            if not ctype.startswith("text/event-stream"):
                return state.interrupt(
                    "malformed", http_status=response.status_code,
                    transport_code="unexpected_content_type",
                )
            if response.headers.get("content-encoding", "identity").lower() != "identity":
                return state.interrupt(
                    "malformed", http_status=response.status_code,
                    transport_code="unexpected_content_encoding",
                )
            decoder = SseDecoder(limits.max_frame_bytes)
            total = 0
            timer = IdleTimer(idle, limits.idle_timeout)
            async for chunk in chunks:
                # Any bytes are a sign of life (``: ping`` comments during a long silent
                # stretch included); the total-bytes bound below still caps the stream.
                timer.touch()
                total += len(chunk)
                if total > limits.max_total_bytes:
                    return state.interrupt("response_too_large", transport_code="stream_too_large")
                try:
                    frames = decoder.feed(chunk)
                except FrameTooLarge:
                    return state.interrupt("response_too_large", transport_code="frame_too_large")
                for frame in frames:
                    if frame.data == b"[DONE]":
                        # A sentinel some servers add after the terminal event; before one,
                        # the stream simply ended without it.
                        return state.interrupt("premature_eof", transport_code="done_sentinel")
                    outcome = state.feed(frame.data, event_name=frame.event)
                    if outcome is not None:
                        await _drain_terminal(chunks, outcome)
                        return outcome
            return state.interrupt("premature_eof")
        finally:
            with trio.CancelScope(shield=True):
                await chunks.aclose()  # never left to the garbage collector (ResourceWarning)
                await response.aclose()
                _unbind(response)

    async def _rejected(
        self, response: httpx.Response, body: bytearray, state: ResponseStream
    ) -> Interruption:
        raw = cast("AsyncGenerator[bytes, None]", response.aiter_raw())
        async with contextlib.aclosing(raw) as chunks:
            async for chunk in chunks:
                body += chunk
                if len(body) > MAX_ERROR_BODY_BYTES:
                    break
        return self._rejection(response, bytes(body), state)

    @staticmethod
    def _rejection(response: httpx.Response, body: bytes, state: ResponseStream) -> Interruption:
        ptype, pcode = parse_error_body(body)
        return state.interrupt(
            "http_rejected",
            http_status=response.status_code,
            provider_type=ptype,
            provider_code=pcode,
            retry_after=parse_retry_after(response.headers.multi_items()),
        )
