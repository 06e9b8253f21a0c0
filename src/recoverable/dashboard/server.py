"""``recoverable dashboard --store S [--host 127.0.0.1 [--allow-remote]] [--port 0]
[--account ID] [--show-content] [--prices FILE]``: the operator's web dashboard over a
store (docs/dashboard.md).

It opens the store (an LMDB directory, or a ``postgresql://`` URL once that store is
installed: ``RecoveryStore.open`` picks it), a runtime without a backend (it never
generates; the actions are the CLI's library calls), and serves the Starlette app with
Hypercorn's Trio worker. First it prints one JSON line on stdout::

    {"url": "http://127.0.0.1:PORT/?token=...", "host": ..., "port": ..., "pid": ...,
     "store": ..., "account_bound": true|false, "show_content": false}

then serves until SIGINT or SIGTERM (exit code 0). The token is made per start and never
written to disk. Telemetry of every action goes to stderr as JSON lines (ids and counts).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
from functools import partial
from typing import IO, Any, Final, cast
from urllib.parse import urlsplit

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from recoverable import errors
from recoverable.actors.runtime import open_runtime
from recoverable.cli.exits import EXIT_OK, UsageError
from recoverable.cli.ops import resolve_account
from recoverable.dashboard.app import Dashboard
from recoverable.dashboard.security import Guard, Sessions
from recoverable.pricing import PriceTable, load_prices
from recoverable.storage.redact import url_host
from recoverable.storage.store import RecoveryStore, registered_schemes, url_scheme
from recoverable.telemetry import TelemetryEvent

__all__ = ["run_dashboard", "store_label"]

GRACEFUL_SECONDS: Final = 2.0  # open live views (SSE) are closed after this on shutdown


def store_label(spec: str) -> str:
    """How pages and the JSON line name the store: a URL without its credentials."""
    if "://" in spec:
        # From the raw text (storage/redact.py): a parser would take part of a password
        # holding an unencoded '/', '?', '#' or '@' for the host.
        host = url_host(spec) or "local socket"
        return f"{spec.split('://', 1)[0]} store on {host} (credentials not shown)"
    return os.path.abspath(spec)


def open_dashboard_store(spec: str) -> RecoveryStore:
    """The store named by ``--store``; a missing or unopenable one is a usage error whose
    message never repeats a URL's credentials."""
    label = store_label(spec)
    if "://" in spec:
        scheme = url_scheme(spec)
        # A URL is opened by the engine registered for its scheme (PostgreSQL once
        # psycopg is installed); any other is refused (never a directory named
        # "postgresql:").
        if scheme not in registered_schemes():
            raise UsageError(f"cannot open the store at {label}: this installation opens "
                             "LMDB directories only")
    elif (
        not os.path.isdir(spec) or not os.path.exists(os.path.join(spec, "data.mdb"))
    ):
        raise UsageError(f"no recovery store at {label}")
    try:
        return RecoveryStore.open(spec)
    except errors.RecoveryError as exc:
        raise UsageError(f"cannot open the store at {label}: {exc.code}") from None
    except (OSError, ValueError, TypeError):
        raise UsageError(f"cannot open the store at {label}") from None


