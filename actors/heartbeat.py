"""The runtime's heartbeat: it keeps the leases its executions hold alive, and stops an
execution the moment its lease is lost.

Every lease this runtime holds is registered here (:meth:`LeaseKeeper.hold`) by the
execution that took it, with the way to stop that execution. One task per runtime
(:meth:`LeaseKeeper.run`, in the runtime's supervisor nursery) renews, every
``lease_seconds / 3``, ALL of them in one store write per :data:`RENEW_CHUNK` leases
(``storage.leases.renew_leases``: the group commit), each conditional on its token and
fence still being current. A lease found
lost (taken over, fenced out) stops its execution at once, with ``LeaseLost``. A renewal
that cannot be written (the store is unavailable) is retried sooner, until a lease's
safety margin is reached: then its execution stops too.

The *safety margin* is ``lease_seconds / 6`` before ``expires_at``. An attempt's transport
runs in a cancel scope (:meth:`LeaseKeeper.transport_scope`) that only the heartbeat cuts:
when the lease is lost, or when it reaches its margin and cannot be renewed (the write
failed, or did not return within half a margin: a hung store, a busy event loop;
:meth:`LeaseKeeper.watch`). A running generation is cut only when its lease could no longer
be held (seed 000's "no elapsed-time deadline on a running generation" holds while the
owner is alive and renewing), so that before the lease expires, and another owner may
claim it, this one has stopped. Cut at the margin, the execution itself goes on: the
attempt ends as an interruption (``transport_code="lease_late"``, spent once sent) and is
replaced within the budget once the lease is renewed (``actors/send.py``); a
background response is left to be resumed by its id, as when the lease is lost.

A lease is never lost by its own live owner for being late, even with thousands of waiting
operations in one runtime. An execution with no transport running (parked until its
``next_attempt_at``, waiting for the host, writing)
whose lease passes its margin unrenewed (an event loop too busy, a slow disk) is not
stopped, nor is one whose stream was cut there: nothing it does is visible outside the
store, and every write it makes is fenced.
It stops with ``LeaseLost`` only when another owner may have taken over: a renewal found
the lease taken, fenced out or released, or a renewal begun after the lease *expired*
could not be written (a renewal still in flight past the expiry is awaited, for up to a
whole ``lease_seconds``, and one not begun yet is asked for: only a renewal's outcome tells
whether another owner claimed the operation meanwhile).
Before it starts a transport, an execution waits for its lease to be back within its
margin (:meth:`LeaseKeeper.fresh`): no generation starts on a lease that may be claimed
before the stream could be cut.

A process stopped past its expiry (SIGSTOP, an event loop blocked) and woken again is
not cut by the clock: its first beat renews what nobody claimed meanwhile (an expired
lease whose token and fence are still current: ``storage.leases.renew_leases``), and its
streams and receipts go on; what another owner claimed is lost and stopped. A transport
deadline in Trio time would fire on waking, before any renewal could run, and throw away
completions that were safe to save.

Expiry is wall-clock time (``wall_clock``, the clock every process shares); the heartbeat's
sleeps and the transport deadlines are Trio time, converted at each renewal.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final, Protocol

import trio

from recoverable import errors, machine, reattachment
from recoverable.outcome import Interruption
from recoverable.records import LeaseRecord, OperationRecord
from recoverable.storage.base import Store, WriteTransaction
from recoverable.storage.leases import renew_leases

__all__ = [
    "LEASE_SECONDS_MAX",
    "LEASE_SECONDS_MIN",
    "ExecutionLease",
    "HeldLease",
    "LeaseKeeper",
    "check_lease_seconds",
    "lease_lost_transition",
]

# Leases per renewal write: a beat of thousands is a few short writes, never one that
# holds the writer (and every write queued behind it) for a third of a second (measured:
# ~30 us a lease on LMDB, so 10,000 leases were one 300 ms write every beat).
RENEW_CHUNK: Final = 256
LEASE_SECONDS_MIN: Final = 1.0
LEASE_SECONDS_MAX: Final = 3600.0


def check_lease_seconds(value: float) -> float:
    """``value`` as a float, or ``InvalidRequest`` outside ``1..3600`` seconds."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not LEASE_SECONDS_MIN <= value <= LEASE_SECONDS_MAX
    ):
        raise errors.InvalidRequest(
            f"lease_seconds must be a number of seconds in {LEASE_SECONDS_MIN:g}.."
            f"{LEASE_SECONDS_MAX:g}"
        )
    return float(value)


