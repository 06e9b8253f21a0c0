"""The command line's arguments: the parser of every command and its value checks."""

from __future__ import annotations

import argparse
import math
import re
from typing import Final, NoReturn

from recoverable import errors
from recoverable.actors.governor import DEFAULT_BURST_SECONDS, MINIMUM_PER_MINUTE
from recoverable.actors.heartbeat import LEASE_SECONDS_MAX, LEASE_SECONDS_MIN
from recoverable.actors.worker import MAX_CONCURRENCY
from recoverable.cli.bulk_arguments import BULK_COMMANDS, add_bulk_arguments
from recoverable.cli.config import DEFAULT_RETRY_PROVIDER_CODES, MINIMUM_RPS
from recoverable.cli.exits import UsageError
from recoverable.cli.jobs import id_problem
from recoverable.cli.paging import DEFAULT_LIMIT, MAX_LIMIT
from recoverable.fixture.provider import FaultSpec
from recoverable.outcome import bounded_code
from recoverable.preconditions import MAX_ATTEMPTS, MAX_COST_TOTAL
from recoverable.transport.connect import UNREACHABLE_AFTER
from recoverable.transport.modes import DEFAULT_MODE, MODES

__all__ = [
    "NEEDS_ACCOUNT",
    "OPS_COMMANDS",
    "ascii_decimal",
    "ascii_int",
    "ascii_number",
    "build_parser",
]

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
MAXIMUM_WORKERS: Final = 64  # batch --workers: worker processes
MAXIMUM_PER_MINUTE: Final = 1e12  # --rpm/--tpm: 0.01..1e12 (as the governor's validate_limits)
MAXIMUM_BURST_SECONDS: Final = 3600.0  # --rate-burst-seconds (as validate_limits)


