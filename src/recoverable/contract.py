"""Response contracts: the strict-mode JSON schema sent to the API and the validator of its answers.

A contract is built from a ``msgspec.Struct`` type, a pydantic v2 model, a dataclass, a
TypedDict (see ``recoverable.output_types``) or a ``recoverable.JsonSchema(name, schema)``:

- Struct types are turned into an OpenAI strict-mode schema: the root ``$ref``
  that ``msgspec.json.schema`` emits is inlined, every object gets
  ``additionalProperties: false`` and lists every property in ``required``,
  ``default``/``discriminator`` are dropped. Defaults therefore do *not* make a
  field optional for the model: a value that may be absent must be typed
  ``T | None``. Types strict mode cannot express (a non-object root, dicts with
  arbitrary keys, ``Any``, tuples) are refused with ``InvalidRequest``.
- pydantic models, dataclasses and TypedDicts are rewritten the same way by
  ``output_types.strict_schema`` (which also drops titles and refuses keywords strict mode
  does not support, naming the field); the answer is checked against the frozen schema,
  then built by pydantic (its validators run) or msgspec's typed decoder.
- JsonSchema schemas are sent exactly as given (the host owns them) but are
  checked: bounded size and depth, an object root, local ``$ref`` only, the
  strict-mode shape of every object, and that some finite JSON value satisfies the
  schema (recursion needs a way out: a nullable/anyOf branch without the cycle or an
  array that may be empty); each refusal names a JSON-pointer path.

Validation of an answer never fetches anything and never echoes payload text in
its error detail. Struct contracts validate with msgspec's typed decoder alone
when the Struct tree already matches the strict schema exactly (every Struct
forbids unknown fields, has no defaults and no tag); otherwise the compiled
jsonschema-rs validator checks the frozen schema first and the typed decode
follows (so ``decode`` of a saved payload cannot fail later).
"""

from __future__ import annotations

import hashlib
import re
import threading
import typing
from collections import OrderedDict
from typing import Any, Literal

import attrs
import jsonschema_rs
import msgspec
import msgspec.inspect as mi

from recoverable import output_types
from recoverable.errors import InvalidRequest
from recoverable.output_roots import WRAPPER_FIELD, needs_wrapper, wire_schema, wrapper_type
from recoverable.strict_mode import (
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    SCHEMA_KEYWORDS,
    SCHEMA_LIST_KEYWORDS,
    SCHEMA_MAP_KEYWORDS,
    check_json_shape,
    check_strict,
    first_line,
    is_object_schema,
    regex_error,
)
from recoverable.types import JsonSchema

__all__ = [
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "OutputInvalid",
    "ResponseContract",
    "contract_for",
]

_MAX_DETAIL = 300
_CACHE_SIZE = 256
_TOO_DEEP = "the output nests deeper than the JSON decoder allows"
_NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_NAME_BAD_CHARS = re.compile(r"[^a-zA-Z0-9_-]")

# Keywords strict mode rejects and msgspec may emit; the typed decoder still enforces them.
_DROPPED_KEYWORDS = ("default", "discriminator")


class OutputInvalid(Exception):
    """A completion's text is not valid JSON or does not match the contract.

    ``detail`` is bounded and never contains payload text (only schema-derived
    locations and the kind of mismatch).
    """

    def __init__(
        self,
        kind: Literal["invalid_json", "schema_violation"],
        detail: str,
        *,
        location: str | None = None,
    ) -> None:
        detail = detail[:_MAX_DETAIL]
        super().__init__(f"{kind}: {detail}")
        self.kind: Literal["invalid_json", "schema_violation"] = kind
        self.detail = detail
        # Where the output broke the contract, as a JSON pointer into the output
        # (``/items/1/name``). Its parts are the contract's own property names and list
        # indexes (strict objects are closed, so no payload key can appear), bounded.
        self.location = output_location(location)


_LOCATION = re.compile(r"/[A-Za-z0-9_./$\[\]-]{0,159}|")


def output_location(value: str | None) -> str | None:
    """A JSON pointer into the output, bounded (``None`` when absent or not plain)."""
    if value is None or not _LOCATION.fullmatch(value):
        return None
    return value


