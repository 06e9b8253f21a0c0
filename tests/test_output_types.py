"""Output types (issue 19.1): pydantic v2 models, dataclasses and TypedDicts as ``response=``.

Each becomes a strict-mode schema, comes back as an instance of its type (from
``send_recovering`` and from ``Receipt.decode``), refuses what strict mode cannot express
naming the field, and has a digest that is the same in another process. pydantic stays
optional: ``import recoverable`` does not import it, and the other kinds work without it.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from pydantic import BaseModel

import recoverable
from recoverable.contract import OutputInvalid, _clear_caches, contract_for
from recoverable.errors import InvalidRequest, UnsupportedOutputType
from recoverable.testing import FixtureProvider, Reply
from tests import output_type_models as m

ROOT = Path(__file__).resolve().parent.parent
ACCOUNT = recoverable.AccountBinding("acct-1", "api-key")
REQUEST = recoverable.StructuredRequest(model="gpt-test", input="Fill the basket.")
FAST = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)


class Answer(msgspec.Struct):
    answer: int
    note: str | None


@pytest.fixture(autouse=True)
def _fresh_contracts() -> Iterator[None]:
    _clear_caches()
    yield
    _clear_caches()


# ----------------------------------------------------------------- the strict shape


def _walk(schema: Any, path: str = "#") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(schema, dict):
        yield path, schema
        for key, value in schema.items():
            if key in ("enum", "const"):
                continue
            if key in ("properties", "$defs"):
                for name, sub in value.items():
                    yield from _walk(sub, f"{path}/{key}/{name}")
            else:
                yield from _walk(value, f"{path}/{key}")
    elif isinstance(schema, list):
        for i, item in enumerate(schema):
            yield from _walk(item, f"{path}/{i}")


def assert_strict(schema: dict[str, Any]) -> None:
    """OpenAI strict mode: object root, every object closed with every property required,
    no annotation or unsupported keyword, no $ref with siblings."""
    assert schema["type"] == "object" and "$ref" not in schema and "anyOf" not in schema
    for path, node in _walk(schema):
        for banned in ("title", "default", "oneOf", "allOf", "discriminator", "const",
                       "examples", "uniqueItems", "prefixItems", "minLength", "maxLength"):
            assert banned not in node, (path, banned)
        if node.get("type") == "object" or "properties" in node:
            assert node["additionalProperties"] is False, path
            assert node["required"] == list(node["properties"]), path
        if "$ref" in node:
            assert set(node) == {"$ref"}, path


KINDS = [m.DcBasket, m.TdShape, m.PBasket, m.TreeNode, m.Forest, m.Closed]


@pytest.mark.parametrize("tp", KINDS, ids=lambda t: t.__name__)
def test_every_kind_becomes_a_strict_schema(tp: Any) -> None:
    contract = contract_for(tp)
    assert contract.name == tp.__name__
    assert contract.python_type is tp
    assert_strict(contract.schema)
    assert contract.text_format()["strict"] is True
    # The saved request keeps (name, schema); rebuilt as a JsonSchema (manual retry with
    # reselection) it is the same contract.
    rebuilt = contract_for(recoverable.JsonSchema(contract.name, contract.schema))
    assert rebuilt.format_hash == contract.format_hash


def test_optionals_are_nullable_and_required_defaults_keep_their_type() -> None:
    for tp in (m.DcBasket, m.PBasket):
        props = contract_for(tp).schema["properties"]
        assert props["note"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
        # a default does not make a field nullable: a null could not be decoded into it
        assert props["color"] == {"$ref": "#/$defs/Color"}
        assert props["mode"]["enum"] == ["fast", "slow"]
    typed_dict = contract_for(m.TdShape).schema
    assert typed_dict["properties"]["closed"] == {
        "anyOf": [{"type": "boolean"}, {"type": "null"}]
    }


def test_pydantic_schema_details() -> None:
    schema = contract_for(m.PBasket).schema
    props = schema["properties"]
    assert schema["description"] == "A basket of items."
    # a $ref with a description is inlined one level, keeping the field's description
    assert props["first"]["description"] == "the first item"
    assert props["first"]["properties"]["label"]["description"] == "what the item is"
    assert props["first"]["properties"]["score"] == {
        "type": "number", "minimum": 0, "maximum": 1
    }
    # a discriminated union becomes anyOf; Literal["cat"] becomes a one-value enum
    assert props["pet"] == {"anyOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}
    assert schema["$defs"]["Cat"]["properties"]["kind"] == {"type": "string", "enum": ["cat"]}
    assert props["seen"] == {
        "anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]
    }
    assert props["count"] == {"type": "integer", "minimum": 0}
    assert sorted(schema["$defs"]) == ["Cat", "Color", "Dog", "PItem"]


def test_recursive_pydantic_models_with_a_way_out() -> None:
    tree = contract_for(m.TreeNode).schema
    assert tree["properties"]["children"] == {"type": "array", "items": {"$ref": "#"}}
    assert tree["properties"]["next"] == {"anyOf": [{"$ref": "#"}, {"type": "null"}]}
    forest = contract_for(m.Forest)
    node = forest.schema["$defs"]["TreeNode"]
    assert node["properties"]["children"]["items"] == {"$ref": "#/$defs/TreeNode"}
    payload = json.dumps({
        "trees": [{"name": "a", "children": [{"name": "b", "children": [], "next": None}],
                   "next": {"name": "c", "children": [], "next": None}}],
        "largest": None,
    })
    value = forest.decode(forest.validate(payload))
    assert isinstance(value, m.Forest)
    assert value.trees[0].children[0].name == "b" and value.trees[0].next is not None


def test_recursion_without_a_way_out_is_refused_at_the_field() -> None:
    with pytest.raises(InvalidRequest, match=r"no finite instance.*#/properties/inner"):
        contract_for(m.Loop)


# ----------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("tp", "field_path", "keyword"),
    [
        (m.WithDict, "WithDict.scores", "additionalProperties"),
        (m.WithSet, "WithSet.tags", "uniqueItems"),
        (m.WithTuple, "WithTuple.pair", "prefixItems"),
        (m.WithAny, "WithAny.blob", "{}"),
        (m.WithUri, "WithUri.link", "format"),
        (m.Nested, "Nested.holder.scores", "additionalProperties"),
        (m.DcWithBytes, "DcWithBytes.data", "contentEncoding"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_unsupported_constructs_are_refused_naming_the_field(
    tp: Any, field_path: str, keyword: str
) -> None:
    with pytest.raises(UnsupportedOutputType) as caught:
        contract_for(tp)
    error = caught.value
    assert isinstance(error, InvalidRequest)  # hosts catching InvalidRequest still do
    assert error.code == "unsupported_output_type"
    assert error.field_path == field_path
    assert error.keyword == keyword
    assert f"field {field_path} " in str(error)
    assert "strict mode cannot express" in str(error)


def test_non_types_are_refused() -> None:
    # A non-object root (m.Listing, a RootModel) is sent wrapped: tests/test_output_roots.py.
    for bad in (m.Plain, m.PBasket(owner="x", items=[], first=m.PItem(label="a", score=0),
                                   pet=m.Cat(kind="cat", meows=1)), dict, BaseModel):
        with pytest.raises(InvalidRequest):
            contract_for(bad)


async def test_prepare_refuses_an_unsupported_type_before_saving_anything(
    tmp_path: Path,
) -> None:
    async with FixtureProvider.serve() as provider:
        with recoverable.RecoveryStore.open(tmp_path / "store") as store:
            async with _runtime(store, provider) as rt:
                with pytest.raises(UnsupportedOutputType, match=r"field WithSet\.tags "):
                    await rt.prepare(REQUEST, response=m.WithSet, maximum_attempts=2)
                inventory = await rt.inventory()
                assert inventory.operations == ()
        assert provider.requests == []


# ----------------------------------------------------------------- validation


def test_pydantic_validators_run_when_an_answer_is_validated() -> None:
    contract = contract_for(m.PBasket)
    good = _basket_payload()
    value = contract.decode(contract.validate(json.dumps(good)))
    assert isinstance(value, m.PBasket) and value.seen == datetime.date(2026, 11, 30)
    secret = "   "
    with pytest.raises(OutputInvalid) as caught:
        contract.validate(json.dumps({**good, "owner": secret}))
    assert caught.value.kind == "schema_violation"
    assert "/owner" in caught.value.detail and "value_error" in caught.value.detail
    # the schema check comes first and names a schema path; nothing quotes the payload
    with pytest.raises(OutputInvalid) as caught:
        contract.validate(json.dumps({**good, "count": "SECRET-TEXT"}))
    assert "SECRET-TEXT" not in str(caught.value)
    # a value strict mode lets through (a string) that is not a date: pydantic refuses it
    with pytest.raises(OutputInvalid, match="/seen"):
        contract.validate(json.dumps({**good, "seen": "not-a-date"}))


def test_native_kinds_validate_against_the_strict_schema() -> None:
    contract = contract_for(m.DcBasket)
    good = {"owner": "o", "items": [{"label": "a", "score": 1.5}], "note": None,
            "color": "blue", "mode": "slow", "tags": ["t"]}
    value = contract.decode(contract.validate(json.dumps(good)))
    assert value == m.DcBasket("o", [m.DcItem("a", 1.5)], None, m.Color.BLUE, "slow", ["t"])
    missing = {k: v for k, v in good.items() if k != "tags"}  # defaulted, still required
    with pytest.raises(OutputInvalid):
        contract.validate(json.dumps(missing))
    with pytest.raises(OutputInvalid):
        contract.validate(json.dumps({**good, "extra": 1}))


def test_contract_decode_failure_is_a_msgspec_validation_error() -> None:
    # The operation actor maps it to FormatMismatch whatever the kind of type.
    contract = contract_for(m.PBasket)
    with pytest.raises(msgspec.ValidationError, match="does not validate as PBasket"):
        contract.decode(b'{"owner": 1}')


# ----------------------------------------------------------------- round trips


def _basket_payload() -> dict[str, Any]:
    return {
        "owner": "ada",
        "items": [{"label": "apple", "score": 0.5}],
        "first": {"label": "apple", "score": 0.5},
        "note": None,
        "color": "blue",
        "mode": "slow",
        "pet": {"kind": "dog", "barks": True},
        "count": 2,
        "seen": "2026-11-30",
    }


ROUND_TRIPS: list[tuple[Any, dict[str, Any], Any]] = [
    (
        m.DcBasket,
        {"owner": "o", "items": [{"label": "a", "score": 1.0}], "note": "n",
         "color": "red", "mode": "fast", "tags": []},
        m.DcBasket("o", [m.DcItem("a", 1.0)], "n", m.Color.RED, "fast", []),
    ),
    (
        m.TdShape,
        {"name": "tri", "points": [{"x": 0, "y": 0}, {"x": 1, "y": 2}], "color": "red",
         "closed": None},
        {"name": "tri", "points": [{"x": 0, "y": 0}, {"x": 1, "y": 2}], "color": "red",
         "closed": None},
    ),
    (
        m.PBasket,
        _basket_payload(),
        m.PBasket(owner="ada", items=[m.PItem(label="apple", score=0.5)],
                  first=m.PItem(label="apple", score=0.5), note=None, color=m.Color.BLUE,
                  mode="slow", pet=m.Dog(kind="dog", barks=True), count=2,
                  seen=datetime.date(2026, 11, 30)),
    ),
    (
        m.Forest,
        {"trees": [{"name": "r", "children": [{"name": "c", "children": [], "next": None}],
                    "next": None}], "largest": None},
        m.Forest(trees=[m.TreeNode(name="r", children=[m.TreeNode(name="c", children=[])])],
                 largest=None),
    ),
]


def _runtime(store: recoverable.RecoveryStore, provider: FixtureProvider) -> Any:
    backend = recoverable.ResponsesBackend(
        provider.http_url,
        credentials=recoverable.StaticCredentials("sk-test", account=ACCOUNT),
        mode="sse",
        endpoint_id="fixture",
    )
    return recoverable.open_runtime(store, backend, account=ACCOUNT)


async def _approve(attempt: recoverable.Attempt) -> bool:
    return True


@pytest.mark.parametrize(("tp", "payload", "expected"), ROUND_TRIPS,
                         ids=[t.__name__ for t, _, _ in ROUND_TRIPS])
async def test_round_trip_through_the_fixture_provider(
    tmp_path: Path, tp: Any, payload: dict[str, Any], expected: Any
) -> None:
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.disconnect(after_events=3), Reply.complete(payload)])
        with recoverable.RecoveryStore.open(tmp_path / "store") as store:
            async with _runtime(store, provider) as rt:
                handle = await rt.prepare(
                    REQUEST, response=tp, maximum_attempts=3, retry_policy=FAST
                )
                value = await rt.send_recovering(handle, response=tp, authorize=_approve)
                receipt = await rt.receipt(handle)
            posts = len(provider.requests)
            # a new runtime returns the saved receipt as the same type, with no POST
            async with _runtime(store, provider) as rt2:
                again = await rt2.send_recovering(handle, response=tp, authorize=_approve)
            assert len(provider.requests) == posts == 2
    assert value == expected and type(value) is type(expected)
    assert again == expected
    assert receipt.decode(tp) == expected
    assert receipt.format_hash == contract_for(tp).format_hash
    sent = json.loads(provider.requests[0].body)["text"]["format"]
    assert sent == contract_for(tp).text_format()
    assert provider.requests[0].body == provider.requests[1].body  # the frozen body


async def test_synthesized_answer_for_a_recursive_pydantic_model(tmp_path: Path) -> None:
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.synthesize()])
        with recoverable.RecoveryStore.open(tmp_path / "store") as store:
            async with _runtime(store, provider) as rt:
                handle = await rt.prepare(REQUEST, response=m.Forest, maximum_attempts=1)
                value = await rt.send_recovering(handle, response=m.Forest, authorize=_approve)
    assert isinstance(value, m.Forest)


async def test_a_model_validator_rejection_is_invalid_output_and_can_be_replaced(
    tmp_path: Path,
) -> None:
    blank = {**_basket_payload(), "owner": " "}
    policy = recoverable.RetryPolicy(
        initial_backoff=0.0, maximum_backoff=0.0, replace_invalid_output=True
    )
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.complete(blank), Reply.complete(_basket_payload())])
        with recoverable.RecoveryStore.open(tmp_path / "store") as store:
            async with _runtime(store, provider) as rt:
                handle = await rt.prepare(
                    REQUEST, response=m.PBasket, maximum_attempts=2, retry_policy=policy
                )
                value = await rt.send_recovering(handle, response=m.PBasket, authorize=_approve)
                status = await rt.status(handle)
    assert value.owner == "ada"
    first = status.attempts[0].failure
    assert first is not None and first.kind == "invalid_output"


async def test_a_different_type_at_send_is_a_format_mismatch(tmp_path: Path) -> None:
    async with FixtureProvider.serve() as provider:
        with recoverable.RecoveryStore.open(tmp_path / "store") as store:
            async with _runtime(store, provider) as rt:
                handle = await rt.prepare(REQUEST, response=m.PBasket, maximum_attempts=1)
                with pytest.raises(recoverable.FormatMismatch):
                    await rt.send_recovering(handle, response=m.DcBasket, authorize=_approve)
        assert provider.requests == []


# ----------------------------------------------------------------- processes


_HASHES = """
import json, sys
from recoverable.contract import contract_for
from tests import output_type_models as m
print(json.dumps({t.__name__: contract_for(t).format_hash
                  for t in (m.DcBasket, m.TdShape, m.PBasket, m.TreeNode, m.Forest, m.Closed)}))