class _Parser(argparse.ArgumentParser):
    """Argument errors are raised (and printed by ``main``, as JSON with ``--json``)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}\n{self.format_usage().strip()}")


# -- value checks ---------------------------------------------------------------------------
#
# Numbers are ASCII: ``int()`` and ``float()`` alone also take other scripts' digits
# (Arabic-Indic U+0663, fullwidth U+FF13), underscores ("1_000"), surrounding spaces and
# words ("nan", "inf").
# Each bounded option states its one real range, whatever side its value falls out on.

_ASCII_INTEGER: Final = re.compile(r"-?[0-9]+")
_ASCII_DECIMAL: Final = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")
_ASCII_NUMBER: Final = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_MAX_DIGITS: Final = 18  # beyond every range here; int() of a longer text is not needed


def ascii_int(text: str) -> int | None:
    """``text`` as an integer written in ASCII digits (an optional leading ``-``), else
    None. A number of more than 18 digits reads as ±10**18, outside every range."""
    if not _ASCII_INTEGER.fullmatch(text):
        return None
    if len(text.lstrip("-")) > _MAX_DIGITS:
        return -(10**_MAX_DIGITS) if text.startswith("-") else 10**_MAX_DIGITS
    return int(text)


def ascii_decimal(text: str) -> float | None:
    """``text`` as a plain ASCII decimal (``120``, ``1.5``, an optional leading ``-``; no
    exponent, no ``nan``/``inf``), else None."""
    return float(text) if _ASCII_DECIMAL.fullmatch(text) else None


def ascii_number(text: str) -> float | None:
    """``text`` as an ASCII number, with an optional exponent (``1e6``), else None. A
    value too large for a float reads as infinite (outside every range)."""
    return float(text) if _ASCII_NUMBER.fullmatch(text) else None


def _int_in(text: str, low: int, high: int, unit: str = "") -> int:
    value = ascii_int(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"not an integer (ASCII digits): {text!r}")
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be in {low}..{high}{unit}: {text!r}")
    return value


def _number(text: str) -> float:
    value = ascii_number(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"not a number (ASCII digits): {text!r}")
    return value


def _shown(value: float) -> str:
    return f"{value:g}".replace("e+", "e")  # 1e12, not 1e+12


def _number_in(text: str, low: float, high: float, unit: str = "") -> float:
    """A number in ``low..high``; ``low == 0`` means above 0."""
    value = _number(text)
    if not (low < value if low == 0 else low <= value) or not value <= high:
        where = (f"above 0 and at most {_shown(high)}" if low == 0
                 else f"in {_shown(low)}..{_shown(high)}")
        raise argparse.ArgumentTypeError(f"must be a number {where}{unit}: {text!r}")
    return value


def _max_cost(text: str) -> float:
    return _number_in(text, 0, MAX_COST_TOTAL, " USD")


def _concurrency(text: str) -> int:
    return _int_in(text, 1, MAX_CONCURRENCY)  # what a runtime's worker accepts


# ``recoverable worker --concurrency`` (``_add_worker``) takes the same check by this name.
_positive_int = _concurrency


def _attempts(text: str) -> int:
    return _int_in(text, 1, MAX_ATTEMPTS)


def _finite(text: str, *, zero: bool) -> float:
    """A finite number above zero (or at least zero, with ``zero``)."""
    value = _number(text)
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        what = "a non-negative" if zero else "a positive"
        raise argparse.ArgumentTypeError(f"must be {what} number: {text!r}")
    return value


def _positive_float(text: str) -> float:
    return _finite(text, zero=False)


def _non_negative_float(text: str) -> float:
    return _finite(text, zero=True)


def _unreachable_after(text: str) -> float:
    """Seconds (ASCII, at least 0), or ``inf``: no bound."""
    return math.inf if text == "inf" else _finite(text, zero=True)


def _provider_codes(text: str) -> frozenset[str]:
    codes = frozenset(part.strip() for part in text.split(",") if part.strip())
    for code in codes:
        if bounded_code(code) != code:
            raise argparse.ArgumentTypeError(f"not a provider code: {code[:80]!r}")
    return codes


def _rps(text: str) -> float:
    return _number_in(text, MINIMUM_RPS, MAXIMUM_RPS, " POSTs per second")


def _workers(text: str) -> int:
    return _int_in(text, 0, MAXIMUM_WORKERS)


def _worker_restarts(text: str) -> int:
    return _int_in(text, 0, 10_000)


def _revision(text: str) -> str:
    problem = id_problem(text)  # the one rule for ids (cli/jobs.py)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def _per_minute(text: str) -> float:
    # --rpm/--tpm: any value from the governor's floor admits requests (at the limit's own
    # rate, also when one request is larger than its bucket: docs/rate-limits.md).
    return _number_in(text, MINIMUM_PER_MINUTE, MAXIMUM_PER_MINUTE, " per minute")


def _burst_seconds(text: str) -> float:
    return _number_in(text, 0, MAXIMUM_BURST_SECONDS, " seconds")


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


def _add_shared_limits(parser: argparse.ArgumentParser) -> None:
    """``--rpm``/``--tpm``/``--rate-burst-seconds``: the rate governor's limits, shared by
    every process on the store (``batch`` passes them to its ``--workers``)."""
    parser.add_argument(
        "--rpm", type=_per_minute, metavar="N",
        help="requests per minute (0.01..1e12), shared by every process on the store "
        "(docs/rate-limits.md)",
    )
    parser.add_argument(
        "--tpm", type=_per_minute, metavar="N",
        help="tokens per minute (0.01..1e12; estimated from each request, corrected by its "
        "usage), shared by every process on the store",
    )
    parser.add_argument(
        "--rate-burst-seconds", type=_burst_seconds, default=DEFAULT_BURST_SECONDS,
        metavar="S", help="--rpm/--tpm budget that may be spent at once, in seconds of "
        "refill (default 5: no 60 s window holds more than the limit)",
    )


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
    batch.add_argument("--mode", choices=MODES, default=DEFAULT_MODE)
    batch.add_argument(
        "--concurrency", type=_concurrency, default=64, metavar="N",
        help=f"operations run at once (1..{MAX_CONCURRENCY}, default 64)",
    )
    batch.add_argument(
        "--rps", type=_rps, metavar="R",
        help=f"max POSTs per second ({MINIMUM_RPS:g}..{MAXIMUM_RPS:g})",
    )
    _add_shared_limits(batch)
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
        "--unreachable-after", type=_unreachable_after, default=UNREACHABLE_AFTER,
        metavar="SECONDS",
        help="end the batch (exit 1, the jobs unfinished, nothing spent) once the endpoint "
        "could not be connected to for SECONDS (default 300; 'inf': wait without end)",
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
        help="run the jobs in N (0..64) `recoverable worker` processes on the store (many cores; "
        "--concurrency is then per worker, --rpm/--tpm shared by all); 0 (default): in this "
        "process",
    )
    batch.add_argument(
        "--worker-restarts", type=_worker_restarts, metavar="N",
        help="replace a worker process that dies at most N times in all (default: 4 per "
        "worker), then stop with worker_restarts_exhausted",
    )
    batch.add_argument(
        "--prices",
        metavar="FILE",
        help="JSON price table for the cost estimate and --max-cost: model -> {input, "
        "cached_input, output} in USD per 1M tokens; it takes precedence over genai-prices "
        "(the default source, the prices extra) for the models it names",
    )
    batch.add_argument(
        "--max-cost", type=_max_cost, metavar="USD",
        help="each job's cost budget (maximum_cost_total): once the cost of the usage its "
        "attempts reported reaches it, no replacement is sent and the job fails "
        "cost_budget_exhausted; refused before anything runs when a job's model has no price",
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
    """``recoverable source set KEY DIGEST | delete KEY`` (source manifest, cli/source.py)."""
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
        _add_paging(parser, SUPERSEDED_LIMIT, cursor=False)


SUPERSEDED_LIMIT: Final = 100  # superseded ids a source change prints unless --limit says


def _limit(text: str) -> int:
    return _int_in(text, 0, MAX_LIMIT)


def _add_paging(parser: argparse.ArgumentParser, default: int, *, cursor: bool) -> None:
    """``--limit N`` (and ``--after ID``): a long listing is printed a page at a time."""
    parser.add_argument(
        "--limit", type=_limit, default=default, metavar="N",
        help=f"print at most N operation ids (default {default}; 0: all), with the total",
    )
    if cursor:
        parser.add_argument(
            "--after", metavar="OPERATION_ID",
            help="the next page: only the operations after this id (printed as the cursor)",
        )


CONFIG_KEYS = ("continuation.enabled", "continuation.delay_seconds", "continuation.budget")


def _add_config(sub: argparse._SubParsersAction[_Parser]) -> None:
    """``recoverable config get|set KEY [VALUE] --store DIR [--json]`` (store-wide preferences)."""
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
    worker.add_argument("--mode", choices=MODES, default=DEFAULT_MODE)
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
        "--unreachable-after", type=_unreachable_after, default=UNREACHABLE_AFTER,
        metavar="SECONDS",
        help="exit (code 69; its operations stay queued, nothing spent) once the endpoint "
        "could not be connected to for SECONDS (default 300; 'inf': wait without end)",
    )
    worker.add_argument(
        "--lease-seconds", type=_lease_seconds, default=30.0, metavar="SECONDS",
        help="how long a claim lives unless the worker's heartbeat renews it (1..3600; a "
        "hung worker's operations are reclaimed by another worker after it)",
    )
    worker.add_argument(
        "--stop-with-stdin", action="store_true",
        help="stop (as on SIGTERM) when standard input is closed: batch --workers passes it, "
        "so its workers stop with the batch however it ends",
    )
    _add_shared_limits(worker)  # what batch --workers passes: the same limits, fleet-wide


def _lease_seconds(text: str) -> float:
    return _number_in(text, LEASE_SECONDS_MIN, LEASE_SECONDS_MAX, " seconds")


def _port(text: str) -> int:
    return _int_in(text, 0, 65535)


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
                           help="address to listen on (default 127.0.0.1: this machine only; "
                           "any other than a loopback address needs --allow-remote)")
    dashboard.add_argument(
        "--allow-remote", action="store_true",
        help="allow a --host other machines can reach (plain http: the token and the session "
        "travel unencrypted); a warning is printed on stderr",
    )
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
    dashboard.add_argument(
        "--prices", metavar="FILE",
        help="JSON price table for the cost estimate, as batch's --prices: model -> {input, "
        "cached_input, output} in USD per 1M tokens (default: genai-prices, the prices extra)",
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
        command.add_argument("operation_id", metavar="OPERATION_ID",
                             nargs="?" if name in BULK_COMMANDS else None)
    if name in BULK_COMMANDS:
        add_bulk_arguments(command, name)
    match name:
        case "inventory" | "purge":
            command.add_argument("--scope", help="only operations with this host scope")
        case "cancel":
            command.add_argument(
                "--force",
                action="store_true",
                help="cancel even though a validated result is saved (it is never delivered)",
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
    if name == "inventory":
        _add_paging(command, DEFAULT_LIMIT, cursor=True)
    command.add_argument("--json", action="store_true", help="machine output (JSON)")
