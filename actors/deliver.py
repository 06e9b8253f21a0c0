"""Delivering the receipt: the step of ``machine.Deliver``.

The completion was validated and saved (fenced) before this step runs; it is decoded with
the caller's type and returned. A cancel seen meanwhile, or a sign-out, delivers nothing
(the receipt stays saved for its own account). A missing receipt is never permission to
regenerate: it fails closed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from recoverable import errors, machine
from recoverable.actors.execution import Execution
from recoverable.records import OperationRecord
from recoverable.storage.migration import saved_completion

__all__ = ["deliver"]


async def deliver(execution: Execution, current: OperationRecord) -> Any:
    host = execution.host
    operation_id = execution.operation_id
    watch = execution.watching()
    if watch.command == "cancel":
        await execution.advance(lambda _: machine.command_observed(current, "cancel"))
        raise errors.OperationCancelled(operation_id=operation_id)
    if watch.account_stop is not None or host.account != current.account:
        # Signed out (or switched) while the receipt was being saved: it stays saved for
        # its own account and is delivered to nobody now.
        error = errors.AccountChanged(
            "signed out" if host.account is None else "account changed",
            operation_id=operation_id,
        )
        host.telemetry.emit_stop(operation_id, error)
        raise error
    payload = execution.payload
    if payload is None:
        # A version-1 record delivered by a runtime that did not upgrade it (no backend)
        # keeps its completion inline: read it from there.
        payload = saved_completion(host.store, current)
        if payload is None:
            # Fail closed: a missing receipt is never permission to regenerate.
            raise errors.CompletionUnavailable(
                "the saved completion is missing", operation_id=operation_id
            )
        host.telemetry.emit("receipt.retrieved", operation_id)
    try:
        return execution.contract.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise errors.FormatMismatch(
            "the saved completion does not decode with the requested type",
            operation_id=operation_id,
        ) from exc
