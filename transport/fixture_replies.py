"""The real-API event streams (and HTTP rejections) the fixture's replies become.

``events_for`` turns a ``Reply`` and a request into the Responses API events a real
server would stream; ``http_rejection`` gives status, headers and body of an HTTP-level
reply. The reply values live in ``fixture_script``, value synthesis in ``fixture_synth``;
their names are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import msgspec

from recoverable.transport.fixture_script import (
    HTTP_KINDS,
    REPLY_KINDS,
    FaultSpec,
    Reply,
    ReplyKind,
)
from recoverable.transport.fixture_synth import (
    MAX_SYNTH_DEPTH,
    MAX_SYNTH_VALUES,
    CannotSynthesize,
    synthesize_text,
    synthesize_value,
    violate,
)

__all__ = [
    "HTTP_KINDS",
    "MAX_SYNTH_DEPTH",
    "MAX_SYNTH_VALUES",
    "REPLY_KINDS",
    "CannotSynthesize",
    "FaultSpec",
    "HttpRejection",
    "Reply",
    "ReplyKind",
    "events_for",
    "http_rejection",
    "schema_rejection",
    "synthesize_value",
    "violate",
]

@attrs.frozen
class HttpRejection:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


def _error_body(etype: str, code: str | None, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": etype, "param": None, "code": code}}


def http_rejection(reply: Reply) -> HttpRejection:
    """Status, headers and body of an HTTP-level reply kind."""
    headers: list[tuple[str, str]] = [("content-type", "application/json")]
    if reply.kind == "rate_limited":
        retry_after = reply.retry_after or 0.0
        seconds = str(max(0, round(retry_after)))
        milliseconds = str(int(retry_after * 1000))
        name = reply.retry_after_header
        if name is None:
            headers += [("retry-after", seconds), ("retry-after-ms", milliseconds)]
        else:
            headers.append((name, milliseconds if name.endswith("-ms") else seconds))
        status = 429
        body: Any = _error_body("requests", "rate_limit_exceeded", "Rate limit reached.")
    elif reply.kind == "quota_exceeded":
        status = 429
        body = _error_body("insufficient_quota", "insufficient_quota", "You exceeded your quota.")
    elif reply.kind == "unauthorized":
        status = 401
        body = _error_body("invalid_request_error", "invalid_api_key", "Incorrect API key.")
    elif reply.kind == "forbidden":
        status = 403
        body = _error_body(
            "invalid_request_error",
            "unsupported_country_region_territory",
            "Country, region, or territory not supported.",
        )
    elif reply.kind == "http_error":
        status = reply.status or 500
        body = (
            reply.body
            if reply.body is not None
            else _error_body("server_error", "server_error", "The server had an error.")
        )
        headers += [(name.lower(), value) for name, value in reply.headers]
        if reply.framing == "sse":
            headers[0] = ("content-type", "text/event-stream")
            return HttpRejection(
                status, tuple(headers), b"data: " + msgspec.json.encode(body) + b"\n\n"
            )
    else:
        raise ValueError(f"{reply.kind} is not an HTTP-level reply")
    return HttpRejection(status, tuple(headers), msgspec.json.encode(body))


def schema_rejection(exc: CannotSynthesize) -> HttpRejection:
    """What the real API answers for a schema it cannot use: 400 ``invalid_json_schema``."""
    body = _error_body("invalid_request_error", "invalid_json_schema",
                       f"Invalid schema for response format: {exc}"[:500])
    body["error"]["param"] = "text.format.schema"
    return HttpRejection(400, (("content-type", "application/json"),), msgspec.json.encode(body))


# -- event streams ------------------------------------------------------------------
def _response_object(
    rid: str, request: Mapping[str, Any], created_at: int, status: str, output: list[Any]
) -> dict[str, Any]:
    text = request.get("text") if isinstance(request.get("text"), Mapping) else None
    reasoning = request.get("reasoning")
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "model": request.get("model", "fixture-model"),
        "output": output,
        "parallel_tool_calls": bool(request.get("parallel_tool_calls", False)),
        "previous_response_id": None,
        "reasoning": reasoning if isinstance(reasoning, Mapping) else {"effort": None,
                                                                        "summary": None},
        "store": bool(request.get("store", False)),
        "temperature": 1.0,
        "text": text if text is not None else {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice", "none"),
        "tools": request.get("tools", []),
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": None,
        "user": None,
        "metadata": {},
    }


def _usage(text: str, request: Mapping[str, Any]) -> dict[str, Any]:
    """A realistic ``usage`` object, deterministic from the request and answer sizes
    (about four characters a token, like English text). Output tokens include the
    reasoning tokens, which grow with the requested effort, as in the provider's usage."""
    prompt = msgspec.json.encode(
        [request.get("instructions"), request.get("input"), request.get("text")]
    )
    input_tokens = max(1, len(prompt) // 4)
    reasoning = request.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, Mapping) else None
    reasoning_tokens = {"minimal": 0, "low": 16, "medium": 64, "high": 256}.get(
        effort if isinstance(effort, str) else "", 0
    )
    out = max(1, len(text) // 4) + reasoning_tokens
    limit = request.get("max_output_tokens")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        # Like the API, never more output than the request allows.
        out = min(out, limit)
        reasoning_tokens = min(reasoning_tokens, out)
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + out,
    }


