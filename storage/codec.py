"""Deterministic, strict encoding of persisted records.

Records are msgpack maps (``msgspec.msgpack`` with ``order="deterministic"``, so
sets such as ``RetryPolicy.retryable_statuses`` always encode in the same order:
the same record gives the same bytes in every process).

Decoding reads ``version`` first. The current version is decoded strictly
(unknown fields, wrong types, non-finite junk -> ``CorruptRecord``). Any other
version is ``UnsupportedRecordVersion`` unless an upgrader was registered for it
(operations only: the later V1 migration registers a ``bytes -> OperationRecord``
function with :func:`register_operation_upgrader`). Unreadable records are never
rewritten or deleted by the store's write helpers; the store lists them by id.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Final, TypeVar

import msgspec

from recoverable.errors import CorruptRecord, UnsupportedRecordVersion
from recoverable.records import (
    COMMAND_VERSION,
    DISPOSITION_VERSION,
    LEASE_VERSION,
    OPERATION_VERSION,
    CommandRecord,
    DispositionRecord,
    LeaseRecord,
    OperationRecord,
)

__all__ = [
    "AnyRecord",
    "OperationUpgrader",
    "decode_command",
    "decode_disposition",
    "decode_lease",
    "decode_operation",
    "encode",
    "read_version",
    "register_operation_upgrader",
    "unregister_operation_upgrader",
]

AnyRecord = OperationRecord | CommandRecord | LeaseRecord | DispositionRecord
OperationUpgrader = Callable[[bytes], OperationRecord]

_Row = TypeVar("_Row", OperationRecord, CommandRecord, LeaseRecord, DispositionRecord)


class _Versioned(msgspec.Struct):
    """Only the ``version`` field; every other field is ignored at this step."""

    version: int


_encoder: Final = msgspec.msgpack.Encoder(order="deterministic")
_version_decoder: Final = msgspec.msgpack.Decoder(_Versioned)
_decoders: Final[dict[type[Any], msgspec.msgpack.Decoder[Any]]] = {
    OperationRecord: msgspec.msgpack.Decoder(OperationRecord),
    CommandRecord: msgspec.msgpack.Decoder(CommandRecord),
    LeaseRecord: msgspec.msgpack.Decoder(LeaseRecord),
    DispositionRecord: msgspec.msgpack.Decoder(DispositionRecord),
}
_current_versions: Final[dict[type[Any], int]] = {
    OperationRecord: OPERATION_VERSION,
    CommandRecord: COMMAND_VERSION,
    LeaseRecord: LEASE_VERSION,
    DispositionRecord: DISPOSITION_VERSION,
}

_upgraders_lock = threading.Lock()
_operation_upgraders: dict[int, OperationUpgrader] = {}


def encode(record: AnyRecord) -> bytes:
    """Encode a record; equal records always give equal bytes."""
    expected = _current_versions[type(record)]
    if record.version != expected:
        # Only the current version is ever written: an old or future version would
        # be unreadable (or misread) the next time it is loaded.
        raise ValueError(
            f"cannot write a {type(record).__name__} with version {record.version} "
            f"(this library writes version {expected})"
        )
    return _encoder.encode(record)


def read_version(data: bytes) -> int:
    """The ``version`` of an encoded record, or ``CorruptRecord``."""
    try:
        return _version_decoder.decode(data).version
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise CorruptRecord("record has no readable version field") from exc


def register_operation_upgrader(version: int, fn: OperationUpgrader) -> None:
    """Let operation records of an older ``version`` be read through ``fn``.

    ``fn`` receives the stored bytes and returns a current ``OperationRecord``; any
    exception it raises (or a wrong return type) makes the record ``CorruptRecord``.
    """
    if version == OPERATION_VERSION:
        raise ValueError("the current operation version is decoded directly")
    with _upgraders_lock:
        _operation_upgraders[version] = fn


def unregister_operation_upgrader(version: int) -> None:
    with _upgraders_lock:
        _operation_upgraders.pop(version, None)


def _decode_current(data: bytes, type_: type[_Row], op_hint: str | None) -> _Row:
    try:
        record: _Row = _decoders[type_].decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise CorruptRecord(
            f"{type_.__name__} failed strict decoding: {exc}", operation_id=op_hint
        ) from exc
    return _check_key(record, op_hint)


def _check_key(record: _Row, op_hint: str | None) -> _Row:
    """A record stored under another operation's key is corrupt, however well it decodes."""
    if op_hint is not None and record.operation_id != op_hint:
        raise CorruptRecord(
            f"the {type(record).__name__} stored under this key names another operation",
            operation_id=op_hint,
        )
    return record


def decode_operation(data: bytes, *, operation_id: str | None = None) -> OperationRecord:
    """Strictly decode an operation record (through a registered upgrader if old)."""
    version = _version_of(data, operation_id)
    if version == OPERATION_VERSION:
        return _decode_current(data, OperationRecord, operation_id)
    with _upgraders_lock:
        upgrader = _operation_upgraders.get(version)
    if upgrader is None:
        raise UnsupportedRecordVersion(
            f"operation record version {version} is not supported", operation_id=operation_id
        )
    try:
        record = upgrader(data)
    except Exception as exc:
        raise CorruptRecord(
            f"operation record version {version} could not be upgraded: {exc}",
            operation_id=operation_id,
        ) from exc
    if not isinstance(record, OperationRecord):
        raise CorruptRecord(
            f"upgrader for version {version} returned {type(record).__name__}",
            operation_id=operation_id,
        )
    return _check_key(record, operation_id)


def decode_command(data: bytes, *, operation_id: str | None = None) -> CommandRecord:
    return _decode_simple(data, CommandRecord, operation_id)


def decode_lease(data: bytes, *, operation_id: str | None = None) -> LeaseRecord:
    return _decode_simple(data, LeaseRecord, operation_id)


def decode_disposition(data: bytes, *, operation_id: str | None = None) -> DispositionRecord:
    return _decode_simple(data, DispositionRecord, operation_id)


def _version_of(data: bytes, operation_id: str | None) -> int:
    try:
        return read_version(data)
    except CorruptRecord as exc:
        exc.operation_id = operation_id
        raise


def _decode_simple(data: bytes, type_: type[_Row], operation_id: str | None) -> _Row:
    version = _version_of(data, operation_id)
    if version != _current_versions[type_]:
        raise UnsupportedRecordVersion(
            f"{type_.__name__} version {version} is not supported", operation_id=operation_id
        )
    return _decode_current(data, type_, operation_id)
