"""Threads: multi-turn structured conversations made of ordinary operations.

A thread is named by the host (``runtime.thread(thread_id, ...)``) and lives in the store
as its turns: each turn is an operation in scope :data:`THREAD_SCOPE`, ``job_id`` = the
thread id and ``input_revision`` = ``turn-000001``, ``turn-000002``, ... Its frozen body
carries the thread's history up to the previous **committed** turn: every earlier user
input and validated output, as plain message items (so it works with ``store: false``; no
``previous_response_id``: server-side conversation state is an unsupported form here, the
body contract refuses it). A turn is committed only when the host says so
(:meth:`Thread.commit`, after its own commit); its saved input and output then become the
next turn's history — reused from the store, never generated again.

A thread never has two turns in flight: a new turn is created (in one transaction with
the check) only when the latest turn is committed, failed for good (then the new turn is
newer user intent: it cancels that turn's pending continuation, ``newer_turn``) or was
abandoned. A turn that failed on stream failures may be continued (``docs/continuation.md``):
its continuation successor is the same turn (same number, same body).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Final, Protocol

import attrs
import msgspec

from recoverable import continuation, errors
from recoverable.actors.checks import require_owner, require_signed_in
from recoverable.actors.continuation import SendingRuntime, continued_id, send_continuing
from recoverable.actors.options import PrepareOptions
from recoverable.actors.prepare import new_admission, put_new_operation
from recoverable.actors.turns import (
    THREAD_SCOPE,
    thread_turns,
    turn_history,
    turn_number,
    turn_revision,
)
from recoverable.contract import contract_for
from recoverable.records import OperationRecord
from recoverable.storage.base import WriteTransaction as WriteTxn
from recoverable.storage.threads import ThreadRow, read_row
from recoverable.types import Handle, JsonSchema, RetryPolicy, StructuredRequest


class Runtime(SendingRuntime, Protocol):
    """What a thread uses of the runtime (``actors/runtime.py`` implements it)."""


__all__ = ["THREAD_SCOPE", "Thread", "ThreadTurn"]

MAX_TURNS: Final = 999_999

def _settled(records: list[OperationRecord], gone: Callable[[str], bool] = lambda _: False
             ) -> str:
    """How a turn stands: ``committed``, ``completed``, ``continuation_pending`` (failed;
    a newer turn cancels that), ``failed`` (for good), or ``active`` (in flight).
    ``gone(id)``: that operation was acknowledged or abandoned (its marker is saved)."""
    if any(turn.thread_committed for turn in records):
        return "committed"
    if any(turn.has_completion for turn in records):
        return "completed"
    ids = {turn.operation_id for turn in records}
    for record in records:
        decided = record.continuation
        if record.phase not in ("failed", "cancelled"):
            return "active"
        successor = decided.successor_id if decided is not None else None
        if decided is not None and decided.state == "dispatched" and (
            successor is None or (successor not in ids and not gone(successor))
        ):
            return "active"  # its successor is being created
    if any(continuation.is_pending(turn) for turn in records):
        return "continuation_pending"
    return "failed"


@attrs.frozen
class ThreadTurn:
    """One turn of a thread as the store holds it (ids and states only)."""

    number: int
    operation_id: str  # the operation that stands for it (a completion, or the latest)
    state: str  # committed, completed, failed, continuation_pending, active


def _standing(records: list[OperationRecord]) -> OperationRecord:
    done = [turn for turn in records if turn.has_completion]
    return done[0] if done else max(records, key=lambda turn: (turn.created_at,
                                                                  turn.operation_id))


@attrs.frozen
class _TurnPlan:
    thread_id: str
    user_input: str
    model: str
    instructions: str | None
    reasoning_effort: str | None


def _create_turn(
    plan: _TurnPlan, build: Any, queue: bool, now: float, txn: WriteTxn
) -> tuple[OperationRecord, bool]:
    """The transaction of :meth:`Thread.turn`: check that no turn is in flight, build the
    next turn's body from the committed history, save it (idempotent for the same input)."""
    account = build.account
    turns = thread_turns(txn, account, plan.thread_id)
    # What the thread's disposed turns left (their records are gone).
    row = read_row(txn, account, plan.thread_id)
    latest = max(max(turns, default=0), row.latest_turn if row is not None else 0)
    gone = functools.partial(_disposed, txn)
    committed = [turn for turn in turns if _settled(turns[turn], gone) == "committed"]
    if row is not None and row.committed_turn == latest:
        state = "committed"  # acknowledged (or abandoned) after its commit
    else:  # "none": no turn yet, or the latest one's records are all disposed
        state = _settled(turns[latest], gone) if latest in turns else "none"
    if state in ("active", "completed"):
        # The same input again (a host that crashed before saving the handle) returns
        # the turn in flight; anything else waits for it.
        standing = _standing(turns[latest])
        again, _body, _stored = build.admit(
            _turn_request(plan, _committed_history(txn, turns, committed, latest, row)),
            turn_revision(latest),
        )
        if again.body_hash == standing.body_hash:
            return standing, False
        raise errors.ThreadTurnActive(operation_id=standing.operation_id)
    if state == "continuation_pending":
        # Newer user intent takes precedence: the failed turn is not continued.
        for pending in turns[latest]:
            if continuation.is_pending(pending):
                txn.put_operation(continuation.cancelled(pending, "newer_turn", now))
                txn.dequeue(pending.operation_id)
    number = latest + 1
    if number > MAX_TURNS:
        raise errors.InvalidRequest("a thread has at most 999,999 turns")
    request = _turn_request(plan, _committed_history(txn, turns, committed, number, row))
    record, body, stored = build.admit(request, turn_revision(number))
    put_new_operation(txn, record, body, stored)
    if queue:
        txn.enqueue(record.operation_id)
    return record, True


