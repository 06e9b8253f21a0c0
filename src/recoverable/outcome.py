"""Typed facts about how one streamed generation ended.

The transport fills these; the operation state machine decides what they mean
for the budget. Nothing here is parsed from message strings. ``Interruption``
is also persisted inside operation records, so it is a ``msgspec.Struct`` with
only bounded, non-sensitive fields (no provider message text, no headers).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Annotated, Final, Literal

import msgspec
import msgspec.structs

from recoverable import failure_policy

# Re-exported: the quota and rate-limit words are the failure policy's.
from recoverable.failure_policy import QUOTA_CODES as QUOTA_CODES
from recoverable.failure_policy import RATE_LIMIT_NAMES as RATE_LIMIT_NAMES

InterruptionKind = Literal[
    "disconnected",  # the connection dropped / closed before a terminal event
    "timeout",  # idle time between events (or connect) passed its bound
    "premature_eof",  # the stream ended cleanly but without a terminal event
    "http_rejected",  # an HTTP (or WS handshake / WS wrapped error with status) rejection
    "provider_failed",  # response.failed, or an error event without an HTTP status
    "incomplete",  # response.incomplete (incomplete_details.reason in provider_code)
    "tool_activity",  # a function/tool call item appeared: stopped, nothing executed
    "malformed",  # a frame or event broke the protocol (garbled, wrong types, bad JSON)
    "response_too_large",  # a configured size bound (frame, total bytes, event count) passed
    "refusal",  # the model refused (response.refusal.*) instead of producing output
    "invalid_output",  # completed, but the text is not valid JSON / not schema-valid
    "interrupted",  # the local process died or was cancelled while the attempt was in flight
    # Reattachment: the saved background response could not be resumed (404 / expired on the
    # provider, or cancelled there): replaceable like an interruption (seed 000 decides).
    "reattach_unavailable",
]

# The ``transport_code`` of a ``provider_failed`` that came from an ``error`` event (no HTTP
# status) rather than ``response.failed``: both are judged alike, but a person reading the
# failure must be told which of the two the provider sent.
ERROR_EVENT: Final = "error_event"

# -- bounds on every provider-supplied string -------------------------------------------------
# A provider code/type/reason is kept only when it looks like a code: a short token. Anything
# else (too long, spaces, control or non-ASCII characters) becomes ``UNRECOGNIZED_CODE``, so no
# record, status, telemetry event, log line or CLI output ever carries provider text.
MAX_CODE_CHARS: Final = 64
UNRECOGNIZED_CODE: Final = "unrecognized"
_CODE = re.compile(rf"[A-Za-z0-9_.:/-]{{1,{MAX_CODE_CHARS}}}")
# Response ids are kept up to this length (third-party servers encode routing data in them);
# a longer or non-printable id is stored as a prefix plus a digest of the whole id.
MAX_RESPONSE_ID_CHARS: Final = 512
_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_RESPONSE_ID_CHARS}}}")
_ID_DIGEST_CHARS: Final = 32


def bounded_code(value: object) -> str | None:
    """A provider code/type as a bounded application code (``None`` stays ``None``)."""
    if value is None:
        return None
    if isinstance(value, str) and _CODE.fullmatch(value):
        return value
    return UNRECOGNIZED_CODE


def bounded_response_id(value: object) -> str | None:
    """A response id of at most ``MAX_RESPONSE_ID_CHARS`` printable ASCII characters.

    Ids within the bound are kept exactly. A longer (or non-printable) id keeps a
    printable prefix and ends with ``~`` and a digest of the whole id, so two different
    long ids stay different and the same id always maps to the same value.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        value = repr(value)
    if _ID.fullmatch(value):
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:_ID_DIGEST_CHARS]
    keep = MAX_RESPONSE_ID_CHARS - _ID_DIGEST_CHARS - 1
    prefix = "".join(char for char in value[: keep * 4] if "!" <= char <= "~")[:keep]
    return f"{prefix}~{digest}"


# -- token usage ---------------------------------------------------------------------------
# The sane cap on one attempt's token count: far above any context window, far below what
# overflows anything. A reported count outside 0..MAX_USAGE_TOKENS makes the usage malformed.
MAX_USAGE_TOKENS: Final = 10**9
_Count = Annotated[int, msgspec.Meta(ge=0)]  # a decoded record never holds a negative count

