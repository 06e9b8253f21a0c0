"""The frozen canonical request body: built once at preparation, replayed byte for byte.

The body is tool-free (``tools: []``, ``tool_choice: "none"``,
``parallel_tool_calls: false``), unstored (``store: false``) and carries the
contract's strict ``json_schema`` format. It never contains ``stream`` (the
transport adds what its mode needs) nor credentials. Encoding is canonical
(``msgspec.json.encode(..., order="sorted")``), so the same request and
contract always give identical bytes.

The optional Responses parameters (``temperature``, ``service_tier``, ``metadata``...)
are validated here and added only when set: a request that sets none of
them freezes to exactly the bytes it did before they existed. Numbers are normalized
(``temperature=1`` and ``1.0`` freeze alike), ``include`` is sorted and de-duplicated.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgspec

from recoverable.contract import ResponseContract
from recoverable.errors import InvalidParameter, InvalidRequest, UnsupportedInputItem
from recoverable.types import StructuredRequest
from recoverable.wire_parameters import parameters_from_wire, refuse, shown

__all__ = [
    "INCLUDABLES",
    "MAX_IDENTIFIER_CHARS",
    "MAX_INPUT_BYTES",
    "MAX_METADATA_KEY_CHARS",
    "MAX_METADATA_PAIRS",
    "MAX_METADATA_VALUE_CHARS",
    "MAX_MODEL_CHARS",
    "MAX_OUTPUT_TOKENS",
    "MAX_TOP_LOGPROBS",
    "MESSAGE_ROLES",
    "PROMPT_CACHE_RETENTIONS",
    "REASONING_CONTEXTS",
    "REASONING_EFFORTS",
    "REASONING_MODES",
    "REASONING_SUMMARIES",
    "SERVICE_TIERS",
    "TRUNCATIONS",
    "VERBOSITIES",
    "body_hash",
    "freeze_body",
    "parameters_from_wire",
]

MAX_INPUT_BYTES = 32 * 1024 * 1024  # instructions + input, canonical JSON
MAX_MODEL_CHARS = 256
# Value sets as in the official openai SDK's ResponseCreateParams (checked 2026-11).
REASONING_EFFORTS = frozenset({"minimal", "low", "medium", "high", "xhigh", "max", "none"})
REASONING_SUMMARIES = frozenset({"auto", "concise", "detailed"})
REASONING_MODES = frozenset({"standard", "pro"})
REASONING_CONTEXTS = frozenset({"auto", "current_turn", "all_turns"})
SERVICE_TIERS = frozenset({"auto", "default", "flex", "scale", "priority", "fast", "ultrafast"})
TRUNCATIONS = frozenset({"auto", "disabled"})
VERBOSITIES = frozenset({"low", "medium", "high"})
PROMPT_CACHE_RETENTIONS = frozenset({"in_memory", "24h"})
PROMPT_CACHE_MODES = frozenset({"implicit", "explicit"})
PROMPT_CACHE_TTLS = frozenset({"30m"})
MODERATION_MODES = frozenset({"score", "block"})
# The roles of a Responses input message (EasyInputMessage / ResponseInputItem.Message;
# an assistant message replays an earlier answer).
MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
# ``include`` values that need no tool; the others name tool outputs and are refused.
INCLUDABLES = frozenset(
    {"message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content"}
)
TOOL_INCLUDABLES = frozenset({
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
})
MAX_OUTPUT_TOKENS = 2**24  # far above any model's output limit; bounds the token estimates
MAX_TOP_LOGPROBS = 20
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_IDENTIFIER_CHARS = 64  # prompt_cache_key, safety_identifier, user (the provider's limit)


def body_hash(body: bytes) -> str:
    """The sha256 hex digest of a frozen body."""
    return hashlib.sha256(body).hexdigest()


def freeze_body(
    request: StructuredRequest, contract: ResponseContract, *, reattach: bool = False
) -> bytes:
    """Validate ``request`` and return its canonical tool-free Responses body.

    With ``reattach=True`` (reattachment, ``prepare(..., reattach=True)``) the body is frozen
    with ``"background": true, "store": true``: the provider keeps the response (for a
    limited time) so an interrupted attempt can be resumed by id instead of generated
    again (docs/reattach.md). The request's own ``store``/``background`` stay refused:
    this flag is the one way to set them. Still tool-free and strict.

    Raises ``InvalidParameter`` (an ``InvalidRequest`` naming the parameter) for tools,
    tool choices, persistent threads, stored responses or prompts, a bad model, or an
    optional parameter out of its range; ``InvalidRequest`` for bad or oversize input;
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
        raise InvalidParameter("model must be a non-empty string", parameter="model")
    if len(model) > MAX_MODEL_CHARS:
        raise InvalidParameter(
            f"model is longer than {MAX_MODEL_CHARS} characters", parameter="model"
        )

    effort = _choice(request.reasoning_effort, "reasoning_effort", REASONING_EFFORTS)

    instructions = request.instructions
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidParameter("instructions must be a string or None", parameter="instructions")

    optional = _optional_parameters(request)

    input_json = _encode_input(request.input)
    size = len(input_json)
    if instructions is not None:
        size += len(_canonical(instructions))
    if size > MAX_INPUT_BYTES:
        raise InvalidRequest(
            f"instructions and input are {size} bytes of canonical JSON; "
            f"the limit is {MAX_INPUT_BYTES}"
        )

    text: dict[str, Any] = {"format": contract.text_format()}
    body: dict[str, Any] = {
        "model": model,
        # Already canonical: embedded verbatim so large input is encoded once.
        "input": msgspec.Raw(input_json),
        "store": reattach is True,
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": False,
        "text": text,
    }
    if reattach is True:
        body["background"] = True
    if instructions is not None:
        body["instructions"] = instructions
    reasoning: dict[str, Any] = {}
    if effort is not None:
        reasoning["effort"] = effort
    for name in ("summary", "mode", "context"):
        value = optional.pop(f"reasoning_{name}", None)
        if value is not None:
            reasoning[name] = value
    if reasoning:
        body["reasoning"] = reasoning
    verbosity = optional.pop("verbosity", None)
    if verbosity is not None:
        text["verbosity"] = verbosity
    body.update(optional)  # every other optional parameter under its own wire name
    return _canonical(body)