def _disposed(txn: WriteTxn, operation_id: str) -> bool:
    return txn.get_disposition(operation_id) is not None


def _committed_history(txn: WriteTxn, turns: dict[int, list[OperationRecord]],
                       committed: list[int], before: int, row: ThreadRow | None
                       ) -> list[dict[str, Any]]:
    """The history a turn numbered ``before`` carries: up to the last committed turn —
    its records, or the thread's row when that turn was disposed."""
    live = max((turn for turn in committed if turn < before), default=0)
    if row is not None and live < row.committed_turn < before:
        return list(row.history)
    return turn_history(txn, _standing(turns[live])) if live else []


def _turn_request(plan: _TurnPlan, history: list[dict[str, Any]]) -> StructuredRequest:
    return StructuredRequest(
        model=plan.model, instructions=plan.instructions,
        input=[*history, {"role": "user", "content": plan.user_input}],
        reasoning_effort=plan.reasoning_effort,
    )


def _commit(operation_id: str, account: Any, thread_id: str, txn: WriteTxn) -> OperationRecord:
    record = txn.get_operation(operation_id)
    if record is None or turn_number(record) is None:
        raise errors.StateUnavailable("no such thread turn", operation_id=operation_id)
    require_owner(account, record.account, operation_id)
    if record.job_id != thread_id:  # fail closed: never another thread's turn
        raise errors.InvalidRequest(
            f"the operation is a turn of another thread, not of {thread_id!r}",
            operation_id=operation_id)
    if not record.has_completion or txn.get_payload(operation_id, "completion") is None:
        raise errors.CompletionUnavailable(
            "nothing to commit: the turn has no saved result", operation_id=operation_id
        )
    if not record.thread_committed:
        record = msgspec.structs.replace(record, thread_committed=True)
        txn.put_operation(record)
    return record


