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


def test_jiter_partial_mode_s_leniency_is_not_let_through() -> None:
    """jiter's partial mode alone reads ``[1 2]`` as ``[1]`` and shows a number cut by the
    end of the text; the strict pass and the open-number cut keep the promises."""
    for text in ("[1 2]", "[1 2", '{"a": 1 "b": 2}', '{"a": 1}}', "[true false]", '"a" x',
                 '{"a": [1] x', "1 2", '{"a": NaN}', '{"a": Infinity}'):
        assert parse_partial(text) is None, text
    assert parse_partial("12") is None  # may still become 123
    assert parse_partial("12 ") == 12
    assert parse_partial("[5, 12") == [5]
    assert parse_partial('{"a": 1, "a": 12') == {"a": 1}  # the open repeat is not shown
    assert parse_partial('{"s": "x 12') == {"s": "x 12"}  # digits inside a string
    assert parse_partial('{"a": 5, "x 12') == {"a": 5}  # digits inside an open key
    assert parse_partial("[true") == [True] and parse_partial("[fals") == []


def test_the_depth_bound_holds_between_ours_and_jiter_s_own_limit() -> None:
    """jiter's own nesting limit is 200; ours (64) is checked on the value read."""
    for depth in (MAX_PARTIAL_DEPTH + 1, 100, 199, 250):
        assert parse_partial("[" * depth) is None, depth
        assert parse_partial('{"a": ' * depth + "1" + "}" * depth) is None, depth
    deep = '{"a": ' * MAX_PARTIAL_DEPTH + '"x"' + "}" * MAX_PARTIAL_DEPTH
    assert parse_partial(deep) is not None
    # Many containers side by side are not deep: only nesting counts.
    wide = json.dumps([[{"k": [i]}] for i in range(500)])
    assert parse_partial(wide) == json.loads(wide)
    assert parse_partial(wide[:-3]) is not None


def test_the_size_bound_and_odd_text_give_none() -> None:
    assert parse_partial("[" + "1," * (MAX_PARTIAL_CHARS // 2)) is None  # past the size
    assert parse_partial('"\\ud800"') is None  # a lone surrogate escape: jiter refuses it
    assert parse_partial('["a\ud800"]') is None  # a lone surrogate in the str itself
    assert parse_partial(b"[1]") is None  # type: ignore[arg-type]  # not a str
