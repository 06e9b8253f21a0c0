"""``recoverable db upgrade --store URL``: bring a PostgreSQL store's schema up to date.

The migration is versioned and idempotent (``storage/pg_schema.py``); opening the store
runs it too, so this command is for operators who migrate before rolling out workers.
A schema newer than this code is refused (exit 1), never touched. An LMDB directory
needs no command: it is checked (and brought up to date) whenever it is opened.
"""

from __future__ import annotations

import argparse
from typing import IO

from recoverable import errors
from recoverable.cli.exits import EXIT_FAILED, EXIT_OK, UsageError
from recoverable.cli.formatting import safe_text
from recoverable.storage import redact
from recoverable.storage.store import redact_url, url_scheme

__all__ = ["run_db"]


def run_db(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    url: str = args.store
    if url_scheme(url) not in ("postgresql", "postgres"):
        raise UsageError(
            "db upgrade takes a postgresql:// store URL (an LMDB directory is upgraded "
            "when it is opened)"
        )
    try:
        import psycopg

        from recoverable.storage import pg_schema
        from recoverable.storage.pg_sql import describe
    except ImportError as exc:
        raise UsageError(
            "the PostgreSQL store needs recoverable[postgres]: pip install "
            "'recoverable[postgres]'"
        ) from exc
    where = redact_url(url)
    redact.remember(url)
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
            before, after = pg_schema.upgrade(conn)
    except psycopg.Error as exc:
        err.write(
            f"recoverable db upgrade: storage_unavailable: cannot connect to {where} "
            f"({describe(exc, url)})\n"
        )
        return EXIT_FAILED
    except errors.RecoveryError as exc:
        err.write(f"recoverable db upgrade: {exc.code}: {safe_text(exc)}\n")
        return EXIT_FAILED
    if before == after:
        out.write(f"{where}: schema version {after}, up to date\n")
    else:
        out.write(f"{where}: schema upgraded from version {before} to {after}\n")
    return EXIT_OK
