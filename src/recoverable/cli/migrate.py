"""``recoverable migrate-store SRC DST``: move a store's rows (an LMDB directory's live
operations to PostgreSQL, or back) with ``storage/copy.py``.

SRC must exist and be open in no other process; DST (a directory, created if missing,
or a ``postgresql://`` URL) must be empty. Prints the rows copied per table; a refusal
is exit 1 with the typed reason, a missing source exit 2.
"""

from __future__ import annotations

import argparse
from typing import IO

from recoverable import errors
from recoverable.cli.exits import EXIT_FAILED, EXIT_OK, UsageError
from recoverable.cli.formatting import safe_text
from recoverable.cli.ops import open_store
from recoverable.storage.copy import copy_store
from recoverable.storage.store import RecoveryStore, redact_url

__all__ = ["run_migrate"]


def run_migrate(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    source = open_store(args.source)
    try:
        try:
            destination = RecoveryStore.open(args.destination)
        except errors.RecoveryError as exc:
            raise UsageError(
                f"cannot open the destination {redact_url(args.destination)}: {exc}"
            ) from exc
        try:
            counts = copy_store(source, destination)
        except errors.RecoveryError as exc:
            err.write(f"recoverable migrate-store: {exc.code}: {safe_text(exc)}\n")
            return EXIT_FAILED
        finally:
            destination.close()
    finally:
        source.close()
    total = sum(counts.values())
    details = ", ".join(f"{table} {count}" for table, count in counts.items() if count)
    out.write(
        f"copied {total} rows from {redact_url(args.source)} to "
        f"{redact_url(args.destination)}" + (f" ({details})" if details else "") + "\n"
    )
    return EXIT_OK
