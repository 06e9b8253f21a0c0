"""The Runtime (supervisor): the public API over one store, one backend, one account.

``open_runtime`` opens a supervisor nursery holding the Scheduler, the
LifecycleMonitor and the telemetry pump; each ``send_recovering`` runs an
OperationActor in the caller's task (so the caller's cancellation suspends it).
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import msgspec
import trio
from recoverable.actors.governor import RateGovernor
from recoverable.actors.monitor import LifecycleMonitor
from recoverable.actors.operation import Authorize, OperationActor, check_disposition
from recoverable.actors.scheduler import Scheduler
from recoverable.storage.base import Store as RecoveryStore
from recoverable.storage.base import WriteTransaction as WriteTxn
from recoverable.storage.integrity import verify_body
from recoverable.storage.migration import saved_completion, upgrade_operation
from recoverable.storage.retention import remove_content
from recoverable.transport.base import Credentials
from recoverable.transport.connect import ConnectBackoff, EndpointGate

from recoverable import _killpoints, errors, machine
from recoverable.body import body_hash, freeze_body
from recoverable.contract import ResponseContract, contract_for
from recoverable.outcome import Outcome, Progress, Usage
from recoverable.records import (
    CommandKind,
    DispositionRecord,
    OperationRecord,
    RetryReservation,
    StoredRequest,
)
from recoverable.telemetry import Telemetry, TelemetrySink
from recoverable.types import (
    AccountBinding,
    Handle,
    Inventory,
    JsonSchema,
    Receipt,
    RetryPolicy,
    Selection,
    Status,
    StructuredRequest,
    to_datetime,
    to_timestamp,
)

T = TypeVar("T")
Selector = Callable[[StructuredRequest], StructuredRequest]

_UNSET: Any = object()


class Backend(Protocol):
    """What the runtime needs from a transport (``ResponsesBackend`` implements it)."""

    @property
    def endpoint_id(self) -> str: ...

    @property
    def credentials(self) -> Credentials: ...

    async def stream(
        self,
        body: bytes,
        *,
        attempt_id: str,
        token: str,
        on_progress: Callable[[Progress], None] | None = None,
        before_send: Callable[[], Awaitable[None]] | None = None,
    ) -> Outcome: ...


_ID_PREFIX = secrets.token_bytes(8)  # per process; ids stay unique across processes
_ID_COUNTER = itertools.count(int.from_bytes(secrets.token_bytes(4), "big"))


def new_operation_id() -> str:
    """A unique operation id without a system call per id (ids are not secrets)."""
    return "op_" + (_ID_PREFIX + next(_ID_COUNTER).to_bytes(8, "big")).hex()


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
    ) -> None:
        self.store = store
        self.backend = backend
        self.account = account
        self.selector = selector
        self.now = wall_clock
        self.scheduler = scheduler
        self.telemetry = telemetry
        self.monitor = monitor
        self.connect_backoff = connect_backoff
        # The rate governor (docs/rate-limits.md): the shared 429 pause, and the
        # requests/tokens per minute of every process on this store.
        self.governor = governor or RateGovernor(store, wall_clock=wall_clock, telemetry=telemetry)
        self.attempts_consumed = 0  # attempts this runtime consumed (persisted before sending)
        self.usage_malformed = 0  # attempts whose reported usage was ignored as malformed
        self._gates: dict[str, EndpointGate] = {}

    def endpoint_gate(self, endpoint_id: str) -> EndpointGate:
        """The shared connect backoff of one endpoint in this runtime (item 11.7)."""
        gate = self._gates.get(endpoint_id)
        if gate is None:
            gate = self._gates[endpoint_id] = EndpointGate(endpoint_id, self.connect_backoff)
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
        self.monitor.account_changed(None)

    def sign_in(self, account: AccountBinding) -> None:
        """Bind the runtime to ``account``; running work of any other account stops
        as on :meth:`sign_out` (``transport_code="account_changed"``)."""
        self.account = account
        self.monitor.account_changed(account)

    def _require_account(self, record: OperationRecord) -> None:
        if self.account is None:
            raise errors.AccountChanged("signed out", operation_id=record.operation_id)
        if record.account != self.account:
            raise errors.AccountChanged(
                "the operation belongs to another account", operation_id=record.operation_id
            )

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
    ) -> Handle:
        """Freeze the request and persist the operation without sending anything.

        ``maximum_output_tokens_total`` (optional) is a token budget saved with the
        operation like ``maximum_attempts``: once the output tokens the provider reported
        across its attempts reach it, no replacement is authorized
        (``TokenBudgetExhausted``, availability ``exhausted``). See docs/usage.md.

        ``previous_operation_id`` names a prior operation of the same host job, for
        diagnostics only (shown in status, receipts and markers): the new operation
        has its own budget and its own root; nothing about the prior one is checked,
        reserved or changed (it may even be gone). Use ``retry`` for a linked successor.
        """
        if self.account is None:
            raise errors.AccountChanged("signed out: cannot prepare")
        policy = retry_policy or RetryPolicy()
        machine.validate_preparation(
            maximum_attempts=maximum_attempts,
            retry_policy=policy,
            scope=scope,
            job_id=job_id,
            input_revision=input_revision,
            contract_version=contract_version,
            maximum_output_tokens_total=maximum_output_tokens_total,
        )
        machine.validate_metadata("previous_operation_id", previous_operation_id)
        if self.backend is None:
            raise errors.ConfigurationUnavailable("no backend: cannot prepare generation")
        contract = contract_for(response)
        effective = request
        if self.selector is not None and not request.model_override:
            effective = self.selector(request)
        body = freeze_body(effective, contract)
        operation_id = new_operation_id()
        record = OperationRecord(
            operation_id=operation_id,
            account=self.account,
            endpoint_id=self.backend.endpoint_id,
            created_at=self.now(),
            maximum_attempts=maximum_attempts,
            expires_at=to_timestamp(expires_at),
            retry_policy=policy,
            model=effective.model,
            reasoning_effort=effective.reasoning_effort,
            model_override=request.model_override,
            format_name=contract.name,
            format_hash=contract.format_hash,
            contract_version=contract_version,
            scope=scope,
            job_id=job_id,
            input_revision=input_revision,
            body_hash=body_hash(body),
            root_operation_id=operation_id,
            previous_operation_id=previous_operation_id,
            maximum_output_tokens_total=maximum_output_tokens_total,
        )
        stored = msgspec.json.encode(
            StoredRequest(request=request, format_name=contract.name, schema=contract.schema)
        )
        await self._create(record, body, stored)
        self.telemetry.emit("operation.prepared", operation_id, model=record.model,
                            effort=record.reasoning_effort, maximum_attempts=maximum_attempts)
        return Handle(
            operation_id,
            root_operation_id=operation_id,
            previous_operation_id=previous_operation_id,
        )

    async def _create(self, record: OperationRecord, body: bytes, stored: bytes) -> None:
        op_id = record.operation_id

        def create(txn: WriteTxn) -> None:
            if txn.get_operation(op_id) is not None:
                raise errors.InvalidRequest("operation id collision", operation_id=op_id)
            txn.put_payload(op_id, "body", body)
            txn.put_payload(op_id, "request", stored)
            txn.put_operation(record)

        _killpoints.hit("prepare.before_save")
        await self.store.write(create)
        _killpoints.hit("prepare.saved")

    # --- send -----------------------------------------------------------------------

    async def send_recovering(
        self,
        handle: Handle,
        *,
        response: type[T] | JsonSchema,
        authorize: Authorize,
        expected_contract_version: str | None = _UNSET,
    ) -> T:
        """Run the operation to a validated, saved completion and return it.

        A saved completion is returned with no POST and no callback. Trio
        cancellation of the calling task suspends the operation.
        """
        contract: ResponseContract = contract_for(response)
        actor = OperationActor(self, handle.operation_id, contract, authorize)
        result: T = await actor.run(
            expected_contract_version=(
                None if expected_contract_version is _UNSET else expected_contract_version
            ),
            check_contract_version=expected_contract_version is not _UNSET,
        )
        return result

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
        """
        if not isinstance(retry_action_id, str) or not 0 < len(retry_action_id) <= 256:
            raise errors.InvalidRequest("retry_action_id must be a non-empty string (<= 256)")
        if selection not in ("preserve", "reselect"):
            raise errors.InvalidRequest("selection must be 'preserve' or 'reselect'")
        machine.validate_preparation(
            maximum_attempts=maximum_attempts,
            retry_policy=retry_policy or RetryPolicy(),
            scope=None, job_id=None, input_revision=None, contract_version=None,
        )
        if self.backend is None:
            raise errors.ConfigurationUnavailable("no backend: cannot prepare a successor")
        source_id = handle.operation_id
        settings = msgspec.json.encode(
            {
                "maximum_attempts": maximum_attempts,
                "selection": selection,
                "expires_at": to_timestamp(expires_at),
                "retry_policy": retry_policy,
            },
            order="sorted",
        )
        settings_hash = hashlib.sha256(settings).hexdigest()
        successor_id = "op_" + hashlib.sha256(
            f"{source_id}\0{retry_action_id}".encode()
        ).hexdigest()[:32]
        account = self.account
        now = self.now()
        endpoint_id = self.backend.endpoint_id

        def conditions(view: Any) -> OperationRecord:
            """The source-condition table, on the store (a pre-check) or in the write."""
            check_disposition(view, source_id)
            source: OperationRecord | None = view.get_operation(source_id)
            if source is None:
                raise errors.StateUnavailable("no such operation", operation_id=source_id)
            if account is None or source.account != account:
                raise errors.AccountChanged(operation_id=source_id)
            reservation = source.retry_reservation
            if reservation is not None:
                if reservation.retry_action_id != retry_action_id:
                    raise errors.RetryAlreadyCreated(
                        f"successor {reservation.successor_id} exists; retry from it",
                        operation_id=source_id,
                    )
                if reservation.settings_hash != settings_hash:
                    raise errors.RetryConfigurationMismatch(operation_id=source_id)
                return source
            lease = view.get_lease(source_id)
            if lease is not None and view.lease_is_live(lease):
                raise errors.OperationBusy(operation_id=source_id)
            machine.check_retry_source(source, now=now, endpoint_id=endpoint_id)
            return source

        # Check first, reserve second: the source must be clonable (its frozen request
        # present and readable) BEFORE its reservation is written, so a refusal leaves
        # no dangling successor id behind.
        checked = conditions(self.store)
        if checked.retry_reservation is not None and checked.retry_reservation.created:
            return self._successor_handle(checked)
        if checked.awaiting_upgrade:
            # A version-1 source: freeze its request (the lazy upgrade send_recovering
            # does), then check it again as a current record.
            await upgrade_operation(self.store, source_id, endpoint_id=endpoint_id)
            checked = conditions(self.store)
            if checked.awaiting_upgrade:
                raise errors.RequestUnavailable(
                    "the version-1 request could not be frozen: it cannot be cloned",
                    operation_id=source_id,
                )
        body, stored, model, effort = self._successor_body(checked, selection)

        def reserve(txn: WriteTxn) -> OperationRecord:
            source = conditions(txn)
            if source.retry_reservation is not None:
                return source
            if source.body_hash != checked.body_hash or txn.get_payload(
                source_id, "body"
            ) is None:
                raise errors.RequestUnavailable(
                    "the source's frozen request changed or disappeared", operation_id=source_id
                )
            reserved = msgspec.structs.replace(
                source,
                retry_reservation=RetryReservation(
                    retry_action_id=retry_action_id,
                    successor_id=successor_id,
                    settings_hash=settings_hash,
                ),
            )
            txn.put_operation(reserved)
            return reserved

        source = await self.store.write(reserve)
        assert source.retry_reservation is not None
        if source.retry_reservation.created:
            return self._successor_handle(source)
        _killpoints.hit("retry.reserved")
        child = OperationRecord(
            operation_id=successor_id,
            account=source.account,
            endpoint_id=endpoint_id,
            created_at=now,
            maximum_attempts=maximum_attempts,
            expires_at=to_timestamp(expires_at),
            retry_policy=retry_policy or source.retry_policy,
            model=model,
            reasoning_effort=effort,
            model_override=source.model_override,
            format_name=source.format_name,
            format_hash=source.format_hash,
            contract_version=source.contract_version,
            scope=source.scope,
            job_id=source.job_id,
            input_revision=source.input_revision,
            body_hash=body_hash(body),
            root_operation_id=source.root_operation_id,
            previous_operation_id=source_id,
            # The same per-operation token budget, counted afresh for the successor.
            maximum_output_tokens_total=source.maximum_output_tokens_total,
        )

        def create(txn: WriteTxn) -> None:
            current = txn.get_operation(source_id)
            if current is None or current.retry_reservation is None:
                raise errors.StateUnavailable("the source changed", operation_id=source_id)
            if txn.get_operation(successor_id) is None and txn.get_disposition(
                successor_id
            ) is None:
                txn.put_payload(successor_id, "body", body)
                txn.put_payload(successor_id, "request", stored)
                txn.put_operation(child)
            done = msgspec.structs.replace(current.retry_reservation, created=True)
            txn.put_operation(msgspec.structs.replace(current, retry_reservation=done))

        await self.store.write(create)
        self.telemetry.emit("operation.manual_retry_created", successor_id,
                            previous_operation_id=source_id, selection=selection,
                            maximum_attempts=maximum_attempts, model=model)
        return self._successor_handle(source)

    @staticmethod
    def _successor_handle(source: OperationRecord) -> Handle:
        assert source.retry_reservation is not None
        return Handle(
            source.retry_reservation.successor_id,
            root_operation_id=source.root_operation_id,
            previous_operation_id=source.operation_id,
        )

    def _successor_body(
        self, source: OperationRecord, selection: Selection
    ) -> tuple[bytes, bytes, str, str | None]:
        op_id = source.operation_id
        body = self.store.get_payload(op_id, "body")
        stored_raw = self.store.get_payload(op_id, "request")
        if body is None or stored_raw is None:
            raise errors.RequestUnavailable(
                "the source's frozen request is missing from the store: it cannot be cloned",
                operation_id=op_id,
            )
        if selection == "preserve":
            verify_body(op_id, source.body_hash, body)  # a tampered body is never reused
            return body, stored_raw, source.model, source.reasoning_effort
        try:
            stored = msgspec.json.decode(stored_raw, type=StoredRequest)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise errors.CorruptRecord(
                "the saved request is unreadable", operation_id=op_id
            ) from exc
        request = stored.request
        effective = request
        if self.selector is not None and not request.model_override:
            effective = self.selector(request)
        contract = contract_for(JsonSchema(stored.format_name, stored.schema))
        if contract.format_hash != source.format_hash:
            raise errors.FormatMismatch("the saved contract changed", operation_id=op_id)
        return (
            freeze_body(effective, contract),
            stored_raw,
            effective.model,
            effective.reasoning_effort,
        )

    # --- reads ----------------------------------------------------------------------

    def _read(self, operation_id: str) -> OperationRecord:
        record = self.store.get_operation(operation_id)
        if record is None:
            disposition = self.store.get_disposition(operation_id)
            if disposition is not None:
                raise errors.StateUnavailable(
                    f"operation is {disposition.disposition}", operation_id=operation_id
                )
            raise errors.StateUnavailable("no such operation", operation_id=operation_id)
        return record

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
        lease = self.store.get_lease(record.operation_id)
        live = lease is not None and self.store.lease_is_live(lease)
        command = self.store.get_command(record.operation_id)
        payloads = self.store.payload_kinds([record.operation_id])[record.operation_id]
        return self._with_rate_limit(record, machine.derive_status(
            record,
            now=self.now(),
            lease_live=live,
            viewer=self.account,
            endpoint_id=self.backend.endpoint_id if self.backend is not None else None,
            command=command.kind if command is not None else None,
            payloads=payloads,
            endpoint_down=self.endpoint_failure(),
        ))

    def _with_rate_limit(
        self,
        record: OperationRecord,
        status: Status,
        pauses: dict[tuple[str, AccountBinding], float | None] | None = None,
    ) -> Status:
        """Mark an operation that waits for the rate governor: in this runtime (why, and
        until when), or behind a shared pause of its endpoint+account (any process)."""
        if status.state in ("completed", "failed", "cancelled") or status.redacted:
            return status
        waiting = self.governor.waiting.get(record.operation_id)
        if waiting is not None:
            return msgspec.structs.replace(
                status, rate_limited=waiting[0], rate_limited_until=to_datetime(waiting[1])
            )
        where = (record.endpoint_id, record.account)
        if pauses is not None and where in pauses:
            paused = pauses[where]
        else:
            paused = self.governor.paused_until(*where)
            if pauses is not None:
                pauses[where] = paused
        if paused is None:
            return status
        return msgspec.structs.replace(
            status, rate_limited="paused", rate_limited_until=to_datetime(paused)
        )

    def _disposition_status(self, d: DispositionRecord) -> Status:
        if self.account is None or d.account != self.account:
            return machine.redacted_status(d.operation_id)
        return Status(
            operation_id=d.operation_id,
            state=d.disposition,
            availability=d.disposition,
            attempts_used=d.attempts_used,
            maximum_attempts=d.maximum_attempts,
            root_operation_id=d.root_operation_id,
            previous_operation_id=d.previous_operation_id,
            job_id=d.job_id,
            input_revision=d.input_revision,
            scope=d.scope,
            usage=d.usage or Usage(),
        )

    async def receipt(self, handle: Handle) -> Receipt:
        """The saved, validated completion (works without backend or unexpired permission)."""
        record = self._read(handle.operation_id)
        self._require_account(record)
        command = self.store.get_command(record.operation_id)
        if record.phase == "cancelled" or (command is not None and command.kind == "cancel"):
            raise errors.OperationCancelled(operation_id=record.operation_id)
        # A version-1 record that was never upgraded keeps its completion inline: it is
        # read from there (no backend, no lease, no write).
        payload = saved_completion(self.store, record) if record.has_completion else None
        if not record.has_completion or payload is None or record.completed_at is None:
            raise errors.CompletionUnavailable(
                "no saved completion", operation_id=record.operation_id
            )
        last = record.attempts[-1] if record.attempts else None
        completed_at = to_datetime(record.completed_at)
        assert completed_at is not None
        self.telemetry.emit("receipt.retrieved", record.operation_id)
        return Receipt(
            operation_id=record.operation_id,
            payload=payload,
            format_name=record.format_name,
            format_hash=record.format_hash,
            contract_version=record.contract_version,
            job_id=record.job_id,
            input_revision=record.input_revision,
            scope=record.scope,
            completed_at=completed_at,
            root_operation_id=record.root_operation_id,
            previous_operation_id=record.previous_operation_id,
            response_id=last.response_id if last else None,
            account=record.account,
            usage=record.usage,
        )

    async def inventory(self, scope: str | None = None) -> Inventory:
        if self.account is None:
            raise errors.AccountChanged("signed out: no inventory")
        records, unreadable = self.store.inventory(account=self.account, scope=scope)
        leases, commands = self.store.control_rows()
        present = self.store.payload_kinds(r.operation_id for r in records)
        live: dict[str, bool] = {}
        now = self.now()
        endpoint_id = self.backend.endpoint_id if self.backend is not None else None
        endpoint_down = self.endpoint_failure()
        pauses: dict[tuple[str, AccountBinding], float | None] = {}
        statuses = []
        for record in records:
            lease = leases.get(record.operation_id)
            is_live = False
            if lease is not None:
                key = f"{lease.owner_id}\0{lease.token}"
                if key not in live:
                    live[key] = self.store.lease_is_live(lease)
                is_live = live[key]
            command = commands.get(record.operation_id)
            statuses.append(self._with_rate_limit(
                record,
                machine.derive_status(
                    record, now=now, lease_live=is_live, viewer=self.account,
                    endpoint_id=endpoint_id,
                    command=command.kind if command is not None else None,
                    payloads=present.get(record.operation_id),
                    endpoint_down=endpoint_down,
                ),
                pauses,
            ))
        return Inventory(operations=tuple(statuses), unreadable=tuple(unreadable))

    # --- lifecycle ------------------------------------------------------------------

    async def suspend(self, handle: Handle) -> None:
        """Suspend from any runtime on the store, also while another process streams it."""
        await self._command(handle.operation_id, "suspend")

    async def cancel(self, handle: Handle) -> None:
        """Permanently cancel: fences late delivery and all future generation.

        A completion that is already saved is fenced too: after ``cancel`` the
        validated (and paid-for) result can never be read with ``receipt`` nor
        returned by ``send_recovering``. Read and commit it first if it may be
        needed (``status().has_saved_completion``); the CLI's ``cancel`` refuses
        such an operation unless given ``--force``.
        """
        await self._command(handle.operation_id, "cancel")

    async def _command(self, operation_id: str, kind: CommandKind) -> None:
        now = self.now()
        account = self.account

        def write(txn: WriteTxn) -> Any:
            check_disposition(txn, operation_id)
            record = txn.get_operation(operation_id)
            if record is None:
                raise errors.StateUnavailable("no such operation", operation_id=operation_id)
            if account is None or record.account != account:
                raise errors.AccountChanged(operation_id=operation_id)
            lease = txn.get_lease(operation_id)
            if lease is not None and txn.lease_is_live(lease):
                existing = txn.get_command(operation_id)
                if existing is not None and existing.kind == "cancel":
                    return existing  # never downgrade a cancel
                return txn.put_command(operation_id, kind, now)
            # Nobody runs it: apply directly (a dead owner's lease is void).
            t = machine.command_on_idle(record, kind)
            if t.changed:
                txn.put_operation(t.record)
            if txn.get_command(operation_id) is not None and kind == "cancel":
                txn.delete_command(operation_id)
            return None

        command = await self.store.write(write)
        if command is not None:
            self.monitor.notify_local(command)
        self.telemetry.emit(
            "operation.cancelled" if kind == "cancel" else "operation.suspended", operation_id
        )

    async def acknowledge(self, handle: Handle) -> None:
        """After the host's own commit: remove request and response, keep a small marker.

        The marker and the removal commit together. Idempotent.
        """
        await self._dispose(handle.operation_id, "acknowledged")
        self.telemetry.emit("receipt.acknowledged", handle.operation_id)

    async def abandon(self, handle: Handle) -> None:
        """The result is no longer applicable: remove content, keep a small marker."""
        await self._dispose(handle.operation_id, "abandoned")
        self.telemetry.emit("operation.abandoned", handle.operation_id)

    async def _dispose(self, operation_id: str, disposition: str) -> None:
        now = self.now()
        account = self.account

        def remove(txn: WriteTxn, marker: DispositionRecord) -> None:
            remove_content(txn, operation_id)
            txn.put_disposition(msgspec.structs.replace(marker, removal_complete=True))

        def dispose(txn: WriteTxn) -> None:
            existing = txn.get_disposition(operation_id)
            if existing is not None:
                if account is None or existing.account != account:
                    raise errors.AccountChanged(operation_id=operation_id)
                if existing.disposition != disposition:
                    raise errors.StateUnavailable(
                        f"operation is {existing.disposition}", operation_id=operation_id
                    )
                if not existing.removal_complete:
                    remove(txn, existing)  # a repeat completes an earlier removal
                return
            record = txn.get_operation(operation_id)
            if record is None:
                raise errors.StateUnavailable("no such operation", operation_id=operation_id)
            if account is None or record.account != account:
                raise errors.AccountChanged(operation_id=operation_id)
            lease = txn.get_lease(operation_id)
            if lease is not None and txn.lease_is_live(lease):
                raise errors.OperationBusy(
                    "stop and await the active execution first", operation_id=operation_id
                )
            if disposition == "acknowledged":
                machine.check_acknowledge(record)
                # Acknowledge what the host could have read: the completion must be
                # readable (a current payload, or a version-1 record's inline one).
                # A damaged record fails closed and keeps its state; abandon it instead.
                if saved_completion(txn, record) is None:
                    raise errors.CompletionUnavailable(
                        "the saved completion is missing from the store: nothing to "
                        "acknowledge (abandon the operation instead)",
                        operation_id=operation_id,
                    )
            # The marker and the removal of the content commit together: the operation
            # can never generate again, and nothing sensitive stays behind it.
            remove(
                txn,
                DispositionRecord(
                    operation_id=operation_id,
                    disposition=disposition,  # type: ignore[arg-type]
                    at=now,
                    account=record.account,
                    scope=record.scope,
                    job_id=record.job_id,
                    input_revision=record.input_revision,
                    root_operation_id=record.root_operation_id,
                    previous_operation_id=record.previous_operation_id,
                    attempts_used=record.attempts_used,
                    maximum_attempts=record.maximum_attempts,
                    usage=record.usage,
                ),
            )

        await self.store.write(dispose)
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
    rate_burst_seconds: float = 60.0,
    telemetry: TelemetrySink | None = None,
    wall_clock: Callable[[], float] = time.time,
    monitor_interval: float = 0.002,
    connect_backoff: ConnectBackoff = ConnectBackoff(),
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
    )
    body_error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler.run)
        nursery.start_soon(monitor.run)
        nursery.start_soon(pump.run)
        try:
            yield runtime
        except BaseException as exc:
            # Re-raised below, unchanged: the host's own exception must not come back
            # wrapped in an ExceptionGroup by this internal nursery.
            body_error = exc
        finally:
            pump.flush()
            nursery.cancel_scope.cancel()
    if body_error is not None:
        raise body_error
