"""The store commands: ``status|inventory|receipt|acknowledge|abandon|suspend|cancel|
retry|purge --store DIR``, always within the account given by ``--account``."""

from __future__ import annotations

import argparse
import json
import os
from typing import IO, Any, Final

import msgspec
import trio

from recoverable import errors
from recoverable.actors.checks import require_owner
from recoverable.actors.runtime import Runtime, open_runtime
from recoverable.cli.arguments import NEEDS_ACCOUNT
from recoverable.cli.exits import EXIT_FAILED, EXIT_OK, UsageError
from recoverable.cli.formatting import (
    encode_json,
    format_inventory,
    format_receipt,
    format_status,
    printable_inventory,
    receipt_json,
    safe_text,
)
from recoverable.cli.paging import page
from recoverable.records import CommandRecord, OperationRecord
from recoverable.storage.store import RecoveryStore, redact_url, url_scheme
from recoverable.transport.base import StaticCredentials
from recoverable.types import AccountBinding, Handle, Inventory, Status

__all__ = ["NoGeneration", "open_store", "resolve_account", "run_ops"]

_TARGET_STATE: Final = {
    "acknowledge": "acknowledged",
    "abandon": "abandoned",
    "suspend": "suspended",
    "cancel": "cancelled",
}


def resolve_account(explicit: str | None) -> AccountBinding | None:
    """``--account`` only: a command never borrows the operation's own account."""
    return AccountBinding(explicit, "api-key") if explicit is not None else None


