"""The frozen canonical request body: exact bytes, determinism, rejections."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from recoverable.body import MAX_INPUT_BYTES, body_hash, freeze_body
from recoverable.contract import contract_for
from recoverable.errors import InvalidRequest, UnsupportedInputItem
from recoverable.types import JsonSchema, StructuredRequest


class Answer(msgspec.Struct, forbid_unknown_fields=True):
    text: str


_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
    "additionalProperties": False,
}


def test_exact_bytes_for_a_known_request() -> None:
    contract = contract_for(JsonSchema("answer", _SCHEMA))
    request = StructuredRequest(
        model="gpt-5-mini",
        instructions="Be brief.",
        input="Say hi",
        reasoning_effort="low",
        max_output_tokens=100,
    )
    expected = (
        b'{"input":"Say hi","instructions":"Be brief.","max_output_tokens":100,'
        b'"model":"gpt-5-mini","parallel_tool_calls":false,"reasoning":{"effort":"low"},'
        b'"store":false,"text":{"format":{"name":"answer","schema":{"additionalProperties":false,'
        b'"properties":{"text":{"type":"string"}},"required":["text"],"type":"object"},'
        b'"strict":true,"type":"json_schema"}},"tool_choice":"none","tools":[]}'
    )
    body = freeze_body(request, contract)
    assert body == expected
    assert body_hash(body) == hashlib.sha256(expected).hexdigest()


def test_minimal_request_omits_optional_keys_and_stream() -> None:
    body = msgspec.json.decode(
        freeze_body(StructuredRequest(model="m", input="x"), contract_for(Answer))
    )
    assert set(body) == {
        "model",
        "input",
        "store",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
    }
    assert body["store"] is False
    assert body["tools"] == []
    assert body["tool_choice"] == "none"
    assert body["parallel_tool_calls"] is False
    assert body["text"]["format"] == contract_for(Answer).text_format()


def test_input_items_are_canonical_and_body_is_deterministic() -> None:
    items = [{"role": "user", "content": [{"type": "input_text", "text": "héllo"}]}]
    reordered = [{"content": [{"text": "héllo", "type": "input_text"}], "role": "user"}]
    contract = contract_for(Answer)
    a = freeze_body(StructuredRequest(model="m", input=items, reasoning_effort="none"), contract)
    b = freeze_body(
        StructuredRequest(model="m", input=reordered, reasoning_effort="none"), contract
    )
    assert a == b
    assert body_hash(a) == body_hash(b)
    decoded = msgspec.json.decode(a)
    assert decoded["input"] == items
    assert decoded["reasoning"] == {"effort": "none"}
    assert b'"content":[{"text":"h\xc3\xa9llo","type":"input_text"}],"role":"user"' in a


def test_same_request_different_contract_differs() -> None:
    request = StructuredRequest(model="m", input="x")
    one = freeze_body(request, contract_for(Answer))
    two = freeze_body(request, contract_for(JsonSchema("answer", _SCHEMA)))
    assert one != two  # names differ ("Answer" vs "answer")


@pytest.mark.parametrize(
    ("request_", "fragment"),
    [
        (StructuredRequest(model="m", tools=[{"type": "web_search"}]), "tool-free"),
        (StructuredRequest(model="m", tool_choice="auto"), "tool_choice"),
        (StructuredRequest(model="m", tool_choice="required"), "tool_choice"),
        (StructuredRequest(model="m", previous_response_id="resp_1"), "previous_response_id"),
        (StructuredRequest(model="m", previous_response_id=""), "previous_response_id"),
        (StructuredRequest(model="m", conversation="conv_1"), "conversation"),
        (StructuredRequest(model=""), "model must be a non-empty"),
        (StructuredRequest(model="   "), "model must be a non-empty"),
        (StructuredRequest(model="m" * 257), "longer than 256"),
        (StructuredRequest(model="m", reasoning_effort="maximum"), "reasoning_effort"),
        (StructuredRequest(model="m", reasoning_effort="LOW"), "reasoning_effort"),
        (StructuredRequest(model="m", max_output_tokens=0), "max_output_tokens"),
        (StructuredRequest(model="m", max_output_tokens=True), "max_output_tokens"),
        (StructuredRequest(model="m", input=42), "input must be a string or a list"),  # type: ignore[arg-type]
        (StructuredRequest(model="m", input={"role": "user"}), "input must be"),  # type: ignore[arg-type]
        (StructuredRequest(model="m", input=["text"]), "input item 0 must be a dict"),  # type: ignore[list-item]
        (StructuredRequest(model="m", input=[{"a": object()}]), "not JSON-encodable"),
        (StructuredRequest(model="m", input=[{1: "x"}]), "not JSON-encodable"),  # type: ignore[dict-item]
        (StructuredRequest(model="m", instructions=5), "instructions"),  # type: ignore[arg-type]
        (StructuredRequest(model=7), "model must be"),  # type: ignore[arg-type]
    ],
)
def test_rejections(request_: StructuredRequest, fragment: str) -> None:
    with pytest.raises(InvalidRequest, match=fragment):
        freeze_body(request_, contract_for(Answer))


def test_allowed_tool_choice_values() -> None:
    contract = contract_for(Answer)
    a = freeze_body(StructuredRequest(model="m", tool_choice=None), contract)
    b = freeze_body(StructuredRequest(model="m", tool_choice="none"), contract)
    assert a == b


def test_deeply_nested_input_is_refused_not_crashing() -> None:
    nested: Any = "x"
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(InvalidRequest, match="not JSON-encodable"):
        freeze_body(StructuredRequest(model="m", input=[{"n": nested}]), contract_for(Answer))


def test_size_limit_counts_instructions_and_input() -> None:
    contract = contract_for(Answer)
    half = "a" * (MAX_INPUT_BYTES // 2)
    with pytest.raises(InvalidRequest, match="bytes of canonical JSON"):
        freeze_body(StructuredRequest(model="m", instructions=half, input=half), contract)
    # Just under the limit is accepted (two quotes each side).
    body = freeze_body(
        StructuredRequest(model="m", instructions=half[:-2], input=half[:-2]), contract
    )
    assert len(body) > MAX_INPUT_BYTES


def test_not_a_request_or_contract() -> None:
    with pytest.raises(InvalidRequest, match="StructuredRequest"):
        freeze_body({"model": "m"}, contract_for(Answer))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="ResponseContract"):
        freeze_body(StructuredRequest(model="m"), Answer)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("item", "item_type"),
    [
        ({"type": "item_reference", "id": "msg_123"}, "item_reference"),
        ({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
         "function_call"),
        ({"type": "function_call_output", "call_id": "c1", "output": "42"},
         "function_call_output"),
        ({"type": "custom_tool_call_output", "call_id": "c1", "output": "x"},
         "custom_tool_call_output"),
        ({"type": "computer_call", "id": "cu_1", "call_id": "c2", "action": {}},
         "computer_call"),
        ({"type": "shell_call_output", "call_id": "c3", "output": []}, "shell_call_output"),
        ({"type": "mcp_call", "id": "m1", "name": "n", "arguments": "{}", "server_label": "s"},
         "mcp_call"),
        ({"type": "mcp_approval_response", "approval_request_id": "a", "approve": True},
         "mcp_approval_response"),
        ({"type": "reasoning", "id": "rs_1", "summary": []}, "reasoning"),
        ({"type": "compaction", "encrypted_content": "x"}, "compaction"),
        ({"role": "user", "content": "hi", "call_id": "c4"}, None),  # anything with call_id
        ({"content": "no role"}, None),
    ],
)
def test_input_items_that_continue_a_thread_or_replay_tools_are_rejected(
    item: dict[str, Any], item_type: str | None
) -> None:
    """Issue 10.8: refused at freeze time (so at prepare), naming the item."""
    ok = {"role": "user", "content": "first"}
    with pytest.raises(UnsupportedInputItem) as refused:
        freeze_body(StructuredRequest(model="m", input=[ok, item]), contract_for(Answer))
    assert refused.value.code == "unsupported_input_item"
    assert isinstance(refused.value, InvalidRequest)
    assert refused.value.item_index == 1 and refused.value.item_type == item_type
    assert "input item 1" in str(refused.value)


def test_message_items_are_accepted_in_every_spelling() -> None:
    contract = contract_for(Answer)
    items: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"role": "assistant", "content": "an example answer"},
        {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
    ]
    body = msgspec.json.decode(freeze_body(StructuredRequest(model="m", input=items), contract))
    assert body["input"] == msgspec.json.decode(msgspec.json.encode(items, order="sorted"))


async def test_prepare_rejects_a_tool_history_item_and_saves_nothing(tmp_path: Path) -> None:
    """Issue 10.8 through the public API: a typed error, no record, no POST."""
    import recoverable

    account = recoverable.AccountBinding("acct-1")
    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    backend = recoverable.ResponsesBackend(
        "http://127.0.0.1:9/v1",
        credentials=recoverable.StaticCredentials("k", account=account),
    )
    request = StructuredRequest(model="m", input=[
        {"role": "user", "content": "what did the tool say?"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
    ])
    try:
        async with recoverable.open_runtime(store, backend, account=account) as rt:
            with pytest.raises(recoverable.UnsupportedInputItem) as refused:
                await rt.prepare(request, response=Answer, maximum_attempts=1)
            assert refused.value.item_type == "function_call_output"
            assert (await rt.inventory()).operations == ()
    finally:
        store.close()
