"""``recoverable worker``: a process that runs queued operations of one store.

It opens the store, a backend (a base URL with the key from ``--api-key-env``, the
embedded fixture, or a fixture already served at ``--fixture-url`` — what
``recoverable batch --workers N`` passes its workers) and a runtime bound to one
account, then runs ``recoverable.actors.worker.run_worker`` until SIGTERM/SIGINT: the
running operations are then suspended durably and flagged for the next worker, and the
process exits 0. A second signal exits at once (still safe: the store is the authority).

The standing authorization policy: ``--authorizer module:callable`` (a host callable,
given each ``Attempt`` like ``send_recovering``'s ``authorize``), or by default every
attempt the operation's saved budget allows (the budget, saved at submit, is the bound).

stdout: one JSON line when ready (``{"worker": "ready", "pid": ...}``), one at exit with
the counts (``WorkerReport``); never ids, prompts, outputs, keys or account names.

The store is ``--store DIR|URL`` or, with ``--store-env VAR``, the value of that
environment variable (``batch --workers`` passes it so: a URL's password stays out of
``ps``). Exit codes: 0 after a clean stop; 2 a usage error or a store that cannot be
opened; 1 the worker failed while running (the store failed under it, its PostgreSQL
session was lost, ...): ONE line on stderr, ``recoverable worker: CODE: message``, never
a traceback (``RECOVERABLE_DEBUG=1`` prints one for an unexpected error, a defect).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import AsyncIterator, Callable
from typing import IO, Any, Final

import attrs
import trio

from recoverable import errors
from recoverable.actors.governor import DEFAULT_BURST_SECONDS
from recoverable.actors.host import Authorize
from recoverable.actors.runtime import open_runtime
from recoverable.actors.worker import WorkerReport, run_worker
from recoverable.cli.exits import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_STORE_LOST,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    UsageError,
)
from recoverable.cli.gc_tuning import tuned_collector
from recoverable.cli.provider import FIXTURE_ACCOUNT, FIXTURE_KEY
from recoverable.fixture.provider import FixtureProvider
from recoverable.storage.redact import brief, scrub
from recoverable.storage.store import RecoveryStore
from recoverable.transport.backend import ResponsesBackend, check_base_url
from recoverable.transport.base import StaticCredentials, StreamLimits, validate_api_key
from recoverable.transport.modes import DEFAULT_MODE, Mode
from recoverable.types import AccountBinding, Attempt

__all__ = [
    "WorkerConfig", "load_authorizer", "main", "run_worker_command", "worker_account",
    "worker_config",
]

FIXTURE_ENDPOINT_ID: Final = "fixture"  # the batch's embedded provider, whatever its port
DEBUG_ENV: Final = "RECOVERABLE_DEBUG"  # =1: an unexpected error's traceback is printed


@attrs.frozen
class WorkerConfig:
    store_path: str
    endpoint: str = "fixture"  # "fixture" or a base URL
    fixture_url: str | None = None  # a fixture provider already served (batch --workers)
    api_key_env: str = "OPENAI_API_KEY"
    account: str | None = None
    mode: Mode = DEFAULT_MODE
    concurrency: int = 64
    authorizer: str | None = None
    idle_timeout: float = 120.0
    lease_seconds: float = 30.0
    stop_with_stdin: bool = False  # stop when standard input closes (batch --workers)
    unreachable_after: float = 300.0  # then exit EXIT_UNAVAILABLE
    # The rate governor's limits (--rpm/--tpm/--rate-burst-seconds), shared through the
    # store by every process with the same endpoint and account (docs/rate-limits.md).
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    rate_burst_seconds: float = DEFAULT_BURST_SECONDS


def worker_account(config: WorkerConfig) -> AccountBinding:
    """The account this worker serves (the same rule as ``recoverable batch``'s)."""
    if config.account is not None:
        return AccountBinding(config.account, "api-key")
    fixture = config.endpoint == "fixture" or config.fixture_url is not None
    return FIXTURE_ACCOUNT if fixture else AccountBinding("default")


async def authorize_within_budget(attempt: Attempt) -> bool:
    """The CLI's default policy: every attempt the operation's saved budget allows (the
    runtime never asks for one past it)."""
    return True


def load_authorizer(spec: str) -> Authorize:
    """``module:callable`` (a dotted attribute path after the colon) -> the callable."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise UsageError(f"--authorizer must be module:callable, not {spec!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"--authorizer: cannot import {module_name!r}: {exc}") from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise UsageError(f"--authorizer: {module_name!r} has no {attribute!r}") from None
    if not callable(target):
        raise UsageError(f"--authorizer: {spec!r} is not callable")
    authorize: Authorize = target
    return authorize


def check_worker_config(config: WorkerConfig) -> None:
    """Usage problems, before anything is opened (``UsageError``)."""
    if config.fixture_url is not None:
        try:
            check_base_url(config.fixture_url)
        except ValueError as exc:
            raise UsageError(f"--fixture-url: not a usable URL: {exc}") from None
        return
    if config.endpoint == "fixture":
        return
    try:
        check_base_url(config.endpoint)
    except ValueError as exc:
        raise UsageError(f"--endpoint: not a usable URL: {exc}") from None
    key = os.environ.get(config.api_key_env)
    if not key:
        raise UsageError(
            f"the environment variable {config.api_key_env} (--api-key-env) is not set"
        )
    try:
        validate_api_key(key, what=f"the key in {config.api_key_env}")
    except errors.InvalidCredentials as exc:
        raise UsageError(str(exc)) from None


@contextlib.asynccontextmanager
async def open_worker_backend(
    config: WorkerConfig, account: AccountBinding
) -> AsyncIterator[ResponsesBackend]:
    limits = StreamLimits(idle_timeout=config.idle_timeout)
    if config.fixture_url is not None or config.endpoint == "fixture":
        async with contextlib.AsyncExitStack() as stack:
            url = config.fixture_url
            if url is None:
                provider = await stack.enter_async_context(FixtureProvider.serve())
                url = provider.http_url
            backend = ResponsesBackend(
                url, credentials=StaticCredentials(FIXTURE_KEY, account=account),
                mode=config.mode, limits=limits, endpoint_id=FIXTURE_ENDPOINT_ID,
            )
            async with backend:
                yield backend
        return
    backend = ResponsesBackend(
        config.endpoint,
        credentials=StaticCredentials(os.environ.get(config.api_key_env, ""), account=account),
        mode=config.mode,
        limits=limits,
    )
    async with backend:
        yield backend


def _say(stream: IO[str] | None, line: dict[str, Any]) -> None:
    if stream is None:
        return
    try:
        stream.write(json.dumps(line) + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass  # a closed stdout never stops the worker


async def _serve(
    config: WorkerConfig, store: RecoveryStore, authorize: Authorize, out: IO[str] | None
) -> WorkerReport:
    account = worker_account(config)
    stop = trio.Event()
    unavailable: errors.EndpointUnavailable | None = None
    async with (
        open_worker_backend(config, account) as backend,
        open_runtime(
            store, backend, account=account, lease_seconds=config.lease_seconds,
            unreachable_after=config.unreachable_after,
            requests_per_minute=config.requests_per_minute,
            tokens_per_minute=config.tokens_per_minute,
            rate_burst_seconds=config.rate_burst_seconds,
        ) as rt,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(_watch_signals, stop)  # installed before "ready" is said
        if config.stop_with_stdin:
            nursery.start_soon(_watch_stdin, stop)
        _say(out, {"worker": "ready", "pid": os.getpid(), "concurrency": config.concurrency})
        with tuned_collector():  # the collector's setting for a run (gc_tuning)
            try:
                report = await run_worker(rt, concurrency=config.concurrency,
                                          authorize=authorize, stop=stop)
            except errors.EndpointUnavailable as exc:  # raised as itself, not in a group
                unavailable = exc
        nursery.cancel_scope.cancel()
    if unavailable is not None:
        raise unavailable
    return report


async def _watch_signals(
    stop: trio.Event, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for _ in signals:
            if stop.is_set():
                os._exit(EXIT_INTERRUPTED)  # second signal: at once (the store is safe)
            stop.set()


async def _watch_stdin(stop: trio.Event) -> None:
    """Stop (as on SIGTERM) once standard input reaches its end: ``batch --workers`` holds
    the other end of that pipe, so its workers stop with it however it ends (SIGKILL
    included: the kernel closes the pipe), suspending what they run, leases released."""
    async with trio.lowlevel.FdStream(os.dup(0)) as stdin:
        while await stdin.receive_some(4096):
            pass  # nothing is sent on it: only its end means something
    stop.set()


def run_worker_command(
    config: WorkerConfig, *, out: IO[str] | None, err: IO[str] | None
) -> int:
    """Run a worker until SIGTERM/SIGINT; 0 after a clean stop."""
    def say(text: str) -> None:
        if err is not None:
            err.write(text + "\n")

    try:
        check_worker_config(config)
        authorize = (
            load_authorizer(config.authorizer) if config.authorizer is not None
            else authorize_within_budget
        )
    except UsageError as exc:
        say(f"recoverable worker: {exc}")
        return EXIT_USAGE
    _quiet_driver_log()
    try:
        store = RecoveryStore.open(config.store_path)
    except errors.RecoveryError as exc:
        say(f"recoverable worker: cannot open the store: {exc.code}: {scrub(str(exc))}")
        return EXIT_USAGE
    try:
        report = trio.run(_serve, config, store, authorize, out)
    except errors.EndpointUnavailable as exc:  # nothing spent; its operations stay queued
        say(f"recoverable worker: {exc.code}: {scrub(str(exc))}")
        return EXIT_UNAVAILABLE
    except BaseException as exc:  # each kind is told apart in _failure
        return _failure(exc, say, err)
    finally:
        with contextlib.suppress(errors.RecoveryError):
            store.close()  # a store that failed may fail closing too: it was told
    _say(out, {"worker": "stopped", **attrs.asdict(report)})
    return 0


def _quiet_driver_log() -> None:
    """psycopg logs a warning through Python's last-resort handler (stderr) when it cleans
    up a connection the server ended; the worker's one line says what happened (the
    warning is kept with ``RECOVERABLE_DEBUG=1``)."""
    if os.environ.get(DEBUG_ENV) != "1":
        logging.getLogger("psycopg").addHandler(logging.NullHandler())


def _store_lost(error: errors.RecoveryError) -> bool:
    """The store stopped accepting this process, and a new one may go on: unavailable,
    not damaged (``StoreDamaged``, ``StoreLockReplaced`` fail every process alike)."""
    return isinstance(error, errors.StorageUnavailable) and not isinstance(
        error, errors.StoreDamaged | errors.StoreLockReplaced | errors.RequestUnavailable
    )


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, as Trio's nurseries raise them."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _failure(exc: BaseException, say: Callable[[str], None], err: IO[str] | None) -> int:
    """How a worker that failed ends: ONE line on stderr and ``EXIT_FAILED``, never a
    traceback (``RECOVERABLE_DEBUG=1`` adds it for an unexpected error). A typed error
    (the store failing under the worker: ``storage_unavailable``, ``store_lock_replaced``,
    ...) is told by its code and message, also when Trio's nurseries wrapped it (and
    others) in exception groups. An interruption (Ctrl-C) is re-raised (``entry.py``: exit
    130); any other exception is a defect, told by its type."""
    leaves = _leaves(exc)
    if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves):
        raise KeyboardInterrupt from exc
    if not isinstance(exc, Exception):
        raise exc  # SystemExit and the like: not a failure to tell
    typed = [leaf for leaf in leaves if isinstance(leaf, errors.RecoveryError)]
    if len(typed) == len(leaves):
        first = typed[0]
        others = sorted({leaf.code for leaf in typed} - {first.code})
        also = f" (also: {', '.join(others)})" if others else ""
        say(f"recoverable worker: {first.code}: {brief(scrub(str(first)), 2000)}{also}")
        if all(isinstance(leaf, errors.EndpointUnavailable) for leaf in typed):
            return EXIT_UNAVAILABLE
        return EXIT_STORE_LOST if all(_store_lost(leaf) for leaf in typed) else EXIT_FAILED
    unknown = next(leaf for leaf in leaves if not isinstance(leaf, errors.RecoveryError))
    say(
        f"recoverable worker: internal_error: {type(unknown).__name__}: "
        f"{brief(scrub(str(unknown)))} (a defect of recoverable: please report it; "
        f"{DEBUG_ENV}=1 prints the traceback)"
    )
    if os.environ.get(DEBUG_ENV) == "1" and err is not None:
        traceback.print_exception(exc, file=err)
    return EXIT_FAILED


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The parsed ``recoverable worker`` arguments (``cli/arguments.py``)."""
    if args.fixture_url is not None and args.endpoint != "fixture":
        raise UsageError("--fixture-url and --endpoint URL exclude each other")
    if not 1.0 <= args.lease_seconds <= 3600.0:
        raise UsageError("--lease-seconds must be between 1 and 3600")
    return WorkerConfig(
        store_path=_store_location(args),
        endpoint=args.endpoint,
        fixture_url=args.fixture_url,
        api_key_env=args.api_key_env,
        account=args.account,
        mode=args.mode,
        concurrency=args.concurrency,
        authorizer=args.authorizer,
        idle_timeout=args.idle_timeout,
        lease_seconds=args.lease_seconds,
        stop_with_stdin=args.stop_with_stdin,
        unreachable_after=args.unreachable_after,
        requests_per_minute=args.rpm,
        tokens_per_minute=args.tpm,
        rate_burst_seconds=args.rate_burst_seconds,
    )


def _store_location(args: argparse.Namespace) -> str:
    """``--store DIR|URL``, or the value of the variable named by ``--store-env`` (what
    ``batch --workers`` passes: a URL's password never shows in the process list)."""
    if args.store_env is None:
        store: str = args.store
        return store
    value = os.environ.get(args.store_env)
    if not value:
        raise UsageError(
            f"the environment variable {args.store_env} (--store-env) is not set"
        )
    return value


def main(args: argparse.Namespace) -> int:
    return run_worker_command(worker_config(args), out=sys.stdout, err=sys.stderr)