def _output_pointer(parts: Any) -> str:
    return "".join(f"/{part}" for part in parts)


@attrs.frozen(kw_only=True)
class ResponseContract:
    """A frozen response format: what is sent as ``text.format`` and how answers are checked.

    Treat ``schema`` as read-only: contracts are cached and shared.
    """

    name: str
    schema: dict[str, Any] = attrs.field(hash=False)
    format_hash: str
    python_type: Any
    _validator: Any = attrs.field(alias="validator", eq=False, repr=False, hash=False)
    _typed_decoder: Any = attrs.field(alias="typed_decoder", eq=False, repr=False, hash=False)
    # A non-object root sent wrapped (``output_roots``): the value is the wrapper's field.
    unwrap: bool = False
    # What is sent: ``schema`` without the keywords checked locally (``output_roots``).
    wire: dict[str, Any] = attrs.field(
        eq=False, repr=False, hash=False,
        default=attrs.Factory(lambda self: wire_schema(self.schema), takes_self=True),
    )

    def text_format(self) -> dict[str, Any]:
        return {"type": "json_schema", "name": self.name, "strict": True, "schema": self.wire}

    def validate(self, text: str) -> bytes:
        """Check ``text`` against the contract; return its UTF-8 bytes unchanged (the payload)."""
        try:
            payload = text.encode("utf-8")
        except (UnicodeEncodeError, AttributeError):
            raise OutputInvalid("invalid_json", "text is not encodable as UTF-8") from None
        if self._validator is not None:
            try:
                value = msgspec.json.decode(payload)
            except msgspec.DecodeError:
                raise OutputInvalid("invalid_json", "the output is not valid JSON") from None
            except RecursionError:
                raise OutputInvalid("invalid_json", _TOO_DEEP) from None
            _check_schema(self._validator, value)
        if isinstance(self._typed_decoder, output_types.PydanticDecoder):
            problem = self._typed_decoder.check(payload)
            if problem is not None:
                where = problem.split(" at ", 1)[1].split(" ", 1)[0] if " at " in problem else None
                raise OutputInvalid("schema_violation", problem, location=where)
        elif self._typed_decoder is not None:
            try:
                self._typed_decoder.decode(payload)
            except msgspec.ValidationError as exc:
                raise OutputInvalid(
                    "schema_violation", _msgspec_detail(exc), location=_msgspec_location(exc)
                ) from None
            except msgspec.DecodeError:
                raise OutputInvalid("invalid_json", "the output is not valid JSON") from None
            except RecursionError:
                raise OutputInvalid("invalid_json", _TOO_DEEP) from None
        return payload

    def decode(self, payload: bytes) -> Any:
        """An instance of the response type, or the plain JSON value (JsonSchema).

        A payload that does not decode raises ``msgspec.ValidationError`` /
        ``msgspec.DecodeError`` whatever the kind of type.
        """
        if isinstance(self._typed_decoder, output_types.PydanticDecoder):
            value = self._typed_decoder.decode(payload)
        elif self.python_type is not None:
            value = msgspec.json.decode(payload, type=self.python_type)
        else:
            return msgspec.json.decode(payload)
        return getattr(value, WRAPPER_FIELD) if self.unwrap else value


def _check_schema(validator: Any, value: Any) -> None:
    if validator.is_valid(value):
        return
    detail = "the output does not match the schema"
    for error in validator.iter_errors(value):
        # Schema path and kind only: the message and instance path may quote payload text.
        kind = type(error.kind).__name__.rsplit("_", 1)[-1]
        where = "/".join(str(part) for part in error.schema_path)
        detail = f"{kind} violated at schema path /{where}"
        location = _output_pointer(error.instance_path)
        break
    else:
        location = None
    raise OutputInvalid("schema_violation", detail, location=location)


_MSGSPEC_QUOTED = re.compile(r"`[^`]*`")


_MSGSPEC_PATH = re.compile(r"\[(\d+)\]|\.([A-Za-z0-9_]+)")