def _check_tool_free(request: StructuredRequest) -> None:
    # Identity and type checks, not truthiness: a look-alike (``tools=None``, ``store=0``)
    # would be saved with the request and then fail to decode on reselection.
    if not isinstance(request.tools, (list, tuple)):
        raise InvalidParameter("tools must be an empty list", parameter="tools")
    if not isinstance(request.model_override, bool):
        raise InvalidParameter("model_override must be True or False", parameter="model_override")
    if request.tools:
        raise InvalidParameter(
            "recoverable requests are tool-free: tools must be empty (tools are never executed)",
            parameter="tools", reason="refused",
        )
    if request.tool_choice not in (None, "none"):
        raise InvalidParameter(
            'tool_choice must be None or "none": recovery never runs tools',
            parameter="tool_choice", reason="refused",
        )
    if request.parallel_tool_calls is not None and request.parallel_tool_calls is not False:
        raise refuse("parallel_tool_calls", "recovery never runs tools (only None or False)")
    if request.previous_response_id is not None:
        raise refuse(
            "previous_response_id", "recovery does not continue persistent threads"
        )
    if request.conversation is not None:
        raise refuse("conversation", "recovery does not continue persistent threads")
    if request.store is not None and request.store is not False:
        raise refuse(
            "store",
            "recovery keeps no response on the provider; an interrupted attempt is "
            "replaced by a new request from the frozen body (only None or False)",
        )
    if request.background is not None and request.background is not False:
        raise refuse(
            "background", "recovery streams every attempt itself (only None or False)"
        )
    if request.prompt is not None:
        raise refuse(
            "prompt",
            "a stored prompt template lives on the provider and may change; put its text "
            "in instructions/input so the frozen body says everything",
        )


def _optional_parameters(request: StructuredRequest) -> dict[str, Any]:
    """The validated optional parameters that are set, by wire name (``verbosity`` and
    ``reasoning_*`` by field name: the caller nests them)."""
    found: dict[str, Any] = {
        "max_output_tokens": _integer(
            request.max_output_tokens, "max_output_tokens", 1, MAX_OUTPUT_TOKENS
        ),
        "temperature": _number(request.temperature, "temperature", 0.0, 2.0),
        "top_p": _number(request.top_p, "top_p", 0.0, 1.0),
        "top_logprobs": _integer(request.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS),
        "service_tier": _choice(request.service_tier, "service_tier", SERVICE_TIERS),
        "metadata": _metadata(request.metadata),
        "prompt_cache_key": _identifier(request.prompt_cache_key, "prompt_cache_key"),
        "prompt_cache_retention": _choice(
            request.prompt_cache_retention, "prompt_cache_retention", PROMPT_CACHE_RETENTIONS
        ),
        "prompt_cache_options": _prompt_cache_options(request.prompt_cache_options),
        "safety_identifier": _identifier(request.safety_identifier, "safety_identifier"),
        "user": _identifier(request.user, "user"),
        "truncation": _choice(request.truncation, "truncation", TRUNCATIONS),
        "include": _include(request.include),
        "moderation": _moderation(request.moderation),
        "verbosity": _choice(request.verbosity, "verbosity", VERBOSITIES, "text.verbosity"),
        "reasoning_summary": _choice(
            request.reasoning_summary, "reasoning_summary", REASONING_SUMMARIES,
            "reasoning.summary",
        ),
        "reasoning_mode": _choice(
            request.reasoning_mode, "reasoning_mode", REASONING_MODES, "reasoning.mode"
        ),
        "reasoning_context": _choice(
            request.reasoning_context, "reasoning_context", REASONING_CONTEXTS,
            "reasoning.context",
        ),
    }
    return {name: value for name, value in found.items() if value is not None}


def _label(name: str, wire: str | None) -> str:
    return f"{name} ({wire})" if wire else name


