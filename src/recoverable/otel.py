"""OpenTelemetry sink for ``recovery.*`` telemetry (the optional ``otel`` extra).

``OpenTelemetrySink`` is a telemetry sink (``open_runtime(..., telemetry=sink)``) that
turns the privacy-filtered events into spans and metrics following the OpenTelemetry
GenAI semantic conventions. It depends on ``opentelemetry-api`` only; the host brings
the SDK and its exporters. It reads nothing but the events, so it carries nothing the
events do not: ids, counts, the model, typed codes, never prompts, outputs, tokens,
account identifiers or scope/job strings.

Spans, reconstructed from the event stream with the events' own timestamps:

- one ``send_recovering {model}`` span (kind INTERNAL) per send of an operation: it
  starts at the first event of the send (an attempt reserved, a cooldown, a stop) and
  ends at its outcome (receipt saved or retrieved, stopped, suspended, cancelled);
  reservations, failures, cooldowns and account stops are span events on it;
- one ``chat {model}`` child span (kind CLIENT, the GenAI inference span) per
  transmitted attempt, from its authorization to its outcome.

Metrics: ``recoverable.attempts``, ``recoverable.replacements``,
``recoverable.completions``, ``recoverable.attempt.failures`` (by ``error.type`` =
interruption kind), ``recoverable.operation.stops`` (by ``error.type`` = error code),
``recoverable.events`` (by event name), the histogram ``gen_ai.client.operation.duration``
(seconds per attempt) and, when events carry token usage, ``gen_ai.client.token.usage``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics, trace
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
    from opentelemetry.semconv._incubating.metrics import gen_ai_metrics
    from opentelemetry.semconv.attributes import error_attributes, http_attributes
    from opentelemetry.trace import SpanKind, Status, StatusCode
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "recoverable.otel needs the OpenTelemetry API: pip install 'recoverable[otel]' "
        "(and an OpenTelemetry SDK with an exporter to see the data)"
    ) from exc

from recoverable.telemetry import TelemetryEvent

__all__ = ["OpenTelemetrySink"]

_SCOPE = "recoverable"
_SEMCONV_SCHEMA = "https://opentelemetry.io/schemas/1.37.0"
_OPERATION = "chat"  # gen_ai.operation.name of a Responses generation
# Bucket boundaries the GenAI conventions advise for gen_ai.client.operation.duration.
_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                     20.48, 40.96, 81.92)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                  16777216, 67108864)
# Token usage, when an event carries it (field name -> span attribute, token type).
# The names are the semantic conventions package's (``gen_ai`` is still incubating there).
_USAGE: tuple[tuple[str, str, str | None], ...] = (
    ("input_tokens", gen_ai.GEN_AI_USAGE_INPUT_TOKENS, "input"),
    ("output_tokens", gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS, "output"),
    ("cached_input_tokens", gen_ai.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, None),
    ("reasoning_tokens", gen_ai.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS, None),
)
_ERROR_TYPE = error_attributes.ERROR_TYPE
_HTTP_STATUS = http_attributes.HTTP_RESPONSE_STATUS_CODE
_STOPS = {
    "recovery.operation.stopped": "stopped",
    "recovery.operation.suspended": "suspended",
    "recovery.operation.cancelled": "cancelled",
    "recovery.operation.authentication_required": "authentication_required",
}
# Stops that are a deliberate host decision, not an error.
_DELIBERATE = frozenset({"suspended", "cancelled"})

Attrs = dict[str, str | int | float | bool]


class _Send:
    """The open spans of one operation's send."""

    __slots__ = ("attempt", "attempt_reason", "attempt_start", "attempts", "model", "span")

    def __init__(self, span: trace.Span, model: str | None) -> None:
        self.span = span
        self.model = model
        self.attempts = 0
        self.attempt: trace.Span | None = None
        self.attempt_start = 0.0
        self.attempt_reason: str | None = None


