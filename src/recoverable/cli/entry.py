"""The entry point: ``recoverable COMMAND ...`` parsed, dispatched, and its exit code."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import IO

from recoverable import errors
from recoverable.cli.arguments import build_parser
from recoverable.cli.batch import run_batch
from recoverable.cli.bulk_arguments import BULK_COMMANDS
from recoverable.cli.bulk_cli import is_bulk, run_bulk
from recoverable.cli.config import DEFAULT_RETRY_PROVIDER_CODES, BatchConfig
from recoverable.cli.db import run_db
from recoverable.cli.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, UsageError
from recoverable.cli.formatting import safe_text
from recoverable.cli.migrate import run_migrate
from recoverable.cli.ops import run_ops
from recoverable.cli.settings import run_config
from recoverable.cli.source import run_source
from recoverable.cli.sweep import run_sweep
from recoverable.cli.worker import main as worker_main
from recoverable.fixture.provider import fixture_main
from recoverable.pricing import load_prices
from recoverable.storage.redact import scrub
from recoverable.transport.backend import check_base_url

__all__ = ["main"]


def _reserve_standard_descriptors() -> None:
    """A closed stdout/stderr (``>&-``) must not let a file we open take descriptor 1
    or 2 (anything printed would land in it): point them at /dev/null."""
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)


# The dashboard's web dependencies: the ``dashboard`` extra.
_DASHBOARD_DEPENDENCIES = frozenset({"starlette", "hypercorn"})


def _dashboard(args: argparse.Namespace, out: IO[str]) -> int:
    """``recoverable dashboard``; without its extra, one line saying how to install it."""
    try:
        from recoverable.dashboard.server import run_dashboard
    except ImportError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in _DASHBOARD_DEPENDENCIES:
            raise
        print(
            f"recoverable dashboard: needs {missing}, which is not installed: "
            "pip install 'recoverable[dashboard]'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return run_dashboard(args, out, sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    _reserve_standard_descriptors()
    if args_list and args_list[0] == "fixture-provider":
        return fixture_main(args_list[1:])
    parser = build_parser()
    as_json = "--json" in args_list
    command = args_list[0] if args_list and not args_list[0].startswith("-") else None
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except UsageError as exc:
        _usage_error(command, exc, as_json)
        return EXIT_USAGE
    try:
        if args.command == "batch":
            return run_batch(_batch_config(args), out=sys.stdout, err=sys.stderr)
        if args.command == "worker":
            return worker_main(args)
        out = sys.stdout if sys.stdout is not None else open(os.devnull, "w")
        if args.command == "sweep":
            return run_sweep(args, out, sys.stderr)
        if args.command == "source":
            return run_source(args, out, sys.stderr)
        if args.command == "dashboard":
            return _dashboard(args, out)
        if args.command == "config":
            return run_config(args, out, sys.stderr)
        if args.command == "db":
            return run_db(args, out, sys.stderr)
        if args.command == "migrate-store":
            return run_migrate(args, out, sys.stderr)
        if args.command in BULK_COMMANDS and is_bulk(args):
            return run_bulk(args, out, sys.stderr)
        return run_ops(args, out, sys.stderr)
    except UsageError as exc:
        _usage_error(args.command, exc, getattr(args, "json", False))
        return EXIT_USAGE
    except errors.RecoveryError as exc:
        # Last resort (a damaged store met outside an operation): the typed
        # code and message, never a traceback.
        sys.stderr.write(f"recoverable {args.command}: {exc.code}: {safe_text(scrub(str(exc)))}\n")
        if isinstance(exc, errors.StoreDamaged):
            _exit_now(EXIT_FAILED)
        return EXIT_FAILED
    except KeyboardInterrupt:
        # Before or after the batch's own signal handling (startup, shutdown, ops).
        sys.stderr.write(f"recoverable {args.command}: interrupted\n")
        return EXIT_INTERRUPTED


def _exit_now(code: int) -> None:
    """End the process at once, without finalizers: LMDB may have read a damaged store's
    pages before the damage was found, and its memory (the C heap) can no longer be
    trusted; a ``free()`` at interpreter exit aborted the process after the typed
    message was printed (a seeded bit-flip run). Nothing is left to write: the store was
    refused, and the standard streams are flushed first."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    os._exit(code)


def _usage_error(command: str | None, exc: UsageError, as_json: bool) -> None:
    err: IO[str] | None = sys.stderr
    if err is None:
        return
    if as_json:
        err.write(json.dumps({"error": exc.code, "message": str(exc),
                              "operation_id": exc.operation_id}) + "\n")
    else:
        err.write(f"recoverable{' ' + command if command else ''}: {exc}\n")


def _batch_config(args: argparse.Namespace) -> BatchConfig:
    """The batch's options, checked (a ``UsageError`` before anything is opened)."""
    out_path = os.path.abspath(args.out)
    prices = None
    if args.prices is not None:
        try:
            prices = load_prices(args.prices)
        except errors.InvalidRequest as exc:
            raise UsageError(f"--prices: {exc}") from None
    config = BatchConfig(
        jobs_path=args.jobs,
        out_path=out_path,
        store_path=args.store or out_path + ".store",
        endpoint=args.endpoint,
        api_key_env=args.api_key_env,
        account=args.account,
        mode=args.mode,
        concurrency=args.concurrency,
        rps=args.rps,
        rpm=args.rpm,
        tpm=args.tpm,
        rate_burst_seconds=args.rate_burst_seconds,
        faults=args.faults,
        max_attempts=args.max_attempts,
        on_interruption=args.on_interruption,
        initial_backoff=(
            args.backoff if args.backoff is not None
            else 0.05 if args.endpoint == "fixture" else 0.5
        ),
        idle_timeout=args.idle_timeout,
        retry_provider_codes=(
            args.retry_provider_codes if args.retry_provider_codes is not None
            else DEFAULT_RETRY_PROVIDER_CODES
        ),
        prices=prices,
        prices_path=args.prices,
        max_cost=args.max_cost,
        output_format=args.output_format,
        errors_path=None if args.errors is None else os.path.abspath(args.errors),
        retry_failed=args.retry_failed,
        revision=args.revision,
        workers=args.workers,
        worker_restarts=args.worker_restarts,
        unreachable_after=args.unreachable_after,
    )
    if args.workers and args.rps is not None:
        # --rpm/--tpm go to every worker and are shared through the store's governor row;
        # --rps spaces POST starts inside one process (no shared state): each worker would
        # allow R, N x R in all.
        raise UsageError(
            "--rps is not available with --workers: it spaces the POSTs of one process, and "
            "each worker would send R per second; use --rpm (shared by every worker) with a "
            "short --rate-burst-seconds, e.g. --rpm 300 --rate-burst-seconds 1 for about 5 "
            "per second (docs/rate-limits.md)"
        )
    if args.faults is not None and args.endpoint != "fixture":
        raise UsageError("--faults only applies to --endpoint fixture")
    if args.endpoint != "fixture":
        try:
            check_base_url(args.endpoint)  # the backend's own check: no ws(s):// URL
        except ValueError as exc:  # InvalidRequest, or urllib's own ("Invalid IPv6 URL")
            raise UsageError(f"--endpoint: not a usable URL: {exc}") from None
    return config
