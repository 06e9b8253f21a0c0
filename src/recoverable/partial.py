"""Partial views of a live operation: ephemeral, never a result.

A :class:`PartialView` is what ``async for view in live`` yields while a live operation
streams (``docs/live.md``): ``text`` is the output text of the current attempt so far,
``partial`` a best-effort reading of it as JSON (:func:`parse_partial`). A view is never
written to the store, never returned as the result and never part of a receipt: the
result is the validated, saved completion (``live.value``).

:func:`parse_partial` reads a prefix of a JSON text without I/O and within bounds: a
text longer than :data:`MAX_PARTIAL_CHARS` or nested deeper than
:data:`MAX_PARTIAL_DEPTH` gives ``None``, as does a text that is not a JSON prefix.

The reading is jiter's (the Rust JSON parser pydantic uses), in two passes, because its
partial mode alone does not keep these promises (jiter 0.19, measured):

- Partial mode stops quietly at the first syntax error and returns what it had:
  ``[1 2]`` reads ``[1]``, ``{"a": 1} x`` reads ``{"a": 1}``. So a strict pass runs
  first: a text is a JSON prefix exactly when the strict parser succeeds or its first
  error is the end of the text (``EOF while parsing ...``); any other error is None.
- Partial mode shows a number cut by the end of the text (``{"n": 4`` reads
  ``{"n": 4}`` though the text may go on as ``42``). A number still open at the end is
  cut off the text before the partial pass, so numbers show only once complete.
- Its nesting limit is fixed (200 levels); ours (64) is checked on the value read.

A string with a lone surrogate escape (``"\\ud800"``) is refused by jiter (None), where
Python's ``json`` reads it; it is not valid Unicode and no view is lost by it but that
text's. ``bench/partial_json.py`` measures this reader against the former hand-written one.
"""

from __future__ import annotations

import re
from typing import Any, Final

import jiter
import msgspec

__all__ = ["MAX_PARTIAL_CHARS", "MAX_PARTIAL_DEPTH", "PartialView", "parse_partial"]

# A view's text longer than this is not parsed (``partial`` is None): parsing is done
# for each view a consumer takes, so its cost stays bounded.
MAX_PARTIAL_CHARS: Final = 1 << 20
MAX_PARTIAL_DEPTH: Final = 64


class PartialView(msgspec.Struct, frozen=True, kw_only=True):
    """One ephemeral view of a live operation's output (never a result).

    ``text``: the output text of attempt number ``attempt`` received so far.
    ``partial``: best effort, the JSON value parsed from ``text`` so far (objects with the
    fields complete or started, strings cut where the text ends, numbers and literals
    only once complete), or None when nothing can be read yet, the text is not JSON,
    or it passes the bounds. It is not validated against the schema.
    ``sequence``: how many text deltas the live operation had received when the view was
    taken (it grows; a slow consumer sees it skip: intermediate views are dropped).
    """

    text: str
    partial: Any
    attempt: int
    sequence: int


# The first error of a strict parse that only says the text ended (a JSON prefix), and the
# one that says it ended inside a string (a number-looking end is then string text).
_ENDED: Final = "EOF while parsing"
_ENDED_IN_STRING: Final = "EOF while parsing a string"
# A run of number characters at the end, and what may come right before a number token.
_NUMBER_END = re.compile(r"[-+.0-9eE]+\Z")
_BEFORE_NUMBER: Final = frozenset("[,: \t\n\r")
_MISSING: Any = object()


def _without_open_number(text: str, strict_error: str | None) -> str:
    """``text`` with a number token still open at its end cut off (it may grow)."""
    if strict_error is not None and strict_error.startswith(_ENDED_IN_STRING):
        return text
    found = _NUMBER_END.search(text)
    if found is None:
        return text
    start = found.start()
    # After ``true``/``false`` the ``e`` is a literal's; inside a finished string the
    # strict pass would have gone past it. Only a token after a delimiter is a number.
    if start == 0 or text[start - 1] in _BEFORE_NUMBER:
        return text[:start]
    return text


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether containers nest more than ``limit`` deep in ``value`` (iterative)."""
    level: list[tuple[Any, int]] = [(value, 1)]
    while level:
        node, depth = level.pop()
        if depth > limit:
            return True
        items = node.values() if isinstance(node, dict) else node
        level.extend((item, depth + 1) for item in items if isinstance(item, dict | list))
    return False


def parse_partial(text: str) -> Any:
    """Best effort: the JSON value a prefix of a JSON text shows so far, or None.

    None for an empty text, a text that is not the beginning of one JSON value, one
    longer than ``MAX_PARTIAL_CHARS`` or nested deeper than ``MAX_PARTIAL_DEPTH``.
    Never raises for any text.
    """
    if not isinstance(text, str) or len(text) > MAX_PARTIAL_CHARS:
        return None
    try:
        data = text.encode()
    except UnicodeEncodeError:  # a lone surrogate in the str itself: not JSON text
        return None
    strict_error: str | None = None
    found: Any = _MISSING
    try:
        found = jiter.from_json(data, allow_inf_nan=False, cache_mode=False)
    except ValueError as exc:
        strict_error = str(exc)
        if not strict_error.startswith(_ENDED):
            return None  # a syntax error before the end: not a prefix of one JSON value
    cut = _without_open_number(text, strict_error)
    if cut is not text or found is _MISSING:
        if not cut.strip():
            return None
        try:
            found = jiter.from_json(
                cut.encode(), allow_inf_nan=False, cache_mode=False,
                partial_mode="trailing-strings",
            )
        except ValueError:  # nothing complete enough to show yet (``tr``, ``-``)
            return None
    if isinstance(found, dict | list) and (
        text.count("[") + text.count("{") > MAX_PARTIAL_DEPTH
        and _deeper_than(found, MAX_PARTIAL_DEPTH)
    ):
        return None
    return found
