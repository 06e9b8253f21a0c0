"""The command line's arguments: the parser of every command and its value checks."""

from __future__ import annotations

import argparse
import math
from typing import Final, NoReturn

from recoverable import errors
from recoverable.cli.config import DEFAULT_RETRY_PROVIDER_CODES, MINIMUM_RPS
from recoverable.cli.exits import UsageError
from recoverable.outcome import bounded_code
from recoverable.transport.fixture import FaultSpec

__all__ = ["NEEDS_ACCOUNT", "OPS_COMMANDS", "build_parser"]

OPS_COMMANDS: Final = (
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
_OPS_HELP: Final = {
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
_NEEDS_ID: Final = frozenset(
    {"status", "receipt", "acknowledge", "abandon", "suspend", "cancel", "retry"}
)
# Every command but ``status`` acts on (or reveals) an account's operations: it needs
# ``--account`` and never falls back to the operation's own account. ``status`` without
# it shows only the redacted status (that the operation exists).
NEEDS_ACCOUNT: Final = frozenset(OPS_COMMANDS) - {"status"}
MAXIMUM_RPS: Final = 100_000.0


class _Parser(argparse.ArgumentParser):
    """Argument errors are raised (and printed by ``main``, as JSON with ``--json``)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}\n{self.format_usage().strip()}")


# -- value checks ---------------------------------------------------------------------------


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


def _finite(text: str, *, zero: bool) -> float:
    """A finite number above zero (or at least zero, with ``zero``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        what = "a non-negative" if zero else "a positive"
        raise argparse.ArgumentTypeError(f"must be {what} number: {text!r}")
    return value


def _positive_float(text: str) -> float:
    return _finite(text, zero=False)


def _non_negative_float(text: str) -> float:
    return _finite(text, zero=True)


def _provider_codes(text: str) -> frozenset[str]:
    codes = frozenset(part.strip() for part in text.split(",") if part.strip())
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


def _workers(text: str) -> int:
    value = _non_negative_int(text)
    if value > 64:
        raise argparse.ArgumentTypeError(f"must be in 0..64: {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0 or value > 10_000:
        raise argparse.ArgumentTypeError(f"must be in 0..10000: {text!r}")
    return value


def _revision(text: str) -> str:
    if not 1 <= len(text) <= 256 or any(ord(char) < 32 for char in text):
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


# -- the parser -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="recoverable",
        description="Durable, crash-safe structured LLM requests: batch host and store tools.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_batch(sub)
    _add_worker(sub)
    for name in OPS_COMMANDS:
        _add_ops_command(sub, name)
    _add_sweep(sub)
    _add_source(sub)
    _add_dashboard(sub)
    _add_config(sub)
    _add_db(sub)
    migrate = sub.add_parser(
        "migrate-store",
        help="copy a store's rows into an empty store (e.g. LMDB -> postgresql://...)",
    )
    migrate.add_argument("source", metavar="SRC", help="a store directory or URL")
    migrate.add_argument("destination", metavar="DST", help="an empty store (DIR or URL)")
    sub.add_parser(
        "fixture-provider",
        help="run the loopback fixture Responses provider",
        add_help=False,
    )
    return parser


def _add_db(sub: argparse._SubParsersAction[_Parser]) -> None:
    db = sub.add_parser("db", help="PostgreSQL store maintenance: db upgrade --store URL")
    db.add_argument("action", choices=("upgrade",), help="upgrade: migrate the schema")
    db.add_argument("--store", required=True, metavar="URL", help="postgresql://user@host/db")


def _add_batch(sub: argparse._SubParsersAction[_Parser]) -> None:
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
    batch.add_argument(
        "--store", metavar="DIR|URL",
        help="recovery store: a directory (LMDB) or postgresql://user@host/db "
        "(default: <out>.store)",
    )
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
        "--on-interruption",
        choices=("replace", "fail"),
        default="replace",
        help="what an interrupted attempt (disconnect, idle timeout, crash) means for a "
        "job: replace it within the budget (default) or fail the job, never replaced",
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
        "--workers", type=_workers, default=0, metavar="N",
        help="run the jobs in N `recoverable worker` processes on the store (many cores; "
        "--concurrency is then per worker); 0 (default): in this process",
    )
    batch.add_argument(
        "--worker-restarts", type=_non_negative_int, metavar="N",
        help="replace a worker process that dies at most N times in all (default: 4 per "
        "worker), then stop with worker_restarts_exhausted",
    )
    batch.add_argument(
        "--prices",
        metavar="FILE",
        help="JSON price table for the cost estimate: model -> {input, cached_input, output} "
        "in USD per 1M tokens (default: a small dated built-in estimate)",
    )


def _add_sweep(sub: argparse._SubParsersAction[_Parser]) -> None:
    sweep = sub.add_parser(
        "sweep",
        help="close every operation whose owner is gone (store-wide): each becomes waiting "
        "for adoption or honestly failed (owner_lost, expired)",
    )
    sweep.add_argument("--store", required=True, metavar="DIR|URL")
    sweep.add_argument(
        "--unclaimed-after", type=_non_negative_float, metavar="SECONDS",
        help="also fail (no_worker) runnable operations no process has run for SECONDS "
        "since they became runnable",
    )
    sweep.add_argument("--json", action="store_true", help="machine output (JSON)")


def _add_source(sub: argparse._SubParsersAction[_Parser]) -> None:
    """``recoverable source set KEY DIGEST | delete KEY`` (issue 16, cli/source.py)."""
    source = sub.add_parser(
        "source",
        help="update the source manifest: a new digest (or deletion) supersedes the "
        "operations bound to the old one",
    )
    actions = source.add_subparsers(dest="source_action", metavar="ACTION", required=True)
    set_parser = actions.add_parser("set", help="make DIGEST the current digest of KEY")
    set_parser.add_argument("key", metavar="KEY")
    set_parser.add_argument("digest", metavar="DIGEST")
    delete_parser = actions.add_parser("delete", help="remove KEY from the manifest")
    delete_parser.add_argument("key", metavar="KEY")
    for parser in (set_parser, delete_parser):
        parser.add_argument("--store", required=True, metavar="DIR")
        parser.add_argument("--json", action="store_true", help="machine output (JSON)")


CONFIG_KEYS = ("continuation.enabled", "continuation.delay_seconds", "continuation.budget")


def _add_config(sub: argparse._SubParsersAction[_Parser]) -> None:
    """``recoverable config get|set KEY [VALUE] --store DIR [--json]`` (issue 18)."""
    config = sub.add_parser(
        "config",
        help="read or change a store-wide preference (continuation.enabled: the opt-in "
        "continuation after terminal stream failures; off by default)",
    )
    action = config.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    get = action.add_parser("get", help="print a preference")
    get.add_argument("key", choices=CONFIG_KEYS)
    put = action.add_parser("set", help="change a preference (it persists)")
    put.add_argument("key", choices=CONFIG_KEYS)
    put.add_argument("value")
    for parser in (get, put):
        parser.add_argument("--store", required=True, metavar="DIR")
        parser.add_argument("--json", action="store_true", help="machine output (JSON)")


def _add_worker(sub: argparse._SubParsersAction[_Parser]) -> None:
    worker = sub.add_parser(
        "worker",
        help="run queued operations of a store (until SIGTERM/SIGINT)",
        description=(
            "Claim queued and orphaned operations of one account and endpoint on --store "
            "(runtime.submit queues them), run them and save their receipts. SIGTERM or "
            "SIGINT suspends the running ones durably for the next worker. Default "
            "authorization: every attempt the operation's saved budget allows."
        ),
    )
    where = worker.add_mutually_exclusive_group(required=True)  # exactly one (else exit 2)
    where.add_argument("--store", metavar="DIR|URL", help="the store: a directory or a URL")
    where.add_argument(
        "--store-env", metavar="VAR",
        help="read the store's directory or URL from the environment variable VAR (what "
        "batch --workers passes: a URL's password stays out of the process list)",
    )
    worker.add_argument(
        "--endpoint", default="fixture", metavar="URL|fixture",
        help="a Responses-compatible base URL, or 'fixture' (an embedded provider)",
    )
    worker.add_argument(
        "--fixture-url", metavar="URL",
        help="a fixture provider already serving at URL (what batch --workers passes)",
    )
    worker.add_argument("--api-key-env", default="OPENAI_API_KEY", metavar="VAR")
    worker.add_argument(
        "--account", metavar="ID",
        help="the account whose operations it runs (default: as recoverable batch's)",
    )
    worker.add_argument("--mode", choices=("websocket", "sse"), default="websocket")
    worker.add_argument(
        "--concurrency", type=_positive_int, default=64, metavar="N",
        help="operations run at once (default 64)",
    )
    worker.add_argument(
        "--authorizer", metavar="MODULE:CALLABLE",
        help="the host's authorization policy, called with each Attempt (default: every "
        "attempt the saved budget allows)",
    )
    worker.add_argument(
        "--idle-timeout", type=_positive_float, default=120.0, metavar="SECONDS",
        help="a stream silent this long is interrupted (and replaced)",
    )
    worker.add_argument(
        "--lease-seconds", type=_positive_float, default=30.0, metavar="SECONDS",
        help="how long a claim lives unless the worker's heartbeat renews it (1..3600; a "
        "hung worker's operations are reclaimed by another worker after it)",
    )


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535: {text!r}")
    return value


def _add_dashboard(sub: argparse._SubParsersAction[_Parser]) -> None:
    dashboard = sub.add_parser(
        "dashboard",
        help="serve the operator's web dashboard over a store (docs/dashboard.md)",
        description=(
            "Serve a local web dashboard over --store: live counts, failures, owners, one "
            "page per operation, and its actions (with --account). Prints one JSON line "
            "with the URL (it carries the access token), then serves until Ctrl-C."
        ),
    )
    dashboard.add_argument("--store", required=True, metavar="DIR|URL")
    dashboard.add_argument("--host", default="127.0.0.1",
                           help="address to listen on (default 127.0.0.1: this machine only)")
    dashboard.add_argument("--port", type=_port, default=0,
                           help="port (default 0: a free one, printed)")
    dashboard.add_argument(
        "--account", metavar="ID",
        help="the account to act within: without it the dashboard is read-only",
    )
    dashboard.add_argument(
        "--show-content", action="store_true",
        help="also show the frozen request and the saved result of --account's operations",
    )


def _add_ops_command(sub: argparse._SubParsersAction[_Parser], name: str) -> None:
    command = sub.add_parser(name, help=_OPS_HELP[name])
    command.add_argument("--store", required=True, metavar="DIR|URL")
    command.add_argument(
        "--account",
        metavar="ID",
        required=name in NEEDS_ACCOUNT,
        help="the account the operations belong to; the command acts only within it"
        + (" (without it, status is redacted)" if name == "status" else ""),
    )
    if name in _NEEDS_ID:
        command.add_argument("operation_id", metavar="OPERATION_ID")
    match name:
        case "inventory" | "purge":
            command.add_argument("--scope", help="only operations with this host scope")
        case "cancel":
            command.add_argument(
                "--force",
                action="store_true",
                help="cancel even though a validated result is saved (it is discarded)",
            )
        case "retry":
            command.add_argument(
                "--action-id", required=True, metavar="ID",
                help="names this decision: repeating it returns the same successor",
            )
            command.add_argument(
                "--max-attempts", type=_attempts, metavar="N",
                help="the successor's total attempt budget (default: the source's)",
            )
            command.add_argument(
                "--selection", choices=("preserve", "reselect"), default="preserve",
                help="preserve the frozen request (default) or rebuild it from the saved one",
            )
    command.add_argument("--json", action="store_true", help="machine output (JSON)")
