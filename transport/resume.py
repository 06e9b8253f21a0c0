"""Background responses over HTTP (reattachment): create, resume, retrieve and cancel by id.

A body frozen with ``reattach=True`` carries ``"background": true, "store": true``; the
provider keeps generating it when the client goes away and keeps it retrievable for a
limited time. ``ReattachClient`` speaks the wire contract of
``/work/shared/design/responses-protocol.md`` ("Background responses"):

- ``stream``: ``POST /responses`` (SSE), as ``SseTransport.stream``;
- ``resume``: ``GET /responses/{id}?stream=true&starting_after=N``, the rest of the event
  stream (events at or below ``N`` are skipped if a server repeats them); a server that
  answers it with the response object (``200 application/json``: it dropped ``stream``)
  is read as a retrieve, and polled while the response is still running;
- ``retrieve``: ``GET /responses/{id}``, the response object and its ``status``;
- ``cancel``: ``POST /responses/{id}/cancel``, best effort.

Over a WebSocket backend (background mode is not available over WebSocket) the same
client uses an HTTP SSE transport of the same base URL, made on first use. Like
``stream``, nothing here raises for a provider or transport problem: a typed
``Interruption`` comes back. A response that is gone (404/410) or cancelled on the
server is ``reattach_unavailable``; a GET the server refused otherwise (401, 429, 5xx)
or a dropped connection is ``disconnected`` (the resume may be tried again, bounded by
the caller). Nothing is fabricated from partial events: a resumed stream whose final
event has no output is completed only from the retrieved response object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Literal, Unpack
from urllib.parse import quote

import httpx
import msgspec
import trio

from recoverable.outcome import Interruption, Outcome, Progress
from recoverable.transport.base import StreamLimits, StreamOptions
from recoverable.transport.connect import classify_connect_error
from recoverable.transport.events import RESUMED_WITHOUT_OUTPUT, ResponseStream
from recoverable.transport.sse import SseTransport

__all__ = ["CancelResult", "ReattachClient"]

# What ``cancel`` saw: the response is cancelled (now or before), it had already ended
# (completed/failed/incomplete: left as it is), it is gone (404), or the request failed.
CancelResult = Literal["cancelled", "ended", "gone", "failed"]

_GONE: Final = frozenset({404, 410})
# A response still running when read as an object (a server that answers a resume GET
# with the response object): retrieved again after POLL_FIRST seconds, doubling up to
# POLL_MOST, for at most POLL_FOR_AT_MOST seconds per resume try.
POLL_FIRST: Final = 0.5
POLL_MOST: Final = 5.0
POLL_FOR_AT_MOST: Final = 900.0
_RUNNING: Final = frozenset({"queued", "in_progress"})


def _gone(response_id: str, status: int | None, code: str) -> Interruption:
    return Interruption(kind="reattach_unavailable", http_status=status, transport_code=code,
                        response_id=response_id)


class ReattachClient:
    """Background responses of one backend, over HTTP SSE (see the module docstring)."""

    def __init__(
        self,
        base_url: str,
        *,
        limits: StreamLimits,
        http: SseTransport | None,
        max_connections: int,
        slots: trio.Semaphore,
    ) -> None:
        self._base = base_url.rstrip("/")
        self._limits = limits
        self._http = http
        self._owned = http is None  # made here on first use (a WebSocket backend)
        self._max_connections = max_connections
        self._slots = slots

    def _transport(self) -> SseTransport:
        if self._http is None:
            self._http = SseTransport(
                self._base, limits=self._limits, max_connections=self._max_connections
            )
        return self._http

    def _url(self, response_id: str, suffix: str = "") -> str:
        return f"{self._base}/responses/{quote(response_id, safe='')}{suffix}"

    async def aclose(self) -> None:
        if self._owned and self._http is not None:
            await self._http.aclose()

    async def stream(self, body: bytes, **options: Unpack[StreamOptions]) -> Outcome:
        """``POST /responses`` of a background body, streamed (``SseTransport.stream``)."""
        async with self._slots:
            return await self._transport().stream(body, **options)

    async def resume(
        self,
        response_id: str,
        *,
        after: int | None,
        attempt_id: str,
        token: str,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> Outcome:
        """The rest of the response's event stream after sequence number ``after`` (all of
        it when ``None``), to its terminal event; bounded like any stream."""
        http = self._transport()
        params = {"stream": "true"}
        if after is not None:
            params["starting_after"] = str(after)
        state = ResponseStream(
            max_events=self._limits.max_events, on_progress=on_progress,
            resume_after=after, response_id=response_id,
        )
        request = http.request("GET", self._url(response_id), token=token,
                               attempt_id=attempt_id, params=params, stream=True)
        objects: list[bytes] = []
        async with self._slots:
            outcome = await http.exchange(request, state, objects)
        if objects:  # answered as a retrieve: the response object, not its events
            return await self._poll(
                response_id, self._read(response_id, 200, objects[0]),
                attempt_id=attempt_id, token=token,
            )
        if isinstance(outcome, Interruption):
            if outcome.kind == "http_rejected" and state.events == 0:
                # The GET itself was answered with an error status (no event was read).
                return self._refused(response_id, outcome.http_status, after)
            if outcome.transport_code == RESUMED_WITHOUT_OUTPUT:
                final = await self.retrieve(response_id, attempt_id=attempt_id, token=token)
                return final if final is not None else outcome
        return outcome

    @staticmethod
    def _refused(response_id: str, status: int | None, after: int | None) -> Interruption:
        if status in _GONE:
            return _gone(response_id, status, "response_gone")
        return Interruption(kind="disconnected", transport_code=f"resume_http_{status}",
                            response_id=response_id, sequence_number=after)

    async def retrieve(self, response_id: str, *, attempt_id: str, token: str) -> Outcome | None:
        """The response's final state: ``Completed`` or a typed ``Interruption``; ``None``
        while it is still queued or in progress. One bounded GET."""
        http = self._transport()
        request = http.request("GET", self._url(response_id), token=token, attempt_id=attempt_id)
        fetched = await self._fetch(http, request)
        if isinstance(fetched, Interruption):
            return fetched
        return self._read(response_id, *fetched)

    async def _poll(
        self, response_id: str, final: Outcome | None, *, attempt_id: str, token: str
    ) -> Outcome:
        """A response object that says the response is still running (``final`` None):
        retrieve it again, spaced ``POLL_FIRST`` doubling to ``POLL_MOST`` seconds, until
        it ended, for at most ``POLL_FOR_AT_MOST`` seconds (then a ``timeout``: the
        caller's bound of resume tries decides). Every enclosing bound (the lease, the
        attempt's hard timeout, a suspend or cancel) cuts it as it cuts a stream."""
        delay = POLL_FIRST
        with trio.move_on_after(POLL_FOR_AT_MOST):
            while final is None:
                await trio.sleep(delay)
                delay = min(POLL_MOST, delay * 2)
                final = await self.retrieve(response_id, attempt_id=attempt_id, token=token)
            return final
        return Interruption(kind="timeout", transport_code="poll_timeout",
                            response_id=response_id)

    def _read(self, response_id: str, status: int, body: bytes | None) -> Outcome | None:
        """An answered retrieve (status, whole body) as ``retrieve`` returns it."""
        if status in _GONE:
            return _gone(response_id, status, "response_gone")
        if not 200 <= status < 300:
            return self._refused(response_id, status, None)
        if body is None:
            return Interruption(kind="response_too_large", transport_code="frame_too_large",
                                response_id=response_id)
        try:
            obj = msgspec.json.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError):
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("status"), str):
            return Interruption(kind="malformed", transport_code="bad_response_object",
                                response_id=response_id)
        return final_state(response_id, obj, self._limits.max_events)

    async def cancel(self, response_id: str, *, token: str) -> CancelResult:
        """``POST /responses/{id}/cancel``, best effort and bounded; never raises."""
        http = self._transport()
        request = http.request("POST", self._url(response_id, "/cancel"), token=token)
        fetched = await self._fetch(http, request)
        if isinstance(fetched, Interruption):
            return "failed"
        status, body = fetched
        if status in _GONE:
            return "gone"
        if not 200 <= status < 300 or body is None:
            return "failed"
        try:
            obj = msgspec.json.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError):
            return "failed"
        state = obj.get("status") if isinstance(obj, dict) else None
        if state == "cancelled":
            return "cancelled"
        return "ended" if state in ("completed", "failed", "incomplete") else "failed"

    async def _fetch(
        self, http: SseTransport, request: httpx.Request
    ) -> tuple[int, bytes | None] | Interruption:
        limits = self._limits
        # One GET or POST: bounded like the first event of a stream (connect + idle).
        with trio.move_on_after(limits.connect_timeout + limits.idle_timeout):
            try:
                async with self._slots:
                    return await http.fetch(request)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # Never connected (nothing was asked): a connect code, as a stream's.
                code = classify_connect_error(exc, default=(
                    "connect_timeout" if isinstance(exc, httpx.ConnectTimeout)
                    else "connect_failed"))
                return Interruption(
                    kind="timeout" if code == "connect_timeout" else "disconnected",
                    transport_code=code,
                )
            except httpx.TimeoutException:
                return Interruption(kind="timeout", transport_code="http_timeout")
            except httpx.TransportError:
                return Interruption(kind="disconnected", transport_code="transport_error")
        return Interruption(kind="timeout", transport_code="idle_timeout")


def final_state(response_id: str, obj: dict[str, Any], max_events: int) -> Outcome | None:
    """A retrieved response object as an outcome (``None`` while it is still running).

    ``completed``, ``failed`` and ``incomplete`` are read exactly as the stream's terminal
    events of the same name (the completion only from the object's own ``output``);
    ``cancelled`` on the server is ``reattach_unavailable`` (code ``cancelled``).
    """
    status = obj.get("status")
    if status in _RUNNING:
        return None
    if status == "cancelled":
        return Interruption(kind="reattach_unavailable", provider_code="cancelled",
                            response_id=response_id)
    if status not in ("completed", "failed", "incomplete"):
        return Interruption(kind="malformed", transport_code="unknown_response_status",
                            response_id=response_id)
    # ``resume_after=-1``: none of its events was seen here, so no delta may complete it.
    state = ResponseStream(max_events=max_events, resume_after=-1, response_id=response_id)
    outcome = state.feed(msgspec.json.encode({"type": f"response.{status}", "response": obj}))
    assert outcome is not None  # a terminal event always ends the stream
    return outcome
