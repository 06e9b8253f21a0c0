"""The hand-written partial-JSON reader ``recoverable.partial`` used before jiter: kept
here, unchanged, as the same-run baseline of ``bench/partial_json.py``."""

from __future__ import annotations

import json
import re
from typing import Any, Final

__all__ = ["parse_partial"]

# A view's text longer than this is not parsed (``partial`` is None): parsing is done
# for each view a consumer takes, so its cost stays bounded.
MAX_PARTIAL_CHARS: Final = 1 << 20
MAX_PARTIAL_DEPTH: Final = 64


class _Invalid(Exception):
    """The text is not a prefix of a JSON value (or passes the depth bound)."""


_MISSING: Any = object()  # a value that started but cannot be shown yet
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_STRING_BODY = re.compile(r'(?:[^"\\]|\\.)*', re.DOTALL)
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?[0-9]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")
_LITERALS: Final = {"t": ("true", True), "f": ("false", False), "n": ("null", None)}
# A string cut inside an escape: drop the unfinished escape before reading it.
_CUT_ESCAPE = re.compile(r"\\u[0-9a-fA-F]{0,3}$")


class _Reader:
    """A recursive reader of a JSON prefix; each value returns (value, complete)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def _skip(self) -> bool:
        """Skip whitespace; whether text remains."""
        end = _WHITESPACE.match(self.text, self.pos)
        assert end is not None
        self.pos = end.end()
        return self.pos < len(self.text)

    def value(self, depth: int) -> tuple[Any, bool]:
        if depth >= MAX_PARTIAL_DEPTH:
            raise _Invalid
        if not self._skip():
            return _MISSING, False
        char = self.text[self.pos]
        if char == "{":
            return self._object(depth)
        if char == "[":
            return self._array(depth)
        if char == '"':
            return self._string()
        if char in _LITERALS:
            word, literal = _LITERALS[char]
            rest = self.text[self.pos : self.pos + len(word)]
            if rest == word:
                self.pos += len(word)
                return literal, True
            if word.startswith(rest) and self.pos + len(rest) == len(self.text):
                return _MISSING, False
            raise _Invalid
        number = _NUMBER_PREFIX.match(self.text, self.pos)
        assert number is not None
        if number.end() == len(self.text):
            return _MISSING, False  # "12" may still become "123", "1." become "1.5"
        strict = _NUMBER.match(self.text, self.pos)
        if strict is None or strict.end() != number.end() or number.end() == self.pos:
            raise _Invalid
        self.pos = number.end()
        return json.loads(strict.group()), True

    def _string(self) -> tuple[Any, bool]:
        start = self.pos
        body = _STRING_BODY.match(self.text, start + 1)
        assert body is not None
        end = body.end()
        try:
            if end < len(self.text) and self.text[end] == '"':  # the closing quote
                self.pos = end + 1
                return json.loads(self.text[start : end + 1]), True
            # Cut by the end of the text (a lone backslash there is left out by the match).
            self.pos = len(self.text)
            cut = self.text[start:end]
            try:
                shown: str = json.loads(cut + '"')
            except ValueError:
                shown = json.loads(_CUT_ESCAPE.sub("", cut) + '"')  # inside a \\uXXXX
        except ValueError:  # a control character, a bad escape
            raise _Invalid from None
        if shown and "\ud800" <= shown[-1] <= "\udbff":
            shown = shown[:-1]  # half of a surrogate pair: wait for the other half
        return shown, False

    def _object(self, depth: int) -> tuple[Any, bool]:
        self.pos += 1
        found: dict[str, Any] = {}
        if not self._skip():
            return found, False
        if self.text[self.pos] == "}":
            self.pos += 1
            return found, True
        while True:
            if self.text[self.pos] != '"':
                raise _Invalid
            key, complete = self._string()
            if not complete or not self._skip():
                return found, False
            if self.text[self.pos] != ":":
                raise _Invalid
            self.pos += 1
            item, complete = self.value(depth + 1)
            if item is not _MISSING:
                found[key] = item
            if not complete or not self._skip():
                return found, False
            char = self.text[self.pos]
            self.pos += 1
            if char == "}":
                return found, True
            if char != "," or not self._skip():
                if char != ",":
                    raise _Invalid
                return found, False

    def _array(self, depth: int) -> tuple[Any, bool]:
        self.pos += 1
        found: list[Any] = []
        if not self._skip():
            return found, False
        if self.text[self.pos] == "]":
            self.pos += 1
            return found, True
        while True:
            item, complete = self.value(depth + 1)
            if item is not _MISSING:
                found.append(item)
            if not complete or not self._skip():
                return found, False
            char = self.text[self.pos]
            self.pos += 1
            if char == "]":
                return found, True
            if char != ",":
                raise _Invalid
            if not self._skip():
                return found, False


def parse_partial(text: str) -> Any:
    """Best effort: the JSON value a prefix of a JSON text shows so far, or None.

    None for an empty text, a text that is not the beginning of one JSON value, one
    longer than ``MAX_PARTIAL_CHARS`` or nested deeper than ``MAX_PARTIAL_DEPTH``.
    Never raises for any text.
    """
    if not isinstance(text, str) or len(text) > MAX_PARTIAL_CHARS:
        return None
    reader = _Reader(text)
    try:
        found, complete = reader.value(0)
        if complete and reader._skip():
            return None  # text after a complete value: not one JSON value
    except _Invalid:
        return None
    except RecursionError:  # cannot happen within the depth bound; fail closed anyway
        return None
    return None if found is _MISSING else found
