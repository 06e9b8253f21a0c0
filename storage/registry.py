"""The process registry: one opened store per directory per process.

LMDB must not open one environment twice in a process (its locks are per process), so a
second ``RecoveryStore.open`` of the same directory returns the object already open,
reference counted: the last ``close`` closes it. Opening it again with other options is
a ``ValueError`` (two callers would disagree about the quotas).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import msgspec

from recoverable.storage.redact import redact_url

__all__ = ["OpenStores", "StoreOptions"]

Opened = TypeVar("Opened")


class StoreOptions(msgspec.Struct, frozen=True):
    max_bytes: int
    max_record_bytes: int
    initial_map_size: int | None


class _Entry(Generic[Opened]):
    def __init__(self, store: Opened, options: StoreOptions) -> None:
        self.store = store
        self.options = options
        self.references = 1


class OpenStores(Generic[Opened]):
    """The stores this process has open, by real path."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry[Opened]] = {}

    def open(
        self,
        path: str,
        options: StoreOptions,
        create: Callable[[str, StoreOptions], Opened],
    ) -> Opened:
        """The store open at ``path`` (one more reference), or ``create(path, options)``."""
        with self._lock:
            entry = self._entries.get(path)
            if entry is not None:
                if entry.options != options:
                    raise ValueError(
                        f"the store at {redact_url(path)} is already open in this process with "
                        f"different options ({entry.options} != {options})"
                    )
                entry.references += 1
                return entry.store
            store = create(path, options)
            self._entries[path] = _Entry(store, options)
            return store

    def release(self, path: str, store: Opened) -> bool:
        """Drop one reference of ``store``; ``True`` when it was the last (close it now).

        ``False`` for a store that is not (or no longer) registered: already closed.
        """
        with self._lock:
            entry = self._entries.get(path)
            if entry is None or entry.store is not store:
                return False
            entry.references -= 1
            if entry.references > 0:
                return False
            del self._entries[path]
            return True