"""


def _python(code: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,  # generous: two cores shared by many test runs
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_digest_is_the_same_in_other_processes() -> None:
    here = {t.__name__: contract_for(t).format_hash for t in KINDS}
    for seed in ("1", "2"):  # different str hashing: no set or dict-order dependence
        there = json.loads(_python(_HASHES, PYTHONHASHSEED=seed))
        assert there == here


def test_importing_recoverable_does_not_import_pydantic() -> None:
    _python(
        "import sys, recoverable, recoverable.testing, recoverable.output_types\n"
        "assert 'pydantic' not in sys.modules, 'pydantic was imported'\n"
    )


_WITHOUT_PYDANTIC = """
import dataclasses, sys, typing
sys.modules['pydantic'] = None  # any import of pydantic now fails
import msgspec
from recoverable.contract import contract_for
from recoverable.types import Receipt

@dataclasses.dataclass
class Dc:
    a: int
    b: typing.Optional[str] = None

class Td(typing.TypedDict):
    x: list[int]

class St(msgspec.Struct):
    y: bool

for tp, text in ((Dc, '{"a": 1, "b": null}'), (Td, '{"x": [1]}'), (St, '{"y": true}')):
    contract = contract_for(tp)
    print(tp.__name__, contract.decode(contract.validate(text)))

class LooksLikeAModel:
    model_fields = {}
try:
    contract_for(LooksLikeAModel)
except Exception as exc:
    print(type(exc).__name__)
"""


def test_the_other_kinds_work_without_pydantic() -> None:
    out = _python(_WITHOUT_PYDANTIC).splitlines()
    assert out == [
        "Dc Dc(a=1, b=None)",
        "Td {'x': [1]}",
        "St St(y=True)",
        "InvalidRequest",
    ]


def test_receipt_decode_accepts_every_kind_and_json_schema() -> None:
    from recoverable.output_types import decode_as

    payload = b'{"value": 3}'
    assert decode_as(payload, m.Closed) == m.Closed(value=3)
    assert decode_as(payload, dict) == {"value": 3}
    assert decode_as(payload, recoverable.JsonSchema("closed", {})) == {"value": 3}
    with pytest.raises(msgspec.ValidationError):
        decode_as(b'{"value": "x"}', dict[str, int])
