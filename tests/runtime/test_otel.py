"""The OpenTelemetry sink (issue 19.7): real operations against the fixture provider,
exported through the OpenTelemetry SDK's in-memory span exporter and metric reader."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import recoverable
from recoverable.otel import OpenTelemetrySink
from recoverable.telemetry import TelemetryEvent
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, make_backend

FAST = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)


class Otel:
    """An SDK tracer/meter provider pair with in-memory export."""

    def __init__(self, *processors: SpanProcessor) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        for processor in processors:
            self.tracer_provider.add_span_processor(processor)
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.sink = OpenTelemetrySink(self.tracer_provider, self.meter_provider)

    def finished(self) -> Sequence[ReadableSpan]:
        return self.spans.get_finished_spans()

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        found: list[Any] = []
        if data is None:
            return found
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found

    def total(self, name: str, **attrs: Any) -> int:
        return sum(
            p.value for p in self.points(name)
            if all(p.attributes.get(k) == v for k, v in attrs.items())
        )

    def exported_text(self) -> str:
        """Everything exported: every span (names, attributes, events, resource) and
        every metric point, as JSON."""
        parts = [span.to_json() for span in self.finished()]
        data = self.reader.get_metrics_data()
        if data is not None:
            parts.append(data.to_json())
        return "\n".join(parts)


@pytest.fixture
def otel() -> Iterator[Otel]:
    o = Otel()
    yield o
    o.tracer_provider.shutdown()
    o.meter_provider.shutdown()


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def test_replacement_after_disconnect_is_one_send_span_with_two_attempt_spans(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str, otel: Otel
) -> None:
    provider.script(
        [Reply.disconnect(after_events=3), Reply.complete({"answer": 7, "note": "second"})]
    )
    before = time.time()
    async with recoverable.open_runtime(
        store, make_backend(provider, mode), account=ACCOUNT, telemetry=otel.sink
    ) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3, retry_policy=FAST)
        value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    after = time.time()
    assert value == Answer(7, "second")
    assert otel.sink.failed == 0
    op = handle.operation_id

    spans = otel.finished()
    sends = [s for s in spans if s.name == "send_recovering gpt-test"]
    attempts = sorted((s for s in spans if s.name == "chat gpt-test"),
                      key=lambda s: _attrs(s)["recoverable.attempt.number"])
    assert len(sends) == 1 and len(attempts) == 2 and len(spans) == 3
    send = sends[0]
    assert send.kind is SpanKind.INTERNAL
    assert _attrs(send) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.output.type": "json",
        "gen_ai.request.model": "gpt-test",
        "recoverable.operation.id": op,
        "recoverable.outcome": "completed",
        "recoverable.attempts": 2,
    }
    assert send.status.status_code is StatusCode.UNSET
    event_names = [e.name for e in send.events]
    assert event_names.count("recoverable.attempt.reserved") == 2
    assert event_names.count("recoverable.attempt.failed") == 1
    failed_event = next(e for e in send.events if e.name == "recoverable.attempt.failed")
    assert failed_event.attributes is not None
    assert failed_event.attributes["error.type"] in ("disconnected", "premature_eof")

    first, second = attempts
    for number, span, reason in ((1, first, "initial"), (2, second, "replacement")):
        assert span.kind is SpanKind.CLIENT
        assert span.parent is not None and span.parent.span_id == send.context.span_id
        assert span.context.trace_id == send.context.trace_id
        a = _attrs(span)
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "gpt-test"
        assert a["gen_ai.provider.name"] == "openai"
        assert a["recoverable.operation.id"] == op
        assert a["recoverable.attempt.number"] == number
        assert a["recoverable.attempt.reason"] == reason
        assert span.start_time is not None and span.end_time is not None
        assert send.start_time is not None and send.end_time is not None
        # The spans carry the events' own timestamps, inside the test's wall-clock window.
        assert int(before * 1e9) <= send.start_time <= span.start_time
        assert span.start_time <= span.end_time <= send.end_time <= int(after * 1e9)
    assert first.status.status_code is StatusCode.ERROR
    assert _attrs(first)["error.type"] in ("disconnected", "premature_eof")
    assert second.status.status_code is StatusCode.UNSET and "error.type" not in _attrs(second)
    assert first.end_time is not None and second.start_time is not None
    assert first.end_time <= second.start_time

    assert otel.total("recoverable.attempts") == 2
    assert otel.total("recoverable.attempts", **{"recoverable.attempt.reason": "initial"}) == 1
    assert otel.total("recoverable.replacements") == 1
    assert otel.total("recoverable.replacements",
                      **{"recoverable.attempt.reason": "replacement",
                         "gen_ai.request.model": "gpt-test"}) == 1
    assert otel.total("recoverable.completions", **{"gen_ai.request.model": "gpt-test"}) == 1
    failures = otel.points("recoverable.attempt.failures")
    assert [p.value for p in failures] == [1]
    assert failures[0].attributes["error.type"] in ("disconnected", "premature_eof")
    assert otel.total("recoverable.operation.stops") == 0
    assert otel.total("recoverable.events",
                      **{"recoverable.event.name": "recovery.receipt.saved"}) == 1
    durations = otel.points("gen_ai.client.operation.duration")
    assert sum(p.count for p in durations) == 2
    failed_durations = [p for p in durations if "error.type" in p.attributes]
    assert len(failed_durations) == 1 and failed_durations[0].count == 1
    assert all(p.attributes["gen_ai.request.model"] == "gpt-test" for p in durations)
    assert 0 <= sum(p.sum for p in durations) <= after - before
    # The completed attempt's reported usage is on its span and in the token metric
    # (the disconnected one reported none: nothing is invented for it).
    assert "gen_ai.usage.input_tokens" not in _attrs(first)
    reported = _attrs(second)
    tokens = {p.attributes["gen_ai.token.type"]: p.sum
              for p in otel.points("gen_ai.client.token.usage")}
    assert tokens == {"input": reported["gen_ai.usage.input_tokens"],
                      "output": reported["gen_ai.usage.output_tokens"]}


async def test_exhausted_stop_and_redelivery_spans(
    provider: FixtureProvider, store: recoverable.RecoveryStore, otel: Otel
) -> None:
    provider.script([Reply.disconnect(after_events=2), Reply.complete({"answer": 1, "note": "a"})])
    async with recoverable.open_runtime(
        store, make_backend(provider), account=ACCOUNT, telemetry=otel.sink
    ) as rt:
        exhausted = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
        with pytest.raises(recoverable.AttemptsExhausted):
            await rt.send_recovering(exhausted, response=Answer, authorize=Authorizer())
        with pytest.raises(recoverable.AttemptsExhausted):  # reopened: stops at once
            await rt.send_recovering(exhausted, response=Answer, authorize=Authorizer())
        done = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
        await rt.send_recovering(done, response=Answer, authorize=Authorizer())
    async with recoverable.open_runtime(
        store, make_backend(provider), account=ACCOUNT, telemetry=otel.sink
    ) as rt:  # another runtime delivers the saved receipt again
        assert await rt.send_recovering(done, response=Answer, authorize=Authorizer()) == (
            Answer(1, "a"))
    assert otel.sink.failed == 0
    by_op: dict[str, list[ReadableSpan]] = {}
    for span in otel.finished():
        if span.name.startswith("send_recovering"):
            by_op.setdefault(_attrs(span)["recoverable.operation.id"], []).append(span)
    first_send, reopened = by_op[exhausted.operation_id]
    for span in (first_send, reopened):
        assert span.status.status_code is StatusCode.ERROR
        assert _attrs(span)["error.type"] == "attempts_exhausted"
        assert _attrs(span)["recoverable.outcome"] == "attempts_exhausted"
    assert _attrs(first_send)["recoverable.attempts"] == 1
    assert _attrs(reopened)["recoverable.attempts"] == 0
    assert reopened.start_time == reopened.end_time
    completed, retrieved = by_op[done.operation_id]
    assert _attrs(completed)["recoverable.outcome"] == "completed"
    assert _attrs(retrieved)["recoverable.outcome"] == "retrieved"
    # A span opened in a runtime that saw no `prepared` event still names the model.
    assert retrieved.name == "send_recovering gpt-test"
    assert otel.total("recoverable.operation.stops",
                      **{"error.type": "attempts_exhausted"}) == 2
    assert otel.total("recoverable.completions") == 1
    assert otel.total("recoverable.attempts") == 2


SECRET_PROMPT = "PROMPT-SECRET-c0ffee11"
SECRET_INSTRUCTIONS = "INSTRUCTIONS-SECRET-5eed"
SECRET_OUTPUT = "OUTPUT-SECRET-deadbeef"
SECRET_ACCOUNT = "ACCOUNT-SECRET-a11ce"
SECRET_SCOPE = "SCOPE-SECRET-b0b0"
SECRET_JOB = "JOB-SECRET-f00d"
SECRET_KEY = "sk-KEY-SECRET-77aa"


async def test_no_prompt_output_account_scope_job_or_key_is_exported(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str, otel: Otel
) -> None:
    account = recoverable.AccountBinding(SECRET_ACCOUNT, "api-key")
    creds = recoverable.StaticCredentials(SECRET_KEY, account=account)
    backend = recoverable.ResponsesBackend(
        provider.http_url, credentials=creds, mode=mode, endpoint_id="fixture"  # type: ignore[arg-type]
    )
    request = recoverable.StructuredRequest(
        model="gpt-test", instructions=SECRET_INSTRUCTIONS, input=SECRET_PROMPT
    )
    provider.script([
        Reply.disconnect(after_events=4),
        Reply.complete({"answer": 3, "note": SECRET_OUTPUT}),
        Reply.http_error(403, {"error": {"type": "invalid_request_error", "code": "forbidden",
                                         "message": SECRET_OUTPUT}}),
    ])
    async with recoverable.open_runtime(store, backend, account=account,
                                        telemetry=otel.sink) as rt:
        ok = await rt.prepare(request, response=Answer, maximum_attempts=3, retry_policy=FAST,
                              scope=SECRET_SCOPE, job_id=SECRET_JOB,
                              input_revision=SECRET_JOB)
        value = await rt.send_recovering(ok, response=Answer, authorize=Authorizer())
        assert value.note == SECRET_OUTPUT
        await rt.acknowledge(ok)
        bad = await rt.prepare(request, response=Answer, maximum_attempts=2,
                               scope=SECRET_SCOPE, job_id=SECRET_JOB)
        with pytest.raises(recoverable.ProviderError):
            await rt.send_recovering(bad, response=Answer, authorize=Authorizer())
    exported = otel.exported_text()
    assert ok.operation_id in exported and bad.operation_id in exported
    assert len(otel.finished()) == 5  # 2 sends, 3 attempts
    for secret in (SECRET_PROMPT, SECRET_INSTRUCTIONS, SECRET_OUTPUT, SECRET_ACCOUNT,
                   SECRET_SCOPE, SECRET_JOB, SECRET_KEY):
        assert secret not in exported, secret


class _BrokenExporter(SpanExporter):
    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        raise RuntimeError("collector unreachable")


class _BrokenProcessor(SpanProcessor):
    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("processor bug")


async def test_a_failing_exporter_never_breaks_an_operation(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    broken = _BrokenExporter()
    otel = Otel(SimpleSpanProcessor(broken), _BrokenProcessor())
    provider.script(
        [Reply.disconnect(after_events=3), Reply.complete({"answer": 5, "note": "fine"})]
    )
    try:
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT, telemetry=otel.sink
        ) as rt:
            handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3,
                                      retry_policy=FAST)
            value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
            status = await rt.status(handle)
        completions = otel.total("recoverable.completions")
    finally:
        otel.tracer_provider.shutdown()
        otel.meter_provider.shutdown()
    assert value == Answer(5, "fine")
    assert status.state == "completed" and status.attempts_used == 2
    assert broken.calls >= 1
    assert otel.sink.failed >= 1  # the processor's exception was swallowed and counted
    assert completions == 1  # metrics still flow
    assert {s.name for s in otel.finished()} == {"send_recovering gpt-test", "chat gpt-test"}


async def test_end_open_spans_closes_a_send_whose_outcome_never_came(
    provider: FixtureProvider, store: recoverable.RecoveryStore, otel: Otel
) -> None:
    async def explode(attempt: recoverable.Attempt) -> bool:
        raise LookupError("host bug")

    async with recoverable.open_runtime(
        store, make_backend(provider), account=ACCOUNT, telemetry=otel.sink
    ) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        with pytest.raises(LookupError):
            await rt.send_recovering(handle, response=Answer, authorize=explode)
    assert otel.finished() == ()
    otel.sink.end_open_spans()
    (span,) = otel.finished()
    assert _attrs(span)["recoverable.outcome"] == "unfinished"
    assert _attrs(span)["recoverable.operation.id"] == handle.operation_id


def _event(name: str, op: str, at: float, **fields: Any) -> TelemetryEvent:
    return TelemetryEvent(name=f"recovery.{name}", event_version=1, operation_id=op,
                          fields=fields, time=at)


def test_token_usage_of_the_usage_event_goes_on_the_attempt_span(otel: Otel) -> None:
    """``recovery.attempt.usage`` (emitted before the attempt's outcome) becomes the
    attempt span's gen_ai.usage.* attributes and the token usage histogram."""
    sink = otel.sink
    sink(_event("attempt.reserved", "op_u", 100.0, attempt=1, reason="initial", model="m-1"))
    sink(_event("attempt.transmission_authorized", "op_u", 100.5, attempt=1))
    sink(_event("attempt.usage", "op_u", 101.9, input_tokens=120, output_tokens=30,
                cached_input_tokens=100, reasoning_tokens=12))
    sink(_event("receipt.saved", "op_u", 102.0, bytes=10))
    assert sink.failed == 0
    chat = next(s for s in otel.finished() if s.name == "chat m-1")
    a = _attrs(chat)
    assert a["gen_ai.usage.input_tokens"] == 120 and a["gen_ai.usage.output_tokens"] == 30
    assert a["gen_ai.usage.cache_read.input_tokens"] == 100
    assert a["gen_ai.usage.reasoning.output_tokens"] == 12
    assert (chat.start_time, chat.end_time) == (100_500_000_000, 102_000_000_000)
    tokens = {p.attributes["gen_ai.token.type"]: p.sum
              for p in otel.points("gen_ai.client.token.usage")}
    assert tokens == {"input": 120, "output": 30}
    (duration,) = otel.points("gen_ai.client.operation.duration")
    assert duration.sum == pytest.approx(1.5)


def test_events_carry_their_emission_time() -> None:
    seen: list[TelemetryEvent] = []
    telemetry = recoverable.telemetry.Telemetry(seen.append)
    before = time.time()
    telemetry.emit("receipt.saved", "op_t", bytes=3)
    telemetry.flush()
    assert before <= seen[0].time <= time.time()
    assert msgspec.json.decode(msgspec.json.encode(seen[0]))["time"] == seen[0].time


def test_without_the_extra_the_import_error_says_how_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['opentelemetry'] = None\n"
        "try:\n"
        "    import recoverable.otel\n"
        "except ImportError as exc:\n"
        "    print(str(exc))\n"
        "import recoverable\n"  # the core library does not need it
        "print('core ok', recoverable.LoggingSink.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)  # generous: a loaded 2-core machine
    assert "pip install 'recoverable[otel]'" in out.stdout
    assert "core ok LoggingSink" in out.stdout


def test_exported_json_is_valid(otel: Otel) -> None:
    otel.sink(_event("operation.stopped", "op_s", 5.0, error="state_expired"))
    (span,) = otel.finished()
    assert json.loads(span.to_json())["attributes"]["error.type"] == "state_expired"


def test_default_providers_are_the_global_ones() -> None:
    """Without arguments the sink uses the global providers (no-op unless the host set
    them): every event is handled, nothing fails."""
    sink = OpenTelemetrySink()
    sink(_event("attempt.reserved", "op_g", 1.0, attempt=1, reason="initial", model="m"))
    sink(_event("attempt.transmission_authorized", "op_g", 1.5, attempt=1))
    sink(_event("attempt.failed", "op_g", 2.0, kind="timeout", http_status=None, code=None))
    sink(_event("operation.waiting", "op_g", 2.0, until=3.0))
    sink(_event("operation.stopped", "op_g", 2.5, error="attempts_exhausted"))
    sink.end_open_spans()
    assert sink.failed == 0


async def test_a_real_send_is_a_child_of_the_caller_s_span_and_carries_its_usage(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str, otel: Otel
) -> None:
    """The operation's spans join the host's trace (its current span when it sent), and
    the usage the provider reported is on the attempt span and in the token metric."""
    provider.script([Reply.complete({"answer": 7, "note": "traced"})])
    tracer = otel.tracer_provider.get_tracer("host")
    async with recoverable.open_runtime(
        store, make_backend(provider, mode), account=ACCOUNT, telemetry=otel.sink
    ) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3, retry_policy=FAST)
        with tracer.start_as_current_span("host request"):
            value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    assert value == Answer(7, "traced")
    assert otel.sink.failed == 0
    spans = otel.finished()
    host = next(span for span in spans if span.name == "host request")
    send = next(span for span in spans if span.name == "send_recovering gpt-test")
    chat = next(span for span in spans if span.name == "chat gpt-test")
    assert host.context is not None and send.context is not None
    assert send.parent is not None and send.parent.span_id == host.context.span_id
    assert send.context.trace_id == host.context.trace_id
    assert chat.parent is not None and chat.parent.span_id == send.context.span_id
    usage = _attrs(chat)
    assert usage["gen_ai.usage.input_tokens"] > 0
    assert usage["gen_ai.usage.output_tokens"] > 0
    tokens = {point.attributes["gen_ai.token.type"]: point.sum
              for point in otel.points("gen_ai.client.token.usage")}
    assert tokens == {"input": usage["gen_ai.usage.input_tokens"],
                      "output": usage["gen_ai.usage.output_tokens"]}


async def test_an_operation_sent_outside_any_span_is_a_root(
    provider: FixtureProvider, store: recoverable.RecoveryStore, otel: Otel
) -> None:
    provider.script([Reply.complete({"answer": 1, "note": "root"})])
    tracer = otel.tracer_provider.get_tracer("host")
    async with recoverable.open_runtime(
        store, make_backend(provider), account=ACCOUNT, telemetry=otel.sink
    ) as rt:
        with tracer.start_as_current_span("prepared under a span"):
            handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    send = next(span for span in otel.finished() if span.name == "send_recovering gpt-test")
    assert send.parent is None  # the span of the send, not of the prepare, decides
