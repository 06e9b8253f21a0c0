"""Privacy-preserving ``recovery.*`` telemetry.

Events carry operational identifiers, counts, selected model/effort and typed
error codes — never prompt or result text, tokens, authorization headers,
account identifiers, host scope/job strings, or provider messages. They are
buffered (bounded; the oldest are dropped and counted) and delivered to the
sink by a runtime task, so a slow or failing sink never blocks or breaks an
operation and can never re-enter one synchronously.

Telemetry is best-effort diagnostics, not the attempt ledger.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import msgspec
import trio
import trio.lowlevel

from recoverable import errors

EVENT_VERSION = 1
_ALLOWED_VALUE = (int, float, bool, type(None))


class TelemetryEvent(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # e.g. "recovery.attempt.failed"
    event_version: int
    operation_id: str
    fields: dict[str, str | int | float | bool | None]
    time: float = 0.0  # POSIX seconds (wall clock) when the event was emitted


class TelemetrySink(Protocol):
    def __call__(self, event: TelemetryEvent) -> None: ...


class LoggingSink:
    """Adapter to the standard ``logging`` module (logger ``recoverable.recovery``)."""

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO) -> None:
        self.logger = logger or logging.getLogger("recoverable.recovery")
        self.level = level

    def __call__(self, event: TelemetryEvent) -> None:
        if self.logger.isEnabledFor(self.level):
            self.logger.log(
                self.level,
                "%s op=%s %s",
                event.name,
                event.operation_id,
                " ".join(f"{name}={value}" for name, value in sorted(event.fields.items())),
                extra={"recovery_event": msgspec.to_builtins(event)},
            )


# String-valued fields that are safe by construction: enumerations and codes.
_SAFE_STRING_FIELDS = frozenset(
    {
        "reason", "kind", "code", "model", "effort", "state", "error", "selection",
        "availability", "previous_operation_id", "successor_id",
        "result",  # reattachment: what the provider answered to a cancel (an enumeration)
    }
)


class Telemetry:
    def __init__(self, sink: TelemetrySink | None, *, capacity: int = 10_000) -> None:
        self._sink = sink
        # A sink may ask to see where each event was emitted, at once, in the emitting
        # task (``capture(operation_id)``: the OpenTelemetry sink keeps the caller's
        # current span as the parent of the operation's spans); events reach ``__call__``
        # later, from the telemetry task.
        self._capture: Callable[[str], None] | None = getattr(sink, "capture", None)
        self._buffer: deque[TelemetryEvent] = deque(maxlen=capacity)
        self._ready = trio.Event()
        self.dropped = 0
        self.failed = 0

    def emit(self, name: str, operation_id: str, **fields: object) -> None:
        if self._sink is None:
            return
        clean: dict[str, str | int | float | bool | None] = {}
        for key, value in fields.items():
            if isinstance(value, _ALLOWED_VALUE):
                clean[key] = value
            elif isinstance(value, str) and key in _SAFE_STRING_FIELDS:
                clean[key] = value[:128]
        capture = self._capture
        if capture is not None:
            try:
                capture(operation_id)
            except Exception:  # a sink never breaks an operation
                self.failed += 1
        if len(self._buffer) == self._buffer.maxlen:
            self.dropped += 1
        self._buffer.append(
            TelemetryEvent(
                name=f"recovery.{name}",
                event_version=EVENT_VERSION,
                operation_id=operation_id,
                fields=clean,
                time=time.time(),
            )
        )
        self._ready.set()

    def emit_stop(self, operation_id: str, error: errors.RecoveryError) -> None:
        names = {
            errors.OperationSuspended: "operation.suspended",
            errors.OperationCancelled: "operation.cancelled",
            errors.AuthenticationRequired: "operation.authentication_required",
        }
        name = names.get(type(error), "operation.stopped")
        self.emit(name, operation_id, error=error.code)

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready = trio.Event()
            self.flush()
            await trio.lowlevel.checkpoint()

    def flush(self) -> None:
        sink = self._sink
        while self._buffer and sink is not None:
            event = self._buffer.popleft()
            try:
                sink(event)
            except Exception:  # a failing sink never breaks an operation
                self.failed += 1
