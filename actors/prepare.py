"""New operation records: one constructor, shared by ``prepare`` and manual ``retry``.

An operation is born ``prepared`` with its frozen body and its saved request, in one
transaction (:func:`create_operation`); nothing is sent. A successor of manual retry is
built by the same constructor from its source's identity (:func:`identity_of`).
"""

from __future__ import annotations

import functools
import itertools
import secrets
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import msgspec

from recoverable import _killpoints, errors
from recoverable.actors.checks import require_signed_in
from recoverable.actors.heartbeat import LeaseKeeper
from recoverable.actors.host import Backend
from recoverable.actors.options import PrepareOptions
from recoverable.body import body_hash, freeze_body
from recoverable.contract import contract_for
from recoverable.pricing import CostBudget, cost_budget
from recoverable.records import OnInterruption, OperationRecord, StoredRequest
from recoverable.storage.base import Store
from recoverable.storage.base import WriteTransaction as WriteTxn
from recoverable.telemetry import Telemetry
from recoverable.types import (
    AccountBinding,
    Handle,
    JsonSchema,
    RetryPolicy,
    SourceRef,
    StructuredRequest,
)

_ID_PREFIX = secrets.token_bytes(8)  # per process; ids stay unique across processes
_ID_COUNTER = itertools.count(int.from_bytes(secrets.token_bytes(4), "big"))


def new_operation_id() -> str:
    """A unique operation id without a system call per id (ids are not secrets)."""
    return "op_" + (_ID_PREFIX + next(_ID_COUNTER).to_bytes(8, "big")).hex()


@attrs.frozen
class Identity:
    """What a host named about an operation: its contract, job and selection flags.

    A successor of manual retry inherits its source's identity unchanged.
    """

    format_name: str
    format_hash: str
    model_override: bool = False
    contract_version: str | None = None
    scope: str | None = None
    job_id: str | None = None
    input_revision: str | None = None
    # the source it derives from, and its attempts' hard timeout (seconds)
    source: SourceRef | None = None
    attempt_timeout: float | None = None
    # submitted for workers with this unclaimed bound (seconds; None: not)
    unclaimed_after: float | None = None


def identity_of(record: OperationRecord) -> Identity:
    return Identity(
        format_name=record.format_name,
        format_hash=record.format_hash,
        model_override=record.model_override,
        contract_version=record.contract_version,
        scope=record.scope,
        job_id=record.job_id,
        input_revision=record.input_revision,
        source=record.source,
        attempt_timeout=record.attempt_timeout,
        unclaimed_after=record.unclaimed_after,
    )


def new_operation_record(
    operation_id: str,
    *,
    identity: Identity,
    account: AccountBinding,
    endpoint_id: str,
    created_at: float,
    maximum_attempts: int,
    expires_at: float | None,
    retry_policy: RetryPolicy,
    model: str,
    reasoning_effort: str | None,
    body: bytes,
    root_operation_id: str,
    previous_operation_id: str | None,
    maximum_output_tokens_total: int | None,
    on_interruption: OnInterruption = "replace",
    live: bool = False,
    reattach: bool = False,
    cost: CostBudget | None = None,
    service_tier: str | None = None,
) -> OperationRecord:
    """The one constructor of a new (``prepared``) operation record."""
    return OperationRecord(
        operation_id=operation_id,
        account=account,
        endpoint_id=endpoint_id,
        created_at=created_at,
        maximum_attempts=maximum_attempts,
        expires_at=expires_at,
        retry_policy=retry_policy,
        model=model,
        reasoning_effort=reasoning_effort,
        model_override=identity.model_override,
        format_name=identity.format_name,
        format_hash=identity.format_hash,
        contract_version=identity.contract_version,
        scope=identity.scope,
        job_id=identity.job_id,
        input_revision=identity.input_revision,
        body_hash=body_hash(body),
        root_operation_id=root_operation_id,
        previous_operation_id=previous_operation_id,
        maximum_output_tokens_total=maximum_output_tokens_total,
        maximum_cost_total=None if cost is None else cost.maximum,
        cost_price=None if cost is None else cost.price,
        service_tier=service_tier,
        on_interruption=on_interruption,
        source=identity.source,
        attempt_timeout=identity.attempt_timeout,
        live=live,
        reattach=reattach,
        unclaimed_after=identity.unclaimed_after,
    )


