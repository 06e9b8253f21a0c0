"""The checks every entry point of the runtime makes, each said once.

``require_signed_in``: the runtime is bound to an account (``require_bound``: it was
ever given one). ``require_owner``: an
operation (or its disposition marker) belongs to the runtime's account — the one
owner check. ``check_disposition``: an acknowledged or abandoned operation is gone.
They read through any view that has ``get_disposition`` (the store, or a write
transaction), so the same check runs as a pre-check and inside a write.
"""

from __future__ import annotations

import datetime
from typing import Any, Protocol

from recoverable import errors
from recoverable.records import DispositionRecord
from recoverable.types import AccountBinding


class DispositionView(Protocol):
    def get_disposition(self, operation_id: str) -> DispositionRecord | None: ...


def require_signed_in(account: AccountBinding | None, doing: str) -> AccountBinding:
    """The runtime's account, or ``AccountChanged`` when it is signed out."""
    if account is None:
        raise errors.AccountChanged(f"signed out: {doing}")
    return account


def require_bound(account: AccountBinding | None, *, signed_out: bool) -> None:
    """``AccountRequired`` when the runtime has no account and never had one (opened with
    ``account=None``, never signed in); a signed-out runtime is left to
    ``require_signed_in`` (``AccountChanged``)."""
    if account is None and not signed_out:
        raise errors.AccountRequired()


def check_expires_at(expires_at: Any) -> float | None:
    """``expires_at`` (None or a timezone-aware ``datetime``) as a timestamp, or
    ``InvalidParameter`` before anything is saved or sent."""
    if expires_at is None:
        return None
    if not isinstance(expires_at, datetime.datetime):
        raise errors.InvalidParameter(
            f"expires_at must be a timezone-aware datetime.datetime or None, "
            f"got {type(expires_at).__name__}", parameter="expires_at")
    if expires_at.tzinfo is None or expires_at.utcoffset() is None:
        raise errors.InvalidParameter(
            "expires_at must be timezone-aware (for example datetime.now(UTC) + "
            "timedelta(hours=1))", parameter="expires_at")
    return expires_at.timestamp()


def require_owner(
    account: AccountBinding | None, owner: AccountBinding, operation_id: str
) -> None:
    """The one owner check: ``owner`` (an operation's account) is the runtime's account."""
    if account is None:
        raise errors.AccountChanged("signed out", operation_id=operation_id)
    if owner != account:
        raise errors.AccountChanged(
            "the operation belongs to another account", operation_id=operation_id
        )


def check_disposition(view: DispositionView, operation_id: str) -> None:
    """An acknowledged or abandoned operation cannot be run, retried or commanded."""
    disposition = view.get_disposition(operation_id)
    if disposition is not None:
        raise errors.StateUnavailable(
            f"operation is {disposition.disposition}", operation_id=operation_id
        )
