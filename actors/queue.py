"""Submit and wait: operations handed to workers through the store's ``queue`` table.

``submit`` is ``prepare`` plus enqueue, in ONE store transaction, idempotent by
``(account, scope, job_id, input_revision)``: the same frozen body again returns the
same handle (and queues it again if it is not finished); a different body under the
same key is ``JobConflict`` and changes nothing. The operation's unclaimed bound is saved
with it (``actors/unclaimed.py``). ``wait`` reads the operation's record
once the operation left the queue (one poller per runtime watches the queue rows of every
waited operation at once: ``actors/waiters.py``), and at least once a second, until it
is settled: the saved, validated value, or the
operation's typed terminal error. Any process on the store may wait; a worker
(``actors/worker.py``) runs the operation.

Both are methods of ``Runtime`` (``Runtime.submit``, ``Runtime.wait``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Final, Protocol, TypeVar

import msgspec

from recoverable import errors, machine
from recoverable.actors.checks import require_bound, require_owner
from recoverable.actors.heartbeat import LeaseKeeper
from recoverable.actors.host import Backend
from recoverable.actors.options import PrepareOptions
from recoverable.actors.prepare import (
    admission_for,
    choose_job_operation,
    job_operation,
    put_new_operation,
    save_admitted,
)
from recoverable.actors.unclaimed import Served, key_of, no_worker_at, served_now
from recoverable.actors.waiters import QueueWatch
from recoverable.contract import ResponseContract, contract_for
from recoverable.preconditions import DEFAULT_UNCLAIMED_AFTER, is_expired
from recoverable.records import CommandRecord, OperationRecord
from recoverable.sources_rules import superseded_error
from recoverable.status import SETTLED_STATES
from recoverable.storage import codec
from recoverable.storage.base import Store as RecoveryStore
from recoverable.storage.base import WriteTransaction as WriteTxn
from recoverable.storage.keys import operation_key, payload_key
from recoverable.storage.migration import saved_completion
from recoverable.storage.queue import decode_member, member_key
from recoverable.storage.queue_checks import QueueLook, find_damage
from recoverable.telemetry import Telemetry
from recoverable.transitions import FINISHED
from recoverable.types import (
    AccountBinding,
    Handle,
    JsonSchema,
    Status,
    StructuredRequest,
    to_datetime,
)


class Runtime(Protocol):
    """What submit and wait use of the runtime (``actors/runtime.py`` implements it)."""

    store: RecoveryStore
    backend: Backend | None
    account: AccountBinding | None
    signed_out: bool  # sign_out was called (account None: signed out, not never bound)
    selector: Callable[[StructuredRequest], StructuredRequest] | None
    now: Callable[[], float]
    telemetry: Telemetry
    leases: LeaseKeeper  # its lease_seconds bounds a hard attempt_timeout
    queue_watch: QueueWatch  # wakes ``wait`` when the operation leaves the queue

__all__ = [
    "DEFAULT_UNCLAIMED_AFTER", "choose_job_operation", "served_now", "settled", "submit",
    "wait", "with_queue_state",
]

ResultT = TypeVar("ResultT")

_PENDING: Final = object()


def submit_operation(
    record: OperationRecord, body: bytes, stored: bytes, txn: WriteTxn
) -> OperationRecord:
    """The transaction of ``submit``: the job's existing operation, or this new one;
    queued unless finished."""
    chosen = job_operation(txn, record)
    if chosen is None:
        put_new_operation(txn, record, body, stored)
        chosen = record
    if chosen.phase not in FINISHED and not chosen.has_completion:
        txn.enqueue(chosen.operation_id)
    return chosen


async def submit(
    rt: Runtime,
    /,
    request: StructuredRequest,
    *,
    response: type[Any] | JsonSchema,
    job_id: str,
    input_revision: str | None = None,
    maximum_attempts: int,
    unclaimed_after: float = DEFAULT_UNCLAIMED_AFTER,
    **options: Any,
) -> Handle:
    """Prepare and queue an operation for workers, in one transaction; idempotent by
    ``(account, scope, job_id, input_revision)``.

    ``unclaimed_after`` (seconds, default ``DEFAULT_UNCLAIMED_AFTER``: one hour) is saved
    with the operation: once no live worker of its account and endpoint has served it for
    that long, any runtime's sweep, or the poller of a runtime waiting for it, ends it
    ``failed`` with ``failure_reason="no_worker"`` (``wait`` raises ``PermanentlyFailed``;
    docs/workers.md). A finite number >= 0 (``InvalidRequest``). An operation already
    saved for the job keeps the bound it was saved with.

    ``options`` are ``prepare``'s (``retry_policy``, ``expires_at``, ``scope``,
    ``contract_version``, ``previous_operation_id``, ``maximum_output_tokens_total``,
    ``maximum_cost_total``, ``prices``, ``on_interruption``, ``reattach``).
    Submitting the same job and revision again with the same frozen body returns the
    same handle, whatever state the operation is in (nothing is generated again); with
    another body it raises ``JobConflict``. A job whose operation was acknowledged or
    abandoned is gone from the store: submitting it again creates a new operation. A job
    with an operation whose record cannot be read raises that record's ``CorruptRecord``
    or ``UnsupportedRecordVersion`` and creates nothing (restore the store, or abandon
    that operation: an operator's decision).
    """
    if not isinstance(job_id, str):
        raise errors.InvalidRequest("submit needs a job_id (the key of its idempotency)")
    require_bound(rt.account, signed_out=rt.signed_out)
    record, body, stored = admission_for(rt, request, response=response, options=PrepareOptions(
        maximum_attempts=maximum_attempts, job_id=job_id, input_revision=input_revision,
        unclaimed_after=unclaimed_after, **options,
    ))
    return await save_admitted(rt, record, body, stored, submit_operation, "submit")


def settled_rows(store: RecoveryStore, operation_id: str) -> list[bytes | None]:
    """What :func:`settled` decides from: the record, its command, its completion and its
    queue row in one snapshot. A worker claims a suspended operation by spending its
    resume mark and reopening the record in one commit, so a record read before that
    commit and a queue row read after it would look "suspended from outside". One read
    is also one round trip on PostgreSQL."""
    return store.get_raw_rows([
        ("operations", operation_key(operation_id)), ("commands", operation_key(operation_id)),
        ("payloads", payload_key(operation_id, "completion")),
        ("queue", member_key(operation_id)),
    ])


def settled(
    rt: Runtime, operation_id: str, contract: ResponseContract,
    rows: list[bytes | None] | None = None,
) -> Any:
    """The operation's validated value, its typed terminal error raised, or ``_PENDING``
    (``rows``: :func:`settled_rows`, read here if not given)."""
    store: RecoveryStore = rt.store
    raw_record, raw_command, completion, raw_queued = (
        settled_rows(store, operation_id) if rows is None else rows
    )
    record: OperationRecord | None = (
        None if raw_record is None
        else codec.decode_operation(raw_record, operation_id=operation_id)
    )
    if record is None:
        disposition = store.get_disposition(operation_id)
        if disposition is not None:
            require_owner(rt.account, disposition.account, operation_id)
            raise errors.StateUnavailable(
                f"operation is {disposition.disposition}", operation_id=operation_id
            )
        raise errors.StateUnavailable("no such operation", operation_id=operation_id)
    require_owner(rt.account, record.account, operation_id)
    if record.phase == "superseded":  # no result of it may count
        raise superseded_error(record)
    command: CommandRecord | None = (
        None if raw_command is None
        else codec.decode_command(raw_command, operation_id=operation_id)
    )
    if machine.cancel_fences(record, command.kind if command is not None else None):
        raise errors.OperationCancelled(operation_id=operation_id)
    if record.format_hash != contract.format_hash:
        raise errors.FormatMismatch(
            "the requested response format differs from the saved one",
            operation_id=operation_id,
        )
    if record.has_completion:
        payload = completion if completion is not None else saved_completion(store, record)
        if payload is None:
            raise errors.CompletionUnavailable(
                "the saved completion is missing", operation_id=operation_id
            )
        return contract.decode(payload)
    if record.phase == "failed":
        pending = record.continuation
        if pending is not None and pending.state == "pending":
            return _PENDING  # a continuation will run it again (or be cancelled)
        if pending is not None and pending.state == "dispatched" and pending.successor_id:
            # Its continuation successor (same body, model, account, endpoint)
            # settles the job; its own continuation counts against the same budget.
            return settled(rt, pending.successor_id, contract)
        raise machine.terminal_error(record)
    idle = record.phase in ("prepared", "waiting", "suspended")
    if idle and is_expired(record, rt.now()):
        raise errors.StateExpired(operation_id=operation_id)
    if record.phase == "suspended":
        member = None if raw_queued is None else decode_member(raw_queued)
        if member is None or not member[1]:  # not marked for the next worker to resume
            raise errors.OperationSuspended(operation_id=operation_id)
    return _PENDING


async def wait(
    rt: Runtime, handle: Handle, *, response: type[ResultT] | JsonSchema
) -> ResultT:
    """Wait until the operation is settled; return its saved, validated value or raise
    its typed terminal error.

    Runs nothing itself: a worker (any process on the store) runs the operation. It
    reads the record when it left the queue (one poller per runtime watches the queue
    for every waiter, ``actors/waiters.py``), or when it may have settled while queued
    (a host's suspend; looked for once a second for all waiters at once);
    never busy-loops; bound it with ``trio.fail_after``/``move_on_after``. Raises
    ``OperationCancelled``, ``AttemptsExhausted``/``PermanentlyFailed`` (the failed
    record's error), ``StateExpired``, ``OperationSuspended`` (suspended by a host, not
    by a stopping worker), ``StateUnavailable`` (acknowledged, abandoned or missing),
    ``AccountChanged`` and ``FormatMismatch`` like ``send_recovering``. Nothing waits forever: a
    submitted operation that no live worker of its account and endpoint served within
    its unclaimed bound (counted from this wait's start at the earliest) is ended
    ``no_worker`` by this runtime's poller: ``PermanentlyFailed``; a damaged queue or
    lease row, which would keep it from every worker, raises ``CorruptRecord``.
    """
    contract = contract_for(response)
    began = rt.now()
    operation_id = handle.operation_id
    while True:
        # The read off the event loop where it is a round trip (RecoveryStore.read_off_loop):
        # a host waiting on thousands of jobs serves the others meanwhile.
        rows = await rt.store.read_off_loop(
            functools.partial(settled_rows, rt.store, operation_id)
        )
        value = settled(rt, operation_id, contract, rows)
        if value is not _PENDING:
            result: ResultT = value
            return result
        # One poller per runtime wakes this when the operation leaves the queue or may
        # have settled while queued (actors/waiters.py); the record is read again then.
        await rt.queue_watch.until_gone(operation_id, waiting_since=began)


def with_queue_state(
    store: RecoveryStore, record: OperationRecord, status: Status,
    served: Served | None = None, look: QueueLook | None = None,
) -> Status:
    """``status`` with its queue state: ``queued``, ``resuming`` or ``waiting_for_worker``
    (queued, and no live worker serves its account and endpoint: ``queue_reason`` says
    whether one serves the endpoint for another account, ``no_worker_at`` when it ends
    ``no_worker`` if none comes). Unchanged for an operation that is not queued, is
    settled, or was suspended by a host. A damaged queue or lease row is the
    blocker ``incompatible_record`` (availability ``blocked``), ``queue_reason`` naming
    which row, and ``queue`` None: no worker will run it. ``served`` and ``look`` (the
    queue and lease rows of many operations, ``find_damage``) are read here if not given."""
    if status.redacted or status.state in SETTLED_STATES:
        return status
    if look is None:
        look = find_damage(store, [record.operation_id])
    damage = look.damage.get(record.operation_id)
    if damage is not None:
        return msgspec.structs.replace(
            status, queue=None, queue_reason=damage.kind, availability="blocked",
            blockers=status.blockers | {"incompatible_record"},
            suggested_actions=("abandon",),
        )
    resume = look.queued.get(record.operation_id)
    if resume is None or (record.phase == "suspended" and not resume):
        return status
    if served is None:
        served = served_now(store)
    key = key_of(record)
    if key not in served:
        at = no_worker_at(record, record.unclaimed_after, served.until(key))
        return msgspec.structs.replace(
            status, queue="waiting_for_worker", queue_reason=served.reason(key),
            no_worker_at=to_datetime(at),
        )
    return msgspec.structs.replace(status, queue="resuming" if resume else "queued")
