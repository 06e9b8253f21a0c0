"""Request parameters in wire form: a Responses create body (as a batch job line or
``StructuredRequest.from_params`` gives it) turned into ``StructuredRequest`` keyword
arguments. Names are checked here (unknown, refused, nested); values are checked when
the body is frozen (``recoverable.body.freeze_body``).
"""

from __future__ import annotations

from typing import Any

from recoverable.errors import InvalidParameter, InvalidRequest

__all__ = ["parameters_from_wire", "refuse", "shown"]


def refuse(parameter: str, why: str) -> InvalidParameter:
    return InvalidParameter(f"{parameter} is not allowed: {why}", parameter=parameter,
                            reason="refused")


def shown(value: Any) -> str:
    """A short, safe rendering of a rejected value for an error message."""
    return repr(value)[:40] if isinstance(value, (str, int, float)) else type(value).__name__


# Wire names taken as they are (StructuredRequest field = wire name).
_WIRE_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
    "top_logprobs", "service_tier", "metadata", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "safety_identifier", "user", "truncation", "include", "moderation",
    # refused unless None or their no-op value, by freeze_body
    "tools", "tool_choice", "parallel_tool_calls", "previous_response_id", "conversation",
    "store", "background", "prompt",
})
_WIRE_REFUSED = {
    "max_tool_calls": "recovery never runs tools",
    "context_management": "it compacts a stored conversation; recovery keeps no thread",
    "stream": "the transport sets it for its mode",
    "stream_options": "the transport owns the stream",
}
_WIRE_NESTED = {
    "text": {"verbosity": "verbosity"},
    "reasoning": {
        "effort": "reasoning_effort",
        "summary": "reasoning_summary",
        "mode": "reasoning_mode",
        "context": "reasoning_context",
    },
}


def parameters_from_wire(params: Any) -> dict[str, Any]:
    """``StructuredRequest`` keyword arguments from a Responses create body (wire names).

    ``text.verbosity`` becomes ``verbosity``, ``reasoning.<name>`` becomes
    ``reasoning_<name>`` (effort, summary, mode, context); ``text.format`` is refused (the format
    comes from ``response=`` / the job's schema), as are tool and thread parameters and
    every unknown name (``InvalidParameter`` with ``reason="unknown"``). Values are
    validated by ``freeze_body``.
    """
    if not isinstance(params, dict):
        raise InvalidRequest(
            f"request parameters must be a JSON object (dict), not {type(params).__name__}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in params.items():
        if not isinstance(name, str):
            raise InvalidParameter(
                f"parameter names must be strings, not {shown(name)}",
                parameter=str(name)[:64], reason="unknown",
            )
        if name in _WIRE_FIELDS:
            kwargs[name] = value
        elif name in _WIRE_REFUSED:
            raise refuse(name, _WIRE_REFUSED[name])
        elif name in _WIRE_NESTED:
            kwargs.update(_nested_from_wire(name, value))
        else:
            raise InvalidParameter(
                f"unknown request parameter {name[:64]!r}", parameter=name[:64],
                reason="unknown",
            )
    return kwargs


def _nested_from_wire(name: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidParameter(f"{name} must be an object or null", parameter=name)
    fields = _WIRE_NESTED[name]
    kwargs: dict[str, Any] = {}
    for key, item in value.items():
        path = f"{name}.{str(key)[:64]}"
        if path == "text.format":
            raise InvalidParameter(
                "text.format is not a request parameter: the structured output format comes "
                "from response= (the job's schema in a batch)",
                parameter=path, reason="refused",
            )
        if key not in fields:
            raise InvalidParameter(
                f"unknown request parameter {path!r} (known: "
                f"{', '.join(f'{name}.{known}' for known in sorted(fields))})",
                parameter=path, reason="unknown",
            )
        kwargs[fields[key]] = item
    return kwargs