def _chunks(text: str, pieces: int = 4) -> list[str]:
    if not text:
        return [""]
    size = max(1, -(-len(text) // pieces))
    return [text[start : start + size] for start in range(0, len(text), size)]


def _split(text: str, pieces: int) -> list[str]:
    """``text`` in ``min(pieces, len(text))`` pieces of near-equal length (one empty piece for
    an empty text)."""
    pieces = min(max(1, pieces), len(text))
    if pieces == 0:
        return [""]
    size = len(text)
    return [text[start * size // pieces : (start + 1) * size // pieces] for start in range(pieces)]


def request_schema(request: Mapping[str, Any]) -> Any:
    text = request.get("text")
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema":
        return fmt.get("schema", {})
    return None


def events_for(
    reply: Reply, request: Mapping[str, Any], *, serial: int, created_at: int,
    deltas: int | None = None,
) -> list[dict[str, Any]]:
    """The full event list of a streamed reply (a disconnect/stall sends only a prefix).

    ``deltas``: stream the answer text in that many delta events (fewer if the text is
    shorter), as a real answer of that many tokens streams; default four."""
    rid = reply.response_id or f"resp_fixture{serial:012d}"
    mid = f"msg_fixture{serial:012d}"
    kind = reply.kind
    schema = request_schema(request)
    if kind == "complete":
        text = msgspec.json.encode(reply.payload).decode()
    elif kind == "invalid_json":
        text = "This is not JSON: {answer: 42"
    elif kind == "schema_violation":
        text = msgspec.json.encode(violate(schema, synthesize_value(schema or {}))).decode()
    elif kind == "refusal":
        text = reply.text or "I can't help with that."
    else:  # synthesize, disconnect, stall, incomplete, failed, tool_call
        text = synthesize_text(schema or {})

    events: list[dict[str, Any]] = []

    def emit(event: dict[str, Any]) -> None:
        event["sequence_number"] = len(events)
        events.append(event)

    def resp(status: str, output: list[Any]) -> dict[str, Any]:
        return _response_object(rid, request, created_at, status, output)

    emit({"type": "response.created", "response": resp("in_progress", [])})
    emit({"type": "response.in_progress", "response": resp("in_progress", [])})

    if kind == "error_event":
        error: dict[str, Any] = {"type": "error", "error": {
            "type": reply.error_type, "code": reply.code, "message": "The upstream failed.",
            "param": None}}
        if reply.status is not None:
            error["status"] = reply.status
        prefix = events[: reply.after_events or 0]
        events.clear()
        events.extend(prefix)
        emit(error)
        return events

    if kind == "failed":
        if reply.after_events is not None:
            # A normal answer's first events (the text is partial), then the failure.
            answer = events_for(attrs.evolve(reply, kind="synthesize", after_events=None),
                                request, serial=serial, created_at=created_at, deltas=deltas)
            events[:] = answer[: max(2, min(reply.after_events, len(answer) - 1))]
        failed = resp("failed", [])
        failed["error"] = {"code": reply.code or "server_error", "message": "The model failed."}
        failed["usage"] = _usage("", request)  # the input was processed before it failed
        emit({"type": "response.failed", "response": failed})
        return events

    if kind == "tool_call":
        call = {
            "id": f"fc_fixture{serial:012d}",
            "type": "function_call",
            "status": "in_progress",
            "arguments": "",
            "call_id": f"call_fixture{serial:012d}",
            "name": "lookup",
        }
        emit({"type": "response.output_item.added", "output_index": 0, "item": call})
        args = '{"query":"x"}'
        emit({"type": "response.function_call_arguments.delta", "item_id": call["id"],
              "output_index": 0, "delta": args})
        emit({"type": "response.function_call_arguments.done", "item_id": call["id"],
              "output_index": 0, "arguments": args})
        done_call = dict(call, status="completed", arguments=args)
        emit({"type": "response.output_item.done", "output_index": 0, "item": done_call})
        final = resp("completed", [done_call])
        final["usage"] = _usage(args, request)
        emit({"type": "response.completed", "response": final})
        return events

    part_type = "refusal" if kind == "refusal" else "output_text"
    empty_part: dict[str, Any] = (
        {"type": "refusal", "refusal": ""}
        if kind == "refusal"
        else {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    )
    item = {"id": mid, "type": "message", "status": "in_progress", "role": "assistant",
            "content": []}
    emit({"type": "response.output_item.added", "output_index": 0, "item": item})
    emit({"type": "response.content_part.added", "item_id": mid, "output_index": 0,
          "content_index": 0, "part": empty_part})
    chunks = _chunks(text) if deltas is None else _split(text, deltas)
    if kind == "incomplete":
        chunks = chunks[: max(1, len(chunks) // 2)]
    delta_type = "response.refusal.delta" if kind == "refusal" else "response.output_text.delta"
    for chunk in chunks:
        ev: dict[str, Any] = {"type": delta_type, "item_id": mid, "output_index": 0,
                              "content_index": 0, "delta": chunk}
        if kind != "refusal":
            ev["logprobs"] = []
        emit(ev)
    if kind == "incomplete":
        partial = "".join(chunks)
        part = {"type": "output_text", "text": partial, "annotations": [], "logprobs": []}
        msg = dict(item, status="incomplete", content=[part])
        final = resp("incomplete", [msg])
        final["incomplete_details"] = {"reason": reply.reason or "max_output_tokens"}
        final["usage"] = _usage(partial, request)
        emit({"type": "response.incomplete", "response": final})
        return events
    if kind == "refusal":
        emit({"type": "response.refusal.done", "item_id": mid, "output_index": 0,
              "content_index": 0, "refusal": text})
        part = {"type": "refusal", "refusal": text}
    else:
        emit({"type": "response.output_text.done", "item_id": mid, "output_index": 0,
              "content_index": 0, "text": text, "logprobs": []})
        part = {"type": part_type, "text": text, "annotations": [], "logprobs": []}
    emit({"type": "response.content_part.done", "item_id": mid, "output_index": 0,
          "content_index": 0, "part": part})
    msg = dict(item, status="completed", content=[part])
    emit({"type": "response.output_item.done", "output_index": 0, "item": msg})
    final = resp("completed", [msg])
    final["usage"] = _usage(text, request) if reply.usage is None else reply.usage
    emit({"type": "response.completed", "response": final})
    return events
