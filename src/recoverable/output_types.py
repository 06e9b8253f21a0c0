"""Output types beyond ``msgspec.Struct``: pydantic v2 models, dataclasses and TypedDicts.

Each is turned into an OpenAI strict-mode schema and its validated payload back into an
instance of that type:

- dataclasses and TypedDicts: ``msgspec.json.schema`` generates the schema and msgspec's
  typed decoder builds the value (both are native to msgspec);
- pydantic v2 models (and pydantic dataclasses): ``model_json_schema()`` /
  ``TypeAdapter.json_schema()`` generates it and ``model_validate_json`` builds the value,
  so the model's own validators run on every answer.

pydantic is optional: it is never imported here. A type is a pydantic type only when
pydantic is already in ``sys.modules`` (the host imported it to define the model) and the
type is a subclass of ``pydantic.BaseModel`` (or carries a pydantic validator).

The generated schema is rewritten by :func:`strict_schema`: a root ``$ref`` is inlined
(recursion into the root becomes ``"$ref": "#"``), ``title``/``default``/``examples`` are
dropped, a ``$ref`` with sibling keywords is inlined one level, a discriminated ``oneOf``
becomes ``anyOf``, a single-entry ``allOf`` is merged, ``const`` becomes a one-value
``enum``, and every object gets ``additionalProperties: false`` with every property in
``required``. Optional values stay typed as nullable (``anyOf`` with ``null``); a defaulted
field whose type does not admit ``null`` becomes required with its own type (the model must
give a value; a ``null`` could not be decoded into it). Anything strict mode cannot express
is refused with :class:`~recoverable.errors.UnsupportedOutputType` naming the field.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
import warnings
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from recoverable.errors import InvalidRequest, UnsupportedOutputType

__all__ = [
    "LOCAL_CONSTRAINT_KEYWORDS",
    "STRICT_CONSTRAINT_KEYWORDS",
    "STRICT_STRING_FORMATS",
    "JsonSchema",
    "PydanticDecoder",
    "decode_as",
    "generated_schema",
    "output_kind",
    "strict_schema",
]

class JsonSchema(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An explicit JSON Schema response contract (OpenAI strict-mode subset)."""

    name: str
    schema: dict[str, Any]


OutputKind = Literal["pydantic", "native"]

# What OpenAI's strict mode accepts besides the structural keywords (its Structured
# Outputs guide, "supported properties"): string pattern and format, numeric bounds and
# multipleOf, array length bounds. Everything else is refused at prepare.
STRICT_CONSTRAINT_KEYWORDS = frozenset(
    {
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "minItems",
        "maxItems",
    }
)
STRICT_STRING_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}
)
_STRUCTURAL = frozenset(
    {"type", "properties", "required", "additionalProperties", "items", "anyOf", "enum",
     "$ref", "description"}
)
# Annotations that change nothing about which values are valid; strict mode does not need
# them (``default`` is even rejected), so they are dropped.
_ANNOTATIONS = frozenset(
    {"title", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment"}
)
_MAX_DEPTH = 64
_MAX_INLINE = 16

# Kept in the contract and checked on every answer, but not sent (strict mode does not
# take them): ``output_roots.wire_schema`` tells the model in the description instead.
LOCAL_CONSTRAINT_KEYWORDS = frozenset({"minLength", "maxLength"})

# What to write instead of a refused keyword.
_MAP_HINT = "use a model with named fields"
_HINTS: dict[str, str] = {
    "uniqueItems": "use a list",
    "prefixItems": "use a list or a model with named fields",
    "patternProperties": _MAP_HINT,
    "propertyNames": _MAP_HINT,
    "minProperties": _MAP_HINT,
    "maxProperties": _MAP_HINT,
    "oneOf": "use a discriminated union (Field(discriminator=...)) or a plain union",
    "contentEncoding": "use str",
    "contentMediaType": "use str",
}
_ANY_HINT = "give the field a concrete type"
_WHAT: dict[str, str] = {
    "prefixItems": "a tuple (prefixItems)",
    "uniqueItems": "a set (uniqueItems)",
    "contentEncoding": "bytes (contentEncoding)",
    "allOf": "an intersection of several schemas (allOf)",
    "oneOf": "an undiscriminated oneOf union",
}


# --------------------------------------------------------------------------- kinds


def _pydantic_module() -> Any:
    return sys.modules.get("pydantic")


def is_pydantic_type(tp: Any) -> bool:
    """A pydantic v2 model class (or pydantic dataclass), without importing pydantic."""
    pydantic = _pydantic_module()
    if pydantic is None or not isinstance(tp, type):
        return False
    base = getattr(pydantic, "BaseModel", None)
    if base is not None and issubclass(tp, base):
        return tp is not base  # BaseModel itself describes no fields
    return dataclasses.is_dataclass(tp) and hasattr(tp, "__pydantic_validator__")


def output_kind(tp: Any) -> OutputKind | None:
    """``pydantic``, ``native`` (dataclass / TypedDict, decoded by msgspec) or None."""
    if is_pydantic_type(tp):
        return "pydantic"
    origin = typing.get_origin(tp) or tp
    if not isinstance(origin, type):
        return None
    if dataclasses.is_dataclass(origin) or typing.is_typeddict(origin):
        return "native"
    return None


def type_label(tp: Any) -> str:
    return getattr(tp, "__name__", None) or repr(tp)


def generated_schema(tp: Any, kind: OutputKind) -> dict[str, Any]:
    """The JSON schema the type's own library generates (not yet strict)."""
    label = type_label(tp)
    if kind == "native":
        try:
            return msgspec.json.schema(tp)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"{label} cannot be expressed as a JSON schema: {exc}") from None
    pydantic = _pydantic_module()
    try:
        with warnings.catch_warnings():
            # Defaults that do not serialize are dropped anyway.
            warnings.simplefilter("ignore", pydantic.json_schema.PydanticJsonSchemaWarning)
            if issubclass(tp, pydantic.BaseModel):
                schema: dict[str, Any] = tp.model_json_schema()
            else:
                schema = pydantic.TypeAdapter(tp).json_schema()
    except (pydantic.errors.PydanticUserError, TypeError, ValueError) as exc:
        raise InvalidRequest(
            f"{label} cannot be expressed as a JSON schema: {_first_line(exc)}"
        ) from None
    return schema


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


