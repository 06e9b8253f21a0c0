"""``--output-format openai-batch`` lines that code written for OpenAI's batch files
reads unchanged: every result body validates as the official SDK's Responses object, and
failed requests are OpenAI's failed request lines (the provider's HTTP rejection as the
response with its status code, anything else as ``error``), through ``recoverable batch``
as a real process against the embedded fixture provider."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from openai.types.responses import Response
from openai.types.shared import ErrorObject

from .cli_helpers import SMALL_SCHEMA, run_cli, write_jobs
from .test_batch_interop import batch_line

LINE_KEYS = {"id", "custom_id", "response", "error", "recoverable"}


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(text) for text in path.read_text().splitlines()]


def _assert_batch_output_line(line: dict[str, Any]) -> None:
    """The documented Batch API output line (the SDK has no type for it): id, custom_id,
    response {status_code, request_id, body} or null, error {code, message} or null,
    exactly one of the two set; plus this tool's ``recoverable`` data."""
    assert set(line) == LINE_KEYS, line
    assert isinstance(line["id"], str) and line["id"].startswith("batch_req_")
    assert isinstance(line["custom_id"], str)
    response, error = line["response"], line["error"]
    assert (response is None) != (error is None), line
    if response is not None:
        assert set(response) == {"status_code", "request_id", "body"}
        assert isinstance(response["status_code"], int)
        assert isinstance(response["request_id"], str) and response["request_id"]
        assert isinstance(response["body"], dict)
    else:
        assert set(error) == {"code", "message"}
        assert isinstance(error["code"], str) and isinstance(error["message"], str)


def test_every_result_body_validates_as_the_sdks_responses_object(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "batch.jsonl", [
        batch_line(0),
        batch_line(1, max_output_tokens=200, top_p=0.5),
        batch_line(2, reasoning={"effort": "low"}, truncation="auto"),
        batch_line(3, text={"format": {"type": "json_schema", "name": "label",
                                       "schema": SMALL_SCHEMA, "strict": True},
                            "verbosity": "low"}),
    ])
    out = tmp_path / "out.jsonl"
    # Disconnects replace attempts: the line is the completing attempt's.
    proc = run_cli("batch", str(jobs), "--out", str(out), "--output-format", "openai-batch",
                   "--faults", "disconnect=0.4,seed=3", "--backoff", "0.01")
    assert proc.returncode == 0, proc.stderr
    lines = _lines(out)
    assert sorted(line["custom_id"] for line in lines) == [f"req-{i}" for i in range(4)]
    for line in lines:
        _assert_batch_output_line(line)
        operation_id = line["recoverable"]["operation_id"]
        response = line["response"]
        assert response["status_code"] == 200 and line["error"] is None
        # The attempt whose answer it is (op_….N): the provider's request id is not kept.
        assert response["request_id"].startswith(operation_id + ".")
        body = Response.model_validate(response["body"])
        assert body.object == "response" and body.status == "completed"
        assert body.id.startswith("resp_") and body.model == "gpt-test"
        assert body.completed_at is not None and body.created_at <= body.completed_at
        value = json.loads(body.output_text)
        assert value["label"] in ("a", "b") and 0 <= value["score"] <= 10
        [message] = body.output
        assert message.type == "message" and message.role == "assistant"
        assert message.id == f"msg_{operation_id}" and message.status == "completed"
        assert [part.type for part in message.content] == ["output_text"]
        # What the frozen body sent: tool-free, the strict json_schema format.
        assert body.tools == [] and body.tool_choice == "none"
        assert body.parallel_tool_calls is False
        assert body.text is not None and body.text.format is not None
        text_format = body.text.format.model_dump()
        assert text_format["type"] == "json_schema" and text_format["name"] == "label"
        assert text_format["strict"] is True
        assert body.temperature == 0.2
        assert body.usage is not None
        assert body.usage.total_tokens == body.usage.input_tokens + body.usage.output_tokens
        # The job's output, none of its input.
        raw = json.dumps(line)
        assert "Label the text." not in raw and "text number" not in raw
        assert body.instructions is None
    by_id = {line["custom_id"]: Response.model_validate(line["response"]["body"])
             for line in lines}
    assert by_id["req-0"].max_output_tokens is None and by_id["req-0"].reasoning is None
    assert by_id["req-1"].max_output_tokens == 200 and by_id["req-1"].top_p == 0.5
    reasoning = by_id["req-2"].reasoning
    assert reasoning is not None and reasoning.effort == "low"
    assert by_id["req-2"].truncation == "auto"
    text_config = by_id["req-3"].text
    assert text_config is not None and text_config.verbosity == "low"


