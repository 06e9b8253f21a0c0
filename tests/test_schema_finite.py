"""Schemas with no finite instance are refused at prepare; answer synthesis is bounded.

Issue 11.5: one job whose schema was ``{"x": {"$ref": "#/properties/x"}}`` (required) was
accepted, then crashed the embedded fixture's answer synthesis with RecursionError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema_rs
import msgspec
import pytest

import recoverable
from recoverable import Completed, Interruption
from recoverable.cli import jobs as cli_jobs
from recoverable.contract import _clear_caches, contract_for
from recoverable.errors import InvalidRequest
from recoverable.fixture.replies import (
    MAX_SYNTH_DEPTH,
    MAX_SYNTH_VALUES,
    CannotSynthesize,
    events_for,
)
from recoverable.schema_graph import SchemaGraph
from recoverable.testing import FixtureProvider, Reply, synthesize_value
from recoverable.types import JsonSchema
from tests.cli.cli_helpers import job_line, read_results, run_cli, write_jobs


def obj(props: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False, **extra}


CYCLIC: list[tuple[dict[str, Any], str]] = [
    # The issue's reproduction.
    (obj({"x": {"$ref": "#/properties/x"}}), "#/properties/x"),
    # The root contains itself, required.
    (obj({"v": {"type": "string"}, "next": {"$ref": "#"}}), "#/properties/next"),
    # An array that must hold at least one more of itself.
    (obj({"kids": {"type": "array", "minItems": 1, "items": {"$ref": "#"}}}),
     "#/properties/kids"),
    # Mutual recursion through $defs, every branch recursing.
    (obj({"a": {"$ref": "#/$defs/A"}}, **{"$defs": {
        "A": obj({"b": {"$ref": "#/$defs/B"}}),
        "B": obj({"a": {"anyOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]}}),
    }}), "#/$defs/A/properties/b"),
    # Nullable in name only: both anyOf branches recurse.
    (obj({"n": {"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]}}), "#/properties/n"),
]


@pytest.fixture(autouse=True)
def _fresh_caches() -> None:
    _clear_caches()


@pytest.mark.parametrize(("schema", "where"), CYCLIC)
def test_schema_without_finite_instance_is_refused_naming_the_path(
    schema: dict[str, Any], where: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        contract_for(JsonSchema("cyclic", schema))
    message = str(info.value)
    assert info.value.code == "invalid_request"
    assert "no finite instance" in message
    assert f"at {where} " in message, message


def test_required_false_schema_and_empty_enum_are_refused() -> None:
    for schema in (obj({"x": False}), obj({"x": {"enum": []}}), obj({"x": {"anyOf": []}})):
        with pytest.raises(InvalidRequest, match=r"no finite instance.*#/properties/x"):
            contract_for(JsonSchema("never", schema))


class Loop(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    next: Loop


class Tree(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    children: list[Tree]
    parent: Tree | None


def test_struct_that_must_contain_itself_is_refused() -> None:
    with pytest.raises(InvalidRequest, match=r"no finite instance.*#/properties/next"):
        contract_for(Loop)


ESCAPABLE: list[dict[str, Any]] = [
    obj({"n": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}),
    obj({"n": {"type": ["object", "null"], "properties": {"m": {"$ref": "#/properties/n"}},
               "required": ["m"], "additionalProperties": False}}),
    obj({"kids": {"type": "array", "items": {"$ref": "#"}}}),
    obj({"kids": {"type": "array", "minItems": 0, "items": {"$ref": "#"}}}),
    obj({"a": {"$ref": "#/$defs/A"}}, **{"$defs": {
        "A": obj({"b": {"anyOf": [{"$ref": "#/$defs/B"}, {"type": "string"}]}}),
        "B": obj({"a": {"$ref": "#/$defs/A"}}),
    }}),
    obj({"x": {"enum": [{"x": 1}]}, "y": {"const": None}}),
]


@pytest.mark.parametrize("schema", ESCAPABLE)
def test_recursion_with_a_way_out_is_accepted_and_synthesized(schema: dict[str, Any]) -> None:
    contract = contract_for(JsonSchema("tree", schema))
    value = synthesize_value(contract.schema)
    assert contract.validate(json.dumps(value))
    assert synthesize_value(contract.schema) == value  # deterministic


def test_recursive_struct_with_exits_is_accepted_and_synthesized() -> None:
    contract = contract_for(Tree)
    value = synthesize_value(contract.schema)
    assert value == {"name": "example", "children": [], "parent": None}
    assert contract.decode(contract.validate(json.dumps(value))) == Tree("example", [], None)


def test_optional_recursion_outside_strict_mode_is_inhabited() -> None:
    # Not a strict-mode schema (contract_for refuses it earlier), but the analysis and
    # the fixture's synthesis accept recursion through an optional property.
    schema = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": []}
    assert SchemaGraph(schema).no_finite_instance() is None
    assert synthesize_value(schema) == {}


@pytest.mark.parametrize(("schema", "_where"), CYCLIC)
def test_synthesis_of_a_cyclic_schema_is_a_typed_error(
    schema: dict[str, Any], _where: str
) -> None:
    with pytest.raises(CannotSynthesize, match="no finite instance"):
        synthesize_value(schema)


def test_synthesis_is_bounded_in_depth_and_size() -> None:
    # A chain of definitions deeper than the bound: finite, but refused with a typed error.
    defs = {f"D{i}": obj({"v": {"$ref": f"#/$defs/D{i + 1}"}}) for i in range(MAX_SYNTH_DEPTH)}
    defs[f"D{MAX_SYNTH_DEPTH}"] = obj({"v": {"type": "integer"}})
    deep = obj({"v": {"$ref": "#/$defs/D0"}}, **{"$defs": defs})
    with pytest.raises(CannotSynthesize, match="deeper than"):
        synthesize_value(deep)
    # Each level needs two of the next: 2**30 leaves, finite but far too large.
    defs = {f"L{i}": obj({"a": {"$ref": f"#/$defs/L{i + 1}"}, "b": {"$ref": f"#/$defs/L{i + 1}"}})
            for i in range(30)}
    defs["L30"] = obj({"v": {"type": "integer"}})
    wide = obj({"v": {"$ref": "#/$defs/L0"}}, **{"$defs": defs})
    with pytest.raises(CannotSynthesize, match=f"more than {MAX_SYNTH_VALUES}"):
        synthesize_value(wide)


def test_unsatisfiable_constraints_are_a_typed_error_not_an_invalid_answer() -> None:
    schema = obj({"n": {"type": "integer", "minimum": 5, "maximum": 3}})
    with pytest.raises(CannotSynthesize, match="does not satisfy"):
        synthesize_value(schema)
    assert not jsonschema_rs.validator_for(schema).is_valid({"n": 5})


def test_batch_job_line_with_cyclic_schema_is_a_job_line_error() -> None:
    line = json.dumps({"id": "j1", "revision": "r1", "model": "gpt-test", "input": "hi",
                       "schema": obj({"x": {"$ref": "#/properties/x"}})})
    with pytest.raises(cli_jobs.JobLineError) as info:
        cli_jobs.parse_job_line(line, 7)
    assert info.value.lineno == 7
    assert "no finite instance" in info.value.reason and "#/properties/x" in info.value.reason


def _body(schema: dict[str, Any]) -> bytes:
    return msgspec.json.encode({
        "input": "x", "model": "m", "store": False,
        "text": {"format": {"type": "json_schema", "name": "s", "strict": True,
                            "schema": schema}},
    })


@pytest.mark.parametrize("mode", ["sse", "websocket"])
async def test_fixture_answers_an_unanswerable_schema_with_400_and_keeps_serving(
    mode: str,
) -> None:
    cyclic = CYCLIC[0][0]
    assert events_for(Reply.complete({"x": 1}), {}, serial=1, created_at=0)  # unaffected
    async with FixtureProvider.serve() as provider:
        backend = recoverable.ResponsesBackend(
            provider.http_url, mode=mode,  # type: ignore[arg-type]
            credentials=recoverable.StaticCredentials("sk-test"),
        )
        try:
            outcome = await backend.stream(_body(cyclic), attempt_id="op_a.1", token="sk-test")
            assert isinstance(outcome, Interruption), outcome
            assert outcome.kind == "http_rejected" and outcome.http_status == 400
            assert outcome.provider_code == "invalid_json_schema"
            good = obj({"n": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}})
            outcome = await backend.stream(_body(good), attempt_id="op_b.1", token="sk-test")
            assert isinstance(outcome, Completed), outcome
            assert msgspec.json.decode(outcome.text) == {"n": None}
        finally:
            await backend.aclose()
    assert [r.reply_kind for r in provider.requests] == ["synthesize", "synthesize"]


def test_cannot_synthesize_is_an_invalid_request() -> None:
    assert issubclass(CannotSynthesize, InvalidRequest)
    assert CannotSynthesize.code == "cannot_synthesize"


def test_batch_reports_the_cyclic_job_and_runs_the_others_on_every_rerun(tmp_path: Path) -> None:
    """The issue's reproduction as real processes: the cyclic job never reaches the store,
    the provider or the batch's per-job handling; the good job completes."""
    cyclic = obj({"x": {"$ref": "#/properties/x"}})
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(1), job_line(2, schema=cyclic)])
    out, store = tmp_path / "out.jsonl", tmp_path / "store"
    for _ in range(2):  # a rerun behaves the same and spends nothing on the bad line
        run = run_cli("batch", str(jobs), "--out", str(out), "--store", str(store),
                      "--endpoint", "fixture")
        text = run.stdout + run.stderr
        assert "Traceback" not in text and "RecursionError" not in text, text
        assert "jobs.jsonl:2: skipped" in text and "no finite instance" in text, text
        assert "#/properties/x" in text, text
        assert run.returncode == 1, text  # a job (the skipped line) did not run
        assert [r["id"] for r in read_results(out)] == ["gen-0001"]
    listing = msgspec.json.decode(
        run_cli("inventory", "--store", str(store), "--account", "batch", "--json").stdout,
        type=recoverable.Inventory)
    assert [op.job_id for op in listing.operations] == []  # gen-0001 acknowledged; no gen-0002
