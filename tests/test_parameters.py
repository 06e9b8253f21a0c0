"""Issue 19.2: optional Responses parameters: accepted, validated, frozen, refused, sent."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

import recoverable
from recoverable.body import body_hash, freeze_body, parameters_from_wire
from recoverable.cli.jobs import JobLineError, parse_job_line
from recoverable.contract import contract_for
from recoverable.errors import InvalidParameter, InvalidRequest
from recoverable.records import StoredRequest
from recoverable.testing import FixtureProvider, Reply
from recoverable.types import JsonSchema, StructuredRequest

_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
    "additionalProperties": False,
}
_FORMAT = (
    b'"text":{"format":{"name":"answer","schema":{"additionalProperties":false,'
    b'"properties":{"text":{"type":"string"}},"required":["text"],"type":"object"},'
    b'"strict":true,"type":"json_schema"}'
)
_TAIL = b',"tool_choice":"none","tools":[]}'
# The body of StructuredRequest(model="m", input="x") (tests/test_body.py pins the format).
_BASE = (
    b'{"input":"x","model":"m","parallel_tool_calls":false,"store":false,'
    + _FORMAT + b"}" + _TAIL
)

ALL_PARAMETERS: dict[str, Any] = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_logprobs": 5,
    "max_output_tokens": 2048,
    "service_tier": "flex",
    "metadata": {"job": "j-1", "batch": "b-7"},
    "prompt_cache_key": "cache-key-1",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "safety_identifier": "user-hash-1",
    "user": "u-1",
    "truncation": "auto",
    "verbosity": "low",
    "reasoning_effort": "low",
    "reasoning_summary": "concise",
    "include": ["message.output_text.logprobs", "reasoning.encrypted_content"],
    "moderation": {"model": "omni-moderation-latest", "policy": {"input": {"mode": "score"}}},
}

ALL_EXPECTED = (
    b'{"include":["message.output_text.logprobs","reasoning.encrypted_content"],'
    b'"input":"x","max_output_tokens":2048,'
    b'"metadata":{"batch":"b-7","job":"j-1"},"model":"m",'
    b'"moderation":{"model":"omni-moderation-latest","policy":{"input":{"mode":"score"}}},'
    b'"parallel_tool_calls":false,"prompt_cache_key":"cache-key-1",'
    b'"prompt_cache_options":{"mode":"implicit","ttl":"30m"},"prompt_cache_retention":"24h",'
    b'"reasoning":{"effort":"low","summary":"concise"},"safety_identifier":"user-hash-1",'
    b'"service_tier":"flex","store":false,"temperature":0.7,'
    + _FORMAT
    + b',"verbosity":"low"},"tool_choice":"none","tools":[],"top_logprobs":5,"top_p":0.9,'
    b'"truncation":"auto","user":"u-1"}'
)


def _contract() -> Any:
    return contract_for(JsonSchema("answer", _SCHEMA))


def _freeze(**params: Any) -> bytes:
    return freeze_body(StructuredRequest(model="m", input="x", **params), _contract())


def test_base_body_is_unchanged_by_the_new_fields() -> None:
    """Unset parameters are omitted: existing frozen bodies and their hashes stay the same."""
    assert _freeze() == _BASE


def test_all_parameters_freeze_to_exact_bytes() -> None:
    assert _freeze(**ALL_PARAMETERS) == ALL_EXPECTED


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"temperature": 0}, b'"temperature":0.0,'),
        ({"temperature": 2}, b'"temperature":2.0,'),
        ({"temperature": 1.25}, b'"temperature":1.25,'),
        ({"top_p": 0.0}, b'"tools":[],"top_p":0.0}'),
        ({"top_p": 1}, b'"tools":[],"top_p":1.0}'),
        ({"top_logprobs": 0}, b'"tools":[],"top_logprobs":0}'),
        ({"top_logprobs": 20}, b'"tools":[],"top_logprobs":20}'),
        ({"max_output_tokens": 1}, b'"max_output_tokens":1,'),
        ({"max_output_tokens": 2**24}, b'"max_output_tokens":16777216,'),
        *[({"service_tier": t}, b'"service_tier":"%s",' % t.encode())
          for t in ("auto", "default", "flex", "scale", "priority", "fast", "ultrafast")],
        ({"metadata": {}}, b'"metadata":{},'),
        ({"metadata": {f"k{i:02}": "v" * 512 for i in range(16)}}, b'"k15":"vvv'),
        ({"metadata": {"k" * 64: ""}}, b'"metadata":{"' + b"k" * 64 + b'":""},'),
        ({"prompt_cache_key": "p" * 64}, b'"prompt_cache_key":"' + b"p" * 64 + b'",'),
        ({"safety_identifier": "s"}, b'"safety_identifier":"s",'),
        ({"user": "u"}, b'"tools":[],"user":"u"}'),
        ({"prompt_cache_retention": "in_memory"}, b'"prompt_cache_retention":"in_memory",'),
        ({"prompt_cache_options": {"mode": "explicit"}},
         b'"prompt_cache_options":{"mode":"explicit"},'),
        ({"truncation": "disabled"}, b'"truncation":"disabled"}'),
        *[({"verbosity": v}, b'"type":"json_schema"},"verbosity":"%s"}' % v.encode())
          for v in ("low", "medium", "high")],
        *[({"reasoning_summary": v}, b'"reasoning":{"summary":"%s"},' % v.encode())
          for v in ("auto", "concise", "detailed")],
        ({"reasoning_effort": "max"}, b'"reasoning":{"effort":"max"},'),
        ({"reasoning_mode": "pro"}, b'"reasoning":{"mode":"pro"},'),
        ({"reasoning_mode": "standard"}, b'"reasoning":{"mode":"standard"},'),
        *[({"reasoning_context": v}, b'"reasoning":{"context":"%s"},' % v.encode())
          for v in ("auto", "current_turn", "all_turns")],
        ({"reasoning_effort": "high", "reasoning_summary": "auto", "reasoning_mode": "pro",
          "reasoning_context": "auto"},
         b'"reasoning":{"context":"auto","effort":"high","mode":"pro","summary":"auto"},'),
        ({"include": ["reasoning.encrypted_content", "message.input_image.image_url",
                      "reasoning.encrypted_content"]},
         b'{"include":["message.input_image.image_url","reasoning.encrypted_content"],'),
        ({"moderation": {"model": "mod", "policy": {"output": {"mode": "block"}, "input": None}}},
         b'"moderation":{"model":"mod","policy":{"output":{"mode":"block"}}},'),
    ],
)
def test_each_parameter_is_accepted_and_frozen(params: dict[str, Any], fragment: bytes) -> None:
    body = _freeze(**params)
    assert fragment in body
    decoded = msgspec.json.decode(body)
    base = msgspec.json.decode(_BASE)
    added = {"reasoning" if k.startswith("reasoning_") else k for k in params}
    assert set(decoded) - set(base) <= added  # nothing else added
    # Canonical: re-encoding the decoded body with sorted keys gives the same bytes.
    assert msgspec.json.encode(decoded, order="sorted") == body


def test_numbers_are_normalized_so_equal_requests_freeze_alike() -> None:
    assert _freeze(temperature=1) == _freeze(temperature=1.0)
    assert _freeze(top_p=0) == _freeze(top_p=0.0)
    assert _freeze(include=["reasoning.encrypted_content", "message.output_text.logprobs"]) == \
        _freeze(include=["message.output_text.logprobs", "reasoning.encrypted_content"])


@pytest.mark.parametrize(
    ("params", "parameter"),
    [
        ({"temperature": -0.01}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": 10**400}, "temperature"),  # too large for a float: no OverflowError
        ({"top_p": -(10**400)}, "top_p"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -1}, "top_p"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 1.0}, "top_logprobs"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 2**24 + 1}, "max_output_tokens"),
        ({"max_output_tokens": 10.0}, "max_output_tokens"),
        ({"max_output_tokens": False}, "max_output_tokens"),
        ({"service_tier": "cheap"}, "service_tier"),
        ({"service_tier": "FLEX"}, "service_tier"),
        ({"service_tier": ["flex"]}, "service_tier"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"": "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"metadata": {1: "v"}}, "metadata"),
        ({"metadata": [("k", "v")]}, "metadata"),
        ({"prompt_cache_key": "p" * 65}, "prompt_cache_key"),
        ({"prompt_cache_key": ""}, "prompt_cache_key"),
        ({"prompt_cache_key": 7}, "prompt_cache_key"),
        ({"safety_identifier": "s" * 65}, "safety_identifier"),
        ({"user": "u" * 65}, "user"),
        ({"prompt_cache_retention": "1h"}, "prompt_cache_retention"),
        ({"prompt_cache_options": {"ttl": "1h"}}, "prompt_cache_options.ttl"),
        ({"prompt_cache_options": {"mode": "manual"}}, "prompt_cache_options.mode"),
        ({"prompt_cache_options": {"size": 1}}, "prompt_cache_options"),
        ({"prompt_cache_options": "implicit"}, "prompt_cache_options"),
        ({"truncation": "middle"}, "truncation"),
        ({"verbosity": "terse"}, "verbosity"),
        ({"reasoning_summary": "full"}, "reasoning_summary"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"reasoning_mode": "turbo"}, "reasoning_mode"),
        ({"reasoning_context": "none"}, "reasoning_context"),
        ({"include": "reasoning.encrypted_content"}, "include"),
        ({"include": ["output_text"]}, "include"),
        ({"moderation": {"policy": {}}}, "moderation"),
        ({"moderation": {"model": "m", "policy": {"input": {"mode": "warn"}}}},
         "moderation.policy.input.mode"),
        ({"moderation": {"model": "m", "extra": 1}}, "moderation"),
    ],
)
def test_each_bad_value_is_a_typed_error_naming_the_parameter(
    params: dict[str, Any], parameter: str
) -> None:
    with pytest.raises(InvalidParameter) as refused:
        _freeze(**params)
    assert refused.value.parameter == parameter
    assert refused.value.code == "invalid_parameter"
    assert isinstance(refused.value, InvalidRequest)
    assert parameter.split(".")[0] in str(refused.value)


@pytest.mark.parametrize(
    ("params", "parameter"),
    [
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"parallel_tool_calls": True}, "parallel_tool_calls"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"include": ["code_interpreter_call.outputs"]}, "include"),
    ],
)
def test_server_state_and_tool_parameters_are_refused_by_name(
    params: dict[str, Any], parameter: str
) -> None:
    with pytest.raises(InvalidParameter) as refused:
        _freeze(**params)
    assert refused.value.parameter == parameter and refused.value.reason == "refused"
    assert parameter in str(refused.value)


@pytest.mark.parametrize(
    ("params", "parameter"),
    [
        ({"tools": None}, "tools"),
        ({"store": 0}, "store"),
        ({"background": 0}, "background"),
        ({"parallel_tool_calls": 0}, "parallel_tool_calls"),
        ({"model_override": 1}, "model_override"),
    ],
)
def test_look_alike_values_that_could_not_be_read_back_are_refused(
    params: dict[str, Any], parameter: str
) -> None:
    """Found by the fuzz test below: ``tools=None`` or ``store=0`` passed the no-op check,
    and the saved request then failed to decode (``CorruptRecord`` on reselection)."""
    with pytest.raises(InvalidParameter) as refused:
        _freeze(**params)
    assert refused.value.parameter == parameter


def test_the_no_op_values_of_refused_parameters_are_accepted() -> None:
    assert _freeze(store=False, background=False, parallel_tool_calls=False,
                   tools=[], tool_choice="none") == _BASE


def test_unknown_keyword_is_rejected_by_name() -> None:
    with pytest.raises(TypeError, match="temprature"):
        StructuredRequest(model="m", temprature=0.5)  # type: ignore[call-arg]
    # Decoding a saved or hand-written request refuses unknown fields too.
    with pytest.raises(msgspec.ValidationError, match="temprature"):
        msgspec.json.decode(b'{"model":"m","temprature":0.5}', type=StructuredRequest)


def test_from_params_nests_every_reasoning_field() -> None:
    request = StructuredRequest.from_params({"model": "m", "reasoning": {
        "effort": "high", "summary": "auto", "mode": "pro", "context": "current_turn"}})
    assert (request.reasoning_effort, request.reasoning_summary, request.reasoning_mode,
            request.reasoning_context) == ("high", "auto", "pro", "current_turn")


def test_from_params_maps_wire_names_and_freezes_identically() -> None:
    wire = {
        "model": "m",
        "input": "x",
        "temperature": 0.7,
        "top_p": 0.9,
        "top_logprobs": 5,
        "max_output_tokens": 2048,
        "service_tier": "flex",
        "metadata": {"job": "j-1", "batch": "b-7"},
        "prompt_cache_key": "cache-key-1",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
        "safety_identifier": "user-hash-1",
        "user": "u-1",
        "truncation": "auto",
        "text": {"verbosity": "low"},
        "reasoning": {"effort": "low", "summary": "concise"},
        "include": ["message.output_text.logprobs", "reasoning.encrypted_content"],
        "moderation": {"model": "omni-moderation-latest", "policy": {"input": {"mode": "score"}}},
        "store": False,
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": False,
    }
    request = StructuredRequest.from_params(wire)
    assert freeze_body(request, _contract()) == ALL_EXPECTED


@pytest.mark.parametrize(
    ("wire", "parameter", "reason"),
    [
        ({"model": "m", "temprature": 1}, "temprature", "unknown"),
        ({"model": "m", "frequency_penalty": 1}, "frequency_penalty", "unknown"),
        ({"model": "m", "text": {"verbosty": "low"}}, "text.verbosty", "unknown"),
        ({"model": "m", "reasoning": {"modes": "pro"}}, "reasoning.modes", "unknown"),
        ({"model": "m", "reasoning": {"generate_summary": "auto"}},
         "reasoning.generate_summary", "unknown"),
        ({"model": "m", "model_override": True}, "model_override", "unknown"),
        ({"model": "m", "text": {"format": {"type": "text"}}}, "text.format", "refused"),
        ({"model": "m", "max_tool_calls": 3}, "max_tool_calls", "refused"),
        ({"model": "m", "context_management": [{"type": "compaction"}]},
         "context_management", "refused"),
        ({"model": "m", "stream": True}, "stream", "refused"),
        ({"model": "m", "stream_options": {}}, "stream_options", "refused"),
        ({"model": "m", "text": "low"}, "text", "invalid_value"),
    ],
)
def test_from_params_refuses_unknown_and_transport_names(
    wire: dict[str, Any], parameter: str, reason: str
) -> None:
    with pytest.raises(InvalidParameter) as refused:
        StructuredRequest.from_params(wire)
    assert (refused.value.parameter, refused.value.reason) == (parameter, reason)
    assert parameter in str(refused.value)


def test_from_params_server_state_names_are_refused_at_freeze() -> None:
    for name, value in (("store", True), ("background", True), ("prompt", {"id": "p"}),
                        ("previous_response_id", "resp_1"), ("conversation", {"id": "c"})):
        request = StructuredRequest.from_params({"model": "m", name: value})
        with pytest.raises(InvalidParameter, match=name) as refused:
            freeze_body(request, _contract())
        assert refused.value.reason == "refused"


def test_from_params_needs_a_mapping() -> None:
    with pytest.raises(InvalidRequest, match="JSON object"):
        parameters_from_wire([("model", "m")])


def test_saved_request_round_trips_and_old_saved_requests_still_decode() -> None:
    request = StructuredRequest(model="m", input="x", **ALL_PARAMETERS)
    saved = msgspec.json.encode(
        StoredRequest(request=request, format_name="answer", schema=_SCHEMA)
    )
    again = msgspec.json.decode(saved, type=StoredRequest).request
    assert again == request
    assert freeze_body(again, _contract()) == ALL_EXPECTED
    old = b'{"version":1,"request":{"model":"m","input":"x"},"format_name":"answer","schema":{}}'
    assert msgspec.json.decode(old, type=StoredRequest).request == StructuredRequest(
        model="m", input="x"
    )


_CHILD = """
import sys
from recoverable.body import body_hash, freeze_body
from recoverable.contract import contract_for
from recoverable.types import JsonSchema, StructuredRequest
import tests.test_parameters as t
body = freeze_body(StructuredRequest(model="m", input="x", **t.ALL_PARAMETERS), t._contract())
sys.stdout.write(body_hash(body))
"""


def test_body_is_identical_across_processes() -> None:
    """Same bytes in every process: different hash seeds, fresh interpreters."""
    here = body_hash(_freeze(**ALL_PARAMETERS))
    root = str(Path(__file__).resolve().parent.parent)
    seen = set()
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _CHILD], cwd=root, env=env, capture_output=True,
            text=True, check=True, timeout=120,  # generous: a loaded 2-core machine
        )
        seen.add(out.stdout)
    assert seen == {here}


# -- batch job lines --------------------------------------------------------------------


def _job(**extra: Any) -> str:
    line = {"id": "j1", "revision": "r1", "model": "m", "input": "x", "schema": _SCHEMA,
            "schema_name": "answer", **extra}
    return msgspec.json.encode(line).decode()


def test_job_line_parameters_are_frozen_like_the_api() -> None:
    wire = {k: v for k, v in ALL_PARAMETERS.items()
            if k not in ("verbosity", "reasoning_effort", "reasoning_summary",
                         "max_output_tokens")}
    wire["text"] = {"verbosity": "low"}
    wire["reasoning"] = {"summary": "concise"}
    job = parse_job_line(
        _job(parameters=wire, reasoning_effort="low", max_output_tokens=2048), 3
    )
    assert job.request.service_tier == "flex"
    assert job.body_hash == body_hash(ALL_EXPECTED)
    # Without parameters, the body hash is what it always was.
    assert parse_job_line(_job(), 3).body_hash == body_hash(_BASE)


@pytest.mark.parametrize(
    ("parameters", "fragment"),
    [
        ({"temperature": 3}, "temperature must be a number from 0 to 2"),
        ({"temprature": 1}, "unknown request parameter 'temprature'"),
        ({"store": True}, "store is not allowed"),
        ({"model": "other"}, "top-level field"),
        ({"reasoning": {"effort": "low"}}, "top-level field"),
        ({"text": {"format": {"type": "text"}}}, "text.format"),
        ([1, 2], "invalid job"),
    ],
)
def test_job_line_bad_parameters_are_reported_on_their_line(
    parameters: Any, fragment: str
) -> None:
    with pytest.raises(JobLineError, match="line 5") as bad:
        parse_job_line(_job(parameters=parameters), 5)
    assert fragment in bad.value.reason


# -- integration: the fixture provider receives them --------------------------------------


class Answer(msgspec.Struct, frozen=True):
    text: str


@pytest.fixture
async def provider() -> AsyncIterator[FixtureProvider]:
    async with FixtureProvider.serve() as p:
        yield p


@pytest.mark.parametrize("mode", ["sse", "websocket"])
async def test_fixture_receives_every_parameter_in_the_post_body(
    provider: FixtureProvider, tmp_path: Path, mode: str
) -> None:
    account = recoverable.AccountBinding("acct-1")
    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    backend = recoverable.ResponsesBackend(
        provider.http_url, mode=mode,  # type: ignore[arg-type]
        credentials=recoverable.StaticCredentials("sk-test", account=account),
    )
    provider.script([Reply.complete({"text": "hi"})])
    request = StructuredRequest(model="gpt-test", input="x", **ALL_PARAMETERS)

    async def authorize(attempt: recoverable.Attempt) -> bool:
        return True

    try:
        async with recoverable.open_runtime(store, backend, account=account) as rt:
            handle = await rt.prepare(request, response=Answer, maximum_attempts=1)
            value = await rt.send_recovering(handle, response=Answer, authorize=authorize)
            assert value == Answer("hi")
    finally:
        store.close()
    [received] = provider.requests
    sent = msgspec.json.decode(received.body)
    assert sent["service_tier"] == "flex"
    assert received.body == freeze_body(request, contract_for(Answer))
    for name in ("temperature", "top_p", "top_logprobs", "max_output_tokens", "metadata",
                 "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
                 "safety_identifier", "user", "truncation", "include", "moderation"):
        assert name in sent, name
    assert sent["text"]["verbosity"] == "low"
    assert sent["reasoning"] == {"effort": "low", "summary": "concise"}
    assert sent["store"] is False and sent["tools"] == []


def test_batch_job_parameters_reach_the_post_body(tmp_path: Path) -> None:
    """`recoverable batch` against a separate fixture-provider process: the job line's
    `parameters` (service_tier flex, ...) are in the body the provider logged."""
    import json

    import httpx

    from .cli.cli_helpers import TIMEOUT, child_env, cli_command, read_results, write_jobs

    provider = subprocess.Popen(
        cli_command("fixture-provider"), stdout=subprocess.PIPE, text=True, env=child_env()
    )
    try:
        assert provider.stdout is not None
        urls = json.loads(provider.stdout.readline())
        jobs = write_jobs(tmp_path / "jobs.jsonl", [
            {"id": f"j{i}", "revision": "r1", "model": "gpt-test", "input": f"text {i}",
             "schema": _SCHEMA, "schema_name": "answer",
             "parameters": {"service_tier": "flex", "temperature": 0.5,
                            "text": {"verbosity": "low"}, "metadata": {"job": f"j{i}"}}}
            for i in range(2)
        ])
        out = tmp_path / "results.jsonl"
        done = subprocess.run(
            cli_command("batch", str(jobs), "--out", str(out), "--store", str(tmp_path / "s"),
                        "--endpoint", urls["http_url"], "--mode", "sse"),
            capture_output=True, text=True, timeout=TIMEOUT,
            env={**child_env(), "OPENAI_API_KEY": "sk-test-params"},
        )
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert {r["id"] for r in read_results(out)} == {"j0", "j1"}
        logged = httpx.get(urls["requests_url"], timeout=TIMEOUT).json()
    finally:
        provider.terminate()
        provider.wait(timeout=TIMEOUT)
    bodies = sorted((json.loads(r["body"]) for r in logged), key=lambda b: b["input"])
    assert len(bodies) == 2
    for i, body in enumerate(bodies):
        assert body["service_tier"] == "flex"
        assert body["temperature"] == 0.5
        assert body["text"]["verbosity"] == "low"
        assert body["metadata"] == {"job": f"j{i}"}
        assert body["store"] is False


async def test_prepare_refuses_a_bad_parameter_and_saves_nothing(
    provider: FixtureProvider, tmp_path: Path
) -> None:
    account = recoverable.AccountBinding("acct-1")
    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    backend = recoverable.ResponsesBackend(
        provider.http_url, credentials=recoverable.StaticCredentials("sk-test", account=account)
    )
    try:
        async with recoverable.open_runtime(store, backend, account=account) as rt:
            for bad in ({"temperature": 3.0}, {"store": True}, {"service_tier": "cheap"}):
                with pytest.raises(recoverable.InvalidParameter) as refused:
                    await rt.prepare(StructuredRequest(model="m", input="x", **bad),
                                     response=Answer, maximum_attempts=1)
                assert refused.value.parameter == next(iter(bad))
            assert (await rt.inventory()).operations == ()
    finally:
        store.close()
    assert provider.requests == []


# -- fuzz: any value for any parameter gives a body or a typed error ------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_FUZZ = settings(
    max_examples=int(os.environ.get("RECOVERABLE_FUZZ_EXAMPLES", "200")), deadline=None,
    derandomize=True, suppress_health_check=[HealthCheck.too_slow],
)
_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
    | st.text(max_size=70)
    | st.sampled_from(["auto", "flex", "low", "24h", "score", "mode", "pro", "all_turns"])
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(["mode", "ttl", "model", "policy", "input", "output",
                                       "verbosity", "effort", "summary", "format", "context", "k"])
                      | st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)
_wire_names = st.sampled_from([
    "temperature", "top_p", "top_logprobs", "max_output_tokens", "service_tier", "metadata",
    "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "safety_identifier",
    "user", "truncation", "include", "moderation", "text", "reasoning", "store", "background",
    "prompt", "tools", "tool_choice", "parallel_tool_calls", "stream", "bogus",
]) | st.text(max_size=10)


@_FUZZ
@given(params=st.dictionaries(_wire_names, _values, max_size=6))
def test_any_wire_parameters_give_a_canonical_body_or_a_typed_error(
    params: dict[str, Any],
) -> None:
    try:
        request = StructuredRequest.from_params({"model": "m", "input": "x", **params})
        body = freeze_body(request, _contract())
    except InvalidRequest as exc:
        assert str(exc)
        return
    assert msgspec.json.encode(msgspec.json.decode(body), order="sorted") == body
    # A saved request re-freezes to the same bytes (what reselection does after a restart).
    saved = msgspec.json.encode(StoredRequest(request=request, format_name="a", schema={}))
    again = msgspec.json.decode(saved, type=StoredRequest).request
    assert freeze_body(again, _contract()) == body


@_FUZZ
@given(parameters=_values | st.dictionaries(_wire_names, _values, max_size=6))
def test_any_job_line_parameters_give_a_job_or_a_job_line_error(parameters: Any) -> None:
    line = _job(parameters=parameters)
    try:
        parse_job_line(line, 2)
    except JobLineError as exc:
        assert exc.lineno == 2 and exc.reason
