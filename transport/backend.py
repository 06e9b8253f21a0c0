"""``ResponsesBackend``: the one object the rest of the library streams through."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Literal

import trio
from recoverable.transport.base import Credentials, StreamLimits, normalize_base_url
from recoverable.transport.outcome import Outcome, Progress
from recoverable.transport.sse import SseTransport
from recoverable.transport.websocket import WebSocketTransport

from recoverable.errors import InvalidRequest

__all__ = ["ResponsesBackend"]

Mode = Literal["websocket", "sse"]


class ResponsesBackend:
    """Streams one frozen create body per call and returns how it ended.

    ``stream`` never raises for provider or transport problems: it returns
    ``Completed`` or a typed ``Interruption``. It raises ``trio.Cancelled``
    (the connection is closed, never reused) and ``InvalidRequest`` for a body
    that is not a JSON object.

    ``before_send`` (optional) runs once the connection is established and before
    the request is written; when no connection could be established it is never
    called, and the interruption's ``transport_code`` is one of
    ``transport.connect.CONNECT_CODES`` (nothing was sent). The runtime keeps
    one shared connect backoff per endpoint (``transport.connect.EndpointGate``).

    Use it as ``async with backend:`` to reuse WebSocket connections (a pool
    keyed by URL and token fingerprint); outside that, each WebSocket stream
    opens its own connection. SSE always reuses HTTP connections.
    """

    def __init__(
        self,
        base_url: str,
        *,
        credentials: Credentials,
        mode: Mode = "websocket",
        limits: StreamLimits = StreamLimits(),
        endpoint_id: str | None = None,
        max_connections: int = 2048,
    ) -> None:
        if mode not in ("websocket", "sse"):
            raise InvalidRequest(f"mode must be 'websocket' or 'sse', got {mode!r}")
        if not isinstance(max_connections, int) or max_connections <= 0:
            raise InvalidRequest("max_connections must be a positive integer")
        if not isinstance(limits, StreamLimits):
            raise InvalidRequest("limits must be a StreamLimits")

        normalized = normalize_base_url(base_url)
        self.base_url = normalized
        self.endpoint_id: str = endpoint_id if endpoint_id is not None else normalized
        self.credentials: Credentials = credentials
        self.mode: str = mode
        self.limits = limits
        self._slots = trio.Semaphore(max_connections)
        self._transport: WebSocketTransport | SseTransport
        if mode == "websocket":
            self._transport = WebSocketTransport(
                normalized, limits=limits, max_connections=max_connections
            )
        else:
            self._transport = SseTransport(
                normalized, limits=limits, max_connections=max_connections
            )
        self._stack: contextlib.AsyncExitStack | None = None

    def __repr__(self) -> str:
        return f"ResponsesBackend({self.base_url!r}, mode={self.mode!r})"

    async def stream(
        self,
        body: bytes,
        *,
        attempt_id: str,
        token: str,
        on_progress: Callable[[Progress], None] | None = None,
        before_send: Callable[[], Awaitable[None]] | None = None,
    ) -> Outcome:
        if not isinstance(body, bytes) or not body.startswith(b"{") or not body.endswith(b"}"):
            raise InvalidRequest("body must be the canonical JSON object bytes")
        if not attempt_id or not isinstance(attempt_id, str):
            raise InvalidRequest("attempt_id must be a non-empty string")
        if not isinstance(token, str) or not token:
            raise InvalidRequest("token must be a non-empty string")
        async with self._slots:
            return await self._transport.stream(
                body, attempt_id=attempt_id, token=token, on_progress=on_progress,
                before_send=before_send,
            )

    async def __aenter__(self) -> ResponsesBackend:
        if self._stack is not None:
            raise RuntimeError("ResponsesBackend is already entered")
        stack = contextlib.AsyncExitStack()
        nursery = await stack.enter_async_context(trio.open_nursery())
        self._stack = stack
        if isinstance(self._transport, WebSocketTransport):
            self._transport.attach(nursery)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        try:
            await self.aclose()
        finally:
            if isinstance(self._transport, WebSocketTransport):
                self._transport.attach(None)
            if stack is not None:
                # The nursery only holds connection keepers, which never raise once
                # started; the body's own exception is not handed to it (so it is not
                # wrapped into an ExceptionGroup).
                await stack.aclose()

    async def aclose(self) -> None:
        """Close pooled connections; idempotent. Streams still running finish on their own."""
        await self._transport.aclose()
