"""How the command line ends: its exit codes, and the usage error behind exit code 2."""

from __future__ import annotations

from typing import Final

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_STORE_LOST",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "UsageError",
]

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1  # a job or an operation failed (or was not found)
EXIT_USAGE: Final = 2  # a usage or input error
# A worker whose store stopped accepting this process (its PostgreSQL session ended, its
# heartbeat failed, the database is unreachable): nothing it holds is live any more, and a
# new process, which opens the store anew, can go on (``batch --workers`` replaces it).
EXIT_STORE_LOST: Final = 3
EXIT_INTERRUPTED: Final = 130
# ``recoverable worker``: its endpoint stayed unreachable past --unreachable-after (nothing
# spent; its operations stay queued). sysexits' EX_UNAVAILABLE; a batch does not replace it.
EXIT_UNAVAILABLE: Final = 69


class UsageError(Exception):
    """A bad option or argument (exit code 2)."""

    def __init__(self, message: str, *, code: str = "usage", operation_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.operation_id = operation_id
