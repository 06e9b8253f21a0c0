"""The turns of a thread as the store holds them (issue 18): their scope, numbering and
the "newer turn" check a continuation makes before its dispatch. ``actors/thread.py`` is
the thread itself; this module is what ``actors/continuation.py`` needs of it.
"""

from __future__ import annotations

from typing import Final

from recoverable.storage.base import WriteTransaction as WriteTxn

from recoverable import errors
from recoverable.records import OperationRecord
from recoverable.types import AccountBinding

__all__ = [
    "DELEGATE_SCOPE", "THREAD_SCOPE", "newer_turn", "thread_turns", "turn_number", "turn_revision",
]

THREAD_SCOPE: Final = "recoverable.thread"
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
    """A later turn of the same thread exists: newer user intent (continuation check)."""
    number = turn_number(record)
    if number is None or record.job_id is None:
        return False
    return any(later > number for later in thread_turns(txn, record.account, record.job_id))
