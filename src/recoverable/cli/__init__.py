"""The ``recoverable`` command line: the batch host and store operations.

``recoverable batch JOBS.jsonl --out RESULTS.jsonl`` runs a file of jobs durably
(see ``recoverable.cli.batch``). ``status|inventory|receipt|acknowledge|abandon|
suspend|cancel|retry|purge --store DIR`` operate on a store from the shell
(``--json`` for machine output), always within the account given by
``--account``. ``fixture-provider`` runs the loopback test provider.

Exit codes: 0 success, 1 a job or an operation failed (or was not found),
2 usage or input error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any, NoReturn

import msgspec
import trio

from recoverable import errors
from recoverable.actors.runtime import Runtime, open_runtime
from recoverable.cli.batch import (
    DEFAULT_RETRY_PROVIDER_CODES,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    MINIMUM_RPS,
    BatchConfig,
    run_batch,
)
from recoverable.pricing import attempts_usage_text, load_prices, usage_text
from recoverable.storage.store import RecoveryStore
from recoverable.transport.base import StaticCredentials
from recoverable.transport.fixture import FaultSpec, fixture_main
from recoverable.types import AccountBinding, Handle, Inventory, Receipt, Status

__all__ = ["main"]

OPS_COMMANDS = (
    "status",
    "inventory",
    "receipt",
    "acknowledge",
    "abandon",
    "suspend",
    "cancel",
    "retry",
    "purge",
)
_NEEDS_ID = frozenset(
    {"status", "receipt", "acknowledge", "abandon", "suspend", "cancel", "retry"}
)
# Every command but ``status`` acts on (or reveals) an account's operations: it needs
# ``--account`` and never falls back to the operation's own account. ``status`` without
# it shows only the redacted status (that the operation exists).
_NEEDS_ACCOUNT = frozenset(OPS_COMMANDS) - {"status"}
MAXIMUM_RPS = 100_000.0


class UsageError(Exception):
    """A bad option or argument (exit code 2)."""

    def __init__(self, message: str, *, code: str = "usage", operation_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.operation_id = operation_id


class _Parser(argparse.ArgumentParser):
    """Argument errors are raised (and printed by ``main``, as JSON with ``--json``)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}\n{self.format_usage().strip()}")


