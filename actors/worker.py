"""The worker: runs queued (and orphaned) operations with no caller attached.

``run_worker(runtime, concurrency=, authorize=)`` looks at the store's ``queue`` table
(``storage/queue.py``, filled by ``runtime.submit``) and claims the operations of ITS
runtime's account and endpoint that are due and whose lease is not live:

- ``prepared``; ``waiting`` with ``next_attempt_at`` reached;
- ``authorizing``/``transmitting`` whose owner is gone (orphaned: the actor's reopening
  closes the in-flight attempt as interrupted and replaces it within the budget);
- ``suspended`` by a worker that stopped cleanly (its queue row says ``resume``), never
  one a host suspended.

Each claim is the operation actor taking the lease (``Runtime.start_operation``,
detached): the acquisition increments the generation fence, so two workers never run
the same operation, and a stale one can write nothing. Before it starts them, a round
reserves its candidates (``RecoveryStore.reserve_claims``; on PostgreSQL ``FOR NO KEY
UPDATE SKIP LOCKED``, ``storage/pg_claims.py``): workers of several processes reading the
same page start different operations rather than race for the same leases. At most
``concurrency`` run at once. An operation that ends terminal (or was disposed, or
expired while idle) leaves the queue; one that stopped without a state change it can
act on (the host declined the attempt, its body is missing, ...) is left alone by this
worker for ``SKIP_SECONDS``.

On ``stop`` (the CLI sets it on SIGTERM/SIGINT) the running operations are flagged
``resume`` in their queue rows (one transaction), then stopped: each actor suspends its
operation durably and releases its lease before ``run_worker`` returns. The next worker
resumes them. A worker killed outright (SIGKILL) leaves leases whose owner lock died
with it: they are not live, so another worker adopts the operations at once.

An endpoint that stays unreachable past the runtime's bound (``open_runtime(
unreachable_after=)``) ends the operations waiting for it with ``EndpointUnavailable``
(nothing spent: they rest ``prepared``, still queued). The first such end stops the
worker as ``stop`` would (its other running operations suspended, flagged for the next
worker), then ``run_worker`` raises that error (no operation id: it is the worker's): a
worker that cannot reach its endpoint says so instead of claiming the queue in vain.

At start a worker runs the full recovery sweep (``actors/sweep.py``; its runtime already
ran the cheap one when it opened): every operation whose owner is gone is closed honestly
before anything is claimed, including the rare in-flight record that has no lease row;
unclaimed work of other accounts and endpoints is ended ``no_worker``, never its own.

Its worker row says which account and endpoint it serves; with it, the served mark of
that account and endpoint (``storage/queue.py``) is moved ``SERVED_GRACE`` seconds ahead
when it starts, every ``SERVED_RENEW`` seconds while it runs and to its stop when it stops:
the unclaimed bound of the queue's operations counts from it (``actors/unclaimed.py``).
"""

from __future__ import annotations

import contextlib
import functools
import secrets
from collections.abc import Callable
from typing import Any, Final, Protocol

import attrs
import msgspec
import trio

from recoverable import errors
from recoverable.actors.checks import require_signed_in
from recoverable.actors.continuation import dispatch_continuation
from recoverable.actors.host import Authorize, Backend
from recoverable.actors.supervisor import Running
from recoverable.actors.sweep import sweep
from recoverable.continuation import is_pending
from recoverable.preconditions import is_expired
from recoverable.records import LeaseRecord, OperationRecord, StoredRequest
from recoverable.storage import codec
from recoverable.storage.base import Store as RecoveryStore
from recoverable.storage.base import WriteTransaction as WriteTxn
from recoverable.storage.keys import operation_key, payload_key
from recoverable.storage.leases import lease_expired
from recoverable.storage.queue import SERVED_GRACE, SERVED_RENEW, QueueEntry, ServedRow, WorkerRow
from recoverable.telemetry import Telemetry
from recoverable.transitions import FINISHED
from recoverable.types import AccountBinding, Handle, JsonSchema

