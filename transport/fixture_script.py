"""Scripted replies of the fixture provider: ``Reply`` and the seeded ``FaultSpec``.

A ``Reply`` is a frozen value with a ``kind`` and a JSON-able spec
(``to_spec`` / ``from_spec``), so scripts can live in files. ``FaultSpec``
draws faults at seeded rates when no script is queued.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any, Literal, get_args

import attrs
import msgspec

from recoverable.errors import InvalidRequest

__all__ = ["HTTP_KINDS", "REPLY_KINDS", "FaultSpec", "Reply", "ReplyKind", "ResumeFault"]

ReplyKind = Literal[
    "complete",
    "synthesize",
    "disconnect",
    "stall",
    "http_error",
    "rate_limited",
    "quota_exceeded",
    "unauthorized",
    "forbidden",
    "failed",
    "incomplete",
    "invalid_json",
    "schema_violation",
    "tool_call",
    "refusal",
    "error_event",
    "keepalive",
    "lenient",
]
REPLY_KINDS: frozenset[str] = frozenset(get_args(ReplyKind))
# Kinds answered at the HTTP level (status + JSON error body); a refused WS handshake.
HTTP_KINDS: frozenset[str] = frozenset(
    {"http_error", "rate_limited", "quota_exceeded", "unauthorized", "forbidden"}
)

# The name of a header a scripted reply may send (``Reply.rate_limited(retry_after_header=)``).
_HEADER_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


@attrs.frozen
class Reply:
    """One scripted answer to one generation request. Build with the class methods."""

    kind: ReplyKind
    payload: Any = None
    after_events: int | None = None
    status: int | None = None
    body: Any = None
    headers: tuple[tuple[str, str], ...] = ()
    retry_after: float | None = None
    # ``rate_limited``: the one header the delay goes in instead of the standard pair, as a
    # proxy renames it (``llm_provider-retry-after``); milliseconds when it ends in ``-ms``.
    retry_after_header: str | None = None
    code: str | None = None
    reason: str | None = None
    text: str | None = None
    error_type: str | None = None
    pause: float | None = None
    every: float | None = None
    response_id: str | None = None
    framing: str | None = None
    usage: Any = None  # replaces the computed ``usage`` object of the terminal event
    # The connection drops after this many events while the response goes on (reattachment:
    # a background response that fails on the server after its client went away).
    disconnect_after: int | None = None

    # -- constructors ---------------------------------------------------------
    @classmethod
    def complete(cls, payload: Any, *, usage: Any = None) -> Reply:
        """Stream ``payload`` (JSON-encoded) as the output text, then ``response.completed``.

        Its ``usage`` is computed from the request and answer sizes, unless ``usage``
        gives the JSON value to send instead (to test malformed usage)."""
        msgspec.json.encode(payload)  # fail early for non-JSON payloads
        msgspec.json.encode(usage)
        return cls("complete", payload=payload, usage=usage)

    @classmethod
    def synthesize(cls) -> Reply:
        """Stream a deterministic schema-valid value for the request's schema."""
        return cls("synthesize")

    @classmethod
    def disconnect(cls, after_events: int = 3) -> Reply:
        """Send ``after_events`` events of a normal stream, then drop the TCP connection."""
        return cls("disconnect", after_events=_count(after_events))

    @classmethod
    def stall(cls, after_events: int = 2) -> Reply:
        """Send ``after_events`` events, then nothing until the client goes away."""
        return cls("stall", after_events=_count(after_events))

    @classmethod
    def http_error(
        cls,
        status: int,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        framing: str | None = None,
    ) -> Reply:
        """An HTTP rejection (WS: refused handshake) with ``status``, JSON ``body`` and headers.

        ``framing="sse"`` sends the body as one SSE ``data:`` frame with
        ``content-type: text/event-stream`` (as some proxies answer a non-2xx).
        """
        if not isinstance(status, int) or not 400 <= status <= 599:
            raise InvalidRequest("http_error status must be an int in 400..599")
        if framing not in (None, "sse"):
            raise InvalidRequest("http_error framing must be None or 'sse'")
        return cls(
            "http_error", status=status, body=body, headers=_headers(headers), framing=framing
        )

    @classmethod
    def rate_limited(
        cls, retry_after: float = 1.0, retry_after_header: str | None = None
    ) -> Reply:
        """429 ``rate_limit_exceeded`` with ``retry-after`` / ``retry-after-ms`` headers, or
        with only ``retry_after_header`` (e.g. ``"llm_provider-retry-after"``, as LiteLLM
        forwards an upstream's): milliseconds if its name ends in ``-ms``, else seconds."""
        if not isinstance(retry_after, int | float) or retry_after < 0:
            raise InvalidRequest("retry_after must be a non-negative number")
        if retry_after_header is not None and (
            not isinstance(retry_after_header, str)
            or not _HEADER_NAME.fullmatch(retry_after_header)
        ):
            raise InvalidRequest("retry_after_header must be a lowercase header name")
        return cls("rate_limited", retry_after=float(retry_after),
                   retry_after_header=retry_after_header)

    @classmethod
    def quota_exceeded(cls) -> Reply:
        """429 with error type ``insufficient_quota`` (permanent, not a rate limit)."""
        return cls("quota_exceeded")

    @classmethod
    def unauthorized(cls) -> Reply:
        return cls("unauthorized")

    @classmethod
    def forbidden(cls) -> Reply:
        return cls("forbidden")

    @classmethod
    def failed(
        cls, code: str = "server_error", after_events: int | None = None,
        disconnect_after: int | None = None,
    ) -> Reply:
        """``response.failed`` with ``response.error.code == code``.

        ``after_events``: the failure comes after that many events of a normal answer
        (output items and deltas; at least the two ``response.created``/``in_progress``),
        not right after ``response.in_progress``. ``disconnect_after``: the connection
        drops after that many events; a background response goes on failing on the server
        without its client (a plain stream is just cut there)."""
        return cls(
            "failed", code=_text(code, "code"),
            after_events=None if after_events is None else _count(after_events),
            disconnect_after=None if disconnect_after is None else _count(disconnect_after),
        )

    @classmethod
    def incomplete(cls, reason: str = "max_output_tokens") -> Reply:
        """Partial output, then ``response.incomplete`` with ``incomplete_details.reason``."""
        return cls("incomplete", reason=_text(reason, "reason"))

    @classmethod
    def invalid_json(cls) -> Reply:
        """``response.completed`` whose output text is not JSON."""
        return cls("invalid_json")

    @classmethod
    def schema_violation(cls) -> Reply:
        """``response.completed`` with valid JSON that breaks the request's schema."""
        return cls("schema_violation")

    @classmethod
    def tool_call(cls) -> Reply:
        """A ``function_call`` output item (the client must stop, never execute it)."""
        return cls("tool_call")

    @classmethod
    def refusal(cls, text: str = "I can't help with that.") -> Reply:
        """The model refuses: ``response.refusal.*`` events, then ``response.completed``."""
        return cls("refusal", text=_text(text, "text"))

    @classmethod
    def error_event(
        cls,
        error_type: str | None = None,
        code: str | None = None,
        status: int | None = None,
        after_events: int = 2,
    ) -> Reply:
        """``after_events`` events, then an ``error`` event
        ``{"type": "error", "error": {"type", "code", "message"}}`` (plus ``status`` when
        given, as the WebSocket mode wraps an HTTP error). No status and no code is how a
        proxy forwards an upstream 429 or 5xx over WebSocket."""
        if error_type is not None:
            _text(error_type, "error_type")
        if code is not None:
            _text(code, "code")
        if status is not None and (not isinstance(status, int) or not 400 <= status <= 599):
            raise InvalidRequest("error_event status must be an int in 400..599")
        return cls("error_event", error_type=error_type, code=code, status=status,
                   after_events=_count(after_events))

    @classmethod
    def keepalive(cls, pause: float, every: float, after_events: int = 2) -> Reply:
        """A normal stream that goes silent for ``pause`` seconds after ``after_events``
        events, sending only keepalives every ``every`` seconds (SSE ``: ping`` comments,
        WebSocket ping frames), then finishes."""
        for name, value in (("pause", pause), ("every", every)):
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise InvalidRequest(f"{name} must be a positive number")
        return cls("keepalive", pause=float(pause), every=float(every),
                   after_events=_count(after_events))

    @classmethod
    def lenient(cls, response_id: str | None = None) -> Reply:
        """A synthesized completion the way lenient third-party servers send it: unknown
        top-level fields on every event, SSE ``event:`` lines on some frames only,
        ``data: [DONE]`` after ``response.completed``, and (optionally) this response id."""
        if response_id is not None:
            _text(response_id, "response_id")
        return cls("lenient", response_id=response_id)

    # -- JSON specs -----------------------------------------------------------
    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"kind": self.kind}
        for field in attrs.fields(Reply):
            if field.name == "kind":
                continue
            value = getattr(self, field.name)
            if value != field.default:
                spec[field.name] = dict(value) if field.name == "headers" else value
        return spec

    @classmethod
    def from_spec(cls, spec: object) -> Reply:
        """Build (and validate) a reply from ``{"kind": ..., ...}``. Raises ``InvalidRequest``."""
        if not isinstance(spec, Mapping) or not isinstance(spec.get("kind"), str):
            raise InvalidRequest("a reply spec is an object with a string 'kind'")
        kind = spec["kind"]
        args = {key: value for key, value in spec.items() if key != "kind"}
        builders: dict[str, tuple[str, ...]] = {
            "complete": ("payload",),
            "synthesize": (),
            "disconnect": ("after_events",),
            "stall": ("after_events",),
            "http_error": ("status", "body", "headers", "framing"),
            "rate_limited": ("retry_after", "retry_after_header"),
            "quota_exceeded": (),
            "unauthorized": (),
            "forbidden": (),
            "failed": ("code", "after_events", "disconnect_after"),
            "incomplete": ("reason",),
            "invalid_json": (),
            "schema_violation": (),
            "tool_call": (),
            "refusal": ("text",),
            "error_event": ("error_type", "code", "status", "after_events"),
            "keepalive": ("pause", "every", "after_events"),
            "lenient": ("response_id",),
        }
        if kind not in builders:
            raise InvalidRequest(f"unknown reply kind {kind!r}")
        unknown = set(args) - set(builders[kind])
        if unknown:
            raise InvalidRequest(f"reply kind {kind!r} does not take {sorted(unknown)}")
        if kind == "complete" and "payload" not in args:
            raise InvalidRequest("reply kind 'complete' needs a 'payload'")
        if kind == "http_error" and "status" not in args:
            raise InvalidRequest("reply kind 'http_error' needs a 'status'")
        try:
            built: Reply = getattr(cls, kind)(**args)
        except (TypeError, ValueError, msgspec.EncodeError) as exc:
            raise InvalidRequest(f"bad reply spec for {kind!r}: {exc}") from None
        return built


