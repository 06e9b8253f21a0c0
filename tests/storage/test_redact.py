"""Issue 28 item 5: a store URL's password is never shown, whatever it holds.

``redact_url`` works on the raw text (an unencoded ``/ ? # @ :`` in a password makes a URL
parser split at the wrong place), and ``describe`` (every psycopg error shown by the
store and the CLI) scrubs the password from the driver's message. The driver messages
here are real: psycopg connecting with each hostile URL to a port nobody listens on.
"""

from __future__ import annotations

import re
import socket
import urllib.parse
from collections.abc import Iterator

import psycopg
import pytest

from recoverable.storage import redact
from recoverable.storage.pg_sql import describe
from recoverable.storage.store import redact_url

# (URL template, the password it holds as written); {port}: a closed port on 127.0.0.1.
HOSTILE = [
    ("postgresql://app:Sup3r/S3cret@127.0.0.1:{port}/jobs", "Sup3r/S3cret"),
    ("postgresql://app:Sup3r?S3cret@127.0.0.1:{port}/jobs", "Sup3r?S3cret"),
    ("postgresql://app:Sup3r#S3cret@127.0.0.1:{port}/jobs", "Sup3r#S3cret"),
    ("postgresql://app:Sup3r@S3cret@127.0.0.1:{port}/jobs", "Sup3r@S3cret"),
    ("postgresql://app:Sup3r:S3cret@127.0.0.1:{port}/jobs", "Sup3r:S3cret"),
    ("postgres://app:Wh0le/M1x?0f#a11@0f:th3m@127.0.0.1:{port}/jobs",
     "Wh0le/M1x?0f#a11@0f:th3m"),
    ("postgresql://app:Sup3r%2FS3cret%40x@127.0.0.1:{port}/jobs", "Sup3r%2FS3cret%40x"),
    ("postgresql://app:Plain5ecret@127.0.0.1:{port}/jobs", "Plain5ecret"),
    ("postgresql://app:Sup3r/S3cret@127.0.0.1:{port},127.0.0.2:{port}/jobs", "Sup3r/S3cret"),
    ("postgresql://app@127.0.0.1:{port}/jobs?sslmode=disable&password=Hunt3r2&application_name=probe",
     "Hunt3r2"),
    ("postgresql://app@127.0.0.1:{port}/jobs?password=Hunt3r%262#frag", "Hunt3r%262#frag"),
    # An '@' in the query: more than the password is hidden (the safe side of the rule).
    ("postgresql://127.0.0.1:{port}/jobs?user=me@corp&password=Hunt3r/9", "Hunt3r/9"),
]
QUERY_AT = HOSTILE[-1][0]
NO_SECRET = [
    "postgresql://app@127.0.0.1:{port}/jobs",
    "postgresql://127.0.0.1:{port}/jobs",
    "postgresql:///jobs?host=/var/run/postgresql",
]
KEY_VALUE = [
    ("host=127.0.0.1 port={port} user=app password=Sup3r/S3cret dbname=jobs", "Sup3r/S3cret"),
    ("host=127.0.0.1 port={port} password = 'Sup3r S3cret@x' dbname=jobs", "Sup3r S3cret@x"),
]


def fragments(password: str) -> set[str]:
    """The password, decoded, and every piece of it a URL parser could show on its own."""
    decoded = urllib.parse.unquote(password)
    pieces = {password, decoded}
    for text in (password, decoded):
        pieces.update(piece for piece in re.split(r"[/?#@:&]", text) if len(piece) >= 3)
    return pieces


def assert_hidden(text: str, password: str) -> None:
    for piece in fragments(password):
        assert piece not in text, (piece, text)


@pytest.fixture(scope="module")
def closed_port() -> Iterator[int]:
    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize(("template", "password"), HOSTILE)
def test_a_hostile_url_is_shown_without_its_password(template: str, password: str) -> None:
    url = template.format(port=5432)
    shown = redact_url(url)
    assert_hidden(shown, password)
    assert shown.startswith(url.split("://")[0] + "://")
    if template != QUERY_AT:
        assert "127.0.0.1:5432" in shown  # where the store is stays readable
        assert "app" in shown  # so does the user
    assert redact_url(shown) == shown  # redacting twice changes nothing
    assert_hidden(redact.scrub(f"cannot reach {url} now", url), password)


@pytest.mark.parametrize(("template", "password"), HOSTILE)
def test_the_drivers_own_message_never_shows_the_password(
    template: str, password: str, closed_port: int
) -> None:
    url = template.format(port=closed_port)
    with pytest.raises(psycopg.Error) as caught:
        psycopg.connect(url, connect_timeout=5)
    described = describe(caught.value, url)
    assert_hidden(described, password)
    assert described.startswith(type(caught.value).__name__)
    assert "\n" not in described and len(described) <= 400
    if not redact.is_ambiguous(url):  # libpq read the URL as written: its reason is told
        assert "refused" in described.lower() or "failed" in described.lower(), described


@pytest.mark.parametrize("template", NO_SECRET)
def test_a_url_without_a_password_is_shown_as_it_is(template: str) -> None:
    url = template.format(port=5432)
    assert redact_url(url) == url


@pytest.mark.parametrize(("template", "password"), KEY_VALUE)
def test_a_key_value_string_is_shown_without_its_password(
    template: str, password: str, closed_port: int
) -> None:
    conninfo = template.format(port=closed_port)
    shown = redact_url(conninfo)
    assert_hidden(shown, password)
    assert "user=app" in shown or "host=127.0.0.1" in shown
    with pytest.raises(psycopg.Error) as caught:
        psycopg.connect(conninfo, connect_timeout=5)
    assert_hidden(describe(caught.value, conninfo), password)


def test_a_remembered_password_is_scrubbed_from_any_later_message() -> None:
    url = "postgresql://app:Rem3mbered/One@db.example/jobs"
    redact.remember(url)
    text = redact.scrub('server said: "Rem3mbered/One" and Rem3mbered%2FOne')
    assert_hidden(text, "Rem3mbered/One")


def test_a_directory_path_is_shown_as_it_is() -> None:
    for path in ("/var/lib/jobs.store", "relative/dir", "C:\\stores\\x"):
        assert redact_url(path) == path


def test_a_long_or_multi_line_reason_is_cut_to_one_bounded_line() -> None:
    assert redact.brief("\n  first line  \nsecond") == "first line"
    long = redact.brief("x" * 1000)
    assert len(long) == redact.MAX_REASON and long.endswith("…")