def _msgspec_location(exc: msgspec.ValidationError) -> str | None:
    """``$.items[1].name`` → ``/items/1/name``; only for type mismatches (an unknown
    field's name would come from the payload)."""
    message = str(exc)
    if not message.startswith("Expected") or " - at `$" not in message:
        return None
    path = message.rsplit(" - at `$", 1)[1].rstrip("`")
    parts = [index or name for index, name in _MSGSPEC_PATH.findall(path)]
    if "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in parts) != path:
        return None  # something this reading does not understand: say nothing
    return _output_pointer(parts)


def _msgspec_detail(exc: msgspec.ValidationError) -> str:
    # msgspec messages look like "Expected `int`, got `str` - at `$.x[0]`"; the location
    # and unknown-field names can come from the payload, so only the expectation part is kept
    # when it quotes type names, everything quoted after " - at " is dropped.
    message = str(exc).split(" - at ", 1)[0]
    if message.startswith("Object contains unknown field"):
        return "the output contains an unknown field"
    if message.startswith("Expected"):
        return message
    return "the output does not match the response type: " + _MSGSPEC_QUOTED.sub("`…`", message)


# --------------------------------------------------------------------------- cache


class _LRU:
    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Any) -> Any:
        with self._lock:
            try:
                value = self._items[key]
            except KeyError:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.hits = self.misses = 0


_struct_contracts = _LRU(_CACHE_SIZE)
_schema_contracts = _LRU(_CACHE_SIZE)
_validators = _LRU(_CACHE_SIZE)


def contract_for(response: Any) -> ResponseContract:
    """The (cached) contract for a ``msgspec.Struct`` type, a pydantic v2 model, a
    dataclass, a TypedDict or a ``JsonSchema``.

    Raises ``InvalidRequest`` for anything that cannot be a strict-mode contract
    (``UnsupportedOutputType``, naming the field, for a construct strict mode cannot express).
    """
    if isinstance(response, JsonSchema):
        return _json_schema_contract(response)
    if _is_struct_type(response):
        kind: str | None = "struct"
    else:
        kind = output_types.output_kind(response)
    if needs_wrapper(response):
        kind = "wrapped"
    if kind is None:
        raise InvalidRequest(
            "response must be a msgspec.Struct type, a pydantic v2 model, a dataclass, a "
            "TypedDict or recoverable.JsonSchema(name, schema), "
            f"not {type(response).__name__}"
        )
    try:
        cached = _struct_contracts.get(response)
    except TypeError:  # an unhashable generic alias: build it every time
        cached = None
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    if kind == "struct":
        contract = _struct_contract(response)
    elif kind == "wrapped":
        wrapper, pydantic = wrapper_type(response)
        inner = _typed_contract(wrapper, "pydantic" if pydantic else "native")
        contract = attrs.evolve(inner, unwrap=True)
    else:
        contract = _typed_contract(response, kind)  # type: ignore[arg-type]
    try:
        _struct_contracts.put(response, contract)
    except TypeError:
        pass
    return contract


def _is_struct_type(response: Any) -> bool:
    """A Struct class, or a parametrized generic Struct such as ``Page[Item]``."""
    origin = typing.get_origin(response) or response
    return isinstance(origin, type) and issubclass(origin, msgspec.Struct)


def _canonical(value: Any) -> bytes:
    return msgspec.json.encode(value, order="sorted")


def _format_hash(name: str, schema: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical({"name": name, "schema": schema, "strict": True})).hexdigest()


def _compile(schema: dict[str, Any], schema_bytes: bytes) -> Any:
    key = hashlib.sha256(schema_bytes).hexdigest()
    validator = _validators.get(key)
    if validator is None:
        try:
            # offline: remote references are never retrieved (non-local refs are refused
            # before this point anyway).
            validator = jsonschema_rs.Draft202012Validator(schema, offline=True)
        except (ValueError, TypeError, OverflowError) as exc:
            raise InvalidRequest(f"schema is not a valid JSON Schema: {first_line(exc)}") from None
        _validators.put(key, validator)
    return validator


# --------------------------------------------------------------------------- JsonSchema


