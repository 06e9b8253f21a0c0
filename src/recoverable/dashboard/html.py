"""The small HTML pieces every dashboard page shares: times in UTC, ids cut to one line
with the whole value in their tooltip, links to an operation and tables of already
escaped cells. Every value given as text is escaped here."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable, Sequence
from html import escape
from urllib.parse import quote

__all__ = ["clipped", "clock", "full_time", "operation_link", "short_id", "table"]


def full_time(stamp: float | None) -> str:
    """A date and time in UTC, or "-"."""
    if stamp is None:
        return "-"
    moment = _dt.datetime.fromtimestamp(stamp, _dt.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def clock(stamp: float | None) -> str:
    """A short time of day (UTC) for the overview's tables, or "-"."""
    if stamp is None:
        return "-"
    return _dt.datetime.fromtimestamp(stamp, _dt.UTC).strftime("%H:%M:%S")


def short_id(owner_id: str) -> str:
    """An owner id, shortened (the whole id in its tooltip)."""
    return f'<code title="{escape(owner_id)}">{escape(owner_id[:12])}…</code>'


def clipped(value: str | None) -> str:
    """An id of any length (a response id may be hundreds of characters) on one line,
    cut with an ellipsis by the CSS so it never widens the page; the whole value is in
    its tooltip (and selectable)."""
    if value is None:
        return "<code>-</code>"
    return f'<code class="clip" title="{escape(value)}">{escape(value)}</code>'


def operation_link(operation_id: str) -> str:
    """The operation's id (clipped) as a link to its page."""
    return f'<a href="/operations/{quote(operation_id, safe="")}">{clipped(operation_id)}</a>'


def table(head: Sequence[str], rows: Iterable[Sequence[str]], *, empty: str,
          raw_head: bool = False, element_id: str = "") -> str:
    """A table of already escaped cells (``raw_head``: the head cells are HTML too), or
    the ``empty`` sentence; ``element_id`` names the table (its sentence: ``ID-empty``)."""
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>"
                   for row in rows)
    if not body:
        named = f' id="{escape(element_id)}-empty"' if element_id else ""
        return f'<p class="muted"{named}>{escape(empty)}</p>'
    named = f' id="{escape(element_id)}"' if element_id else ""
    return (f"<table{named}><tr>" + "".join(
        f"<th>{name if raw_head else escape(name)}</th>" for name in head) + "</tr>"
            + body + "</table>")
