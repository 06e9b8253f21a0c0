"""The recovery sweep: close what dead owners left behind, honestly (seed 004's
TurnRecovery in our terms).

The store is the authority; a process that ran an operation is only a projection of it
that may vanish. For every operation whose owner is gone (its lease is not live: the
owner process died, or its lease expired), in **one write transaction per operation**,
conditional on the fence the scan read:

- :func:`recoverable.machine.owner_lost` closes the attempt in flight as an interruption
  (``transport_code="owner_lost"``; no completion, usage or response id is invented) and
  leaves the operation waiting for adoption, or fails it (``owner_lost`` / ``expired``);
- the stale lease row is deleted;
- the record's fence is incremented, so the lost owner (if it is only hung and wakes up
  later) can neither checkpoint nor finish: every write it makes is fenced.

An operation whose lease is live is never touched. A second sweep changes nothing (the
rows it closed no longer hold a lease and are no longer in flight).

Unclaimed work (``actors/unclaimed.py``): a queued operation with a saved
bound (``submit(unclaimed_after=)``) that no live worker of its account and endpoint has
served for that long ends ``failed`` with ``failure_reason="no_worker"``; with
``unclaimed_after`` (``recoverable sweep --unclaimed-after S``) every runnable operation is
judged by that bound instead. An operation a live worker of its account and endpoint
could claim is never ended so, and neither is one of ``serving`` (the
account and endpoint of the runtime that sweeps as it opens).

Damage (``storage/queue_checks.py``): a full sweep also names the queue and
lease rows that would keep an unfinished operation from any worker for ever, and a
rolled-back queue serial counter (``damaged``, ``damaged_rows``); it never rewrites them.

Which operations are examined: every operation in ``authorizing`` or ``transmitting``,
every operation holding a lease row, and the runnable ones a bound applies to. The store
has no phase index, so the full sweep decodes every operation record once (one read
snapshot; ~0.2 s for 20,000 records here) and reads the queue and lease rows of the
unfinished ones in three batched reads; the writes touch only the operations that change.
``leased_only=True`` (what a runtime runs when it opens) reads only the lease table, the
queue and the records they name: every operation a dead owner was driving holds a lease
row, except one whose owner's last write failed before it released the lease; that rare
row reads as interrupted and is closed by a full sweep or when reopened.
Unreadable records (``CorruptRecord`` / ``UnsupportedRecordVersion``) are left untouched
and counted.
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable
from typing import Final, Literal

import msgspec

from recoverable import errors, machine
from recoverable.actors.unclaimed import (
    Key,
    Served,
    bound_of,
    key_of,
    mark_in,
    no_worker_at,
    reread,
)
from recoverable.preconditions import check_unclaimed_after
from recoverable.records import OperationRecord
from recoverable.storage import codec
from recoverable.storage.base import Store as RecoveryStore
from recoverable.storage.base import WriteTransaction as WriteTxn
from recoverable.storage.keys import operation_key
from recoverable.storage.leases import lease_blocks
from recoverable.storage.queue import MAX_SCAN
from recoverable.storage.queue_checks import counter_damage, find_damage
from recoverable.telemetry import Telemetry
from recoverable.transitions import FINISHED

__all__ = ["MAX_REPORT_IDS", "SweepReport", "sweep", "sweep_at_open"]

# Each id list of a report holds at most this many ids (the counts are always exact).
MAX_REPORT_IDS: Final = 1000

_IN_FLIGHT: Final = frozenset({"authorizing", "transmitting"})
_RUNNABLE: Final = frozenset({"prepared", "waiting"})

Outcome = Literal[
    "untouched", "live", "raced", "closed", "waiting", "failed", "unclaimed", "unreadable"
]


class SweepReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one sweep did (counts and bounded id lists; never prompts, outputs or keys).

    - ``examined``: readable operations looked at (in flight, holding a lease row, or
      runnable with an unclaimed bound that applies);
    - ``live``: of those, owned by a live lease: untouched;
    - ``closed``: operations the sweep wrote (a dead owner's state closed, or a stale
      lease row removed, or an unclaimed operation ended); each is also counted in
      ``waiting`` or ``failed`` when the sweep left it there;
    - ``waiting``: closed and left for adoption (``waiting``, or ``prepared`` when
      nothing was ever spent);
    - ``failed``: closed and made terminal by this sweep (``failure_reason``
      ``owner_lost``, ``expired`` or ``no_worker``);
    - ``unclaimed``: of those, ended ``no_worker`` (unclaimed);
    - ``raced``: changed by another process between the scan and the write (skipped;
      the next sweep looks again);
    - ``unreadable``: records that could not be decoded (never rewritten);
    - ``damaged``: unfinished operations whose queue or lease row is damaged (issue
      29.10: no worker would ever run them; never rewritten), and ``damaged_rows`` what
      is wrong with each such row and with the queue serial counter (full sweep only).

    The id lists name at most :data:`MAX_REPORT_IDS` operations each;
    ``ids_truncated`` says that some were left out.
    """

    examined: int = 0
    live: int = 0
    closed: int = 0
    waiting: int = 0
    failed: int = 0
    unclaimed: int = 0
    raced: int = 0
    unreadable: int = 0
    damaged: int = 0
    closed_ids: tuple[str, ...] = ()
    waiting_ids: tuple[str, ...] = ()
    failed_ids: tuple[str, ...] = ()
    unclaimed_ids: tuple[str, ...] = ()
    damaged_ids: tuple[str, ...] = ()
    damaged_rows: tuple[str, ...] = ()
    ids_truncated: bool = False

    @property
    def changed(self) -> bool:
        return self.closed > 0


