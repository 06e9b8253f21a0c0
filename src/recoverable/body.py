"""The frozen canonical request body: built once at preparation, replayed byte for byte.

The body is tool-free (``tools: []``, ``tool_choice: "none"``,
``parallel_tool_calls: false``), unstored (``store: false``) and carries the
contract's strict ``json_schema`` format. It never contains ``stream`` (the
transport adds what its mode needs) nor credentials. Encoding is canonical
(``msgspec.json.encode(..., order="sorted")``), so the same request and
contract always give identical bytes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from recoverable.contract import ResponseContract
from recoverable.errors import InvalidRequest, UnsupportedInputItem
from recoverable.types import StructuredRequest

__all__ = [
    "MAX_INPUT_BYTES",
    "MAX_MODEL_CHARS",
    "REASONING_EFFORTS",
    "body_hash",
    "freeze_body",
]

MAX_INPUT_BYTES = 32 * 1024 * 1024  # instructions + input, canonical JSON
MAX_MODEL_CHARS = 256
REASONING_EFFORTS = frozenset({"minimal", "low", "medium", "high", "xhigh", "none"})


def body_hash(body: bytes) -> str:
    """The sha256 hex digest of a frozen body."""
    return hashlib.sha256(body).hexdigest()


def freeze_body(request: StructuredRequest, contract: ResponseContract) -> bytes:
    """Validate ``request`` and return its canonical tool-free Responses body.

    Raises ``InvalidRequest`` (with the reason) for tools, tool choices,
    persistent threads, a bad model, input or reasoning effort, or oversize input;
    ``UnsupportedInputItem`` (naming the item) for an input item that is not a message.
    """
    if not isinstance(request, StructuredRequest):
        raise InvalidRequest(
            f"request must be a recoverable.StructuredRequest, not {type(request).__name__}"
        )
    if not isinstance(contract, ResponseContract):
        raise InvalidRequest("contract must be a ResponseContract (see contract_for)")
    _check_tool_free(request)

    model = request.model
    if not isinstance(model, str) or not model.strip():
        raise InvalidRequest("model must be a non-empty string")
    if len(model) > MAX_MODEL_CHARS:
        raise InvalidRequest(f"model is longer than {MAX_MODEL_CHARS} characters")

    effort = request.reasoning_effort
    if effort is not None and effort not in REASONING_EFFORTS:
        raise InvalidRequest(
            "reasoning_effort must be one of "
            f"{', '.join(sorted(REASONING_EFFORTS))} or None, not {str(effort)[:32]!r}"
        )

    max_output_tokens = request.max_output_tokens
    if max_output_tokens is not None and (
        isinstance(max_output_tokens, bool)
        or not isinstance(max_output_tokens, int)
        or max_output_tokens < 1
    ):
        raise InvalidRequest("max_output_tokens must be a positive integer or None")

    instructions = request.instructions
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("instructions must be a string or None")

    input_json = _encode_input(request.input)
    size = len(input_json)
    if instructions is not None:
        size += len(_canonical(instructions))
    if size > MAX_INPUT_BYTES:
        raise InvalidRequest(
            f"instructions and input are {size} bytes of canonical JSON; "
            f"the limit is {MAX_INPUT_BYTES}"
        )

    body: dict[str, Any] = {
        "model": model,
        # Already canonical: embedded verbatim so large input is encoded once.
        "input": msgspec.Raw(input_json),
        "store": False,
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": False,
        "text": {"format": contract.text_format()},
    }
    if instructions is not None:
        body["instructions"] = instructions
    if effort is not None:
        body["reasoning"] = {"effort": effort}
    if max_output_tokens is not None:
        body["max_output_tokens"] = max_output_tokens
    return _canonical(body)


def _check_tool_free(request: StructuredRequest) -> None:
    if request.tools:
        raise InvalidRequest(
            "recoverable requests are tool-free: tools must be empty (tools are never executed)"
        )
    if request.tool_choice not in (None, "none"):
        raise InvalidRequest('tool_choice must be None or "none": recovery never runs tools')
    if request.previous_response_id is not None:
        raise InvalidRequest(
            "previous_response_id is not allowed: recovery does not continue persistent threads"
        )
    if request.conversation is not None:
        raise InvalidRequest(
            "conversation is not allowed: recovery does not continue persistent threads"
        )


def _encode_input(value: Any) -> bytes:
    if isinstance(value, str):
        return _canonical(value)
    if not isinstance(value, list):
        raise InvalidRequest(
            f"input must be a string or a list of input items (dicts), not {type(value).__name__}"
        )
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input item {index} must be a dict, not {type(item).__name__}")
    try:
        encoded = _canonical(value)
    except (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError) as exc:
        message = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise InvalidRequest(f"input is not JSON-encodable: {message}") from None
    for index, item in enumerate(value):
        _check_input_item(index, item)
    return encoded


# Items that continue a stored response or thread rather than stating the request.
_THREAD_ITEMS = frozenset({"item_reference", "reasoning", "compaction", "compaction_trigger"})


def _check_input_item(index: int, item: dict[str, Any]) -> None:
    """Only messages are accepted (``type: "message"``, or no type and a ``role``).

    Every other Responses input item replays tool history (``function_call``,
    ``function_call_output``, ``computer_call``, ``shell_call_output``, ``mcp_call``,
    any item with a ``call_id``...), continues a stored response (``item_reference``,
    ``reasoning``, ``compaction``) or configures tools. A recoverable request is
    self-contained and tool-free, so each is refused here, before anything is saved.
    """
    kind = item.get("type")
    shown = kind[:64] if isinstance(kind, str) else None
    if "call_id" in item or (
        isinstance(kind, str) and (kind.endswith("_call") or kind.endswith("_output"))
    ):
        raise UnsupportedInputItem(
            f"input item {index} ({shown or 'with a call_id'}) replays tool history: "
            "recovery sends tool-free requests only",
            item_index=index, item_type=shown,
        )
    if kind in _THREAD_ITEMS:
        raise UnsupportedInputItem(
            f"input item {index} ({shown}) continues a stored response or thread: "
            "recovery sends self-contained requests only",
            item_index=index, item_type=shown,
        )
    if kind not in (None, "message"):
        raise UnsupportedInputItem(
            f"input item {index} has type {shown or type(kind).__name__!r}: "
            "only message items are accepted",
            item_index=index, item_type=shown,
        )
    if kind is None and "role" not in item:
        raise UnsupportedInputItem(
            f"input item {index} is not a message (it has neither a type nor a role)",
            item_index=index, item_type=None,
        )


def _canonical(value: Any) -> bytes:
    return msgspec.json.encode(value, order="sorted")
