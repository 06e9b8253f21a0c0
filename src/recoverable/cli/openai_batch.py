"""What ``--output-format openai-batch`` writes: the OpenAI Batch API's output line shapes.

Code written for OpenAI's batch output and error files must read ours unchanged: a
result line's ``response.body`` is a complete Responses API object (it passes the
official SDK's ``Response.model_validate``), a failure reads as OpenAI's failed request
lines do (``response.status_code`` and a body ``{"error": ...}`` for a request the
provider rejected with an HTTP error, else ``response`` null and ``error`` set).

Every value is one the batch really has, or a fixed value where the Responses object
requires a field we never saw (documented in docs/cli.md): the echoed request
parameters are those of the frozen body (``recoverable.body``: tool-free, so ``tools``
is always ``[]``, ``tool_choice`` ``"none"``, ``parallel_tool_calls`` false). Nothing
of the job's input is copied (no ``instructions`` or ``input``, no ``metadata``,
``user`` or ``safety_identifier``), and no credentials: a line carries the job's output.
"""

from __future__ import annotations

from typing import Any

import attrs

from recoverable import errors
from recoverable.cli.jobs import Job
from recoverable.contract import contract_for
from recoverable.records import OperationRecord
from recoverable.types import Receipt

__all__ = [
    "HttpFailure",
    "error_line_fields",
    "http_failure",
    "response_body",
    "success_response",
]

# The request parameters a Responses object echoes that a recoverable body may carry:
# validated by ``recoverable.body`` against the SDK's own value sets, so echoed as they
# were sent (and the object still validates).
_ECHOED = ("max_output_tokens", "temperature", "top_p", "top_logprobs", "truncation")


@attrs.frozen
class HttpFailure:
    """A job's failure decided by the provider's HTTP rejection: its status, the error's
    bounded ``type`` and ``code`` (never the provider's message text, which is not kept),
    and the attempt that got it."""

    status_code: int
    error_type: str | None
    error_code: str | None
    request_id: str | None


def _completing_attempt_id(record: OperationRecord | None) -> str | None:
    if record is None:
        return None
    completed = [attempt for attempt in record.attempts if attempt.outcome == "completed"]
    return completed[-1].attempt_id if completed else None


def _usage(record: OperationRecord | None) -> dict[str, Any] | None:
    """The completing attempt's tokens in the Responses ``usage`` shape (None: not
    reported). ``cache_write_tokens`` is required by the object but never reported to
    us, so it is 0."""
    if record is None:
        return None
    completed = [attempt for attempt in record.attempts if attempt.outcome == "completed"]
    if not completed or completed[-1].usage is None:
        return None
    tokens = completed[-1].usage
    return {
        "input_tokens": tokens.input_tokens,
        "input_tokens_details": {"cached_tokens": tokens.cached_input_tokens,
                                 "cache_write_tokens": 0},
        "output_tokens": tokens.output_tokens,
        "output_tokens_details": {"reasoning_tokens": tokens.reasoning_tokens},
        "total_tokens": tokens.total_tokens,
    }


def _created_at(receipt: Receipt, record: OperationRecord | None) -> int:
    """When the completing attempt began (its POST), else when the receipt was saved: the
    provider's own ``created_at`` is not kept. Never after ``completed_at``."""
    completed_at = int(receipt.completed_at.timestamp())
    if record is not None:
        completed = [attempt for attempt in record.attempts if attempt.outcome == "completed"]
        if completed:
            return min(int(completed[-1].consumed_at), completed_at)
    return completed_at


def response_body(
    job: Job, operation_id: str, receipt: Receipt, record: OperationRecord | None
) -> dict[str, Any]:
    """The Responses API object of a committed job's validated result."""
    text = receipt.payload.decode("utf-8")
    request = job.request
    text_config: dict[str, Any] = {"format": contract_for(job.response).text_format()}
    if request.verbosity is not None:
        text_config["verbosity"] = request.verbosity
    reasoning: dict[str, Any] | None = None
    if request.reasoning_effort is not None or request.reasoning_summary is not None:
        reasoning = {"effort": request.reasoning_effort, "summary": request.reasoning_summary}
    body: dict[str, Any] = {
        # The provider's response id when it was saved; a custom backend may give none,
        # and the object needs one: derived from the operation, so a rerun writes the same.
        "id": receipt.response_id or f"resp_{operation_id}",
        "object": "response",
        "created_at": _created_at(receipt, record),
        "status": "completed",
        "completed_at": int(receipt.completed_at.timestamp()),
        "error": None,
        "incomplete_details": None,
        "instructions": None,  # not copied: the jobs file has it
        "model": request.model,
        "output": [{
            "type": "message",
            # The provider's message item id is not kept: one message per operation.
            "id": f"msg_{operation_id}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }],
        # The frozen body is tool-free: this is what it sent.
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "text": text_config,
        "reasoning": reasoning,
        "usage": _usage(record),
        # Not part of the wire object (the SDKs compute it): kept for readers of the
        # earlier lines, which had it.
        "output_text": text,
    }
    for name in _ECHOED:
        body[name] = getattr(request, name)
    return body


def success_response(
    job: Job, operation_id: str, receipt: Receipt, record: OperationRecord | None
) -> dict[str, Any]:
    """The ``response`` of a result line: status 200, the attempt that produced it as
    ``request_id`` (the provider's x-request-id is not kept), and the Responses object."""
    return {
        "status_code": 200,
        "request_id": _completing_attempt_id(record),
        "body": response_body(job, operation_id, receipt, record),
    }


def http_failure(
    error: errors.RecoveryError, record: OperationRecord | None
) -> HttpFailure | None:
    """The provider's HTTP rejection that ended the job, if one did: the failure the
    typed error carries (``ProviderError.interruption``, or the ``last_failure`` of an
    operation whose budget is spent or which failed permanently) is an ``http_rejected``
    with a status. Anything else (no answer, or an answer that was not a usable result)
    is None."""
    last = getattr(error, "last_failure", None) or getattr(error, "interruption", None)
    if last is None or last.kind != "http_rejected" or last.http_status is None:
        return None
    request_id = None
    if record is not None:
        failed = [attempt for attempt in record.attempts if attempt.failure is not None]
        request_id = failed[-1].attempt_id if failed else None
    return HttpFailure(last.http_status, last.provider_type, last.provider_code, request_id)


def error_line_fields(
    code: str, message: str, failure: HttpFailure | None
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(response, error)`` of an errors-file line: the provider's HTTP rejection as
    its response (status code, body ``{"error": {message, type, param, code}}``, the
    shape of the SDK's ``ErrorObject``) with ``error`` null; any other failure as
    ``error`` ``{code, message}`` (``code`` a typed error's stable code) with
    ``response`` null."""
    if failure is None:
        return None, {"code": code, "message": message}
    # OpenAI's error object always has a type: when the provider sent none, the type
    # OpenAI gives such a status (so the SDK's ErrorObject still validates).
    error_type = failure.error_type or (
        "server_error" if failure.status_code >= 500 else "invalid_request_error"
    )
    body = {"error": {"message": message, "type": error_type, "param": None,
                      "code": failure.error_code}}
    return {"status_code": failure.status_code, "request_id": failure.request_id,
            "body": body}, None
