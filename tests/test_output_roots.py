"""Output types users write: non-object roots sent wrapped, and one rule for string
length bounds across pydantic models, dataclasses, Structs and raw schemas
(docs/output-types.md).

Real: the fixture provider on 127.0.0.1 and an LMDB store on disk; no mocks.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import pytest
from pydantic import BaseModel, Field

import recoverable
from recoverable.contract import OutputInvalid, contract_for
from recoverable.testing import FixtureProvider, Reply
from tests import output_type_models as m

ACCOUNT = recoverable.AccountBinding("acct-1", "api-key")
REQUEST = recoverable.StructuredRequest(model="gpt-test", input="List them.")


class Row(msgspec.Struct, frozen=True):
    name: str
    size: int


def _wrapper(inner: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"items": inner}, "required": ["items"],
            "additionalProperties": False}


# (type, the answer the provider gives, the value handed back)
WRAPPED: list[tuple[Any, Any, Any]] = [
    (list[m.PItem], {"items": [{"label": "a", "score": 0.5}]}, [m.PItem(label="a", score=0.5)]),
    (list[int], {"items": [1, 2, 3]}, [1, 2, 3]),
    (Literal["yes", "no"], {"items": "no"}, "no"),
    (m.Listing, {"items": [4, 5]}, m.Listing([4, 5])),
    (list[Row], {"items": [{"name": "r", "size": 2}]}, [Row("r", 2)]),
]


@pytest.mark.parametrize(("tp", "answer", "expected"), WRAPPED,
                         ids=["list_model", "list_int", "literal", "root_model", "list_struct"])
async def test_a_non_object_root_is_sent_wrapped_and_returned_unwrapped(
    tmp_path: Path, tp: Any, answer: Any, expected: Any
) -> None:
    contract = contract_for(tp)
    wire = contract.text_format()["schema"]
    assert wire["type"] == "object" and wire["required"] == ["items"]
    assert wire["additionalProperties"] is False and list(wire["properties"]) == ["items"]
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.complete(answer)])
        with recoverable.RecoveryStore.open(tmp_path / "store") as store:
            backend = recoverable.ResponsesBackend(
                provider.http_url, mode="sse", endpoint_id="fixture",
                credentials=recoverable.StaticCredentials("sk-test", account=ACCOUNT))
            async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
                handle = await rt.prepare(REQUEST, response=tp, maximum_attempts=1)
                value = await rt.send_recovering(handle, response=tp, authorize=_approve)
                receipt = await rt.receipt(handle)
                again = await rt.send_recovering(handle, response=tp, authorize=_approve)
        (request,) = provider.requests  # the rerun came from the receipt
    assert value == expected and type(value) is type(expected) and again == expected
    # The receipt keeps what the provider returned; decoding it as the type unwraps.
    assert json.loads(receipt.payload) == answer
    assert receipt.decode(tp) == expected
    assert json.loads(request.body)["text"]["format"]["schema"] == wire
    # The saved (name, schema) rebuilds the same contract (workers, manual retry).
    rebuilt = contract_for(recoverable.JsonSchema(contract.name, contract.schema))
    assert rebuilt.format_hash == contract.format_hash == receipt.format_hash


def test_the_wrapper_schema_is_the_one_field_object() -> None:
    assert contract_for(list[int]).text_format()["schema"] == _wrapper(
        {"type": "array", "items": {"type": "integer"}})
    assert contract_for(Literal["yes", "no"]).text_format()["schema"] == _wrapper(
        {"enum": ["no", "yes"]})  # msgspec sorts a Literal's values
    assert contract_for(list[int]).name == "list_int"
    # An object type is not wrapped.
    assert "items" not in contract_for(m.PItem).schema["properties"]


async def _approve(attempt: recoverable.Attempt) -> bool:
    return True


# ----------------------------------------------------------- one rule for length bounds


class PCode(BaseModel):
    code: str = Field(max_length=3)


@dataclasses.dataclass
class DcCode:
    code: Annotated[str, msgspec.Meta(max_length=3)]


class SCode(msgspec.Struct):
    code: Annotated[str, msgspec.Meta(max_length=3)]


RAW = recoverable.JsonSchema("RawCode", {
    "type": "object", "properties": {"code": {"type": "string", "maxLength": 3}},
    "required": ["code"], "additionalProperties": False,
})


@pytest.mark.parametrize("tp", [PCode, DcCode, SCode, RAW, m.WithMaxLength],
                         ids=["pydantic", "dataclass", "struct", "raw", "nested_pydantic"])
def test_max_length_follows_one_rule_for_every_kind(tp: Any) -> None:
    contract = contract_for(tp)  # accepted: pydantic's is no longer refused
    code = contract.schema["properties"]["code"]
    assert code["maxLength"] == 3  # kept in the contract (and its digest)
    sent = contract.text_format()["schema"]["properties"]["code"]
    assert "maxLength" not in sent  # strict mode takes no length bound: not sent ...
    assert "at most 3 characters" in sent["description"]  # ... the model is told
    # ... and every answer is checked against it, whatever the kind.
    contract.decode(contract.validate(json.dumps(_answer(tp, "abc"))))
    with pytest.raises(OutputInvalid) as caught:
        contract.validate(json.dumps(_answer(tp, "abcd")))
    assert caught.value.kind == "schema_violation"
    # The saved (name, schema) rebuilds the same contract (manual retry, workers).
    rebuilt = contract_for(recoverable.JsonSchema(contract.name, contract.schema))
    assert rebuilt.format_hash == contract.format_hash
    assert rebuilt.text_format() == contract.text_format()


def _answer(tp: Any, code: str) -> dict[str, Any]:
    if tp is m.WithMaxLength:
        return {"inner": {"label": "a", "score": 0.5}, "code": code}
    return {"code": code}


async def test_the_fixture_follows_the_told_bound(tmp_path: Path) -> None:
    async with FixtureProvider.serve() as provider:
        with recoverable.RecoveryStore.open(tmp_path / "store") as store:
            backend = recoverable.ResponsesBackend(
                provider.http_url, mode="sse", endpoint_id="fixture",
                credentials=recoverable.StaticCredentials("sk-test", account=ACCOUNT))
            async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
                handle = await rt.prepare(REQUEST, response=PCode, maximum_attempts=1)
                value = await rt.send_recovering(handle, response=PCode, authorize=_approve)
    assert isinstance(value, PCode) and len(value.code) <= 3
