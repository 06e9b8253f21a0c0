"""New operation records: one constructor, shared by ``prepare`` and manual ``retry``.

An operation is born ``prepared`` with its frozen body and its saved request, in one
transaction (:func:`create_operation`); nothing is sent. A successor of manual retry is
built by the same constructor from its source's identity (:func:`identity_of`).
"""

from __future__ import annotations

import itertools
import secrets

import attrs
from recoverable.storage.base import WriteTransaction as WriteTxn

from recoverable import errors
from recoverable.body import body_hash
from recoverable.records import OnInterruption, OperationRecord
from recoverable.types import AccountBinding, RetryPolicy

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


def identity_of(record: OperationRecord) -> Identity:
    return Identity(
        format_name=record.format_name,
        format_hash=record.format_hash,
        model_override=record.model_override,
        contract_version=record.contract_version,
        scope=record.scope,
        job_id=record.job_id,
        input_revision=record.input_revision,
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
        on_interruption=on_interruption,
    )


def put_new_operation(txn: WriteTxn, record: OperationRecord, body: bytes, stored: bytes) -> None:
    """Write a new operation with its frozen body and saved request (inside a transaction)."""
    txn.put_payload(record.operation_id, "body", body)
    txn.put_payload(record.operation_id, "request", stored)
    txn.put_operation(record)


def create_operation(record: OperationRecord, body: bytes, stored: bytes, txn: WriteTxn) -> None:
    """The transaction of ``prepare``: a new id never overwrites an existing operation."""
    if txn.get_operation(record.operation_id) is not None:
        raise errors.InvalidRequest("operation id collision", operation_id=record.operation_id)
    put_new_operation(txn, record, body, stored)
