"""An operation's execution, run: the loop over the machine's actions.

:func:`run` takes the operation's lease (``Execution.acquire``), loops *machine step ->
fenced save -> action* until the machine delivers or stops, and releases the lease only
after everything has unwound. Each action is one step function that takes the execution:
``WaitUntil`` waits on the scheduler (here), ``AskHost`` asks the host and sends
(``actors/authorize.py`` -> ``actors/send.py``), ``Reattach`` resumes a background
response (``actors/reattach.py``), ``Deliver`` decodes the receipt
(``actors/deliver.py``). Every blocking step runs inside the monitor's cancel scope, and
the whole loop inside the heartbeat's (the lease lost: ``LeaseLost``). It runs as a task
of the runtime's supervisor nursery (``actors/supervisor.py``); a Trio cancellation of
that task (its last caller went away, or the runtime closed) suspends the operation.
"""

from __future__ import annotations

import functools
from typing import Any

from recoverable import errors, machine
from recoverable.actors.authorize import ask_host
from recoverable.actors.deliver import deliver
from recoverable.actors.execution import Cut, Execution
from recoverable.actors.reattach import cancel_on_server, reattach
from recoverable.actors.supervisor import is_cancellation

__all__ = ["run"]


async def run(execution: Execution) -> Any:
    """The whole execution: its value, or its typed error raised."""
    try:
        opening = await execution.acquire()
        try:
            with execution.guard.scope:  # cancelled by the heartbeat: the lease is lost
                return await _drive(execution, opening)
            raise await execution.lease_lost()
        except BaseException as exc:
            if is_cancellation(exc):
                await execution.suspend_on_cancel()
            raise
    finally:
        await execution.release()
        # The last attempt points back at its execution: cut the pair here, so both go
        # with their last reference instead of waiting for the full collector.
        execution.sending = None


async def _drive(execution: Execution, transition: machine.Transition) -> Any:
    op_id = execution.operation_id
    host = execution.host
    telemetry = host.telemetry
    while True:
        current = transition.record
        match transition.action:
            case machine.Stop(error=error):
                telemetry.emit_stop(op_id, error)
                if current.reattach and isinstance(
                    error, (errors.OperationCancelled, errors.OperationSuperseded)
                ):
                    await cancel_on_server(host, current)  # best effort
                raise error
            case machine.Deliver():
                return await deliver(execution, current)
            case _ if execution.watching().account_stop is not None:
                # Signed out or switched between two steps: stop before the next one.
                transition = await execution.on_stop(current)
            case machine.WaitUntil(at=at):
                # Nothing is in flight while it waits (its attempt's end is saved): the
                # ended attempt need not stay parked with it (see the end of ``run``).
                execution.sending = None
                telemetry.emit("operation.waiting", op_id, until=at)
                waited = await execution.interruptible(host.scheduler.wait_until(at))
                if isinstance(waited, Cut):
                    transition = await execution.on_stop(current)
                else:
                    transition = await execution.advance(
                        functools.partial(execution.wake, current)
                    )
            case machine.AskHost(attempt=attempt):
                transition = await ask_host(execution, current, attempt)
            case machine.Reattach() as action:  # no new POST, no budget
                transition = await reattach(execution, current, action)
            case _:
                raise machine.InvalidTransition(f"no action after {current.phase}")
