"""``recoverable batch``: a JSONL file of jobs, run durably.

Every job is one recovery operation keyed by ``(id, revision)`` in scope
``"batch"`` (see ``recoverable.cli.host``). The output file is the host's own commit log
(``recoverable.cli.result_log``): one fsynced JSON line per committed job, and an
operation is acknowledged only after its line is durable. A rerun reads the log back
(dropping a torn last line), adopts the operations it finds in the store for uncommitted
jobs instead of preparing again, and acknowledges committed jobs whose acknowledgement was
lost. Cancellation (Ctrl-C) suspends every running operation; nothing saved is generated
again.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable
from typing import IO

import attrs
import trio

from recoverable import errors
from recoverable.actors.runtime import Runtime, open_runtime
from recoverable.cli.batch_workers import WorkersHost
from recoverable.cli.config import BatchConfig
from recoverable.cli.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE
from recoverable.cli.gc_tuning import tuned_collector
from recoverable.cli.host import BatchHost
from recoverable.cli.jobs import Job, JobsFile, read_jobs
from recoverable.cli.output_files import BatchFiles, check_batch_files
from recoverable.cli.progress import Messages, ProgressDisplay, Terminal
from recoverable.cli.provider import FIXTURE_NOTICE, batch_account, open_backend
from recoverable.cli.report import BatchSummary, ErrorLog, JobError
from recoverable.cli.result_log import ResultLog, ResultLogError
from recoverable.cli.store_binding import bind_result_log
from recoverable.pricing import default_prices
from recoverable.storage.store import RecoveryStore, redact_url, url_scheme
from recoverable.transport.base import validate_api_key
from recoverable.transport.connect import EndpointGate

__all__ = ["run_batch"]


class _EndpointReporter:
    """One message when the endpoint becomes unreachable, one when it is back."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.shown: str | None = None  # the failure last told

    def changed(self, gate: EndpointGate) -> None:
        if gate.failure is not None and self.shown is None:
            bound = gate.unreachable_after
            until = f" for up to {bound:g} s (--unreachable-after)" if bound < math.inf else ""
            self.say(f"endpoint unavailable ({gate.failure}): jobs wait and spend nothing; "
                     f"retrying with backoff{until} (Ctrl-C suspends them; a rerun resumes)")
        elif gate.failure is None and self.shown is not None:
            self.say("endpoint reachable again")
        self.shown = gate.failure