# --------------------------------------------------------------------------- decoding


class PydanticDecoder:
    """Builds the pydantic value from a payload (``model_validate_json``)."""

    def __init__(self, tp: Any) -> None:
        pydantic = _pydantic_module()
        self._error: type[Exception] = pydantic.ValidationError
        self._label = type_label(tp)
        self._validate: Callable[[bytes], Any]
        if issubclass(tp, pydantic.BaseModel):
            self._validate = tp.model_validate_json
        else:
            self._validate = pydantic.TypeAdapter(tp).validate_json

    def check(self, payload: bytes) -> str | None:
        """None when the payload validates; else a bounded detail without payload text."""
        try:
            self._validate(payload)
        except self._error as exc:
            return _pydantic_detail(exc)
        return None

    def decode(self, payload: bytes) -> Any:
        """The value; a payload the model rejects raises ``msgspec.ValidationError``."""
        try:
            return self._validate(payload)
        except self._error as exc:
            raise msgspec.ValidationError(
                f"the payload does not validate as {self._label}: {_pydantic_detail(exc)}"
            ) from exc


def _pydantic_detail(exc: Any) -> str:
    # Error type and location only: pydantic messages and inputs may quote the payload.
    # Locations are field names and list indexes (free-form dict keys are refused).
    try:
        errors = exc.errors(include_input=False, include_url=False, include_context=False)
    except Exception:  # pragma: no cover - defensive: any pydantic oddity
        return "the output does not validate as the response type"
    if not errors:
        return "the output does not validate as the response type"
    first = errors[0]
    where = "/" + "/".join(str(part) for part in first.get("loc", ()))
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{first.get('type', 'invalid')} at {where}{more}"


def decode_as(payload: bytes, tp: Any) -> Any:
    """Decode a saved payload as ``tp``: a pydantic model (validated by pydantic), any type
    msgspec decodes (Struct, dataclass, TypedDict, ``dict``...), or a ``JsonSchema`` (the
    plain JSON value)."""
    if isinstance(tp, JsonSchema):
        return msgspec.json.decode(payload)
    if is_pydantic_type(tp):
        pydantic = _pydantic_module()
        if issubclass(tp, pydantic.BaseModel):
            return tp.model_validate_json(payload)
        return pydantic.TypeAdapter(tp).validate_json(payload)
    return msgspec.json.decode(payload, type=tp)