_LISTED: Final = ("closed", "waiting", "failed", "unclaimed", "damaged", "damaged_rows")


class _Tally:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.ids: dict[str, list[str]] = {name: [] for name in _LISTED}
        self.truncated = False

    def add(self, name: str, operation_id: str | None = None) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1
        if operation_id is not None:
            self.name(name, operation_id)

    def name(self, name: str, text: str) -> None:
        ids = self.ids[name]
        if len(ids) < MAX_REPORT_IDS:
            ids.append(text)
        else:
            self.truncated = True

    def report(self) -> SweepReport:
        count = self.counts.get
        return SweepReport(
            examined=count("examined", 0),
            live=count("live", 0),
            closed=count("closed", 0),
            waiting=count("waiting", 0),
            failed=count("failed", 0),
            unclaimed=count("unclaimed", 0),
            raced=count("raced", 0),
            unreadable=count("unreadable", 0),
            damaged=count("damaged", 0),
            closed_ids=tuple(self.ids["closed"]),
            waiting_ids=tuple(self.ids["waiting"]),
            failed_ids=tuple(self.ids["failed"]),
            unclaimed_ids=tuple(self.ids["unclaimed"]),
            damaged_ids=tuple(self.ids["damaged"]),
            damaged_rows=tuple(self.ids["damaged_rows"]),
            ids_truncated=self.truncated,
        )


class _Bounds:
    """Which unclaimed bound applies to each runnable record (None: none): the sweep's
    own, else the saved one of a queued record; never to an account and endpoint a live
    worker serves, or that the sweeping runtime serves (``serving``), or to a damaged
    record (reported instead)."""

    def __init__(
        self, store: RecoveryStore, override: float | None, queued: Container[str],
        serving: Key | None, damaged: Iterable[str] = (),
    ) -> None:
        self.store = store
        self.override = override
        self.queued = queued
        self.serving = serving
        self.damaged = frozenset(damaged)
        self._served: Served | None = None

    @property
    def served(self) -> Served:
        """The live workers, read once, when a bound first applies."""
        if self._served is None:
            self._served = Served(self.store)
        return self._served

    def of(self, record: OperationRecord) -> float | None:
        bound = bound_of(record, self.override)
        if self.override is None and record.operation_id not in self.queued:
            return None  # a saved bound is for work submitted to workers
        key = key_of(record)
        if (bound is None or key == self.serving or record.operation_id in self.damaged
                or key in self.served):
            return None
        return bound

    def due(self, record: OperationRecord, now: float) -> bool:
        """A runnable record nobody runs whose bound has passed (worth a write)."""
        bound = self.of(record)
        at = no_worker_at(record, bound, self.served.until(key_of(record)))
        return at is not None and at <= now


