"""Manual retry: the one successor of a source operation, after a deliberate decision.

It never generates. The successor has a fresh bounded budget and links to the
previous/root operations; the source's history and spent budget are unchanged. The
reservation is saved on the source before the child is created, and the child's id
derives from (source id, action id), so repeating the same action with the same
settings returns or completes the same child. Each step is a named transaction over
a :class:`RetryPlan`; :func:`source_conditions` is the source-condition table, run
as a pre-check on the store and again inside the write.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import msgspec

from recoverable import _killpoints, continuation, errors, machine, reattachment
from recoverable.actors.checks import check_disposition, require_owner
from recoverable.actors.prepare import identity_of, new_operation_record, put_new_operation
from recoverable.body import freeze_body
from recoverable.contract import contract_for
from recoverable.pricing import successor_cost
from recoverable.records import (
    DispositionRecord,
    LeaseRecord,
    OperationRecord,
    RetryReservation,
    StoredRequest,
)
from recoverable.sources_rules import receipt_refusal
from recoverable.storage.base import Store as RecoveryStore
from recoverable.storage.base import WriteTransaction as WriteTxn
from recoverable.storage.integrity import verify_body
from recoverable.storage.migration import upgrade_operation
from recoverable.telemetry import Telemetry
from recoverable.types import (
    AccountBinding,
    Handle,
    JsonSchema,
    RetryPolicy,
    Selection,
    StructuredRequest,
    to_timestamp,
)

Selector = Callable[[StructuredRequest], StructuredRequest]


class SourceView(Protocol):
    """What the source-condition table reads: the store, or a write transaction."""

    def get_operation(self, operation_id: str) -> OperationRecord | None: ...
    def get_disposition(self, operation_id: str) -> DispositionRecord | None: ...
    def get_lease(self, operation_id: str) -> LeaseRecord | None: ...
    def lease_is_live(self, lease: LeaseRecord, now: float | None = None) -> bool: ...
    def get_source(self, key: str) -> str | None: ...


@attrs.frozen
class RetryPlan:
    """One manual-retry decision: the source, the action and the successor's settings."""

    source_id: str
    retry_action_id: str
    successor_id: str
    settings_hash: str
    account: AccountBinding | None
    endpoint_id: str
    now: float
    maximum_attempts: int
    selection: Selection
    expires_at: float | None
    retry_policy: RetryPolicy | None


@attrs.frozen
class SuccessorRequest:
    """The successor's frozen body and saved request, and the model that body selects."""

    body: bytes
    stored: bytes
    model: str
    reasoning_effort: str | None


def plan_retry(
    source_id: str,
    *,
    retry_action_id: str,
    maximum_attempts: int,
    selection: Selection,
    expires_at: Any,
    retry_policy: RetryPolicy | None,
    account: AccountBinding | None,
    endpoint_id: str | None,
    now: float,
) -> RetryPlan:
    """Validate the arguments and derive the successor's id and the settings' hash."""
    if not isinstance(retry_action_id, str) or not 0 < len(retry_action_id) <= 256:
        raise errors.InvalidRequest("retry_action_id must be a non-empty string (<= 256)")
    if selection not in ("preserve", "reselect"):
        raise errors.InvalidRequest("selection must be 'preserve' or 'reselect'")
    machine.validate_preparation(
        maximum_attempts=maximum_attempts,
        retry_policy=retry_policy or RetryPolicy(),
        scope=None, job_id=None, input_revision=None, contract_version=None,
    )
    if endpoint_id is None:
        raise errors.ConfigurationUnavailable("no backend: cannot prepare a successor")
    expires = to_timestamp(expires_at)
    settings = msgspec.json.encode(
        {
            "maximum_attempts": maximum_attempts,
            "selection": selection,
            "expires_at": expires,
            "retry_policy": retry_policy,
        },
        order="sorted",
    )
    successor_id = "op_" + hashlib.sha256(
        f"{source_id}\0{retry_action_id}".encode()
    ).hexdigest()[:32]
    return RetryPlan(
        source_id=source_id,
        retry_action_id=retry_action_id,
        successor_id=successor_id,
        settings_hash=hashlib.sha256(settings).hexdigest(),
        account=account,
        endpoint_id=endpoint_id,
        now=now,
        maximum_attempts=maximum_attempts,
        selection=selection,
        expires_at=expires,
        retry_policy=retry_policy,
    )


