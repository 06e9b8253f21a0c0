"""``recoverable retry|cancel|suspend|acknowledge|abandon --filter ... (--dry-run|--yes)``:
one action over every operation a filter selects, with the dashboard's function
(``cli/bulk.py``): the selection from one summary of the store, the per-operation rules,
the per-operation library call, and a summary of what was done and refused, and why.

``--dry-run`` prints the preview (how many, which, what the rules refuse now) and does
nothing; ``--yes`` acts. Exit code 0 when it ran (refusals are reported, not failures:
the summary and ``--json`` say how many), 2 for a usage error (a bad filter, neither or
both of ``--dry-run`` and ``--yes``, an OPERATION_ID and ``--filter`` together).
"""

from __future__ import annotations

import argparse
import json
import secrets
from typing import IO, Final

import trio

from recoverable import errors
from recoverable.actors.runtime import open_runtime
from recoverable.cli.bulk import (
    BULK_ACTIONS,
    BulkAction,
    BulkOptions,
    act_on_many,
    preview,
    selection_of,
)
from recoverable.cli.exits import EXIT_OK, UsageError
from recoverable.cli.formatting import safe_text
from recoverable.cli.ops import open_store, resolve_account
from recoverable.cli.selection import Filter, parse_filter_text
from recoverable.dashboard.actions import ACTION_ID
from recoverable.dashboard.data import build_summary
from recoverable.storage.store import RecoveryStore
from recoverable.telemetry import TelemetryEvent

__all__ = ["is_bulk", "run_bulk"]

LISTED: Final = 20  # ids printed per list in the human output (--json lists them all)


def is_bulk(args: argparse.Namespace) -> bool:
    """Whether the command names a filter (or bulk-only flags) rather than one id."""
    if getattr(args, "filter", None) is not None:
        if getattr(args, "operation_id", None) is not None:
            raise UsageError("give OPERATION_ID or --filter, not both")
        if not (args.dry_run or args.yes):
            raise UsageError("--filter acts on many operations: pass --dry-run to see which, "
                             "or --yes to act")
        return True
    if args.command in BULK_ACTIONS:
        if getattr(args, "operation_id", None) is None:
            raise UsageError(f"{args.command} needs OPERATION_ID or --filter KEY=VALUE,...")
        if args.dry_run or args.yes:
            raise UsageError("--dry-run and --yes go with --filter")
    return False


def _drop(event: TelemetryEvent) -> None:
    """The CLI's telemetry: none (as its single-operation commands)."""


def _action(command: str) -> BulkAction:
    found = next((action for action in BULK_ACTIONS if action == command), None)
    assert found is not None
    return found


def run_bulk(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    account = resolve_account(args.account)
    if account is None:
        raise UsageError(f"{args.command} acts within one account: pass --account ID")
    if args.action_id is not None and ACTION_ID.fullmatch(args.action_id) is None:
        raise UsageError("--action-id: 8..100 of A-Z a-z 0-9 _ - (with --filter)")
    try:
        chosen = parse_filter_text(args.filter)
    except errors.InvalidRequest as exc:
        raise UsageError(str(exc)) from None
    store = open_store(args.store)
    try:
        return trio.run(_run, store, args, chosen, out, err)
    finally:
        store.close()


async def _run(store: RecoveryStore, args: argparse.Namespace, chosen: Filter, out: IO[str],
               err: IO[str]) -> int:
    action = _action(args.command)
    options = BulkOptions(
        selection=getattr(args, "selection", "preserve"),
        max_attempts=getattr(args, "max_attempts", None),
        force=bool(getattr(args, "force", False)),
    )
    action_id = args.action_id or "cli-" + secrets.token_urlsafe(12)
    account = resolve_account(args.account)
    summary = await trio.to_thread.run_sync(build_summary, store)
    ids = selection_of(summary, chosen)
    async with open_runtime(store, None, account=account) as runtime:
        if args.dry_run:
            seen = await trio.to_thread.run_sync(preview, runtime, store, ids, action, options)
            if args.json:
                out.write(json.dumps({
                    "dry_run": True, "action": action, "filter": chosen.params(),
                    "selected": len(ids), "allowed": seen.allowed,
                    "refused": len(seen.refused), "operation_ids": list(ids),
                    "reasons": [{"reason": reason, "operations": count}
                                for reason, count in seen.reasons()],
                }, sort_keys=True) + "\n")
                return EXIT_OK
            out.write(f"{action} (dry run, nothing done): {len(ids)} operation(s) match "
                      f"{chosen.describe()}; {seen.allowed} allowed now, {len(seen.refused)} "
                      "refused\n")
            for reason, count in seen.reasons():
                out.write(f"  refused {count}: {safe_text(reason)}\n")
            refused = dict(seen.refused)
            for operation_id in ids[:LISTED]:
                out.write(f"  {safe_text(operation_id)}"
                          f"{'  (refused)' if operation_id in refused else ''}\n")
            if len(ids) > LISTED:
                out.write(f"  ... and {len(ids) - LISTED} more (--json lists them all)\n")
            return EXIT_OK
        result = await act_on_many(runtime, store, ids, action, options, action_id=action_id,
                                   telemetry=_drop)
    if args.json:
        out.write(json.dumps({**result.counts(), "filter": chosen.params(),
                              "done_ids": [op_id for op_id, _ in result.done],
                              "refused_ids": [op_id for op_id, _, _ in result.refused]},
                             sort_keys=True) + "\n")
        return EXIT_OK
    out.write(f"{action} (action id {action_id}): {len(result.done)} done, "
              f"{len(result.refused)} refused, of {result.selected} matching "
              f"{chosen.describe()}\n")
    for reason, count in result.reasons():
        out.write(f"  refused {count}: {safe_text(reason)}\n")
    for _operation_id, text in result.done[:LISTED]:
        out.write(f"  {safe_text(text)}\n")
    if len(result.done) > LISTED:
        out.write(f"  ... and {len(result.done) - LISTED} more done (--json lists them all)\n")
    if result.refused and not result.done:
        err.write(f"recoverable {action}: nothing done: every selected operation was "
                  "refused\n")
    return EXIT_OK
