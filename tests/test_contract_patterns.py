"""Regular expressions in a JsonSchema are checked wherever they appear (issue 12.1 follow-up).

The JSON Schema compiler only compiles the patterns of subschemas it can reach, so a pattern
it cannot compile inside an unreferenced ``$defs`` entry used to be accepted (found by
``tests/fuzz/test_fuzz_schemas.py``). Strict mode checks every subschema, referenced or not:
such a schema is refused with ``InvalidRequest`` naming the JSON pointer of the pattern, the
same way whether the entry is referenced, unreferenced or inline.
"""

from __future__ import annotations

from typing import Any

import pytest

from recoverable.contract import contract_for
from recoverable.errors import InvalidRequest
from recoverable.types import JsonSchema


def _root(**extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
            "additionalProperties": False, **extra}


def _refused(schema: dict[str, Any]) -> str:
    with pytest.raises(InvalidRequest) as caught:
        contract_for(JsonSchema("result", schema))
    assert caught.value.code == "invalid_request"
    return str(caught.value)


@pytest.mark.parametrize("pattern", ["(", "[", "a{2,1}", "\\"])
def test_an_uncompilable_pattern_in_an_unreferenced_def_is_refused(pattern: str) -> None:
    schema = _root(**{"$defs": {"unused": {"type": "string", "pattern": pattern}}})
    message = _refused(schema)
    assert "#/$defs/unused/pattern" in message, message
    assert "regular expression" in message, message


def test_a_referenced_def_and_an_inline_property_name_the_same_kind_of_path() -> None:
    referenced = _root(**{"$defs": {"A": {"type": "string", "pattern": "("}}})
    referenced["properties"] = {"a": {"$ref": "#/$defs/A"}}
    assert "#/$defs/A/pattern" in _refused(referenced)
    inline = _root()
    inline["properties"] = {"a": {"type": "string", "pattern": "("}}
    assert "#/properties/a/pattern" in _refused(inline)


def test_nested_and_legacy_definitions_are_checked_too() -> None:
    nested = _root(**{"$defs": {"O": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "(a"}},
        "required": ["s"], "additionalProperties": False}}})
    assert "#/$defs/O/properties/s/pattern" in _refused(nested)
    legacy = _root(definitions={"x/y": {"type": "string", "pattern": "["}})
    assert "#/definitions/x~1y/pattern" in _refused(legacy)


def test_an_uncompilable_pattern_properties_key_is_refused_with_its_path() -> None:
    schema = _root(**{"$defs": {"M": {
        "type": "object", "properties": {}, "required": [], "additionalProperties": False,
        "patternProperties": {"(": {"type": "string"}}}}})
    message = _refused(schema)
    assert "#/$defs/M/patternProperties" in message and "regular expression" in message


def test_valid_patterns_in_unreferenced_defs_are_still_accepted() -> None:
    schema = _root(**{"$defs": {"unused": {"type": "string", "pattern": "^\\d{2}(a+)+$"},
                                "other": {"type": "string", "pattern": "(?<=a)b"}}})
    contract = contract_for(JsonSchema("result", schema))
    assert contract.validate('{"a":"z"}') == b'{"a":"z"}'


def test_pattern_of_the_wrong_type_stays_refused() -> None:
    schema = _root(**{"$defs": {"unused": {"type": "string", "pattern": 5}}})
    _refused(schema)
