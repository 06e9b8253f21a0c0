"""Deterministic schema-valid values for the fixture provider (and schema violations).

``synthesize_value`` makes a deterministic value valid against a request's
``text.format.schema``; ``violate`` makes one that is not. A schema no finite
value can answer raises ``CannotSynthesize`` (the real API's 400).
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import jsonschema_rs
import msgspec

from recoverable.errors import InvalidRequest
from recoverable.schema_graph import (
    SchemaGraph,
    min_items,
    required_names,
    resolve_pointer,
    type_names,
)

__all__ = [
    "MAX_SYNTH_DEPTH",
    "MAX_SYNTH_VALUES",
    "CannotSynthesize",
    "synthesize_text",
    "synthesize_value",
    "violate",
]

MAX_SYNTH_DEPTH = 128
MAX_SYNTH_VALUES = 100_000
_GRAPHS_SIZE = 64


class CannotSynthesize(InvalidRequest):
    """The fixture cannot build a value for this schema (none exists, or it is too large).

    The fixture answers such a request as the real API answers an unusable schema:
    HTTP 400 ``invalid_request_error`` with code ``invalid_json_schema``.
    """

    code = "cannot_synthesize"


class _Analysis:
    """A private copy of a schema, its graph and its compiled validator (cached by bytes)."""

    def __init__(self, schema_bytes: bytes) -> None:
        self.root: Any = msgspec.json.decode(schema_bytes)
        self.graph = SchemaGraph(self.root)
        try:
            self.validator: Any = jsonschema_rs.Draft202012Validator(self.root, offline=True)
        except (ValueError, TypeError, OverflowError):
            self.validator = None
        # The synthesized value as JSON text, once made: synthesis is deterministic, so
        # a provider answering the same schema thousands of times makes it once.
        self.text: str | None = None


_analyses: OrderedDict[bytes, _Analysis] = OrderedDict()


def _analysis(schema: Any) -> _Analysis:
    try:
        key = msgspec.json.encode(schema, order="sorted")
    except (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError):
        raise CannotSynthesize("the schema is not JSON") from None
    found = _analyses.get(key)
    if found is None:
        found = _Analysis(key)
        _analyses[key] = found
        while len(_analyses) > _GRAPHS_SIZE:
            _analyses.popitem(last=False)
    else:
        _analyses.move_to_end(key)
    return found


def synthesize_value(schema: Any) -> Any:
    """A deterministic value valid for ``schema``, or ``CannotSynthesize``.

    Bounded: it follows only branches known to end (see ``recoverable.schema_graph``),
    stops at ``MAX_SYNTH_DEPTH`` nesting or ``MAX_SYNTH_VALUES`` values, and checks the
    result against the schema (constraints it does not model are reported, not sent).
    """
    if schema is True or not isinstance(schema, Mapping):
        return {}
    return _synthesize(_analysis(schema))


def synthesize_text(schema: Any) -> str:
    """``synthesize_value(schema)`` as JSON text, cached with the schema's analysis (the
    fixture's per-request path: the same schema answered many times is synthesized once)."""
    if schema is True or not isinstance(schema, Mapping):
        return "{}"
    analysis = _analysis(schema)
    if analysis.text is None:
        analysis.text = msgspec.json.encode(_synthesize(analysis)).decode()
    return analysis.text


def _synthesize(analysis: _Analysis) -> Any:
    reason = analysis.graph.no_finite_instance()
    if reason is not None:
        raise CannotSynthesize(reason)
    value = _Synthesizer(analysis.graph).value(analysis.root, analysis.graph.order(analysis.root))
    if analysis.validator is None:
        raise CannotSynthesize("the schema is not a valid JSON Schema")
    if not analysis.validator.is_valid(value):
        raise CannotSynthesize(
            "the fixture's synthesized value does not satisfy the schema "
            "(constraints it cannot meet, or that no value meets)"
        )
    return value