__all__ = ["MAX_CONCURRENCY", "WorkerReport", "claimable", "run_worker"]

MAX_CONCURRENCY: Final = 10_000
SKIP_SECONDS: Final = 30.0  # an operation that stopped without progress is left this long
MAX_SKIPPED: Final = 4096  # remembered skips past which the lapsed ones are dropped
BUSY_SECONDS: Final = 0.1  # one running in another process is looked at again after this
POLL_FIRST: Final = 0.005  # seconds between looks at the queue when work was found
POLL_MAX: Final = 0.1  # ... and at most this long when there was none
CONTINUATION_RECHECK: Final = 1.0  # a pending continuation not yet due: seconds


class WorkerRuntime(Protocol):
    """What the worker uses of the runtime (``actors/runtime.py`` implements it)."""

    store: RecoveryStore
    backend: Backend | None
    account: AccountBinding | None
    now: Callable[[], float]
    telemetry: Telemetry

    def start_operation(
        self, handle: Handle, *, response: Any, authorize: Authorize,
    ) -> Running: ...


@attrs.define
class WorkerReport:
    """What one worker did (counts only: no ids, no content)."""

    claimed: int = 0  # executions started
    completed: int = 0  # ended with a saved completion
    failed: int = 0  # ended terminal without one (failed, cancelled, expired)
    busy: int = 0  # another worker claimed it first
    stopped: int = 0  # ended without a terminal state (declined, suspended, ...)
    removed: int = 0  # queue rows removed (terminal, disposed, expired)
    resumable: int = 0  # suspended by this worker's stop, flagged for the next one
    continued: int = 0  # continuation successors dispatched


def claimable(
    record: OperationRecord,
    entry: QueueEntry,
    *,
    account: AccountBinding,
    endpoint_id: str,
    now: float,
    lease_live: bool,
) -> bool | None:
    """True: this worker may claim it now; False: not now (another's, not due, running);
    None: it is done with the queue (finished, or expired while idle)."""
    if record.phase in FINISHED or record.has_completion:
        return None
    idle = record.phase in ("prepared", "waiting", "suspended")
    if idle and is_expired(record, now):
        return None
    if record.account != account or record.endpoint_id != endpoint_id or lease_live:
        return False
    match record.phase:
        case "prepared" | "authorizing" | "transmitting":
            return True
        case "waiting":
            return record.next_attempt_at is None or record.next_attempt_at <= now
        case "suspended":
            return entry.resume
    return False


def _register(
    token: str, row: WorkerRow, served: ServedRow, dead: list[tuple[str, str]], txn: WriteTxn
) -> None:
    for owner_id, other in dead:
        txn.unregister_worker(owner_id, other)
    txn.register_worker(token, row)
    txn.mark_served(served)  # with the row: a sweep that reads either sees this worker


def _mark(served: ServedRow, txn: WriteTxn) -> None:
    txn.mark_served(served)


def _unregister(token: str, served: ServedRow, txn: WriteTxn) -> None:
    txn.unregister_worker(txn.owner_id, token)
    txn.mark_served(served)


def _dequeue(operation_ids: list[str], txn: WriteTxn) -> int:
    removed = 0
    for operation_id in operation_ids:
        try:
            record = txn.get_operation(operation_id)
        except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
            record = None
        if record is not None and is_pending(record):
            continue  # a pending continuation stays queued until dispatched
        removed += txn.dequeue(operation_id)
    return removed


def _mark_resume(operation_ids: list[str], txn: WriteTxn) -> None:
    """A stopping worker's mark: the next worker resumes these (the opening that takes
    the lease spends it, ``fenced.acquire``)."""
    for operation_id in operation_ids:
        if txn.get_operation(operation_id) is not None:
            txn.enqueue(operation_id, resume=True)


