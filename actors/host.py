"""What an operation actor needs from the runtime that supervises it, as Protocols.

An execution (``actors/execution.py``) depends on these, never on the ``Runtime`` class:
the runtime implements :class:`OperationHost`, a transport implements :class:`Backend`
(``ResponsesBackend`` does).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal, Protocol, runtime_checkable

from recoverable.actors.governor import RateGovernor
from recoverable.actors.heartbeat import LeaseKeeper
from recoverable.actors.monitor import LifecycleMonitor
from recoverable.actors.scheduler import Scheduler
from recoverable.outcome import Outcome, Progress, Usage
from recoverable.storage.base import Store as RecoveryStore
from recoverable.telemetry import Telemetry
from recoverable.transport.base import Credentials, Streams
from recoverable.transport.connect import EndpointGate
from recoverable.types import AccountBinding, Attempt

# The host's authorization of one attempt: ``True`` approves it (sync or async).
Authorize = Callable[[Attempt], Awaitable[bool] | bool]


class Backend(Streams, Protocol):
    """What the runtime needs from a transport (``ResponsesBackend`` implements it):
    ``stream`` (``transport.base.Streams``) and the endpoint and credentials it serves."""

    @property
    def endpoint_id(self) -> str: ...

    @property
    def credentials(self) -> Credentials: ...


@runtime_checkable
class ReattachBackend(Streams, Protocol):
    """Reattachment: what a backend offers for background responses (``ResponsesBackend``'s
    ``reattachment``, a ``transport.resume.ReattachClient``): ``stream`` a background
    body, ``resume`` and ``cancel`` it by response id."""

    async def resume(
        self,
        response_id: str,
        *,
        after: int | None,
        attempt_id: str,
        token: str,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> Outcome: ...

    async def cancel(
        self, response_id: str, *, token: str
    ) -> Literal["cancelled", "ended", "gone", "failed"]: ...


def reattach_client(backend: object) -> ReattachBackend | None:
    """The backend's reattachment client, or ``None`` when it has none."""
    client = getattr(backend, "reattachment", None)
    return client if isinstance(client, ReattachBackend) else None


class OperationHost(Protocol):
    """The runtime, as an operation actor sees it: its store, backend, account, clock,
    shared actors (scheduler, monitor, governor), telemetry and counters."""

    store: RecoveryStore
    backend: Backend | None
    account: AccountBinding | None
    now: Callable[[], float]
    scheduler: Scheduler
    monitor: LifecycleMonitor
    governor: RateGovernor
    leases: LeaseKeeper  # the heartbeat that renews this runtime's leases
    telemetry: Telemetry
    attempts_consumed: int
    usage_malformed: int
    reattachments: int  # resume GETs this runtime finished (an outcome read)

    def endpoint_gate(self, endpoint_id: str) -> EndpointGate: ...


def count_usage(
    host: OperationHost, operation_id: str, usage: Usage | None, malformed: bool
) -> None:
    """Telemetry for an attempt's reported usage: token counts only (never text)."""
    if malformed:
        host.usage_malformed += 1
        host.telemetry.emit("attempt.usage_malformed", operation_id)
    if usage is not None:
        host.telemetry.emit(
            "attempt.usage", operation_id,
            input_tokens=usage.input_tokens,
            cached_input_tokens=usage.cached_input_tokens,
            output_tokens=usage.output_tokens,
            reasoning_tokens=usage.reasoning_tokens,
        )