def put_new_operation(txn: WriteTxn, record: OperationRecord, body: bytes, stored: bytes) -> None:
    """Write a new operation with its frozen body and saved request (inside a transaction).

    A source-bound operation is written only while the source manifest holds
    its digest (``InvalidParameter``, ``parameter="source"``, ``reason="not_current"``):
    work bound to a digest that is already stale would be superseded at birth.
    """
    source = record.source
    if source is not None and txn.get_source(source.key) != source.digest:
        raise errors.InvalidParameter(
            "the source manifest does not hold this digest of the source: set it first "
            "(store.set_source) or bind the current digest",
            parameter="source",
            reason="not_current",
        )
    txn.put_payload(record.operation_id, "body", body)
    txn.put_payload(record.operation_id, "request", stored)
    txn.put_operation(record)


def create_operation(
    record: OperationRecord, body: bytes, stored: bytes, txn: WriteTxn
) -> OperationRecord:
    """The transaction of ``prepare``: a new id never overwrites an existing operation. A
    job's operation (``job_id`` given) is prepared once per revision: the one that stands
    for it is returned (:func:`job_operation`), this one written only when there is none."""
    if txn.get_operation(record.operation_id) is not None:
        raise errors.InvalidRequest("operation id collision", operation_id=record.operation_id)
    if record.job_id is not None:
        existing = job_operation(txn, record)
        if existing is not None:
            return existing
    put_new_operation(txn, record, body, stored)
    return record


def choose_job_operation(records: list[OperationRecord]) -> OperationRecord | None:
    """The operation that stands for a job among those sharing its key: a source whose
    manual-retry successor exists yields to it; then a saved completion; then the oldest."""
    if not records:
        return None
    ids = {record.operation_id for record in records}
    current = [
        record for record in records
        if record.retry_reservation is None
        or not record.retry_reservation.created
        or record.retry_reservation.successor_id not in ids
    ] or records
    current.sort(
        key=lambda record: (not record.has_completion, record.created_at, record.operation_id)
    )
    return current[0]


def job_operation(txn: WriteTxn, record: OperationRecord) -> OperationRecord | None:
    """The operation that already stands for ``record``'s job (account, scope, job id,
    input revision), or None: the job's key is its idempotency, in ``prepare`` and
    ``submit`` alike.

    Raises ``JobConflict`` when it was admitted with another body; ``AlreadyAcknowledged``
    when the job's only operation of that revision was acknowledged (its marker is kept:
    a duplicate delivery never generates again); and an unreadable operation's typed
    error (``CorruptRecord``, ``UnsupportedRecordVersion``): it may hold this revision's
    saved result or spent budget, so nothing new is prepared until it is restored or
    abandoned."""
    existing: list[OperationRecord] = []
    acknowledged: str | None = None
    for operation_id in txn.operation_ids_by_job(record.account, record.scope, record.job_id):
        found = txn.get_operation(operation_id)
        if found is None:
            marker = txn.get_disposition(operation_id)
            if (marker is not None and marker.disposition == "acknowledged"
                    and marker.input_revision == record.input_revision):
                acknowledged = operation_id
        elif found.input_revision == record.input_revision:
            existing.append(found)
    chosen = choose_job_operation(existing)
    if chosen is None:
        if acknowledged is not None:
            raise errors.AlreadyAcknowledged(operation_id=acknowledged)
        return None
    if chosen.body_hash != record.body_hash:
        raise errors.JobConflict(
            "the same job and input revision were prepared with another request body",
            operation_id=chosen.operation_id,
        )
    return chosen


class Admitting(Protocol):
    """What :func:`admission_for` reads of the runtime (``actors/runtime.py``)."""

    account: AccountBinding | None
    backend: Backend | None
    selector: Callable[[StructuredRequest], StructuredRequest] | None
    now: Callable[[], float]
    leases: LeaseKeeper


def admission_for(
    rt: Admitting, request: StructuredRequest, *, response: type[Any] | JsonSchema,
    options: PrepareOptions,
) -> tuple[OperationRecord, bytes, bytes]:
    """:func:`new_admission` with the runtime's account, backend, model selector, clock
    and lease (``prepare``, ``submit`` and the batch's admission alike)."""
    return new_admission(
        request, response=response, options=options, account=rt.account,
        backend=rt.backend, selector=rt.selector, now=rt.now(),
        lease_seconds=rt.leases.lease_seconds,
    )


