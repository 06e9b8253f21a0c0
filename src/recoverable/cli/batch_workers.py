"""``recoverable batch --workers N``: the jobs run in N worker processes (many cores).

The batch process stays the host: it submits every job that is not committed yet
(``runtime.submit``: prepare + enqueue in one transaction, idempotent by the job's id and
revision in scope ``"batch"``, so a rerun adopts what an earlier run submitted), runs N
``recoverable worker`` child processes on the same store and provider, and waits for each
job's operation (``runtime.wait``). Each validated result goes through the same result
log as ``--workers 0`` (``cli/host.py``, ``cli/result_log.py``): one fsynced line per
job, then the acknowledgement — so every job is committed exactly once, whatever happens
to the workers.

The workers (:class:`WorkerPool`): a worker that exits while the batch still runs (a
crash, SIGKILL, the OOM killer) is replaced; its operations are adopted by the others at
once (their leases died with its owner lock) and their interrupted attempts replaced
within their saved budgets. At most ``--worker-restarts`` replacements in all (default 4
per worker); past it the batch stops with ``worker_restarts_exhausted`` (exit 1, a rerun
resumes). When the batch ends or is interrupted the workers get SIGTERM: they suspend
their running operations durably (flagged for the next worker) and exit.

The embedded fixture provider is served by the batch process on 127.0.0.1; its URL is
passed to the workers (``--fixture-url``). A real endpoint is passed as ``--endpoint`` with
the same ``--api-key-env`` (the key is read by each worker from its environment, never
put on a command line).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import trio

from recoverable import errors, machine
from recoverable.cli.exits import EXIT_STORE_LOST, EXIT_UNAVAILABLE
from recoverable.cli.host import BatchHost, _JobFailed
from recoverable.cli.jobs import Job
from recoverable.cli.provider import batch_account
from recoverable.records import OperationRecord
from recoverable.transitions import FINISHED
from recoverable.types import Handle

__all__ = [
    "RESTARTS_PER_WORKER", "STORE_ENV", "WorkerCommand", "WorkerPool", "WorkersHost",
    "worker_command",
]

RESTARTS_PER_WORKER: Final = 4
MAX_WAITERS: Final = 10_000  # jobs waited for at once (each a cheap poll of the store)


STORE_ENV: Final = "RECOVERABLE_WORKER_STORE"  # the store location, in a worker's environment


class WorkerCommand(list[str]):
    """A worker's command line, and what its environment adds: the store location, which
    never goes on a command line (``ps`` and ``/proc/PID/cmdline`` show those to every
    user of the machine, and a ``postgresql://`` URL may hold a password)."""

    def __init__(self, argv: Iterable[str], env: Mapping[str, str]) -> None:
        super().__init__(argv)
        self.env = dict(env)


def worker_command(host: WorkersHost) -> WorkerCommand:
    """The ``recoverable worker`` command line of this batch's workers; the store is
    passed in their environment (``--store-env``)."""
    config = host.config
    backend = host.rt.backend
    assert backend is not None
    command = [
        sys.executable, "-m", "recoverable", "worker",
        "--store-env", STORE_ENV,
        "--account", batch_account(config).account_id,
        "--mode", config.mode,
        "--concurrency", str(config.concurrency),
        "--idle-timeout", repr(config.idle_timeout),
        "--stop-with-stdin",  # WorkerPool holds the other end: they stop with this batch
        "--unreachable-after", repr(config.unreachable_after),  # then it exits 69
    ]
    # The shared rate limits: every worker claims from the same governor row (the store's),
    # so together they stay within one --rpm/--tpm (docs/rate-limits.md).
    if config.rpm is not None:
        command += ["--rpm", repr(config.rpm)]
    if config.tpm is not None:
        command += ["--tpm", repr(config.tpm)]
    if config.rpm is not None or config.tpm is not None:
        command += ["--rate-burst-seconds", repr(config.rate_burst_seconds)]
    if config.endpoint == "fixture":
        command += ["--fixture-url", getattr(backend, "base_url")]  # noqa: B009
    else:
        command += ["--endpoint", config.endpoint, "--api-key-env", config.api_key_env]
    return WorkerCommand(command, {STORE_ENV: config.store_path})


class WorkerPool:
    """N supervised worker processes; a dead one is replaced within a bound.

    Each runs ``command`` with this process's environment plus ``env`` (by default a
    :class:`WorkerCommand`'s own)."""

    def __init__(
        self,
        command: list[str],
        count: int,
        *,
        max_restarts: int,
        say: Callable[[str], None],
        on_exhausted: Callable[[str], None],
        env: Mapping[str, str] | None = None,
        on_unavailable: Callable[[], None] | None = None,
    ) -> None:
        self.command = list(command)
        if env is None:
            env = command.env if isinstance(command, WorkerCommand) else {}
        self.env = dict(env)
        self.count = count
        self.max_restarts = max_restarts
        self.say = say
        self.on_exhausted = on_exhausted
        # A worker that exits EXIT_UNAVAILABLE (its endpoint stayed unreachable past
        # --unreachable-after) is not replaced: the batch ends as --workers 0 does.
        self.on_unavailable = on_unavailable
        self.restarts = 0
        self.started = 0
        self.pids: set[int] = set()
        self._stdin = -1  # the workers' standard input (see run)

    async def run(self) -> None:
        """Run the pool until cancelled (then every worker gets SIGTERM and is awaited).

        Each worker's standard input is the read end of one pipe whose write end only this
        process holds: if it dies without stopping them (SIGKILL, the OOM killer), the
        kernel closes it, and workers started with ``--stop-with-stdin`` stop."""
        self._stdin, lifeline = os.pipe()  # both ends close-on-exec (os.pipe's default)
        try:
            async with trio.open_nursery() as nursery:
                for slot in range(self.count):
                    nursery.start_soon(self._slot, slot)
        finally:
            os.close(self._stdin)
            os.close(lifeline)

    async def _slot(self, slot: int) -> None:
        while True:
            self.started += 1
            status = await self._run_one()
            if status == EXIT_UNAVAILABLE and self.on_unavailable is not None:
                self.on_unavailable()
                return
            if self.restarts >= self.max_restarts:
                self.on_exhausted(
                    f"worker_restarts_exhausted: worker {slot} exited (status {status}) and "
                    f"{self.restarts} replacement(s) were already made (--worker-restarts "
                    f"{self.max_restarts}); stopping (a rerun resumes; nothing is lost)"
                )
                return
            self.restarts += 1
            why = " (it lost its store: a new process opens it anew)" if (
                status == EXIT_STORE_LOST) else ""
            self.say(f"worker {slot} exited (status {status}){why}; starting a replacement "
                     f"({self.restarts} of at most {self.max_restarts}); its operations "
                     "are adopted")

    async def _run_one(self) -> int:
        process: trio.Process | None = None

        env = {**os.environ, **self.env} if self.env else None  # None: inherit ours

        async def run(task_status: trio.TaskStatus[trio.Process]) -> None:
            await trio.run_process(
                self.command, check=False, stdin=self._stdin,
                stdout=subprocess.DEVNULL, deliver_cancel=_terminate, env=env,
                task_status=task_status,
            )

        async with trio.open_nursery() as nursery:
            process = await nursery.start(run)
            self.pids.add(process.pid)
        self.pids.discard(process.pid)
        return process.returncode if process.returncode is not None else -1


async def _terminate(process: trio.Process) -> None:
    """SIGTERM (the worker suspends its operations durably), SIGKILL after 30 s."""
    process.send_signal(signal.SIGTERM)
    with trio.move_on_after(30):  # a bound, not a mechanism: suspending takes ms
        await process.wait()
        return
    process.kill()


class WorkersHost(BatchHost):
    """The batch host of ``--workers N``: submits, waits, commits (``cli/host.py``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spent = 0
        self.pool: WorkerPool | None = None
        self.waiting: set[str] = set()  # the operations whose jobs wait for a worker

    async def _handle(self, job: Job) -> Handle:
        adopted = await self.find_existing(job) is not None  # raises revision_conflict
        await self.supersede_older(job)  # older revisions of the job stop counting
        try:
            handle = await self.rt.submit(job.request, **self.admission(job))
        except errors.JobConflict:
            raise _JobFailed(
                "revision_conflict",
                "the job's content changed but its revision did not (use a new revision)",
            ) from None
        if adopted:
            self.summary.adopted += 1
        else:
            self.summary.prepared += 1
        return handle

    async def run_operation(self, handle: Handle, job: Job) -> Any:
        """A worker process runs it; this waits for its saved value (or typed error).

        A failure is reported as the execution that ended it raised it (``--workers 0``
        reports it so): ``wait`` raises the record's reopening error.

        Nothing waits forever: an operation saved for another endpoint is never claimed by a worker
        of this batch's endpoint, so it is refused before waiting, as ``send_recovering``
        refuses it with ``--workers 0`` (``configuration_unavailable``)."""
        refusal = await self._endpoint_refusal(handle.operation_id)
        if refusal is not None:
            raise refusal
        self.waiting.add(handle.operation_id)
        try:
            return await self.rt.wait(handle, response=job.response)
        except errors.PermanentlyFailed as exc:
            record = (
                None if exc.operation_id is None else await self.read_record(exc.operation_id)
            )
            if record is None or record.phase != "failed":
                raise
            raise machine.ended_error(record) from None
        finally:
            self.waiting.discard(handle.operation_id)

    async def _endpoint_refusal(self, operation_id: str) -> errors.RecoveryError | None:
        """``send_recovering``'s refusal at open of an operation saved for another
        endpoint; None once it has an outcome to deliver (a receipt, a terminal failure:
        ``wait`` returns or raises it, whatever the endpoint)."""
        record = await self.read_record(operation_id)
        backend = self.rt.backend
        if record is None or backend is None or record.has_completion:
            return None
        if record.phase in FINISHED and record.failure_reason != "authentication_required":
            return None
        return machine.endpoint_refusal(record, backend.endpoint_id)


    def _record_now(self, operation_id: str) -> OperationRecord | None:
        try:
            return self.store.get_operation(operation_id)
        except errors.RecoveryError:
            return None

    def lanes(self, todo: int) -> int:
        return min(todo, MAX_WAITERS)

    def attempts_spent(self) -> int:
        return self.spent

    async def _count_tokens(self, operation_id: str | None) -> OperationRecord | None:
        record = await super()._count_tokens(operation_id)
        if record is not None:
            self.spent += record.attempts_used
        return record

    async def run(self) -> None:
        if all(job.key in self.log.committed for job in self.jobs):
            await super().run()  # nothing to run: no worker is started
            return
        workers = self.config.workers
        restarts = self.config.worker_restarts
        self.pool = WorkerPool(
            worker_command(self),
            workers,
            max_restarts=RESTARTS_PER_WORKER * workers if restarts is None else restarts,
            say=self.say,
            on_exhausted=self._pool_failed,
            on_unavailable=self._endpoint_down,
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.pool.run)
            try:
                await super().run()
            finally:
                nursery.cancel_scope.cancel()  # SIGTERM to every worker, awaited

    def _endpoint_down(self) -> None:
        """A worker exited because its endpoint stayed unreachable past
        ``--unreachable-after``: the kind is the one it saved with the operations it
        gave up (nothing spent); the batch ends with ``--workers 0``'s message."""
        kind = next((record.endpoint_failure for record in map(
            self._record_now, sorted(self.waiting)
        ) if record is not None and record.endpoint_failure), None)
        self.endpoint_gave_up(kind)
        if self.work is not None:
            self.work.cancel()  # SIGTERM to the other workers, which suspend for the next

    def _pool_failed(self, message: str) -> None:
        if self.fatal is None:
            self.fatal = message
            self.summary.fatal = message
            self.say(f"error: {message}")
        if self.work is not None:
            self.work.cancel()
