"""The turns of a thread as the store holds them: their scope, numbering and
the "newer turn" check a continuation makes before its dispatch, and what a disposed turn
leaves its thread (:func:`remember_turn`). ``actors/thread.py`` is the thread
itself; this module is what ``actors/continuation.py`` and ``actors/lifecycle.py`` need.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from recoverable import errors
from recoverable.records import OperationRecord, StoredRequest
from recoverable.storage.base import WriteTransaction as WriteTxn
from recoverable.storage.threads import THREAD_SCOPE, ThreadRow, read_row, write_row
from recoverable.types import AccountBinding

__all__ = [
    "DELEGATE_SCOPE", "THREAD_SCOPE", "newer_turn", "remember_turn", "thread_turns",
    "turn_history", "turn_number", "turn_revision",
]

# The scope of delegated children and their parent (``actors/delegate.py``): one job id per
# group, one revision per child (``child:<key>``) and ``parent``.
DELEGATE_SCOPE: Final = "recoverable.delegate"
_PREFIX: Final = "turn-"


def turn_revision(number: int) -> str:
    return f"{_PREFIX}{number:06d}"


def turn_number(record: OperationRecord) -> int | None:
    """The turn number of a thread turn's record (None: not a thread turn)."""
    revision = record.input_revision
    if record.scope != THREAD_SCOPE or revision is None or not revision.startswith(_PREFIX):
        return None
    try:
        return int(revision[len(_PREFIX):])
    except ValueError:
        return None


def thread_turns(txn: WriteTxn, account: AccountBinding, thread_id: str
                 ) -> dict[int, list[OperationRecord]]:
    """Every readable turn operation of the thread, by turn number (a continued turn has
    several: the failed source and its successors)."""
    found: dict[int, list[OperationRecord]] = {}
    for operation_id in txn.operation_ids_by_job(account, THREAD_SCOPE, thread_id):
        try:
            other = txn.get_operation(operation_id)
        except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
            continue
        number = turn_number(other) if other is not None else None
        if other is not None and number is not None:
            found.setdefault(number, []).append(other)
    return found


def newer_turn(txn: WriteTxn, record: OperationRecord) -> bool:
    """A later turn of the same thread exists (or existed: its records were disposed):
    newer user intent (continuation check)."""
    number = turn_number(record)
    if number is None or record.job_id is None:
        return False
    row = read_row(txn, record.account, record.job_id)
    if row is not None and row.latest_turn > number:
        return True
    return any(later > number for later in thread_turns(txn, record.account, record.job_id))


def turn_history(txn: WriteTxn, turn: OperationRecord) -> list[dict[str, Any]]:
    """A committed turn's own input items (its history included) and its output."""
    stored_raw = txn.get_payload(turn.operation_id, "request")
    completion = txn.get_payload(turn.operation_id, "completion")
    if stored_raw is None or completion is None:
        raise errors.CompletionUnavailable(
            "the committed turn's saved input or output is missing: the thread cannot go on",
            operation_id=turn.operation_id,
        )
    stored = msgspec.json.decode(stored_raw, type=StoredRequest)
    items = stored.request.input
    previous = [{"role": "user", "content": items}] if isinstance(items, str) else list(items)
    return [*previous, {"role": "assistant", "content": completion.decode("utf-8")}]


def remember_turn(txn: WriteTxn, record: OperationRecord) -> None:
    """A thread turn is about to be disposed (acknowledged or abandoned, its
    content removed in this transaction): its thread's row keeps its number and, when the
    turn is committed, the history up to and including it, so the thread's numbering and
    context go on. A committed turn whose input or output cannot be read (damage) leaves
    only its number, and a damaged row is left as it is: the abandon of a damaged record
    must not be refused."""
    number = turn_number(record)
    if number is None or record.job_id is None:
        return
    try:
        stored = read_row(txn, record.account, record.job_id)
    except errors.CorruptRecord:
        return  # a damaged row stays as it is (the thread reports it); the disposal goes on
    row = stored or ThreadRow(account=record.account, thread_id=record.job_id)
    changes: dict[str, Any] = {}
    if number > row.latest_turn:
        changes["latest_turn"] = number
    if record.thread_committed and number > row.committed_turn:
        try:
            history = turn_history(txn, record)
        except (errors.CompletionUnavailable, msgspec.DecodeError, UnicodeDecodeError):
            history = None
        if history is not None:
            changes.update(committed_turn=number, committed_operation_id=record.operation_id,
                           history=tuple(history))
    if changes:
        write_row(txn, msgspec.structs.replace(row, **changes))
