"""LISTEN/NOTIFY for Trio: wake a lifecycle monitor when any process commits a command.

psycopg's async API is asyncio-only, so it is not used: the listener owns one sync
autocommit connection that has run ``LISTEN recoverable``, and waits for it from Trio with
``trio.lowlevel.wait_readable(conn.fileno())``; once the socket is readable,
``conn.notifies(timeout=0)`` reads what arrived without blocking. The writer of every
process sends ``NOTIFY recoverable`` in the transaction that writes a command or a queue
row, so the notification arrives once that commit is visible.

A notification can be lost (the connection drops, the server restarts): the monitor
also polls the store's commit counter every ``fallback`` seconds (bounded poll), and a
listener that finds its connection gone says "woken" so the monitor scans at once, then
reconnects (in a thread: a connect blocks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import psycopg
import trio

from recoverable.errors import StorageUnavailable

__all__ = ["CHANNEL", "CommitListener"]

CHANNEL: Final = "recoverable"


class CommitListener:
    """One monitor's LISTEN connection (use as an async context manager)."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], fallback: float) -> None:
        self._connect = connect
        self.fallback = fallback  # the monitor's bounded poll while nothing is notified
        self._conn: psycopg.Connection[Any] | None = None
        self.notifications = 0
        self.reconnects = 0

    async def __aenter__(self) -> CommitListener:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._close()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                trio.lowlevel.notify_closing(conn.fileno())  # nobody waits on it any more
            except psycopg.Error:
                pass  # no socket left
            conn.close()

    def _open(self) -> psycopg.Connection[Any]:
        conn = self._connect()
        try:
            conn.execute(f"LISTEN {CHANNEL}")
        except psycopg.Error:
            conn.close()
            raise
        return conn

    async def wait(self) -> bool:
        """Until a notification (True) or ``fallback`` seconds (False). True as well when
        the connection was (re)opened: what was sent meanwhile is not known."""
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                self._close()
                self.reconnects += 1
            try:
                self._conn = await trio.to_thread.run_sync(self._open)
            except (psycopg.Error, StorageUnavailable):
                await trio.sleep(self.fallback)  # the poll goes on while the database is away
            return True
        with trio.move_on_after(self.fallback):
            while True:
                await trio.lowlevel.wait_readable(conn.fileno())
                try:
                    received = sum(1 for _ in conn.notifies(timeout=0))
                except psycopg.Error:
                    self._close()
                    return True
                if received:
                    self.notifications += received
                    return True
        return False
