"""What every transport shares: credentials, bounds, reading HTTP rejections, and the
shape of a transport (:class:`Transport`, its ``stream`` signature in :class:`StreamOptions`).

The transport knows frames, headers and how a stream ended; it knows nothing
of budgets or policy (that is ``recoverable.actors``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Final, Protocol, Required, TypedDict, Unpack, runtime_checkable
from urllib.parse import urlsplit, urlunsplit

import attrs
import msgspec
import trio

from recoverable.errors import InvalidCredentials, InvalidRequest
from recoverable.outcome import Outcome, Progress
from recoverable.transport.events import FrameTooLarge, SseDecoder, error_fields
from recoverable.transport.ratelimit import parse_retry_after
from recoverable.types import AccountBinding

__all__ = [
    "MAX_ERROR_BODY_BYTES",
    "USER_AGENT",
    "Credentials",
    "StaticCredentials",
    "StreamLimits",
    "StreamOptions",
    "Streams",
    "Transport",
    "TransportFactory",
    "normalize_base_url",
    "parse_error_body",
    "parse_retry_after",
    "token_fingerprint",
    "validate_api_key",
]



def _version() -> str:
    try:
        return metadata.version("recoverable")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0"


#: The ``User-Agent`` of every request both transports send (generation, reattachment).
USER_AGENT: Final = f"recoverable/{_version()}"

# A rejection body is read only this far: enough for {"error": {...}}, never a flood.
MAX_ERROR_BODY_BYTES = 64 * 1024


@runtime_checkable
class Credentials(Protocol):
    """Where tokens come from. ``account`` is the binding the tokens belong to."""

    @property
    def account(self) -> AccountBinding: ...

    async def token(self, *, renew: bool = False) -> str: ...


def validate_api_key(key: object, *, what: str = "api_key") -> str:
    """Return ``key`` if it can be sent as ``Authorization: Bearer <key>``.

    Only printable ASCII without spaces is accepted (0x21..0x7e): a non-ASCII
    character would fail to encode in the HTTP client, and ``\\r``/``\\n``/spaces
    would corrupt or split the header. The message never contains the key.
    """
    if not isinstance(key, str):
        raise InvalidCredentials(f"{what} must be a string")
    if not key:
        raise InvalidCredentials(f"{what} is empty")
    for index, char in enumerate(key):
        if not "\x21" <= char <= "\x7e":
            if char in "\r\n":
                problem = "a line break"
            elif char.isspace():
                problem = "whitespace"
            elif ord(char) > 0x7E:
                problem = "a non-ASCII character"
            else:
                problem = "a control character"
            raise InvalidCredentials(f"{what} contains {problem} (at position {index})")
    return key


class StaticCredentials:
    """A fixed API key.

    ``token(renew=True)`` returns the same key: an API key cannot be renewed, so
    a second 401 after a renewal is final (``AuthenticationRequired``).
    The key is kept in memory only; ``repr`` never shows it.
    """

    __slots__ = ("_account", "_key")

    def __init__(
        self, api_key: str, *, account: AccountBinding = AccountBinding("default", "api-key")
    ) -> None:
        self._key = validate_api_key(api_key)
        self._account = account

    @property
    def account(self) -> AccountBinding:
        return self._account

    async def token(self, *, renew: bool = False) -> str:
        return self._key

    def __repr__(self) -> str:
        return f"StaticCredentials(account={self._account!r}, api_key=<redacted>)"


@attrs.frozen
class StreamLimits:
    """Bounds on everything a stream reads.

    Passing a size bound (frame, events, total bytes) yields a terminal
    ``response_too_large`` interruption; passing ``idle_timeout`` a replaceable
    ``timeout``.
    """

    max_frame_bytes: int = 16 * 2**20  # one SSE frame / WebSocket message
    max_events: int = 200_000
    max_total_bytes: int = 64 * 2**20  # everything received, keepalives included
    idle_timeout: float = 120.0  # time without ANY bytes (keepalives reset it)
    connect_timeout: float = 15.0

    def __attrs_post_init__(self) -> None:
        for name in ("max_frame_bytes", "max_events", "max_total_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidRequest(f"StreamLimits.{name} must be a positive integer")
        for name in ("idle_timeout", "connect_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise InvalidRequest(f"StreamLimits.{name} must be a positive number")


class StreamOptions(TypedDict, total=False):
    """The keyword arguments of every ``stream(body, ...)``, written once.

    ``attempt_id`` and ``token`` are required; the callbacks default to ``None``.
    ``before_send`` runs once a connection is established and before the request is
    written (never when none could be: the interruption's ``transport_code`` is then a
    connect code); ``on_delta`` receives each output text delta (a live view).
    """

    attempt_id: Required[str]
    token: Required[str]
    on_progress: Callable[[Progress], None] | None
    before_send: Callable[[], Awaitable[None]] | None
    on_delta: Callable[[str], None] | None


class Streams(Protocol):
    """Anything that streams one frozen create body and returns how it ended: a
    transport, ``ResponsesBackend``, the reattachment client. Implementations may
    spell the keywords out; mypy checks them against :class:`StreamOptions`."""

    async def stream(self, body: bytes, **options: Unpack[StreamOptions]) -> Outcome: ...


class Transport(Streams, Protocol):
    """One transport mode (``transport/modes.py`` lists them): streams, closes its pool,
    and is given the backend's long-lived nursery while the backend is entered (a
    transport that needs no background tasks ignores it)."""

    def attach(self, nursery: trio.Nursery | None) -> None: ...

    async def aclose(self) -> None: ...


class TransportFactory(Protocol):
    """How ``ResponsesBackend`` makes a transport: its class, called with the normalized
    HTTP(S) base URL and the backend's bounds."""

    def __call__(
        self, base_url: str, *, limits: StreamLimits, max_connections: int
    ) -> Transport: ...


