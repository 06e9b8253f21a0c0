"""The one Responses event parser, shared by the WebSocket and SSE transports.

No I/O here: bytes in, typed outcome out. ``SseDecoder`` turns an SSE byte
stream into frames; ``ResponseStream`` turns each frame's JSON into state and,
at a terminal event (or a violation), into a ``Completed`` or ``Interruption``.
Every input is bounded (frame size, event count); the transports bound total
bytes and idle time, since those need a clock and a socket.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from recoverable.outcome import (
    ERROR_EVENT,
    Completed,
    Interruption,
    InterruptionKind,
    MalformedUsage,
    Outcome,
    Progress,
    Usage,
    bounded_code,
    bounded_response_id,
    parse_usage,
)
from recoverable.transport.ratelimit import parse_rate_limit_headers, parse_retry_after

__all__ = [
    "RESUMED_WITHOUT_OUTPUT",
    "DeltaResponseStream",
    "FrameTooLarge",
    "ResponseStream",
    "SseDecoder",
    "SseFrame",
    "error_fields",
    "is_tool_item_type",
    "response_stream",
]

# Output item types that are not tool activity; every other ``*_call`` type is.
_PLAIN_ITEM_TYPES = frozenset({"message", "reasoning"})
_TOOL_EVENT_PREFIXES = (
    "response.function_call_arguments.",
    "response.custom_tool_call_input.",
    "response.mcp_",
)
_TOOL_EVENT_MARKER = re.compile(r"^response\.[a-z_]+_call\.")


def is_tool_item_type(item_type: str) -> bool:
    """Whether an output item of this type means the model asked for a tool."""
    if item_type in _PLAIN_ITEM_TYPES:
        return False
    return item_type.endswith("_call") or item_type in {"function_call", "custom_tool_call"}


def _is_tool_event(event_type: str) -> bool:
    if event_type.startswith(_TOOL_EVENT_PREFIXES):
        return True
    return _TOOL_EVENT_MARKER.match(event_type) is not None


# Reattachment: a resumed stream's terminal ``response.completed`` carried no message output.
RESUMED_WITHOUT_OUTPUT = "resumed_without_output"


class FrameTooLarge(Exception):
    """An SSE frame (or a single line) passed ``max_frame_bytes``."""


class SseFrame(msgspec.Struct, frozen=True):
    event: str | None
    data: bytes


_NEWLINE = re.compile(rb"\r\n|\r|\n")


class SseDecoder:
    """Incremental ``text/event-stream`` decoder (WHATWG rules) with a frame bound.

    Handles ``event:``/``data:`` fields, multi-line data (joined by ``\\n``),
    comments, CR / LF / CRLF line ends (also split across chunks), a leading
    BOM, and the optional space after the colon. ``id`` and ``retry`` are
    ignored: a Responses stream is never resumed by ``Last-Event-ID``.
    """

    def __init__(self, max_frame_bytes: int) -> None:
        self._max = max_frame_bytes
        self._buf = bytearray()
        self._scan_from = 0
        self._event: str | None = None
        self._data: list[bytes] = []
        self._data_size = 0
        self._first = True
        self._skip_lf = False

    def feed(self, chunk: bytes) -> list[SseFrame]:
        """Decode a chunk; returns the frames it completed. Raises ``FrameTooLarge``."""
        if self._first and chunk:
            self._first = False
            if chunk.startswith(b"\xef\xbb\xbf"):
                chunk = chunk[3:]
        if self._skip_lf and chunk:
            # The previous chunk ended with a CR that was taken as a line end at once; a
            # LF starting this chunk is the second half of that CRLF.
            self._skip_lf = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        self._buf += chunk
        frames: list[SseFrame] = []
        pos = 0
        buf = self._buf
        while True:
            newline = _NEWLINE.search(buf, max(pos, self._scan_from))
            if newline is None:
                break
            if newline.group() == b"\r" and newline.end() == len(buf):
                # A CR ends its line now (waiting for a possible LF would stall a stream
                # whose last line ends with CR); a LF arriving next is skipped.
                self._skip_lf = True
            line = bytes(buf[pos : newline.start()])
            pos = newline.end()
            self._scan_from = pos
            frame = self._line(line)
            if frame is not None:
                frames.append(frame)
        if pos:
            del buf[:pos]
            self._scan_from = 0
        if self._scan_from < len(buf):
            # Nothing found past here; the next search starts where this one ended
            # (minus one byte: a lone trailing CR is re-examined).
            self._scan_from = max(0, len(buf) - 1)
        if len(buf) + self._data_size > self._max:
            raise FrameTooLarge
        return frames

    def _line(self, line: bytes) -> SseFrame | None:
        if not line:
            if not self._data:
                self._event = None
                return None
            frame = SseFrame(self._event, b"\n".join(self._data))
            self._event = None
            self._data = []
            self._data_size = 0
            return frame
        if line.startswith(b":"):
            return None
        name, sep, value = line.partition(b":")
        if sep and value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            self._data.append(value)
            self._data_size += len(value) + 1
            if self._data_size > self._max:
                raise FrameTooLarge
        elif name == b"event":
            self._event = value.decode("utf-8", "replace")
        return None


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def error_fields(error: object) -> tuple[str | None, str | None]:
    """(type, code) of an ``{"type", "code", "message"}`` error object, if shaped so.

    Both are bounded application codes (:func:`bounded_code`): a provider string never
    leaves the adapter unbounded. The message is never read.
    """
    if not isinstance(error, Mapping):
        return None, None
    return bounded_code(_str(error.get("type"))), bounded_code(_str(error.get("code")))


class _Malformed(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class ResponseStream:
    """State of one streamed response, fed one event (a JSON object) at a time.

    ``feed`` returns ``None`` while the stream should continue, or the outcome
    once a terminal event, a tool call, or a protocol violation ends it.
    ``interrupt`` builds the ``Interruption`` for an end the transport saw
    (disconnect, timeout, bound), filled with what the stream learned so far.
    """

    def __init__(
        self,
        *,
        max_events: int,
        on_progress: Callable[[Progress], None] | None = None,
        progress_interval: int = 32,
        resume_after: int | None = None,
        response_id: str | None = None,
    ) -> None:
        # Reattachment: a stream resumed after ``resume_after`` (a saved cursor) of the known
        # ``response_id``. Events at or below the cursor are skipped (never applied twice);
        # the deltas before it are missing, so a completion is taken only from the terminal
        # response's own output, never assembled from partial events.
        self._resume_after = resume_after
        self.response_id: str | None = response_id
        # ``background`` of the first response object seen (``Progress.background``).
        self.background: bool | None = None
        self.sequence_number: int | None = None
        self.had_output = False
        self.had_tool_activity = False
        self.events = 0
        self._max_events = max_events
        self._on_progress = on_progress
        self._progress_interval = progress_interval
        self._reported_seq: int | None = None
        self._texts: dict[tuple[int, int], list[str]] = {}
        self._done_texts: dict[tuple[int, int], str] = {}
        self._refusal = False
        self.outcome: Outcome | None = None
        # The terminal response's ``usage`` (completed / incomplete / failed), once seen.
        self.usage: Usage | None = None
        self.usage_malformed = False

    # -- building outcomes -------------------------------------------------
    def interrupt(self, kind: InterruptionKind, **fields: Any) -> Interruption:
        fields.setdefault("response_id", self.response_id)
        fields.setdefault("sequence_number", self.sequence_number)
        fields.setdefault("had_output", self.had_output)
        fields.setdefault("had_tool_activity", self.had_tool_activity)
        fields.setdefault("usage", self.usage)
        fields.setdefault("usage_malformed", self.usage_malformed)
        return Interruption(kind=kind, **fields)

    def _finish(self, outcome: Outcome) -> Outcome:
        self.outcome = outcome
        self._report(force=True)
        return outcome

    def _report(self, *, force: bool = False) -> None:
        if self._on_progress is None:
            return
        seq = self.sequence_number
        if not force and self._reported_seq is not None and seq is not None:
            if seq - self._reported_seq < self._progress_interval:
                return
        self._reported_seq = seq
        self._on_progress(
            Progress(
                response_id=self.response_id,
                sequence_number=seq,
                had_output=self.had_output,
                background=self.background,
            )
        )

    # -- feeding ---------------------------------------------------------------
    def feed(self, data: bytes | str, *, event_name: str | None = None) -> Outcome | None:
        """Parse one event's JSON text. Never raises for bad input.

        ``event_name`` is the SSE ``event:`` line, when the frame had one: it is used
        only when the JSON itself carries no ``type`` (servers send the line on some
        frames only; the JSON ``type`` is authoritative).
        """
        if self.outcome is not None:
            return self.outcome
        self.events += 1
        if self.events > self._max_events:
            return self._finish(
                self.interrupt("response_too_large", transport_code="too_many_events")
            )
        try:
            event = msgspec.json.decode(data)
        except (msgspec.DecodeError, UnicodeDecodeError):
            return self._finish(self.interrupt("malformed", transport_code="invalid_json"))
        if not isinstance(event, dict):
            return self._finish(self.interrupt("malformed", transport_code="event_not_object"))
        if "type" not in event:
            if event_name:
                event["type"] = event_name
            elif isinstance(event.get("error"), dict):
                event["type"] = "error"  # ``data: {"error": {...}}``, as proxies stream it
        try:
            return self.feed_event(event)
        except _Malformed as exc:
            return self._finish(self.interrupt("malformed", transport_code=exc.code))

    def feed_event(self, event: dict[str, Any]) -> Outcome | None:
        etype = event.get("type")
        if not isinstance(etype, str):
            raise _Malformed("event_without_type")
        seq = event.get("sequence_number")
        if seq is not None:
            if not isinstance(seq, int) or isinstance(seq, bool):
                raise _Malformed("bad_sequence_number")
            if self._resume_after is not None and seq <= self._resume_after:
                return None  # already applied before the stream was resumed
            self.sequence_number = seq
        known_id = self.response_id
        had_output = self.had_output
        outcome = self._dispatch(etype, event)
        if outcome is not None:
            return self._finish(outcome)
        self._report(force=(known_id != self.response_id or had_output != self.had_output))
        return None

    def _learn_response(self, event: Mapping[str, Any]) -> Mapping[str, Any] | None:
        response = event.get("response")
        if response is None:
            return None
        if not isinstance(response, Mapping):
            raise _Malformed("bad_response_object")
        rid = response.get("id")
        if rid is not None:
            if not isinstance(rid, str):
                raise _Malformed("bad_response_id")
            if self.response_id is None:
                self.response_id = bounded_response_id(rid)
        if self.background is None:
            self.background = response.get("background") is True
        return response

    def _learn_usage(self, response: Mapping[str, Any] | None) -> None:
        """Read a terminal response's ``usage``. Malformed usage is ignored and flagged,
        never a failure of the attempt: the tokens were consumed either way."""
        if response is None:
            return
        try:
            self.usage = parse_usage(response.get("usage"))
        except MalformedUsage:
            self.usage = None
            self.usage_malformed = True

    def _dispatch(self, etype: str, event: dict[str, Any]) -> Outcome | None:
        if etype in ("response.created", "response.in_progress", "response.queued"):
            self._learn_response(event)
            return None
        if etype in ("response.output_item.added", "response.output_item.done"):
            item = event.get("item")
            if not isinstance(item, Mapping) or not isinstance(item.get("type"), str):
                raise _Malformed("bad_output_item")
            self.had_output = True
            if is_tool_item_type(item["type"]):
                self.had_tool_activity = True
                return self.interrupt("tool_activity")
            return None
        if etype == "response.output_text.delta" or etype == "response.refusal.delta":
            delta = event.get("delta")
            if not isinstance(delta, str):
                raise _Malformed("bad_delta")
            self.had_output = True
            if etype == "response.refusal.delta":
                self._refusal = True
            else:
                self._texts.setdefault(self._key(event), []).append(delta)
            return None
        if etype == "response.output_text.done":
            text = event.get("text")
            if not isinstance(text, str):
                raise _Malformed("bad_text")
            self.had_output = True
            self._done_texts[self._key(event)] = text
            return None
        if etype == "response.refusal.done":
            self.had_output = True
            self._refusal = True
            return None
        if etype in ("response.content_part.added", "response.content_part.done"):
            part = event.get("part")
            if isinstance(part, Mapping) and part.get("type") == "refusal":
                self._refusal = True
            return None
        if etype == "response.completed":
            response = self._learn_response(event)
            self._learn_usage(response)
            return self._completed(response)
        if etype == "response.failed":
            response = self._learn_response(event)
            self._learn_usage(response)
            error = response.get("error") if response is not None else None
            ptype, pcode = error_fields(error)
            return self.interrupt("provider_failed", provider_type=ptype, provider_code=pcode)
        if etype == "response.incomplete":
            response = self._learn_response(event)
            self._learn_usage(response)
            details = response.get("incomplete_details") if response is not None else None
            reason = (
                bounded_code(_str(details.get("reason"))) if isinstance(details, Mapping) else None
            )
            return self.interrupt("incomplete", provider_code=reason)
        if etype == "error":
            return self._error(event)
        if _is_tool_event(etype):
            self.had_tool_activity = True
            return self.interrupt("tool_activity")
        return None  # unknown / informational events are tolerated

    @staticmethod
    def _key(event: Mapping[str, Any]) -> tuple[int, int]:
        oi = event.get("output_index", 0)
        ci = event.get("content_index", 0)
        if not isinstance(oi, int) or not isinstance(ci, int):
            raise _Malformed("bad_index")
        return (oi, ci)

    def _error(self, event: Mapping[str, Any]) -> Interruption:
        nested = event.get("error")
        if isinstance(nested, Mapping):
            ptype, pcode = error_fields(nested)
        else:
            # Flat shape: ``type`` is "error" itself; only the code is the provider's.
            ptype, pcode = None, bounded_code(_str(event.get("code")))
        status = event.get("status")
        if isinstance(status, int) and not isinstance(status, bool) and 100 <= status <= 599:
            headers = event.get("headers")
            retry_after = None
            rate_limits = None
            if isinstance(headers, Mapping):
                lowered = {str(name).lower(): str(value) for name, value in headers.items()}
                retry_after = parse_retry_after(lowered)
                rate_limits = parse_rate_limit_headers(lowered)
            return self.interrupt(
                "http_rejected",
                http_status=status,
                provider_type=ptype,
                provider_code=pcode,
                retry_after=retry_after,
                rate_limits=rate_limits,
            )
        return self.interrupt("provider_failed", provider_type=ptype, provider_code=pcode,
                              transport_code=ERROR_EVENT)

    def _completed(self, response: Mapping[str, Any] | None) -> Outcome:
        texts: list[str] = []
        found_message = False
        output = response.get("output") if response is not None else None
        if isinstance(output, list):
            for item in output:
                if not isinstance(item, Mapping):
                    raise _Malformed("bad_output_item")
                itype = item.get("type")
                if isinstance(itype, str) and is_tool_item_type(itype):
                    self.had_tool_activity = True
                    self.had_output = True
                    return self.interrupt("tool_activity")
                if itype != "message":
                    continue
                content = item.get("content")
                if not isinstance(content, list):
                    continue
                for part in content:
                    if not isinstance(part, Mapping):
                        raise _Malformed("bad_content_part")
                    if part.get("type") == "refusal":
                        self._refusal = True
                    elif part.get("type") == "output_text":
                        text = part.get("text")
                        if not isinstance(text, str):
                            raise _Malformed("bad_text")
                        texts.append(text)
                        found_message = True
        if self._refusal:
            self.had_output = True
            return self.interrupt("refusal")
        if found_message:
            final = "".join(texts)
        elif self._resume_after is not None:
            # Resumed: the deltas before the cursor were never seen here. Nothing is
            # fabricated from partial events (the caller reads the final state instead).
            return self.interrupt("malformed", transport_code=RESUMED_WITHOUT_OUTPUT)
        else:
            keys = sorted(set(self._texts) | set(self._done_texts))
            final = "".join(
                self._done_texts[part] if part in self._done_texts else "".join(self._texts[part])
                for part in keys
            )
        return Completed(
            text=final,
            response_id=self.response_id,
            sequence_number=self.sequence_number,
            usage=self.usage,
            usage_malformed=self.usage_malformed,
        )


class DeltaResponseStream(ResponseStream):
    """A :class:`ResponseStream` that also hands each output text delta to ``on_delta``
    as it arrives (a live operation's views). ``on_delta`` is synchronous and
    must never wait. Only a stream that asked is of this class: no other stream pays."""

    def __init__(
        self,
        *,
        max_events: int,
        on_delta: Callable[[str], None],
        on_progress: Callable[[Progress], None] | None = None,
    ) -> None:
        super().__init__(max_events=max_events, on_progress=on_progress)
        self._on_delta = on_delta

    def _dispatch(self, etype: str, event: dict[str, Any]) -> Outcome | None:
        outcome = super()._dispatch(etype, event)
        if etype == "response.output_text.delta":
            self._on_delta(event["delta"])  # a string: checked by the parser above
        return outcome


def response_stream(
    *,
    max_events: int,
    on_progress: Callable[[Progress], None] | None,
    on_delta: Callable[[str], None] | None,
) -> ResponseStream:
    """The parser state of one stream: with ``on_delta`` only when one was asked for."""
    if on_delta is None:
        return ResponseStream(max_events=max_events, on_progress=on_progress)
    return DeltaResponseStream(max_events=max_events, on_progress=on_progress, on_delta=on_delta)
