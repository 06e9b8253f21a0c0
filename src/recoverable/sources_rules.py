"""The rules of source-bound (derivative) operations (docs/sources.md). Pure; no I/O.

An operation prepared with ``source=SourceRef(key, digest)`` derives its result from a
source at a digest. The store's source manifest (key → current digest) says which digest
is current; the storage side (``storage/sources.py``) applies these rules in the same
transaction as the write they guard:

- a receipt is saved only while the manifest holds the bound digest
  (:func:`receipt_refusal`); otherwise the operation becomes ``superseded`` and the
  completion is discarded;
- a manifest change (a new digest, or deletion) supersedes every operation bound to the
  old digest that is not finished or holds an unacknowledged receipt
  (:func:`needs_superseding`, :func:`supersede`);
- an attempt's hard timeout must be shorter than the lease (:func:`check_attempt_timeout`),
  so a provider call can never outlive the claim that authorized it.
"""

from __future__ import annotations

import math
import re
from typing import Final

from recoverable import errors
from recoverable.records import OperationRecord
from recoverable.transitions import close_in_flight, evolve
from recoverable.types import SourceRef, SupersededReason

__all__ = [
    "MAX_SOURCE_DIGEST_CHARS",
    "MAX_SOURCE_KEY_CHARS",
    "check_attempt_timeout",
    "check_digest",
    "check_source",
    "check_source_key",
    "default_attempt_timeout",
    "needs_superseding",
    "receipt_refusal",
    "supersede",
    "superseded_error",
]

MAX_SOURCE_KEY_CHARS: Final = 256
MAX_SOURCE_DIGEST_CHARS: Final = 128
# Printable text without control characters (a key is also a store key: no NUL).
_KEY = re.compile(rf"[^\x00-\x1f\x7f]{{1,{MAX_SOURCE_KEY_CHARS}}}")
# A digest is a token: printable ASCII without spaces ("sha256:…", a hex string, an etag).
_DIGEST = re.compile(rf"[\x21-\x7e]{{1,{MAX_SOURCE_DIGEST_CHARS}}}")


def check_source_key(key: object) -> str:
    """A source key: 1..256 characters and at most 256 UTF-8 bytes (it is part of a store
    key), no control characters (``InvalidParameter``)."""
    if not isinstance(key, str) or not _KEY.fullmatch(key) or _utf8_size(key) is None:
        raise errors.InvalidParameter(
            f"a source key must be 1..{MAX_SOURCE_KEY_CHARS} characters (at most "
            f"{MAX_SOURCE_KEY_CHARS} UTF-8 bytes) without control characters",
            parameter="source.key",
        )
    return key


def _utf8_size(key: str) -> int | None:
    """The UTF-8 size of ``key`` if it is at most the bound (None: too long or not text)."""
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return None
    return size if size <= MAX_SOURCE_KEY_CHARS else None


def check_digest(digest: object) -> str:
    """A source digest: 1..128 printable ASCII characters, no spaces (``InvalidParameter``)."""
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise errors.InvalidParameter(
            f"a source digest must be 1..{MAX_SOURCE_DIGEST_CHARS} printable ASCII characters "
            "without spaces",
            parameter="source.digest",
        )
    return digest


def check_source(source: object) -> SourceRef | None:
    """``prepare``'s ``source=``: None, or a valid :class:`SourceRef`."""
    if source is None:
        return None
    if not isinstance(source, SourceRef):
        raise errors.InvalidParameter(
            "source must be a recoverable.SourceRef(key, digest) or None", parameter="source"
        )
    check_source_key(source.key)
    check_digest(source.digest)
    return source


def default_attempt_timeout(lease_seconds: float) -> float:
    """A source-bound attempt's hard timeout when the host names none: two thirds of the
    lease (the lease's safety margin, ``lease_seconds / 6``, still comes after it)."""
    return lease_seconds * 2 / 3


def check_attempt_timeout(
    attempt_timeout: object, *, lease_seconds: float, source: SourceRef | None
) -> float | None:
    """The hard timeout saved with the operation (seconds), checked against the lease.

    ``None`` for an operation that is not source-bound and names none (no elapsed-time
    deadline on a running generation, seed 000). A source-bound operation always has one:
    :func:`default_attempt_timeout` unless named. It must be a positive finite number
    strictly shorter than ``lease_seconds`` (``InvalidParameter``,
    ``parameter="attempt_timeout"``): a provider call must end before the claim that
    authorized it could expire and be reclaimed by another worker.
    """
    if attempt_timeout is None:
        return default_attempt_timeout(lease_seconds) if source is not None else None
    if (
        isinstance(attempt_timeout, bool)
        or not isinstance(attempt_timeout, int | float)
        or not math.isfinite(attempt_timeout)
        or attempt_timeout <= 0
    ):
        raise errors.InvalidParameter(
            "attempt_timeout must be a positive finite number of seconds",
            parameter="attempt_timeout",
        )
    if attempt_timeout >= lease_seconds:
        raise errors.InvalidParameter(
            f"attempt_timeout ({attempt_timeout:g} s) must be shorter than the lease "
            f"({lease_seconds:g} s): a provider call may not outlive its claim",
            parameter="attempt_timeout",
        )
    return float(attempt_timeout)


def receipt_refusal(record: OperationRecord, current: str | None) -> SupersededReason | None:
    """Why a completion of ``record`` may not be saved while the manifest holds ``current``
    (None: it may; also for an operation that is not source-bound)."""
    source = record.source
    if source is None:
        return None
    if current is None:
        return "source_deleted"
    return None if current == source.digest else "source_changed"


def needs_superseding(record: OperationRecord) -> bool:
    """A manifest change must supersede it: it can still produce a result (any phase
    before a terminal one), or it holds a saved receipt nobody acknowledged yet. A
    failed or cancelled operation has no result to protect; acknowledged ones are gone
    from the operations table (their disposition markers are history)."""
    if record.phase in ("failed", "cancelled", "superseded"):
        return False
    return True


def supersede(record: OperationRecord, reason: SupersededReason) -> OperationRecord:
    """The terminal ``superseded`` record: an attempt in flight is closed as interrupted
    (spent; nothing invented), no attempt is pending or scheduled, and the completion is
    gone (``completed_at=None``; the caller removes or never writes its payload)."""
    closed = close_in_flight(record, "superseded")
    return evolve(
        closed,
        phase="superseded",
        superseded_reason=reason,
        pending=None,
        next_attempt_at=None,
        completed_at=None,
        endpoint_failure=None,
    )


def superseded_error(record: OperationRecord) -> errors.OperationSuperseded:
    """The typed error a superseded record stands for."""
    reason = record.superseded_reason
    return errors.OperationSuperseded(operation_id=record.operation_id, reason=reason)