def token_fingerprint(token: str) -> str:
    """A short, non-reversible tag for a token (pool keys, redacted request logs)."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()[:16]


def normalize_base_url(base_url: str) -> str:
    """``scheme://host[:port]/path`` lower-cased scheme/host, default port and trailing
    slash removed. Raises ``InvalidRequest`` for anything but http(s)/ws(s) URLs."""
    if not isinstance(base_url, str):
        raise InvalidRequest("base_url must be a string")
    parts = urlsplit(base_url.strip())
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
        raise InvalidRequest(f"base_url must be an http(s) URL, got {base_url!r}")
    if parts.username or parts.password:
        raise InvalidRequest("base_url must not carry credentials")
    if parts.query or parts.fragment:
        raise InvalidRequest("base_url must not have a query or fragment")
    scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError as exc:
        raise InvalidRequest(f"base_url has an invalid port: {base_url!r}") from exc
    default = 443 if scheme == "https" else 80
    netloc = host if port in (None, default) else f"{host}:{port}"
    path = parts.path.rstrip("/")
    return urlunsplit((scheme, netloc, path, "", ""))


def _error_object(decoded: object) -> tuple[str | None, str | None] | None:
    if not isinstance(decoded, dict):
        return None
    nested = decoded.get("error")
    if isinstance(nested, dict):
        return error_fields(nested)
    if decoded.get("type") == "error":  # a flat error event: {"type": "error", "code": ...}
        return error_fields({"code": decoded.get("code")})
    return None


def parse_error_body(body: bytes) -> tuple[str | None, str | None]:
    """(error.type, error.code) of a rejection body; (None, None) when there is none.

    The body is either the JSON ``{"error": {...}}`` or the same framed as SSE
    (``data: {"error": {...}}``, as some proxies answer a non-2xx); the first frame
    that carries an error object is used. Both values are bounded codes.
    """
    if not body or len(body) > MAX_ERROR_BODY_BYTES:
        return None, None
    try:
        found = _error_object(msgspec.json.decode(body))
    except (msgspec.DecodeError, UnicodeDecodeError):
        found = None
        try:
            frames = SseDecoder(MAX_ERROR_BODY_BYTES).feed(body + b"\n\n")
        except FrameTooLarge:
            frames = []
        for frame in frames:
            try:
                found = _error_object(msgspec.json.decode(frame.data))
            except (msgspec.DecodeError, UnicodeDecodeError):
                continue
            if found is not None:
                break
    return found if found is not None else (None, None)
