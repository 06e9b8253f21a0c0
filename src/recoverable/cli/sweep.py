"""``recoverable sweep --store DIR [--unclaimed-after S] [--json]``: the full recovery sweep
(``recoverable.actors.sweep``) from the shell, store-wide, and what it did."""

from __future__ import annotations

import argparse
import functools
import time
from typing import IO

import trio

from recoverable import errors
from recoverable.actors.sweep import SweepReport, sweep
from recoverable.cli.exits import EXIT_FAILED, EXIT_OK
from recoverable.cli.formatting import encode_json, safe_text
from recoverable.cli.ops import open_store

__all__ = ["format_sweep", "run_sweep"]


def run_sweep(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    """Run one full sweep of the store; print its report (exit 1 on a typed failure)."""
    store = open_store(args.store)
    try:
        run = functools.partial(
            sweep, store, now=time.time(), unclaimed_after=args.unclaimed_after
        )
        report = trio.run(run)
    except errors.RecoveryError as exc:
        if args.json:
            err.write(encode_json({"error": exc.code, "message": str(exc),
                                   "operation_id": exc.operation_id}))
        else:
            err.write(f"recoverable sweep: {exc.code}: {safe_text(exc)}\n")
        return EXIT_FAILED
    finally:
        store.close()
    out.write(encode_json(report) if args.json else format_sweep(report))
    return EXIT_OK


def format_sweep(report: SweepReport) -> str:
    """The report for people: the counts, then the ids (bounded) by what became of them,
    then the damaged rows."""
    lines = [
        f"sweep: examined {report.examined}, closed {report.closed} (waiting for adoption "
        f"{report.waiting}, failed {report.failed}), of which no_worker {report.unclaimed}, "
        f"live owner {report.live}, changed meanwhile {report.raced}, unreadable "
        f"{report.unreadable}, damaged {report.damaged}"
    ]
    unclaimed = frozenset(report.unclaimed_ids)
    lines += [f"  waiting {safe_text(op_id)}" for op_id in report.waiting_ids]
    lines += [
        f"  failed  {safe_text(op_id)}{' (no_worker)' if op_id in unclaimed else ''}"
        for op_id in report.failed_ids
    ]
    others = sorted(
        set(report.closed_ids) - set(report.waiting_ids) - set(report.failed_ids)
    )
    lines += [f"  closed  {safe_text(op_id)} (stale lease removed)" for op_id in others]
    lines += [f"  damaged {safe_text(row)}" for row in report.damaged_rows]
    if report.ids_truncated:
        lines.append("  (more ids not listed: use the counts)")
    if report.damaged_rows:
        lines.append("damaged rows: no worker would run these operations; nothing was "
                     "changed (abandon them, or restore the store)")
    elif not report.changed:
        lines.append("nothing to close")
    return "\n".join(lines) + "\n"