def _look(
    store: RecoveryStore, operation_ids: list[str]
) -> list[tuple[LeaseRecord | None, OperationRecord | None, bool]]:
    """``(lease, record, unreadable)`` of each operation: two reads for all of them."""
    if not operation_ids:
        return []
    keys = [operation_key(operation_id) for operation_id in operation_ids]
    leases = store.get_raw_many("leases", keys)
    records = store.get_raw_many("operations", keys)
    looked: list[tuple[LeaseRecord | None, OperationRecord | None, bool]] = []
    for operation_id, raw_lease, raw_record in zip(operation_ids, leases, records, strict=True):
        try:
            lease = (
                None if raw_lease is None
                else codec.decode_lease(raw_lease, operation_id=operation_id)
            )
            record = (
                None if raw_record is None
                else codec.decode_operation(raw_record, operation_id=operation_id)
            )
        except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
            looked.append((None, None, True))
            continue
        looked.append((lease, record, False))
    return looked


def _owners_live(store: RecoveryStore, leases: list[LeaseRecord]) -> dict[str, bool]:
    """Whether each other owner holding one of ``leases`` (unexpired) is live: asked once
    per owner per claim round."""
    owners: dict[str, bool] = {}
    for lease in leases:
        if lease.owner_id != store.owner_id and not lease_expired(lease):
            if lease.owner_id not in owners:
                owners[lease.owner_id] = store.owner_is_live(lease.owner_id)
    return owners


def _live(store: RecoveryStore, lease: LeaseRecord, owners: dict[str, bool]) -> bool:
    """``store.lease_is_live``, another owner's liveness from ``owners`` (_owners_live)."""
    if lease.owner_id == store.owner_id or lease_expired(lease):
        return store.lease_is_live(lease)
    live = owners.get(lease.owner_id)
    if live is None:  # its lease expired meanwhile is handled above; asked now otherwise
        live = owners[lease.owner_id] = store.owner_is_live(lease.owner_id)
    return live