def run_ops(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    """Run one store command; return its exit code (a usage error is raised)."""
    command: str = args.command
    account = resolve_account(args.account)
    if account is None and command in NEEDS_ACCOUNT:  # argparse requires it already
        raise UsageError(f"{command} acts within one account: pass --account ID")
    store = open_store(args.store)
    try:
        operation_id: str | None = getattr(args, "operation_id", None)
        if operation_id is not None:
            _check_exists(store, operation_id)
        if command == "purge":
            assert account is not None
            return _purge(store, account, args, out, err)
        return trio.run(_StoreCommand(store, account, args, out, err).run)
    finally:
        store.close()


def open_store(path: str) -> RecoveryStore:
    """The store at ``path`` (a directory, or a ``postgresql://`` URL); a missing or
    unopenable store is a usage error (exit 2). A URL is named redacted in errors."""
    is_url = url_scheme(path) is not None
    if not is_url and (
        not os.path.isdir(path) or not os.path.exists(os.path.join(path, "data.mdb"))
    ):
        raise UsageError(f"no recovery store at {redact_url(path)}")  # a pasted password=
    try:
        return RecoveryStore.open(path)
    except errors.RecoveryError as exc:
        where = "the PostgreSQL store" if is_url else f"the store at {path}"
        raise UsageError(f"cannot open {where}: {exc}") from exc


def _check_exists(store: RecoveryStore, operation_id: str) -> None:
    """An id that is not in the store at all is a usage error (exit code 2)."""
    try:
        if store.get_operation(operation_id) is not None:
            return
        if store.get_disposition(operation_id) is not None:
            return
    except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
        return  # it exists; the command reports what it can
    except errors.InvalidRequest as exc:
        raise UsageError(str(exc), operation_id=operation_id) from exc
    raise UsageError(f"no operation {operation_id} in this store", code="state_unavailable",
                     operation_id=operation_id)


class NoGeneration:
    """The backend of ``recoverable retry``: it names the endpoint the successor is
    bound to (the source's) and can never send anything."""

    def __init__(self, endpoint_id: str, account: AccountBinding) -> None:
        self.endpoint_id = endpoint_id
        self.credentials = StaticCredentials("unused-by-the-cli", account=account)

    async def stream(self, body: bytes, **_: Any) -> Any:
        raise errors.ConfigurationUnavailable("the command line never generates")


class _StoreCommand:
    """One store command (all but ``purge``), run over a runtime on the store."""

    def __init__(
        self,
        store: RecoveryStore,
        account: AccountBinding | None,
        args: argparse.Namespace,
        out: IO[str],
        err: IO[str],
    ) -> None:
        self.store = store
        self.account = account
        self.args = args
        self.command: str = args.command
        self.operation_id: str | None = getattr(args, "operation_id", None)
        self.as_json: bool = args.json
        self.out = out
        self.err = err

    async def run(self) -> int:
        backend: NoGeneration | None = None
        if self.command == "retry":
            assert self.account is not None and self.operation_id is not None
            source = self.store.get_operation(self.operation_id)
            if source is not None:
                backend = NoGeneration(source.endpoint_id, self.account)
        async with open_runtime(self.store, backend, account=self.account) as rt:
            try:
                if self.command == "retry" and backend is None:
                    raise errors.StateUnavailable(
                        "the operation is already disposed", operation_id=self.operation_id
                    )
                return await self._dispatch(rt)
            except errors.RecoveryError as exc:
                if self.as_json:
                    self.err.write(json.dumps({"error": exc.code, "message": str(exc),
                                               "operation_id": exc.operation_id}) + "\n")
                else:
                    self.err.write(f"recoverable {self.command}: {exc.code}: {safe_text(exc)}\n")
                return EXIT_FAILED

    async def _dispatch(self, rt: Runtime) -> int:
        if self.command == "inventory":
            inventory = await rt.inventory(scope=self.args.scope)
            shown = page(inventory.operations, _operation_id, limit=self.args.limit,
                         after=self.args.after)
            unreadable = page(inventory.unreadable, str, limit=self.args.limit)
            paged = Inventory(operations=shown.items, unreadable=unreadable.items)
            # Acknowledged and abandoned operations are gone; their markers are counted.
            removed = {"acknowledged": 0, "abandoned": 0}
            for marker in rt.store.dispositions(account=rt.account, scope=self.args.scope):
                removed[marker.disposition] += 1
            if self.as_json:
                self.out.write(encode_json({
                    **msgspec.to_builtins(printable_inventory(paged)),
                    "total": shown.total, "unreadable_total": unreadable.total,
                    "next_after": shown.next_after, "removed": removed,
                }))
            else:
                self.out.write(format_inventory(
                    paged, total=shown.total, next_after=shown.next_after,
                    unreadable_total=unreadable.total, removed=removed,
                ))
            return EXIT_OK
        operation_id = self.operation_id
        assert operation_id is not None
        handle = Handle(operation_id)
        before: Snapshot = (None, None)
        requested = False  # a suspend or cancel requested of the process that runs it
        match self.command:
            case "retry":
                return await self._retry(rt, operation_id)
            case "status":
                status = await rt.status(handle)
                self.out.write(encode_json(status) if self.as_json else format_status(status))
                if status.redacted and not self.as_json and self.account is None:
                    self.err.write("recoverable status: redacted: pass --account ID (the "
                                   "operation's account) to see its details\n")
                return EXIT_OK
            case "receipt":
                receipt = await rt.receipt(handle)
                self.out.write(receipt_json(receipt) if self.as_json else format_receipt(receipt))
                return EXIT_OK
            case "acknowledge":
                await rt.acknowledge(handle)
            case "abandon":
                await rt.abandon(handle)
            case "suspend":
                before = _snapshot(rt, operation_id)
                requested = await rt._command(operation_id, "suspend")
            case "cancel":
                if not self.args.force:
                    refusal = _cancel_refusal(rt, operation_id)
                    if refusal is not None:
                        raise UsageError(
                            refusal, code="completion_saved", operation_id=operation_id
                        )
                before = _snapshot(rt, operation_id)
                requested = await rt._command(operation_id, "cancel")
        status = rt.status_of(operation_id)
        if self.as_json:
            self.out.write(encode_json(status))
        else:
            self.out.write(_lifecycle_message(self.command, operation_id, status))
            if self.command in ("suspend", "cancel"):
                self.out.write(_command_outcome(rt, self.command, operation_id, status,
                                                before, requested))
        return EXIT_OK

    async def _retry(self, rt: Runtime, operation_id: str) -> int:
        record = rt.store.get_operation(operation_id)
        if record is not None:
            # The account first (fail closed): another account's operation is account_changed,
            # never a budget read from its redacted status.
            require_owner(rt.account, record.account, operation_id)
        source = rt.status_of(operation_id)
        successor = await rt.retry(
            Handle(operation_id),
            retry_action_id=self.args.action_id,
            maximum_attempts=self.args.max_attempts or source.maximum_attempts,
            selection=self.args.selection,
        )
        status = rt.status_of(successor.operation_id)
        if self.as_json:
            self.out.write(encode_json(status))
        else:
            self.out.write(
                f"retry: {successor.operation_id} is the successor of {operation_id} "
                f"({status.maximum_attempts} attempt(s), selection {self.args.selection}); "
                "nothing was sent. A rerun of the batch runs the successor for this job.\n"
            )
        return EXIT_OK


def _lifecycle_message(command: str, operation_id: str, status: Status) -> str:
    """What happened to the operation, truthfully (acknowledge, abandon, or a suspend or
    cancel that took effect: the rest is :func:`_command_outcome`)."""
    if status.state == _TARGET_STATE[command]:
        return f"{command}: {operation_id} is now {status.state}\n"
    return ""


Snapshot = tuple[OperationRecord | None, CommandRecord | None]


def _snapshot(rt: Runtime, operation_id: str) -> Snapshot:
    try:
        return rt.store.get_operation(operation_id), rt.store.get_command(operation_id)
    except errors.RecoveryError:
        return None, None


def _command_outcome(rt: Runtime, command: str, operation_id: str, status: Status,
                     before: Snapshot, requested: bool) -> str:
    """What a suspend or cancel really did: ``requested`` of the process that runs
    it (a command row it applies at its next check: the write says so; the row may be
    gone already, applied by that process); nothing at all (a completed or failed
    operation has nothing to suspend); and what it did to the continuation successor
    dispatched after it, if any."""
    record, _ = _snapshot(rt, operation_id)
    lines: list[str] = []
    if status.state != _TARGET_STATE[command]:
        if requested:
            lines.append(
                f"{command}: requested; {operation_id} is {status.state} in another process, "
                f"which applies the {command} at its next check (see `recoverable status`)")
        elif record is not None and record != before[0]:
            lines.append(f"{command}: {operation_id} is {status.state}; its pending "
                         "continuation was cancelled")
        else:
            lines.append(f"{command}: nothing to {command}: {operation_id} is {status.state}; "
                         "nothing was recorded")
    decided = record.continuation if record is not None else None
    successor_id = decided.successor_id if decided is not None else None
    if decided is not None and decided.state == "dispatched" and successor_id is not None:
        successor = rt.status_of(successor_id)
        pending = rt.store.get_command(successor_id)
        done = (f"requested ({successor.state} in another process)"
                if pending is not None and successor.state != _TARGET_STATE[command]
                else f"{successor.state}")
        lines.append(f"{command}: its continuation successor {successor_id} is {done}")
    return "".join(line + "\n" for line in lines)


def _cancel_refusal(rt: Runtime, operation_id: str) -> str | None:
    """Cancel fences delivery: a saved, validated (paid) result would never be delivered."""
    try:
        status = rt.status_of(operation_id)
    except errors.RecoveryError:
        return None  # the cancel itself reports it
    if not status.has_saved_completion:
        return None
    return (
        f"{operation_id} has a saved, validated result: after cancel it is never delivered "
        "(`receipt` refuses it; its content stays in the store until `abandon` removes it). "
        "Read it with `recoverable receipt` (then acknowledge), or pass --force to cancel "
        "anyway"
    )


def _purge(
    store: RecoveryStore,
    account: AccountBinding,
    args: argparse.Namespace,
    out: IO[str],
    err: IO[str],
) -> int:
    try:
        result = store.purge_account(account, scope=args.scope)
    except errors.RecoveryError as exc:
        err.write(f"recoverable purge: {exc.code}: {safe_text(exc)}\n")
        return EXIT_FAILED
    if args.json:
        out.write(encode_json(result))
    else:
        out.write(f"purged {len(result.removed)} record(s) of account {account.account_id!r}")
        out.write(f"; skipped {len(result.skipped)} (busy or unreadable)\n"
                  if result.skipped else "\n")
        for op_id in result.skipped:
            out.write(f"  skipped {safe_text(op_id)}\n")
    return EXIT_OK


def _operation_id(status: Status) -> str:
    return status.operation_id