class Thread:
    """A durable multi-turn conversation (``runtime.thread``); see the module docstring."""

    def __init__(
        self,
        rt: Runtime,
        thread_id: str,
        *,
        response: type[Any] | JsonSchema,
        model: str,
        instructions: str | None,
        maximum_attempts: int,
        retry_policy: RetryPolicy | None,
        reasoning_effort: str | None,
    ) -> None:
        if not isinstance(thread_id, str) or not 0 < len(thread_id) <= 256:
            raise errors.InvalidRequest("thread_id must be a non-empty string (<= 256)")
        contract_for(response)  # a bad response type fails now, not at the first turn
        self.rt = rt
        self.thread_id = thread_id
        self.response = response
        self.model = model
        self.instructions = instructions
        self.maximum_attempts = maximum_attempts
        self.retry_policy = retry_policy
        self.reasoning_effort = reasoning_effort

    @property
    def account(self) -> Any:
        return require_signed_in(self.rt.account, "a thread needs an account")

    def admit(self, request: StructuredRequest, revision: str) -> tuple[OperationRecord, bytes,
                                                                        bytes]:
        rt = self.rt
        return new_admission(
            request, response=self.response,
            options=PrepareOptions(
                maximum_attempts=self.maximum_attempts, retry_policy=self.retry_policy,
                scope=THREAD_SCOPE, job_id=self.thread_id, input_revision=revision,
            ),
            account=rt.account, backend=rt.backend, selector=None, now=rt.now(),
        )

    async def turn(self, user_input: str, *, queue: bool = False) -> Handle:
        """Create the next turn (nothing is sent). ``queue=True`` hands it to workers.
        The same input while that turn is in flight returns it again (idempotent); other
        input raises ``ThreadTurnActive`` until the latest turn is committed or failed."""
        if not isinstance(user_input, str) or not user_input:
            raise errors.InvalidRequest("a turn's input is a non-empty string")
        plan = _TurnPlan(self.thread_id, user_input, self.model, self.instructions,
                         self.reasoning_effort)
        self.account  # noqa: B018 (signed in, or AccountChanged before anything is written)
        record, _new = await self.rt.store.write(
            functools.partial(_create_turn, plan, self, queue, self.rt.now())
        )
        return Handle(record.operation_id, root_operation_id=record.root_operation_id)

    async def send(self, handle: Handle, *, authorize: Any) -> Any:
        """Run the turn here to its validated value (a pending continuation of a turn that
        failed on stream failures is followed, like ``recoverable batch`` does)."""
        return await send_continuing(self.rt, handle, response=self.response,
                                     authorize=authorize)

    async def commit(self, handle: Handle) -> None:
        """The host committed this turn's result: it becomes the next turn's history
        (call after your own commit; idempotent). A continued turn is committed through
        any operation of its lineage."""
        operation_id = continued_id(self.rt.store, handle.operation_id)
        await self.rt.store.write(functools.partial(_commit, operation_id, self.account,
                                                    self.thread_id))

    def turns(self) -> list[ThreadTurn]:
        """The thread's turns, oldest first (ids and states only). A disposed turn is
        gone, except the last committed one, which stays the thread's history."""
        store = self.rt.store
        records, _unreadable = store.inventory(self.account, THREAD_SCOPE)
        grouped: dict[int, list[OperationRecord]] = {}
        for record in records:
            number = turn_number(record)
            if record.job_id == self.thread_id and number is not None:
                grouped.setdefault(number, []).append(record)
        row = read_row(store, self.account, self.thread_id)

        def gone(operation_id: str) -> bool:
            return store.get_disposition(operation_id) is not None

        listed = {
            number: ThreadTurn(number, _standing(grouped[number]).operation_id,
                               _settled(grouped[number], gone))
            for number in grouped
        }
        if row is not None and row.committed_operation_id is not None:
            listed[row.committed_turn] = ThreadTurn(row.committed_turn,
                                                    row.committed_operation_id, "committed")
        return [listed[number] for number in sorted(listed)]


def open_thread(
    rt: Runtime,
    thread_id: str,
    *,
    response: type[Any] | JsonSchema,
    model: str,
    instructions: str | None = None,
    maximum_attempts: int = 3,
    retry_policy: RetryPolicy | None = None,
    reasoning_effort: str | None = None,
    server_state: bool = False,
) -> Thread:
    """``runtime.thread(...)``: the thread's settings apply to each turn it creates."""
    if server_state:
        raise errors.InvalidRequest(
            "server_state=True (continuing by previous_response_id with store: true) is not "
            "supported: recoverable requests are self-contained; a thread carries its "
            "committed history in each turn's body instead"
        )
    return Thread(rt, thread_id, response=response, model=model, instructions=instructions,
                  maximum_attempts=maximum_attempts, retry_policy=retry_policy,
                  reasoning_effort=reasoning_effort)