class _Worker:
    def __init__(
        self, rt: WorkerRuntime, *, concurrency: int, authorize: Authorize, stop: trio.Event
    ) -> None:
        self.rt = rt
        self.store = rt.store
        self.concurrency = concurrency
        self.authorize = authorize
        self.stop = stop
        self.report = WorkerReport()
        self.account = require_signed_in(rt.account, "a worker needs an account")
        if rt.backend is None:
            raise errors.ConfigurationUnavailable("a worker needs a backend")
        self.endpoint_id = rt.backend.endpoint_id
        self.running: dict[str, Running] = {}
        self.skip: dict[str, float] = {}  # operation id -> trio time it may be tried again
        self.changed = trio.Event()  # an execution ended: look at the queue again
        self.token = secrets.token_hex(8)  # names this worker's row (storage/queue.py)
        # Its endpoint stayed unreachable past the runtime's bound: the worker stops.
        self.unavailable: errors.EndpointUnavailable | None = None

    def _wake(self) -> None:
        self.changed.set()

    def _served(self, ahead: float) -> ServedRow:
        """Its account and endpoint served until ``ahead`` seconds from now."""
        return ServedRow(
            account_id=self.account.account_id, source=self.account.source,
            endpoint_id=self.endpoint_id, until=self.rt.now() + ahead,
        )

    async def run(self) -> WorkerReport:
        serving = (self.account.account_id, self.account.source, self.endpoint_id)
        try:  # never ends unclaimed what this worker is about to serve
            await sweep(self.store, now=self.rt.now(), serving=serving)
        except errors.RecoveryError as exc:  # a full/unavailable store: claims still fence
            self.rt.telemetry.emit("sweep.failed", "", code=exc.code)
        await self._register()
        try:
            return await self._serve()
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self.store.write(
                        functools.partial(_unregister, self.token, self._served(0.0))
                    )
                except errors.RecoveryError:
                    pass  # the row names a dead owner once this process ends

    async def _register(self) -> None:
        """Say which account and endpoint this worker serves (status tells operations
        nobody serves: ``waiting_for_worker``); forget the rows of dead workers."""
        dead = [(owner, token) for owner, token, _row in self.store.workers()
                if not self.store.owner_is_live(owner)]
        row = WorkerRow(
            account_id=self.account.account_id, source=self.account.source,
            endpoint_id=self.endpoint_id, concurrency=self.concurrency,
            started_at=self.rt.now(),
        )
        await self.store.write(
            functools.partial(_register, self.token, row, self._served(SERVED_GRACE), dead)
        )

    async def _serve(self) -> WorkerReport:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_stop)
            nursery.start_soon(self._renew_served)
            delay = POLL_FIRST
            while not self.stop.is_set() and self.unavailable is None:
                self._check_owner()
                self.changed = trio.Event()
                started = await self._claim_round(nursery)
                delay = POLL_FIRST if started else min(delay * 2, POLL_MAX)
                await trio.sleep(POLL_FIRST)  # completions that come together: one round
                with trio.move_on_after(delay - POLL_FIRST):
                    await self.changed.wait()
            await self._shutdown()
            nursery.cancel_scope.cancel()
        return self.report

    def _check_owner(self) -> None:
        """A store that lost this process's ownership (the PostgreSQL store: its session
        or heartbeat failed) refuses every write for good: the worker can run nothing
        more, so it stops with the typed error rather than idle on (restart it)."""
        if not self.store.owner_is_live(self.store.owner_id):
            raise errors.StorageUnavailable(
                "this worker lost its ownership of the store (its database session or "
                "heartbeat failed): it can write nothing more; start it again"
            )

    async def _watch_stop(self) -> None:
        await self.stop.wait()
        self._wake()

    async def _renew_served(self) -> None:
        """Keep the served mark of its account and endpoint ``SERVED_GRACE`` seconds ahead
        while it runs (one write every ``SERVED_RENEW`` seconds)."""
        while True:
            await trio.sleep(SERVED_RENEW)
            with contextlib.suppress(errors.RecoveryError):  # the next renewal tries again
                await self.store.write(functools.partial(_mark, self._served(SERVED_GRACE)))

    async def _claim_round(self, nursery: trio.Nursery) -> int:
        """Look at the queue once (oldest first); start what may run; return how many."""
        free = self.concurrency - len(self.running)
        if free <= 0:
            return 0
        now, clock = self.rt.now(), trio.current_time()
        if len(self.skip) > MAX_SKIPPED:  # bounded: forget the entries that have lapsed
            self.skip = {
                operation_id: until
                for operation_id, until in self.skip.items()
                if until > clock
            }
        done: list[str] = []
        continuing: list[str] = []
        claims: list[tuple[OperationRecord, QueueEntry]] = []
        after = 0
        while len(claims) < free:
            # Each read of the round off the event loop where it is a round trip
            # (RecoveryStore.read_off_loop): the operations this worker runs go on meanwhile.
            page = await self.store.read_off_loop(functools.partial(
                self.store.queued, after_serial=after, limit=max(64, 4 * free)
            ))
            if not page:
                break
            after = page[-1].serial
            candidates = [
                entry for entry in page
                if entry.operation_id not in self.running
                and self.skip.get(entry.operation_id, 0) <= clock
            ]
            # The page's leases and records in two reads (not two per entry: each is a
            # round trip on PostgreSQL), another owner's liveness asked once per round.
            looked = await self.store.read_off_loop(functools.partial(
                _look, self.store, [entry.operation_id for entry in candidates]
            ))
            owners_live = await self.store.read_off_loop(functools.partial(
                _owners_live, self.store, [lease for lease, _, _ in looked if lease is not None]
            ))
            wanted: list[tuple[OperationRecord, QueueEntry]] = []
            for entry, (lease, record, unreadable) in zip(candidates, looked, strict=True):
                operation_id = entry.operation_id
                if unreadable:
                    self.skip[operation_id] = clock + SKIP_SECONDS
                    continue
                if lease is not None and _live(self.store, lease, owners_live):
                    self.skip[operation_id] = clock + BUSY_SECONDS  # running elsewhere
                    continue
                if record is None:
                    done.append(operation_id)  # acknowledged, abandoned or purged
                    continue
                if is_pending(record):  # a failed run's pending continuation
                    continuing.append(operation_id)
                    continue
                verdict = claimable(
                    record, entry, account=self.account, endpoint_id=self.endpoint_id,
                    now=now, lease_live=False,
                )
                if verdict is None:
                    done.append(operation_id)
                elif verdict:
                    wanted.append((record, entry))
            if wanted:
                claims += await self._reserve(wanted, free - len(claims), clock)
        if done:
            self.report.removed += await self.store.write(
                functools.partial(_dequeue, done), touches=done
            )
        started = 0
        for operation_id in continuing:
            started += await self._continue(operation_id, clock)
        # The saved requests of every claim in one read (on PostgreSQL a read is a round
        # trip that holds the event loop: one per round, not one per claim).
        requests = await self.store.read_off_loop(functools.partial(
            self.store.get_raw_many,
            "payloads", [payload_key(record.operation_id, "request") for record, _ in claims],
        )) if claims else []
        for (record, _entry), stored in zip(claims, requests, strict=True):
            if self._start(record, stored, nursery):
                started += 1
        return started

    async def _reserve(
        self, wanted: list[tuple[OperationRecord, QueueEntry]], limit: int, clock: float
    ) -> list[tuple[OperationRecord, QueueEntry]]:
        """The first ``limit`` of ``wanted`` (in queue order) no other owner's worker is
        claiming (``RecoveryStore.reserve_claims``): workers reading the same page start
        different operations instead of racing for the same leases. One another owner
        holds is looked at again after ``BUSY_SECONDS``."""
        reserved = set(await self.store.read_off_loop(functools.partial(
            self.store.reserve_claims,
            [record.operation_id for record, _ in wanted], limit=limit,
        )))
        if len(reserved) < limit:  # every one not reserved is another's
            for record, _ in wanted:
                if record.operation_id not in reserved:
                    self.skip[record.operation_id] = clock + BUSY_SECONDS
        return [(record, entry) for record, entry in wanted if record.operation_id in reserved]

    async def _continue(self, operation_id: str, clock: float) -> int:
        """Dispatch a pending continuation when due: 1 if a successor was
        created (it is queued: a later round claims it)."""
        # The runtime's account NOW (fail closed): a signed-out runtime dispatches nothing.
        result = await dispatch_continuation(self.store, self.rt.telemetry, operation_id,
                                             account=self.rt.account,
                                             endpoint_id=self.endpoint_id, now=self.rt.now())
        if result.outcome == "not_due" and result.due_at is not None:
            # Looked at again within a second at most: the wall clock may jump.
            wait = min(CONTINUATION_RECHECK, max(0.0, result.due_at - self.rt.now()))
            self.skip[operation_id] = clock + wait
        elif result.outcome in ("not_mine", "failed"):
            self.skip[operation_id] = clock + SKIP_SECONDS
        if result.outcome == "dispatched":
            self.report.continued += 1
            return 1
        return 0

    def _start(
        self, record: OperationRecord, stored: bytes | None, nursery: trio.Nursery
    ) -> bool:
        """Start an execution of ``record`` (``stored``: its saved request, read with the
        round's others); False if it cannot run from here now."""
        operation_id = record.operation_id
        try:
            if stored is None:
                raise errors.RequestUnavailable(operation_id=operation_id)
            saved = msgspec.json.decode(stored, type=StoredRequest)
            response = JsonSchema(saved.format_name, saved.schema)
            execution = self.rt.start_operation(
                Handle(operation_id), response=response, authorize=self.authorize
            )
        except errors.OperationBusy:
            self.report.busy += 1
            return False
        except (errors.RecoveryError, msgspec.DecodeError):
            # It cannot be run from here (its saved request is unreadable, ...): leave it
            # to the host (status shows why), and do not look at it again for a while.
            self.skip[operation_id] = trio.current_time() + SKIP_SECONDS
            return False
        self.running[operation_id] = execution
        self.report.claimed += 1
        nursery.start_soon(self._finish, execution)
        return True

    async def _finish(self, execution: Running) -> None:
        operation_id = execution.operation_id
        try:
            await execution.finished.wait()
        finally:
            self.running.pop(operation_id, None)
            self._wake()
        error = execution.error
        if isinstance(error, errors.EndpointUnavailable) and not self._stopping():
            self.report.stopped += 1  # it rests prepared, queued: nothing was spent
            self.unavailable = errors.EndpointUnavailable(
                kind=error.kind, unreachable_after=error.unreachable_after
            )
            return
        if self._stopping() and error is not None:
            # Stopping: the shutdown accounts for the executions it stopped. One that
            # finished without an error (its receipt saved just before the stop) still
            # counts as completed below (a race seen on the PostgreSQL store).
            return
        if isinstance(error, errors.OperationBusy | errors.FenceMismatch):
            self.report.busy += 1
            return
        record: OperationRecord | None = None
        if error is None:
            # It ended without an error: its completion is saved (the execution returns
            # only after the receipt's write committed), so it is finished: no read.
            finished = True
        else:
            try:
                record = self.store.get_operation(operation_id)
            except errors.RecoveryError:
                record = None
            finished = record is None or record.phase in FINISHED or record.has_completion
        expired = isinstance(error, errors.StateExpired)
        if finished or expired:
            if error is None:
                self.report.completed += 1
            else:
                self.report.failed += 1
            with trio.CancelScope(shield=True):
                self.report.removed += await self.store.write(
                    functools.partial(_dequeue, [operation_id]), touches=(operation_id,)
                )
            return
        self.report.stopped += 1
        if record is not None and record.phase != "suspended":
            self.skip[operation_id] = trio.current_time() + SKIP_SECONDS

    def _stopping(self) -> bool:
        return self.stop.is_set() or self.unavailable is not None

    async def _shutdown(self) -> None:
        """Flag the running operations for resumption, stop them, wait until each has
        suspended durably and released its lease."""
        running = list(self.running.values())
        if not running:
            return
        with trio.CancelScope(shield=True):
            ids = [execution.operation_id for execution in running]
            try:
                await self.store.write(functools.partial(_mark_resume, ids), touches=ids)
                self.report.resumable += len(ids)
            except errors.RecoveryError:
                pass  # they stay suspended; a host resumes them (send_recovering / submit)
            for execution in running:
                execution.stop()
            for execution in running:
                await execution.finished.wait()


async def run_worker(
    runtime: WorkerRuntime,
    *,
    concurrency: int,
    authorize: Authorize,
    stop: trio.Event | None = None,
) -> WorkerReport:
    """Run queued and orphaned operations of ``runtime``'s account and endpoint, at most
    ``concurrency`` at once, until ``stop`` is set (then they are suspended durably and
    flagged for the next worker). ``authorize`` is the standing authorization policy:
    it is asked before every attempt, like ``send_recovering``'s callback. Raises
    ``EndpointUnavailable`` once an operation found the endpoint unreachable past the
    runtime's ``unreachable_after`` (the worker stopped as on ``stop``; nothing spent)."""
    if (
        not isinstance(concurrency, int) or isinstance(concurrency, bool)
        or not 1 <= concurrency <= MAX_CONCURRENCY
    ):
        raise errors.InvalidRequest(f"concurrency must be an integer in 1..{MAX_CONCURRENCY}")
    if not callable(authorize):
        raise errors.InvalidRequest("authorize must be a callable")
    worker = _Worker(runtime, concurrency=concurrency, authorize=authorize,
                     stop=trio.Event() if stop is None else stop)
    report = await worker.run()
    if worker.unavailable is not None:
        raise worker.unavailable
    return report