def _choice(
    value: Any, name: str, allowed: frozenset[str], wire: str | None = None
) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in allowed:
        raise InvalidParameter(
            f"{_label(name, wire)} must be one of {', '.join(sorted(allowed))} or None, "
            f"not {shown(value)}",
            parameter=name,
        )
    return value


def _number(value: Any, name: str, low: float, high: float) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not math.isfinite(value))
        or not low <= value <= high  # exact for any int, so no OverflowError below
    ):
        raise InvalidParameter(
            f"{name} must be a number from {low:g} to {high:g} or None, not {shown(value)}",
            parameter=name,
        )
    return float(value)  # 1 and 1.0 freeze to the same bytes


def _integer(value: Any, name: str, low: int, high: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidParameter(
            f"{name} must be an integer from {low} to {high} or None, not {shown(value)}",
            parameter=name,
        )
    return int(value)


def _identifier(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_IDENTIFIER_CHARS:
        raise InvalidParameter(
            f"{name} must be a string of 1 to {MAX_IDENTIFIER_CHARS} characters or None",
            parameter=name,
        )
    return value


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidParameter(
            "metadata must be a dict of strings to strings or None", parameter="metadata"
        )
    if len(value) > MAX_METADATA_PAIRS:
        raise InvalidParameter(
            f"metadata has {len(value)} pairs; at most {MAX_METADATA_PAIRS} are allowed",
            parameter="metadata",
        )
    for key, item in value.items():
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_METADATA_KEY_CHARS:
            raise InvalidParameter(
                f"metadata keys must be strings of 1 to {MAX_METADATA_KEY_CHARS} characters",
                parameter="metadata",
            )
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE_CHARS:
            raise InvalidParameter(
                f"metadata[{key!r}] must be a string of at most "
                f"{MAX_METADATA_VALUE_CHARS} characters",
                parameter="metadata",
            )
    return dict(value)


def _include(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise InvalidParameter("include must be a list of strings or None", parameter="include")
    for entry in value:
        if isinstance(entry, str) and entry in TOOL_INCLUDABLES:
            raise InvalidParameter(
                f"include {entry!r} names a tool's output: recovery never runs tools",
                parameter="include", reason="refused",
            )
        if not isinstance(entry, str) or entry not in INCLUDABLES:
            raise InvalidParameter(
                f"include entries must be among {', '.join(sorted(INCLUDABLES))}, "
                f"not {shown(entry)}",
                parameter="include",
            )
    return sorted(set(value))


def _prompt_cache_options(value: Any) -> dict[str, str] | None:
    name = "prompt_cache_options"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidParameter(f"{name} must be a dict or None", parameter=name)
    allowed = {"mode": PROMPT_CACHE_MODES, "ttl": PROMPT_CACHE_TTLS}
    for key, item in value.items():
        if key not in allowed:
            raise InvalidParameter(
                f"{name} has an unknown key {shown(key)} (known: mode, ttl)",
                parameter=name, reason="unknown",
            )
        _choice(item, f"{name}.{key}", allowed[key])
    return {key: item for key, item in value.items() if item is not None}


def _moderation(value: Any) -> dict[str, Any] | None:
    name = "moderation"
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"model", "policy"}:
        raise InvalidParameter(
            f"{name} must be a dict with model and optional policy or None", parameter=name
        )
    model = value.get("model")
    if not isinstance(model, str) or not 1 <= len(model) <= MAX_MODEL_CHARS:
        raise InvalidParameter(
            f"{name}.model must be a string of 1 to {MAX_MODEL_CHARS} characters",
            parameter=name,
        )
    frozen: dict[str, Any] = {"model": model}
    policy = value.get("policy")
    if policy is not None:
        if not isinstance(policy, dict) or set(policy) - {"input", "output"}:
            raise InvalidParameter(
                f"{name}.policy must be a dict with optional input and output", parameter=name
            )
        frozen_policy: dict[str, Any] = {}
        for side, rule in policy.items():
            if rule is None:
                continue
            if not isinstance(rule, dict) or set(rule) != {"mode"}:
                raise InvalidParameter(
                    f"{name}.policy.{side} must be a dict with a mode", parameter=name
                )
            frozen_policy[side] = {
                "mode": _choice(rule["mode"], f"{name}.policy.{side}.mode", MODERATION_MODES)
            }
        frozen["policy"] = frozen_policy
    return frozen


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
    """Only messages are accepted (``type: "message"``, or no type and a ``role``), and a
    message's ``role`` must be one of :data:`MESSAGE_ROLES` (``InvalidParameter``).

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
    role = item.get("role")
    if not isinstance(role, str) or role not in MESSAGE_ROLES:
        has = (
            "no role" if role is None
            else f"role {repr(role)[:40] if isinstance(role, str) else type(role).__name__}"
        )
        raise InvalidParameter(
            f"input item {index} has {has}: a message's role is one of "
            f"{', '.join(sorted(MESSAGE_ROLES))}",
            parameter="input",
        )


def _canonical(value: Any) -> bytes:
    return msgspec.json.encode(value, order="sorted")