class Saving(Admitting, Protocol):
    """What :func:`save_admitted` uses of the runtime."""

    store: Store
    telemetry: Telemetry


def emit_prepared(telemetry: Telemetry, record: OperationRecord) -> None:
    """Telemetry ``operation.prepared``: a new operation was written (ids and counts)."""
    telemetry.emit("operation.prepared", record.operation_id, model=record.model,
                   effort=record.reasoning_effort, maximum_attempts=record.maximum_attempts)


def handle_of(record: OperationRecord) -> Handle:
    return Handle(
        record.operation_id,
        root_operation_id=record.root_operation_id,
        previous_operation_id=record.previous_operation_id,
    )


async def save_admitted(
    rt: Saving,
    record: OperationRecord,
    body: bytes,
    stored: bytes,
    mutation: Callable[[OperationRecord, bytes, bytes, WriteTxn], OperationRecord],
    point: str,
) -> Handle:
    """Write a new admission with ``mutation`` (``create_operation`` for ``prepare``,
    ``submit_operation`` for ``submit``), between the kill points ``{point}.before_save``
    and ``{point}.saved``; the handle of the operation that stands for it (an existing
    one of its job, or this one, told as ``operation.prepared``)."""
    _killpoints.hit(f"{point}.before_save")
    chosen = await rt.store.write(
        functools.partial(mutation, record, body, stored), touches=(record,)
    )
    _killpoints.hit(f"{point}.saved")
    if chosen is record:
        emit_prepared(rt.telemetry, record)
    return handle_of(chosen)


def new_admission(
    request: StructuredRequest,
    *,
    response: type[Any] | JsonSchema,
    options: PrepareOptions,
    account: AccountBinding | None,
    backend: Backend | None,
    selector: Callable[[StructuredRequest], StructuredRequest] | None,
    now: float,
    lease_seconds: float = 30.0,
) -> tuple[OperationRecord, bytes, bytes]:
    """What ``prepare`` and ``submit`` save: the checked new record, its frozen body and
    its saved request (nothing is written here). ``options`` are checked by
    ``PrepareOptions.checked`` against ``lease_seconds`` (the preparing runtime's lease)
    and ``backend``. A cost budget (``options.maximum_cost_total``) is counted at the
    price ``options.prices`` (else ``default_prices()``) gives the request's model and
    service tier, frozen in the record (``PriceUnknown`` when there is none)."""
    account = require_signed_in(account, "cannot prepare")
    checked = options.checked(lease_seconds=lease_seconds, backend=backend)
    contract = contract_for(response)
    effective = request
    if selector is not None and not request.model_override:
        effective = selector(request)
    body = freeze_body(effective, contract, reattach=options.reattach)
    cost = cost_budget(
        options.maximum_cost_total, effective.model, effective.service_tier, options.prices
    )
    operation_id = new_operation_id()
    record = new_operation_record(
        operation_id,
        identity=Identity(
            format_name=contract.name,
            format_hash=contract.format_hash,
            model_override=request.model_override,
            contract_version=options.contract_version,
            scope=options.scope,
            job_id=options.job_id,
            input_revision=options.input_revision,
            source=checked.source,
            attempt_timeout=checked.attempt_timeout,
            unclaimed_after=checked.unclaimed_after,
        ),
        account=account,
        endpoint_id=checked.backend.endpoint_id,
        created_at=now,
        maximum_attempts=options.maximum_attempts,
        expires_at=checked.expires_at,
        retry_policy=checked.retry_policy,
        model=effective.model,
        reasoning_effort=effective.reasoning_effort,
        body=body,
        root_operation_id=operation_id,
        previous_operation_id=options.previous_operation_id,
        maximum_output_tokens_total=options.maximum_output_tokens_total,
        on_interruption=checked.on_interruption,
        live=options.live,
        reattach=options.reattach,
        cost=cost,
        service_tier=effective.service_tier,
    )
    stored = msgspec.json.encode(
        StoredRequest(request=request, format_name=contract.name, schema=contract.schema)
    )
    return record, body, stored
