"""The batch host: runs the jobs of one batch over one runtime, each result written once.

Every job is one recovery operation keyed by ``(id, revision)`` in scope ``"batch"``. A
job whose operation a previous run prepared is adopted (never prepared again); a saved
completion is delivered without generating. A validated result is appended to the result
log (fsynced), and only then is its operation acknowledged; a committed job whose
acknowledgement was lost is acknowledged by the next run, its line never rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Final

import attrs
import trio

from recoverable import _killpoints, errors
from recoverable.actors.continuation import (
    ENDED_FAILED,
    LINEAGE_STEPS,
    continue_failed,
    dispatched_successor,
    send_continuing,
)
from recoverable.actors.fenced import JobAdopted
from recoverable.actors.prepare import choose_job_operation
from recoverable.actors.prepare_send import Admission
from recoverable.actors.runtime import Runtime
from recoverable.cli.acknowledger import Acknowledger
from recoverable.cli.config import BatchConfig
from recoverable.cli.jobs import BATCH_SCOPE, Job
from recoverable.cli.openai_batch import HttpFailure, http_failure
from recoverable.cli.report import BatchSummary, ErrorLog, JobError, failure_reason
from recoverable.cli.result_log import ResultLog, encode_batch_output_line, encode_result_line
from recoverable.records import OperationRecord
from recoverable.storage.sources import supersede_revisions
from recoverable.storage.store import RecoveryStore, redact_url
from recoverable.transitions import FINISHED
from recoverable.types import AccountBinding, Attempt, Handle, RetryPolicy

__all__ = ["BatchHost"]

MESSAGES_PER_REASON: Final = 5  # failure messages shown per reason (all are counted)
# Failures of the whole store (not of one operation's records): the first is shown, then
# one line saying the store is unusable; the others are only counted.
STORE_WIDE_REASONS: Final = frozenset(
    {errors.StorageUnavailable.code, errors.StoreDamaged.code, errors.StoreLockReplaced.code}
)


class _JobFailed(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


class _Unreadable(Exception):
    """An operation of the job's id cannot be read: the job waits for an operator."""

    def __init__(self, error: errors.RecoveryError) -> None:
        super().__init__(error.code)
        self.error = error


@attrs.frozen
class _Sent:
    """A job whose operation returned its validated result."""

    handle: Handle
    value: Any
    record: OperationRecord | None  # read before acknowledge removes it


