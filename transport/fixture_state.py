"""The fixture provider's state: its script, faults, token bucket and request log.

Shared by its HTTP side (``fixture``) and its WebSocket side (``fixture_ws``): every
generation request is recorded here *before* any reply byte is sent, so a client killed
mid-stream is counted once. Also the reply pacing both sides use (prefix, keepalives,
stall).
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Literal

import attrs
import msgspec
import trio

from recoverable.errors import InvalidRequest
from recoverable.transport.base import token_fingerprint
from recoverable.transport.fixture_replies import FaultSpec, Reply, events_for
from recoverable.transport.ratelimit import estimate_tokens, format_duration

MAX_REQUEST_BYTES = 32 * 2**20
MAX_DELTAS = 100_000
RECV_BYTES = 65536


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


def redacted_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for raw_name, raw_value in raw:
        name = bytes(raw_name).decode("latin-1").lower()
        value = bytes(raw_value).decode("latin-1")
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
    return canonical_object(msgspec.json.decode(data))


def canonical_object(obj: object) -> tuple[bytes, dict[str, Any]]:
    """``canonical_body`` of an already decoded request (it is changed in place)."""
    if not isinstance(obj, dict):
        raise ValueError("request body is not a JSON object")
    obj.pop("type", None)
    obj.pop("stream", None)
    obj.pop(CLIENT_REQUEST_ID_FIELD, None)
    return msgspec.json.encode(obj, order="sorted"), obj


class ProviderState:
    """Script, faults, token bucket and request log of one fixture provider."""

    def __init__(
        self,
        *,
        faults: FaultSpec | None = None,
        reply_delay: float = 0.0,
        tpm_limit: int | None = None,
        rate_burst_seconds: float = 60.0,
        deltas: tuple[int, int] | None = None,
        ws_bind_model: bool = False,
    ) -> None:
        if not reply_delay >= 0.0:
            raise InvalidRequest("reply_delay must be >= 0 seconds")
        if tpm_limit is not None and (
            isinstance(tpm_limit, bool) or not isinstance(tpm_limit, int) or tpm_limit < 1
        ):
            raise InvalidRequest("tpm_limit must be a positive integer (tokens per minute)")
        if not 0.0 < rate_burst_seconds <= 3600.0:
            raise InvalidRequest("rate_burst_seconds must be in (0, 3600]")
        if deltas is not None and not (
            len(deltas) == 2
            and all(isinstance(delta, int) and not isinstance(delta, bool) for delta in deltas)
            and 1 <= deltas[0] <= deltas[1] <= MAX_DELTAS
        ):
            raise InvalidRequest(
                f"deltas must be (low, high) with 1 <= low <= high <= {MAX_DELTAS}"
            )
        if not isinstance(ws_bind_model, bool):
            raise InvalidRequest("ws_bind_model must be True or False")
        self.faults = faults
        # As the LiteLLM proxy does: a WebSocket connection is bound to the model of its
        # first ``response.create``, and a create for another model on it is answered
        # with a ``server_error`` event that never reaches the upstream.
        self.ws_bind_model = ws_bind_model
        # How many delta events a text answer is streamed in: None, four (the default
        # stream); else from ``low`` to ``high``, chosen per reply by its serial number.
        self.deltas = deltas
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
        deltas = None
        if self.deltas is not None:
            low, high = self.deltas
            deltas = low + self._serial % (high - low + 1)
        return events_for(reply, request, serial=self._serial, created_at=int(time.time()),
                          deltas=deltas)



def reply_prefix(reply: Reply, events: list[dict[str, Any]]) -> int:
    """How many of the events are sent before the reply's fault (all: no fault)."""
    if reply.kind in ("disconnect", "stall", "keepalive"):
        return min(reply.after_events or 0, len(events) - 1)
    if reply.disconnect_after is not None:
        return min(reply.disconnect_after, len(events) - 1)
    return len(events)


async def keepalives(reply: Reply, send: Callable[[], Awaitable[Any]]) -> None:
    """Silence for ``reply.pause`` seconds, broken only by a keepalive every ``every``."""
    assert reply.pause is not None and reply.every is not None
    end = trio.current_time() + reply.pause
    while True:
        await trio.sleep(min(reply.every, max(0.0, end - trio.current_time())))
        if trio.current_time() >= end:
            return
        await send()


async def until_peer_gone(stream: trio.SocketStream) -> None:
    """Read and drop until the peer closes (a stalled reply)."""
    try:
        while await stream.receive_some(RECV_BYTES):
            pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def sse_frame(event: Mapping[str, Any], *, with_event_line: bool = True) -> bytes:
    """One SSE frame of an event (``event:`` line, then ``data:``), as the real API sends."""
    data = b"data: " + msgspec.json.encode(event) + b"\n\n"
    if not with_event_line:
        return data
    return b"event: " + str(event["type"]).encode() + b"\n" + data


def lenient(event: dict[str, Any]) -> dict[str, Any]:
    """An event with the unknown top-level fields a lenient proxy adds."""
    return {**event, "provider_specific_fields": {"upstream": "fixture"}, "x_trace": "t-1"}

