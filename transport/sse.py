"""HTTP SSE transport: ``POST {base_url}/responses`` with ``"stream": true`` (httpx on Trio)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import cast

import httpx
import trio
from recoverable.transport.base import (
    MAX_ERROR_BODY_BYTES,
    StreamLimits,
    parse_error_body,
    parse_retry_after,
)
from recoverable.transport.events import FrameTooLarge, ResponseStream, SseDecoder
from recoverable.transport.outcome import Completed, Interruption, Outcome, Progress

__all__ = ["SseTransport", "add_field"]


def add_field(body: bytes, field: bytes) -> bytes:
    """Insert ``field`` (``b'"k":v'``) as the first member of the JSON object ``body``."""
    if not body.startswith(b"{") or not body.endswith(b"}"):
        raise ValueError("the frozen request body must be a JSON object")
    inner = body[1:-1].strip()
    return b"{" + field + (b"," + inner if inner else b"") + b"}"


# After ``response.completed`` the body normally ends at once. Reading that end lets
# httpx's own stream generators finish (no ResourceWarning) and keeps the connection
# for reuse; a server that keeps the body open is cut off after this much.
DRAIN_GRACE_SECONDS = 1.0
DRAIN_MAX_BYTES = 64 * 1024


async def _drain_completed(chunks: AsyncGenerator[bytes, None], outcome: Outcome) -> None:
    if not isinstance(outcome, Completed):
        return
    total = 0
    # Shielded and short: the completion is in hand, and no idle timeout, suspend or
    # cancel may turn it into an interruption while the (normally empty) rest is read.
    with trio.CancelScope(deadline=trio.current_time() + DRAIN_GRACE_SECONDS, shield=True):
        try:
            async for chunk in chunks:
                total += len(chunk)
                if total > DRAIN_MAX_BYTES:
                    return
        except httpx.TransportError:
            return  # the completion is already in hand


class SseTransport:
    def __init__(self, base_url: str, *, limits: StreamLimits, max_connections: int) -> None:
        self.url = base_url.rstrip("/") + "/responses"
        self._limits = limits
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=30.0,
            ),
            # Connect is bounded here; idle time is bounded per event by our own scope.
            timeout=httpx.Timeout(connect=limits.connect_timeout, read=None, write=None, pool=None),
            follow_redirects=False,
            trust_env=False,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def stream(
        self,
        body: bytes,
        *,
        attempt_id: str,
        token: str,
        on_progress: Callable[[Progress], None] | None,
    ) -> Outcome:
        limits = self._limits
        state = ResponseStream(max_events=limits.max_events, on_progress=on_progress)
        content = add_field(body, b'"stream":true')
        headers = {
            "authorization": f"Bearer {token}",
            "x-client-request-id": attempt_id,
            "content-type": "application/json",
            "accept": "text/event-stream",
            # Raw bytes only: a compressed stream could expand past every bound in one chunk.
            "accept-encoding": "identity",
        }
        request = self._client.build_request("POST", self.url, content=content, headers=headers)
        idle = trio.CancelScope()
        # The first event must arrive within connect + idle; afterwards idle per event.
        idle.deadline = trio.current_time() + limits.connect_timeout + limits.idle_timeout
        outcome: Outcome | None = None
        with idle:
            try:
                outcome = await self._exchange(request, state, idle)
            except httpx.ConnectTimeout:
                outcome = state.interrupt("timeout", transport_code="connect_timeout")
            except httpx.ConnectError:
                outcome = state.interrupt("disconnected", transport_code="connect_failed")
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
        if idle.cancelled_caught:
            return state.interrupt("timeout", transport_code="idle_timeout")
        assert outcome is not None
        return outcome

    async def _exchange(
        self, request: httpx.Request, state: ResponseStream, idle: trio.CancelScope
    ) -> Outcome:
        limits = self._limits
        response = await self._client.send(request, stream=True)
        chunks = cast("AsyncGenerator[bytes, None]", response.aiter_raw())  # closed below
        try:
            if not 200 <= response.status_code < 300:
                return await self._rejected(response, state)
            ctype = response.headers.get("content-type", "")
            if not ctype.lower().startswith("text/event-stream"):
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
            async for chunk in chunks:
                total += len(chunk)
                if total > limits.max_total_bytes:
                    return state.interrupt("malformed", transport_code="stream_too_large")
                try:
                    frames = decoder.feed(chunk)
                except FrameTooLarge:
                    return state.interrupt("malformed", transport_code="frame_too_large")
                for frame in frames:
                    outcome = state.feed(frame.data)
                    if outcome is not None:
                        await _drain_completed(chunks, outcome)
                        return outcome
                    idle.deadline = trio.current_time() + limits.idle_timeout
            return state.interrupt("premature_eof")
        finally:
            with trio.CancelScope(shield=True):
                await chunks.aclose()  # never left to the garbage collector (ResourceWarning)
                await response.aclose()

    async def _rejected(self, response: httpx.Response, state: ResponseStream) -> Interruption:
        body = bytearray()
        raw = cast("AsyncGenerator[bytes, None]", response.aiter_raw())
        async with contextlib.aclosing(raw) as chunks:
            async for chunk in chunks:
                body += chunk
                if len(body) > MAX_ERROR_BODY_BYTES:
                    break
        ptype, pcode = parse_error_body(bytes(body))
        return state.interrupt(
            "http_rejected",
            http_status=response.status_code,
            provider_type=ptype,
            provider_code=pcode,
            retry_after=parse_retry_after(response.headers.multi_items()),
        )
