"""The dashboard's access control: the printed token, the session cookie, the CSRF token
of every form, and the Host/Origin checks (an ASGI middleware around the app).

- The access token (``secrets.token_urlsafe(32)``) is made per start and never written to
  disk. A ``GET`` with ``?token=`` (checked in constant time) opens a session: an
  ``HttpOnly; SameSite=Strict; Path=/`` cookie with a random session id, then a redirect
  to the same URL without the token (so it leaves the address bar and the history); a
  token URL opened with a session already is redirected the same way. Every other
  request without a valid session cookie is answered 401. A redirect's target is always
  a path of this dashboard (:func:`same_origin_path`).
- The cookie is named after the dashboard's port (:func:`cookie_name`): cookies are not
  scoped by port, so with one shared name signing into a second dashboard on the same
  host replaced the first one's session (it was logged out). It has no ``Domain``
  attribute (the exact host only). The ``__Host-`` prefix would pin it further, but
  browsers accept it only with ``Secure``, which an ``http://`` loopback page cannot set.
- Each session has its own CSRF token, put in a hidden field of every form; a ``POST``
  must carry it (``check_csrf``) and an ``Origin`` (or, without one, a ``Referer``) of the
  dashboard itself.
- The ``Host`` header must name the dashboard's own address (no DNS rebinding).
- Every response gets ``Cache-Control: no-store``, ``X-Content-Type-Options: nosniff``,
  ``X-Frame-Options: DENY`` and ``Referrer-Policy: same-origin``.
"""

from __future__ import annotations

import hmac
import secrets
from collections import OrderedDict
from http.cookies import SimpleCookie
from typing import Final
from urllib.parse import parse_qsl, quote, unquote_plus, urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["COOKIE", "Guard", "Sessions", "cookie_name"]

COOKIE: Final = "recoverable_dashboard"  # the prefix of the per-port cookie name
MAX_SESSIONS: Final = 64  # the oldest is forgotten past this (it signs in again)
_HEADERS: Final = (
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
)


