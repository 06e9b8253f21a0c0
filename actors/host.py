"""What an operation actor needs from the runtime that supervises it, as Protocols.

The actor (``actors/operation.py``) depends on these, never on the ``Runtime`` class:
the runtime implements :class:`OperationHost`, a transport implements :class:`Backend`
(``ResponsesBackend`` does).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from recoverable.actors.governor import RateGovernor
from recoverable.actors.monitor import LifecycleMonitor
from recoverable.actors.scheduler import Scheduler
from recoverable.storage.base import Store as RecoveryStore
from recoverable.transport.base import Credentials
from recoverable.transport.connect import EndpointGate

from recoverable.outcome import Outcome, Progress
from recoverable.telemetry import Telemetry
from recoverable.types import AccountBinding


class Backend(Protocol):
    """What the runtime needs from a transport (``ResponsesBackend`` implements it)."""

    @property
    def endpoint_id(self) -> str: ...

    @property
    def credentials(self) -> Credentials: ...

    async def stream(
        self,
        body: bytes,
        *,
        attempt_id: str,
        token: str,
        on_progress: Callable[[Progress], None] | None = None,
        before_send: Callable[[], Awaitable[None]] | None = None,
    ) -> Outcome: ...


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
    telemetry: Telemetry
    attempts_consumed: int
    usage_malformed: int

    def endpoint_gate(self, endpoint_id: str) -> EndpointGate: ...
