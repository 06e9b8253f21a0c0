"""Opt-in continuation after a terminal stream failure: decide, then dispatch.

**Decide.** :func:`decide_on_failure` runs inside the fenced write that ends an operation
``failed`` (``actors/fenced.py``): when the store-wide preference is on
(``storage/preferences.py``) it records the decision on the failed record itself (the one
durable dispatch record keyed by the failed operation): ``pending`` with a persisted due
time, or ``declined`` with the reason (``recoverable.continuation``). A pending one keeps
(or puts) the operation in the ``queue`` table, so a worker looks at it again; nobody
needs to be attached.

**Dispatch.** :func:`dispatch` is ONE write transaction, run by a worker
(``actors/worker.py``) for a queued failed operation whose continuation is pending:
everything is checked again inside it (the preference, the budget, stop commands, a newer
revision or thread turn, a manual retry, a live lease, the manual-retry source table),
and then, when due, the deterministic successor (the manual-retry lineage:
``plan_retry(source, retry_action_id=continuation.ACTION_ID)``, ``selection="preserve"``:
the same frozen body, model, account and endpoint) is created and queued, the source's
reservation and dispatch record say so, and the source leaves the queue. Two workers,
a restart or a repeated terminal event meet the same record: the second one sees
``dispatched`` (or the reservation) and creates nothing. The successor is an ordinary
operation: every attempt is authorized by the worker's ``authorize`` like any other.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, Final, Literal, Protocol

import attrs
import msgspec

from recoverable import _killpoints, continuation, errors
from recoverable.actors.host import Backend
from recoverable.actors.prepare import identity_of, new_operation_record, put_new_operation
from recoverable.actors.retry import plan_retry, source_conditions
from recoverable.actors.scheduler import Scheduler
from recoverable.actors.turns import DELEGATE_SCOPE, THREAD_SCOPE, newer_turn
from recoverable.pricing import successor_cost
from recoverable.records import ContinuationRecord, OperationRecord, RetryReservation
from recoverable.sources_rules import receipt_refusal
from recoverable.storage.base import Store
from recoverable.storage.base import WriteTransaction as WriteTxn
from recoverable.storage.integrity import verify_body
from recoverable.storage.preferences import (
    ContinuationPreference,
    read_continuation,
    write_continuation,
)
from recoverable.storage.queue import MAX_SCAN
from recoverable.telemetry import Telemetry as RuntimeTelemetry
from recoverable.types import AccountBinding, Handle, to_datetime

# The errors of an operation that ended ``failed`` (only those can have a continuation).
ENDED_FAILED: Final = (errors.AttemptsExhausted, errors.PermanentlyFailed, errors.ProviderError)

__all__ = [
    "ENDED_FAILED",
    "LINEAGE_STEPS",
    "ContinuationPreference",
    "DispatchResult",
    "HostRuntime",
    "SendingRuntime",
    "continuation_preference",
    "continue_failed",
    "continued_id",
    "decide_on_failure",
    "dispatch",
    "dispatch_continuation",
    "dispatched_successor",
    "newer_revision",
    "send_continuing",
    "set_continuation_preference",
]

NewerTurn = Callable[[WriteTxn, OperationRecord], bool]

Outcome = Literal[
    "dispatched", "cancelled", "not_due", "not_pending", "missing", "not_mine", "failed",
]


def decide_on_failure(
    txn: WriteTxn, record: OperationRecord, now: float | None
) -> tuple[OperationRecord, ContinuationRecord | None]:
    """The record a fenced write is about to save, with its continuation decided when it
    ends ``failed`` here and the preference is on; and the decision (None: nothing new)."""
    if record.phase != "failed" or record.continuation is not None or now is None:
        return record, None
    stored = txn.get_operation(record.operation_id)
    if stored is not None and stored.phase == "failed":
        return record, None  # it was already failed: not a new terminal failure
    preference = read_continuation(txn)
    if not preference.enabled:
        return record, None  # off: it just ends failed; nothing is decided
    decided = continuation.decide(
        record, now=now, delay=preference.delay_seconds, budget=preference.budget
    )
    if continuation.is_pending(decided):
        txn.enqueue(record.operation_id)  # a worker dispatches it when due
    return decided, decided.continuation


def newer_revision(txn: WriteTxn, record: OperationRecord) -> bool:
    """Another operation of the same job with another input revision, created after this
    one: newer user intent."""
    if record.job_id is None or record.scope in (THREAD_SCOPE, DELEGATE_SCOPE):
        # A thread's turns and a group's children differ by revision by design (newer
        # turns are judged by newer_turn; siblings are never newer intent).
        return False
    for operation_id in txn.operation_ids_by_job(record.account, record.scope, record.job_id):
        if operation_id == record.operation_id:
            continue
        try:
            other = txn.get_operation(operation_id)
        except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
            continue
        if (other is not None and other.input_revision != record.input_revision
                and other.created_at >= record.created_at):
            return True
    return False


@attrs.frozen
class DispatchResult:
    """What one dispatch transaction found or did."""

    outcome: Outcome
    reason: str | None = None  # why it was cancelled
    due_at: float | None = None  # not due yet: when it is
    successor_id: str | None = None
    model: str | None = None


def _cancel(txn: WriteTxn, record: OperationRecord, reason: continuation.Reason,
            now: float) -> DispatchResult:
    txn.put_operation(continuation.cancelled(record, reason, now))
    txn.dequeue(record.operation_id)
    return DispatchResult("cancelled", reason=reason)


def dispatch(
    source_id: str,
    account: AccountBinding | None,
    endpoint_id: str,
    now: float,
    txn: WriteTxn,
    *,
    is_newer_turn: NewerTurn = newer_turn,
) -> DispatchResult:
    """Check a pending continuation again and, when due, create its one successor.
    ``account``: the dispatching runtime's account now (None: signed out, nothing is
    dispatched)."""
    if account is None:
        return DispatchResult("not_mine")  # a signed-out runtime dispatches nothing
    record = txn.get_operation(source_id)
    if record is None:
        txn.dequeue(source_id)  # acknowledged, abandoned or purged: nothing to continue
        return DispatchResult("missing")
    if not continuation.is_pending(record):
        if record.phase in ("failed", "cancelled") and record.continuation is not None:
            txn.dequeue(source_id)  # cancelled by a retry, or dispatched elsewhere
        return DispatchResult("not_pending")
    if record.account != account or record.endpoint_id != endpoint_id:
        return DispatchResult("not_mine")  # never another account's or endpoint's work
    preference = read_continuation(txn)
    command = txn.get_command(source_id)
    lease = txn.get_lease(source_id)
    reason = continuation.invalidation(
        record,
        enabled=preference.enabled,
        budget=preference.budget,
        now=now,
        command=command.kind if command is not None else None,
        lease_live=lease is not None and txn.lease_is_live(lease, now),
        newer_revision=newer_revision(txn, record),
        newer_turn=is_newer_turn(txn, record),
        source_refusal=(  # the successor would be bound to a stale digest
            None if record.source is None
            else receipt_refusal(record, txn.get_source(record.source.key))
        ),
    )
    if reason is not None:
        return _cancel(txn, record, reason, now)
    pending = record.continuation
    assert pending is not None and pending.due_at is not None
    if pending.due_at > now:
        return DispatchResult("not_due", due_at=pending.due_at)
    plan = plan_retry(
        source_id,
        retry_action_id=continuation.ACTION_ID,
        maximum_attempts=record.maximum_attempts,
        selection="preserve",
        expires_at=to_datetime(record.expires_at),
        retry_policy=record.retry_policy,
        account=record.account,
        endpoint_id=record.endpoint_id,
        now=now,
    )
    try:
        source_conditions(plan, txn)  # the manual-retry source table, in the same write
    except errors.RecoveryError:
        return _cancel(txn, record, "manual_retry" if record.retry_reservation else "not_failed",
                       now)
    body = txn.get_payload(source_id, "body")
    stored = txn.get_payload(source_id, "request")
    if body is None or stored is None:
        return _cancel(txn, record, "no_evidence", now)
    verify_body(source_id, record.body_hash, body)  # a tampered body is never reused
    child = new_operation_record(
        plan.successor_id,
        identity=identity_of(record),
        account=record.account,
        endpoint_id=record.endpoint_id,
        created_at=now,
        maximum_attempts=record.maximum_attempts,
        expires_at=record.expires_at,
        retry_policy=record.retry_policy,
        model=record.model,
        reasoning_effort=record.reasoning_effort,
        body=body,
        root_operation_id=record.root_operation_id,
        previous_operation_id=source_id,
        maximum_output_tokens_total=record.maximum_output_tokens_total,
        cost=successor_cost(record, record.model),  # the same model: the frozen price
        service_tier=record.service_tier,
        on_interruption=record.on_interruption,
        # The same choices as a manual retry's successor (actors/retry.py): the body was
        # frozen for them (reattach: background and stored), so they go with it.
        live=record.live,
        reattach=record.reattach,
    )
    child = msgspec.structs.replace(child, continuations_used=record.continuations_used + 1)
    if txn.get_operation(child.operation_id) is None and txn.get_disposition(
        child.operation_id
    ) is None:
        put_new_operation(txn, child, body, stored)
        txn.enqueue(child.operation_id)
    reserved = msgspec.structs.replace(
        continuation.dispatched(record, child.operation_id, now),
        retry_reservation=RetryReservation(
            retry_action_id=plan.retry_action_id,
            successor_id=plan.successor_id,
            settings_hash=plan.settings_hash,
            created=True,
        ),
    )
    txn.put_operation(reserved)
    txn.dequeue(source_id)
    return DispatchResult("dispatched", successor_id=child.operation_id, model=child.model)


class Telemetry(Protocol):
    def emit(self, name: str, operation_id: str, **fields: object) -> None: ...


async def dispatch_continuation(
    store: Store,
    telemetry: Telemetry,
    source_id: str,
    *,
    account: AccountBinding | None,
    endpoint_id: str,
    now: float,
) -> DispatchResult:
    """Run :func:`dispatch` in one write and report it (ids, codes and counts only).
    ``account`` None (the runtime signed out): nothing is dispatched (``not_mine``)."""
    try:
        result = await store.write(functools.partial(
            dispatch, source_id, account, endpoint_id, now,
        ))
    except errors.RecoveryError as exc:  # unreadable, a full store, ...: left as it is
        telemetry.emit("continuation.failed", source_id, code=exc.code)
        return DispatchResult("failed", reason=exc.code)
    if result.outcome == "dispatched":
        _killpoints.hit("continuation.dispatched")
        telemetry.emit("continuation.dispatched", source_id, successor_id=result.successor_id,
                       model=result.model)
    elif result.outcome == "cancelled":
        telemetry.emit("continuation.cancelled", source_id, reason=result.reason)
    return result


def continuation_preference(store: Store) -> ContinuationPreference:
    """The store's continuation preference (off for every store until it is turned on;
    an unreadable row raises ``CorruptRecord`` here and reads as off everywhere else)."""
    return read_continuation(store, strict=True)


def _set_preference(
    enabled: bool | None,
    delay_seconds: float | None,
    budget: int | None,
    queued: list[str],
    now: float,
    txn: WriteTxn,
) -> tuple[ContinuationPreference, list[str]]:
    preference = write_continuation(txn, enabled=enabled, delay_seconds=delay_seconds,
                                    budget=budget)
    stopped: list[str] = []
    if not preference.enabled:
        for operation_id in queued:  # turning it off cancels what is pending, now
            try:
                record = txn.get_operation(operation_id)
            except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
                continue
            if record is not None and continuation.is_pending(record):
                _cancel(txn, record, "disabled", now)
                stopped.append(operation_id)
    return preference, stopped


async def set_continuation_preference(
    store: Store,
    *,
    enabled: bool | None = None,
    delay_seconds: float | None = None,
    budget: int | None = None,
    telemetry: Telemetry | None = None,
    now: float | None = None,
) -> ContinuationPreference:
    """Change the store-wide continuation preference (the fields given; it persists and
    is reversible). Turning it off cancels every pending continuation (``disabled``);
    a dispatch checks it again in its own transaction, so none starts afterwards."""
    queued: list[str] = []
    after = 0
    while page := store.queued(after_serial=after, limit=MAX_SCAN):  # every queued one
        queued.extend(entry.operation_id for entry in page)
        after = page[-1].serial
    preference, stopped = await store.write(functools.partial(
        _set_preference, enabled, delay_seconds, budget, sorted(set(queued)),
        time.time() if now is None else now,
    ))
    if telemetry is not None:
        telemetry.emit("continuation.preference_changed", "", enabled=preference.enabled,
                       delay_seconds=preference.delay_seconds, budget=preference.budget,
                       cancelled=len(stopped))
        for operation_id in stopped:
            telemetry.emit("continuation.cancelled", operation_id, reason="disabled")
    return preference


# How far along a lineage of dispatched continuations a reader follows.
LINEAGE_STEPS: Final = continuation.MAX_BUDGET + 1


def dispatched_successor(record: OperationRecord | None) -> str | None:
    """The continuation successor ``record`` dispatched (None: it stands for itself)."""
    decided = record.continuation if record is not None else None
    if decided is None or decided.state != "dispatched":
        return None
    return decided.successor_id


def continued_id(store: Store, operation_id: str, *, steps: int = LINEAGE_STEPS) -> str:
    """The operation that stands for ``operation_id`` after its dispatched continuations
    (itself when none was dispatched), at most ``steps`` along the lineage."""
    current = operation_id
    for _ in range(steps):
        try:
            record = store.get_operation(current)
        except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
            return current
        successor = dispatched_successor(record)
        if successor is None:
            return current
        current = successor
    return current


class HostRuntime(Protocol):
    """What :func:`continue_failed` uses of the runtime (``actors/runtime.py``)."""

    store: Store
    backend: Backend | None
    account: AccountBinding | None
    now: Callable[[], float]
    telemetry: RuntimeTelemetry
    scheduler: Scheduler


async def continue_failed(rt: HostRuntime, operation_id: str) -> str | None:
    """For a host that runs its operations itself (``recoverable batch --workers 0``):
    the failed operation's continuation successor — waiting for the persisted due time,
    then dispatching it here, with every check of :func:`dispatch` — or None when it has
    no pending (or dispatched) continuation. Cancelled while waiting: nothing changes."""
    for _ in range(continuation.MAX_BUDGET + 2):
        try:
            record = rt.store.get_operation(operation_id)
        except errors.RecoveryError:
            return None  # the store cannot say: the caller's own error stands
        decided = record.continuation if record is not None else None
        if decided is None or rt.account is None or rt.backend is None:
            return None
        if decided.state == "dispatched":
            return decided.successor_id
        if decided.state != "pending":
            return None
        if decided.due_at is not None:
            await rt.scheduler.wait_until(decided.due_at)
        result = await dispatch_continuation(rt.store, rt.telemetry, operation_id,
                                             account=rt.account,
                                             endpoint_id=rt.backend.endpoint_id, now=rt.now())
        if result.outcome == "dispatched":
            return result.successor_id
        if result.outcome != "not_due":
            return None
    return None


class SendingRuntime(HostRuntime, Protocol):
    """What :func:`send_continuing` uses of the runtime: :class:`HostRuntime` and
    ``send_recovering``."""

    async def send_recovering(self, handle: Handle, *, response: Any, authorize: Any
                              ) -> Any: ...


async def send_continuing(rt: SendingRuntime, handle: Handle, *, response: Any,
                          authorize: Any) -> Any:
    """Send ``handle`` here to its validated value, following the continuation of an
    operation that ended failed (:func:`continue_failed`) as ``recoverable batch`` does;
    the last operation's own typed error when it has none."""
    while True:
        try:
            return await rt.send_recovering(handle, response=response, authorize=authorize)
        except ENDED_FAILED:
            successor = await continue_failed(rt, handle.operation_id)
            if successor is None:
                raise
            handle = Handle(successor)
