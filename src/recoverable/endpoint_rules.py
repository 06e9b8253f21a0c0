"""An operation and its endpoint: the saved endpoint's check at open, and the two events
of an endpoint that cannot be connected to. Pure functions over records; no I/O.

- :func:`endpoint_refusal`: an operation runs only against the endpoint it was prepared
  for; another one is ``ConfigurationUnavailable`` (``send_recovering`` at open, and
  ``recoverable batch --workers N`` before it waits for a job no worker of its endpoint
  would ever claim).
- :func:`endpoint_unreachable`: connecting for the approved attempt failed; nothing sent.
- :func:`endpoint_given_up`: it kept failing past the runtime's bound
  (``open_runtime(unreachable_after=)``): the execution ends, nothing spent.

``recoverable.machine`` re-exports them.
"""

from __future__ import annotations

from recoverable import errors
from recoverable.lifecycle import apply_command
from recoverable.preconditions import endpoint_blocked
from recoverable.records import CommandKind, OperationRecord
from recoverable.transitions import Transition, evolve, idle_phase, moved, require_pending, stopped

__all__ = ["endpoint_given_up", "endpoint_refusal", "endpoint_unreachable"]


def endpoint_refusal(
    rec: OperationRecord, endpoint_id: str | None
) -> errors.ConfigurationUnavailable | None:
    """The error of running ``rec`` against ``endpoint_id`` (None: it may run there, or
    no backend judges it). Checked at open after the saved outcomes (a receipt, a terminal
    failure), which are delivered whatever the endpoint."""
    if not endpoint_blocked(rec, endpoint_id):
        return None
    return errors.ConfigurationUnavailable(
        "the operation was prepared for another endpoint", operation_id=rec.operation_id
    )


def endpoint_unreachable(rec: OperationRecord, attempt_id: str, kind: str) -> Transition:
    """Connecting for the approved pending attempt failed before anything was sent.

    Nothing is spent: the phase stays ``authorizing`` with the same pending attempt id
    (the driver waits in the runtime's shared connect backoff and tries again); the
    typed kind is recorded so that status reads ``endpoint_unavailable``, also from
    another process and after this execution ends.
    """
    require_pending("endpoint_unreachable", rec, attempt_id)
    return moved(rec, evolve(rec, endpoint_failure=kind), None)


def endpoint_given_up(
    rec: OperationRecord, attempt_id: str, kind: str, seconds: float,
    command: CommandKind | None,
) -> Transition:
    """The endpoint stayed unreachable past the runtime's bound (``unreachable_after``):
    the execution ends with ``EndpointUnavailable``. Nothing was spent: the record rests
    as before the host was asked (``prepared``, or ``waiting`` once an attempt was spent),
    with its pending attempt id and the connect failure kept (the next execution asks for
    the same attempt). A lifecycle command standing at that moment applies instead."""
    require_pending("endpoint_given_up", rec, attempt_id)
    idle = evolve(rec, phase=idle_phase(rec), endpoint_failure=kind)
    if command is not None:
        return apply_command(idle, command)
    return stopped(rec, idle, errors.EndpointUnavailable(
        operation_id=rec.operation_id, kind=kind, unreachable_after=seconds
    ))