def _candidates(
    records: Iterable[OperationRecord], leased: frozenset[str], bounds: _Bounds, now: float
) -> list[tuple[OperationRecord, float | None, bool]]:
    """The operations a sweep looks at, in id order (deterministic reports): each with
    the bound that applies and whether it is worth a write (in flight, leased, or due)."""
    chosen = []
    runnable = []
    for rec in records:
        if rec.awaiting_upgrade:  # a version-1 record not yet upgraded: only its migration
            continue
        if rec.phase in _IN_FLIGHT or rec.operation_id in leased:
            chosen.append((rec, bounds.of(rec), True))
        elif rec.phase in _RUNNABLE and bounds.of(rec) is not None:
            runnable.append(rec)
    if runnable:
        bounds.served.prime(key_of(rec) for rec in runnable)
    chosen += [(rec, bounds.of(rec), bounds.due(rec, now)) for rec in runnable]
    chosen.sort(key=lambda chosen: chosen[0].operation_id)
    return chosen


def _sweep_one(
    txn: WriteTxn, seen: OperationRecord, now: float, bound: float | None
) -> Outcome:
    """One operation, in one write transaction, conditional on the fence the scan read."""
    operation_id = seen.operation_id
    read = reread(txn, seen)  # "raced": claimed or removed since the scan, not ours now
    if isinstance(read, str):
        return read
    current, lease = read
    if current.awaiting_upgrade:
        return "untouched"
    # Expiry judged at the sweep's now; a source-bound operation's lease only by expiry.
    if lease is not None and lease_blocks(txn, lease, current, now):
        return "live"
    new = machine.owner_lost(current, now=now).record
    if bound is not None:
        new = machine.unclaimed(
            new, now=now, unclaimed_after=bound, served_until=mark_in(txn, current)
        ).record
    if new == current and lease is None:
        return "untouched"
    # Any write on a dead owner's behalf takes the operation from it: the fence moves, so
    # a lost owner that is only hung can never write again.
    txn.put_operation(
        msgspec.structs.replace(new, fence=current.fence + 1), expect_fence=current.fence
    )
    if lease is not None:
        txn.delete_lease(operation_id)
    if new.phase == "failed" and current.phase != "failed":
        return "unclaimed" if new.failure_reason == "no_worker" else "failed"
    if new.phase in _RUNNABLE:
        return "waiting"
    return "closed"


def _records_of(
    store: RecoveryStore, operation_ids: Iterable[str]
) -> tuple[list[OperationRecord], int]:
    """The readable records of ``operation_ids`` (one batched read), and how many were not."""
    wanted = list(dict.fromkeys(operation_ids))
    records: list[OperationRecord] = []
    unreadable = 0
    raws = store.get_raw_many("operations", [operation_key(op) for op in wanted])
    for operation_id, raw in zip(wanted, raws, strict=True):
        if raw is None:
            continue
        try:
            records.append(codec.decode_operation(raw, operation_id=operation_id))
        except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
            unreadable += 1
    return records, unreadable


def _queued_ids(store: RecoveryStore) -> list[str]:
    """Every queued operation's id, page by page (each page one snapshot)."""
    found: list[str] = []
    after = 0
    while page := store.queued(after_serial=after, limit=MAX_SCAN):
        found += [entry.operation_id for entry in page]
        after = page[-1].serial
    return found


