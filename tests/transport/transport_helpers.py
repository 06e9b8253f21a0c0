"""Shared values for the transport tests (a module, not a conftest, so tests can import it)."""

from __future__ import annotations

from typing import Any

import msgspec

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer"},
        "label": {"type": "string", "enum": ["yes", "no"]},
        "note": {"type": ["string", "null"]},
        "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
    },
    "required": ["answer", "label", "note", "items"],
    "additionalProperties": False,
    "$defs": {
        "Item": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "score": {"type": "number"}},
            "required": ["name", "score"],
            "additionalProperties": False,
        }
    },
}


def make_body(schema: dict[str, Any] = SCHEMA, **extra: Any) -> bytes:
    body = {
        "model": "fixture-model",
        "instructions": "Answer.",
        "input": "What is the answer?",
        "store": False,
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "Answer", "strict": True,
                            "schema": schema}},
        **extra,
    }
    return msgspec.json.encode(body, order="sorted")
