"""OpenAI strict mode, checked before any request is sent: what a response schema must
be (JSON only, bounded, every object closed and fully required, local ``$ref`` only,
every regular expression compilable, and some finite value satisfies it).

``recoverable.contract`` applies these checks to a host's ``JsonSchema`` and to the
schema it generates for a typed response. Raises ``InvalidRequest`` naming the place
(a JSON pointer).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jsonschema_rs

from recoverable.errors import InvalidRequest
from recoverable.schema_graph import SchemaGraph, json_pointer, resolve_pointer

__all__ = [
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "SCHEMA_KEYWORDS",
    "SCHEMA_LIST_KEYWORDS",
    "SCHEMA_MAP_KEYWORDS",
    "check_json_shape",
    "check_strict",
    "first_line",
    "is_object_schema",
    "regex_error",
]

MAX_SCHEMA_BYTES = 1024 * 1024
MAX_SCHEMA_DEPTH = 64

# Keywords whose value is one subschema / a list of subschemas / a map of name -> subschema.
SCHEMA_KEYWORDS = frozenset(
    {
        "items",
        "additionalProperties",
        "not",
        "if",
        "then",
        "else",
        "contains",
        "propertyNames",
        "unevaluatedItems",
        "unevaluatedProperties",
        "additionalItems",
        "contentSchema",
    }
)
SCHEMA_LIST_KEYWORDS = frozenset({"anyOf", "allOf", "oneOf", "prefixItems", "items"})
SCHEMA_MAP_KEYWORDS = frozenset(
    {"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"}
)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, bounded (for an error message)."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


def check_json_shape(schema: dict[str, Any]) -> None:
    """Iteratively check depth, key types and value types (JSON only, finite numbers)."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    nodes = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_BYTES:
            raise InvalidRequest(f"JsonSchema schema is larger than {MAX_SCHEMA_BYTES} bytes")
        if isinstance(value, dict):
            if depth > MAX_SCHEMA_DEPTH:
                raise InvalidRequest(f"JsonSchema schema is nested deeper than {MAX_SCHEMA_DEPTH}")
            for key, item in value.items():
                if not isinstance(key, str):
                    raise InvalidRequest("JsonSchema schema keys must be strings")
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            if depth > MAX_SCHEMA_DEPTH:
                raise InvalidRequest(f"JsonSchema schema is nested deeper than {MAX_SCHEMA_DEPTH}")
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidRequest("JsonSchema schema contains a non-finite number")
        elif value is None or isinstance(value, (str, int)):
            pass
        else:
            raise InvalidRequest(
                f"JsonSchema schema contains a non-JSON value of type {type(value).__name__}"
            )


_Path = tuple[str | int, ...]


def _subschemas(node: dict[str, Any], path: _Path) -> list[tuple[Any, _Path]]:
    """The subschemas of ``node`` (keyword positions only: enum/const values are data)."""
    found: list[tuple[Any, _Path]] = []
    for key, value in node.items():
        if key in SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
            found.extend((sub, (*path, key, name)) for name, sub in value.items())
        elif key in SCHEMA_LIST_KEYWORDS and isinstance(value, list):
            found.extend((sub, (*path, key, index)) for index, sub in enumerate(value))
        elif key in SCHEMA_KEYWORDS and isinstance(value, dict):
            found.append((value, (*path, key)))
    return found


def _resolve_local(root: dict[str, Any], ref: str) -> bool:
    return isinstance(resolve_pointer(root, ref), (dict, bool))


@functools.lru_cache(maxsize=1024)
def regex_error(pattern: str) -> str | None:
    """Why the JSON Schema validator cannot compile ``pattern``, or None when it can.

    Asked of the validator itself, so the rule is exactly the one it applies to the
    patterns it reaches.
    """
    try:
        jsonschema_rs.Draft202012Validator({"pattern": pattern}, offline=True)
    except (ValueError, TypeError, OverflowError) as exc:
        return first_line(exc)
    return None


def _check_patterns(node: dict[str, Any], path: _Path) -> None:
    """Every regular expression of ``node`` compiles, referenced from the root or not.

    The validator compiles only the subschemas it can reach, so a pattern in an
    unreferenced ``$defs`` entry would otherwise be accepted; strict mode checks them all.
    Non-string values are left to the compiler's meta-schema check.
    """
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        reason = regex_error(pattern)
        if reason is not None:
            raise InvalidRequest(
                f"schema is not a valid JSON Schema: pattern at {json_pointer((*path, 'pattern'))} "
                f"is not a regular expression the validator accepts: {reason}"
            )
    keyed = node.get("patternProperties")
    if isinstance(keyed, dict):
        for key in keyed:
            reason = regex_error(key)
            if reason is not None:
                raise InvalidRequest(
                    "schema is not a valid JSON Schema: patternProperties key at "
                    f"{json_pointer((*path, 'patternProperties', key))} is not a regular "
                    f"expression the validator accepts: {reason}"
                )


def is_object_schema(node: dict[str, Any]) -> bool:
    """A subschema that describes an object (strict mode closes and requires it)."""
    kind = node.get("type")
    if kind == "object" or (isinstance(kind, list) and "object" in kind):
        return True
    return "properties" in node


def check_strict(schema: dict[str, Any]) -> None:
    """Strict-mode requirements of a host schema; raises InvalidRequest with a JSON-pointer path."""
    if schema.get("type") != "object":
        raise InvalidRequest('the schema root must have "type": "object" (strict mode)')
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(schema, ())]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue  # boolean schemas etc.: left to the JSON Schema compiler
        for key in ("$ref", "$dynamicRef", "$recursiveRef"):
            if key not in node:
                continue
            ref = node[key]
            if key != "$ref" or not isinstance(ref, str) or not ref.startswith("#"):
                raise InvalidRequest(
                    "only local $ref (starting with '#') is allowed; "
                    f"found {key} at {json_pointer(path)}"
                )
            if not _resolve_local(schema, ref):
                raise InvalidRequest(
                    f"$ref at {json_pointer(path)} does not resolve within the schema"
                )
        if "$id" in node and path:
            raise InvalidRequest(f"$id is not allowed in subschemas (at {json_pointer(path)})")
        _check_patterns(node, path)
        if is_object_schema(node):
            if node.get("additionalProperties") is not False:
                raise InvalidRequest(
                    f"strict mode requires additionalProperties: false on every object; "
                    f"missing at {json_pointer(path)}"
                )
            properties = node.get("properties", {})
            if not isinstance(properties, dict):
                raise InvalidRequest(f"properties must be an object at {json_pointer(path)}")
            required = node.get("required", [])
            if not isinstance(required, list):
                raise InvalidRequest(f"required must be a list at {json_pointer(path)}")
            missing = [name for name in properties if name not in required]
            if missing:
                raise InvalidRequest(
                    f"strict mode requires every property in required; at {json_pointer(path)} "
                    f"{len(missing)} missing (first: {missing[0][:64]!r}); "
                    "type optional values as nullable instead"
                )
        stack.extend(_subschemas(node, path))
    # A schema no finite JSON value satisfies (e.g. a required property whose only way
    # to exist is to contain itself) can never be answered: refuse it before any POST.
    reason = SchemaGraph(schema).no_finite_instance()
    if reason is not None:
        raise InvalidRequest(reason)
