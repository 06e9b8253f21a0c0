"""The Runtime (supervisor): the public API over one store, one backend, one account.

``open_runtime`` opens the supervisor nursery holding the Scheduler, the
LifecycleMonitor, the telemetry pump and every active operation: each
``send_recovering`` starts an operation's execution as a task of that nursery
(``actors/supervisor.py``) and awaits its outcome; the caller's cancellation
suspends the operation. Manual retry lives in ``actors/retry.py``, the lifecycle
transactions in ``actors/lifecycle.py``, new records in ``actors/prepare.py``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio

from recoverable import _killpoints, errors, machine
from recoverable.actors import live as live_operations
from recoverable.actors import operation, prepare_send, reads
from recoverable.actors import queue as submitted
from recoverable.actors import retry as manual_retry
from recoverable.actors.checks import require_bound, require_signed_in
from recoverable.actors.delegate import Delegation, open_delegation
from recoverable.actors.execution import Execution
from recoverable.actors.fenced import Creation
from recoverable.actors.governor import DEFAULT_BURST_SECONDS, RateGovernor
from recoverable.actors.heartbeat import LeaseKeeper
from recoverable.actors.host import Authorize, Backend
from recoverable.actors.lifecycle import acknowledge_all, dispose, write_lineage_command
from recoverable.actors.live import LiveSlot
from recoverable.actors.monitor import LifecycleMonitor
from recoverable.actors.options import POLICY_UNSET, PrepareOptions
from recoverable.actors.prepare import (
    admission_for,
    create_operation,
    new_operation_id,
    save_admitted,
)
from recoverable.actors.reattach import cancel_on_server
from recoverable.actors.scheduler import Scheduler
from recoverable.actors.supervisor import Running, Supervisor
from recoverable.actors.sweep import sweep_at_open
from recoverable.actors.thread import Thread, open_thread
from recoverable.actors.waiters import QueueWatch
from recoverable.contract import ResponseContract, contract_for
from recoverable.pricing import PriceTable
from recoverable.records import (
    CommandKind,
    Disposition,
    DispositionRecord,
    OnInterruption,
    OperationRecord,
)
from recoverable.storage.base import Store as RecoveryStore
from recoverable.storage.leases import lease_blocks, unexpired_derivative
from recoverable.storage.queue_checks import find_damage
from recoverable.telemetry import Telemetry, TelemetrySink
from recoverable.transport.connect import (
    UNREACHABLE_AFTER,
    ConnectBackoff,
    EndpointGate,
    check_unreachable_after,
)
from recoverable.types import (
    AccountBinding,
    Handle,
    Inventory,
    JsonSchema,
    Receipt,
    RetryPolicy,
    Selection,
    SourceRef,
    Status,
    StructuredRequest,
)

__all__ = ["Backend", "Runtime", "new_operation_id", "open_runtime"]

ResultT = TypeVar("ResultT")
Selector = Callable[[StructuredRequest], StructuredRequest]

_UNSET: Any = object()


class Runtime:
    def __init__(
        self,
        store: RecoveryStore,
        backend: Backend | None,
        *,
        account: AccountBinding | None,
        selector: Selector | None = None,
        wall_clock: Callable[[], float] = time.time,
        scheduler: Scheduler,
        telemetry: Telemetry,
        monitor: LifecycleMonitor,
        connect_backoff: ConnectBackoff = ConnectBackoff(),
        governor: RateGovernor | None = None,
        leases: LeaseKeeper | None = None,
        unreachable_after: float = UNREACHABLE_AFTER,
    ) -> None:
        self.store = store
        self.backend = backend
        self.account = account
        self.signed_out = False  # sign_out was called (account=None means "signed out")
        self.selector = selector
        self.now = wall_clock
        self.scheduler = scheduler
        self.telemetry = telemetry
        self.monitor = monitor
        self.connect_backoff = connect_backoff
        self.unreachable_after = check_unreachable_after(unreachable_after)
        # The rate governor (docs/rate-limits.md): the shared 429 pause, and the
        # requests/tokens per minute of every process on this store.
        self.governor = governor or RateGovernor(store, wall_clock=wall_clock, telemetry=telemetry)
        self.attempts_consumed = 0  # attempts this runtime consumed (persisted before sending)
        self.usage_malformed = 0  # attempts whose reported usage was ignored as malformed
        self.reattachments = 0  # resume GETs of background responses that ended
        self.supervisor = Supervisor()  # every active operation: a task of open_runtime's nursery
        self.queue_watch = QueueWatch(store, wall_clock)  # every ``wait``'s poller (waiters.py)
        # The leases this runtime holds, renewed by the heartbeat task (actors/heartbeat.py).
        self.leases = leases or LeaseKeeper(store, lease_seconds=30.0, wall_clock=wall_clock)
        self._gates: dict[str, EndpointGate] = {}

    def endpoint_gate(self, endpoint_id: str) -> EndpointGate:
        """The shared connect backoff of one endpoint in this runtime (item 11.7)."""
        gate = self._gates.get(endpoint_id)
        if gate is None:
            gate = self._gates[endpoint_id] = EndpointGate(
                endpoint_id, self.connect_backoff, self.unreachable_after
            )
        return gate

    def endpoint_failure(self) -> str | None:
        """The typed connect failure of this runtime's endpoint, None while it is reachable."""
        if self.backend is None:
            return None
        gate = self._gates.get(self.backend.endpoint_id)
        return gate.failure if gate is not None else None

    # --- account --------------------------------------------------------------------

    def sign_out(self) -> None:
        """Stop authorizing work for any account, and stop this runtime's running work.

        Every operation this runtime is executing is stopped at once (its transport,
        cooldown wait or authorization wait is cancelled, as by a local ``cancel``);
        its ``send_recovering`` raises ``AccountChanged``. An attempt in flight stays
        spent and reads as interrupted (``transport_code="signed_out"``); a completion
        already received is validated and kept as the receipt, never delivered.
        """
        self.account = None
        self.signed_out = True
        self.monitor.account_changed(None)

    def sign_in(self, account: AccountBinding) -> None:
        """Bind the runtime to ``account``; running work of any other account stops
        as on :meth:`sign_out` (``transport_code="account_changed"``)."""
        self.account = account
        self.monitor.account_changed(account)

    # --- prepare --------------------------------------------------------------------

    async def prepare(
        self,
        request: StructuredRequest,
        *,
        response: type[Any] | JsonSchema,
        maximum_attempts: int,
        retry_policy: RetryPolicy | None = None,
        expires_at: Any = None,
        scope: str | None = None,
        job_id: str | None = None,
        input_revision: str | None = None,
        contract_version: str | None = None,
        previous_operation_id: str | None = None,
        maximum_output_tokens_total: int | None = None,
        on_interruption: OnInterruption = POLICY_UNSET,
        source: SourceRef | None = None,
        attempt_timeout: float | None = None,
        live: bool = False,
        reattach: bool = False,
        maximum_cost_total: float | None = None,
        prices: PriceTable | None = None,
    ) -> Handle:
        """Freeze the request and persist the operation without sending anything.

        With a ``job_id``, once per (account, scope, job, revision): again, the same handle
        (``JobConflict`` for another body, ``AlreadyAcknowledged`` once acknowledged).

        ``source=SourceRef(key, digest)`` binds the result to a source at a digest (issue
        16, docs/sources.md): the manifest must hold that digest (``store.set_source``);
        its receipt is saved only while it still does, and a manifest change supersedes
        it. Each of its attempts then has a hard ``attempt_timeout`` (seconds; default two
        thirds of the lease), which must be shorter than this runtime's lease
        (``InvalidParameter``). ``attempt_timeout`` may also be given without a source.

        ``live=True`` makes a live operation, run with :meth:`live` to show
        partial views while it streams; its policy is fixed: ``on_interruption="fail"``
        (an explicit ``"replace"`` is ``InvalidRequest``). See docs/live.md.

        ``on_interruption`` is saved with the operation: ``"replace"`` (the default) lets
        an interrupted attempt (disconnect, idle timeout, crash, lost lease) be replaced
        within the budget; ``"fail"`` ends the operation ``failed`` with
        ``failure_reason="interrupted"`` instead, never replaced. See docs/failures.md.

        ``maximum_output_tokens_total`` (optional) is a token budget saved with the
        operation like ``maximum_attempts``: once the output tokens the provider reported
        across its attempts reach it, no replacement is authorized
        (``TokenBudgetExhausted``, availability ``exhausted``). ``maximum_cost_total``
        (USD, optional) is the same for the cost of that usage, at the price ``prices``
        (a ``recoverable.pricing.PriceTable``; default genai-prices') gives the model and
        service tier, saved with the operation (``CostBudgetExhausted``); no price:
        ``PriceUnknown`` and nothing is saved. See docs/usage.md.

        ``previous_operation_id`` names a prior operation of the same host job, for
        diagnostics only (shown in status, receipts and markers): the new operation
        has its own budget and its own root; nothing about the prior one is checked,
        reserved or changed (it may even be gone). Use ``retry`` for a linked successor.

        ``reattach=True`` freezes the body with ``background: true, store:
        true``: an attempt interrupted by a disconnect, an idle timeout, a crash or a lost
        lease is first resumed by its saved response id (a GET: no new POST, no budget)
        before seed 000 replaces it. The provider keeps the response for a limited time
        (a privacy trade-off): see docs/reattach.md.
        """
        require_bound(self.account, signed_out=self.signed_out)
        options = PrepareOptions(
            maximum_attempts=maximum_attempts, retry_policy=retry_policy,
            expires_at=expires_at, scope=scope, job_id=job_id, input_revision=input_revision,
            contract_version=contract_version, previous_operation_id=previous_operation_id,
            maximum_output_tokens_total=maximum_output_tokens_total,
            on_interruption=on_interruption, source=source, attempt_timeout=attempt_timeout,
            live=live, reattach=reattach, maximum_cost_total=maximum_cost_total, prices=prices,
        )
        record, body, stored = admission_for(self, request, response=response, options=options)
        return await save_admitted(self, record, body, stored, create_operation, "prepare")

    # --- submit and wait: operations run by workers (actors/queue.py, actors/worker.py) ---

    submit = submitted.submit
    admit = prepare_send.admit  # internal: prepare and send in one write (batch)
    send_admitted = prepare_send.send_admitted
    wait = submitted.wait
    live = live_operations.live  # a live operation's partial views (docs/live.md)

    # --- send -----------------------------------------------------------------------

    async def send_recovering(
        self,
        handle: Handle,
        *,
        response: type[ResultT] | JsonSchema,
        authorize: Authorize,
        expected_contract_version: str | None = _UNSET,
    ) -> ResultT:
        """Run the operation to a validated, saved completion and return it.

        A saved completion is returned with no POST and no callback. The operation runs
        as an actor of this runtime's supervisor nursery; this call is its caller. Trio
        cancellation of the calling task suspends the operation (and returns only after
        the actor has unwound and released its lease).
        """
        execution = self.start_operation(
            handle,
            response=response,
            authorize=authorize,
            expected_contract_version=expected_contract_version,
            attached=True,
        )
        result: ResultT = await execution.outcome()
        return result

    def start_operation(
        self,
        handle: Handle,
        *,
        response: type[Any] | JsonSchema,
        authorize: Authorize,
        expected_contract_version: str | None = _UNSET,
        attached: bool = False,
        live: LiveSlot | None = None,
        create: Creation | None = None,
    ) -> Running:
        """Internal: start the operation's execution in the supervisor nursery, not awaiting it.

        Detached (the default) it runs with no caller until it ends or the runtime
        closes (then it is suspended, as by a caller's cancellation). Its outcome is
        ``await execution.outcome()``; a second start of a running operation raises
        ``OperationBusy``. It runs in a copy of the starting task's context.
        """
        contract: ResponseContract = contract_for(response)
        execution = Execution(
            self, handle.operation_id, contract, authorize,
            standing_policy=not attached,
            live=live,
            expected_contract_version=(
                None if expected_contract_version is _UNSET else expected_contract_version
            ),
            check_contract_version=expected_contract_version is not _UNSET,
            create=create,
        )
        run: Callable[[], Awaitable[Any]] = functools.partial(operation.run, execution)
        if live is not None:  # a live operation's views
            run = live.closing(run)
        return self.supervisor.start(handle.operation_id, run, attached=attached)

    # --- manual retry ---------------------------------------------------------------

    async def retry(
        self,
        handle: Handle,
        *,
        retry_action_id: str,
        maximum_attempts: int,
        selection: Selection = "preserve",
        expires_at: Any = None,
        retry_policy: RetryPolicy | None = None,
    ) -> Handle:
        """Create (or finish creating) the one successor of a source operation.

        Only after a deliberate user decision; it does not generate. The
        successor has a fresh bounded budget and links to the previous/root
        operations; the source's history and spent budget are unchanged. The
        reservation is saved on the source before the child is created, and
        the child's id derives from (source id, action id), so repeating the
        same action with the same settings returns or completes the same child.
        See ``actors/retry.py``.
        """
        plan = manual_retry.plan_retry(
            handle.operation_id,
            retry_action_id=retry_action_id,
            maximum_attempts=maximum_attempts,
            selection=selection,
            expires_at=expires_at,
            retry_policy=retry_policy,
            account=self.account,
            endpoint_id=self.backend.endpoint_id if self.backend is not None else None,
            now=self.now(),
        )
        return await manual_retry.retry(
            self.store, plan, selector=self.selector, telemetry=self.telemetry
        )

    def thread(self, thread_id: str, **settings: Any) -> Thread:
        """A durable multi-turn thread (``actors/thread.py``): ``response``,
        ``model``, ``instructions``, ``maximum_attempts``, ``retry_policy``,
        ``reasoning_effort``; ``server_state=True`` is refused (an unsupported form)."""
        return open_thread(self, thread_id, **settings)

    def delegate(self, group_id: str, **settings: Any) -> Delegation:
        """A parent fed by child operations (``actors/delegate.py``): ``builder``
        (deterministic: children's values by key -> the parent's request), ``response``,
        ``maximum_attempts``, ``retry_policy``."""
        return open_delegation(self, group_id, **settings)

    # --- reads ----------------------------------------------------------------------

    def _read(self, operation_id: str) -> OperationRecord:
        return reads.read_record(self.store, operation_id)

    async def status(self, handle: Handle) -> Status:
        """A snapshot of every dimension; never generates, renews or takes the lease."""
        return self.status_of(handle.operation_id)

    def status_of(self, operation_id: str) -> Status:
        disposition = self.store.get_disposition(operation_id)
        if disposition is not None:
            return self._disposition_status(disposition)
        try:
            record = self.store.get_operation(operation_id)
        except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
            return Status(
                operation_id=operation_id,
                state="failed",
                availability="blocked",
                blockers=frozenset({"incompatible_record"}),
                suggested_actions=("abandon",),
            )
        if record is None:
            raise errors.StateUnavailable("no such operation", operation_id=operation_id)
        return self._status(record)

    def _status(self, record: OperationRecord) -> Status:
        try:
            lease = self.store.get_lease(record.operation_id)
        except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
            lease = None  # with_queue_state names the damaged row
        now = self.now()
        # A derivative's lease holds until it expires, even after its owner died.
        live = lease is not None and lease_blocks(self.store, lease, record, now)
        command = self.store.get_command(record.operation_id)
        payloads = self.store.payload_kinds([record.operation_id])[record.operation_id]
        status = self.governor.mark_status(record, machine.derive_status(
            record,
            now=now,
            lease_live=live,
            viewer=self.account,
            endpoint_id=self.backend.endpoint_id if self.backend is not None else None,
            command=command.kind if command is not None else None,
            payloads=payloads,
            endpoint_down=self.endpoint_failure(),
            lease=lease,
        ))
        return submitted.with_queue_state(self.store, record, status)

    def _disposition_status(self, marker: DispositionRecord) -> Status:
        return reads.disposition_status(self.account, marker)

    async def receipt(self, handle: Handle) -> Receipt:
        """The saved, validated completion (works without backend or unexpired permission)."""
        return reads.saved_receipt(self.store, self.account, self.telemetry, handle.operation_id)

    async def inventory(self, scope: str | None = None) -> Inventory:
        require_bound(self.account, signed_out=self.signed_out)
        account = require_signed_in(self.account, "no inventory")
        records, unreadable = self.store.inventory(account=account, scope=scope)
        leases, commands = self.store.control_rows()
        present = self.store.payload_kinds(record.operation_id for record in records)
        live: dict[str, bool] = {}
        now = self.now()
        endpoint_id = self.backend.endpoint_id if self.backend is not None else None
        endpoint_down = self.endpoint_failure()
        pauses: dict[tuple[str, AccountBinding], float | None] = {}
        served = submitted.served_now(self.store)  # live workers (docs/workers.md)
        look = find_damage(self.store, [record.operation_id for record in records])
        statuses = []
        for record in records:
            lease = leases.get(record.operation_id)
            is_live = False
            if lease is not None:
                key = f"{lease.owner_id}\0{lease.token}"
                if key not in live:
                    live[key] = self.store.lease_is_live(lease, now)
                is_live = live[key] or unexpired_derivative(lease, record, now)
            command = commands.get(record.operation_id)
            status = self.governor.mark_status(
                record,
                machine.derive_status(
                    record, now=now, lease_live=is_live, viewer=self.account,
                    endpoint_id=endpoint_id,
                    command=command.kind if command is not None else None,
                    payloads=present.get(record.operation_id),
                    endpoint_down=endpoint_down,
                    lease=lease,
                ),
                pauses,
            )
            statuses.append(
                submitted.with_queue_state(self.store, record, status, served, look)
            )
        return Inventory(operations=tuple(statuses), unreadable=tuple(unreadable))

    # --- lifecycle ------------------------------------------------------------------

    async def suspend(self, handle: Handle) -> None:
        """Suspend from any runtime on the store, also while another process streams it.
        A continuation successor dispatched after it is suspended too."""
        await self._command(handle.operation_id, "suspend")

    async def cancel(self, handle: Handle) -> None:
        """Permanently cancel: fences late delivery and all future generation.

        A completion that is already saved is fenced too: after ``cancel`` the
        validated (and paid-for) result can never be read with ``receipt`` nor
        returned by ``send_recovering``. Read and commit it first if it may be
        needed (``status().has_saved_completion``); the CLI's ``cancel`` refuses
        such an operation unless given ``--force``. A continuation successor
        dispatched after it (not completed yet) is cancelled too.
        """
        await self._command(handle.operation_id, "cancel")

    async def _command(self, operation_id: str, kind: CommandKind) -> bool:
        """Suspend or cancel; True if it was requested of the process that runs the
        operation (its command row written), False if it was applied here. (The CLI says
        which: what it reads afterwards cannot, once that process applied the row.)"""
        # User intent applies to the lineage: also the continuation successors dispatched after it.
        commands = await self.store.write(
            functools.partial(write_lineage_command, operation_id, kind, self.now(),
                              self.account),
            touches=(operation_id,),
        )
        for command in commands:
            self.monitor.notify_local(command)
        self.telemetry.emit(
            "operation.cancelled" if kind == "cancel" else "operation.suspended", operation_id
        )
        own = [command for command in commands if command.operation_id == operation_id]
        if kind == "cancel" and not own:  # applied here: nobody runs it (cancel on the server)
            record = self.store.get_operation(operation_id)
            if record is not None and record.reattach:
                await cancel_on_server(self, record)
        return bool(own)

    async def acknowledge(self, handle: Handle) -> None:
        """After the host's own commit: remove request and response, keep a small marker.

        The marker and the removal commit together. Idempotent.
        """
        await self._dispose(handle.operation_id, "acknowledged")
        self.telemetry.emit("receipt.acknowledged", handle.operation_id)

    async def acknowledge_many(self, handles: Iterable[Handle]) -> dict[str, errors.RecoveryError]:
        """``acknowledge`` of many in one store write: what each refused, by operation id
        (the others' markers commit together; ``lifecycle.acknowledge_all``)."""
        ids = [handle.operation_id for handle in handles]
        return await acknowledge_all(self.store, ids, self.now(), self.account, self.telemetry)

    async def abandon(self, handle: Handle) -> None:
        """The result is no longer applicable: remove content, keep a small marker."""
        await self._dispose(handle.operation_id, "abandoned")
        self.telemetry.emit("operation.abandoned", handle.operation_id)

    async def _dispose(self, operation_id: str, disposition: Disposition) -> None:
        await self.store.write(
            functools.partial(dispose, operation_id, disposition, self.now(), self.account),
            touches=(operation_id,),
        )
        _killpoints.hit("acknowledge.marker_saved")