class _StderrSink:
    """The runtime's telemetry as JSON lines on stderr (ids and counts only)."""

    def __init__(self, err: IO[str]) -> None:
        self.err = err

    def __call__(self, event: TelemetryEvent) -> None:
        line = {"telemetry": event.name, "operation_id": event.operation_id,
                "fields": event.fields, "time": event.time, "source": "dashboard"}
        try:
            self.err.write(json.dumps(line, sort_keys=True, default=str) + "\n")
            self.err.flush()
        except (OSError, ValueError):
            pass  # a closed stderr loses diagnostics, never an action


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (a name other than
    ``localhost`` may resolve to anything: it is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_remote(host: str, allow_remote: bool, err: IO[str]) -> None:
    """A bind other machines can reach needs ``--allow-remote``, and is then warned about:
    the dashboard speaks plain http, so its token and session cross the network in clear."""
    if is_loopback(host):
        return
    if not allow_remote:
        raise UsageError(
            f"--host {host} is not a loopback address: other machines could reach the "
            "dashboard, over plain http (the token and the session cookie unencrypted). "
            "Pass --allow-remote to listen there anyway, or keep the default 127.0.0.1 "
            "(and an SSH tunnel)"
        )
    err.write(f"warning: the dashboard listens on {host}, reachable from other machines "
              "over plain http: anyone who sees its URL or traffic can act as you "
              "(--allow-remote)\n")
    err.flush()


def dashboard_prices(path: str | None) -> PriceTable | None:
    """``--prices FILE`` (the batch's format, pricing.py); a bad file is a usage error
    naming what is wrong. None: genai-prices' (if installed)."""
    if path is None:
        return None
    try:
        return load_prices(path)
    except errors.InvalidRequest as exc:
        raise UsageError(f"--prices: {exc}") from None


def run_dashboard(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    check_remote(args.host, args.allow_remote, err)
    prices = dashboard_prices(args.prices)
    store = open_dashboard_store(args.store)
    try:
        return trio.run(partial(_serve, store, args, out, err, prices))
    finally:
        store.close()


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _serve(store: RecoveryStore, args: argparse.Namespace, out: IO[str],
                 err: IO[str], prices: PriceTable | None) -> int:
    account = resolve_account(args.account)
    sessions = Sessions()
    sink = _StderrSink(err)
    config = Config()
    config.bind = [_bind(args.host, args.port)]
    config.accesslog = None  # a request line would carry the token
    config.graceful_timeout = GRACEFUL_SECONDS
    config.include_server_header = False
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_runtime(store, None, account=account, telemetry=sink,
                                monitor_interval=0.25) as runtime:
            dashboard = Dashboard(
                store, runtime, sessions_csrf=sessions.csrf, check_csrf=sessions.check_csrf,
                flash=sessions.flash, take_flash=sessions.take_flash,
                context=f"store {store_label(args.store)}; "
                + ("acting within --account" if account is not None else "read-only")
                + ("; content shown" if args.show_content else ""),
                show_content=args.show_content, telemetry=sink, prices=prices,
            )
            guard = Guard(dashboard.app(), sessions)
            stop = trio.Event()
            failure: str | None = None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(dashboard.refresh_forever)
                async with trio.open_nursery() as server:
                    try:
                        binds = await server.start(
                            partial(serve, cast(Any, guard), config, shutdown_trigger=stop.wait))
                    except* OSError as group:  # raised inside Hypercorn's own nursery
                        reason = next((exc.strerror for exc in _leaves(group)
                                       if exc.strerror), "refused")
                        failure = f"cannot listen on {args.host}:{args.port}: {reason}"
                    else:
                        _announce(out, guard, sessions, args, binds[0], account is not None)
                        async for _signal in signals:
                            break
                        stop.set()
                        server.cancel_scope.deadline = trio.current_time() + GRACEFUL_SECONDS + 1
                nursery.cancel_scope.cancel()  # the summary refresher runs until now
    if failure is not None:
        raise UsageError(failure)
    return EXIT_OK


def _leaves(group: BaseExceptionGroup[OSError]) -> list[OSError]:
    found: list[OSError] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found += _leaves(exc)
        else:
            found.append(exc)
    return found


def _announce(out: IO[str], guard: Guard, sessions: Sessions, args: argparse.Namespace,
              bind: str, account_bound: bool) -> None:
    """Allow the bound address as Host, and print the one JSON line."""
    port = urlsplit(bind).port
    assert port is not None
    guard.allow_hosts(args.host if ":" not in args.host else f"[{args.host}]", port)
    url = f"http://{_bind(args.host, port)}/?token={sessions.token}"
    out.write(json.dumps({
        "url": url, "host": args.host, "port": port, "pid": os.getpid(),
        "store": store_label(args.store), "account_bound": account_bound,
        "show_content": bool(args.show_content),
    }) + "\n")
    out.flush()
