"""Output types whose JSON is not an object, and the keywords checked here, not sent.

**Non-object roots.** Strict mode wants an object at the root. A response type whose
JSON is something else — ``list[Item]``, ``list[int]``, ``int``, a ``Literal``, an
``Enum``, a union, a pydantic ``RootModel`` — is sent wrapped in a one-field object::

    {"type": "object", "properties": {"items": <the type's schema>},
     "required": ["items"], "additionalProperties": false}

The provider answers ``{"items": ...}``; that answer is what the receipt keeps (what the
provider returned), and the value handed back is the unwrapped ``items``, built as the
type (a ``RootModel`` comes back as the ``RootModel``). :func:`wrapper_type` builds the
one-field type the contract is made from (a pydantic model when the type involves
pydantic, so its validators run; else a msgspec Struct).

**Keywords checked locally.** One rule for every kind of output (pydantic models,
dataclasses, Structs and a host's ``JsonSchema``): ``minLength`` and ``maxLength`` are
kept in the contract's schema (and in its digest) and checked on every answer, but they
are not in strict mode's keyword set, so the schema sent (:func:`wire_schema`) leaves
them out and tells the model in the field's ``description`` instead.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from recoverable.output_types import decode_as as decode_object
from recoverable.output_types import is_pydantic_type

__all__ = [
    "LOCAL_KEYWORDS",
    "WRAPPER_FIELD",
    "decode_as",
    "needs_wrapper",
    "unwrap_payload",
    "uses_pydantic",
    "wire_schema",
    "wrapped_name",
    "wrapper_type",
]

#: The one field of the object a non-object root is wrapped in.
WRAPPER_FIELD: Final = "items"
#: Checked on every answer, never sent (strict mode does not take them).
LOCAL_KEYWORDS: Final = ("minLength", "maxLength")
_NAME_BAD_CHARS = re.compile(r"[^a-zA-Z0-9_-]")
_MAX_WALK = 256


def _pydantic() -> Any:
    return sys.modules.get("pydantic")


def needs_wrapper(tp: Any) -> bool:
    """A type expression whose JSON is not an object with named fields: a generic alias
    (``list[X]``), a ``Literal``, a union, a scalar or enum type, a pydantic
    ``RootModel``. Structs, models, dataclasses and TypedDicts are objects already."""
    pydantic = _pydantic()
    if pydantic is not None and isinstance(tp, type):
        root = getattr(pydantic, "RootModel", None)
        if root is not None and issubclass(tp, root) and tp is not root:
            return True
    if isinstance(tp, type):
        return tp in (int, float, str, bool, list) or issubclass(tp, enum.Enum)
    origin = typing.get_origin(tp)
    if origin is None:
        return False
    # A parametrized object type (``Page[Item]``, a generic dataclass) is an object.
    return not (isinstance(origin, type) and (
        issubclass(origin, (msgspec.Struct, Mapping)) or dataclasses.is_dataclass(origin)
        or typing.is_typeddict(origin) or is_pydantic_type(origin)
    ))


def uses_pydantic(tp: Any) -> bool:
    """Does the type expression involve pydantic (a model, a ``RootModel``, a pydantic
    ``Field`` in ``Annotated``)? Then pydantic builds it (its validators run)."""
    if _pydantic() is None:
        return False
    stack, seen = [tp], 0
    while stack and seen < _MAX_WALK:
        item = stack.pop()
        seen += 1
        if is_pydantic_type(item) or type(item).__module__.split(".")[0] == "pydantic":
            return True
        stack.extend(typing.get_args(item))
    return False


def wrapped_name(tp: Any) -> str:
    """The format name of a wrapped type: ``list_Item``, ``Literal_a_b``, the class name
    of a ``RootModel`` or an enum (deterministic: never an address)."""

    def part(item: Any, depth: int) -> str:
        if isinstance(item, (str, int, float, bool)) or item is None:
            return str(item)
        if isinstance(item, enum.Enum):
            return str(item.value)
        origin = typing.get_origin(item)
        if origin is None or depth > 4:
            return str(getattr(item, "__name__", None) or type(item).__name__)
        base = ("Union" if origin in (typing.Union, types.UnionType)
                else getattr(origin, "__name__", None) or getattr(origin, "_name", None)
                or "type")
        return "_".join([str(base), *(part(arg, depth + 1) for arg in typing.get_args(item))])

    name = _NAME_BAD_CHARS.sub("_", part(tp, 0))[:64]
    return name or "response"


def wrapper_type(tp: Any) -> tuple[Any, bool]:
    """The one-field object type ``{items: tp}`` and whether it is a pydantic model."""
    name = wrapped_name(tp)
    if uses_pydantic(tp):
        pydantic = _pydantic()
        model = pydantic.create_model(name, **{WRAPPER_FIELD: (tp, ...)})
        return model, True
    struct = msgspec.defstruct(name, [(WRAPPER_FIELD, tp)], forbid_unknown_fields=True)
    return struct, False


def unwrap_payload(payload: bytes) -> bytes:
    """The wrapped value's own JSON (``{"items": V}`` -> ``V``), for decoding as the type."""
    fields = msgspec.json.decode(payload, type=dict[str, msgspec.Raw])
    if WRAPPER_FIELD not in fields:
        raise msgspec.ValidationError(f"the payload has no {WRAPPER_FIELD!r} field")
    return bytes(fields[WRAPPER_FIELD])


def decode_as(payload: bytes, tp: Any) -> Any:
    """``output_types.decode_as``, and a wrapped root's saved ``{"items": V}`` as ``tp``."""
    if not needs_wrapper(tp):
        return decode_object(payload, tp)
    inner = unwrap_payload(payload)
    if uses_pydantic(tp):
        return _pydantic().TypeAdapter(tp).validate_json(inner)
    return msgspec.json.decode(inner, type=tp)


def _bounds_text(node: dict[str, Any]) -> str:
    low, high = node.get("minLength"), node.get("maxLength")
    if low is not None and high is not None:
        return f"between {low} and {high} characters"
    if high is not None:
        return f"at most {high} characters"
    return f"at least {low} characters"


def wire_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema as sent: ``schema`` without :data:`LOCAL_KEYWORDS`, each bound told in
    its node's ``description`` instead. ``schema`` itself is returned when it has none."""
    if not any(f'"{keyword}"' in msgspec.json.encode(schema).decode()
               for keyword in LOCAL_KEYWORDS):
        return schema

    def strip(value: Any) -> Any:
        if isinstance(value, list):
            return [strip(item) for item in value]
        if not isinstance(value, dict):
            return value
        out: dict[str, Any] = {}
        for key, item in value.items():
            if key in ("enum", "const"):
                out[key] = item  # data, not schema
            elif key in LOCAL_KEYWORDS and isinstance(item, int) and "$ref" not in value:
                continue
            else:
                out[key] = strip(item)
        if len(out) != len(value):
            said = _bounds_text(value)
            before = out.get("description")
            out["description"] = f"{before} ({said})" if isinstance(before, str) else said
        return out

    stripped: dict[str, Any] = strip(schema)
    return stripped
