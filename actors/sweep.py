"""The recovery sweep: close what dead owners left behind, honestly (issue 14, seed 004's
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

With ``unclaimed_after`` (seconds), runnable operations that no live process owns and
nobody ran for that long since they became runnable (:func:`recoverable.machine.unclaimed`)
end ``failed`` with ``failure_reason="no_worker"``: a bounded, typed report, never a silent
wait forever.

Which operations are examined: every operation in ``authorizing`` or ``transmitting``,
every operation holding a lease row and, with ``unclaimed_after``, every ``prepared`` or
``waiting`` one. The store has no phase index, so this full scan decodes every operation
record once (one read snapshot; ~0.2 s for 20,000 records here); the writes touch only the
operations that change. ``leased_only=True`` (what a runtime runs when it opens) reads only
the lease table and the records it names: every operation a dead owner was driving holds
a lease row, except one whose owner's last write failed before it released the lease;
that rare row reads as interrupted and is closed by a full sweep or when reopened.
Unreadable records (``CorruptRecord`` / ``UnsupportedRecordVersion``) are left untouched
and counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Final, Literal

import msgspec
from recoverable.storage.base import Store as RecoveryStore
from recoverable.storage.base import WriteTransaction as WriteTxn
from recoverable.storage.leases import lease_blocks

from recoverable import errors, machine
from recoverable.records import OperationRecord
from recoverable.telemetry import Telemetry

__all__ = ["MAX_REPORT_IDS", "SweepReport", "sweep", "sweep_at_open"]

# Each id list of a report holds at most this many ids (the counts are always exact).
MAX_REPORT_IDS: Final = 1000

_IN_FLIGHT: Final = frozenset({"authorizing", "transmitting"})
_RUNNABLE: Final = frozenset({"prepared", "waiting"})

Outcome = Literal["untouched", "live", "raced", "closed", "waiting", "failed", "unreadable"]


class SweepReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one sweep did (counts and bounded id lists; never prompts, outputs or keys).

    - ``examined``: readable operations looked at (in flight, holding a lease row, or,
      with ``unclaimed_after``, runnable);
    - ``live``: of those, owned by a live lease: untouched;
    - ``closed``: operations the sweep wrote (a dead owner's state closed, or a stale
      lease row removed, or an unclaimed operation ended); each is also counted in
      ``waiting`` or ``failed`` when the sweep left it there;
    - ``waiting``: closed and left for adoption (``waiting``, or ``prepared`` when
      nothing was ever spent);
    - ``failed``: closed and made terminal by this sweep (``failure_reason``
      ``owner_lost``, ``expired`` or ``no_worker``);
    - ``raced``: changed by another process between the scan and the write (skipped;
      the next sweep looks again);
    - ``unreadable``: records that could not be decoded (never rewritten).

    The id lists name at most :data:`MAX_REPORT_IDS` operations each;
    ``ids_truncated`` says that some were left out.
    """

    examined: int = 0
    live: int = 0
    closed: int = 0
    waiting: int = 0
    failed: int = 0
    raced: int = 0
    unreadable: int = 0
    closed_ids: tuple[str, ...] = ()
    waiting_ids: tuple[str, ...] = ()
    failed_ids: tuple[str, ...] = ()
    ids_truncated: bool = False

    @property
    def changed(self) -> bool:
        return self.closed > 0


class _Tally:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.ids: dict[str, list[str]] = {"closed": [], "waiting": [], "failed": []}
        self.truncated = False

    def add(self, name: str, operation_id: str | None = None) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1
        if operation_id is None:
            return
        ids = self.ids[name]
        if len(ids) < MAX_REPORT_IDS:
            ids.append(operation_id)
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
            raced=count("raced", 0),
            unreadable=count("unreadable", 0),
            closed_ids=tuple(self.ids["closed"]),
            waiting_ids=tuple(self.ids["waiting"]),
            failed_ids=tuple(self.ids["failed"]),
            ids_truncated=self.truncated,
        )


def _check_bound(unclaimed_after: float | None) -> None:
    if unclaimed_after is None:
        return
    if (
        isinstance(unclaimed_after, bool)
        or not isinstance(unclaimed_after, (int, float))
        or not math.isfinite(unclaimed_after)
        or unclaimed_after < 0
    ):
        raise errors.InvalidRequest(
            "unclaimed_after must be a finite number of seconds >= 0 (or None)"
        )


