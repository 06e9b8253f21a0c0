"""The rows of the ``governor`` table: the shared rate-governor state of one endpoint and
account (``actors/governor.py`` reads and writes them; ``check_integrity`` checks them).

A row is advisory state, not budget: an unreadable one is read as a fresh row (and
reported by ``check_integrity``).
"""

from __future__ import annotations

from typing import Final

import msgspec

from recoverable.storage.keys import HASH_BYTES, governor_key

__all__ = [
    "GOVERNOR_VERSION",
    "GovernorRecord",
    "check_governor_entry",
    "decode_governor",
    "encode_governor",
    "governor_key",
    "load_governor",
]

GOVERNOR_VERSION: Final = 1


class GovernorRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The shared state of one endpoint+account (wall-clock seconds; levels in requests
    or tokens, ``None``: never claimed, i.e. full)."""

    version: int = GOVERNOR_VERSION
    paused_until: float = 0.0
    requests_level: float | None = None
    requests_at: float = 0.0
    tokens_level: float | None = None
    tokens_at: float = 0.0


encode_governor: Final = msgspec.msgpack.Encoder(order="deterministic").encode
decode_governor: Final = msgspec.msgpack.Decoder(GovernorRecord).decode


def load_governor(raw: bytes | None) -> GovernorRecord:
    """The stored row, or a fresh one if it is missing or unreadable (advisory state)."""
    if raw is None:
        return GovernorRecord()
    try:
        record = decode_governor(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return GovernorRecord()  # advisory state: a damaged row starts afresh
    if record.version != GOVERNOR_VERSION:
        return GovernorRecord()
    return record


def check_governor_entry(key: bytes, raw: bytes) -> str | None:
    """For ``RecoveryStore.check_integrity``: a description of a bad row, or None."""
    if len(key) != HASH_BYTES:
        return "malformed governor key"
    try:
        record = decode_governor(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return f"corrupt_record: {exc}"
    if record.version != GOVERNOR_VERSION:
        return f"unsupported_record_version: governor version {record.version}"
    return None