class OpenTelemetrySink:
    """A ``recoverable`` telemetry sink that emits OpenTelemetry spans and metrics.

    ``tracer_provider`` / ``meter_provider`` default to the global ones. A failing
    exporter, processor or instrument never reaches an operation: every error here
    is swallowed and counted in ``failed``. The sink runs on the Trio thread (see
    docs/telemetry.md): use a batching span processor and a periodic metric reader,
    which export from their own threads.

    ``max_open`` bounds the operations tracked at once; past it, the oldest send's
    spans are ended (``recoverable.outcome="evicted"``). ``end_open_spans()`` ends
    the spans of sends whose outcome never arrived (e.g. an ``authorize`` callback
    that raised), for example when the runtime has closed.
    """

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        *,
        provider_name: str = "openai",
        max_open: int = 10_000,
    ) -> None:
        version = _version()
        if tracer_provider is None:
            self._tracer = trace.get_tracer(_SCOPE, version, schema_url=_SEMCONV_SCHEMA)
        else:
            self._tracer = tracer_provider.get_tracer(_SCOPE, version, schema_url=_SEMCONV_SCHEMA)
        if meter_provider is None:
            meter = metrics.get_meter(_SCOPE, version, schema_url=_SEMCONV_SCHEMA)
        else:
            meter = meter_provider.get_meter(_SCOPE, version, schema_url=_SEMCONV_SCHEMA)
        self._provider_name = provider_name
        self._max_open = max(1, max_open)
        self._sends: OrderedDict[str, _Send] = OrderedDict()
        self._models: OrderedDict[str, str] = OrderedDict()
        # The caller's context (its current span) of each operation whose send span is
        # not open yet, seen when its first event was emitted (``capture``).
        self._parents: OrderedDict[str, otel_context.Context] = OrderedDict()
        self.failed = 0
        self._attempts = meter.create_counter(
            "recoverable.attempts", "{attempt}", "Generation attempts transmitted (spent).")
        self._replacements = meter.create_counter(
            "recoverable.replacements", "{attempt}",
            "Attempts that replaced an interrupted one (replacement or 401 re-issue).")
        self._completions = meter.create_counter(
            "recoverable.completions", "{operation}", "Validated completions saved as receipts.")
        self._failures = meter.create_counter(
            "recoverable.attempt.failures", "{attempt}",
            "Attempts that ended without a usable completion, by interruption kind.")
        self._stops = meter.create_counter(
            "recoverable.operation.stops", "{operation}",
            "Sends that stopped with a typed error, by error code.")
        self._events = meter.create_counter(
            "recoverable.events", "{event}", "recovery.* telemetry events, by name.")
        self._duration = meter.create_histogram(
            gen_ai_metrics.GEN_AI_CLIENT_OPERATION_DURATION, "s", "GenAI operation duration.",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS)
        self._tokens = meter.create_histogram(
            gen_ai_metrics.GEN_AI_CLIENT_TOKEN_USAGE, "{token}",
            "Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS)

    # --- the sink ----------------------------------------------------------------------

    def __call__(self, event: TelemetryEvent) -> None:
        try:
            self._handle(event)
        except Exception:  # an exporter or SDK failure never breaks an operation
            self.failed += 1

    def capture(self, operation_id: str) -> None:
        """Called by the runtime when an event is emitted, in the emitting task (whose
        context is the caller's: an operation's task starts in a copy of the context
        of the task that sent it): the caller's current span becomes the parent of the
        operation's send span. A worker's operations have no caller: root spans."""
        if operation_id in self._sends:
            return
        # The latest wins: ``prepare`` may run outside the span that then sends.
        parents = self._parents
        parents[operation_id] = otel_context.get_current()
        parents.move_to_end(operation_id)
        while len(parents) > self._max_open:
            parents.popitem(last=False)

    def end_open_spans(self) -> None:
        """End every span still open (``recoverable.outcome="unfinished"``)."""
        now = time.time()
        while self._sends:
            _, send = self._sends.popitem(last=False)
            try:
                self._finish(send, now, "unfinished", error=None)
            except Exception:
                self.failed += 1

    # --- event handling ----------------------------------------------------------------

    def _handle(self, event: TelemetryEvent) -> None:
        name = event.name
        fields = event.fields
        op = event.operation_id
        at = event.time or time.time()
        self._events.add(1, {"recoverable.event.name": name})
        model = _text(fields.get("model"))
        if model is not None:
            self._remember_model(op, model)
        if name == "recovery.attempt.reserved":
            send = self._send(op, at)
            send.span.add_event("recoverable.attempt.reserved", _clean({
                "recoverable.attempt.number": fields.get("attempt"),
                "recoverable.attempt.reason": fields.get("reason"),
            }), timestamp=_ns(at))
            send.attempt_reason = _text(fields.get("reason"))
        elif name == "recovery.attempt.transmission_authorized":
            self._attempt_started(self._send(op, at), op, fields, at)
        elif name == "recovery.attempt.failed":
            self._attempt_failed(self._send(op, at), fields, at)
        elif name == "recovery.attempt.usage":
            self._usage(self._send(op, at), fields)
        elif name == "recovery.receipt.saved":
            send = self._send(op, at)
            self._attempt_ended(send, fields, at, error_type=None)
            self._completions.add(1, self._model_attrs(send))
            self._end(op, at, "completed", error=None)
        elif name == "recovery.receipt.retrieved":
            self._send(op, at)
            self._end(op, at, "retrieved", error=None)
        elif name == "recovery.operation.waiting":
            send = self._send(op, at)
            send.span.add_event("recoverable.operation.waiting", _clean({
                "recoverable.wait.until": fields.get("until"),
            }), timestamp=_ns(at))
        elif name == "recovery.operation.account_stopped":
            send = self._send(op, at)
            send.span.add_event("recoverable.operation.account_stopped", _clean({
                "recoverable.stop.reason": fields.get("reason"),
            }), timestamp=_ns(at))
        elif name in _STOPS:
            outcome = _STOPS[name]
            code = _text(fields.get("error")) or outcome
            send = self._send(op, at)
            if send.attempt is not None:
                self._attempt_ended(send, {}, at, error_type=code)
            attrs = self._model_attrs(send)
            attrs[_ERROR_TYPE] = code
            self._stops.add(1, attrs)
            self._end(op, at, code if outcome == "stopped" else outcome,
                      error=None if outcome in _DELIBERATE else code)
        # prepared, acknowledged, abandoned, manual_retry_created: counted in events only.

    def _remember_model(self, op: str, model: str) -> None:
        self._models[op] = model
        self._models.move_to_end(op)
        while len(self._models) > self._max_open:
            self._models.popitem(last=False)
        send = self._sends.get(op)
        if send is not None and send.model is None:
            send.model = model
            send.span.set_attribute(gen_ai.GEN_AI_REQUEST_MODEL, model)

    def _send(self, op: str, at: float) -> _Send:
        send = self._sends.get(op)
        if send is not None:
            self._sends.move_to_end(op)
            return send
        model = self._models.get(op)
        attrs = self._base_attrs(model)
        attrs["recoverable.operation.id"] = op
        span = self._tracer.start_span(
            f"send_recovering {model}" if model else "send_recovering",
            context=self._parents.pop(op, None),
            kind=SpanKind.INTERNAL, attributes=attrs, start_time=_ns(at),
        )
        send = _Send(span, model)
        self._sends[op] = send
        while len(self._sends) > self._max_open:
            _, oldest = self._sends.popitem(last=False)
            self._finish(oldest, at, "evicted", error=None)
        return send

    def _attempt_started(
        self, send: _Send, op: str, fields: Mapping[str, Any], at: float
    ) -> None:
        if send.attempt is not None:  # the previous attempt's outcome never arrived
            self._attempt_ended(send, {}, at, error_type="unknown")
        reason = send.attempt_reason or "initial"
        attrs = self._base_attrs(send.model)
        attrs["recoverable.operation.id"] = op
        attrs["recoverable.attempt.reason"] = reason
        number = fields.get("attempt")
        if isinstance(number, int):
            attrs["recoverable.attempt.number"] = number
        context = trace.set_span_in_context(send.span)
        send.attempt = self._tracer.start_span(
            f"{_OPERATION} {send.model}" if send.model else _OPERATION,
            context=context, kind=SpanKind.CLIENT, attributes=attrs, start_time=_ns(at),
        )
        send.attempt_start = at
        send.attempts += 1
        counted = self._model_attrs(send)
        counted["recoverable.attempt.reason"] = reason
        self._attempts.add(1, counted)
        if reason != "initial":
            self._replacements.add(1, counted)

    def _attempt_failed(self, send: _Send, fields: Mapping[str, Any], at: float) -> None:
        kind = _text(fields.get("kind")) or "unknown"
        attrs = self._model_attrs(send)
        attrs[_ERROR_TYPE] = kind
        status = fields.get("http_status")
        if isinstance(status, int):
            attrs[_HTTP_STATUS] = status
        self._failures.add(1, attrs)
        send.span.add_event("recoverable.attempt.failed", _clean({
            _ERROR_TYPE: kind,
            _HTTP_STATUS: status,
            "recoverable.failure.code": fields.get("code"),
        }), timestamp=_ns(at))
        self._attempt_ended(send, fields, at, error_type=kind)

    def _attempt_ended(
        self, send: _Send, fields: Mapping[str, Any], at: float, *, error_type: str | None
    ) -> None:
        span = send.attempt
        if span is None:
            return
        send.attempt = None
        measured = self._base_attrs(send.model)
        if error_type is not None:
            measured[_ERROR_TYPE] = error_type
            span.set_attribute(_ERROR_TYPE, error_type)
            status = fields.get("http_status")
            if isinstance(status, int):
                span.set_attribute(_HTTP_STATUS, status)
            code = _text(fields.get("code"))
            if code is not None:
                span.set_attribute("recoverable.failure.code", code)
            span.set_status(Status(StatusCode.ERROR, error_type))
        self._set_usage(span, fields, measured)
        self._duration.record(max(0.0, at - send.attempt_start), measured)
        self._close(span, at)

    def _usage(self, send: _Send, fields: Mapping[str, Any]) -> None:
        """The attempt's usage (``recovery.attempt.usage``): on its span while it is open
        (else on the send's), and the token usage histogram."""
        span = send.attempt if send.attempt is not None else send.span
        self._set_usage(span, fields, self._base_attrs(send.model))

    def _set_usage(self, span: trace.Span, fields: Mapping[str, Any], measured: Attrs) -> None:
        for field, attribute, token_type in _USAGE:
            count = fields.get(field)
            if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
                span.set_attribute(attribute, count)
                if token_type is not None:
                    self._tokens.record(count, {**measured, gen_ai.GEN_AI_TOKEN_TYPE: token_type})

    def _end(self, op: str, at: float, outcome: str, *, error: str | None) -> None:
        send = self._sends.pop(op, None)
        if send is not None:
            self._finish(send, at, outcome, error=error)

    def _finish(self, send: _Send, at: float, outcome: str, *, error: str | None) -> None:
        if send.attempt is not None:
            self._attempt_ended(send, {}, at, error_type=error or outcome)
        span = send.span
        span.set_attribute("recoverable.outcome", outcome)
        span.set_attribute("recoverable.attempts", send.attempts)
        if error is not None:
            span.set_attribute(_ERROR_TYPE, error)
            span.set_status(Status(StatusCode.ERROR, error))
        self._close(span, at)

    def _close(self, span: trace.Span, at: float) -> None:
        # A span processor or exporter that raises must not skip the rest of the event
        # (its metrics, the parent span): swallowed and counted here.
        try:
            span.end(end_time=_ns(at))
        except Exception:
            self.failed += 1

    def _base_attrs(self, model: str | None) -> Attrs:
        attrs: Attrs = {
            gen_ai.GEN_AI_OPERATION_NAME: _OPERATION,
            gen_ai.GEN_AI_PROVIDER_NAME: self._provider_name,
            gen_ai.GEN_AI_OUTPUT_TYPE: "json",
        }
        if model is not None:
            attrs[gen_ai.GEN_AI_REQUEST_MODEL] = model
        return attrs

    def _model_attrs(self, send: _Send) -> Attrs:
        attrs: Attrs = {gen_ai.GEN_AI_OPERATION_NAME: _OPERATION}
        if send.model is not None:
            attrs[gen_ai.GEN_AI_REQUEST_MODEL] = send.model
        return attrs


def _ns(seconds: float) -> int:
    return int(seconds * 1_000_000_000)


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _clean(values: Mapping[str, object]) -> Attrs:
    return {
        key: value
        for key, value in values.items()
        if isinstance(value, str | int | float | bool)
    }


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("recoverable")
    except Exception:  # pragma: no cover - not installed as a distribution
        return "0"