class _Synthesizer:
    def __init__(self, graph: SchemaGraph) -> None:
        self.graph = graph
        self.values = 0

    def _safe(self, schema: Any, bound: int | None) -> bool:
        """Whether ``schema`` is inhabited before ``bound`` (so recursion into it ends)."""
        order = self.graph.order(schema)
        return order is not None and (bound is None or order < bound)

    def _child(self, schema: Any, depth: int) -> Any:
        if depth > MAX_SYNTH_DEPTH:
            raise CannotSynthesize(
                f"the smallest value of the schema nests deeper than {MAX_SYNTH_DEPTH}"
            )
        return self.value(schema, self.graph.order(schema), depth)

    def value(self, schema: Any, bound: int | None, depth: int = 0) -> Any:
        self.values += 1
        if self.values > MAX_SYNTH_VALUES:
            raise CannotSynthesize(
                f"the smallest value of the schema has more than {MAX_SYNTH_VALUES} parts"
            )
        if schema is True or not isinstance(schema, Mapping):
            return None
        if bound is None:
            bound = self.graph.order(schema)
        if "const" in schema:
            return _copy(schema["const"])
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return _copy(enum[0])
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = resolve_pointer(self.graph.root, ref)
            if target is None:
                raise CannotSynthesize(f"unresolvable $ref at {self.graph.path(schema)}")
            return self._child(target, depth + 1)
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            if isinstance(options, list) and options:
                for option in options:  # the first branch that is known to end
                    if self._safe(option, bound):
                        return self._child(option, depth + 1)
                raise CannotSynthesize(f"no {key} branch ends at {self.graph.path(schema)}")
        all_of = schema.get("allOf")
        if isinstance(all_of, list) and all_of:
            merged: dict[str, Any] = {}
            for part in all_of:
                if isinstance(part, Mapping):
                    merged.update(part)
            return self.value(merged, bound, depth + 1)
        return self._typed(schema, bound, depth)

    def _typed(self, schema: Mapping[str, Any], bound: int | None, depth: int) -> Any:
        kinds = type_names(schema)
        if "type" not in schema:
            # Untyped: an object when it declares properties, an array with items.
            kinds = ("object", *kinds) if "properties" in schema else (
                ("array", *kinds) if "items" in schema else ("string",))
        # Non-null types first (a nullable field gets a real value when one ends).
        for kind in sorted(kinds, key=lambda name: name == "null"):
            if kind == "object" and self._object_ends(schema, bound):
                return self._object(schema, bound, depth)
            if kind == "array" and self._array_ends(schema, bound):
                return self._array(schema, bound, depth)
            if kind == "string":
                return _string(schema)
            if kind == "integer":
                return _number(schema, integer=True)
            if kind == "number":
                return _number(schema, integer=False)
            if kind == "boolean":
                return True
            if kind == "null":
                return None
        raise CannotSynthesize(f"no type of the schema at {self.graph.path(schema)} ends")

    def _properties(self, schema: Mapping[str, Any]) -> Mapping[str, Any]:
        props = schema.get("properties")
        return props if isinstance(props, Mapping) else {}

    def _object_ends(self, schema: Mapping[str, Any], bound: int | None) -> bool:
        props = self._properties(schema)
        return all(
            self._safe(props[name], bound) for name in required_names(schema) if name in props
        )

    def _object(self, schema: Mapping[str, Any], bound: int | None, depth: int) -> Any:
        required = set(required_names(schema))
        return {
            name: self._child(sub, depth + 1)
            for name, sub in self._properties(schema).items()
            if name in required or self._safe(sub, bound)
        }

    def _item_schemas(self, schema: Mapping[str, Any], count: int) -> list[Any]:
        prefix = schema.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        items = schema.get("items", {})
        if isinstance(items, list):  # an older draft's tuple form
            prefix, items = items, {}
        return [prefix[index] if index < len(prefix) else items for index in range(count)]

    def _array_count(self, schema: Mapping[str, Any], bound: int | None) -> int:
        count = min_items(schema)
        if count == 0 and "minItems" not in schema:
            # One example item when an item is known to end (recursion stops at []).
            one_item = self._item_schemas(schema, 1)
            count = 1 if all(self._safe(item_schema, bound) for item_schema in one_item) else 0
        max_items = schema.get("maxItems")
        if isinstance(max_items, int) and not isinstance(max_items, bool) and max_items >= 0:
            count = min(count, max_items)
        return count

    def _array_ends(self, schema: Mapping[str, Any], bound: int | None) -> bool:
        count = self._array_count(schema, bound)
        item_schemas = self._item_schemas(schema, count)
        return all(self._safe(item_schema, bound) for item_schema in item_schemas)

    def _array(self, schema: Mapping[str, Any], bound: int | None, depth: int) -> Any:
        count = self._array_count(schema, bound)
        item_schemas = self._item_schemas(schema, count)
        return [self._child(item_schema, depth + 1) for item_schema in item_schemas]