def _candidates(
    records: Iterable[OperationRecord], leased: frozenset[str], unclaimed_after: float | None
) -> list[OperationRecord]:
    """The operations a sweep looks at, in id order (deterministic reports)."""
    chosen = [
        rec for rec in records
        # A version-1 record not yet upgraded: only its migration may rewrite it.
        if not rec.awaiting_upgrade
        and (
            rec.phase in _IN_FLIGHT
            or rec.operation_id in leased
            or (unclaimed_after is not None and rec.phase in _RUNNABLE)
        )
    ]
    chosen.sort(key=lambda rec: rec.operation_id)
    return chosen


def _sweep_one(
    txn: WriteTxn, seen: OperationRecord, now: float, unclaimed_after: float | None
) -> Outcome:
    """One operation, in one write transaction, conditional on the fence the scan read."""
    operation_id = seen.operation_id
    try:
        current = txn.get_operation(operation_id)
        lease = txn.get_lease(operation_id)
    except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
        return "unreadable"
    if current is None or current.fence != seen.fence:
        return "raced"  # claimed (or removed) since the scan: not ours to judge now
    if current.awaiting_upgrade:
        return "untouched"
    # Expiry judged at the sweep's now; a source-bound operation's lease only by expiry.
    if lease is not None and lease_blocks(txn, lease, current, now):
        return "live"
    new = machine.owner_lost(current, now=now).record
    if unclaimed_after is not None:
        new = machine.unclaimed(new, now=now, unclaimed_after=unclaimed_after).record
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
        return "failed"
    if new.phase in _RUNNABLE:
        return "waiting"
    return "closed"


def _leased_records(
    store: RecoveryStore, leased: Iterable[str]
) -> tuple[list[OperationRecord], int]:
    records: list[OperationRecord] = []
    unreadable = 0
    for operation_id in leased:
        try:
            record = store.get_operation(operation_id)
        except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
            unreadable += 1
            continue
        if record is not None:
            records.append(record)
    return records, unreadable


async def sweep(
    store: RecoveryStore,
    *,
    now: float,
    unclaimed_after: float | None = None,
    leased_only: bool = False,
) -> SweepReport:
    """Close every operation whose owner is gone (see the module docstring).

    ``now`` is wall-clock seconds (the clock every process shares, ``Runtime.now()``).
    ``unclaimed_after`` (seconds, optional) also ends runnable operations nobody claimed
    for that long (``no_worker``). ``leased_only`` examines only operations holding a
    lease row (cheap; not with ``unclaimed_after``). ``InvalidRequest`` for a bad
    argument; storage failures raise their typed errors (the operations already swept
    stay swept).
    """
    _check_bound(unclaimed_after)
    if not math.isfinite(now):
        raise errors.InvalidRequest("now must be a finite wall-clock time")
    if leased_only and unclaimed_after is not None:
        raise errors.InvalidRequest("unclaimed_after needs a full sweep (leased_only=False)")
    leases, _ = store.control_rows()
    if leased_only:
        records, unreadable_count = _leased_records(store, sorted(leases))
    else:
        records, unreadable = store.inventory()
        unreadable_count = len(unreadable)
    tally = _Tally()
    for _ in range(unreadable_count):
        tally.add("unreadable")
    for seen in _candidates(records, frozenset(leases), unclaimed_after):
        tally.add("examined")

        def one(txn: WriteTxn, seen: OperationRecord = seen) -> Outcome:
            return _sweep_one(txn, seen, now, unclaimed_after)

        outcome = await store.write(one)
        match outcome:
            case "untouched":
                pass
            case "live" | "raced" | "unreadable":
                tally.add(outcome)
            case _:
                tally.add("closed", seen.operation_id)
                if outcome != "closed":
                    tally.add(outcome, seen.operation_id)
    return tally.report()


async def sweep_at_open(store: RecoveryStore, *, now: float, telemetry: Telemetry) -> SweepReport:
    """The sweep a runtime runs when it opens: the cheap one (``leased_only``), so opening
    costs a read of the lease table, not of every record.

    Each operation it closes is reported as ``recovery.operation.owner_lost`` (``state``:
    ``waiting`` or ``failed``). A typed failure (a full or unavailable store) does not stop
    the runtime from opening: it is reported as ``recovery.sweep.failed`` (``code``) and
    the orphans read as interrupted until a later sweep or their reopening closes them.
    """
    try:
        report = await sweep(store, now=now, leased_only=True)
    except errors.RecoveryError as exc:
        telemetry.emit("sweep.failed", "", code=exc.code)
        return SweepReport()
    for operation_id in report.waiting_ids:
        telemetry.emit("operation.owner_lost", operation_id, state="waiting")
    for operation_id in report.failed_ids:
        telemetry.emit("operation.owner_lost", operation_id, state="failed")
    return report
