"""The provider's rate-limit and Retry-After response headers, and the token estimate of a body.

OpenAI-style servers answer every request (and every 429) with::

    x-ratelimit-remaining-requests: 59
    x-ratelimit-remaining-tokens: 149984
    x-ratelimit-reset-requests: 1s
    x-ratelimit-reset-tokens: 6m0s

The reset values are Go-style durations (``"20ms"``, ``"1s"``, ``"6m0s"``, ``"1h2m3.5s"``).
:func:`parse_rate_limit_headers` turns them into a bounded :class:`RateLimits` (counts and
seconds only); anything malformed is ignored field by field (``None``), never an error: a
header can only make the governor more careful, never stop an operation.
"""

from __future__ import annotations

import datetime as _dt
import email.utils
import math
import re
from collections.abc import Iterable, Mapping
from typing import Final

import msgspec

from recoverable.outcome import MAX_RATE_LIMIT_COUNT, MAX_RATE_LIMIT_RESET, RateLimits

__all__ = [
    "RATE_LIMIT_HEADERS",
    "RETRY_AFTER_HEADERS",
    "RateLimits",
    "estimate_tokens",
    "format_duration",
    "parse_duration",
    "parse_rate_limit_headers",
    "parse_retry_after",
]

# Longest delay hint we represent (10 years); the retry policy caps it far lower.
_MAX_RETRY_AFTER = 10 * 365 * 24 * 3600.0

RATE_LIMIT_HEADERS: Final = (
    "x-ratelimit-remaining-requests",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-requests",
    "x-ratelimit-reset-tokens",
)
_MAX_VALUE_CHARS: Final = 64
_NUMBER = r"(\d{1,12}(?:\.\d{1,9})?)"
_DURATION = re.compile(
    rf"(?:{_NUMBER}h)?(?:{_NUMBER}m(?!s))?(?:{_NUMBER}s)?(?:{_NUMBER}ms)?"
    rf"(?:{_NUMBER}(?:us|µs))?(?:{_NUMBER}ns)?"
)
_UNITS: Final = (3600.0, 60.0, 1.0, 1e-3, 1e-6, 1e-9)


def parse_duration(text: str) -> float | None:
    """Seconds from a Go-style duration (``"6m0s"``, ``"1s"``, ``"20ms"``) or a plain
    number of seconds; ``None`` if it is neither. Capped at ``MAX_RATE_LIMIT_RESET``."""
    if not isinstance(text, str) or not 0 < len(text) <= _MAX_VALUE_CHARS:
        return None
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        match = _DURATION.fullmatch(text)
        if match is None or not any(match.groups()):
            return None
        value = sum(
            float(amount) * unit
            for amount, unit in zip(match.groups(), _UNITS, strict=True)
            if amount
        )
    if not math.isfinite(value) or value < 0:
        return None
    return min(value, MAX_RATE_LIMIT_RESET)


def format_duration(seconds: float) -> str:
    """The provider's format for a reset time (the fixture provider uses it)."""
    seconds = max(0.0, seconds)
    if seconds < 1.0:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60.0)
    if minutes >= 1:
        return f"{int(minutes)}m{rest:.3g}s"
    return f"{seconds:.3g}s"


def _count(text: str) -> int | None:
    text = text.strip()
    if not 0 < len(text) <= _MAX_VALUE_CHARS or not text.isascii() or not text.isdigit():
        return None
    return min(int(text), MAX_RATE_LIMIT_COUNT)


def parse_rate_limit_headers(
    headers: Mapping[str, str] | Iterable[tuple[str, str]],
) -> RateLimits | None:
    """The four ``x-ratelimit-*`` headers as :class:`RateLimits`; ``None`` if none is
    present and well formed. Names match case-insensitively; the first value wins."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    found: dict[str, str] = {}
    for raw_name, raw_value in items:
        name = str(raw_name).lower()
        if name in RATE_LIMIT_HEADERS and name not in found:
            found[name] = str(raw_value)
    if not found:
        return None
    limits = RateLimits(
        remaining_requests=_count(found.get("x-ratelimit-remaining-requests", "")),
        remaining_tokens=_count(found.get("x-ratelimit-remaining-tokens", "")),
        reset_requests=parse_duration(found.get("x-ratelimit-reset-requests", "")),
        reset_tokens=parse_duration(found.get("x-ratelimit-reset-tokens", "")),
    )
    if limits == RateLimits():
        return None
    return limits


class _MaxOutput(msgspec.Struct):
    max_output_tokens: int | None = None


_decode_max_output: Final = msgspec.json.Decoder(_MaxOutput).decode


def estimate_tokens(body: bytes) -> int:
    """The tokens a request is counted for before its usage is known: a quarter of the
    frozen body's bytes (about four bytes a token for text and JSON), plus the request's
    ``max_output_tokens`` when it sets one (the most the answer can add)."""
    estimate = -(-len(body) // 4)
    try:
        extra = _decode_max_output(body).max_output_tokens
    except (msgspec.DecodeError, msgspec.ValidationError):
        extra = None
    if isinstance(extra, int) and extra > 0:
        estimate += min(extra, MAX_RATE_LIMIT_COUNT)
    return estimate


def _finite_delay(value: float) -> float | None:
    if not math.isfinite(value) or value < 0:
        return None
    return min(value, _MAX_RETRY_AFTER)


# Where a server's delay hint is read from, first usable one wins: the standard pair (the
# OpenAI SDKs read exactly these), then the same pair as LiteLLM's proxy forwards an
# upstream's answer, every upstream header renamed with an ``llm_provider-`` prefix (its
# docs/proxy/response_headers.md). A proxy's rename never overrides the standard header.
# Each name says whether its value is milliseconds (else seconds or an HTTP date).
RETRY_AFTER_HEADERS: Final[tuple[tuple[str, bool], ...]] = (
    ("retry-after-ms", True),
    ("retry-after", False),
    ("llm_provider-retry-after-ms", True),
    ("llm_provider-retry-after", False),
)


def parse_retry_after(
    headers: Mapping[str, str] | Iterable[tuple[str, str]], *, now: float | None = None
) -> float | None:
    """Seconds to wait, from the first usable header of :data:`RETRY_AFTER_HEADERS`:
    ``retry-after-ms``, ``retry-after`` (seconds or HTTP date), then LiteLLM's
    ``llm_provider-retry-after-ms`` and ``llm_provider-retry-after``.

    Header names are matched case-insensitively; the first value of a name counts.
    Negative, non-finite or unparsable values are skipped (the next header is read; with
    none usable the result is ``None`` and the policy's own backoff applies); a date in
    the past gives ``0.0``.
    """
    items = headers.items() if isinstance(headers, Mapping) else headers
    lowered: dict[str, str] = {}
    for name, value in items:
        lowered.setdefault(name.lower(), value)
    for name, in_milliseconds in RETRY_AFTER_HEADERS:
        raw = lowered.get(name)
        if raw is None:
            continue
        delay = _milliseconds(raw) if in_milliseconds else _seconds_or_date(raw, now)
        if delay is not None:
            return delay
    return None


def _milliseconds(raw: str) -> float | None:
    try:
        milliseconds = float(raw.strip())
    except ValueError:
        return None
    return _finite_delay(milliseconds / 1000.0)


def _seconds_or_date(raw: str, now: float | None) -> float | None:
    raw = raw.strip()
    try:
        return _finite_delay(float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.UTC)
    current = _dt.datetime.now(_dt.UTC).timestamp() if now is None else now
    return min(max(0.0, when.timestamp() - current), _MAX_RETRY_AFTER)
