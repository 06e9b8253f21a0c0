"""Operation leases that vanish with their owner, and generation fences.

Each opened store is an *owner*: it holds an exclusive ``flock`` on
``<store>/owners/<owner_id>.lock`` for its whole life. The kernel drops that lock
when the process dies (SIGKILL included), so a lease row naming the owner is live
only while the lock is held — no timeout. Within the owning process, a lease is
live only while its per-acquisition token is in the store's in-memory set (two
tasks of one process are told apart).

The lock file is created under a temporary name, locked, and only then renamed
into place: a visible ``*.lock`` file is always already locked by its creator,
so a cleaner that finds one lockable knows its owner is dead and may delete it.

Every acquisition increments the operation record's ``fence``; writes made on
behalf of a lease use ``put_operation(..., expect_fence=lease.fence)`` and so fail
with ``FenceMismatch`` once a newer owner has taken over.

A lease may also carry ``expires_at`` (wall-clock seconds, the clock every process
shares): it is then live only while its owner lock is held AND ``now < expires_at``,
so an owner that is alive but hung (SIGSTOP, a stuck host) stops holding it once it
stops renewing (``renew_leases``). The lock stays the fast path: a dead owner's lease
is free at once, whatever its expiry. A lease without ``expires_at`` (rows written by
older code, or an acquisition without ``lease_seconds``) lives as long as its owner.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Iterable
from typing import Final

import msgspec

from recoverable.errors import InvalidRequest, OperationBusy, StateUnavailable
from recoverable.records import LeaseRecord, OperationRecord
from recoverable.storage.base import RecordReader, WriteTransaction

__all__ = [
    "LeaseTokens",
    "OwnerLock",
    "acquire_lease",
    "lease_blocks",
    "lease_expired",
    "release_lease",
    "renew_leases",
    "unexpired_derivative",
]

_OWNER_ID: Final = re.compile(r"[0-9a-f]{32}")
_TMP_PREFIX: Final = ".tmp-"


class OwnerLock:
    """This process's exclusive lock file for one store directory."""

    def __init__(self, owners_dir: str, owner_id: str, fd: int) -> None:
        self.owners_dir = owners_dir
        self.owner_id = owner_id
        self._fd: int | None = fd

    @property
    def path(self) -> str:
        return os.path.join(self.owners_dir, f"{self.owner_id}.lock")

    @classmethod
    def create(cls, owners_dir: str, note: bytes = b"") -> OwnerLock:
        """Create, lock and publish a new owner lock; remove the dead owners' files.

        ``note`` is written into the file before it is published (the store records
        the identity of the LMDB lock file this owner uses, see ``integrity``).
        """
        os.makedirs(owners_dir, mode=0o700, exist_ok=True)
        os.chmod(owners_dir, 0o700)
        while True:
            owner_id = secrets.token_hex(16)
            tmp = os.path.join(owners_dir, f"{_TMP_PREFIX}{owner_id}")
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX)
                if note:
                    os.write(fd, note)
                os.rename(tmp, os.path.join(owners_dir, f"{owner_id}.lock"))
            except FileNotFoundError:
                # A cleaner removed the temporary file before we locked it: try again.
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            lock = cls(owners_dir, owner_id, fd)
            clean_dead_owners(owners_dir, keep=owner_id)
            return lock

    def release(self) -> None:
        """Unlink while still locked, then close (which drops the lock)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None

    @staticmethod
    def is_held(owners_dir: str, owner_id: str) -> bool:
        """Whether ``owner_id``'s lock file exists and is locked by a living process."""
        if not _OWNER_ID.fullmatch(owner_id):
            return False  # never a name any owner could hold (and never a path to follow)
        try:
            fd = os.open(os.path.join(owners_dir, f"{owner_id}.lock"), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            raise
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        finally:
            os.close(fd)


class LeaseTokens:
    """The lease acquisitions of one owner that are active now (their tokens), and so the
    liveness of any lease: ours while its token is held here, another owner's while that
    owner's lock file is locked by a living process.

    Shared by the owner's tasks and its writer thread (a lock guards the set).
    """

    def __init__(self, owner: OwnerLock) -> None:
        self._owner = owner
        self._active: set[str] = set()
        self._lock = threading.Lock()

    def add(self, token: str) -> None:
        with self._lock:
            self._active.add(token)

    def discard(self, token: str) -> None:
        with self._lock:
            self._active.discard(token)

    def clear(self) -> None:
        with self._lock:
            self._active.clear()

    def is_live(self, lease: LeaseRecord, now: float | None = None) -> bool:
        """Not expired at ``now`` (None: the wall clock, ``time.time()``), and held by one
        of this owner's active acquisitions or by a living other owner."""
        if lease_expired(lease, now):
            return False
        if lease.owner_id == self._owner.owner_id:
            with self._lock:
                return lease.token in self._active
        return OwnerLock.is_held(self._owner.owners_dir, lease.owner_id)


def clean_dead_owners(owners_dir: str, *, keep: str) -> list[str]:
    """Delete lock files (and abandoned temporary files) nobody holds. Returns their names."""
    removed: list[str] = []
    try:
        names = os.listdir(owners_dir)
    except OSError:
        return removed
    for name in names:
        if name in (f"{keep}.lock", f"{_TMP_PREFIX}{keep}"):
            continue
        if not (name.endswith(".lock") or name.startswith(_TMP_PREFIX)):
            continue
        path = os.path.join(owners_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # held: a living owner
        try:
            os.unlink(path)  # still locked by us, so no owner can be using it
            removed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def lease_expired(lease: LeaseRecord, now: float | None = None) -> bool:
    """Whether ``lease`` has an expiry and ``now`` (None: ``time.time()``) reached it."""
    expires_at = lease.expires_at
    if expires_at is None:
        return False
    return (time.time() if now is None else now) >= expires_at


def lease_blocks(
    txn: RecordReader, lease: LeaseRecord, record: OperationRecord, now: float
) -> bool:
    """The lease still keeps the operation from a new claim at ``now``: it is live, or
    the operation is source-bound and the lease has not expired yet — a
    derivative's lease is reclaimed only once expired, even when its owner died, so no
    earlier claim's provider call (bounded by a hard timeout shorter than the lease) can
    still be running when the next one starts."""
    return txn.lease_is_live(lease, now) or unexpired_derivative(lease, record, now)


def unexpired_derivative(lease: LeaseRecord, record: OperationRecord, now: float) -> bool:
    """``record`` is source-bound and ``lease`` has not reached its expiry at ``now``."""
    return record.source is not None and lease.expires_at is not None and not lease_expired(
        lease, now
    )


def _check_lease_seconds(lease_seconds: float) -> None:
    if (
        not isinstance(lease_seconds, int | float)
        or isinstance(lease_seconds, bool)
        or not math.isfinite(lease_seconds)
        or lease_seconds <= 0
    ):
        raise InvalidRequest("lease_seconds must be a positive, finite number of seconds")


def acquire_lease(
    txn: WriteTransaction,
    operation_id: str,
    now: float,
    *,
    lease_seconds: float | None = None,
) -> LeaseRecord:
    """Take the operation's lease for this store's owner, incrementing its fence.

    With ``lease_seconds`` the lease expires at ``now + lease_seconds`` unless renewed
    (``renew_leases``); without, it lives as long as this owner. A current lease blocks
    the acquisition while it is live at ``now`` (its owner alive and, if it has an
    expiry, ``now`` before it): an expired lease is reclaimed, with a higher fence.

    ``StateUnavailable`` if the operation record is missing, ``OperationBusy`` if
    a live lease exists (another task of this process, or a living other process).
    Unreadable records raise their typed error and are left untouched.
    """
    if lease_seconds is not None:
        _check_lease_seconds(lease_seconds)
    record = txn.get_operation(operation_id)
    if record is None:
        raise StateUnavailable("no such operation", operation_id=operation_id)
    current = txn.get_lease(operation_id)
    if current is not None and lease_blocks(txn, current, record, now):
        raise OperationBusy("the operation's lease is held", operation_id=operation_id)
    fenced = msgspec.structs.replace(record, fence=record.fence + 1)
    txn.put_operation(fenced, expect_fence=record.fence)
    lease = LeaseRecord(
        operation_id=operation_id,
        owner_id=txn.owner_id,
        token=secrets.token_hex(16),
        fence=fenced.fence,
        acquired_at=now,
        expires_at=None if lease_seconds is None else now + lease_seconds,
    )
    txn.put_lease(lease)
    txn.register_token(lease.token)
    return lease


def renew_leases(
    txn: WriteTransaction,
    leases: Iterable[LeaseRecord],
    now: float,
    lease_seconds: float,
) -> tuple[list[LeaseRecord], list[LeaseRecord]]:
    """Renew many of this owner's leases in one transaction: ``(renewed, lost)``.

    Each lease is renewed (its ``expires_at`` moved to ``now + lease_seconds``) only if
    it is still current: the stored lease row is this owner's with the same token and
    fence, and the operation record's fence is still that fence. Otherwise it is *lost*
    (taken over, released, reclaimed, fenced out by a command or the sweep) and is
    returned unchanged in ``lost``; the caller stops the work it fenced. ``renewed``
    holds the new rows.

    An EXPIRED lease that is still current is renewed too: its owner was stopped or hung
    past the expiry (SIGSTOP, a blocked event loop) and nobody acted on it, since every
    claim, sweep and command that does increments the fence or removes the row in its
    own transaction, serialized with this one. Its work is safe to go on with (and what
    it received, safe to save) exactly as if it had never stopped.

    Unreadable rows raise their typed error (the whole renewal is then discarded).
    """
    _check_lease_seconds(lease_seconds)
    renewed: list[LeaseRecord] = []
    lost: list[LeaseRecord] = []
    owner_id = txn.owner_id
    expires_at = now + lease_seconds
    for lease in leases:
        current = txn.get_lease(lease.operation_id)
        if (
            current is None
            or current.token != lease.token
            or current.fence != lease.fence
            or current.owner_id != owner_id
        ):
            lost.append(lease)
            continue
        record = txn.get_operation(lease.operation_id)
        if record is None or record.fence != lease.fence:
            lost.append(lease)
            continue
        fresh = msgspec.structs.replace(current, expires_at=expires_at)
        txn.put_lease(fresh)
        renewed.append(fresh)
    return renewed, lost


def release_lease(txn: WriteTransaction, operation_id: str, token: str) -> bool:
    """Delete the lease if it is still this acquisition's; forget the token either way."""
    txn.unregister_token(token)
    current = txn.get_lease(operation_id)
    if current is None or current.token != token:
        return False
    return txn.delete_lease(operation_id)