def _json_schema_contract(response: JsonSchema) -> ResponseContract:
    name = response.name
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise InvalidRequest("JsonSchema name must match ^[a-zA-Z0-9_-]{1,64}$")
    schema = response.schema
    if not isinstance(schema, dict):
        raise InvalidRequest(f"JsonSchema schema must be a dict, not {type(schema).__name__}")
    check_json_shape(schema)  # before encoding: bounds depth, rejects cycles and non-JSON values
    try:
        schema_bytes = _canonical(schema)
    except (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError) as exc:
        raise InvalidRequest(
            f"JsonSchema schema is not JSON-encodable: {first_line(exc)}"
        ) from None
    if len(schema_bytes) > MAX_SCHEMA_BYTES:
        raise InvalidRequest(
            f"JsonSchema schema is {len(schema_bytes)} bytes of canonical JSON; "
            f"the limit is {MAX_SCHEMA_BYTES}"
        )
    format_hash = hashlib.sha256(
        b'{"name":' + _canonical(name) + b',"schema":' + schema_bytes + b',"strict":true}'
    ).hexdigest()
    cached = _schema_contracts.get(format_hash)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    # A private copy of exactly what was hashed: later mutation of the host's dict cannot
    # change what this contract sends.
    frozen_schema: dict[str, Any] = msgspec.json.decode(schema_bytes)
    check_strict(frozen_schema)
    validator = _compile(frozen_schema, schema_bytes)
    contract = ResponseContract(
        name=name,
        schema=frozen_schema,
        format_hash=format_hash,
        python_type=None,
        validator=validator,
        typed_decoder=None,
    )
    _schema_contracts.put(format_hash, contract)
    return contract


# --------------------------------------------------------------------------- Struct types


def _struct_name(tp: Any, root_key: str | None) -> str:
    # A plain class keeps its own name; a generic alias uses msgspec's key (``Page_Item_``).
    raw = tp.__name__ if isinstance(tp, type) else (root_key or "")
    name = _NAME_BAD_CHARS.sub("_", raw or "response")[:64]
    return name or "response"


def _struct_contract(tp: Any) -> ResponseContract:
    label = _NAME_BAD_CHARS.sub("_", repr(tp) if not isinstance(tp, type) else tp.__name__)[:80]
    try:
        generated = msgspec.json.schema(tp)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"{label} cannot be expressed as a JSON schema: {exc}") from None
    defs: dict[str, Any] = dict(generated.get("$defs", {}))
    root_ref = generated.get("$ref")
    if isinstance(root_ref, str) and root_ref.startswith("#/$defs/"):
        root_key = root_ref[len("#/$defs/") :]
        root: dict[str, Any] = dict(defs.pop(root_key))
    else:
        root_key = None
        root = {key: value for key, value in generated.items() if key != "$defs"}
    if root.get("type") != "object":
        raise InvalidRequest(
            f"{label} is not an object in JSON (array_like Structs cannot be a response root)"
        )
    root_pointer = f"#/$defs/{root_key}" if root_key is not None else None
    root = _fix_node(root, root_pointer, label)
    fixed_defs = {
        key: _fix_node(value, root_pointer, f"{label} ($defs/{key})") for key, value in defs.items()
    }
    if fixed_defs:
        root["$defs"] = fixed_defs
    check_strict(root)  # the same rules a host schema must meet
    schema_bytes = _canonical(root)
    name = _struct_name(tp, root_key)
    exact = _typed_decode_is_exact(tp)
    validator = None if exact else _compile(root, schema_bytes)
    return ResponseContract(
        name=name,
        schema=root,
        format_hash=_format_hash(name, root),
        python_type=tp,
        validator=validator,
        typed_decoder=msgspec.json.Decoder(tp, strict=True),
    )


