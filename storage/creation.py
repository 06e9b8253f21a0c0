"""A store another process is creating right now: wait for it, never call it damaged.

LMDB creates a store's ``lock.mdb`` first, then ``data.mdb``, then writes its two meta
pages, holding a POSIX record lock on the lock file's first byte all the while (and a
shared one for as long as it keeps the store open). A process opening the store in
between sees a lock file next to a missing, empty or meta-less data file: what a store
whose data was lost looks like, which ``integrity.check_data_file`` refuses
(``UnfinishedDataFile``, a ``StoreDamaged``). What tells them apart is the lock:
:func:`check_data_file_settled` asks whether another process holds one on ``lock.mdb``.
If one does, the store is being created (or is open there), and the check is repeated
every :data:`POLL_SECONDS` for up to :data:`CREATION_WAIT_SECONDS`; past that,
``StorageUnavailable`` names the process that did not finish. With no holder the damage
is real and ``StoreDamaged`` stands. (``batch --workers`` starts its workers on one new
store at once: before this, one of them could refuse it as damaged.)
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from typing import Final

from recoverable.errors import StorageUnavailable
from recoverable.storage import integrity

__all__ = ["CREATION_WAIT_SECONDS", "check_data_file_settled", "lock_holder"]

CREATION_WAIT_SECONDS: Final = 5.0
POLL_SECONDS: Final = 0.01
# struct flock (Linux, 64-bit): l_type, l_whence (short), l_start, l_len (off_t), l_pid.
_FLOCK: Final = struct.Struct("@hhqqi4x")


def lock_holder(path: str) -> int | None:
    """The pid of another process holding a POSIX record lock on the first byte of the
    store's ``lock.mdb`` (None: nobody, or no lock file). Asks the kernel (``F_GETLK``),
    takes nothing. Called only before this process opens the store: closing a descriptor
    of the file drops this process's own record locks on it, and it has none yet."""
    try:
        fd = os.open(os.path.join(path, integrity.LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        answer = fcntl.fcntl(
            fd, fcntl.F_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
        )
    except OSError:
        return None
    finally:
        os.close(fd)
    kind, _whence, _start, _length, pid = _FLOCK.unpack(answer)
    return None if kind == fcntl.F_UNLCK else pid


def check_data_file_settled(path: str) -> None:
    """``integrity.check_data_file``, waiting out a creation in progress (see the module
    doc)."""
    deadline = time.monotonic() + CREATION_WAIT_SECONDS
    while True:
        try:
            integrity.check_data_file(path)
            return
        except integrity.UnfinishedDataFile:
            holder = lock_holder(path)
            if holder is None:
                raise
            if time.monotonic() >= deadline:
                raise StorageUnavailable(
                    f"the store at {path} is being created or used by another process "
                    f"(pid {holder}), and its data file was still not ready after "
                    f"{CREATION_WAIT_SECONDS:g} s; try again once that process has opened "
                    f"the store (if it never does, the store's data was lost)"
                ) from None
        time.sleep(POLL_SECONDS)