# -- argument parsing -----------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def _attempts(text: str) -> int:
    value = _positive_int(text)
    if value > 1000:
        raise argparse.ArgumentTypeError("must be in 1..1000")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number: {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number: {text!r}")
    return value


def _provider_codes(text: str) -> frozenset[str]:
    from recoverable.outcome import bounded_code

    codes = frozenset(c.strip() for c in text.split(",") if c.strip())
    for code in codes:
        if bounded_code(code) != code:
            raise argparse.ArgumentTypeError(f"not a provider code: {code[:80]!r}")
    return codes


def _rps(text: str) -> float:
    value = _positive_float(text)
    if not MINIMUM_RPS <= value <= MAXIMUM_RPS:
        raise argparse.ArgumentTypeError(
            f"must be in {MINIMUM_RPS:g}..{MAXIMUM_RPS:g} POSTs per second: {text!r}"
        )
    return value


def _revision(text: str) -> str:
    if not 1 <= len(text) <= 256 or any(ord(c) < 32 for c in text):
        raise argparse.ArgumentTypeError("must be 1..256 characters without control characters")
    return text


def _per_minute(text: str) -> float:
    value = _positive_float(text)
    if value > 1e12:
        raise argparse.ArgumentTypeError(f"must be at most 1e12 per minute: {text!r}")
    return value


def _burst_seconds(text: str) -> float:
    value = _positive_float(text)
    if value > 3600:
        raise argparse.ArgumentTypeError(f"must be at most 3600 seconds: {text!r}")
    return value


def _fault_spec(text: str) -> FaultSpec:
    try:
        return FaultSpec.parse(text)
    except errors.InvalidRequest as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="recoverable",
        description="Durable, crash-safe structured LLM requests: batch host and store tools.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    batch = sub.add_parser(
        "batch",
        help="run a JSONL file of jobs durably, writing each result once",
        description=(
            "Run every job of JOBS.jsonl as one durable operation keyed by (id, revision). "
            "Each validated result is appended to --out as one fsynced JSON line, then "
            "acknowledged. Ctrl-C suspends; rerunning resumes without generating again "
            "for saved results."
        ),
    )
    batch.add_argument("jobs", metavar="JOBS.jsonl")
    batch.add_argument("--out", required=True, metavar="RESULTS.jsonl")
    batch.add_argument("--store", metavar="DIR", help="recovery store (default: <out>.store)")
    batch.add_argument(
        "--endpoint",
        default="fixture",
        metavar="URL|fixture",
        help="a Responses-compatible base URL, or 'fixture' (embedded provider, the default)",
    )
    batch.add_argument(
        "--api-key-env",
        default="OPENAI_API_KEY",
        metavar="VAR",
        help="environment variable holding the API key (read, never written anywhere)",
    )
    batch.add_argument(
        "--account",
        metavar="ID",
        help="account id the operations belong to (default: 'batch' for the fixture, "
        "else 'default')",
    )
    batch.add_argument("--mode", choices=("websocket", "sse"), default="websocket")
    batch.add_argument("--concurrency", type=_positive_int, default=64, metavar="N")
    batch.add_argument(
        "--rps", type=_rps, metavar="R",
        help=f"max POSTs per second ({MINIMUM_RPS:g}..{MAXIMUM_RPS:g})",
    )
    batch.add_argument(
        "--rpm", type=_per_minute, metavar="N",
        help="requests per minute, shared by every process on the store (docs/rate-limits.md)",
    )
    batch.add_argument(
        "--tpm", type=_per_minute, metavar="N",
        help="tokens per minute (estimated from each request, corrected by its usage), "
        "shared by every process on the store",
    )
    batch.add_argument(
        "--rate-burst-seconds", type=_burst_seconds, default=60.0, metavar="S",
        help="--rpm/--tpm budget that may be spent at once, in seconds of refill (default 60)",
    )
    batch.add_argument(
        "--faults",
        type=_fault_spec,
        metavar="SPEC",
        help="fixture faults, e.g. disconnect=0.2,rate_limited=0.1,seed=7",
    )
    batch.add_argument(
        "--max-attempts",
        type=_attempts,
        default=8,
        metavar="N",
        help="total attempt budget per job unless the job sets max_attempts (default 8)",
    )
    batch.add_argument(
        "--backoff",
        type=_non_negative_float,
        metavar="SECONDS",
        help="initial backoff before a replacement attempt (doubles, at most 30 s; "
        "default 0.5, or 0.05 for the local fixture)",
    )
    batch.add_argument(
        "--retry-provider-codes",
        type=_provider_codes,
        metavar="CODES",
        help="comma-separated response.failed codes the batch lets be replaced within the "
        "budget (default: " + ",".join(sorted(DEFAULT_RETRY_PROVIDER_CODES)) + "; '' for none)",
    )
    batch.add_argument(
        "--idle-timeout",
        type=_positive_float,
        default=120.0,
        metavar="SECONDS",
        help="a stream silent this long is interrupted (and replaced)",
    )
    batch.add_argument(
        "--output-format",
        choices=("recoverable", "openai-batch"),
        default="recoverable",
        help="shape of the --out lines: this tool's (default) or the OpenAI Batch API's output "
        "lines (a rerun must use the same)",
    )
    batch.add_argument(
        "--errors",
        metavar="FILE",
        help="write one JSON line per failed job (and skipped line) of this run: its typed "
        "failure, operation id and what to do (rewritten by every run)",
    )
    batch.add_argument(
        "--retry-failed",
        action="store_true",
        help="before running, create one manual-retry successor (a new attempt budget linked "
        "to the spent one) for each failed job of this file, then run them",
    )
    batch.add_argument(
        "--revision",
        type=_revision,
        metavar="R",
        help="the revision of every OpenAI Batch API line (default: derived from the line's "
        "body, so it changes when the body does)",
    )
    batch.add_argument(
        "--prices",
        metavar="FILE",
        help="JSON price table for the cost estimate: model -> {input, cached_input, output} "
        "in USD per 1M tokens (default: a small dated built-in estimate)",
    )

    for name in OPS_COMMANDS:
        helps = {
            "status": "show an operation's status",
            "inventory": "list the account's operations",
            "receipt": "show a saved, validated result",
            "acknowledge": "remove a committed operation's content (keeps a marker)",
            "abandon": "give up an operation (removes content, keeps a marker)",
            "suspend": "suspend an operation (also while another process runs it)",
            "cancel": "permanently cancel an operation (a saved result needs --force)",
            "retry": "create the one successor of a failed or exhausted operation "
            "(a new budget linked to the spent one; does not generate)",
            "purge": "remove every idle record of an account",
        }
        p = sub.add_parser(name, help=helps[name])
        p.add_argument("--store", required=True, metavar="DIR")
        p.add_argument(
            "--account",
            metavar="ID",
            required=name in _NEEDS_ACCOUNT,
            help="the account the operations belong to; the command acts only within it"
            + (" (without it, status is redacted)" if name == "status" else ""),
        )
        if name in _NEEDS_ID:
            p.add_argument("operation_id", metavar="OPERATION_ID")
        if name in ("inventory", "purge"):
            p.add_argument("--scope", help="only operations with this host scope")
        if name == "cancel":
            p.add_argument(
                "--force",
                action="store_true",
                help="cancel even though a validated result is saved (it is discarded)",
            )
        if name == "retry":
            p.add_argument(
                "--action-id", required=True, metavar="ID",
                help="names this decision: repeating it returns the same successor",
            )
            p.add_argument(
                "--max-attempts", type=_attempts, metavar="N",
                help="the successor's total attempt budget (default: the source's)",
            )
            p.add_argument(
                "--selection", choices=("preserve", "reselect"), default="preserve",
                help="preserve the frozen request (default) or rebuild it from the saved one",
            )
        p.add_argument("--json", action="store_true", help="machine output (JSON)")

    sub.add_parser(
        "fixture-provider",
        help="run the loopback fixture Responses provider",
        add_help=False,
    )
    return parser


