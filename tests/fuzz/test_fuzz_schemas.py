"""Fuzzing response contracts and batch job lines.

Any JSON value given as a ``recoverable.JsonSchema`` (and any name) must give a
contract or ``InvalidRequest`` from ``recoverable.contract.contract_for`` —
never another exception; a contract it gives validates arbitrary output text
into bytes or a typed ``OutputInvalid``. Any text given to
``recoverable.batch.parse_job_line`` must give a ``Job`` or a ``JobLineError``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import recoverable
from recoverable import batch
from recoverable.contract import OutputInvalid, contract_for
from recoverable.testing import synthesize_value

EXAMPLES = int(os.environ.get("RECOVERABLE_FUZZ_EXAMPLES", "300"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=4),
    max_leaves=20,
)
TYPE_NAMES = ["object", "array", "string", "integer", "number", "boolean", "null", "bogus"]


def schema_nodes(depth: int = 3) -> st.SearchStrategy[Any]:
    """Schema-shaped JSON: real keywords, plausible and implausible values."""
    leaf = st.fixed_dictionaries(
        {}, optional={
            "type": st.sampled_from(TYPE_NAMES) | st.lists(st.sampled_from(TYPE_NAMES),
                                                           max_size=3) | json_values,
            "enum": st.lists(scalars, max_size=3) | json_values,
            "pattern": st.sampled_from(["^a+$", "(", "[", "\\d{2}", "(a+)+$"]),
            "$ref": st.sampled_from(["#", "#/$defs/A", "#/$defs/missing", "http://x/y", "#/a~1b",
                                     "other.json#/x"]) | st.text(max_size=6),
            "format": st.sampled_from(["date-time", "email", "uuid", "nonsense"]),
            "minimum": st.integers() | st.floats(allow_nan=True),
            "minLength": st.integers(-2, 5) | st.text(max_size=2),
            "additionalProperties": st.booleans() | json_values,
            "const": scalars,
        },
    )
    if depth == 0:
        return leaf | json_values
    child = schema_nodes(depth - 1)
    return leaf | st.fixed_dictionaries(
        {"type": st.sampled_from(["object", "array"]) | st.sampled_from(TYPE_NAMES)},
        optional={
            "properties": st.dictionaries(st.text(max_size=6), child, max_size=4) | json_values,
            "required": st.lists(st.text(max_size=6), max_size=4) | json_values,
            "additionalProperties": st.booleans() | child,
            "items": child,
            "$defs": st.dictionaries(st.sampled_from(["A", "B", "a/b"]), child, max_size=2),
            "anyOf": st.lists(child, max_size=3) | json_values,
            "allOf": st.lists(child, max_size=2),
            "$ref": st.sampled_from(["#", "#/$defs/A", "#/$defs/B", "#/properties/x"]),
            "not": child,
            "description": json_values,
            "default": json_values,
            "prefixItems": st.lists(child, max_size=2) | json_values,
            "minItems": st.integers(-1, 3) | json_values,
        },
    )


names = st.sampled_from(["result", "Answer_1", "a-b"]) | st.text(max_size=70) | st.just("")


def check_contract(name: Any, schema: Any, outputs: list[str]) -> None:
    try:
        contract = contract_for(recoverable.JsonSchema(name, schema))
    except recoverable.InvalidRequest:
        return
    assert isinstance(contract.format_hash, str) and contract.format_hash
    assert contract_for(recoverable.JsonSchema(name, schema)).format_hash == contract.format_hash
    candidates = list(outputs)
    try:
        candidates.append(json.dumps(synthesize_value(contract.schema)))
    except (recoverable.InvalidRequest, RecursionError, TypeError, ValueError):
        pass
    for text in candidates:
        try:
            payload = contract.validate(text)
        except OutputInvalid as invalid:
            assert invalid.kind in ("invalid_json", "schema_violation")
            continue
        assert isinstance(payload, bytes)


@SETTINGS
@given(name=names, schema=json_values, outputs=st.lists(st.text(max_size=30), max_size=2))
def test_any_json_value_as_schema_gives_a_contract_or_invalid_request(
    name: Any, schema: Any, outputs: list[str]
) -> None:
    check_contract(name, schema, outputs)


@SETTINGS
@given(
    name=names,
    schema=schema_nodes(),
    outputs=st.lists(st.builds(json.dumps, json_values) | st.text(max_size=20), max_size=3),
)
def test_schema_shaped_values_give_a_contract_or_invalid_request(
    name: Any, schema: Any, outputs: list[str]
) -> None:
    check_contract(name, schema, outputs)


# -- batch job lines ------------------------------------------------------------------

job_fields = {
    "id": st.text(max_size=12) | json_values,
    "revision": st.text(max_size=8) | json_values,
    "model": st.sampled_from(["gpt-test", ""]) | json_values,
    "input": st.text(max_size=20) | st.lists(st.dictionaries(st.text(max_size=5), json_values,
                                                             max_size=3), max_size=2)
    | json_values,
    "schema": schema_nodes(2) | json_values,
    "instructions": st.none() | st.text(max_size=10) | json_values,
    "schema_name": names | json_values,
    "max_attempts": st.none() | st.integers(-5, 2000) | json_values,
    "reasoning_effort": st.none() | st.sampled_from(["low", "high"]) | json_values,
    "max_output_tokens": st.none() | st.integers() | json_values,
    "extra": json_values,
}


@st.composite
def job_lines(draw: st.DrawFn) -> str:
    shape = draw(st.sampled_from(["job", "job", "job", "text", "json", "deep", "cut"]))
    if shape == "text":
        return draw(st.text(max_size=200))
    if shape == "json":
        return json.dumps(draw(json_values))
    if shape == "deep":
        depth = draw(st.integers(100, 5000))
        return '{"id":"a","revision":"r","model":"m","input":"x","schema":' + (
            '{"a":' * depth) + "1" + "}" * depth + "}"
    keys = draw(st.sets(st.sampled_from(sorted(job_fields)), max_size=len(job_fields)))
    job = {k: draw(job_fields[k]) for k in keys}
    if draw(st.booleans()):  # mostly well-formed jobs with one odd part
        job.update({"id": "job-1", "revision": "r1", "model": "gpt-test", "input": "hi"})
        job.setdefault("schema", {"type": "object", "properties": {"a": {"type": "integer"}},
                                  "required": ["a"], "additionalProperties": False})
    line = json.dumps(job, allow_nan=True)
    if shape == "cut":
        return line[: draw(st.integers(0, len(line)))]
    return line


@SETTINGS
@given(line=job_lines(), lineno=st.integers(1, 10**6))
def test_any_job_line_gives_a_job_or_a_job_line_error(line: str, lineno: int) -> None:
    try:
        job = batch.parse_job_line(line, lineno)
    except batch.JobLineError as exc:
        assert exc.lineno == lineno and exc.reason
        return
    assert isinstance(job, batch.Job)
    assert job.lineno == lineno and job.id and job.revision
    assert contract_for(job.response).format_hash