@attrs.define(eq=False)
class _BatchRun:
    """One batch inside ``trio.run``: the host, its progress display and the signals."""

    config: BatchConfig
    jobs: list[Job]
    log: ResultLog
    store: RecoveryStore
    summary: BatchSummary
    messages: Messages
    errors_log: ErrorLog | None
    # Cancelled by Ctrl-C or a fatal output error.
    work: trio.CancelScope = attrs.field(init=False, factory=trio.CancelScope)
    started: float = attrs.field(init=False, factory=time.monotonic)

    async def run(self) -> None:
        self.started = time.monotonic()
        try:
            async with trio.open_nursery() as top:
                # Installed for the whole run: Ctrl-C is a message here, never an exception
                # raised in the middle of a state change.
                top.start_soon(self._watch_interrupts)
                try:
                    with tuned_collector():  # the collector's setting for a run (gc_tuning)
                        await self._run_host()
                finally:
                    top.cancel_scope.cancel()
        finally:
            self.summary.elapsed = time.monotonic() - self.started

    async def _run_host(self) -> None:
        config, summary = self.config, self.summary
        account = batch_account(config)
        async with (
            open_backend(config, account) as backend,
            open_runtime(
                self.store,
                backend,
                account=account,
                max_concurrency=config.concurrency,
                requests_per_second=config.rps,
                requests_per_minute=config.rpm,
                tokens_per_minute=config.tpm,
                rate_burst_seconds=config.rate_burst_seconds,
                unreachable_after=config.unreachable_after,
            ) as rt,
        ):
            host_class = BatchHost if not config.workers else WorkersHost
            host = host_class(rt, self.store, self.log, self.jobs, config, summary,
                              say=self.messages.say, work=self.work, errors_log=self.errors_log)
            self._report_endpoint(rt, backend.endpoint_id)
            display = ProgressDisplay(
                host, self.messages.out, live=self.messages.live, started=self.started
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(display.run)
                with self.work:
                    await host.acknowledge_committed()
                    if config.retry_failed:
                        await host.retry_failed()
                    await host.run()
                nursery.cancel_scope.cancel()
            summary.endpoint_unavailable = rt.endpoint_failure() or summary.endpoint_unavailable
            summary.attempts = host.attempts_spent()
            host.report_suppressed()
            if summary.interrupted or summary.fatal is not None:
                summary.unfinished = (
                    summary.jobs
                    - summary.already_committed
                    - summary.committed
                    - summary.failed_total
                )
            display.draw(final=True)

    def _report_endpoint(self, rt: Runtime, endpoint_id: str) -> None:
        gate = rt.endpoint_gate(endpoint_id)
        gate.listeners.append(_EndpointReporter(self.messages.say).changed)

    async def _watch_interrupts(self) -> None:
        """First Ctrl-C (or SIGTERM): cancel the work, which suspends every running
        operation. Second: exit at once (still safe: the store and the output file are
        crash-consistent)."""
        say = self.messages.say
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                if self.summary.interrupted:
                    say("interrupted again: exiting now (a rerun resumes)")
                    os._exit(EXIT_INTERRUPTED)
                self.summary.interrupted = True
                say("interrupted: suspending running operations (Ctrl-C again to exit at once)")
                self.work.cancel()


def _report_jobs_file(
    config: BatchConfig, jobs_file: JobsFile, summary: BatchSummary, say: Callable[[str], None]
) -> None:
    for bad in jobs_file.bad_lines:
        say(f"{config.jobs_path}:{bad.lineno}: skipped: {bad.reason}")
    for duplicate in jobs_file.duplicates:
        say(f"{config.jobs_path}:{duplicate.line}: duplicate of line {duplicate.first} (same "
            "id and revision); run once")
    for superseded in jobs_file.superseded:
        say(f"{config.jobs_path}:{superseded.line}: superseded by line {superseded.first} "
            "(a newer revision of the same id); not run")
    for conflict in jobs_file.conflicts:
        summary.failed["revision_conflict"] += 1
        say(f"{config.jobs_path}:{conflict.line}: revision_conflict: same id and revision as "
            f"line {conflict.first} but different content; not run (change the revision for "
            "new content)")


def _usage_problem(config: BatchConfig, jobs_file: JobsFile) -> str | None:
    """Why this batch cannot run at all (a usage error), checked before anything is
    opened or sent."""
    if config.revision is not None and jobs_file.format == "recoverable":
        return ("--revision applies to OpenAI Batch API lines only; the job lines of this "
                "file carry their own revision")
    problem = check_batch_files(BatchFiles(
        jobs=config.jobs_path, out=config.out_path, store=config.store_path,
        errors=config.errors_path, prices=config.prices_path,
        store_is_directory=url_scheme(config.store_path) is None,
    ))
    if problem is not None:
        return problem
    unpriced = _unpriced_model(config, jobs_file)
    if unpriced is not None:
        return unpriced
    if config.endpoint != "fixture":
        if not os.environ.get(config.api_key_env):
            return f"the environment variable {config.api_key_env} (--api-key-env) is not set"
        try:
            validate_api_key(
                os.environ[config.api_key_env], what=f"the key in {config.api_key_env}"
            )
        except errors.InvalidCredentials as exc:
            # Before any store or output is touched: a key that cannot be sent is a usage error.
            return str(exc)
    return None


def _unpriced_model(config: BatchConfig, jobs_file: JobsFile) -> str | None:
    """With ``--max-cost``, a job whose model has no price: the budget could not be
    counted, so the batch is refused before anything is sent (fail closed)."""
    if config.max_cost is None:
        return None
    prices = config.prices or default_prices()
    for job in jobs_file.jobs:
        model, tier = job.request.model, job.request.service_tier
        if prices.for_model(model, tier) is None:
            at = "" if tier is None else f" at service tier {tier!r}"
            return (f"--max-cost: no price for model {model!r}{at} (job {job.id!r}), so its "
                    f"cost cannot be counted; prices: {prices.source}. Pass --prices FILE "
                    "naming it (docs/usage.md)")
    return None


def _open_errors_log(
    config: BatchConfig, jobs_file: JobsFile, say: Callable[[str], None]
) -> ErrorLog:
    """The ``--errors`` file, with the lines of the jobs file that are not run (raises
    ``OSError``)."""
    assert config.errors_path is not None
    errors_log = ErrorLog(config.errors_path, config.output_format, say)
    for bad in jobs_file.bad_lines:
        errors_log.write(JobError(
            job_id=bad.job_id, revision=None, lineno=bad.lineno,
            code="invalid_job_line", reason="invalid_job_line", message=bad.reason,
            hint="fix the line (or remove it), then rerun",
        ))
    for conflict in jobs_file.conflicts:
        errors_log.write(JobError(
            job_id=None, revision=None, lineno=conflict.line,
            code="revision_conflict", reason="revision_conflict",
            message=f"same id and revision as line {conflict.first} but different content; "
            "not run",
            hint="change the revision for new content",
        ))
    return errors_log


def _run_logged(
    config: BatchConfig,
    jobs_file: JobsFile,
    log: ResultLog,
    summary: BatchSummary,
    terminal: Terminal,
) -> int | None:
    """Run the batch over its open result log; ``EXIT_USAGE`` when it cannot (told)."""
    errors_log: ErrorLog | None = None
    if config.errors_path is not None:
        try:
            errors_log = _open_errors_log(config, jobs_file, terminal.error)
        except OSError as exc:
            terminal.error(f"recoverable batch: cannot write --errors {config.errors_path}: "
                           f"{exc.strerror or exc}")
            return EXIT_USAGE
        summary.errors_path = config.errors_path
    started = False
    try:
        try:
            store = RecoveryStore.open(config.store_path)
        except errors.RecoveryError as exc:
            terminal.error(f"recoverable batch: cannot open the store: {exc}")
            return EXIT_USAGE
        try:
            try:
                refused = bind_result_log(store, batch_account(config), log.path,
                                          store_name=redact_url(config.store_path))
            except errors.RecoveryError as exc:
                terminal.error(f"recoverable batch: cannot use the store: {exc.code}: {exc}")
                return EXIT_FAILED
            if refused is not None:
                terminal.error(f"recoverable batch: {refused}")
                return EXIT_USAGE
            messages = Messages(terminal, live=terminal.isatty())
            run = _BatchRun(config, jobs_file.jobs, log, store, summary, messages, errors_log)
            started = True
            try:
                trio.run(run.run, restrict_keyboard_interrupt_to_checkpoints=True)
            except BaseException as exc:
                if not _only(exc, KeyboardInterrupt):
                    raise
                summary.interrupted = True  # Ctrl-C before the signal watcher was installed
        finally:
            store.close()
    finally:
        if errors_log is not None and not started:
            errors_log.discard()  # refused before it ran: the errors file stays as it was
        elif errors_log is not None:
            errors_log.close()
            summary.errors_written = errors_log.written
    return None


def run_batch(config: BatchConfig, *, out: IO[str] | None, err: IO[str] | None) -> int:
    """Run a whole batch; return the exit code (0 ok, 1 failures, 2 usage, 130 interrupted).

    ``out`` may be ``None`` (a closed stdout) or break during the run: the batch goes on.
    """
    terminal = Terminal(out, err)
    say = terminal.error
    if config.endpoint == "fixture":  # honest default: say so first (and in the summary)
        terminal.write(FIXTURE_NOTICE + "\n")
    try:
        jobs_file = read_jobs(config.jobs_path, revision=config.revision)
    except OSError as exc:
        say(f"recoverable batch: cannot read {config.jobs_path}: {exc.strerror}")
        return EXIT_USAGE
    summary = BatchSummary(
        jobs=len(jobs_file.jobs),
        skipped_lines=len(jobs_file.bad_lines),
        duplicates=len(jobs_file.duplicates),
        superseded=len(jobs_file.superseded),
        retry_provider_codes=tuple(sorted(config.retry_provider_codes)),
        prices=config.prices or default_prices(),
    )
    _report_jobs_file(config, jobs_file, summary, say)
    problem = _usage_problem(config, jobs_file)
    if problem is not None:
        say(f"recoverable batch: {problem}")
        return EXIT_USAGE
    try:
        log = ResultLog.open(config.out_path, config.output_format)
    except ResultLogError as exc:
        say(f"recoverable batch: {exc}")
        return EXIT_USAGE
    except OSError as exc:
        say(f"recoverable batch: cannot use {config.out_path}: {exc}")
        return EXIT_USAGE
    summary.truncated_bytes = log.truncated_bytes
    summary.newline_added = log.newline_added
    summary.maximum_retry_after = config.maximum_retry_after
    try:
        refused = _run_logged(config, jobs_file, log, summary, terminal)
    finally:
        log.close()
    if refused is not None:
        return refused
    if not terminal.write(summary.table() + "\n"):
        terminal.error(summary.table())
    if config.endpoint == "fixture":
        terminal.write(FIXTURE_NOTICE + "\n")
    return summary.exit_code


def _only(exc: BaseException, kind: type[BaseException]) -> bool:
    """``exc`` is ``kind``, or a (nested) exception group made only of ``kind``."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only(inner, kind) for inner in exc.exceptions)
    return isinstance(exc, kind)
