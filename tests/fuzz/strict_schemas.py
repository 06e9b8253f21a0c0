"""Hypothesis strategies for schemas the strict rules accept, and the end-to-end check.

``strict_schemas()`` draws OpenAI strict-mode schemas with a finite instance: an object
root, ``additionalProperties: false`` and every property required on every object,
nullable values as ``["T", "null"]`` or ``anyOf`` with null, ``$defs`` with ``$ref``
(also recursive, always with a way out: required references only go "down" the list of
definitions, references back to a definition or to the root ``#`` sit behind a nullable
branch or an array that may be empty), enums, consts, arrays, nested objects, and
satisfiable string/number constraints.

``check_accepted`` runs every check a contract must pass once ``contract_for`` accepted
it: a synthesized value validates, mutated ones are rejected with a schema path, the
``format_hash`` is the same from a second, cache-free build, and the fixture's answer
stream parses to a completed text that validates.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import msgspec
import pytest
from hypothesis import strategies as st

import recoverable
from recoverable.contract import OutputInvalid, ResponseContract, _clear_caches, contract_for
from recoverable.fixture.replies import events_for
from recoverable.outcome import Completed
from recoverable.testing import Reply, synthesize_value
from recoverable.transport.events import ResponseStream

NAMES = st.sampled_from(["a", "b", "label", "score", "items", "x y", "ü", "$ref", "type", "n"])
_STRING_FORMATS = ["date-time", "date", "email", "uuid", "uri"]


def _int_schema(draw: st.DrawFn) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    if draw(st.booleans()):
        low = draw(st.integers(-1000, 1000))
        schema["minimum"] = low
        if draw(st.booleans()):
            step = draw(st.integers(1, 9))
            schema["multipleOf"] = step
            schema["maximum"] = low + step * draw(st.integers(1, 5))
        elif draw(st.booleans()):
            schema["maximum"] = low + draw(st.integers(0, 50))
    if draw(st.integers(0, 4)) == 0:
        schema["exclusiveMaximum"] = schema.get("minimum", 0) + draw(st.integers(3, 20))
        schema.pop("maximum", None)
    return schema


def _number_schema(draw: st.DrawFn) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "number"}
    if draw(st.booleans()):
        low = draw(st.integers(-100, 100)) / 4
        key = draw(st.sampled_from(["minimum", "exclusiveMinimum"]))
        schema[key] = low
        if draw(st.booleans()):
            schema["maximum"] = low + draw(st.integers(1, 40))
    elif draw(st.booleans()):
        schema["maximum"] = draw(st.integers(-100, 100)) / 2
    return schema


def _string_schema(draw: st.DrawFn) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    choice = draw(st.integers(0, 4))
    if choice == 1:
        schema["format"] = draw(st.sampled_from(_STRING_FORMATS))
    elif choice == 2:
        low = draw(st.integers(0, 12))
        schema["minLength"] = low
        schema["maxLength"] = low + draw(st.integers(0, 12))
    elif choice == 3:
        schema["pattern"] = draw(st.sampled_from(["^[a-z]+$", "ample", "^e"]))
    return schema


def _scalar(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(
        ["string", "string", "integer", "number", "boolean", "null", "enum", "const"]))
    if kind == "string":
        schema = _string_schema(draw)
    elif kind == "integer":
        schema = _int_schema(draw)
    elif kind == "number":
        schema = _number_schema(draw)
    elif kind == "enum":
        values = draw(st.lists(st.text(max_size=6) | st.integers(-9, 9), min_size=1,
                               max_size=4, unique_by=lambda v: (type(v), v)))
        schema = {"enum": values}
        if all(isinstance(v, str) for v in values) and draw(st.booleans()):
            schema["type"] = "string"
    elif kind == "const":
        schema = {"const": draw(st.none() | st.booleans() | st.integers(-5, 5)
                                | st.text(max_size=5) | st.just({"k": [1, "two"]}))}
    else:
        schema = {"type": kind}
    if draw(st.integers(0, 5)) == 0:
        schema["description"] = draw(st.text(max_size=20))
    return schema


class _Ctx:
    """Definitions drawn so far; ``index`` is the definition being built (None: the root)."""

    def __init__(self, n_defs: int) -> None:
        self.n_defs = n_defs
        self.index: int | None = None

    def down_refs(self) -> list[str]:
        """Definitions a *required* reference may name: strictly later ones (a DAG)."""
        start = 0 if self.index is None else self.index + 1
        return [f"#/$defs/D{i}" for i in range(start, self.n_defs)]

    def any_refs(self) -> list[str]:
        """References allowed behind a way out (nullable / empty-able array): any."""
        return ["#", *(f"#/$defs/D{i}" for i in range(self.n_defs))]


def _nullable(draw: st.DrawFn, schema: dict[str, Any]) -> dict[str, Any]:
    kind = schema.get("type")
    if isinstance(kind, str) and kind != "null" and draw(st.booleans()) and (
        "enum" not in schema and "const" not in schema
    ):
        return {**schema, "type": [kind, "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


def _value(draw: st.DrawFn, depth: int, ctx: _Ctx) -> dict[str, Any]:
    kinds = ["scalar", "scalar", "nullable", "array"]
    if depth > 0:
        kinds += ["object", "anyOf"]
    if ctx.down_refs():
        kinds.append("ref")
    if ctx.any_refs():
        kinds += ["recursive_nullable", "recursive_array"]
    kind = draw(st.sampled_from(kinds))
    if kind == "scalar":
        return _scalar(draw)
    if kind == "nullable":
        inner = _value(draw, depth - 1, ctx) if depth > 0 else _scalar(draw)
        return _nullable(draw, inner)
    if kind == "array":
        inner = _value(draw, depth - 1, ctx) if depth > 0 else _scalar(draw)
        schema: dict[str, Any] = {"type": "array", "items": inner}
        if draw(st.booleans()):
            low = draw(st.integers(0, 2))
            schema["minItems"] = low
            if draw(st.booleans()):
                schema["maxItems"] = low + draw(st.integers(0, 2))
        return schema
    if kind == "object":
        return _object(draw, depth - 1, ctx)
    if kind == "anyOf":
        return {"anyOf": [_value(draw, depth - 1, ctx) for _ in range(draw(st.integers(1, 3)))]}
    if kind == "ref":
        return {"$ref": draw(st.sampled_from(ctx.down_refs()))}
    ref = {"$ref": draw(st.sampled_from(ctx.any_refs()))}
    if kind == "recursive_nullable":
        return {"anyOf": [ref, {"type": "null"}]}
    return {"type": "array", "items": ref, "maxItems": draw(st.integers(0, 3))} if draw(
        st.booleans()) else {"type": "array", "items": ref}


def _object(draw: st.DrawFn, depth: int, ctx: _Ctx) -> dict[str, Any]:
    names = draw(st.lists(NAMES, max_size=4, unique=True))
    props = {name: _value(draw, depth, ctx) for name in names}
    schema: dict[str, Any] = {"type": "object", "properties": props, "required": list(props),
                              "additionalProperties": False}
    if draw(st.integers(0, 4)) == 0:
        schema["description"] = draw(st.text(max_size=20))
    return schema


@st.composite
def strict_schemas(draw: st.DrawFn, max_depth: int = 3) -> dict[str, Any]:
    """A strict-mode schema with a finite instance (see the module docstring)."""
    ctx = _Ctx(draw(st.integers(0, 3)))
    defs: dict[str, Any] = {}
    for i in reversed(range(ctx.n_defs)):  # later definitions first: they are referenced
        ctx.index = i
        defs[f"D{i}"] = _object(draw, draw(st.integers(0, max_depth - 1)), ctx)
    ctx.index = None
    root = _object(draw, draw(st.integers(0, max_depth)), ctx)
    if defs:
        root["$defs"] = dict(sorted(defs.items()))
    return root


@st.composite
def strict_property_schemas(draw: st.DrawFn) -> dict[str, Any]:
    """One property schema of a strict root without definitions."""
    return _value(draw, draw(st.integers(0, 2)), _Ctx(0))


# -- the end-to-end check of an accepted contract ---------------------------------------


def _objects_in(value: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _rejected_with_a_path(contract: ResponseContract, value: Any) -> None:
    with pytest.raises(OutputInvalid) as info:
        contract.validate(json.dumps(value))
    assert info.value.kind == "schema_violation", info.value
    assert " at schema path /" in info.value.detail or info.value.detail.startswith(
        ("Expected", "Object missing", "the output")), info.value.detail


def check_accepted(contract: ResponseContract, name: str, schema: Any, pick: int) -> None:
    """Everything an accepted contract must do; ``pick`` chooses where to mutate."""
    # A synthesized value validates (CannotSynthesize is not swallowed here).
    value = synthesize_value(contract.schema)
    text = json.dumps(value)  # spaced separators: the fixture encodes compactly
    payload = contract.validate(text)
    assert payload == text.encode()
    assert msgspec.json.decode(payload) == value

    # Mutated values are rejected, with a schema path in the detail.
    objects = _objects_in(value)
    assert objects, "the root of a strict schema is an object"
    broken = copy.deepcopy(value)
    target = _objects_in(broken)[pick % len(objects)]
    target["zz_not_in_the_schema"] = 1  # every object is closed (or an exact const/enum)
    _rejected_with_a_path(contract, broken)
    _rejected_with_a_path(contract, [value])  # the root must be an object
    if value:
        first = next(iter(value))
        _rejected_with_a_path(contract, {k: v for k, v in value.items() if k != first})

    # format_hash: deterministic across two builds (caches cleared, a fresh copy).
    _clear_caches()
    again = contract_for(recoverable.JsonSchema(name, copy.deepcopy(schema)))
    assert again is not contract
    assert again.format_hash == contract.format_hash
    canonical = msgspec.json.encode(
        {"name": name, "schema": contract.schema, "strict": True}, order="sorted")
    assert contract.format_hash == hashlib.sha256(canonical).hexdigest()

    # The fixture's answer stream: parsed by the real event parser, it completes with a
    # text that validates; a schema_violation reply's text does not.
    request = {"model": "m", "text": {"format": contract.text_format()}}
    stream = ResponseStream(max_events=10_000)
    outcome = None
    for event in events_for(Reply.synthesize(), request, serial=1, created_at=0):
        outcome = stream.feed(msgspec.json.encode(event))
    assert isinstance(outcome, Completed), outcome
    assert msgspec.json.decode(outcome.text) == value
    assert contract.validate(outcome.text)
    violation = events_for(Reply.schema_violation(), request, serial=2, created_at=0)
    bad = violation[-1]["response"]["output"][0]["content"][0]["text"]
    with pytest.raises(OutputInvalid):
        contract.validate(bad)
