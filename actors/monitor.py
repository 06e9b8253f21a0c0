"""The LifecycleMonitor: one watcher per runtime for the store's command table.

``suspend``/``cancel`` may be written by any process on the same store. Each
running operation registers a :class:`Watch` holding the cancel scope around
its host callback, transport stream and timer waits. The monitor polls LMDB's
``last_txnid`` (about a microsecond) every few milliseconds, reads the (small)
command table only when another transaction committed, and cancels the scope
of any watched operation with a command newer than its watch's baseline.
Commands written by this process are delivered directly, without polling.
A store that can push commits (the PostgreSQL store's ``commit_listener``: LISTEN/NOTIFY)
wakes the monitor instead; its bounded poll (a quarter second) covers a lost notification.

The runtime's account is not a stored command: ``sign_out``/``sign_in`` call
:meth:`LifecycleMonitor.account_changed`, which cancels the scope of every
watched operation of another account at once (the same path a local
``suspend``/``cancel`` takes), so its transport, cooldown wait or
authorization wait stops without waiting for a poll.
"""

from __future__ import annotations

import weakref
from typing import Any, Literal

import trio

from recoverable.errors import StorageUnavailable
from recoverable.machine import merge_command
from recoverable.records import CommandKind, CommandRecord
from recoverable.storage.base import Store as RecoveryStore
from recoverable.types import AccountBinding

AccountStop = Literal["signed_out", "account_changed"]


class Watch:
    """One running operation's registration with the monitor."""

    def __init__(
        self, operation_id: str, baseline_serial: int, account: AccountBinding | None = None
    ) -> None:
        self.operation_id = operation_id
        self.baseline_serial = baseline_serial
        self.account = account  # the operation's account (None: not known, never stopped)
        self.cancel_scope = trio.CancelScope()
        self.command: CommandKind | None = None
        self.command_serial: int | None = None
        self.account_stop: AccountStop | None = None

    def stop_for_account(self, reason: AccountStop) -> None:
        """The runtime signed out or changed account: stop this execution (kept once set)."""
        if self.account_stop is None:
            self.account_stop = reason
        self.cancel_scope.cancel()

    def deliver(self, command: CommandRecord) -> None:
        """A command from the store (any process): cut the running step if it is new."""
        if command.serial > self.baseline_serial and self.observe(command.kind, command.serial):
            self.cancel_scope.cancel()

    def observe(self, kind: CommandKind, serial: int) -> bool:
        """Note ``kind`` merged with what was seen (a cancel is never downgraded);
        False when what was seen already says more."""
        standing = merge_command(self.command, kind)
        if standing != kind:
            return False
        self.command = standing
        self.command_serial = serial
        return True

    def fresh_scope(self) -> trio.CancelScope:
        """A new scope for the next interruptible step (cancelled at once if a command is known)."""
        self.cancel_scope = trio.CancelScope()
        if self.command is not None or self.account_stop is not None:
            self.cancel_scope.cancel()
        return self.cancel_scope


# Every monitor of this process, per store: a command written here reaches them all at once.
_MONITORS: weakref.WeakKeyDictionary[RecoveryStore, weakref.WeakSet[LifecycleMonitor]] = (
    weakref.WeakKeyDictionary()
)


class LifecycleMonitor:
    def __init__(self, store: RecoveryStore, *, poll_interval: float = 0.002) -> None:
        self._store = store
        self._poll_interval = poll_interval
        self._watches: dict[str, Watch] = {}
        self.polls = 0
        self.scans = 0
        _MONITORS.setdefault(store, weakref.WeakSet()).add(self)

    def command_for(self, operation_id: str) -> CommandKind | None:
        """The lifecycle command a running operation of this runtime has observed, if any."""
        watch = self._watches.get(operation_id)
        return watch.command if watch is not None else None

    def account_stop_for(self, operation_id: str) -> AccountStop | None:
        """Why a running operation of this runtime is being stopped for its account, if so."""
        watch = self._watches.get(operation_id)
        return watch.account_stop if watch is not None else None

    def watch(
        self, operation_id: str, baseline_serial: int, account: AccountBinding | None = None
    ) -> Watch:
        watch = Watch(operation_id, baseline_serial, account)
        self._watches[operation_id] = watch
        return watch

    def account_changed(self, account: AccountBinding | None) -> int:
        """The runtime is now bound to ``account`` (None: signed out).

        Every watched operation of another account is stopped at once: its cancel
        scope is cancelled synchronously, before this returns. Returns how many.
        """
        reason: AccountStop = "signed_out" if account is None else "account_changed"
        stopped = 0
        for watch in list(self._watches.values()):
            if watch.account is not None and watch.account != account:
                watch.stop_for_account(reason)
                stopped += 1
        return stopped

    def unwatch(self, watch: Watch) -> None:
        if self._watches.get(watch.operation_id) is watch:
            del self._watches[watch.operation_id]

    def notify_local(self, command: CommandRecord) -> None:
        """Deliver a command written by this process to every monitor on the same store."""
        for monitor in list(_MONITORS.get(self._store, ())):
            watch = monitor._watches.get(command.operation_id)
            if watch is not None:
                watch.deliver(command)

    def scan(self) -> int:
        """Deliver every command; returns the id of the snapshot actually read."""
        return self._deliver(*self._store.commands_snapshot())

    def _deliver(self, txnid: int, commands: list[CommandRecord]) -> int:
        self.scans += 1
        for command in commands:
            watch = self._watches.get(command.operation_id)
            if watch is not None:
                watch.deliver(command)
        return txnid

    async def run(self) -> None:
        # A store that can push commits (PostgreSQL: LISTEN/NOTIFY, storage/pg_listen.py)
        # wakes the monitor instead of the fast poll; its listener's bounded poll stays.
        listener = getattr(self._store, "commit_listener", None)
        if listener is not None:
            await self._run_listening(listener())
            return
        try:
            last = self._store.last_txnid()
        except StorageUnavailable:
            last = -1
        while True:
            await trio.sleep(self._poll_interval)
            self.polls += 1
            if not self._watches:
                continue
            try:
                if self._store.last_txnid() != last:
                    # Remember the snapshot's own id, not last_txnid(): a reader may
                    # briefly get the previous snapshot while last_txnid() already names
                    # a newer commit; then the next poll scans again instead of missing it.
                    last = self.scan()
            except StorageUnavailable:
                # A damaged or unusable store: every operation meets the typed
                # error on its own next store access; the monitor must not end the runtime.
                continue

    async def _run_listening(self, listener: Any) -> None:
        """Scan when the listener is woken (a commit wrote a command, or its connection
        was reopened), or when the bounded poll finds another commit."""
        # Such a store's reads are round trips: they run off the event loop
        # (RecoveryStore.read_off_loop), so the streams this monitor guards go on meanwhile.
        store = self._store
        async with listener:
            try:
                last = await store.read_off_loop(store.last_txnid)
            except StorageUnavailable:
                last = -1
            while True:
                woken = await listener.wait()
                self.polls += 1
                if not self._watches:
                    continue
                try:
                    if woken or await store.read_off_loop(store.last_txnid) != last:
                        last = self._deliver(*await store.read_off_loop(store.commands_snapshot))
                except StorageUnavailable:
                    continue