# -- entry point ------------------------------------------------------------------------------


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
            return _batch(args, sys.stdout, sys.stderr)
        out = sys.stdout if sys.stdout is not None else open(os.devnull, "w")
        return _ops(args, out, sys.stderr)
    except UsageError as exc:
        _usage_error(args.command, exc, getattr(args, "json", False))
        return EXIT_USAGE
    except errors.RecoveryError as exc:
        # Last resort (a damaged store met outside an operation, issue 11.3): the typed
        # code and message, never a traceback.
        sys.stderr.write(f"recoverable {args.command}: {exc.code}: {exc}\n")
        return EXIT_FAILED
    except KeyboardInterrupt:
        # Before or after the batch's own signal handling (startup, shutdown, ops).
        sys.stderr.write(f"recoverable {args.command}: interrupted\n")
        return EXIT_INTERRUPTED


def _usage_error(command: str | None, exc: UsageError, as_json: bool) -> None:
    if sys.stderr is None:
        return
    if as_json:
        sys.stderr.write(json.dumps({"error": exc.code, "message": str(exc),
                                     "operation_id": exc.operation_id}) + "\n")
    else:
        sys.stderr.write(f"recoverable{' ' + command if command else ''}: {exc}\n")


def _batch(args: argparse.Namespace, out: IO[str] | None, err: IO[str] | None) -> int:
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
        output_format=args.output_format,
        errors_path=None if args.errors is None else os.path.abspath(args.errors),
        retry_failed=args.retry_failed,
        revision=args.revision,
    )
    if args.faults is not None and args.endpoint != "fixture":
        raise UsageError("--faults only applies to --endpoint fixture")
    if args.endpoint != "fixture":
        try:
            from recoverable.transport.backend import check_base_url

            check_base_url(args.endpoint)  # the backend's own check: no ws(s):// URL
        except ValueError as exc:  # InvalidRequest, or urllib's own ("Invalid IPv6 URL")
            raise UsageError(f"--endpoint: not a usable URL: {exc}") from None
    return run_batch(config, out=out, err=err)


