"""``recoverable source set KEY DIGEST | delete KEY --store DIR [--json]``: update the
store's source manifest from the shell (docs/sources.md).

``set`` makes DIGEST the current digest of source KEY; ``delete`` removes KEY. In the same
transaction every operation bound to another digest of KEY that could still produce a
result, or holds an unacknowledged receipt, becomes ``superseded``. Prints what changed:
the previous and current digest and the superseded operation ids (ids only).
"""

from __future__ import annotations

import argparse
from typing import IO

from recoverable import errors
from recoverable.cli.exits import EXIT_FAILED, EXIT_OK
from recoverable.cli.formatting import encode_json, safe_text
from recoverable.cli.ops import open_store
from recoverable.cli.paging import page
from recoverable.storage.sources import SourceChange

__all__ = ["format_change", "run_source"]


def run_source(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    """Apply one manifest change; print it (exit 1 on a typed failure, nothing changed)."""
    digest: str | None = args.digest if args.source_action == "set" else None
    store = open_store(args.store)
    try:
        change = store.set_source_sync(args.key, digest)
    except errors.RecoveryError as exc:
        if args.json:
            err.write(encode_json({"error": exc.code, "message": str(exc),
                                   "operation_id": exc.operation_id}))
        else:
            err.write(f"recoverable source {args.source_action}: {exc.code}: {safe_text(exc)}\n")
        return EXIT_FAILED
    finally:
        store.close()
    superseded = page(change.superseded, str, limit=args.limit)
    unreadable = page(change.unreadable, str, limit=args.limit)
    if args.json:
        out.write(encode_json({
            "key": change.key, "previous": change.previous, "current": change.current,
            "superseded": list(superseded.items), "superseded_total": superseded.total,
            "unreadable": list(unreadable.items), "unreadable_total": unreadable.total,
        }))
    else:
        out.write(format_change(change, limit=args.limit))
    return EXIT_OK


def format_change(change: SourceChange, *, limit: int = 0) -> str:
    """The change for people: the digests, then the superseded ids (at most ``limit`` of
    each list: ``cli/paging.py``; 0: all)."""
    now = "deleted" if change.current is None else safe_text(change.current)
    was = "none" if change.previous is None else safe_text(change.previous)
    lines = [
        f"source {safe_text(change.key)}: {was} -> {now}; superseded "
        f"{len(change.superseded)} operation(s)"
    ]
    for what, ids, note in (("superseded", change.superseded, ""),
                            ("unreadable", change.unreadable, " (left as is)")):
        shown = page(ids, str, limit=limit)
        lines += [f"  {what} {safe_text(op_id)}{note}" for op_id in shown.items]
        if shown.more:
            lines.append(f"  ... and {shown.more} more {what} (--limit 0 shows all)")
    return "\n".join(lines) + "\n"
