"""How the LMDB store spells its keys and index entries (pure functions, no I/O).

- ``operations``, ``commands``, ``leases``, ``dispositions``: the operation id (UTF-8)
- ``payloads``: operation id + ``b"\\0"`` + kind
- ``hosts``: h(account) + h(scope) + h(job_id) + operation id (every readable operation)
- ``governor``: h("governor", endpoint, account) (no account identifier in a key)
- ``schedule``: retired (an older store's ``sortable(next_attempt_at) + operation id``
  rows are dropped when the store is opened; see ``RecoveryStore``)
- ``sources``: ``b"m" + key`` → the manifest's current digest of a source key;
  ``b"b" + h(key) + operation id`` → ``b""`` (the operations bound to a source key)
- ``meta``: ``format_version``, ``bytes_used``, ``command_serial`` (8-byte big-endian)

``h`` is a fixed-size digest of tagged, length-prefixed parts (``None`` differs from ``""``).
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Final, get_args

from recoverable.errors import InvalidRequest
from recoverable.records import CommandKind, DispositionRecord, OperationRecord, PayloadKind
from recoverable.types import AccountBinding

__all__ = [
    "COMMAND_KINDS",
    "HASH_BYTES",
    "META_BYTES",
    "META_FORMAT",
    "META_SERIAL",
    "PAYLOAD_KINDS",
    "SOURCE_BOUND",
    "check_next_attempt_at",
    "governor_key",
    "hosts_account_prefix",
    "hosts_key",
    "hosts_prefix",
    "key_str",
    "marker_hosts_key",
    "operation_key",
    "payload_key",
    "source_bound_prefix",
    "source_key",
    "str_operation_key",
    "u64",
]

PAYLOAD_KINDS: Final[frozenset[str]] = frozenset(get_args(PayloadKind))
COMMAND_KINDS: Final[frozenset[str]] = frozenset(get_args(CommandKind))

META_FORMAT: Final = b"format_version"
META_BYTES: Final = b"bytes_used"
META_SERIAL: Final = b"command_serial"
MAX_ID_BYTES: Final = 400  # keeps every key below LMDB's 511-byte limit
HASH_BYTES: Final = 16


def operation_key(operation_id: str) -> bytes:
    """The key of an operation id; ``InvalidRequest`` if it cannot be a key."""
    if not isinstance(operation_id, str) or not operation_id:
        raise InvalidRequest("operation_id must be a non-empty string")
    return _operation_key(operation_id)


@functools.lru_cache(maxsize=16384)
def _operation_key(operation_id: str) -> bytes:
    try:
        key = operation_id.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest("operation_id must be valid Unicode text") from exc
    if len(key) > MAX_ID_BYTES or b"\0" in key:
        raise InvalidRequest(
            f"operation_id must be at most {MAX_ID_BYTES} UTF-8 bytes without NUL",
            operation_id=operation_id[:64],
        )
    return key


# ``operation_key`` for a caller that already knows the id is a non-empty plain ``str``
# (the write transaction's hot read, ``storage/txn.py``): the same cached function, its
# length and NUL checks included, without the Python frame of ``operation_key``.
str_operation_key: Final = _operation_key


def payload_key(operation_id: str, kind: str) -> bytes:
    if kind not in PAYLOAD_KINDS:
        raise InvalidRequest(f"unknown payload kind {kind!r}", operation_id=operation_id)
    return operation_key(operation_id) + b"\0" + kind.encode()


def check_next_attempt_at(record: OperationRecord) -> None:
    """A waiting record's ``next_attempt_at`` must be a finite number (``InvalidRequest``)."""
    when = record.next_attempt_at
    if record.phase == "waiting" and when is not None and (
        not isinstance(when, float | int) or not math.isfinite(when)
    ):
        raise InvalidRequest(f"next_attempt_at must be a finite number, not {when!r}")


@functools.lru_cache(maxsize=16384)
def _digest(*parts: str | None) -> bytes:
    digest = hashlib.blake2b(digest_size=HASH_BYTES)
    for part in parts:
        if part is None:
            digest.update(b"\0")
        else:
            data = part.encode("utf-8", "surrogatepass")
            digest.update(b"\1" + len(data).to_bytes(8, "big") + data)
    return digest.digest()


def hosts_account_prefix(account: AccountBinding) -> bytes:
    """The prefix of every index entry of one account (then the scope, the job id and
    the operation id: :func:`hosts_prefix`)."""
    return _digest(account.account_id, account.source)


def hosts_prefix(
    account: AccountBinding, scope: str | None, job_id: str | None = None, *, with_job: bool
) -> bytes:
    prefix = hosts_account_prefix(account) + _digest(scope)
    return prefix + _digest(job_id) if with_job else prefix


def marker_hosts_key(marker: DispositionRecord) -> bytes:
    """The job index entry an acknowledged or abandoned operation keeps (its marker's
    account, scope and job id): a duplicate of its job finds it (``AlreadyAcknowledged``)."""
    return hosts_prefix(
        marker.account, marker.scope, marker.job_id, with_job=True
    ) + operation_key(marker.operation_id)


def hosts_key(record: OperationRecord) -> bytes:
    return hosts_prefix(
        record.account, record.scope, record.job_id, with_job=True
    ) + operation_key(record.operation_id)


def source_key(key: str) -> bytes:
    """The manifest row of a source key (its UTF-8 bytes are bounded at the API)."""
    return b"m" + key.encode("utf-8")


SOURCE_BOUND: Final = b"b"  # the sources table's bindings (b"m": the manifest rows)


def source_bound_prefix(key: str) -> bytes:
    """The prefix of the index entries of the operations bound to a source key."""
    return SOURCE_BOUND + _digest("source", key)


def governor_key(endpoint_id: str, account: AccountBinding) -> bytes:
    """The key of the shared rate-governor row of one endpoint and account (a digest:
    no account identifier is stored in a key)."""
    return _digest("governor", endpoint_id, account.account_id, account.source)


def key_str(raw: bytes) -> str:
    """A stored key back to text (bytes that are not UTF-8 survive as surrogates)."""
    return raw.decode("utf-8", "surrogateescape")


def u64(value: bytes | None) -> int:
    """An 8-byte big-endian counter of the ``meta`` table (missing: 0)."""
    return 0 if value is None else int.from_bytes(value, "big")