# --------------------------------------------------------------------------- strict schema


def strict_schema(generated: dict[str, Any], label: str) -> dict[str, Any]:
    """Rewrite a generated schema (pydantic or msgspec) into OpenAI strict-mode shape.

    Raises ``UnsupportedOutputType`` naming the field path for constructs strict mode
    cannot express; the caller still runs the general strict and finite-instance checks.
    """
    return _Strictifier(generated, label).run()


class _Strictifier:
    def __init__(self, generated: dict[str, Any], label: str) -> None:
        self.label = label
        defs = generated.get("$defs", {})
        self.defs: dict[str, Any] = dict(defs) if isinstance(defs, dict) else {}
        root_ref = generated.get("$ref")
        self.root_name: str | None = None
        # The first field path through which each definition was reached (for messages).
        self.reached_by: dict[str, str] = {}
        if isinstance(root_ref, str) and root_ref.startswith("#/$defs/"):
            self.root_name = root_ref[len("#/$defs/"):]
            if self.root_name not in self.defs:
                raise InvalidRequest(f"{label}: the generated schema's root $ref is dangling")
            self.root: Any = self.defs[self.root_name]
        else:
            self.root = {
                key: value
                for key, value in generated.items()
                if key not in ("$defs", "definitions")
            }

    def run(self) -> dict[str, Any]:
        root = self._node(self.root, self.label, (), 0, 0)
        if root.get("type") != "object" or "$ref" in root or "anyOf" in root:
            raise UnsupportedOutputType(
                f"{self.label}: the response root must be an object with named fields "
                "(strict mode); wrap the value in a model with one field",
                field_path=self.label,
                keyword="type",
            )
        # Only the definitions reachable from the root are fixed and sent (inlining a
        # $ref with siblings may leave one unused).
        fixed: dict[str, Any] = {}
        todo = _refs(root)
        while todo:
            name = todo.pop()
            if name in fixed:
                continue
            if name not in self.defs:
                raise InvalidRequest(f"{self.label}: the generated $defs/{name} is missing")
            base = self.reached_by.get(name, name)
            fixed[name] = self._node(self.defs[name], base, ("$defs", name), 0, 0)
            todo.extend(_refs(fixed[name]))
        if fixed:
            root["$defs"] = {name: fixed[name] for name in sorted(fixed)}
        return root

    def _refuse(
        self,
        field: str,
        pointer: tuple[str | int, ...],
        keyword: str,
        what: str,
        hint: str | None = None,
    ) -> UnsupportedOutputType:
        return UnsupportedOutputType(
            f"{self.label}: field {field} (schema {_pointer(pointer)}) is {what}, which strict "
            "mode cannot express" + (f"; {hint}" if hint else ""),
            field_path=field,
            keyword=keyword,
        )

    def _node(
        self, node: Any, field: str, pointer: tuple[str | int, ...], depth: int, inlined: int
    ) -> dict[str, Any]:
        if depth > _MAX_DEPTH:
            raise InvalidRequest(f"{self.label}: the schema nests deeper than {_MAX_DEPTH}")
        if not isinstance(node, dict):
            raise self._refuse(field, pointer, "true", "a value of any type (Any)", _ANY_HINT)
        node = {key: value for key, value in node.items() if key not in _ANNOTATIONS}
        if not set(node) - {"description"}:
            raise self._refuse(field, pointer, "{}", "a value of any type (Any, object)", _ANY_HINT)
        if "discriminator" in node:
            del node["discriminator"]
            if "oneOf" in node:
                # Discriminated: the branches are mutually exclusive, so anyOf is the same.
                node["anyOf"] = node.pop("oneOf")
        all_of = node.get("allOf")
        if isinstance(all_of, list) and len(all_of) == 1 and isinstance(all_of[0], dict):
            rest = {key: value for key, value in node.items() if key != "allOf"}
            return self._node({**all_of[0], **rest}, field, pointer, depth + 1, inlined)
        if "const" in node:
            value = node.pop("const")
            if "enum" in node and value not in node["enum"]:
                raise self._refuse(field, pointer, "const", "a const outside its enum")
            node["enum"] = [value]
        ref = node.get("$ref")
        if ref is not None:
            return self._ref(node, ref, field, pointer, depth, inlined)
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key == "properties":
                if not isinstance(value, dict):
                    raise self._refuse(field, pointer, key, "a malformed properties keyword")
                out[key] = {
                    name: self._node(
                        sub, f"{field}.{name}", (*pointer, key, name), depth + 1, inlined
                    )
                    for name, sub in value.items()
                }
            elif key == "items":
                if not isinstance(value, dict):
                    raise self._refuse(
                        field, pointer, "prefixItems", _WHAT["prefixItems"], _HINTS["prefixItems"]
                    )
                out[key] = self._node(value, f"{field}[]", (*pointer, key), depth + 1, inlined)
            elif key == "anyOf":
                if not isinstance(value, list) or not value:
                    raise self._refuse(field, pointer, key, "an empty union")
                out[key] = [
                    self._node(sub, field, (*pointer, key, index), depth + 1, inlined)
                    for index, sub in enumerate(value)
                ]
            elif key == "enum":
                if not isinstance(value, list) or not value:
                    raise self._refuse(field, pointer, key, "an empty enum")
                out[key] = value
            elif key == "format":
                if value not in STRICT_STRING_FORMATS:
                    raise self._refuse(
                        field, pointer, key,
                        f"a string with format {str(value)[:40]!r}",
                        f"supported formats: {', '.join(sorted(STRICT_STRING_FORMATS))}; "
                        "use str",
                    )
                out[key] = value
            elif (key in _STRUCTURAL or key in STRICT_CONSTRAINT_KEYWORDS
                  or key in LOCAL_CONSTRAINT_KEYWORDS):
                out[key] = value
            else:
                what = _WHAT.get(key, f"constrained with {key[:40]!r}")
                raise self._refuse(field, pointer, key[:40], what, _HINTS.get(key))
        if out.get("type") == "object" or "properties" in out:
            self._close_object(out, field, pointer)
        elif out.get("type") == "array" and "items" not in out:
            raise self._refuse(field, pointer, "items", "a list of Any", _ANY_HINT)
        return out

    def _ref(
        self,
        node: dict[str, Any],
        ref: Any,
        field: str,
        pointer: tuple[str | int, ...],
        depth: int,
        inlined: int,
    ) -> dict[str, Any]:
        if not isinstance(ref, str) or not ref.startswith("#/$defs/"):
            raise self._refuse(field, pointer, "$ref", f"a reference outside $defs ({ref!r:.60})")
        name = ref[len("#/$defs/"):]
        if name not in self.defs:
            raise InvalidRequest(f"{self.label}: $ref at {_pointer(pointer)} is dangling")
        siblings = {key: value for key, value in node.items() if key != "$ref"}
        self.reached_by.setdefault(name, field)
        if name == self.root_name:
            # Recursion into the inlined root; a sibling description cannot stay next to it.
            return {"$ref": "#"}
        if not siblings:
            return {"$ref": ref}
        # Strict mode takes no keywords next to $ref: inline the target one level, the
        # field's own keywords (its description) taking precedence.
        if inlined >= _MAX_INLINE:
            return {"$ref": ref}
        merged = {**self.defs[name], **siblings}
        return self._node(merged, field, pointer, depth + 1, inlined + 1)

    def _close_object(
        self, out: dict[str, Any], field: str, pointer: tuple[str | int, ...]
    ) -> None:
        properties = out.get("properties")
        extra = out.get("additionalProperties")
        if properties is None:
            raise self._refuse(
                field, pointer, "additionalProperties",
                "a dict with arbitrary keys (dict, dict[str, X], Mapping)",
                "use a model with named fields",
            )
        if isinstance(extra, dict) and extra:
            raise self._refuse(
                field, pointer, "additionalProperties",
                "an object with typed extra keys", "use a model with named fields only",
            )
        # pydantic's extra="allow" says True: the model may still give only the named
        # fields, so the object is closed.
        out["type"] = "object"
        out["additionalProperties"] = False
        out["required"] = list(properties)


def _refs(value: Any) -> list[str]:
    """The ``$defs`` names referenced anywhere in ``value`` (enum values are data)."""
    found: list[str] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                found.append(ref[len("#/$defs/"):])
            stack.extend(value for key, value in item.items() if key != "enum")
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _pointer(path: tuple[str | int, ...]) -> str:
    parts = (str(part).replace("~", "~0").replace("/", "~1") for part in path)
    return "#/" + "/".join(parts) if path else "#"
