"""The overview's fleet health: the owners holding leases and the registered workers with
their last heartbeat, the operations a dead owner left behind (orphaned: what
``recoverable sweep`` closes), and a running batch's pace (jobs/s, error rate, ETA)
measured between the summaries the live view polls.

Only what the store records is shown. An owner's heartbeat renews its leases: the latest
expiry it moved them to is shown (the lease length is the owner's own setting, so the
renewal moment itself is not known). A worker's heartbeat moves the served mark of its
account and endpoint ``SERVED_GRACE`` seconds ahead (``storage/queue.py``): the last
renewal is that mark minus ``SERVED_GRACE``. The pace needs two summaries a few seconds
apart with work finishing in between; until then it is "-", with the reason.
"""

from __future__ import annotations

from html import escape
from typing import Final
from urllib.parse import urlencode

import attrs

from recoverable.dashboard.html import clock, short_id, table
from recoverable.records import LeaseRecord
from recoverable.storage.base import Store
from recoverable.storage.queue import SERVED_GRACE, decode_served, served_key

__all__ = [
    "Owner",
    "Pace",
    "Worker",
    "fleet_html",
    "measure_pace",
    "owners_of",
    "workers_of",
]

PACE_WINDOW: Final = 60.0  # seconds of samples the pace is measured over
PACE_MIN_SPAN: Final = 2.0  # seconds two samples must be apart to measure anything
_MAX_SAMPLES: Final = 120
# The states in which nothing more happens to an operation by itself (``status.py``).
SETTLED: Final = ("completed", "failed", "cancelled", "superseded", "acknowledged",
                  "abandoned")


@attrs.frozen
class Owner:
    """A process holding leases (``owner_id`` is the store's random owner id)."""

    owner_id: str
    leases: int
    live: bool
    next_expiry: float | None  # the soonest lease expiry still ahead
    # The latest expiry its heartbeat renewed a lease to (None: leases without expiry).
    renewed_until: float | None = None

    @property
    def orphaned(self) -> int:
        """The operations whose lease this dead owner still names (0 while it lives)."""
        return 0 if self.live else self.leases


@attrs.frozen
class Worker:
    owner_id: str
    endpoint_id: str
    concurrency: int
    started_at: float
    live: bool
    # The last renewal of its account and endpoint's served mark (None: none since it
    # started: the mark is older, or gone).
    last_heartbeat: float | None = None


def owners_of(store: Store, leases: dict[str, LeaseRecord], now: float) -> list[Owner]:
    """One row per owner named by a lease."""
    by_owner: dict[str, list[LeaseRecord]] = {}
    for lease in leases.values():
        by_owner.setdefault(lease.owner_id, []).append(lease)
    owners = []
    for owner_id, held in sorted(by_owner.items()):
        expiries = [lease.expires_at for lease in held if lease.expires_at is not None]
        ahead = [expiry for expiry in expiries if expiry > now]
        owners.append(Owner(
            owner_id=owner_id,
            leases=len(held),
            live=store.owner_is_live(owner_id),
            next_expiry=min(ahead) if ahead else None,
            renewed_until=max(expiries) if expiries else None,
        ))
    return owners


def workers_of(store: Store) -> list[Worker]:
    """One row per registered worker, with the last heartbeat of its served mark."""
    found = []
    for owner_id, _token, row in store.workers():
        raw = store.get_raw("queue", served_key(row.account_id, row.source, row.endpoint_id))
        served = None if raw is None else decode_served(raw)
        beat = None if served is None else served.until - SERVED_GRACE
        found.append(Worker(
            owner_id=owner_id, endpoint_id=row.endpoint_id, concurrency=row.concurrency,
            started_at=row.started_at, live=store.owner_is_live(owner_id),
            last_heartbeat=beat if beat is not None and beat >= row.started_at else None,
        ))
    return found


@attrs.frozen
class Pace:
    """A batch's pace between two summaries (``None`` fields: not measurable yet)."""

    samples: tuple[tuple[float, int, int], ...]  # (built at, settled, failed), oldest first
    remaining: int  # operations not settled yet
    jobs_per_second: float | None
    error_rate: float | None  # failed / settled, over the same span
    eta_seconds: float | None
    why: str  # why a value is "-" ("" when all are measured)


