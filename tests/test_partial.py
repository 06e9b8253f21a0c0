"""The partial-JSON reader of live views (issue 16): every prefix of a JSON text reads as
a prefix of its value, never raises, and stays within its bounds."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

import recoverable
from recoverable.partial import MAX_PARTIAL_CHARS, MAX_PARTIAL_DEPTH, PartialView, parse_partial

_SCALARS = (
    st.none() | st.booleans() | st.integers(-10**12, 10**12)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                  max_size=4),
    max_leaves=20,
)


def _prefix_of(shown: Any, final: Any) -> bool:
    """``shown`` is what a prefix of ``final``'s text may show: cut strings, fewer items."""
    if isinstance(final, dict):
        return isinstance(shown, dict) and all(
            key in final and _prefix_of(value, final[key]) for key, value in shown.items()
        )
    if isinstance(final, list):
        return isinstance(shown, list) and len(shown) <= len(final) and all(
            _prefix_of(item, whole) for item, whole in zip(shown, final, strict=False)
        )
    if isinstance(final, str):
        return isinstance(shown, str) and final.startswith(shown)
    return bool(shown == final)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _JSON, max_size=5), st.booleans())
def test_every_prefix_reads_as_a_prefix_of_the_value(value: Any, pretty: bool) -> None:
    text = json.dumps(value, indent=1 if pretty else None, ensure_ascii=False)
    final = json.loads(text)
    for end in range(len(text) + 1):
        shown = parse_partial(text[:end])
        if shown is not None:
            assert _prefix_of(shown, final), (text[:end], shown)
    assert parse_partial(text) == final


def test_fields_so_far() -> None:
    text = '{"answer": 42, "note": "six times sev'
    assert parse_partial(text) == {"answer": 42, "note": "six times sev"}
    assert parse_partial('{"answer": 4') == {}  # a number only once complete
    assert parse_partial('{"answer": 42,') == {"answer": 42}
    assert parse_partial('{"answer": 42, "no') == {"answer": 42}  # a key only once complete
    assert parse_partial('{"items": [1, 2, {"a": tr') == {"items": [1, 2, {}]}
    assert parse_partial('{"a": 1.') == {}
    assert parse_partial('{"a": 1.5e') == {}
    assert parse_partial('{"a": -') == {}
    assert parse_partial('{"a": nul') == {}
    assert parse_partial('{"a": null}') == {"a": None}


def test_a_string_cut_inside_an_escape_drops_the_unfinished_escape() -> None:
    assert parse_partial('{"s": "a\\') == {"s": "a"}
    assert parse_partial('{"s": "a\\\\') == {"s": "a\\"}
    assert parse_partial('{"s": "a\\u00') == {"s": "a"}
    assert parse_partial('{"s": "a\\u00e9') == {"s": "a\u00e9"}
    assert parse_partial('{"s": "\\ud83d') == {"s": ""}  # half a surrogate pair
    assert parse_partial('{"s": "\\ud83d\\ude00') == {"s": "\U0001f600"}


def test_not_json_and_past_the_bounds_is_none() -> None:
    for text in ("", "   ", "hello", "{]", '{"a" 1}', "[1 2]", '{"a": 1} x', "--1", "01x",
                 '{"a": "\x01"}', "{1: 2}", "tru e"):
        assert parse_partial(text) is None, text
    assert parse_partial("[" * (MAX_PARTIAL_DEPTH + 1)) is None
    assert parse_partial("[" * MAX_PARTIAL_DEPTH) is not None
    long = '{"s": "' + "x" * MAX_PARTIAL_CHARS
    assert parse_partial(long) is None
    assert parse_partial(long[:MAX_PARTIAL_CHARS]) == {"s": "x" * (MAX_PARTIAL_CHARS - 7)}


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_any_text_never_raises(text: str) -> None:
    parse_partial(text)


def test_the_view_is_a_public_frozen_value() -> None:
    view = recoverable.PartialView(text='{"a": 1', partial={}, attempt=1, sequence=2)
    assert isinstance(view, PartialView)
    assert msgspec.json.decode(msgspec.json.encode(view), type=PartialView) == view