async def sweep(
    store: RecoveryStore,
    *,
    now: float,
    unclaimed_after: float | None = None,
    leased_only: bool = False,
    serving: Key | None = None,
) -> SweepReport:
    """Close every operation whose owner is gone, end unclaimed work, report damaged queue
    and lease rows (see the module docstring).

    ``now`` is wall-clock seconds (the clock every process shares, ``Runtime.now()``).
    ``unclaimed_after`` (seconds, optional) judges every runnable operation by that bound
    instead of its saved one. ``leased_only`` examines only operations holding a lease row
    and the queued ones (cheap; not with ``unclaimed_after``; no damage report).
    ``serving`` (account id, credential source, endpoint id): the sweeping runtime's own,
    whose operations are never ended ``no_worker``. ``InvalidRequest`` for a bad
    argument; storage failures raise their typed errors (the operations already swept
    stay swept).
    """
    if unclaimed_after is not None:
        check_unclaimed_after(unclaimed_after)
    if not isinstance(now, (int, float)) or not math.isfinite(now):
        raise errors.InvalidRequest("now must be a finite wall-clock time")
    if leased_only and unclaimed_after is not None:
        raise errors.InvalidRequest("unclaimed_after needs a full sweep (leased_only=False)")
    leases, _ = store.control_rows()
    tally = _Tally()
    if leased_only:
        queued = _queued_ids(store)  # only rows a worker would see (damage is skipped)
        records, unreadable_count = _records_of(store, [*sorted(leases), *queued])
        bounds = _Bounds(store, None, frozenset(queued), serving)
    else:
        records, unreadable = store.inventory()
        unreadable_count = len(unreadable)
        unfinished = [
            rec.operation_id for rec in records
            if rec.phase not in FINISHED and not rec.has_completion
        ]
        look = find_damage(store, unfinished)
        for operation_id, damage in sorted(look.damage.items()):
            tally.add("damaged", operation_id)
            tally.name("damaged_rows", damage.describe())
        counter = counter_damage(store, look.highest_serial)
        if counter is not None:
            tally.name("damaged_rows", counter)
        bounds = _Bounds(store, unclaimed_after, look.queued, serving, look.damage)
    for _ in range(unreadable_count):
        tally.add("unreadable")
    for seen, bound, worth in _candidates(records, frozenset(leases), bounds, now):
        tally.add("examined")
        if not worth:
            continue

        def one(txn: WriteTxn, seen: OperationRecord = seen, bound: float | None = bound
                ) -> Outcome:
            return _sweep_one(txn, seen, now, bound)

        outcome = await store.write(one)
        match outcome:
            case "untouched":
                pass
            case "live" | "raced" | "unreadable":
                tally.add(outcome)
            case _:
                tally.add("closed", seen.operation_id)
                if outcome == "unclaimed":
                    tally.add("failed", seen.operation_id)
                if outcome != "closed":
                    tally.add(outcome, seen.operation_id)
    return tally.report()


async def sweep_at_open(
    store: RecoveryStore, *, now: float, telemetry: Telemetry, serving: Key | None = None
) -> SweepReport:
    """The sweep a runtime runs when it opens: the cheap one (``leased_only``), so opening
    costs a read of the lease table and of the queue, not of every record. ``serving``:
    the runtime's own account and endpoint (its operations are never ended ``no_worker``
    here: this runtime may be the worker about to run them, or their host).

    Each operation it closes is reported as ``recovery.operation.owner_lost`` (``state``:
    ``waiting`` or ``failed``), each it ends unclaimed as ``recovery.operation.no_worker``.
    A typed failure (a full or unavailable store) does not stop the runtime from opening:
    it is reported as ``recovery.sweep.failed`` (``code``) and the orphans read as
    interrupted until a later sweep or their reopening closes them.
    """
    try:
        report = await sweep(store, now=now, leased_only=True, serving=serving)
    except errors.RecoveryError as exc:
        telemetry.emit("sweep.failed", "", code=exc.code)
        return SweepReport()
    unclaimed = frozenset(report.unclaimed_ids)
    for operation_id in report.waiting_ids:
        telemetry.emit("operation.owner_lost", operation_id, state="waiting")
    for operation_id in report.failed_ids:
        if operation_id in unclaimed:
            telemetry.emit("operation.no_worker", operation_id)
        else:
            telemetry.emit("operation.owner_lost", operation_id, state="failed")
    return report