class Sessions:
    """The access token and the sessions opened with it (in memory only)."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token or secrets.token_urlsafe(32)
        self._csrf: OrderedDict[str, str] = OrderedDict()  # session id -> CSRF token
        # session id -> (operation id, "done" or "error", text): an action's result, shown
        # once by the operation's next page. Kept here, never in the URL, so a link
        # cannot put a forged banner on the dashboard's page.
        self._flashes: dict[str, tuple[str, str, str]] = {}

    def token_matches(self, candidate: str) -> bool:
        return hmac.compare_digest(candidate.encode(), self.token.encode())

    def open(self) -> str:
        session = secrets.token_urlsafe(32)
        self._csrf[session] = secrets.token_urlsafe(32)
        while len(self._csrf) > MAX_SESSIONS:
            forgotten, _csrf = self._csrf.popitem(last=False)
            self._flashes.pop(forgotten, None)
        return session

    def flash(self, session: str, operation_id: str, kind: str, text: str) -> None:
        """Keep an action's result for the session's next page of ``operation_id``."""
        if session in self._csrf:
            self._flashes[session] = (operation_id, kind, text[:300])

    def take_flash(self, session: str, operation_id: str) -> tuple[str, str] | None:
        """The result kept for this page, ``(kind, text)``, once (then it is gone)."""
        kept = self._flashes.get(session)
        if kept is None or kept[0] != operation_id:
            return None
        del self._flashes[session]
        return kept[1], kept[2]

    def known(self, session: str | None) -> bool:
        return session is not None and session in self._csrf

    def csrf(self, session: str) -> str:
        return self._csrf[session]

    def check_csrf(self, session: str | None, candidate: str | None) -> bool:
        if session is None or candidate is None or session not in self._csrf:
            return False
        return hmac.compare_digest(candidate.encode(), self._csrf[session].encode())


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def cookie_name(port: int) -> str:
    """The session cookie of the dashboard on ``port``: browsers send every cookie of a
    host to all its ports, so each dashboard reads only the one named after its own."""
    return f"{COOKIE}_{port}"


def _cookie(scope: Scope, name: str) -> str | None:
    raw = _header(scope, b"cookie")
    if raw is None:
        return None
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(raw)
    except Exception:  # a malformed Cookie header is no session
        return None
    morsel = jar.get(name)
    return morsel.value if morsel is not None else None


class Guard:
    """The ASGI middleware: Host check, token/session check, POST origin check."""

    def __init__(self, app: ASGIApp, sessions: Sessions) -> None:
        self.app = app
        self.sessions = sessions
        self.hosts: frozenset[str] = frozenset()  # set once the port is known
        self.any_host = False
        self.cookie = COOKIE  # named after the port once it is known (allow_hosts)

    def allow_hosts(self, host: str, port: int) -> None:
        """The Host headers this dashboard answers: its own address (and ``localhost``
        for 127.0.0.1). Bound to every interface (0.0.0.0, ::) it cannot know the names
        it is reached by: any Host is then accepted (the token still guards it)."""
        self.any_host = host in ("0.0.0.0", "[::]")
        names = {host, "127.0.0.1", "localhost"} if host == "127.0.0.1" else {host}
        self.hosts = frozenset(f"{name}:{port}" for name in names)
        self.cookie = cookie_name(port)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *_HEADERS]}
            await send(message)

        host = _header(scope, b"host")
        if host not in self.hosts and not (self.any_host and host):
            await _plain(send_with_headers, 403, "host_refused",
                         "this dashboard answers only at its own address")
            return
        session = _cookie(scope, self.cookie)
        if not self.sessions.known(session):
            await self._sign_in(scope, send_with_headers)
            return
        if scope["method"] == "GET" and _query_token(scope) is not None:
            # Signed in already: the token still leaves the address bar and the history.
            await _see_other(send_with_headers, without_token(scope))
            return
        if scope["method"] not in ("GET", "HEAD", "POST"):
            await _plain(send_with_headers, 405, "method_refused", "GET or POST only")
            return
        if scope["method"] == "POST" and not self._same_origin(scope, host):
            await _plain(send_with_headers, 403, "origin_refused",
                         "a form of this dashboard only (Origin does not match)")
            return
        scope.setdefault("state", {})["session"] = session
        await self.app(scope, receive, send_with_headers)

    def _same_origin(self, scope: Scope, host: str | None) -> bool:
        origin = _header(scope, b"origin")
        if origin is None or origin == "null":
            referer = _header(scope, b"referer")
            if referer is None:
                return False
            parts = urlsplit(referer)
            origin = f"{parts.scheme}://{parts.netloc}"
        return origin == f"http://{host}"

    async def _sign_in(self, scope: Scope, send: Send) -> None:
        token = _query_token(scope)
        if scope["method"] != "GET" or token is None or not self.sessions.token_matches(token):
            await _plain(send, 401, "token_required",
                         "open the URL that `recoverable dashboard` printed (it carries the "
                         "access token)")
            return
        session = self.sessions.open()
        # No Domain (this host only), no Expires (gone with the browser session), no
        # Secure: it is served over http on loopback (see the module's docstring).
        cookie = f"{self.cookie}={session}; HttpOnly; SameSite=Strict; Path=/"
        await _see_other(send, without_token(scope), cookie)


def _query_token(scope: Scope) -> str | None:
    query = parse_qsl(bytes(scope.get("query_string", b"")).decode("latin-1"),
                      keep_blank_values=True)
    return next((value for key, value in query if key == "token"), None)


def same_origin_path(path: str) -> str:
    """``path`` as a redirect target that stays on this dashboard: one ``/`` first, then
    the path percent-encoded. Browsers read a backslash as a slash, so a decoded
    ``/\\evil.example`` (or ``//evil.example``) sent back as it is would be a link to
    another site; encoding also keeps CR, LF and non-Latin-1 characters out of the
    header."""
    return "/" + quote(path.lstrip("/\\"), safe="/:@!$&'()*+,;=")


def without_token(scope: Scope) -> str:
    """The request's own path and query, minus ``token`` (kept byte for byte otherwise)."""
    raw = bytes(scope.get("query_string", b"")).decode("latin-1")
    kept = [part for part in raw.split("&")
            if part and unquote_plus(part.partition("=")[0]) != "token"]
    query = "&".join(quote(part, safe="=&+%/:@!$'()*,;") for part in kept)
    return same_origin_path(scope["path"]) + ("?" + query if query else "")


async def _see_other(send: Send, location: str, cookie: str | None = None) -> None:
    headers = [(b"location", location.encode("ascii")), (b"content-length", b"0")]
    if cookie is not None:
        headers.append((b"set-cookie", cookie.encode("latin-1")))
    await send({"type": "http.response.start", "status": 303, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


async def _plain(send: Send, status: int, code: str, message: str) -> None:
    body = f"{status} {code}: {message}\n".encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
    ]})
    await send({"type": "http.response.body", "body": body})
