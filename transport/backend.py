"""``ResponsesBackend``: the one object the rest of the library streams through."""

from __future__ import annotations

import contextlib
from typing import Unpack
from urllib.parse import urlsplit

import trio

from recoverable.errors import InvalidRequest
from recoverable.outcome import Outcome
from recoverable.transport.base import (
    Credentials,
    StreamLimits,
    StreamOptions,
    Transport,
    normalize_base_url,
)
from recoverable.transport.modes import DEFAULT_MODE, TRANSPORTS, Mode, mode_problem
from recoverable.transport.resume import ReattachClient
from recoverable.transport.sse import SseTransport

__all__ = ["ResponsesBackend", "check_base_url", "endpoint_identity"]

MAX_LABEL_CHARS = 256


def check_base_url(base_url: str) -> str:
    """The normalized HTTP(S) base URL (``.../v1``), the same for both modes.

    A ``ws://``/``wss://`` URL, or a URL naming the ``/responses`` endpoint itself,
    raises ``InvalidRequest`` here: the WebSocket URL is derived from the HTTP base,
    and either mistake would otherwise be found only by a rejected attempt.
    """
    if isinstance(base_url, str) and urlsplit(base_url.strip()).scheme.lower() in ("ws", "wss"):
        raise InvalidRequest(
            "base_url must be the HTTP(S) base URL (for example https://api.openai.com/v1) "
            "in both modes; the WebSocket URL is derived from it. Got a ws(s):// URL"
        )
    normalized = normalize_base_url(base_url)
    if normalized.rstrip("/").endswith("/responses"):
        raise InvalidRequest(
            "base_url is the API base (for example https://api.openai.com/v1), "
            "not its /responses endpoint"
        )
    return normalized


def endpoint_identity(normalized_base_url: str, label: str | None) -> str:
    """The endpoint identity saved with every operation and compared on reopening.

    By default the normalized base URL. A custom ``label`` (for a base URL whose port
    or path changes while it stays the same service, like the fixture provider's
    port) is bound to the URL's host as ``label@host``, so a host change is still
    caught whatever the label says.
    """
    if label is None:
        return normalized_base_url
    if (
        not isinstance(label, str)
        or not label
        or len(label) > MAX_LABEL_CHARS
        or "@" in label
        or "://" in label
        or "\0" in label
    ):
        raise InvalidRequest(
            f"endpoint_id must be a non-empty label of at most {MAX_LABEL_CHARS} characters "
            "without '@', '://' or NUL"
        )
    host = urlsplit(normalized_base_url).hostname or ""
    return f"{label}@{host}"


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
    keyed by URL, token fingerprint and model); outside that, each WebSocket stream
    opens its own connection. SSE always reuses HTTP connections.

    ``base_url`` is the HTTP(S) API base (``.../v1``) in both modes; a ``ws(s)://``
    URL is refused at construction (``check_base_url``). ``endpoint_id`` defaults
    to the normalized base URL; a custom label is saved as ``label@host``
    (``endpoint_identity``).
    """

    def __init__(
        self,
        base_url: str,
        *,
        credentials: Credentials,
        mode: Mode = DEFAULT_MODE,
        limits: StreamLimits = StreamLimits(),
        endpoint_id: str | None = None,
        max_connections: int = 2048,
    ) -> None:
        problem = mode_problem(mode)
        if problem is not None:
            raise InvalidRequest(problem)
        if not isinstance(max_connections, int) or max_connections <= 0:
            raise InvalidRequest("max_connections must be a positive integer")
        if not isinstance(limits, StreamLimits):
            raise InvalidRequest("limits must be a StreamLimits")
        normalized = check_base_url(base_url)
        self.base_url = normalized
        self.endpoint_id: str = endpoint_identity(normalized, endpoint_id)
        self.credentials: Credentials = credentials
        self.mode: str = mode
        self.limits = limits
        self._slots = trio.Semaphore(max_connections)
        self._transport: Transport = TRANSPORTS[mode](
            normalized, limits=limits, max_connections=max_connections
        )
        self._stack: contextlib.AsyncExitStack | None = None
        # Reattachment: background responses (``prepare(..., reattach=True)``) always go over
        # HTTP SSE: the SSE transport itself, or (WebSocket mode, where background mode is
        # not available) one of the same base URL made on first use.
        self.reattachment = ReattachClient(
            normalized, limits=limits, max_connections=max_connections, slots=self._slots,
            http=self._transport if isinstance(self._transport, SseTransport) else None,
        )

    def __repr__(self) -> str:
        return f"ResponsesBackend({self.base_url!r}, mode={self.mode!r})"

    async def stream(self, body: bytes, **options: Unpack[StreamOptions]) -> Outcome:
        """Stream ``body`` over this backend's transport (``StreamOptions``: the keywords)."""
        if not isinstance(body, bytes) or not body.startswith(b"{") or not body.endswith(b"}"):
            raise InvalidRequest("body must be the canonical JSON object bytes")
        attempt_id = options.get("attempt_id")
        if not attempt_id or not isinstance(attempt_id, str):
            raise InvalidRequest("attempt_id must be a non-empty string")
        token = options.get("token")
        if not isinstance(token, str) or not token:
            raise InvalidRequest("token must be a non-empty string")
        async with self._slots:
            return await self._transport.stream(body, **options)

    async def __aenter__(self) -> ResponsesBackend:
        if self._stack is not None:
            raise RuntimeError("ResponsesBackend is already entered")
        stack = contextlib.AsyncExitStack()
        nursery = await stack.enter_async_context(trio.open_nursery())
        self._stack = stack
        self._transport.attach(nursery)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        stack, self._stack = self._stack, None
        try:
            await self.aclose()
        finally:
            self._transport.attach(None)
            if stack is not None:
                # The nursery only holds connection keepers, which never raise once
                # started; the body's own exception is not handed to it (so it is not
                # wrapped into an ExceptionGroup).
                await stack.aclose()

    async def aclose(self) -> None:
        """Close pooled connections; idempotent. Streams still running finish on their own."""
        await self._transport.aclose()
        await self.reattachment.aclose()