def _count(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequest("after_events must be a non-negative integer")
    return value


def _text(value: object, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name} must be a non-empty string")
    return value


def _headers(headers: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    if headers is None:
        return ()
    if not isinstance(headers, Mapping) or not all(
        isinstance(name, str) and isinstance(value, str) for name, value in headers.items()
    ):
        raise InvalidRequest("headers must map strings to strings")
    return tuple(sorted(headers.items()))


# -- faults on the retrieval of a stored response (reattachment) ------------------------
ResumeFaultKind = Literal["not_found", "expired", "disconnect", "stall", "object"]
_RESUME_KINDS: frozenset[str] = frozenset(get_args(ResumeFaultKind))


@attrs.frozen
class ResumeFault:
    """One scripted fault for one ``GET /v1/responses/{id}`` (resume or retrieve).

    ``not_found``: this GET is answered 404 (the response stays stored); ``expired``: the
    response expires now (this GET and every later one is a 404); ``disconnect``: a resume
    stream drops after ``after_events`` events (a plain retrieve: the connection drops
    before the answer); ``stall``: a resume stream goes silent after ``after_events``
    events until the client goes away (a plain retrieve: no answer at all); ``object``: a
    resume GET is answered as a plain retrieve (``200 application/json``, the response
    object as it is now), as a server that drops ``stream`` and ``starting_after`` does
    (the LiteLLM proxy)."""

    kind: ResumeFaultKind
    after_events: int = 0

    @classmethod
    def not_found(cls) -> ResumeFault:
        return cls("not_found")

    @classmethod
    def expired(cls) -> ResumeFault:
        return cls("expired")

    @classmethod
    def disconnect(cls, after_events: int = 2) -> ResumeFault:
        return cls("disconnect", _count(after_events))

    @classmethod
    def stall(cls, after_events: int = 1) -> ResumeFault:
        return cls("stall", _count(after_events))

    @classmethod
    def as_object(cls) -> ResumeFault:
        return cls("object")

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"kind": self.kind}
        if self.kind in ("disconnect", "stall"):
            spec["after_events"] = self.after_events
        return spec

    @classmethod
    def from_spec(cls, spec: object) -> ResumeFault:
        """Build (and validate) from ``{"kind": ..., "after_events": ...}``; InvalidRequest."""
        if not isinstance(spec, Mapping) or spec.get("kind") not in _RESUME_KINDS:
            raise InvalidRequest(
                f"a resume fault spec is an object with 'kind' one of {sorted(_RESUME_KINDS)}"
            )
        kind = spec["kind"]
        unknown = set(spec) - {"kind", "after_events"}
        if kind in ("not_found", "expired") and "after_events" in spec:
            unknown.add("after_events")
        if unknown:
            raise InvalidRequest(f"resume fault {kind!r} does not take {sorted(unknown)}")
        if kind in ("disconnect", "stall"):
            after = spec.get("after_events", 2 if kind == "disconnect" else 1)
            return cls(kind, _count(after))
        return cls(kind)


# -- faults -------------------------------------------------------------------
_FAULT_DEFAULTS: dict[str, Reply] = {
    "disconnect": Reply.disconnect(3),
    "stall": Reply.stall(2),
    "rate_limited": Reply.rate_limited(0.2),
    "quota_exceeded": Reply.quota_exceeded(),
    "unauthorized": Reply.unauthorized(),
    "forbidden": Reply.forbidden(),
    "http_error": Reply.http_error(500),
    "server_error": Reply.http_error(500),
    "failed": Reply.failed("server_error"),
    "incomplete": Reply.incomplete("max_output_tokens"),
    "invalid_json": Reply.invalid_json(),
    "schema_violation": Reply.schema_violation(),
    "tool_call": Reply.tool_call(),
    "refusal": Reply.refusal(),
    # Reattachment: a background response whose client is cut off after 3 events and which
    # then fails on the server (its resume shows ``response.failed``).
    "failed_in_background": Reply.failed("server_error", after_events=6, disconnect_after=3),
}


# Retrieval faults: drawn for each GET of a stored response, by their own generator.
_RESUME_FAULT_DEFAULTS: dict[str, ResumeFault] = {
    "retrieve_404": ResumeFault.not_found(),
    "expired": ResumeFault.expired(),
    "resume_disconnect": ResumeFault.disconnect(2),
    "resume_stall": ResumeFault.stall(1),
}


@attrs.frozen
class FaultSpec:
    """Random faults at per-kind rates (0..1, summing to at most 1), from a seeded RNG."""

    rates: tuple[tuple[str, float], ...] = ()
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """``"disconnect=0.1,rate_limited=0.05,stall=0.01,seed=7"`` → FaultSpec."""
        if not isinstance(text, str):
            raise InvalidRequest("a fault spec is a string")
        rates: dict[str, float] = {}
        seed = 0
        for raw in text.split(","):
            item = raw.strip()
            if not item:
                continue
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep:
                raise InvalidRequest(f"fault spec item {item!r} is not name=value")
            if name == "seed":
                try:
                    seed = int(value)
                except ValueError:
                    raise InvalidRequest(f"fault seed must be an integer: {value!r}") from None
                continue
            if name not in _FAULT_DEFAULTS and name not in _RESUME_FAULT_DEFAULTS:
                known = sorted([*_FAULT_DEFAULTS, *_RESUME_FAULT_DEFAULTS])
                raise InvalidRequest(f"unknown fault {name!r}; known: {', '.join(known)}")
            try:
                rate = float(value)
            except ValueError:
                raise InvalidRequest(f"fault rate must be a number: {item!r}") from None
            if not 0.0 <= rate <= 1.0:
                raise InvalidRequest(f"fault rate must be within 0..1: {item!r}")
            rates[name] = rate
        if sum(rate for name, rate in rates.items() if name in _FAULT_DEFAULTS) > 1.0 + 1e-9:
            raise InvalidRequest("fault rates sum to more than 1")
        if sum(rate for name, rate in rates.items() if name in _RESUME_FAULT_DEFAULTS) > (
            1.0 + 1e-9
        ):
            raise InvalidRequest("the rates of the retrieval faults sum to more than 1")
        return cls(tuple(sorted(rates.items())), seed)

    def chooser(self) -> random.Random:
        return random.Random(self.seed)

    def pick(self, rng: random.Random) -> Reply | None:
        """The fault to inject for the next request, or None for a normal reply."""
        draw = rng.random()
        acc = 0.0
        for name, rate in self.rates:
            if name not in _FAULT_DEFAULTS:
                continue  # a retrieval fault (``pick_resume``)
            acc += rate
            if draw < acc:
                return _FAULT_DEFAULTS[name]
        return None

    def resume_chooser(self) -> random.Random:
        """The generator of the retrieval faults: its own, so that adding them to a spec
        leaves the draws of the generation faults as they were."""
        return random.Random(f"resume:{self.seed}")

    def pick_resume(self, rng: random.Random) -> ResumeFault | None:
        """The fault to inject for the next GET of a stored response, or None."""
        resume_rates = [(name, rate) for name, rate in self.rates
                        if name in _RESUME_FAULT_DEFAULTS]
        if not resume_rates:
            return None
        draw = rng.random()
        acc = 0.0
        for name, rate in resume_rates:
            acc += rate
            if draw < acc:
                return _RESUME_FAULT_DEFAULTS[name]
        return None


# -- schema synthesis -------------------------------------------------------------
# Bounds of a synthesized value: recursion follows the schema graph's well-founded order
# (so it always ends), and these keep a finite but huge value (e.g. an object whose two
# required properties each need the next level, 40 levels deep) from exhausting memory.