def measure_pace(previous: Pace | None, now: float, by_state: dict[str, int]) -> Pace:
    """This summary's sample added to the previous ones (the last :data:`PACE_WINDOW`
    seconds kept), and the pace measured from the oldest of them."""
    settled = sum(by_state.get(state, 0) for state in SETTLED)
    failed = by_state.get("failed", 0)
    remaining = sum(by_state.values()) - settled
    kept = [sample for sample in (previous.samples if previous is not None else ())
            if now - PACE_WINDOW <= sample[0] < now]
    samples = (*kept[-_MAX_SAMPLES:], (now, settled, failed))
    first_at, first_settled, first_failed = samples[0]
    span = now - first_at
    done = settled - first_settled
    if span < PACE_MIN_SPAN:
        return Pace(samples, remaining, None, None, None,
                    "not enough data yet (it is measured between live updates)")
    if done <= 0:
        why = ("nothing left to run" if remaining == 0
               else f"no operation settled in the last {span:.0f} s")
        return Pace(samples, remaining, 0.0, None, None, why)
    rate = done / span
    errors_seen = max(0, failed - first_failed)
    if remaining == 0:
        return Pace(samples, remaining, rate, errors_seen / done, None, "nothing left to run")
    return Pace(samples, remaining, rate, errors_seen / done, remaining / rate, "")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _pace_html(pace: Pace) -> str:
    none = f'<span class="muted" title="{escape(pace.why)}">-</span>'
    rate = none if pace.jobs_per_second is None else f"{pace.jobs_per_second:.2f}"
    error = none if pace.error_rate is None else f"{pace.error_rate * 100:.1f} %"
    eta = none if pace.eta_seconds is None else _duration(pace.eta_seconds)
    why = f'<p class="muted" id="pace-why">{escape(pace.why)}</p>' if pace.why else ""
    return (
        f'<p>jobs/s: <b id="pace-rate">{rate}</b>; error rate: <b id="pace-errors">{error}'
        f'</b>; ETA: <b id="pace-eta">{eta}</b> for <span id="pace-remaining">'
        f"{pace.remaining}</span> operation(s) not settled</p>{why}"
    )


def fleet_html(owners: list[Owner], workers: list[Worker], pace: Pace) -> str:
    """The overview's "Fleet health" panels (HTML, every value escaped)."""
    orphaned = sum(owner.orphaned for owner in owners)
    owner_rows = [
        [short_id(owner.owner_id),
         f'<a href="/operations?{escape(urlencode({"owner": owner.owner_id}))}">'
         f"{owner.leases}</a>",
         '<span class="ok">yes</span>' if owner.live else '<span class="bad">no</span>',
         f'<span class="bad" data-orphaned="{owner.orphaned}">{owner.orphaned} '
         "(recoverable sweep)</span>" if owner.orphaned else "0",
         clock(owner.renewed_until), clock(owner.next_expiry)]
        for owner in owners
    ]
    owners_table = table(
        ("owner (process)", "leases", "live", "orphaned", "heartbeat: leases renewed until (UTC)",
         "soonest expiry (UTC)"),
        owner_rows, empty="no process holds a lease", element_id="owners-table")
    sweep = ""
    if orphaned:
        sweep = (
            f'<p class="error" id="orphaned">{orphaned} operation(s) orphaned: their lease '
            "names an owner whose process is gone. <code>recoverable sweep --store STORE"
            "</code> closes what they left behind, one fenced write per operation "
            "(<code>owner_lost</code>); it never touches an operation of a live owner.</p>"
        )
    worker_rows = [
        [short_id(worker.owner_id), escape(worker.endpoint_id), str(worker.concurrency),
         clock(worker.started_at), clock(worker.last_heartbeat),
         '<span class="ok">yes</span>' if worker.live else '<span class="bad">no</span>']
        for worker in workers
    ]
    workers_table = table(
        ("worker owner", "endpoint", "concurrency", "started (UTC)",
         "last heartbeat (UTC)", "live"),
        worker_rows, empty="no registered worker", element_id="workers-table")
    return (
        f'<div class="box" id="panel-pace"><h2>Batch pace</h2>{_pace_html(pace)}</div>'
        f'<div class="box" id="panel-owners"><h2>Owners and leases</h2>{sweep}'
        f"{owners_table}</div>"
        f'<div class="box" id="panel-workers"><h2>Workers</h2>{workers_table}</div>'
    )
