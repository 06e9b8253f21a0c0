"""Store-wide preferences: the opt-in continuation after terminal stream failures.

One row in the ``meta`` table, ``b"preference.continuation"`` (msgpack of
:class:`ContinuationPreference`), written by ``WriteTransaction.put_preference``. A store
without the row (a store older than preferences, and every new one) reads as
**off** with the documented defaults. An unreadable row also reads as off (fail closed:
nothing starts on a preference nobody can read) and :func:`read_continuation` with
``strict=True`` raises ``CorruptRecord`` so the CLI can say so.

The preference applies to every account and scope of the store; the workers and
runtimes that dispatch continuations read it again inside each dispatch transaction, so
turning it off stops every pending continuation before its dispatch.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Protocol

import msgspec

from recoverable import continuation, errors

__all__ = [
    "CONTINUATION_KEY",
    "ContinuationPreference",
    "PreferenceReader",
    "PreferenceWriter",
    "read_continuation",
    "write_continuation",
]

CONTINUATION_NAME: Final = "continuation"
CONTINUATION_KEY: Final = b"preference." + CONTINUATION_NAME.encode()


class ContinuationPreference(msgspec.Struct, frozen=True, kw_only=True,
                             forbid_unknown_fields=True):
    """Whether failed operations whose budget went to stream failures are continued, after
    how long, and how many times per lineage (``recoverable.continuation``)."""

    version: int = 1
    enabled: bool = False
    delay_seconds: Annotated[float, msgspec.Meta(ge=0, le=continuation.MAX_DELAY)] = (
        continuation.DEFAULT_DELAY
    )
    budget: Annotated[int, msgspec.Meta(ge=0, le=continuation.MAX_BUDGET)] = (
        continuation.DEFAULT_BUDGET
    )


OFF: Final = ContinuationPreference()

_encode = msgspec.msgpack.Encoder(order="deterministic").encode
_decode = msgspec.msgpack.Decoder(ContinuationPreference).decode


class PreferenceReader(Protocol):
    def get_raw(self, table: Any, key: bytes) -> bytes | None: ...


class PreferenceWriter(Protocol):
    def get_raw(self, table: Any, key: bytes) -> bytes | None: ...
    def put_preference(self, name: str, value: bytes) -> None: ...


def read_continuation(reader: PreferenceReader, *, strict: bool = False) -> ContinuationPreference:
    """The store's continuation preference (off when absent; off or ``CorruptRecord``
    when unreadable)."""
    raw = reader.get_raw("meta", CONTINUATION_KEY)
    if raw is None:
        return OFF
    try:
        preference = _decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        if strict:
            raise errors.CorruptRecord("the continuation preference is unreadable") from exc
        return OFF
    if preference.version != 1:
        if strict:
            raise errors.UnsupportedRecordVersion(
                f"continuation preference version {preference.version}"
            )
        return OFF
    return preference


def write_continuation(
    writer: PreferenceWriter,
    *,
    enabled: bool | None = None,
    delay_seconds: float | None = None,
    budget: int | None = None,
) -> ContinuationPreference:
    """Change the given fields of the preference (the others keep their stored value)."""
    current = read_continuation(writer)
    fields: dict[str, object] = {}
    if enabled is not None:
        if not isinstance(enabled, bool):
            raise errors.InvalidRequest("continuation.enabled must be true or false")
        fields["enabled"] = enabled
    if delay_seconds is not None:
        if (isinstance(delay_seconds, bool) or not isinstance(delay_seconds, int | float)
                or not 0 <= delay_seconds <= continuation.MAX_DELAY):
            raise errors.InvalidRequest(
                f"continuation.delay_seconds must be in 0..{continuation.MAX_DELAY:.0f}"
            )
        fields["delay_seconds"] = float(delay_seconds)
    if budget is not None:
        if (isinstance(budget, bool) or not isinstance(budget, int)
                or not 0 <= budget <= continuation.MAX_BUDGET):
            raise errors.InvalidRequest(
                f"continuation.budget must be an integer in 0..{continuation.MAX_BUDGET}"
            )
        fields["budget"] = budget
    updated = msgspec.structs.replace(current, **fields)
    writer.put_preference(CONTINUATION_NAME, _encode(updated))
    return updated
