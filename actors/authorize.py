"""Asking the host to authorize an attempt: the step of ``machine.AskHost``.

The pending attempt's id is saved before the host is asked (the machine's rule: a host's
own authorization record and ours agree after a crash). The host's answer runs inside the
monitor's cancel scope; only ``True`` authorizes. An approved attempt's token is fetched
(nothing spent if that fails) and the approval is rechecked (lifecycle, account, expiry,
budget) before connecting: the same recheck is repeated, atomically, when the attempt is
consumed (``actors/send.py``).
"""

from __future__ import annotations

import functools
import inspect

import trio

from recoverable import _killpoints, errors, machine
from recoverable.actors.execution import Cut, Execution
from recoverable.actors.send import transmit
from recoverable.records import OperationRecord
from recoverable.transport.base import validate_api_key
from recoverable.types import Attempt

__all__ = ["ask_host"]


async def ask_host(
    execution: Execution, current: OperationRecord, attempt: Attempt
) -> machine.Transition:
    host = execution.host
    operation_id = execution.operation_id
    _killpoints.hit("attempt.pending_saved")
    host.telemetry.emit("attempt.reserved", operation_id, attempt=attempt.number,
                        reason=attempt.reason, model=current.model)

    try:
        # A callback exception escapes unchanged: nothing spent, no renewal, no retry.
        reply = execution.authorize(attempt)
        if inspect.isawaitable(reply):
            # An ``async def`` may block: it runs in the monitor's scope (a command cuts it).
            approved: object = await execution.interruptible(reply)
        else:
            # A plain ``def`` ran inline: nothing could interrupt it, so no scope of its own
            # (the recheck before connecting and the one at consumption still see a command).
            approved = reply
        if not isinstance(approved, Cut) and type(approved) is not bool:
            # Only True authorizes; "yes" is a host defect.
            raise errors.AuthorizationFailed(
                f"it returned {type(approved).__name__}", operation_id=operation_id,
                attempt_id=attempt.attempt_id,
            )
    except Exception as exc:
        if not execution.standing_policy:
            raise
        # A worker's policy: nobody would hear the error, so it is saved (nothing spent).
        detail = (
            exc.args[0] if isinstance(exc, errors.AuthorizationFailed)
            else f"it raised {type(exc).__name__}"
        )
        failed = await execution.advance(
            lambda _: machine.authorization_failed(current, attempt.attempt_id, detail)
        )
        assert isinstance(failed.action, machine.Stop)
        host.telemetry.emit_stop(operation_id, failed.action.error)
        raise failed.action.error from exc
    if isinstance(approved, Cut) or execution.watching().account_stop is not None:
        # A late answer after a sign-out authorizes nothing (nothing is spent).
        return await execution.on_stop(current)
    token: str | None = None
    if approved:
        backend = host.backend
        if backend is None:
            raise errors.ConfigurationUnavailable(
                "no backend: this runtime can only read receipts",
                operation_id=current.operation_id,
            )
        renew = attempt.reason == "authentication_reissue"
        try:
            token = await backend.credentials.token(renew=renew)
        except trio.Cancelled:
            raise
        except Exception as exc:  # renewal unavailable: a sign-in blocker, nothing spent
            if not renew:
                raise
            blocked = await execution.advance(
                lambda _: machine.credentials_unavailable(current, attempt.attempt_id)
            )
            host.telemetry.emit("operation.authentication_required", operation_id)
            assert isinstance(blocked.action, machine.Stop)
            raise blocked.action.error from exc
    if execution.watching().account_stop is not None:
        return await execution.on_stop(current)  # signed out while fetching the token
    if not approved:
        return await execution.advance(
            lambda command: machine.authorization_answered(
                current, attempt.attempt_id, False, execution.context(command)
            )
        )
    assert token is not None
    # A token that cannot be sent in a header is a typed error before anything is spent.
    validate_api_key(token, what="the credentials' token")
    # Recheck now (lifecycle, account, expiry, budget): connect only for an attempt that
    # could be consumed. The same check is repeated, atomically, at consumption.
    approve = functools.partial(execution.approved, current, attempt.attempt_id)
    if not isinstance(approve(execution.watching().command).action, machine.Transmit):
        return await execution.advance(approve)
    return await transmit(execution, current, attempt.attempt_id, token)