class HeldLease:
    """One lease an execution of this runtime holds, as the heartbeat keeps it."""

    def __init__(self, lease: LeaseRecord, on_lost: Callable[[], None]) -> None:
        self.lease = lease
        self.lost = False
        self._on_lost = on_lost
        self.transports: list[trio.CancelScope] = []

    def cut(self) -> bool:
        """Past its margin unrenewed, not lost: cut its transport (it must end before
        another owner could claim at expiry); the execution goes on (it records the
        attempt as interrupted and replaces it once its lease is renewed). True if a
        transport was cut now (not already)."""
        fresh = [scope for scope in self.transports if not scope.cancel_called]
        for scope in fresh:
            scope.cancel()
        return bool(fresh)

    def lose(self) -> None:
        """The lease is lost: stop the execution (once), and cut its transport now."""
        if self.lost:
            return
        self.lost = True
        for scope in self.transports:
            scope.cancel()
        self._on_lost()


class LeaseKeeper:
    """The leases of one runtime, and the heartbeat task that renews them."""

    def __init__(
        self,
        store: Store,
        *,
        lease_seconds: float,
        wall_clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.lease_seconds = check_lease_seconds(lease_seconds)
        self.wall_clock = wall_clock
        self.held: dict[str, HeldLease] = {}
        self.renewal_writes = 0  # store writes made by the heartbeat (one per chunk)
        self.renewal_failures = 0  # beats whose write failed (store unavailable)
        self.lost = 0  # leases found lost (or past their margin) by the heartbeat
        self.late = 0  # times a lease without a transport passed its margin unrenewed
        self.cut = 0  # transports cut at their lease's margin, the execution going on
        self.held_back = 0  # transports that waited for their lease's renewal to start
        self._beat = trio.Event()  # set to make the heartbeat beat now (tests, shutdown)
        self._renewed = trio.Event()  # set (and replaced) after each renewal write
        self._attempted = trio.Event()  # set (and replaced) after each renewal attempt
        self._renewing_since: float | None = None  # Trio time the running renewal began
        # The wall-clock time at which the last renewal attempt that failed began (None:
        # the last attempt wrote): a lease that expired before it cannot be saved now.
        self._failed_since: float | None = None
        self._held_changed = trio.Event()  # set when a lease with an earlier margin is held
        self._watching_until = math.inf  # the margin the watch sleeps until (Trio time)

    @property
    def period(self) -> float:
        return self.lease_seconds / 3

    @property
    def margin(self) -> float:
        return self.lease_seconds / 6

    # --- registration (by the execution that took the lease) ------------------------

    def hold(self, lease: LeaseRecord, on_lost: Callable[[], None]) -> HeldLease:
        held = HeldLease(lease, on_lost)
        self.held[lease.operation_id] = held
        if self.deadline(held) < self._watching_until:
            # Only a margin earlier than the one it sleeps until wakes the watch: a scan of
            # every held lease per new lease would be quadratic in the concurrency.
            self._watching_until = -math.inf
            self._held_changed.set()
        return held

    def drop(self, held: HeldLease) -> None:
        if self.held.get(held.lease.operation_id) is held:
            del self.held[held.lease.operation_id]

    # --- the transport's hard deadline ----------------------------------------------

    def deadline(self, held: HeldLease) -> float:
        """The Trio deadline of the held lease's safety margin (``inf``: no expiry)."""
        expires_at = held.lease.expires_at
        if expires_at is None:
            return math.inf
        return trio.current_time() + (expires_at - self.margin - self.wall_clock())

    @contextmanager
    def transport_scope(self, held: HeldLease) -> Iterator[trio.CancelScope]:
        """A cancel scope for one attempt's transport, cut by the heartbeat only: when the
        lease is lost, or past its margin and not renewable (see the module docstring)."""
        scope = trio.CancelScope()
        if held.lost:
            scope.cancel()
        held.transports.append(scope)
        try:
            with scope:
                yield scope
        finally:
            held.transports.remove(scope)

    # --- the heartbeat --------------------------------------------------------------

    def beat_now(self) -> None:
        """Wake the heartbeat for an immediate renewal."""
        self._beat.set()

    async def next_renewal(self) -> None:
        """Wait until the next renewal write has committed (a barrier for tests and
        status readers; nothing waits on it to be correct)."""
        await self._renewed.wait()

    async def run(self) -> None:
        """Renew every ``period``; after a failed write, retry sooner (``period / 4``).
        Beside it, :meth:`watch` cuts what reached its margin without a renewal."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.watch)
            delay = self.period
            while True:
                with trio.move_on_after(delay):
                    await self._beat.wait()
                self._beat = trio.Event()
                delay = self.period if await self.renew() else self.period / 4

    async def watch(self) -> None:
        """Cut the executions whose lease reached its safety margin unrenewed: at the
        earliest margin, ask for a beat and give it half a margin (a store that cannot
        write in that time is hung); then a lease still at its margin is lost if its
        transport is running or it has expired, and only late otherwise (see the module
        docstring: the next renewal decides; meanwhile it is checked every half margin).
        A process woken past its margins (it was stopped) so renews before anything is
        cut."""
        while True:
            live = [held for held in self.held.values() if not held.lost]
            earliest = min((self.deadline(held) for held in live), default=math.inf)
            self._watching_until = earliest
            with trio.move_on_after(max(0.0, earliest - trio.current_time())):
                await self._held_changed.wait()  # a new lease may have an earlier margin
                self._held_changed = trio.Event()
                continue
            due = [held for held in live if self.deadline(held) <= trio.current_time()]
            if not due:
                continue
            attempted = self._attempted
            self.beat_now()
            with trio.move_on_after(self.margin / 2):
                await attempted.wait()
            for held in due:
                if held.lost or self.deadline(held) > trio.current_time():
                    continue  # renewed meanwhile (or already stopped)
                if self.held.get(held.lease.operation_id) is not held:
                    continue  # its execution let go of it meanwhile (it ended)
                self._past_margin(held)

    def _expired(self, held: HeldLease) -> bool:
        """Past its expiry, and no renewal can save it now: a renewal attempt begun after
        the expiry failed (the store cannot write), or one in flight has run for a whole
        ``lease_seconds`` (the store is taken as hung). Otherwise the next renewal's
        outcome decides, since only it tells whether another owner claimed the operation:
        one in flight (the store answers slowly: a loaded machine, a process just woken
        from a stop) is awaited, and one not begun yet (the event loop was too busy for
        the heartbeat to start it: thousands of operations in one runtime) is asked for."""
        if not self._past_expiry(held):
            return False
        since = self._renewing_since
        if since is not None:
            return trio.current_time() - since >= self.lease_seconds
        failed = self._failed_since
        expires_at = held.lease.expires_at
        return failed is not None and expires_at is not None and failed >= expires_at

    def _past_expiry(self, held: HeldLease) -> bool:
        expires_at = held.lease.expires_at
        return expires_at is not None and self.wall_clock() >= expires_at

    def _past_margin(self, held: HeldLease) -> None:
        """A lease past its margin and not renewed. Expired (and no renewal that could
        save it running): another owner may have claimed it, so its execution stops
        (``LeaseLost``). Otherwise a transport that runs before the expiry is cut (the
        stream must end before another owner could claim) and the execution goes on; one
        with no transport, or past its expiry awaiting the renewal's outcome, is late."""
        if self._expired(held):
            self.lost += 1
            held.lose()
        elif held.transports and not self._past_expiry(held):
            self.cut += held.cut()
        else:
            self.late += 1

    async def fresh(self, held: HeldLease) -> None:
        """Return once the held lease is within its margin (at once, normally), or lost:
        a transport must not start on a lease past its margin. Beats and waits for each
        renewal attempt meanwhile; bounded by the lease's expiry, when the watch stops
        an execution whose lease could not be renewed."""
        if not held.lost and self.deadline(held) <= trio.current_time():
            self.held_back += 1
        while not held.lost and self.deadline(held) <= trio.current_time():
            attempted = self._attempted
            self.beat_now()
            with trio.move_on_after(self.margin / 2):
                await attempted.wait()
            if not held.lost and self._expired(held) and (
                self.deadline(held) <= trio.current_time()
            ):
                self.lost += 1
                held.lose()

    async def renew(self) -> bool:
        """One beat: renew all held leases (one write per :data:`RENEW_CHUNK`); stop the
        lost ones.

        Returns False when a write failed (the chunks before it were renewed, the rest
        not; a lease past its margin had its stream cut, and its execution stopped if it
        expired: :meth:`_past_margin`).
        """
        self._renewing_since = trio.current_time()
        began = self.wall_clock()
        try:
            written = await self._renew_held(began)
            if written:
                self._failed_since = None
            return written
        finally:
            self._renewing_since = None
            self._attempted.set()  # the watch waits for an attempt's outcome
            self._attempted = trio.Event()

    async def _renew_held(self, began: float) -> bool:
        beating = [held for held in self.held.values() if not held.lost]
        if not beating:
            return True
        for start in range(0, len(beating), RENEW_CHUNK):
            chunk = [held for held in beating[start:start + RENEW_CHUNK] if not held.lost]
            if not chunk:
                continue
            try:
                renewed, lost = await self.store.write(
                    functools.partial(
                        _renew, [held.lease for held in chunk], self.wall_clock(),
                        self.lease_seconds,
                    )
                )
            except errors.RecoveryError:
                self.renewal_failures += 1
                self._renewing_since = None  # failed: nothing in flight can save a lease now
                self._failed_since = began
                for held in beating[start:]:
                    if not held.lost and self.deadline(held) <= trio.current_time():
                        self._past_margin(held)
                return False
            self.renewal_writes += 1
            self._apply(chunk, renewed, lost)
        self._renewed.set()
        self._renewed = trio.Event()
        return True

    def _apply(
        self, chunk: list[HeldLease], renewed: list[LeaseRecord], lost: list[LeaseRecord]
    ) -> None:
        fresh = {lease.token: lease for lease in renewed}
        for held in chunk:
            lease = fresh.get(held.lease.token)
            if lease is not None:
                held.lease = lease
        for lease in lost:
            lost_held = self.held.get(lease.operation_id)
            if lost_held is not None and lost_held.lease.token == lease.token:
                self.lost += 1
                lost_held.lose()


def _renew(
    leases: list[LeaseRecord], now: float, lease_seconds: float, txn: WriteTransaction
) -> tuple[list[LeaseRecord], list[LeaseRecord]]:
    return renew_leases(txn, leases, now, lease_seconds)


class ExecutionLease:
    """One execution's side of its lease: registered with the runtime's keeper while held,
    the cancel scope the heartbeat cancels when the lease is lost, and the transport's hard
    deadline. The actor runs its steps inside :attr:`scope`; once it is cancelled the actor
    closes an in-flight attempt honestly (:func:`lease_lost_transition`, fenced) and stops
    with ``LeaseLost``."""

    def __init__(self, keeper: LeaseKeeper) -> None:
        self.keeper = keeper
        self.scope = trio.CancelScope()
        self.held: HeldLease | None = None
        # The last transport was cut at its lease's margin, the lease late and not lost:
        # the execution records the attempt as interrupted and goes on.
        self.cut_late = False

    @property
    def lost(self) -> bool:
        return self.scope.cancel_called

    def hold(self, lease: LeaseRecord) -> None:
        self.held = self.keeper.hold(lease, self.scope.cancel)

    def drop(self) -> None:
        """The lease was released (or the execution ended): the heartbeat forgets it."""
        if self.held is not None:
            self.keeper.drop(self.held)
            self.held = None

    async def fresh(self) -> None:
        """Before a transport starts: wait until the lease is back within its margin
        (:meth:`LeaseKeeper.fresh`; at once, normally)."""
        held = self.held
        if held is not None and not held.lost:
            await self.keeper.fresh(held)

    @contextmanager
    def transport(self) -> Iterator[None]:
        """Run one attempt's transport in the scope the heartbeat cuts when the lease is
        lost (see the module docstring); the execution then stops at the next checkpoint
        (:meth:`checkpoint`)."""
        held = self.held
        self.cut_late = False
        if held is None:
            yield
            return
        with self.keeper.transport_scope(held) as scope:
            yield
        self.cut_late = scope.cancelled_caught and not held.lost

    def lose(self) -> None:
        """Stop the execution as if its lease were lost (``LeaseLost`` at the next
        checkpoint)."""
        if self.held is not None:
            self.held.lose()
        else:
            self.scope.cancel()

    async def checkpoint(self) -> None:
        """Raise the scope's cancellation now if the lease is lost (a transport was cut)."""
        if self.lost:
            await trio.lowlevel.checkpoint()


class Sent(Protocol):
    """What the actor saw of the attempt it was sending (its progress reports)."""

    progressed: bool
    response_id: str | None
    sequence_number: int | None
    background: bool | None  # ``Progress.background`` of the stream


def lease_lost_transition(
    record: OperationRecord, ctx: machine.Context, sent: Sent | None = None
) -> machine.Transition:
    """How an execution that lost its lease leaves the record: an attempt still in flight
    ends as an interruption (``transport_code="lease_lost"``: spent, no completion, usage
    or response id invented), classified like any interruption (replaceable within the
    budget); anything else stays as it is. Written fenced: refused if a newer owner exists.
    """
    last = record.attempts[-1] if record.attempts else None
    if record.phase != "transmitting" or last is None or last.outcome != "in_flight":
        return machine.Transition(record, None, False)
    kept = reattachment.lease_lost(
        record, last.attempt_id, sent.response_id if sent is not None else None,
        sent.sequence_number if sent is not None else None, ctx.now,
        sent.background if sent is not None else None,
    )
    if kept is not None:
        return kept  # reattachment: left in flight; the next owner resumes it by its id
    failure = Interruption(
        kind="interrupted",
        transport_code="lease_lost",
        response_id=sent.response_id if sent is not None else None,
        sequence_number=sent.sequence_number if sent is not None else None,
        had_output=sent is not None and sent.progressed,
    )
    return machine.attempt_failed(record, last.attempt_id, failure, ctx)
