"""A thread's own row: what a thread needs once its turns' records are gone.

A thread (``actors/thread.py``) numbers its turns and builds each turn's body from its
committed history. Both were read only from the turns' operation records, which
acknowledge and abandon remove (seed 000: the marker stays, the content goes): after the
host acknowledged its latest committed turn, the next turn was numbered 1 and sent
without any context. Now, in the transaction that disposes a thread turn
(``actors/lifecycle.dispose``), the thread's row keeps the highest turn number it used
and, for a committed turn, the history up to and including that turn (the turn's own
input items and its validated output): exactly what the next turn's body carries.

The row is a payload row (kind ``request``) under an id no operation can have,
``ROW_PREFIX + <account digest> + ":" + <thread digest>``: counted against the quotas,
moved by ``migrate-store`` with the payloads, and removed with the account's records by
``purge_account`` (:func:`delete_rows`: a prefix scan of the account's rows). An
unreadable row raises ``CorruptRecord`` (the thread stops; nothing is guessed).
"""

from __future__ import annotations

import hashlib
from typing import Any, Final, Protocol

import msgspec

from recoverable.errors import CorruptRecord
from recoverable.records import PayloadKind
from recoverable.types import AccountBinding

__all__ = [
    "ROW_PREFIX", "THREAD_SCOPE", "ThreadRow", "delete_rows", "read_row", "row_id", "write_row",
]

# The scope of every thread turn (``actors/turns.py`` re-exports it).
THREAD_SCOPE: Final = "recoverable.thread"
ROW_PREFIX: Final = "recoverable.thread-row:"
_KIND: Final[PayloadKind] = "request"


class ThreadRow(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a thread keeps of its disposed turns."""

    version: int = 1
    account: AccountBinding
    thread_id: str
    latest_turn: int = 0  # the highest turn number a disposed turn of the thread had
    committed_turn: int = 0  # the last committed turn that was disposed (0: none)
    committed_operation_id: str | None = None
    # The input items of the next turn's body up to that committed turn (plain message
    # items: every earlier user input and validated output, that turn's own included).
    history: tuple[Any, ...] = ()


_encode = msgspec.msgpack.Encoder(order="deterministic").encode
_decode = msgspec.msgpack.Decoder(ThreadRow).decode


class RowReader(Protocol):
    def get_payload(self, operation_id: str, kind: PayloadKind) -> bytes | None: ...


class RowWriter(RowReader, Protocol):
    def put_payload(self, operation_id: str, kind: PayloadKind, data: bytes) -> None: ...


class RowRemover(Protocol):
    def delete_payload(self, operation_id: str, kind: PayloadKind) -> bool: ...

    def payload_owners(self, prefix: str) -> list[str]: ...


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _prefix(account: AccountBinding) -> str:
    return f"{ROW_PREFIX}{_digest(account.account_id, account.source)}:"


def row_id(account: AccountBinding, thread_id: str) -> str:
    return _prefix(account) + _digest(thread_id)


def read_row(reader: RowReader, account: AccountBinding, thread_id: str) -> ThreadRow | None:
    """The thread's row (None: none of its turns was disposed yet)."""
    row_key = row_id(account, thread_id)
    raw = reader.get_payload(row_key, _KIND)
    if raw is None:
        return None
    try:
        row = _decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise CorruptRecord("the thread's row is unreadable", operation_id=row_key) from exc
    if row.version != 1 or row.account != account or row.thread_id != thread_id:
        raise CorruptRecord("the thread's row names another thread", operation_id=row_key)
    return row


def write_row(txn: RowWriter, row: ThreadRow) -> None:
    txn.put_payload(row_id(row.account, row.thread_id), _KIND, _encode(row))


def delete_rows(txn: RowRemover, account: AccountBinding) -> int:
    """Remove every thread row of ``account`` (a purge); returns how many."""
    owners = txn.payload_owners(_prefix(account))
    for owner in owners:
        txn.delete_payload(owner, _KIND)
    return len(owners)