# -- store operations -----------------------------------------------------------------------


def _open_store(path: str) -> RecoveryStore:
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "data.mdb")):
        raise UsageError(f"no recovery store at {path}")
    try:
        return RecoveryStore.open(path)
    except errors.RecoveryError as exc:
        raise UsageError(f"cannot open the store at {path}: {exc}") from exc


def resolve_account(explicit: str | None) -> AccountBinding | None:
    """``--account`` only: a command never borrows the operation's own account."""
    return AccountBinding(explicit, "api-key") if explicit is not None else None


def _ops(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    command: str = args.command
    account = resolve_account(args.account)
    if account is None and command in _NEEDS_ACCOUNT:  # argparse requires it already
        raise UsageError(f"{command} acts within one account: pass --account ID")
    store = _open_store(args.store)
    try:
        operation_id: str | None = getattr(args, "operation_id", None)
        if operation_id is not None:
            _check_exists(store, operation_id)
        if command == "purge":
            assert account is not None
            return _purge(store, account, args, out, err)
        return trio.run(_run_op, store, account, command, operation_id, args, out, err)
    finally:
        store.close()


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


class _NoGeneration:
    """The backend of ``recoverable retry``: it names the endpoint the successor is
    bound to (the source's) and can never send anything."""

    def __init__(self, endpoint_id: str, account: AccountBinding) -> None:
        self.endpoint_id = endpoint_id
        self.credentials = StaticCredentials("unused-by-the-cli", account=account)

    async def stream(self, body: bytes, **_: Any) -> Any:
        raise errors.ConfigurationUnavailable("the command line never generates")


async def _run_op(
    store: RecoveryStore,
    account: AccountBinding | None,
    command: str,
    operation_id: str | None,
    args: argparse.Namespace,
    out: IO[str],
    err: IO[str],
) -> int:
    as_json: bool = args.json
    backend: Any = None
    if command == "retry":
        assert account is not None and operation_id is not None
        source = store.get_operation(operation_id)
        if source is not None:
            backend = _NoGeneration(source.endpoint_id, account)
    async with open_runtime(store, backend, account=account) as rt:
        try:
            if command == "retry":
                assert operation_id is not None
                if backend is None:
                    raise errors.StateUnavailable(
                        "the operation is already disposed", operation_id=operation_id
                    )
                return await _retry(rt, operation_id, args, out)
            if command == "cancel" and not args.force:
                assert operation_id is not None
                refusal = _cancel_refusal(rt, operation_id)
                if refusal is not None:
                    raise UsageError(refusal, code="completion_saved", operation_id=operation_id)
            if command == "inventory":
                inventory = await rt.inventory(scope=args.scope)
                out.write(_encode_json(inventory) if as_json else format_inventory(inventory))
                return EXIT_OK
            assert operation_id is not None
            handle = Handle(operation_id)
            if command == "status":
                status = await rt.status(handle)
                out.write(_encode_json(status) if as_json else format_status(status))
                if status.redacted and not as_json and account is None:
                    err.write("recoverable status: redacted: pass --account ID (the "
                              "operation's account) to see its details\n")
                return EXIT_OK
            if command == "receipt":
                receipt = await rt.receipt(handle)
                out.write(receipt_json(receipt) if as_json else format_receipt(receipt))
                return EXIT_OK
            action = _LIFECYCLE[command]
            await action(rt, handle)
            status = rt.status_of(operation_id)
            if as_json:
                out.write(_encode_json(status))
            else:
                out.write(_lifecycle_message(command, operation_id, status))
            return EXIT_OK
        except errors.RecoveryError as exc:
            if as_json:
                err.write(json.dumps({"error": exc.code, "message": str(exc),
                                     "operation_id": exc.operation_id}) + "\n")
            else:
                err.write(f"recoverable {command}: {exc.code}: {exc}\n")
            return EXIT_FAILED


_TARGET_STATE = {
    "acknowledge": "acknowledged",
    "abandon": "abandoned",
    "suspend": "suspended",
    "cancel": "cancelled",
}


def _lifecycle_message(command: str, operation_id: str, status: Status) -> str:
    """What happened, truthfully: a command on an operation another process is running
    is requested (that process applies it at its next check), not done yet."""
    if status.state == _TARGET_STATE[command]:
        return f"{command}: {operation_id} is now {status.state}\n"
    return (
        f"{command}: requested; {operation_id} is {status.state} in another process, which "
        f"applies the {command} at its next check (see `recoverable status`)\n"
    )


def _cancel_refusal(rt: Runtime, operation_id: str) -> str | None:
    """Cancel fences delivery: a saved, validated (paid) result could never be read."""
    try:
        status = rt.status_of(operation_id)
    except errors.RecoveryError:
        return None  # the cancel itself reports it
    if not status.has_saved_completion:
        return None
    return (
        f"{operation_id} has a saved, validated result: cancel discards it for good (it can "
        "never be read or delivered). Read it with `recoverable receipt` (then acknowledge), "
        "or pass --force to cancel anyway"
    )


async def _retry(
    rt: Runtime, operation_id: str, args: argparse.Namespace, out: IO[str]
) -> int:
    source = rt.status_of(operation_id)
    successor = await rt.retry(
        Handle(operation_id),
        retry_action_id=args.action_id,
        maximum_attempts=args.max_attempts or source.maximum_attempts,
        selection=args.selection,
    )
    status = rt.status_of(successor.operation_id)
    if args.json:
        out.write(_encode_json(status))
    else:
        out.write(
            f"retry: {successor.operation_id} is the successor of {operation_id} "
            f"({status.maximum_attempts} attempt(s), selection {args.selection}); nothing "
            "was sent. A rerun of the batch runs the successor for this job.\n"
        )
    return EXIT_OK


async def _acknowledge(rt: Runtime, handle: Handle) -> None:
    await rt.acknowledge(handle)


async def _abandon(rt: Runtime, handle: Handle) -> None:
    await rt.abandon(handle)


async def _suspend(rt: Runtime, handle: Handle) -> None:
    await rt.suspend(handle)


async def _cancel(rt: Runtime, handle: Handle) -> None:
    await rt.cancel(handle)


_LIFECYCLE: dict[str, Callable[[Runtime, Handle], Any]] = {
    "acknowledge": _acknowledge,
    "abandon": _abandon,
    "suspend": _suspend,
    "cancel": _cancel,
}


def _purge(
    store: RecoveryStore,
    account: AccountBinding,
    args: argparse.Namespace,
    out: IO[str],
    err: IO[str],
) -> int:
    purge = getattr(store, "purge_account", None)
    if purge is None:
        err.write("recoverable purge: not available in this version of the store\n")
        return EXIT_USAGE
    try:
        result = purge(account, scope=args.scope)
        if inspect.isawaitable(result):

            async def wait() -> Any:
                return await result

            result = trio.run(wait)
    except errors.RecoveryError as exc:
        err.write(f"recoverable purge: {exc.code}: {exc}\n")
        return EXIT_FAILED
    if args.json:
        out.write(_encode_json(result))
    else:
        removed = getattr(result, "removed", ())
        skipped = getattr(result, "skipped", ())
        out.write(f"purged {len(removed)} record(s) of account {account.account_id!r}")
        out.write(f"; skipped {len(skipped)} (busy or unreadable)\n" if skipped else "\n")
        for op_id in skipped:
            out.write(f"  skipped {op_id}\n")
    return EXIT_OK


# -- output -------------------------------------------------------------------------------------


def _encode_json(value: Any) -> str:
    if isinstance(value, Inventory):
        value = printable_inventory(value)
    return msgspec.json.encode(value).decode() + "\n"


def printable_inventory(inventory: Inventory) -> Inventory:
    """Ids read back from a damaged store may not be text (lone surrogates): escaped,
    so that printing or encoding them never crashes."""
    def fix(status: Status) -> Status:
        return msgspec.structs.replace(
            status,
            operation_id=safe_text(status.operation_id),
            job_id=None if status.job_id is None else safe_text(status.job_id),
            input_revision=(
                None if status.input_revision is None else safe_text(status.input_revision)
            ),
            scope=None if status.scope is None else safe_text(status.scope),
        )

    return Inventory(
        operations=tuple(fix(s) for s in inventory.operations),
        unreadable=tuple(safe_text(op_id) for op_id in inventory.unreadable),
    )


def safe_text(text: str) -> str:
    """``text`` with what cannot be encoded (lone surrogates) as backslash escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def receipt_json(receipt: Receipt) -> str:
    """The Receipt as msgspec encodes it (payload base64), plus the decoded ``result``."""
    data = msgspec.to_builtins(receipt)
    try:
        data["result"] = msgspec.json.decode(receipt.payload)
    except msgspec.DecodeError:
        data["result"] = None
    return msgspec.json.encode(data).decode() + "\n"


def _rows(rows: Sequence[tuple[str, object]]) -> str:
    shown = [(k, v) for k, v in rows if v not in (None, "", (), frozenset())]
    width = max(len(k) for k, _ in shown)
    return "".join(f"{k.ljust(width)}  {v}\n" for k, v in shown)


def format_status(status: Status) -> str:
    failure = status.last_failure
    rows: list[tuple[str, object]] = [
        ("operation", status.operation_id),
        ("state", status.state),
        ("availability", status.availability),
        ("blockers", ", ".join(sorted(status.blockers))),
        (
            "attempts",
            f"{status.attempts_used} of {status.maximum_attempts} used, "
            f"{status.attempts_remaining} remaining",
        ),
        ("saved result", "yes" if status.has_saved_completion else "no"),
        ("job", status.job_id),
        ("revision", status.input_revision),
        ("scope", status.scope),
        ("model", status.model),
        ("next attempt at", status.next_attempt_at.isoformat() if status.next_attempt_at else None),
        ("expires at", status.expires_at.isoformat() if status.expires_at else None),
        ("rate limited", (
            f"{status.rate_limited} until {status.rate_limited_until.isoformat()}"
            if status.rate_limited and status.rate_limited_until else status.rate_limited
        )),
        ("last failure", _failure(failure) if failure is not None else None),
        ("tokens", usage_text(status.usage)),
        ("tokens per attempt", attempts_usage_text((a.number, a.usage) for a in status.attempts)),
        ("output token budget", status.maximum_output_tokens_total),
        ("response id", status.response_id),
        ("suggested", ", ".join(status.suggested_actions)),
        ("redacted", "yes (another account)" if status.redacted else None),
    ]
    return _rows(rows)


def _failure(failure: Any) -> str:
    parts = [failure.kind]
    if failure.http_status is not None:
        parts.append(f"http {failure.http_status}")
    if failure.provider_code:
        parts.append(failure.provider_code)
    return " / ".join(parts)


def format_inventory(inventory: Inventory) -> str:
    header = ("OPERATION", "STATE", "AVAILABILITY", "ATTEMPTS", "JOB", "REVISION")
    rows = [
        (
            s.operation_id,
            s.state,
            s.availability,
            f"{s.attempts_used}/{s.maximum_attempts}",
            s.job_id or "-",
            s.input_revision or "-",
        )
        for s in inventory.operations
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in [header, *rows]]
    text = "\n".join(lines) + "\n"
    text += f"{len(rows)} operation(s)\n"
    for op_id in inventory.unreadable:
        text += f"unreadable record: {op_id}\n"
    return safe_text(text)


def format_receipt(receipt: Receipt) -> str:
    try:
        result = json.dumps(msgspec.json.decode(receipt.payload), indent=2, ensure_ascii=False)
    except msgspec.DecodeError:
        result = "<not JSON>"
    rows: list[tuple[str, object]] = [
        ("operation", receipt.operation_id),
        ("job", receipt.job_id),
        ("revision", receipt.input_revision),
        ("scope", receipt.scope),
        ("format", receipt.format_name),
        ("completed at", receipt.completed_at.isoformat()),
        ("response id", receipt.response_id),
        ("tokens", usage_text(receipt.usage)),
    ]
    return _rows(rows) + "result:\n" + result + "\n"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