def _fix_node(node: Any, root_pointer: str | None, where: str) -> Any:
    """Recursively rewrite a msgspec-generated schema node into strict-mode shape."""
    if isinstance(node, list):
        return [_fix_node(item, root_pointer, where) for item in node]
    if not isinstance(node, dict):
        return node
    if not node:
        raise InvalidRequest(f"{where}: a field typed Any cannot be expressed in strict mode")
    if "prefixItems" in node:
        raise InvalidRequest(
            f"{where}: tuple fields cannot be expressed in strict mode; use a list or a Struct"
        )
    if node.get("type") == "array" and "items" not in node:
        raise InvalidRequest(
            f"{where}: a list of Any (no item type, e.g. an unbound type variable) cannot be "
            "expressed in strict mode"
        )
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED_KEYWORDS:
            continue
        if key == "$ref" and value == root_pointer:
            out[key] = "#"  # recursion into the (inlined) root
        elif key in ("enum", "const"):
            out[key] = value
        elif key in SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
            out[key] = {name: _fix_node(sub, root_pointer, where) for name, sub in value.items()}
        elif key in SCHEMA_KEYWORDS or key in SCHEMA_LIST_KEYWORDS:
            out[key] = _fix_node(value, root_pointer, where)
        else:
            out[key] = value
    if is_object_schema(out):
        extra = out.get("additionalProperties")
        if extra is not None and extra is not False:
            raise InvalidRequest(
                f"{where}: dict fields with arbitrary keys cannot be expressed in strict mode; "
                "use a Struct with named fields"
            )
        if "properties" not in out:
            raise InvalidRequest(
                f"{where}: an object without declared properties (a plain dict) cannot be "
                "expressed in strict mode"
            )
        out["additionalProperties"] = False
        out["required"] = list(out["properties"])
    return out


def _typed_contract(tp: Any, kind: output_types.OutputKind) -> ResponseContract:
    """A pydantic model, dataclass or TypedDict: generated schema -> strict -> checked."""
    label = _NAME_BAD_CHARS.sub("_", output_types.type_label(tp))[:80] or "response"
    generated = output_types.generated_schema(tp, kind)
    root = output_types.strict_schema(generated, output_types.type_label(tp)[:80])
    check_json_shape(root)
    schema_bytes = _canonical(root)
    if len(schema_bytes) > MAX_SCHEMA_BYTES:
        raise InvalidRequest(
            f"{label}: the schema is {len(schema_bytes)} bytes; the limit is {MAX_SCHEMA_BYTES}"
        )
    check_strict(root)  # the same rules a host schema must meet (and a finite instance)
    name = label[:64]
    decoder: Any
    if kind == "pydantic":
        decoder = output_types.PydanticDecoder(tp)
    else:
        decoder = msgspec.json.Decoder(tp, strict=True)
    return ResponseContract(
        name=name,
        schema=root,
        format_hash=_format_hash(name, root),
        python_type=tp,
        validator=_compile(root, schema_bytes),
        typed_decoder=decoder,
    )


def _typed_decode_is_exact(tp: type) -> bool:
    """True when msgspec's typed decode alone enforces the strict schema.

    That holds when every object in the type tree is a Struct that forbids unknown
    fields, has no defaulted fields (all required) and no tag (a tagged Struct decoded
    directly accepts a missing tag). Anything else is validated by jsonschema-rs too.
    """
    seen: set[int] = set()
    stack: list[Any] = [mi.type_info(tp)]
    while stack:
        info = stack.pop()
        if id(info) in seen:
            continue
        seen.add(id(info))
        if isinstance(info, mi.StructType):
            if not info.forbid_unknown_fields or info.tag is not None or info.array_like:
                return False
            for field in info.fields:
                if not field.required:
                    return False
                stack.append(field.type)
        elif isinstance(info, (mi.DataclassType, mi.TypedDictType, mi.NamedTupleType, mi.DictType)):
            return False
        elif isinstance(info, mi.UnionType):
            stack.extend(info.types)
        elif isinstance(info, mi.TupleType):
            stack.extend(info.item_types)
        elif isinstance(info, mi.Metadata):
            stack.append(info.type)
        elif isinstance(info, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
            stack.append(info.item_type)
    return True


def _clear_caches() -> None:
    """For tests: forget cached contracts and validators."""
    _struct_contracts.clear()
    _schema_contracts.clear()
    _validators.clear()
    regex_error.cache_clear()
