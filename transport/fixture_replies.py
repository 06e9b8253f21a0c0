"""Scripted replies of the fixture provider, and the real-API event streams they become.

A ``Reply`` is a frozen value with a ``kind`` and a JSON-able spec
(``to_spec`` / ``from_spec``), so scripts can live in files. ``FaultSpec``
draws faults at seeded rates when no script is queued. ``synthesize_value``
makes a deterministic schema-valid value for a request's ``text.format.schema``.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Literal, get_args

import attrs
import jsonschema_rs
import msgspec

from recoverable.errors import InvalidRequest
from recoverable.schema_graph import (
    SchemaGraph,
    min_items,
    required_names,
    resolve_pointer,
    type_names,
)

__all__ = [
    "HTTP_KINDS",
    "CannotSynthesize",
    "FaultSpec",
    "HttpRejection",
    "Reply",
    "ReplyKind",
    "events_for",
    "http_rejection",
    "schema_rejection",
    "synthesize_value",
]

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
    code: str | None = None
    reason: str | None = None
    text: str | None = None
    error_type: str | None = None
    pause: float | None = None
    every: float | None = None
    response_id: str | None = None
    framing: str | None = None
    usage: Any = None  # replaces the computed ``usage`` object of the terminal event

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
    def rate_limited(cls, retry_after: float = 1.0) -> Reply:
        """429 ``rate_limit_exceeded`` with ``retry-after`` / ``retry-after-ms`` headers."""
        if not isinstance(retry_after, int | float) or retry_after < 0:
            raise InvalidRequest("retry_after must be a non-negative number")
        return cls("rate_limited", retry_after=float(retry_after))

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
    def failed(cls, code: str = "server_error") -> Reply:
        """``response.failed`` with ``response.error.code == code``."""
        return cls("failed", code=_text(code, "code"))

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
        args = {k: v for k, v in spec.items() if k != "kind"}
        builders: dict[str, tuple[str, ...]] = {
            "complete": ("payload",),
            "synthesize": (),
            "disconnect": ("after_events",),
            "stall": ("after_events",),
            "http_error": ("status", "body", "headers", "framing"),
            "rate_limited": ("retry_after",),
            "quota_exceeded": (),
            "unauthorized": (),
            "forbidden": (),
            "failed": ("code",),
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
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise InvalidRequest("headers must map strings to strings")
    return tuple(sorted(headers.items()))


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
            if name not in _FAULT_DEFAULTS:
                raise InvalidRequest(
                    f"unknown fault {name!r}; known: {', '.join(sorted(_FAULT_DEFAULTS))}"
                )
            try:
                rate = float(value)
            except ValueError:
                raise InvalidRequest(f"fault rate must be a number: {item!r}") from None
            if not 0.0 <= rate <= 1.0:
                raise InvalidRequest(f"fault rate must be within 0..1: {item!r}")
            rates[name] = rate
        if sum(rates.values()) > 1.0 + 1e-9:
            raise InvalidRequest("fault rates sum to more than 1")
        return cls(tuple(sorted(rates.items())), seed)

    def chooser(self) -> random.Random:
        return random.Random(self.seed)

    def pick(self, rng: random.Random) -> Reply | None:
        """The fault to inject for the next request, or None for a normal reply."""
        draw = rng.random()
        acc = 0.0
        for name, rate in self.rates:
            acc += rate
            if draw < acc:
                return _FAULT_DEFAULTS[name]
        return None


# -- schema synthesis -------------------------------------------------------------
# Bounds of a synthesized value: recursion follows the schema graph's well-founded order
# (so it always ends), and these keep a finite but huge value (e.g. an object whose two
# required properties each need the next level, 40 levels deep) from exhausting memory.
MAX_SYNTH_DEPTH = 128
MAX_SYNTH_VALUES = 100_000
_GRAPHS_SIZE = 64


class CannotSynthesize(InvalidRequest):
    """The fixture cannot build a value for this schema (none exists, or it is too large).

    The fixture answers such a request as the real API answers an unusable schema:
    HTTP 400 ``invalid_request_error`` with code ``invalid_json_schema``.
    """

    code = "cannot_synthesize"


class _Analysis:
    """A private copy of a schema, its graph and its compiled validator (cached by bytes)."""

    def __init__(self, schema_bytes: bytes) -> None:
        self.root: Any = msgspec.json.decode(schema_bytes)
        self.graph = SchemaGraph(self.root)
        try:
            self.validator: Any = jsonschema_rs.Draft202012Validator(self.root, offline=True)
        except (ValueError, TypeError, OverflowError):
            self.validator = None


_analyses: OrderedDict[bytes, _Analysis] = OrderedDict()


def _analysis(schema: Any) -> _Analysis:
    try:
        key = msgspec.json.encode(schema, order="sorted")
    except (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError):
        raise CannotSynthesize("the schema is not JSON") from None
    found = _analyses.get(key)
    if found is None:
        found = _Analysis(key)
        _analyses[key] = found
        while len(_analyses) > _GRAPHS_SIZE:
            _analyses.popitem(last=False)
    else:
        _analyses.move_to_end(key)
    return found


def synthesize_value(schema: Any) -> Any:
    """A deterministic value valid for ``schema``, or ``CannotSynthesize``.

    Bounded: it follows only branches known to end (see ``recoverable.schema_graph``),
    stops at ``MAX_SYNTH_DEPTH`` nesting or ``MAX_SYNTH_VALUES`` values, and checks the
    result against the schema (constraints it does not model are reported, not sent).
    """
    if schema is True or not isinstance(schema, Mapping):
        return {}
    analysis = _analysis(schema)
    reason = analysis.graph.no_finite_instance()
    if reason is not None:
        raise CannotSynthesize(reason)
    value = _Synthesizer(analysis.graph).value(analysis.root, analysis.graph.order(analysis.root))
    if analysis.validator is None:
        raise CannotSynthesize("the schema is not a valid JSON Schema")
    if not analysis.validator.is_valid(value):
        raise CannotSynthesize(
            "the fixture's synthesized value does not satisfy the schema "
            "(constraints it cannot meet, or that no value meets)"
        )
    return value


class _Synthesizer:
    def __init__(self, graph: SchemaGraph) -> None:
        self.graph = graph
        self.values = 0

    def _safe(self, schema: Any, bound: int | None) -> bool:
        """Whether ``schema`` is inhabited before ``bound`` (so recursion into it ends)."""
        order = self.graph.order(schema)
        return order is not None and (bound is None or order < bound)

    def _child(self, schema: Any, depth: int) -> Any:
        if depth > MAX_SYNTH_DEPTH:
            raise CannotSynthesize(
                f"the smallest value of the schema nests deeper than {MAX_SYNTH_DEPTH}"
            )
        return self.value(schema, self.graph.order(schema), depth)

    def value(self, schema: Any, bound: int | None, depth: int = 0) -> Any:
        self.values += 1
        if self.values > MAX_SYNTH_VALUES:
            raise CannotSynthesize(
                f"the smallest value of the schema has more than {MAX_SYNTH_VALUES} parts"
            )
        if schema is True or not isinstance(schema, Mapping):
            return None
        if bound is None:
            bound = self.graph.order(schema)
        if "const" in schema:
            return _copy(schema["const"])
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return _copy(enum[0])
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = resolve_pointer(self.graph.root, ref)
            if target is None:
                raise CannotSynthesize(f"unresolvable $ref at {self.graph.path(schema)}")
            return self._child(target, depth + 1)
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            if isinstance(options, list) and options:
                for option in options:  # the first branch that is known to end
                    if self._safe(option, bound):
                        return self._child(option, depth + 1)
                raise CannotSynthesize(f"no {key} branch ends at {self.graph.path(schema)}")
        all_of = schema.get("allOf")
        if isinstance(all_of, list) and all_of:
            merged: dict[str, Any] = {}
            for part in all_of:
                if isinstance(part, Mapping):
                    merged.update(part)
            return self.value(merged, bound, depth + 1)
        return self._typed(schema, bound, depth)

    def _typed(self, schema: Mapping[str, Any], bound: int | None, depth: int) -> Any:
        kinds = type_names(schema)
        if "type" not in schema:
            # Untyped: an object when it declares properties, an array with items.
            kinds = ("object", *kinds) if "properties" in schema else (
                ("array", *kinds) if "items" in schema else ("string",))
        # Non-null types first (a nullable field gets a real value when one ends).
        for kind in sorted(kinds, key=lambda k: k == "null"):
            if kind == "object" and self._object_ends(schema, bound):
                return self._object(schema, bound, depth)
            if kind == "array" and self._array_ends(schema, bound):
                return self._array(schema, bound, depth)
            if kind == "string":
                return _string(schema)
            if kind == "integer":
                return _number(schema, integer=True)
            if kind == "number":
                return _number(schema, integer=False)
            if kind == "boolean":
                return True
            if kind == "null":
                return None
        raise CannotSynthesize(f"no type of the schema at {self.graph.path(schema)} ends")

    def _properties(self, schema: Mapping[str, Any]) -> Mapping[str, Any]:
        props = schema.get("properties")
        return props if isinstance(props, Mapping) else {}

    def _object_ends(self, schema: Mapping[str, Any], bound: int | None) -> bool:
        props = self._properties(schema)
        return all(
            self._safe(props[name], bound) for name in required_names(schema) if name in props
        )

    def _object(self, schema: Mapping[str, Any], bound: int | None, depth: int) -> Any:
        required = set(required_names(schema))
        return {
            name: self._child(sub, depth + 1)
            for name, sub in self._properties(schema).items()
            if name in required or self._safe(sub, bound)
        }

    def _item_schemas(self, schema: Mapping[str, Any], count: int) -> list[Any]:
        prefix = schema.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        items = schema.get("items", {})
        if isinstance(items, list):  # an older draft's tuple form
            prefix, items = items, {}
        return [prefix[i] if i < len(prefix) else items for i in range(count)]

    def _array_count(self, schema: Mapping[str, Any], bound: int | None) -> int:
        count = min_items(schema)
        if count == 0 and "minItems" not in schema:
            # One example item when an item is known to end (recursion stops at []).
            count = 1 if all(self._safe(s, bound) for s in self._item_schemas(schema, 1)) else 0
        max_items = schema.get("maxItems")
        if isinstance(max_items, int) and not isinstance(max_items, bool) and max_items >= 0:
            count = min(count, max_items)
        return count

    def _array_ends(self, schema: Mapping[str, Any], bound: int | None) -> bool:
        count = self._array_count(schema, bound)
        return all(self._safe(s, bound) for s in self._item_schemas(schema, count))

    def _array(self, schema: Mapping[str, Any], bound: int | None, depth: int) -> Any:
        count = self._array_count(schema, bound)
        return [self._child(s, depth + 1) for s in self._item_schemas(schema, count)]


def _copy(value: Any) -> Any:
    """A private copy of a const/enum value (the analysis is cached and shared)."""
    if isinstance(value, dict | list):
        return msgspec.json.decode(msgspec.json.encode(value))
    return value


_FORMATS = {
    "date-time": "2024-01-01T00:00:00Z",
    "date": "2024-01-01",
    "time": "00:00:00Z",
    "email": "user@example.com",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "uri": "https://example.com/",
    "hostname": "example.com",
    "ipv4": "192.0.2.1",
    "ipv6": "2001:db8::1",
    "duration": "P1D",
}


def _string(schema: Mapping[str, Any]) -> str:
    fmt = schema.get("format")
    value = _FORMATS.get(fmt, "example") if isinstance(fmt, str) else "example"
    min_len = schema.get("minLength")
    if isinstance(min_len, int) and len(value) < min_len:
        value = value + "x" * (min_len - len(value))
    max_len = schema.get("maxLength")
    if isinstance(max_len, int) and len(value) > max_len:
        value = value[:max_len]
    return value


def _bound(schema: Mapping[str, Any], key: str) -> float | None:
    value = schema.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return value
    return None


def _number(schema: Mapping[str, Any], *, integer: bool) -> int | float:
    """The first candidate within the bounds (and a multiple of ``multipleOf``)."""
    low, xlow = _bound(schema, "minimum"), _bound(schema, "exclusiveMinimum")
    high, xhigh = _bound(schema, "maximum"), _bound(schema, "exclusiveMaximum")

    def fits(v: float) -> bool:
        return ((low is None or v >= low) and (xlow is None or v > xlow)
                and (high is None or v <= high) and (xhigh is None or v < xhigh))

    floor = max((b for b in (low, xlow) if b is not None), default=None)
    ceiling = min((b for b in (high, xhigh) if b is not None), default=None)
    start = floor if floor is not None else (1 if integer else 1.5)
    multiple = _bound(schema, "multipleOf")
    candidates: list[float] = []
    if multiple is not None and multiple > 0:
        first = math.ceil(start / multiple)
        candidates = [k * multiple for k in range(first, first + 3)]
        if ceiling is not None:
            last = math.floor(ceiling / multiple)
            candidates += [k * multiple for k in range(last, last - 3, -1)]
    else:
        candidates = [1 if integer else 1.5, start, start + 1]
        if not integer:
            candidates.append(start + 0.5)
            if ceiling is not None:
                candidates.append((start + ceiling) / 2)
        if ceiling is not None:
            candidates += [ceiling, ceiling - 0.5, ceiling - 1]
    for candidate in candidates:
        if integer:
            if candidate != math.floor(candidate):
                candidate = math.ceil(candidate)
            candidate = int(candidate)
        if fits(candidate):
            return int(candidate) if integer else float(candidate)
    return 1 if integer else 1.5  # nothing fits: the self-check reports it


def violate(schema: Any, value: Any) -> Any:
    """A JSON value that breaks ``schema`` (extra property on objects, else a wrong type)."""
    if isinstance(value, dict):
        broken = dict(value)
        broken["unexpected_property"] = "not in the schema"
        if broken.keys() - {"unexpected_property"}:
            broken.pop(next(iter(value)))  # also a required property missing
        return broken
    if isinstance(value, str):
        return {"not": "a string"}
    return "not the right type"


# -- HTTP-level rejections --------------------------------------------------------
@attrs.frozen
class HttpRejection:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


def _error_body(etype: str, code: str | None, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": etype, "param": None, "code": code}}


def http_rejection(reply: Reply) -> HttpRejection:
    """Status, headers and body of an HTTP-level reply kind."""
    headers: list[tuple[str, str]] = [("content-type", "application/json")]
    if reply.kind == "rate_limited":
        retry_after = reply.retry_after or 0.0
        headers += [
            ("retry-after", str(max(0, round(retry_after)))),
            ("retry-after-ms", str(int(retry_after * 1000))),
        ]
        status = 429
        body: Any = _error_body("requests", "rate_limit_exceeded", "Rate limit reached.")
    elif reply.kind == "quota_exceeded":
        status = 429
        body = _error_body("insufficient_quota", "insufficient_quota", "You exceeded your quota.")
    elif reply.kind == "unauthorized":
        status = 401
        body = _error_body("invalid_request_error", "invalid_api_key", "Incorrect API key.")
    elif reply.kind == "forbidden":
        status = 403
        body = _error_body(
            "invalid_request_error",
            "unsupported_country_region_territory",
            "Country, region, or territory not supported.",
        )
    elif reply.kind == "http_error":
        status = reply.status or 500
        body = (
            reply.body
            if reply.body is not None
            else _error_body("server_error", "server_error", "The server had an error.")
        )
        headers += [(k.lower(), v) for k, v in reply.headers]
        if reply.framing == "sse":
            headers[0] = ("content-type", "text/event-stream")
            return HttpRejection(
                status, tuple(headers), b"data: " + msgspec.json.encode(body) + b"\n\n"
            )
    else:
        raise ValueError(f"{reply.kind} is not an HTTP-level reply")
    return HttpRejection(status, tuple(headers), msgspec.json.encode(body))


def schema_rejection(exc: CannotSynthesize) -> HttpRejection:
    """What the real API answers for a schema it cannot use: 400 ``invalid_json_schema``."""
    body = _error_body("invalid_request_error", "invalid_json_schema",
                       f"Invalid schema for response format: {exc}"[:500])
    body["error"]["param"] = "text.format.schema"
    return HttpRejection(400, (("content-type", "application/json"),), msgspec.json.encode(body))


# -- event streams ------------------------------------------------------------------
def _response_object(
    rid: str, request: Mapping[str, Any], created_at: int, status: str, output: list[Any]
) -> dict[str, Any]:
    text = request.get("text") if isinstance(request.get("text"), Mapping) else None
    reasoning = request.get("reasoning")
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "model": request.get("model", "fixture-model"),
        "output": output,
        "parallel_tool_calls": bool(request.get("parallel_tool_calls", False)),
        "previous_response_id": None,
        "reasoning": reasoning if isinstance(reasoning, Mapping) else {"effort": None,
                                                                        "summary": None},
        "store": bool(request.get("store", False)),
        "temperature": 1.0,
        "text": text if text is not None else {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice", "none"),
        "tools": request.get("tools", []),
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": None,
        "user": None,
        "metadata": {},
    }


def _usage(text: str, request: Mapping[str, Any]) -> dict[str, Any]:
    """A realistic ``usage`` object, deterministic from the request and answer sizes
    (about four characters a token, like English text). Output tokens include the
    reasoning tokens, which grow with the requested effort, as in the provider's usage."""
    prompt = msgspec.json.encode(
        [request.get("instructions"), request.get("input"), request.get("text")]
    )
    input_tokens = max(1, len(prompt) // 4)
    reasoning = request.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, Mapping) else None
    reasoning_tokens = {"minimal": 0, "low": 16, "medium": 64, "high": 256}.get(
        effort if isinstance(effort, str) else "", 0
    )
    out = max(1, len(text) // 4) + reasoning_tokens
    limit = request.get("max_output_tokens")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        # Like the API, never more output than the request allows.
        out = min(out, limit)
        reasoning_tokens = min(reasoning_tokens, out)
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + out,
    }