def _copy(value: Any) -> Any:
    """A private copy of a const/enum value (the analysis is cached and shared)."""
    if isinstance(value, dict | list):
        return msgspec.json.decode(msgspec.json.encode(value))
    return value


_FORMATS = {
    "date-time": "2024-01-01T00:00:00Z",
    "date": "2024-01-01",
    "time": "00:00:00Z",
    "email": "user@example.com",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "uri": "https://example.com/",
    "hostname": "example.com",
    "ipv4": "192.0.2.1",
    "ipv6": "2001:db8::1",
    "duration": "P1D",
}


# A length bound recoverable tells the model in the description instead of sending it
# (strict mode takes no minLength/maxLength): the fixture follows it as a model would.
_TOLD_BOUNDS = re.compile(
    r"(?:between (?P<low>\d{1,6}) and (?P<high>\d{1,6})|at most (?P<most>\d{1,6})"
    r"|at least (?P<least>\d{1,6})) characters"
)


def _told_bounds(schema: Mapping[str, Any]) -> dict[str, int]:
    description = schema.get("description")
    found = _TOLD_BOUNDS.search(description) if isinstance(description, str) else None
    if found is None:
        return {}
    low, high = found["low"] or found["least"], found["high"] or found["most"]
    bounds = {"minLength": int(low)} if low else {}
    return bounds | ({"maxLength": int(high)} if high else {})


def _string(schema: Mapping[str, Any]) -> str:
    schema = {**_told_bounds(schema), **schema}
    fmt = schema.get("format")
    value = _FORMATS.get(fmt, "example") if isinstance(fmt, str) else "example"
    min_len = schema.get("minLength")
    if isinstance(min_len, int) and len(value) < min_len:
        value = value + "x" * (min_len - len(value))
    max_len = schema.get("maxLength")
    if isinstance(max_len, int) and len(value) > max_len:
        value = value[:max_len]
    return value


def _bound(schema: Mapping[str, Any], key: str) -> float | None:
    value = schema.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return value
    return None


def _number(schema: Mapping[str, Any], *, integer: bool) -> int | float:
    """The first candidate within the bounds (and a multiple of ``multipleOf``)."""
    low, xlow = _bound(schema, "minimum"), _bound(schema, "exclusiveMinimum")
    high, xhigh = _bound(schema, "maximum"), _bound(schema, "exclusiveMaximum")

    def fits(candidate: float) -> bool:
        return ((low is None or candidate >= low) and (xlow is None or candidate > xlow)
                and (high is None or candidate <= high) and (xhigh is None or candidate < xhigh))

    floor = max((limit for limit in (low, xlow) if limit is not None), default=None)
    ceiling = min((limit for limit in (high, xhigh) if limit is not None), default=None)
    start = floor if floor is not None else (1 if integer else 1.5)
    multiple = _bound(schema, "multipleOf")
    candidates: list[float] = []
    if multiple is not None and multiple > 0:
        first = math.ceil(start / multiple)
        candidates = [step * multiple for step in range(first, first + 3)]
        if ceiling is not None:
            last = math.floor(ceiling / multiple)
            candidates += [step * multiple for step in range(last, last - 3, -1)]
    else:
        candidates = [1 if integer else 1.5, start, start + 1]
        if not integer:
            candidates.append(start + 0.5)
            if ceiling is not None:
                candidates.append((start + ceiling) / 2)
        if ceiling is not None:
            candidates += [ceiling, ceiling - 0.5, ceiling - 1]
    for candidate in candidates:
        if integer:
            if candidate != math.floor(candidate):
                candidate = math.ceil(candidate)
            candidate = int(candidate)
        if fits(candidate):
            return int(candidate) if integer else float(candidate)
    return 1 if integer else 1.5  # nothing fits: the self-check reports it


def violate(schema: Any, value: Any) -> Any:
    """A JSON value that breaks ``schema`` (extra property on objects, else a wrong type)."""
    if isinstance(value, dict):
        broken = dict(value)
        broken["unexpected_property"] = "not in the schema"
        if broken.keys() - {"unexpected_property"}:
            broken.pop(next(iter(value)))  # also a required property missing
        return broken
    if isinstance(value, str):
        return {"not": "a string"}
    return "not the right type"


# -- HTTP-level rejections --------------------------------------------------------