# The structs of this module are ``gc=False`` (untracked by the cyclic collector): frozen,
# of scalars, strings and other such frozen structs, so no reference cycle can pass
# through them (see ``recoverable.records``). One ``Progress`` is built per stream event.


class Usage(msgspec.Struct, frozen=True, gc=False, kw_only=True, forbid_unknown_fields=True):
    """The tokens one attempt consumed, as the provider reported them (counts only).

    ``input_tokens`` includes ``cached_input_tokens`` and ``output_tokens`` includes
    ``reasoning_tokens``, as in the Responses API's ``usage`` object. Build one from
    provider JSON with :func:`parse_usage` (bounded and validated); sums of several
    attempts (``+``) may pass the per-attempt cap.
    """

    input_tokens: _Count = 0
    cached_input_tokens: _Count = 0
    output_tokens: _Count = 0
    reasoning_tokens: _Count = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            cached_input_tokens=self.cached_input_tokens + other.cached_input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            reasoning_tokens=self.reasoning_tokens + other.reasoning_tokens,
        )



class ModelPrice(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """USD per one million tokens of one model (and service tier): ``input`` (uncached),
    ``cached_input`` and ``output`` (reasoning tokens are output tokens). An operation with
    a cost budget keeps the price it was admitted with (``OperationRecord.cost_price``), so
    a restart, a worker or a new price list never changes what its budget counts."""

    input: float
    cached_input: float
    output: float

    def cost(self, usage: Usage) -> float:
        """What ``usage`` costs at this price, in USD."""
        uncached = max(0, usage.input_tokens - usage.cached_input_tokens)
        return (
            uncached * self.input
            + usage.cached_input_tokens * self.cached_input
            + usage.output_tokens * self.output
        ) / 1_000_000

class MalformedUsage(ValueError):
    """The provider's ``usage`` object is not a bounded, consistent set of counts."""


def _count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedUsage(name)
    if not 0 <= value <= MAX_USAGE_TOKENS:
        raise MalformedUsage(name)
    return value


def _details(usage: Mapping[str, object], key: str, field: str) -> int:
    details = usage.get(key)
    if details is None:
        return 0
    if not isinstance(details, Mapping):
        raise MalformedUsage(key)
    value = details.get(field)
    return 0 if value is None else _count(value, f"{key}.{field}")


def parse_usage(value: object) -> Usage | None:
    """A response object's ``usage`` as a :class:`Usage`; ``None`` when absent (``null``).

    Raises :class:`MalformedUsage` for anything else that is not non-negative integer
    counts within ``MAX_USAGE_TOKENS`` with cached <= input and reasoning <= output.
    Unknown extra keys (``total_tokens``, newer details) are ignored.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise MalformedUsage("usage")
    usage = Usage(
        input_tokens=_count(value.get("input_tokens"), "input_tokens"),
        cached_input_tokens=_details(value, "input_tokens_details", "cached_tokens"),
        output_tokens=_count(value.get("output_tokens"), "output_tokens"),
        reasoning_tokens=_details(value, "output_tokens_details", "reasoning_tokens"),
    )
    if usage.cached_input_tokens > usage.input_tokens:
        raise MalformedUsage("cached_tokens")
    if usage.reasoning_tokens > usage.output_tokens:
        raise MalformedUsage("reasoning_tokens")
    return usage


# -- rate-limit headers ----------------------------------------------------------------------
# A remaining count above this is treated as this (no account has more; it bounds arithmetic).
MAX_RATE_LIMIT_COUNT: Final = 10**12
MAX_RATE_LIMIT_RESET: Final = 24 * 3600.0  # seconds; a longer reset is read as this


class RateLimits(msgspec.Struct, frozen=True, gc=False, kw_only=True, forbid_unknown_fields=True):
    """The provider's ``x-ratelimit-remaining-*`` / ``x-ratelimit-reset-*`` response headers
    (counts and seconds only, each bounded; ``None`` when absent or unparsable). Built by
    :func:`recoverable.transport.ratelimit.parse_rate_limit_headers`; never persisted."""

    remaining_requests: Annotated[int, msgspec.Meta(ge=0)] | None = None
    remaining_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    reset_requests: Annotated[float, msgspec.Meta(ge=0)] | None = None  # seconds
    reset_tokens: Annotated[float, msgspec.Meta(ge=0)] | None = None  # seconds


class Interruption(msgspec.Struct, frozen=True, gc=False, kw_only=True, forbid_unknown_fields=True):
    """Why an attempt did not produce a completed response.

    Every string field is bounded when the value is built (or decoded): provider codes
    and types through :func:`bounded_code`, the response id through
    :func:`bounded_response_id`. The transports already bound them; this also covers a
    custom backend and records written before the bound existed.
    """

    kind: InterruptionKind
    http_status: int | None = None
    provider_type: str | None = None  # error.type, e.g. "insufficient_quota"
    provider_code: str | None = None  # error.code, or incomplete_details.reason
    retry_after: float | None = None  # seconds, from retry-after-ms / retry-after / WS headers
    response_id: str | None = None
    sequence_number: int | None = None
    had_output: bool = False
    had_tool_activity: bool = False
    # e.g. "ws_close_1006", "connect_refused", "frame_too_large"; ``ERROR_EVENT`` on a
    # ``provider_failed`` that an ``error`` event (not ``response.failed``) reported.
    transport_code: str | None = None
    # The tokens the provider reported for this attempt (response.incomplete / .failed, or
    # a completion that failed validation). The operation record keeps them on the
    # attempt (``AttemptRecord.usage``), not here: a persisted failure has ``None``.
    usage: Usage | None = None
    usage_malformed: bool = False  # a usage object was sent but ignored as malformed
    # For ``invalid_output``: where the output broke the contract, a JSON pointer into the
    # output (``/items/1/name``; ``""`` is the root) made of the contract's own names and
    # list indexes.
    output_path: str | None = None
    # The response's x-ratelimit-* headers, for the rate governor; never persisted (the
    # record keeps ``None``, like ``usage``).
    rate_limits: RateLimits | None = None

    def __post_init__(self) -> None:
        for name in ("provider_type", "provider_code", "transport_code"):
            value = getattr(self, name)
            if value is not None:
                bounded = bounded_code(value)
                if bounded is not value:
                    msgspec.structs.force_setattr(self, name, bounded)
        path = self.output_path
        if path is not None and (len(path) > 160 or not path.isprintable()
                                 or (path and not path.startswith("/"))):
            msgspec.structs.force_setattr(self, "output_path", None)
        rid = self.response_id
        if rid is not None:
            bounded_id = bounded_response_id(rid)
            if bounded_id is not rid:
                msgspec.structs.force_setattr(self, "response_id", bounded_id)

    # The failure policy's reading of this failure (``recoverable.failure_policy``).

    @property
    def is_quota(self) -> bool:
        """Recognized quota/credit/spending-limit exhaustion (never a rate limit)."""
        return failure_policy.is_quota(self)

    @property
    def provider_key(self) -> str | None:
        """The provider's own word on the failure: ``provider_code``, else ``provider_type``."""
        return failure_policy.provider_key(self)

    @property
    def is_rate_limit(self) -> bool:
        """A temporary rate limit: HTTP 429 when there is a status; without one, a
        rate-limit code, or (no code) a rate-limit ``error.type``. Never quota."""
        return failure_policy.is_rate_limit(self)


class Completed(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """The stream reached ``response.completed``; ``text`` is the final output text."""

    text: str
    response_id: str | None = None
    sequence_number: int | None = None
    usage: Usage | None = None  # the reported usage, when it was sent and well formed
    usage_malformed: bool = False  # a usage object was sent but ignored as malformed
    rate_limits: RateLimits | None = None  # the response's x-ratelimit-* headers, if any

    def __post_init__(self) -> None:
        _bound_id(self)


def _bound_id(value: Completed | Progress) -> None:
    rid = value.response_id
    if rid is not None:
        bounded = bounded_response_id(rid)
        if bounded is not rid:
            msgspec.structs.force_setattr(value, "response_id", bounded)


Outcome = Completed | Interruption


class Progress(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """Reported to the caller as the stream advances (response id, cursor)."""

    response_id: str | None
    sequence_number: int | None
    had_output: bool
    # What the response object said of ``background`` when the stream first carried one
    # (``response.created``): ``True``/``False``; ``None`` until a response object was seen.
    # A background POST answered ``False`` went to a server that ignored the flag (a
    # proxy bridging to another API): its response id cannot be resumed.
    background: bool | None = None

    def __post_init__(self) -> None:
        _bound_id(self)