def _chunks(text: str, n: int = 4) -> list[str]:
    if not text:
        return [""]
    size = max(1, -(-len(text) // n))
    return [text[i : i + size] for i in range(0, len(text), size)]


def request_schema(request: Mapping[str, Any]) -> Any:
    text = request.get("text")
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema":
        return fmt.get("schema", {})
    return None


def events_for(
    reply: Reply, request: Mapping[str, Any], *, serial: int, created_at: int
) -> list[dict[str, Any]]:
    """The full event list of a streamed reply (a disconnect/stall sends only a prefix)."""
    rid = reply.response_id or f"resp_fixture{serial:012d}"
    mid = f"msg_fixture{serial:012d}"
    kind = reply.kind
    schema = request_schema(request)
    if kind == "complete":
        text = msgspec.json.encode(reply.payload).decode()
    elif kind == "invalid_json":
        text = "This is not JSON: {answer: 42"
    elif kind == "schema_violation":
        text = msgspec.json.encode(violate(schema, synthesize_value(schema or {}))).decode()
    elif kind == "refusal":
        text = reply.text or "I can't help with that."
    else:  # synthesize, disconnect, stall, incomplete, failed, tool_call
        text = msgspec.json.encode(synthesize_value(schema or {})).decode()

    events: list[dict[str, Any]] = []

    def emit(event: dict[str, Any]) -> None:
        event["sequence_number"] = len(events)
        events.append(event)

    def resp(status: str, output: list[Any]) -> dict[str, Any]:
        return _response_object(rid, request, created_at, status, output)

    emit({"type": "response.created", "response": resp("in_progress", [])})
    emit({"type": "response.in_progress", "response": resp("in_progress", [])})

    if kind == "error_event":
        error: dict[str, Any] = {"type": "error", "error": {
            "type": reply.error_type, "code": reply.code, "message": "The upstream failed.",
            "param": None}}
        if reply.status is not None:
            error["status"] = reply.status
        prefix = events[: reply.after_events or 0]
        events.clear()
        events.extend(prefix)
        emit(error)
        return events

    if kind == "failed":
        failed = resp("failed", [])
        failed["error"] = {"code": reply.code or "server_error", "message": "The model failed."}
        failed["usage"] = _usage("", request)  # the input was processed before it failed
        emit({"type": "response.failed", "response": failed})
        return events

    if kind == "tool_call":
        call = {
            "id": f"fc_fixture{serial:012d}",
            "type": "function_call",
            "status": "in_progress",
            "arguments": "",
            "call_id": f"call_fixture{serial:012d}",
            "name": "lookup",
        }
        emit({"type": "response.output_item.added", "output_index": 0, "item": call})
        args = '{"query":"x"}'
        emit({"type": "response.function_call_arguments.delta", "item_id": call["id"],
              "output_index": 0, "delta": args})
        emit({"type": "response.function_call_arguments.done", "item_id": call["id"],
              "output_index": 0, "arguments": args})
        done_call = dict(call, status="completed", arguments=args)
        emit({"type": "response.output_item.done", "output_index": 0, "item": done_call})
        final = resp("completed", [done_call])
        final["usage"] = _usage(args, request)
        emit({"type": "response.completed", "response": final})
        return events

    part_type = "refusal" if kind == "refusal" else "output_text"
    empty_part: dict[str, Any] = (
        {"type": "refusal", "refusal": ""}
        if kind == "refusal"
        else {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    )
    item = {"id": mid, "type": "message", "status": "in_progress", "role": "assistant",
            "content": []}
    emit({"type": "response.output_item.added", "output_index": 0, "item": item})
    emit({"type": "response.content_part.added", "item_id": mid, "output_index": 0,
          "content_index": 0, "part": empty_part})
    chunks = _chunks(text)
    if kind == "incomplete":
        chunks = chunks[: max(1, len(chunks) // 2)]
    delta_type = "response.refusal.delta" if kind == "refusal" else "response.output_text.delta"
    for chunk in chunks:
        ev: dict[str, Any] = {"type": delta_type, "item_id": mid, "output_index": 0,
                              "content_index": 0, "delta": chunk}
        if kind != "refusal":
            ev["logprobs"] = []
        emit(ev)
    if kind == "incomplete":
        partial = "".join(chunks)
        part = {"type": "output_text", "text": partial, "annotations": [], "logprobs": []}
        msg = dict(item, status="incomplete", content=[part])
        final = resp("incomplete", [msg])
        final["incomplete_details"] = {"reason": reply.reason or "max_output_tokens"}
        final["usage"] = _usage(partial, request)
        emit({"type": "response.incomplete", "response": final})
        return events
    if kind == "refusal":
        emit({"type": "response.refusal.done", "item_id": mid, "output_index": 0,
              "content_index": 0, "refusal": text})
        part = {"type": "refusal", "refusal": text}
    else:
        emit({"type": "response.output_text.done", "item_id": mid, "output_index": 0,
              "content_index": 0, "text": text, "logprobs": []})
        part = {"type": part_type, "text": text, "annotations": [], "logprobs": []}
    emit({"type": "response.content_part.done", "item_id": mid, "output_index": 0,
          "content_index": 0, "part": part})
    msg = dict(item, status="completed", content=[part])
    emit({"type": "response.output_item.done", "output_index": 0, "item": msg})
    final = resp("completed", [msg])
    final["usage"] = _usage(text, request) if reply.usage is None else reply.usage
    emit({"type": "response.completed", "response": final})
    return events