def _failed_run(tmp_path: Path, name: str, faults: str) -> tuple[Path, Path, Path]:
    jobs = write_jobs(tmp_path / f"{name}.jsonl", [batch_line(0), batch_line(1)])
    out = tmp_path / f"{name}.out.jsonl"
    errors_file = tmp_path / f"{name}.errors.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out), "--output-format", "openai-batch",
                   "--errors", str(errors_file), "--faults", faults, "--max-attempts", "1",
                   "--backoff", "0.01")
    assert proc.returncode == 1, proc.stderr
    assert out.read_text() == ""
    return jobs, out, errors_file


def test_failed_requests_are_openai_batch_failure_lines(tmp_path: Path) -> None:
    # The provider rejects every request with HTTP 403: a permanent provider_error.
    jobs, out, errors_file = _failed_run(tmp_path, "forbidden", "forbidden=1.0")
    lines = _lines(errors_file)
    assert sorted(line["custom_id"] for line in lines) == ["req-0", "req-1"]
    for line in lines:
        _assert_batch_output_line(line)
        assert line["error"] is None
        response = line["response"]
        assert response["status_code"] == 403
        assert response["request_id"] == line["recoverable"]["operation_id"] + ".1"
        assert set(response["body"]) == {"error"}
        error = ErrorObject.model_validate(response["body"]["error"])
        assert error.type == "invalid_request_error"
        assert error.code == "unsupported_country_region_territory"
        assert "HTTP 403" in error.message and error.param is None
        assert line["recoverable"]["reason"] == "provider_error:http_rejected"
    # A rerun reads the saved failure back (nothing sent): the same lines.
    rerun = run_cli("batch", str(jobs), "--out", str(out), "--output-format", "openai-batch",
                    "--errors", str(errors_file))
    assert rerun.returncode == 1, rerun.stderr
    again = {line["custom_id"]: line for line in _lines(errors_file)}
    for line in lines:
        assert again[line["custom_id"]]["response"] == line["response"]
        assert again[line["custom_id"]]["error"] is None

    # HTTP 500 on the one attempt allowed: the budget is spent, and the provider's last
    # answer is the response, as OpenAI's file shows a request that ended in a 500.
    _, _, errors_file = _failed_run(tmp_path, "server", "http_error=1.0")
    for line in _lines(errors_file):
        _assert_batch_output_line(line)
        assert line["response"]["status_code"] == 500 and line["error"] is None
        error = ErrorObject.model_validate(line["response"]["body"]["error"])
        assert error.type == "server_error" and error.code == "server_error"
        assert line["recoverable"]["reason"] == "attempts_exhausted:http_rejected"


def test_a_failure_without_an_http_answer_is_an_error_line_with_a_stable_code(
    tmp_path: Path,
) -> None:
    # Every attempt's connection drops: no HTTP answer at all.
    _, _, errors_file = _failed_run(tmp_path, "dropped", "disconnect=1.0")
    lines = _lines(errors_file)
    assert len(lines) == 2
    for line in lines:
        _assert_batch_output_line(line)
        assert line["response"] is None
        assert line["error"]["code"] == "attempts_exhausted"
        assert "attempt budget is spent" in line["error"]["message"]
    # An answer that is not a usable result (schema violation) has no response either:
    # OpenAI's file would show a 200 for it, but the batch never delivers it. Its code is
    # the failure's, on this run (ProviderError) and on a rerun that reads the saved
    # failure back (PermanentlyFailed): the same line.
    jobs, out, errors_file = _failed_run(tmp_path, "invalid", "schema_violation=1.0")
    lines = _lines(errors_file)
    for line in lines:
        _assert_batch_output_line(line)
        assert line["response"] is None and line["error"]["code"] == "provider_error"
    rerun = run_cli("batch", str(jobs), "--out", str(out), "--output-format", "openai-batch",
                    "--errors", str(errors_file))
    assert rerun.returncode == 1, rerun.stderr
    for line in _lines(errors_file):
        _assert_batch_output_line(line)
        assert line["response"] is None and line["error"]["code"] == "provider_error"
        assert line["recoverable"]["reason"] == "provider_error:invalid_output:schema_violation"