class BatchHost:
    """Runs the jobs of one batch over one runtime; see the module docstring."""

    def __init__(
        self,
        rt: Runtime,
        store: RecoveryStore,
        log: ResultLog,
        jobs: list[Job],
        config: BatchConfig,
        summary: BatchSummary,
        *,
        say: Callable[[str], None],
        work: trio.CancelScope | None = None,
        errors_log: ErrorLog | None = None,
    ) -> None:
        self.rt = rt
        self.acks = Acknowledger(rt, say)
        self.errors_log = errors_log
        self.work = work
        self.fatal: str | None = None
        self.store = store
        self.log = log
        self.jobs = jobs
        self.config = config
        self.summary = summary
        self.say = say
        self.running = 0
        self.gave_up = False  # the endpoint stayed unreachable past --unreachable-after
        # Per job: older revisions of its id to supersede (find_existing)
        self.older: dict[tuple[str, str], frozenset[str]] = {}
        self._shown: Counter[str] = Counter()
        self.policy = RetryPolicy(
            initial_backoff=config.initial_backoff,
            maximum_backoff=config.maximum_backoff,
            retryable_provider_codes=config.retry_provider_codes,
            maximum_retry_after=config.maximum_retry_after,
        )

    async def authorize(self, attempt: Attempt) -> bool:
        # The batch is the host: it authorizes every attempt (and logs nothing private).
        # Attempts spent are counted by the runtime when consumed: an approved attempt
        # whose connection was never established spends nothing.
        return True

    @property
    def account(self) -> AccountBinding:
        assert self.rt.account is not None
        return self.rt.account

    async def acknowledge_committed(self) -> None:
        """Acknowledge committed jobs whose acknowledgement was lost (no line is rewritten)."""
        for (job_id, revision), op_id in self.log.committed.items():
            try:
                disposition = self.store.get_disposition(op_id)
                if disposition is not None and disposition.removal_complete:
                    continue
                if disposition is None and self.store.get_operation(op_id) is None:
                    continue  # not in this store (e.g. another --store): nothing to do
                await self.rt.acknowledge(Handle(op_id))
                self.summary.acknowledged_late += 1
            except Exception as exc:  # one job's failure never ends the batch
                code = (
                    exc.code if isinstance(exc, errors.RecoveryError)
                    else f"internal_error:{type(exc).__name__}"
                )
                self.say(
                    f"warning: committed job {job_id!r} revision {revision!r}: could not "
                    f"acknowledge {op_id}: {code}"
                )

    async def find_existing(self, job: Job) -> str | None:
        """The operation a previous run prepared for this job (not disposed), if any.

        Operations of the same job id with another revision that could still produce a
        result (or hold an unacknowledged receipt) are remembered for
        :meth:`supersede_older` (the revision being run is the newer one). The reads run
        off the event loop where each is a round trip (``RecoveryStore.read_off_loop``):
        the other jobs go on meanwhile."""
        chosen, older = await self.store.read_off_loop(functools.partial(self._existing, job))
        if older:
            self.older[job.key] = older
        return chosen

    def _existing(self, job: Job) -> tuple[str | None, frozenset[str]]:
        """:meth:`find_existing`'s reads: the chosen operation, and the older revisions."""
        found = []
        older: set[str] = set()
        committed = self.log.committed
        for op_id in self.store.ids_by_job(self.account, BATCH_SCOPE, job.id):
            try:
                if self.store.get_disposition(op_id) is not None:
                    continue
                record = self.store.get_operation(op_id)
            except (errors.CorruptRecord, errors.UnsupportedRecordVersion) as exc:
                # Fail closed: whatever it held (a saved result, a spent budget, another
                # revision) is unknown, so nothing is prepared or sent for this job until
                # an operator decides (restore the store, or abandon the operation).
                raise _Unreadable(exc) from None
            if record is None:
                continue
            revision = record.input_revision
            if revision != job.revision:
                written = revision is not None and committed.get((job.id, revision)) == op_id
                if (record.phase not in FINISHED or record.has_completion) and not written:
                    older.add(op_id)  # pending or unacknowledged, never written out
                continue
            found.append(record)
        # The lineage is followed (a source whose retry successor exists yields to it),
        # then a saved completion first (never generate again), then the oldest.
        chosen = choose_job_operation(found)
        if chosen is None:
            return None, frozenset(older)
        if chosen.body_hash != job.body_hash:
            raise _JobFailed(
                "revision_conflict",
                "the job's content changed but its revision did not (use a new revision)",
            )
        return chosen.operation_id, frozenset(older)

    async def run_job(self, job: Job) -> None:
        sent = await self._send(job)
        if sent is None:
            return
        line = await self._output_line(job, sent)
        if line is not None:
            await self._commit(job, sent.handle, line)

    async def supersede_older(self, job: Job) -> None:
        """Supersede what :meth:`find_existing` found of the job's older revisions (one
        transaction); each is reported, and counted as neither done nor failed."""
        candidates = self.older.pop(job.key, None)
        if not candidates:
            return
        superseded = await self.store.write(functools.partial(
            supersede_revisions, self.account, BATCH_SCOPE, job.id, job.revision,
            candidates, time.time(),
        ))
        for op_id in superseded:
            self.summary.superseded += 1
            self.say(f"job {job.id!r} (line {job.lineno}): operation {op_id} of an older "
                     f"revision superseded by revision {job.revision!r}")

    async def _handle(self, job: Job) -> Handle | Admission:
        """The job's operation: the one a previous run prepared, or a new one admitted
        (checked and frozen; written by its first acquisition, see :meth:`_run`)."""
        op_id = await self.find_existing(job)
        await self.supersede_older(job)
        if op_id is not None:
            self.summary.adopted += 1
            return Handle(op_id)
        return self.rt.admit(job.request, **self.admission(job))

    def admission(self, job: Job) -> dict[str, Any]:
        """What a new operation of this job is prepared (or submitted) with: the same
        options whether this process runs it or a worker does (``--workers N``)."""
        return {
            "response": job.response,
            "maximum_attempts": job.max_attempts or self.config.max_attempts,
            "retry_policy": self.policy,
            "scope": BATCH_SCOPE,
            "job_id": job.id,
            "input_revision": job.revision,
            "on_interruption": self.config.on_interruption,
            # --max-cost: each job's cost budget, at --prices' price (else genai-prices').
            "maximum_cost_total": self.config.max_cost,
            "prices": self.config.prices,
        }

    async def run_operation(self, handle: Handle, job: Job) -> Any:
        """Run the job's operation here, to its validated value (``--workers 0``).

        A failed operation with a pending opt-in continuation is not failed
        yet: its successor is dispatched here when due and run the same way."""
        return await send_continuing(self.rt, handle, response=job.response,
                                     authorize=self.authorize)

    async def _run(self, target: Handle | Admission, job: Job) -> tuple[Handle, Any]:
        """The job's operation (the first of its continuation lineage) and its value. An
        admitted operation is prepared and acquired in one store write
        (``Runtime.send_admitted``: this host keeps no handle of its own, so nothing
        observes the prepared operation apart); one another process prepared meanwhile
        is adopted and run instead."""
        if isinstance(target, Handle):
            return target, await self.run_operation(target, job)
        handle = target.handle
        try:
            value = await self.rt.send_admitted(target, response=job.response,
                                                authorize=self.authorize)
        except JobAdopted as adopted:  # nothing of ours was written
            self.summary.adopted += 1
            handle = Handle(adopted.operation_id)
            return handle, await self.run_operation(handle, job)
        except ENDED_FAILED:
            self.summary.prepared += 1
            successor = await continue_failed(self.rt, handle.operation_id)
            if successor is None:
                raise
            return handle, await self.run_operation(Handle(successor), job)
        except BaseException:
            if self._saved(handle.operation_id):  # it failed after its first write
                self.summary.prepared += 1
            raise
        self.summary.prepared += 1
        return handle, value

    def _saved(self, operation_id: str) -> bool:
        try:
            return self.store.get_operation(operation_id) is not None
        except errors.RecoveryError:
            return False

    def lanes(self, todo: int) -> int:
        """How many jobs are handled at once."""
        return min(self.config.concurrency, todo)

    def attempts_spent(self) -> int:
        """The attempts this run spent (consumed before sending), for the summary."""
        return self.rt.attempts_consumed

    async def _send(self, job: Job) -> _Sent | None:
        """Run the job's operation to its validated result (None: the job is reported)."""
        try:
            target = await self._handle(job)
            self.running += 1
            try:
                handle, value = await self._run(target, job)
            finally:
                self.running -= 1
            # The result may be a continuation successor's: commit that one (the tokens
            # its failed predecessors spent are counted too). One read per operation of
            # the lineage: the record that says where it goes is the one counted.
            operation_id = handle.operation_id
            record = await self._count_tokens(operation_id)
            for _ in range(LINEAGE_STEPS):
                successor = dispatched_successor(record)
                if successor is None:
                    break
                operation_id = successor
                record = await self._count_tokens(operation_id)
            return _Sent(Handle(operation_id), value, record)
        except _JobFailed as failed:
            self._failed(job, failed.reason, failed.detail)
        except _Unreadable as unreadable:
            self._unreadable(job, unreadable.error)
        except errors.OperationSuspended:
            self.summary.unfinished += 1
            self.say(f"job {job.id!r} (line {job.lineno}): suspended from outside; rerun to resume")
        except errors.EndpointUnavailable as exc:
            self.endpoint_gave_up(exc.kind)  # nothing spent: unfinished, told once
        except errors.OperationBusy as exc:
            self.summary.unfinished += 1
            self.say(
                f"job {job.id!r} revision {job.revision!r} (line {job.lineno}): another process "
                f"is running its operation {exc.operation_id} right now; let it finish (or "
                "stop it with `recoverable suspend`), then rerun"
            )
        except errors.RecoveryError as exc:
            record = await self._count_tokens(exc.operation_id)
            message = str(exc) if str(exc) != exc.code else ""
            detail = message
            if exc.operation_id is not None:
                detail = (detail + "; " if detail else "") + self._hint(exc.operation_id)
            self._failed(
                job, failure_reason(exc), detail, code=exc.code, message=message,
                operation_id=exc.operation_id,
                hint=None if exc.operation_id is None else self._suggestion(exc.operation_id),
                http=http_failure(exc, record),
            )
        except Exception as exc:  # one job's failure never ends the batch
            self._failed(
                job,
                f"internal_error:{type(exc).__name__}",
                "an unexpected error while running this job (a defect: please report it); "
                "the other jobs go on",
            )
        return None

    async def _output_line(self, job: Job, sent: _Sent) -> bytes | None:
        """The job's line for the result log (None: the job is reported as failed)."""
        operation_id = sent.handle.operation_id
        try:
            match self.config.output_format:
                case "openai-batch":
                    receipt = await self.rt.receipt(sent.handle)
                    return encode_batch_output_line(job, operation_id, receipt, sent.record)
                case _:
                    return encode_result_line(job, operation_id, sent.value)
        except errors.RecoveryError as exc:
            self._failed(job, exc.code, "the result cannot be read back for the output line; it "
                         "stays saved in the store (rerun to write it)", code=exc.code,
                         operation_id=operation_id)
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            self._failed(job, f"internal_error:{type(exc).__name__}",
                         "the result cannot be written as JSON; it stays saved in the store")
        return None

    async def _commit(self, job: Job, handle: Handle, line: bytes) -> None:
        """Append the job's line (durable), then acknowledge its operation."""
        try:
            await self.log.append(line)
        except OSError as exc:
            # The receipt stays saved (unacknowledged); a rerun writes the line.
            if self.fatal is None:
                self.fatal = f"writing {self.log.path} failed: {exc}"
                self.summary.fatal = self.fatal
                self.say(f"error: {self.fatal}; stopping (a rerun resumes)")
            if self.work is not None:
                self.work.cancel()
            return
        self.log.committed[job.key] = handle.operation_id
        self.summary.committed += 1
        _killpoints.hit("host.committed")
        self.acks.add(job.id, handle)  # with the next group (cli/acknowledger.py)

    def endpoint_gave_up(self, kind: str | None) -> None:
        """The endpoint could not be connected to for ``--unreachable-after``:
        no more jobs start, those running end at the same bound (nothing spent, their
        operations as they were), and every job not done counts as unfinished, with this
        one message (exit 1). The same with ``--workers N`` (``WorkersHost``)."""
        if self.gave_up:
            return
        self.gave_up = True
        self.summary.endpoint_unavailable = kind
        message = (
            "endpoint_unavailable: the endpoint could not be connected to"
            + (f" ({kind})" if kind else "")
            + f" for {self.config.unreachable_after:g} s (--unreachable-after); nothing was "
            "spent: the jobs not done keep their budgets and count as unfinished; rerun "
            "once the endpoint is reachable"
        )
        if self.fatal is None:
            self.fatal = message
            self.summary.fatal = message
            self.say(f"error: {message}")

    def _unreadable(self, job: Job, error: errors.RecoveryError) -> None:
        """A job whose operation cannot be read: unfinished, told, never prepared again."""
        self.summary.unfinished += 1
        op_id = error.operation_id
        store = redact_url(self.config.store_path)
        hint = (
            f"restore the store from a backup, or give the operation up with `recoverable "
            f"abandon --store {store} --account {self.account.account_id} {op_id}` (a rerun "
            "then prepares the job anew and generates it again)"
        )
        if self.errors_log is not None:
            self.errors_log.write(JobError(
                job_id=job.id, revision=job.revision, lineno=job.lineno, code=error.code,
                reason=error.code, message=str(error), operation_id=op_id, hint=hint,
            ))
        self.say(f"job {job.id!r} revision {job.revision!r} (line {job.lineno}): not run: its "
                 f"operation {op_id} cannot be read ({error.code}); nothing is prepared or "
                 f"sent for it until you decide: {hint}")

    def _suggestion(self, operation_id: str) -> str | None:
        """What to do about a failed operation, as one instruction (or None)."""
        try:
            suggested = self.rt.status_of(operation_id).suggested_actions
        except Exception:  # a hint must never fail the job report
            suggested = ()
        store = redact_url(self.config.store_path)  # a URL's password is never printed
        account = self.account.account_id
        if "use_successor" in suggested:
            successor = self.rt.status_of(operation_id).successor_id
            return (f"a manual retry already made its successor {successor}: rerun this "
                    "batch to run it (recoverable status shows it)")
        if "manual_retry" in suggested:
            return (
                "to try again with a new budget linked to the spent one: rerun this batch with "
                f"--retry-failed, or run recoverable retry --store {store} --account {account} "
                f"{operation_id} --action-id retry-1, then rerun this batch"
            )
        if "sign_in" in suggested:
            return "fix the credentials, then rerun to resume it"
        return None

    def _hint(self, operation_id: str) -> str:
        """What the user can do about a failed operation (never "abandon, then rerun",
        which would reset the job's budget)."""
        suggestion = self._suggestion(operation_id)
        if suggestion is None:
            return f"operation {operation_id}"
        return f"operation {operation_id} ({suggestion})"

    async def _count_tokens(self, operation_id: str | None) -> OperationRecord | None:
        """Add the operation's per-attempt usage to the summary (before acknowledge
        removes the record): every attempt's tokens, replaced ones included."""
        record = await self.read_record(operation_id) if operation_id else None
        if record is not None:
            self.summary.tokens.add(record)
        return record

    async def read_record(self, operation_id: str) -> OperationRecord | None:
        """The operation's record (None: gone or unreadable), read off the event loop
        where a read is a round trip (``RecoveryStore.read_off_loop``)."""
        try:
            return await self.store.read_off_loop(
                functools.partial(self.store.get_operation, operation_id)
            )
        except errors.RecoveryError:
            return None

    def _failed(
        self,
        job: Job,
        reason: str,
        detail: str,
        *,
        code: str | None = None,
        message: str | None = None,
        operation_id: str | None = None,
        hint: str | None = None,
        http: HttpFailure | None = None,
    ) -> None:
        if self.errors_log is not None:
            if hint is None and reason == "revision_conflict":
                hint = "change the revision (or the body back) for new content"
            self.errors_log.write(JobError(
                job_id=job.id, revision=job.revision, lineno=job.lineno,
                code=code or reason.split(":")[0], reason=reason,
                message=detail if message is None else message,
                operation_id=operation_id, hint=hint, http_failure=http,
            ))
        self.summary.failed[reason] += 1
        shown = self._shown[reason]
        store_wide = reason.split(":")[0] in STORE_WIDE_REASONS
        limit = 1 if store_wide else MESSAGES_PER_REASON
        if shown >= limit:
            return  # counted in the summary; announced once by report_suppressed
        self._shown[reason] += 1
        self.say(f"job {job.id!r} revision {job.revision!r} (line {job.lineno}) failed: {reason}"
                 + (f" — {detail}" if detail and detail != reason else ""))
        if store_wide:
            self.say(f"the store is not usable ({reason}): other jobs failing the same way are "
                     "only counted in the summary")

    def report_suppressed(self) -> None:
        for reason, count in sorted(self.summary.failed.items()):
            hidden = count - self._shown[reason]
            if hidden > 0:
                self.say(f"... and {hidden} more job(s) failed with {reason} (not shown)")

    def committed_conflict(self, job: Job) -> str | None:
        """Why a job already committed in the output conflicts with this line, if it does:
        its content changed but its revision did not."""
        committed_hash = self.log.hashes.get(job.key)
        if committed_hash is None:
            # A line written before the output carried the hash: the store's record, if
            # it is still there (committed, acknowledgement pending).
            op_id = self.log.committed[job.key]
            try:
                record = self.store.get_operation(op_id)
            except errors.RecoveryError:
                record = None
            committed_hash = record.body_hash if record is not None else None
        if committed_hash is None or committed_hash == job.body_hash:
            return None
        where = self.log.lines.get(job.key)
        return (
            f"committed earlier with other content ({self.log.path}"
            + (f":{where}" if where is not None else "")
            + "); change the revision for new content"
        )

    async def retry_failed(self) -> None:
        """``--retry-failed``: one manual-retry successor per failed job of this file whose
        operation suggests ``manual_retry`` (exhausted, failed, expired, blocked). The
        action id derives from the job and the source, so a rerun returns the same
        successor (never another budget for the same source); the count is printed."""
        created = 0
        for job in self.jobs:
            if job.key in self.log.committed:
                continue
            try:
                op_id = await self.find_existing(job)
                if op_id is None:
                    continue
                status = self.rt.status_of(op_id)
                if not {"manual_retry", "use_successor"} & set(status.suggested_actions):
                    continue
                action = "batch-retry-failed-" + hashlib.sha256(
                    f"{job.id}\0{job.revision}\0{op_id}".encode("utf-8", "surrogatepass")
                ).hexdigest()[:32]
                successor = await self.rt.retry(
                    Handle(op_id), retry_action_id=action,
                    maximum_attempts=status.maximum_attempts,
                )
            except (_JobFailed, _Unreadable):
                continue  # the run reports it (revision_conflict, an unreadable record)
            except errors.RecoveryError as exc:
                self.say(f"job {job.id!r} revision {job.revision!r} (line {job.lineno}): "
                         f"--retry-failed: no successor created ({exc.code}: {exc})")
                continue
            created += 1
            self.say(f"job {job.id!r} revision {job.revision!r} (line {job.lineno}): "
                     f"--retry-failed: {successor.operation_id} succeeds {op_id} with a new "
                     f"budget of {status.maximum_attempts} attempt(s)")
        self.summary.retried = created
        self.say(f"--retry-failed: {created} manual retr{'y' if created == 1 else 'ies'} "
                 "created (each a new attempt budget linked to the spent one); running them")

    async def run(self) -> None:
        todo = []
        for job in self.jobs:
            if job.key not in self.log.committed:
                todo.append(job)
                continue
            conflict = self.committed_conflict(job)
            if conflict is not None:
                self._failed(job, "revision_conflict", conflict)
            else:
                self.summary.already_committed += 1
        send, receive = trio.open_memory_channel[Job](0)
        async with trio.open_nursery() as acknowledging:
            acknowledging.start_soon(self.acks.run)
            async with trio.open_nursery() as nursery:
                for _ in range(self.lanes(len(todo))):
                    nursery.start_soon(self._worker, receive)
                async with send:
                    for job in todo:
                        await send.send(job)
            self.acks.close()  # the last group is written before the batch ends

    async def _worker(self, receive: trio.MemoryReceiveChannel[Job]) -> None:
        async for job in receive:
            if self.gave_up:
                continue  # not started: counted unfinished (endpoint_gave_up)
            try:
                await self.run_job(job)
            except Exception as exc:  # never end the batch for one job
                self._failed(job, f"internal_error:{type(exc).__name__}",
                             "an unexpected error (a defect: please report it)")
