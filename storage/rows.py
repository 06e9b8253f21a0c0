"""The typed reads by key, written once for the store and its write transaction.

``RecordGetters`` turns two primitives into the getters of
:class:`~recoverable.storage.base.RecordReader`: ``_get(table, key)`` (the stored bytes)
and ``_read_record(table, operation_id)`` (the decoded record; the write transaction
remembers what it decoded). A store reads from a fresh snapshot per call; a write
transaction reads its own earlier writes.
"""

from __future__ import annotations

from typing import Any

from recoverable.records import (
    CommandRecord,
    DispositionRecord,
    LeaseRecord,
    OperationRecord,
    PayloadKind,
)
from recoverable.storage import codec
from recoverable.storage.base import Table
from recoverable.storage.keys import operation_key, payload_key, source_key

__all__ = ["RecordGetters", "decode_row"]


def decode_row(table: Table, data: bytes, operation_id: str | None) -> Any:
    """Strictly decode a row of a typed-record table (raises the typed error if unreadable)."""
    match table:
        case "operations":
            return codec.decode_operation(data, operation_id=operation_id)
        case "commands":
            return codec.decode_command(data, operation_id=operation_id)
        case "leases":
            return codec.decode_lease(data, operation_id=operation_id)
        case "dispositions":
            return codec.decode_disposition(data, operation_id=operation_id)
    raise AssertionError(table)


class RecordGetters:
    """The getters of ``RecordReader`` over ``_get`` and ``_read_record``."""

    def _get(self, table: Table, key: bytes) -> bytes | None:
        raise NotImplementedError

    def _read_record(self, table: Table, operation_id: str) -> Any:
        raw = self._get(table, operation_key(operation_id))
        return None if raw is None else decode_row(table, raw, operation_id)

    def get_raw(self, table: Table, key: bytes) -> bytes | None:
        """The stored bytes of any key (version-1 records, governor rows, diagnostics)."""
        return self._get(table, key)

    def get_source(self, key: str) -> str | None:
        """The source manifest's current digest of ``key``."""
        raw = self._get("sources", source_key(key))
        return None if raw is None else raw.decode("ascii", "replace")

    def get_operation(self, operation_id: str) -> OperationRecord | None:
        """The record, ``None`` if missing; unreadable records raise their typed error."""
        record: OperationRecord | None = self._read_record("operations", operation_id)
        return record

    def get_payload(self, operation_id: str, kind: PayloadKind) -> bytes | None:
        return self._get("payloads", payload_key(operation_id, kind))

    def get_command(self, operation_id: str) -> CommandRecord | None:
        record: CommandRecord | None = self._read_record("commands", operation_id)
        return record

    def get_lease(self, operation_id: str) -> LeaseRecord | None:
        record: LeaseRecord | None = self._read_record("leases", operation_id)
        return record

    def get_disposition(self, operation_id: str) -> DispositionRecord | None:
        record: DispositionRecord | None = self._read_record("dispositions", operation_id)
        return record
