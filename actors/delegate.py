"""Delegated operations: a parent operation fed by child operations.

``runtime.delegate(group_id, builder=..., response=..., ...)`` names a group; each
:meth:`Delegation.child` is an ordinary operation (scope :data:`DELEGATE_SCOPE`,
``job_id`` = the group id, ``input_revision`` = ``child:<key>``), run by workers or by the
host, and continued after a terminal stream failure like any operation
(``docs/continuation.md``). :meth:`Delegation.fan_in` waits until every child's result is
saved (following each child's continuation lineage), then prepares the **parent**: its
request comes from the host's deterministic ``builder`` applied to the children's
validated values, in key order; it is frozen and saved in ONE transaction under a
deterministic id (``input_revision`` = ``parent``). Each child's result therefore reaches
the parent exactly once: a repeated or concurrent fan-in (another process, a restart)
finds the same parent, and a builder that gives another body for the same results is
refused (``JobConflict``), never a second parent. A child still recovering keeps the
parent unborn (it is never completed early); a child that failed for good stops the fan-in
with that child's own typed error (the accurate reason). The parent's own continuation
reuses its frozen body: the children's results are never generated again.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

import msgspec

from recoverable import errors
from recoverable.actors.checks import require_owner, require_signed_in
from recoverable.actors.continuation import SendingRuntime, continued_id, send_continuing
from recoverable.actors.options import PrepareOptions
from recoverable.actors.prepare import new_admission, put_new_operation
from recoverable.actors.turns import DELEGATE_SCOPE
from recoverable.contract import contract_for
from recoverable.records import OperationRecord, StoredRequest
from recoverable.storage.base import WriteTransaction as WriteTxn
from recoverable.types import Handle, JsonSchema, RetryPolicy, StructuredRequest

__all__ = ["DELEGATE_SCOPE", "Builder", "Delegation", "open_delegation"]

Builder = Callable[[Mapping[str, Any]], StructuredRequest]
PARENT_REVISION: Final = "parent"
_CHILD: Final = "child:"
MAX_CHILDREN: Final = 1000


class Runtime(SendingRuntime, Protocol):
    """What a delegation uses of the runtime (``actors/runtime.py`` implements it)."""

    async def wait(self, handle: Handle, *, response: Any) -> Any: ...


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not 0 < len(key) <= 128 or not key.isprintable():
        raise errors.InvalidRequest("a child key is a printable string of 1..128 characters")


def _create_child(record: OperationRecord, body: bytes, stored: bytes, queue: bool,
                  txn: WriteTxn) -> OperationRecord:
    """One child per key: the same body again returns it; another body is a conflict."""
    for operation_id in txn.operation_ids_by_job(record.account, DELEGATE_SCOPE, record.job_id):
        other = txn.get_operation(operation_id)
        if other is None or other.input_revision != record.input_revision:
            continue
        if other.body_hash != record.body_hash:
            raise errors.JobConflict("this child key was delegated with another request",
                                     operation_id=other.operation_id)
        return other
    put_new_operation(txn, record, body, stored)
    if queue:
        txn.enqueue(record.operation_id)
    return record


def _create_parent(record: OperationRecord, body: bytes, stored: bytes, queue: bool,
                   txn: WriteTxn) -> OperationRecord:
    """The fan-in transaction: the one parent of the group (deterministic id)."""
    existing = txn.get_operation(record.operation_id)
    if existing is not None:
        if existing.body_hash != record.body_hash:
            raise errors.JobConflict(
                "the builder gave another request for the same children's results: it "
                "must be deterministic", operation_id=record.operation_id)
        return existing
    if txn.get_disposition(record.operation_id) is not None:
        raise errors.StateUnavailable("the group's parent was already settled",
                                      operation_id=record.operation_id)
    put_new_operation(txn, record, body, stored)
    if queue:
        txn.enqueue(record.operation_id)
    return record


class Delegation:
    """A parent fed by children (``runtime.delegate``); see the module docstring."""

    def __init__(self, rt: Runtime, group_id: str, *, builder: Builder,
                 response: type[Any] | JsonSchema, maximum_attempts: int,
                 retry_policy: RetryPolicy | None) -> None:
        if not isinstance(group_id, str) or not 0 < len(group_id) <= 200:
            raise errors.InvalidRequest("group_id must be a non-empty string (<= 200)")
        if not callable(builder):
            raise errors.InvalidRequest("builder must be a callable")
        contract_for(response)
        self.rt = rt
        self.group_id = group_id
        self.builder = builder
        self.response = response
        self.maximum_attempts = maximum_attempts
        self.retry_policy = retry_policy
        self.children: dict[str, Any] = {}  # key -> the child's response type

    def parent_id(self) -> str:
        account = require_signed_in(self.rt.account, "a delegation needs an account")
        seed = f"{account.account_id}\0{account.source}\0{self.group_id}\0parent"
        return "op_" + hashlib.sha256(seed.encode()).hexdigest()[:32]

    def _admit(self, request: StructuredRequest, response: Any, revision: str,
               maximum_attempts: int) -> tuple[OperationRecord, bytes, bytes]:
        rt = self.rt
        return new_admission(
            request, response=response,
            options=PrepareOptions(
                maximum_attempts=maximum_attempts, retry_policy=self.retry_policy,
                scope=DELEGATE_SCOPE, job_id=self.group_id, input_revision=revision,
            ),
            account=rt.account, backend=rt.backend, selector=None, now=rt.now(),
        )

    async def child(self, key: str, request: StructuredRequest, *, response: Any,
                    maximum_attempts: int = 3, queue: bool = False) -> Handle:
        """Declare (fan out) the child ``key``: an operation of its own (idempotent)."""
        _check_key(key)
        if len(self.children) >= MAX_CHILDREN and key not in self.children:
            raise errors.InvalidRequest(f"a delegation has at most {MAX_CHILDREN} children")
        record, body, stored = self._admit(request, response, _CHILD + key, maximum_attempts)
        child = await self.rt.store.write(
            functools.partial(_create_child, record, body, stored, queue))
        self.children[key] = response
        return Handle(child.operation_id, root_operation_id=child.root_operation_id)

    async def _result(self, handle: Handle, response: Any, authorize: Any) -> Any:
        """The child's validated value: run here (``authorize``) or waited for (workers),
        following its continuation; its own typed error when it failed for good."""
        handle = Handle(continued_id(self.rt.store, handle.operation_id))
        saved = self.rt.store.get_operation(handle.operation_id)
        if authorize is None or (saved is not None and saved.has_completion):
            return await self.rt.wait(handle, response=response)  # a saved result: read
        return await send_continuing(self.rt, handle, response=response, authorize=authorize)

    def _check_child(self, key: str, handle: Handle) -> None:
        """``handle`` is this group's child ``key`` (or a continuation successor of it):
        ``InvalidRequest`` otherwise (fail closed: another operation never feeds the parent)."""
        account = require_signed_in(self.rt.account, "a delegation needs an account")
        operation_id = getattr(handle, "operation_id", None)
        if not isinstance(operation_id, str):
            raise errors.InvalidRequest(f"fan_in: the handle of child {key!r} is not a Handle")
        record = self.rt.store.get_operation(operation_id)
        found = record if record is not None else self.rt.store.get_disposition(operation_id)
        if found is None:
            raise errors.StateUnavailable("no such operation", operation_id=operation_id)
        require_owner(account, found.account, operation_id)
        if (found.scope, found.job_id, found.input_revision) != (
            DELEGATE_SCOPE, self.group_id, _CHILD + key
        ):
            raise errors.InvalidRequest(
                f"fan_in: the operation given for child {key!r} is not that child of group "
                f"{self.group_id!r}", operation_id=operation_id)

    async def fan_in(self, handles: Mapping[str, Handle], *, authorize: Any = None,
                     queue: bool = False) -> Handle:
        """Wait for every child's saved result, then prepare the parent from the builder
        (once). ``authorize``: run the children here; None: workers run them. Every handle
        must be this group's child of its key (``InvalidRequest`` before anything waits)."""
        for key in sorted(handles):
            self._check_child(key, handles[key])
        values: dict[str, Any] = {}
        for key in sorted(handles):
            values[key] = await self._result(handles[key], self.children.get(key, None)
                                             or self._schema_of(handles[key]), authorize)
        request = self.builder(dict(values))
        again = self.builder(dict(values))
        if not isinstance(request, StructuredRequest) or again != request:
            raise errors.InvalidRequest("the builder must return the same StructuredRequest "
                                        "for the same results (deterministic)")
        record, body, stored = self._admit(request, self.response, PARENT_REVISION,
                                           self.maximum_attempts)
        parent_id = self.parent_id()
        record = msgspec.structs.replace(record, operation_id=parent_id,
                                         root_operation_id=parent_id)
        parent = await self.rt.store.write(
            functools.partial(_create_parent, record, body, stored, queue))
        return Handle(parent.operation_id, root_operation_id=parent.root_operation_id)

    def _schema_of(self, handle: Handle) -> JsonSchema:
        """A child declared by another process: its saved contract (the request payload)."""
        raw = self.rt.store.get_payload(handle.operation_id, "request")
        if raw is None:
            raise errors.RequestUnavailable(operation_id=handle.operation_id)
        saved = msgspec.json.decode(raw, type=StoredRequest)
        return JsonSchema(saved.format_name, saved.schema)

    async def send(self, parent: Handle, *, authorize: Any) -> Any:
        """Run the parent here to its validated value (following its continuation)."""
        return await self._result(parent, self.response, authorize)

    def settled_parent(self, parent: Handle) -> str:
        """The operation that holds (or will hold) the parent's result after its
        continuations."""
        return continued_id(self.rt.store, parent.operation_id)


def open_delegation(rt: Runtime, group_id: str, *, builder: Builder,
                    response: type[Any] | JsonSchema, maximum_attempts: int = 3,
                    retry_policy: RetryPolicy | None = None) -> Delegation:
    """``runtime.delegate(...)``."""
    return Delegation(rt, group_id, builder=builder, response=response,
                      maximum_attempts=maximum_attempts, retry_policy=retry_policy)