def source_conditions(plan: RetryPlan, view: SourceView) -> OperationRecord:
    """The source-condition table, on the store (a pre-check) or in the write."""
    source_id = plan.source_id
    check_disposition(view, source_id)
    source = view.get_operation(source_id)
    if source is None:
        raise errors.StateUnavailable("no such operation", operation_id=source_id)
    require_owner(plan.account, source.account, source_id)
    reservation = source.retry_reservation
    if reservation is not None:
        if reservation.retry_action_id != plan.retry_action_id:
            raise errors.RetryAlreadyCreated(
                f"successor {reservation.successor_id} exists; retry from it",
                operation_id=source_id,
            )
        if reservation.settings_hash != plan.settings_hash:
            raise errors.RetryConfigurationMismatch(operation_id=source_id)
        return source
    lease = view.get_lease(source_id)
    if lease is not None and view.lease_is_live(lease, plan.now):
        raise errors.OperationBusy(operation_id=source_id)
    if reattachment.can_resume(source, plan.now):  # reattachment: it can still run
        raise errors.RetryNotAllowed(
            "its spent attempt can still be resumed from its saved background response "
            "(reattach=True, no budget needed): resume it instead",
            operation_id=source_id,
        )
    machine.check_retry_source(source, now=plan.now, endpoint_id=plan.endpoint_id)
    if source.source is not None and receipt_refusal(
        source, view.get_source(source.source.key)
    ) is not None:
        # The successor would be bound to a digest that is no longer current
        # (refused here, before any reservation is written on the source).
        raise errors.InvalidParameter(  # the same typed error as put_new_operation's
            "the source manifest does not hold this digest of the source: set it first "
            "(store.set_source) or prepare a new operation bound to the current digest",
            parameter="source",
            reason="not_current",
        )
    return source


def reserve_successor(plan: RetryPlan, checked_body_hash: str, txn: WriteTxn) -> OperationRecord:
    """Save the reservation on the source (its conditions checked again, atomically)."""
    source = source_conditions(plan, txn)
    if source.retry_reservation is not None:
        return source
    if source.body_hash != checked_body_hash or txn.get_payload(plan.source_id, "body") is None:
        raise errors.RequestUnavailable(
            "the source's frozen request changed or disappeared", operation_id=plan.source_id
        )
    # A deliberate retry is newer intent: it cancels a pending continuation.
    reserved = msgspec.structs.replace(
        continuation.cancelled(source, "manual_retry", plan.now),
        retry_reservation=RetryReservation(
            retry_action_id=plan.retry_action_id,
            successor_id=plan.successor_id,
            settings_hash=plan.settings_hash,
        ),
    )
    txn.put_operation(reserved)
    return reserved


def create_successor(
    plan: RetryPlan, child: OperationRecord, request: SuccessorRequest, txn: WriteTxn
) -> None:
    """Create the reserved child (once) and mark the reservation created."""
    current = txn.get_operation(plan.source_id)
    if current is None or current.retry_reservation is None:
        raise errors.StateUnavailable("the source changed", operation_id=plan.source_id)
    if (txn.get_operation(plan.successor_id) is None
            and txn.get_disposition(plan.successor_id) is None):
        put_new_operation(txn, child, request.body, request.stored)
    done = msgspec.structs.replace(current.retry_reservation, created=True)
    txn.put_operation(msgspec.structs.replace(current, retry_reservation=done))


def successor_handle(source: OperationRecord) -> Handle:
    assert source.retry_reservation is not None
    return Handle(
        source.retry_reservation.successor_id,
        root_operation_id=source.root_operation_id,
        previous_operation_id=source.operation_id,
    )


