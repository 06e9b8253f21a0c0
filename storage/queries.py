"""The store's scans: each one reads ONE LMDB snapshot (``RecoveryStore`` opens it).

Unreadable rows are skipped or reported by id here, never guessed about
(``check_integrity`` describes them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, TypeAlias

import lmdb

from recoverable.errors import CorruptRecord, UnsupportedRecordVersion
from recoverable.records import CommandRecord, DispositionRecord, LeaseRecord, OperationRecord
from recoverable.storage import codec
from recoverable.storage.base import Table
from recoverable.storage.keys import HASH_BYTES, PAYLOAD_KINDS, hosts_prefix, key_str, payload_key
from recoverable.types import AccountBinding

__all__ = [
    "commands_after",
    "control_rows",
    "dispositions",
    "ids_by_job",
    "inventory",
    "payload_kinds",
]

Snapshot: TypeAlias = "lmdb.Transaction[bytes]"
Tables: TypeAlias = "dict[Table, Any]"


def _matches(
    record: OperationRecord | DispositionRecord, account: AccountBinding | None,
    scope: str | None,
) -> bool:
    """The record is of ``account`` and ``scope`` (None: any)."""
    return (account is None or record.account == account) and (
        scope is None or record.scope == scope
    )


def _matching_operations(
    rows: Iterable[tuple[bytes, bytes]], account: AccountBinding | None, scope: str | None
) -> tuple[list[OperationRecord], list[str]]:
    """Readable records matching account/scope (None: any), and every unreadable id."""
    readable: list[OperationRecord] = []
    unreadable: list[str] = []
    for key, raw in rows:
        operation_id = key_str(key)
        try:
            record = codec.decode_operation(raw, operation_id=operation_id)
        except (CorruptRecord, UnsupportedRecordVersion):
            unreadable.append(operation_id)
            continue
        if _matches(record, account, scope):
            readable.append(record)
    return readable, unreadable


def inventory(
    txn: Snapshot, dbs: Tables, account: AccountBinding | None, scope: str | None
) -> tuple[list[OperationRecord], list[str]]:
    """See ``RecoveryStore.inventory``."""
    if account is None or scope is None:
        rows = txn.cursor(db=dbs["operations"]).iternext()
        return _matching_operations(rows, account, scope)
    prefix = hosts_prefix(account, scope, with_job=False)
    skip = len(prefix) + HASH_BYTES  # the job hash, then the operation id

    def scope_rows() -> Iterator[tuple[bytes, bytes]]:
        cursor = txn.cursor(db=dbs["hosts"])
        if not cursor.set_range(prefix):
            return
        operations = dbs["operations"]
        for key in cursor.iternext(values=False):
            if not key.startswith(prefix):
                return
            raw = txn.get(key[skip:], db=operations)
            if raw is not None:
                yield key[skip:], raw

    return _matching_operations(scope_rows(), account, scope)


def ids_by_job(
    txn: Snapshot, dbs: Tables, account: AccountBinding, scope: str | None, job_id: str | None
) -> list[str]:
    """Operation ids with exactly this account, scope and job id (None is not "")."""
    prefix = hosts_prefix(account, scope, job_id, with_job=True)
    cursor = txn.cursor(db=dbs["hosts"])
    ids: list[str] = []
    if not cursor.set_range(prefix):
        return ids
    for key in cursor.iternext(values=False):
        if not key.startswith(prefix):
            break
        ids.append(key_str(key[len(prefix) :]))
    return ids


def payload_kinds(
    txn: Snapshot, dbs: Tables, operation_ids: list[str]
) -> dict[str, frozenset[str]]:
    """Which payloads each operation has (keys only: no value is copied)."""
    cursor = txn.cursor(db=dbs["payloads"])
    return {
        operation_id: frozenset(
            kind for kind in PAYLOAD_KINDS if cursor.set_key(payload_key(operation_id, kind))
        )
        for operation_id in operation_ids
    }


def commands_after(txn: Snapshot, dbs: Tables, after_serial: int) -> list[CommandRecord]:
    """Every readable command with ``serial > after_serial``, in serial order."""
    found = []
    for key, raw in txn.cursor(db=dbs["commands"]).iternext():
        try:
            record = codec.decode_command(raw, operation_id=key_str(key))
        except (CorruptRecord, UnsupportedRecordVersion):
            continue
        if record.serial > after_serial:
            found.append(record)
    return sorted(found, key=lambda command: command.serial)


def control_rows(
    txn: Snapshot, dbs: Tables
) -> tuple[dict[str, LeaseRecord], dict[str, CommandRecord]]:
    """Every readable lease and command by operation id."""
    leases: dict[str, LeaseRecord] = {}
    commands: dict[str, CommandRecord] = {}
    for key, raw in txn.cursor(db=dbs["leases"]).iternext():
        with contextlib.suppress(CorruptRecord, UnsupportedRecordVersion):
            leases[key_str(key)] = codec.decode_lease(raw, operation_id=key_str(key))
    for key, raw in txn.cursor(db=dbs["commands"]).iternext():
        with contextlib.suppress(CorruptRecord, UnsupportedRecordVersion):
            commands[key_str(key)] = codec.decode_command(raw, operation_id=key_str(key))
    return leases, commands


def dispositions(
    txn: Snapshot, dbs: Tables, account: AccountBinding | None, scope: str | None
) -> list[DispositionRecord]:
    """Readable disposition markers matching ``account``/``scope`` (None: any)."""
    found: list[DispositionRecord] = []
    for key, raw in txn.cursor(db=dbs["dispositions"]).iternext():
        try:
            record = codec.decode_disposition(raw, operation_id=key_str(key))
        except (CorruptRecord, UnsupportedRecordVersion):
            continue
        if _matches(record, account, scope):
            found.append(record)
    return found
