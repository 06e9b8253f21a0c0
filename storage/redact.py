"""Store URLs and database driver messages without their secrets (fail closed).

A ``postgresql://`` URL may hold a password, and users write it unencoded: with a ``/``,
``?``, ``#`` or ``@`` in it a URL parser (``urllib``, and libpq too) splits the string
at the wrong place and shows part of the password as a host, a path or a query. So the
URL is redacted from its RAW text, never from a parse:

- everything after ``scheme://`` up to the LAST ``@`` of the string is the user
  information (a host, a port, a database name never holds an ``@``); the user name (up
  to its first ``:``) is shown, the rest is ``***``. An ``@`` in the query (rare) makes
  more than the password hidden: the safe side.
- ``password=`` and ``sslpassword=`` query values are ``***`` (up to the next ``&``).
- a libpq ``key=value`` string's ``password`` values are ``***`` too (the stores take
  URLs only; an operator may still paste one).

:func:`scrub` cleans a driver message (psycopg's, libpq's) before it is shown: every
password of the URL it came from (as written, percent-decoded, and as libpq, urllib or
the query read it) and of every URL this process connected with (:func:`remember`) is
replaced by ``***``, any URL in it redacted; when libpq reads the URL differently from
the rule above (an unencoded ``@`` or ``/`` in the password), the message may show a
fragment of the password as a host name, so it is not shown at all. :func:`brief` keeps
the first line, bounded. Pure functions; no I/O.
"""

from __future__ import annotations

import re
import threading
import urllib.parse
from typing import Final

__all__ = [
    "MAX_REASON",
    "REDACTED",
    "brief",
    "is_ambiguous",
    "redact_url",
    "remember",
    "scrub",
    "secrets_of",
    "url_host",
]

REDACTED: Final = "***"
MAX_REASON: Final = 300  # characters of a driver message shown at most
UNREADABLE: Final = (
    "not shown: libpq reads this URL differently (an unencoded '@' or '/' in its "
    "password? write them %40 and %2F)"
)

_SCHEME: Final = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# A password in a URL's query (``?password=...&``), and its value.
_QUERY_SECRET: Final = re.compile(r"(?i)((?:^|[?&])(?:ssl)?password=)([^&]*)")
# A password in a libpq key=value string (``password=x``, ``password = 'a b'``).
_KEYWORD_SECRET: Final = re.compile(
    r"(?i)(\b(?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s]*)"
)
# A URL inside a message (a driver may quote the one it was given).
_URL_IN_TEXT: Final = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^\s\"']*")

_SEEN_LOCK: Final = threading.Lock()
_SEEN: set[str] = set()  # the passwords of every URL this process connected with


def _split(url: str) -> tuple[str, str | None, str] | None:
    """``(scheme://, userinfo or None, the rest)`` by the rule of the module docstring;
    None for a string that is not a URL."""
    match = _SCHEME.match(url)
    if match is None:
        return None
    body = url[match.end():]
    userinfo, at, rest = body.rpartition("@")
    if not at:
        return match.group(), None, body
    return match.group(), userinfo, rest


def _redact_query(text: str) -> str:
    return _QUERY_SECRET.sub(lambda found: found.group(1) + REDACTED, text)


def redact_url(url: str) -> str:
    """The store location as it may be shown: a URL without its password (``user:***@``)
    and password query values; a libpq ``key=value`` string without its password; a
    directory path as it is."""
    parts = _split(url)
    if parts is None:
        return _KEYWORD_SECRET.sub(lambda found: found.group(1) + REDACTED, url)
    prefix, userinfo, rest = parts
    rest = _redact_query(rest)
    if userinfo is None:
        return prefix + rest
    user, colon, _ = userinfo.partition(":")
    shown = _redact_query(user) + (f":{REDACTED}" if colon else "")
    return f"{prefix}{shown}@{rest}"


def url_host(url: str) -> str | None:
    """The host part of a URL by the same rule (no user information, no path): what
    may be shown of where a store is. None when there is none (a local socket)."""
    parts = _split(url)
    if parts is None:
        return None
    hostport = re.split(r"[/?#]", parts[2], maxsplit=1)[0]
    return hostport or None


def _libpq_userinfo(url: str) -> str | None:
    """The user information as libpq reads it: up to the first ``@`` if no ``/`` comes
    before it."""
    match = _SCHEME.match(url)
    if match is None:
        return None
    body = url[match.end():]
    cut = re.search(r"[@/]", body)
    if cut is None or cut.group() != "@":
        return None
    return body[: cut.start()]


def is_ambiguous(url: str) -> bool:
    """libpq would read the user information differently from :func:`redact_url`'s rule
    (an unencoded ``@`` or ``/`` in the password, or an ``@`` after the host): its
    messages may then show a fragment of the password."""
    parts = _split(url)
    if parts is None:
        return False
    return parts[1] != _libpq_userinfo(url)


def _password(userinfo: str | None) -> str | None:
    if userinfo is None or ":" not in userinfo:
        return None
    return userinfo.partition(":")[2]


def secrets_of(url: str) -> frozenset[str]:
    """Every string of ``url`` that is or may be its password: as written, decoded and
    encoded, as this module, libpq and urllib read it, and the query's password values."""
    found: list[str | None] = []
    parts = _split(url)
    if parts is None:
        found += [hit.group(2).strip("'") for hit in _KEYWORD_SECRET.finditer(url)]
    else:
        found.append(_password(parts[1]))
        found.append(_password(_libpq_userinfo(url)))
        try:
            found.append(urllib.parse.urlsplit(url).password)
        except ValueError:
            pass
        found += [hit.group(2) for hit in _QUERY_SECRET.finditer(url.partition("?")[2])]
        found += [hit.group(2) for hit in _QUERY_SECRET.finditer(parts[2])]
    secrets: set[str] = set()
    for value in found:
        if value:
            decoded = urllib.parse.unquote(value)
            secrets.update({
                value, decoded, urllib.parse.unquote_plus(value),
                urllib.parse.quote(decoded, safe=""), urllib.parse.quote_plus(decoded),
            })
    return frozenset(value for value in secrets if value)


def remember(url: str) -> None:
    """Scrub ``url``'s passwords from every later message of this process, wherever it
    comes from (called before connecting with it)."""
    secrets = secrets_of(url)
    if secrets:
        with _SEEN_LOCK:
            _SEEN.update(secrets)


def scrub(text: str, url: str | None = None) -> str:
    """``text`` (a driver's message) with no password of ``url`` or of a URL this
    process connected with, and every URL in it redacted; :data:`UNREADABLE` when libpq
    read ``url`` differently from :func:`redact_url` (see :func:`is_ambiguous`)."""
    if url is not None and is_ambiguous(url):
        return UNREADABLE
    with _SEEN_LOCK:
        secrets = set(_SEEN)
    if url is not None:
        secrets |= secrets_of(url)
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    text = _KEYWORD_SECRET.sub(lambda found: found.group(1) + REDACTED, text)
    return _URL_IN_TEXT.sub(lambda found: redact_url(found.group()), text)


def brief(text: str, limit: int = MAX_REASON) -> str:
    """The first non-empty line of ``text``, at most ``limit`` characters."""
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"