def successor_request(
    store: RecoveryStore, source: OperationRecord, selection: Selection, selector: Selector | None
) -> SuccessorRequest:
    """The successor's body: the source's frozen bytes, or the saved request reselected."""
    op_id = source.operation_id
    body = store.get_payload(op_id, "body")
    stored_raw = store.get_payload(op_id, "request")
    if body is None or stored_raw is None:
        raise errors.RequestUnavailable(
            "the source's frozen request is missing from the store: it cannot be cloned",
            operation_id=op_id,
        )
    if selection == "preserve":
        verify_body(op_id, source.body_hash, body)  # a tampered body is never reused
        return SuccessorRequest(body, stored_raw, source.model, source.reasoning_effort)
    try:
        stored = msgspec.json.decode(stored_raw, type=StoredRequest)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise errors.CorruptRecord("the saved request is unreadable", operation_id=op_id) from exc
    effective = stored.request
    if selector is not None and not effective.model_override:
        effective = selector(effective)
    contract = contract_for(JsonSchema(stored.format_name, stored.schema))
    if contract.format_hash != source.format_hash:
        raise errors.FormatMismatch("the saved contract changed", operation_id=op_id)
    return SuccessorRequest(
        freeze_body(effective, contract, reattach=source.reattach), stored_raw,
        effective.model, effective.reasoning_effort,
    )


async def retry(
    store: RecoveryStore, plan: RetryPlan, *, selector: Selector | None, telemetry: Telemetry
) -> Handle:
    """Create (or finish creating) the successor that ``plan`` names."""
    # Check first, reserve second: the source must be clonable (its frozen request
    # present and readable) BEFORE its reservation is written, so a refusal leaves
    # no dangling successor id behind.
    checked = source_conditions(plan, store)
    if checked.retry_reservation is not None and checked.retry_reservation.created:
        return successor_handle(checked)
    if checked.awaiting_upgrade:
        # A version-1 source: freeze its request (the lazy upgrade send_recovering
        # does), then check it again as a current record.
        await upgrade_operation(store, plan.source_id, endpoint_id=plan.endpoint_id)
        checked = source_conditions(plan, store)
        if checked.awaiting_upgrade:
            raise errors.RequestUnavailable(
                "the version-1 request could not be frozen: it cannot be cloned",
                operation_id=plan.source_id,
            )
    request = successor_request(store, checked, plan.selection, selector)
    # Before the reservation: a reselected model without a price refuses the retry with
    # nothing written (PriceUnknown), as prepare does.
    cost = successor_cost(checked, request.model)
    source = await store.write(functools.partial(reserve_successor, plan, checked.body_hash))
    assert source.retry_reservation is not None
    if source.retry_reservation.created:
        return successor_handle(source)
    _killpoints.hit("retry.reserved")
    child = new_operation_record(
        plan.successor_id,
        identity=identity_of(source),
        account=source.account,
        endpoint_id=plan.endpoint_id,
        created_at=plan.now,
        maximum_attempts=plan.maximum_attempts,
        expires_at=plan.expires_at,
        retry_policy=plan.retry_policy or source.retry_policy,
        model=request.model,
        reasoning_effort=request.reasoning_effort,
        body=request.body,
        root_operation_id=source.root_operation_id,
        previous_operation_id=plan.source_id,
        # The same per-operation token and cost budgets, counted afresh for the successor.
        maximum_output_tokens_total=source.maximum_output_tokens_total,
        cost=cost,
        service_tier=source.service_tier,
        # The same interruption policy: a manual retry does not loosen it.
        on_interruption=source.on_interruption,
        live=source.live,  # a live operation's successor is live too
        # The same reattachment choice (its body was frozen with it).
        reattach=source.reattach,
    )
    # The lineage's continuation count is carried (the budget never resets).
    child = msgspec.structs.replace(child, continuations_used=source.continuations_used)
    await store.write(functools.partial(create_successor, plan, child, request))
    telemetry.emit("operation.manual_retry_created", plan.successor_id,
                   previous_operation_id=plan.source_id, selection=plan.selection,
                   maximum_attempts=plan.maximum_attempts, model=request.model)
    return successor_handle(source)
