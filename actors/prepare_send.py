"""Prepare and send in one write, for a host that keeps no handle of its own.

A host with a job database of its own prepares an operation, saves the handle in its own
transaction, then sends (docs/host-handoff.md): the prepared operation is a durable
boundary that host observes, and it stays one write. A host that finds a job's operation
by the job's key instead — ``recoverable batch`` — observes nothing between the two: the
operation, its lease and its opening transition (the pending attempt id, still saved
before the host's policy is asked) are one write, :class:`~recoverable.actors.fenced.
Creation` run first by the execution's acquisition. A crash after it leaves what a crash
after the acquisition always left (a leased operation with its pending attempt, nothing
spent); the rerun finds it by the job's key and sends it. When another process prepared
the same job meanwhile, nothing is written and ``fenced.JobAdopted`` names its operation,
for the caller to send that one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs

from recoverable.actors import fenced
from recoverable.actors.checks import require_bound
from recoverable.actors.heartbeat import LeaseKeeper
from recoverable.actors.host import Authorize, Backend
from recoverable.actors.options import PrepareOptions
from recoverable.actors.prepare import admission_for, handle_of
from recoverable.actors.supervisor import Running
from recoverable.types import AccountBinding, Handle, JsonSchema, StructuredRequest

__all__ = ["Admission", "admit", "send_admitted"]


class Runtime(Protocol):
    """What :func:`admit` and :func:`send_admitted` use of the runtime
    (``actors/runtime.py`` implements it)."""

    backend: Backend | None
    account: AccountBinding | None
    signed_out: bool
    selector: Callable[[StructuredRequest], StructuredRequest] | None
    now: Callable[[], float]
    leases: LeaseKeeper

    def start_operation(
        self,
        handle: Handle,
        *,
        response: type[Any] | JsonSchema,
        authorize: Authorize,
        attached: bool = ...,
        create: fenced.Creation | None = ...,
    ) -> Running: ...


@attrs.frozen
class Admission:
    """A new operation checked and frozen, not written yet: its handle, and what its
    execution's acquisition writes first."""

    handle: Handle
    creation: fenced.Creation


def admit(
    rt: Runtime, /, request: StructuredRequest, *, response: type[Any] | JsonSchema,
    **options: Any,
) -> Admission:
    """``prepare``'s checks and frozen body, with nothing written: every typed error
    ``prepare`` raises for these options, raised here."""
    require_bound(rt.account, signed_out=rt.signed_out)
    record, body, stored = admission_for(rt, request, response=response,
                                         options=PrepareOptions(**options))
    return Admission(handle_of(record), fenced.Creation(record, body, stored))


async def send_admitted(
    rt: Runtime, /, admission: Admission, *, response: type[Any] | JsonSchema,
    authorize: Authorize,
) -> Any:
    """``send_recovering`` of an admitted operation, created by its acquisition: its
    validated value, or its typed error; ``fenced.JobAdopted`` (nothing written) when
    another operation already stands for its job."""
    running = rt.start_operation(
        admission.handle, response=response, authorize=authorize, attached=True,
        create=admission.creation,
    )
    return await running.outcome()