@asynccontextmanager
async def open_runtime(
    store: RecoveryStore,
    backend: Backend | None,
    *,
    account: AccountBinding | None,
    selector: Selector | None = None,
    max_concurrency: int | None = None,
    requests_per_second: float | None = None,
    requests_per_minute: float | None = None,
    tokens_per_minute: float | None = None,
    rate_burst_seconds: float = DEFAULT_BURST_SECONDS,
    telemetry: TelemetrySink | None = None,
    wall_clock: Callable[[], float] = time.time,
    monitor_interval: float = 0.002,
    connect_backoff: ConnectBackoff = ConnectBackoff(),
    lease_seconds: float = 30.0,
    unreachable_after: float = UNREACHABLE_AFTER,
) -> AsyncIterator[Runtime]:
    """Open the supervisor: scheduler, lifecycle monitor and telemetry pump.

    Trio only: elsewhere (``asyncio.run``, plain threads) it raises ``TrioRequired``;
    use ``recoverable.AsyncioRuntime`` or ``recoverable.BlockingRuntime`` there.

    Rate limits (docs/rate-limits.md): ``max_concurrency`` generations streaming at once
    and ``requests_per_second`` POST starts per second in this runtime;
    ``requests_per_minute`` / ``tokens_per_minute`` are shared by every process on
    ``store`` with the same endpoint and account (token buckets holding
    ``rate_burst_seconds`` of budget). A 429 with Retry-After pauses every operation of
    the endpoint and account, in every process, persisted.

    Leases (docs/guarantees.md#time-bounded-leases): each execution's lease expires
    ``lease_seconds`` (1..3600, ``InvalidRequest`` outside) after its last renewal; this
    runtime's heartbeat renews all of them every ``lease_seconds / 3``. A hung process is
    reclaimable by another once its leases expire; a running attempt's transport is cut
    ``lease_seconds / 6`` before its lease would expire unrenewed (``LeaseLost``).

    An endpoint that cannot be connected to spends nothing; its operations wait in a
    shared ``connect_backoff``, at most ``unreachable_after`` seconds (300; ``math.inf``:
    no bound) after its first failed connect with no success since, then each raises
    ``EndpointUnavailable`` (docs/failures.md#an-endpoint-that-cannot-be-reached).
    """
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        raise errors.TrioRequired(
            "open_runtime runs only inside Trio (trio.run); under asyncio use "
            "recoverable.AsyncioRuntime, from threads or blocking code "
            "recoverable.BlockingRuntime (docs/hosts.md)"
        ) from None
    scheduler = Scheduler(
        wall_clock, max_concurrency=max_concurrency, requests_per_second=requests_per_second
    )
    pump = Telemetry(telemetry)
    governor = RateGovernor(
        store,
        wall_clock=wall_clock,
        telemetry=pump,
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
        burst_seconds=rate_burst_seconds,
    )
    monitor = LifecycleMonitor(store, poll_interval=monitor_interval)
    leases = LeaseKeeper(store, lease_seconds=lease_seconds, wall_clock=wall_clock)
    runtime = Runtime(
        store,
        backend,
        account=account,
        selector=selector,
        wall_clock=wall_clock,
        scheduler=scheduler,
        telemetry=pump,
        monitor=monitor,
        connect_backoff=connect_backoff,
        governor=governor,
        leases=leases,
        unreachable_after=unreachable_after,
    )
    body_error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler.run)
        nursery.start_soon(monitor.run)
        nursery.start_soon(pump.run)
        nursery.start_soon(leases.run)
        nursery.start_soon(runtime.queue_watch.run)
        runtime.supervisor.open(nursery)
        try:
            # Close what dead owners left behind before anything runs.
            await sweep_at_open(store, now=runtime.now(), telemetry=pump, serving=(
                None if account is None or backend is None
                else (account.account_id, account.source, backend.endpoint_id)
            ))
            yield runtime
        except BaseException as exc:
            # Re-raised below, unchanged: the host's own exception must not come back
            # wrapped in an ExceptionGroup by this internal nursery.
            body_error = exc
        finally:
            # A detached operation still running is cancelled with the nursery: its actor
            # suspends it durably (a shielded write) before the nursery closes.
            runtime.supervisor.close()
            pump.flush()
            nursery.cancel_scope.cancel()
    if body_error is not None:
        raise body_error
