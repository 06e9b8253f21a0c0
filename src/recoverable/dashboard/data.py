"""The dashboard's data: one summary of the whole store, rebuilt from one read of it, and
the bounded pages and per-operation views served from it.

The summary (:class:`Summary`) holds one small row per operation (its id, creation time,
state, availability, job id, attempts and failure kind: never a prompt, an output or an
account identifier) and the overview's aggregates. It is built in a worker thread from
``store.inventory()`` + ``store.control_rows()`` + ``store.dispositions()`` (the store
contract: LMDB or any other store implementing it), and rebuilt only when the store
changed (``store.last_txnid()``), at most every ``max(1 s, 3 x the last build)``, so a
store of 100,000 operations costs one rebuild every few seconds while a batch runs, and
nothing while it is idle. A page of the list is a slice of a sorted row list found by
bisection from its cursor: the first and the 2,000th page cost the same.

The operation page reads the operation's own record fresh from the store
(:func:`operation_view`).
"""

from __future__ import annotations

import base64
import binascii
import math
import time
from collections import Counter
from collections.abc import Iterable
from typing import Final, Protocol

import attrs

from recoverable import errors
from recoverable.actors import queue as submitted
from recoverable.dashboard.explain import (
    Chain,
    Explanation,
    explain,
    lineage_chain,
    updated_at,
)
from recoverable.dashboard.fleet import (
    Owner,
    Pace,
    Worker,
    measure_pace,
    owners_of,
    workers_of,
)
from recoverable.machine import derive_status
from recoverable.outcome import Usage
from recoverable.pricing import PriceTable, default_prices
from recoverable.records import DispositionRecord, OperationRecord
from recoverable.storage.base import Store
from recoverable.storage.governor import governor_key, load_governor
from recoverable.types import AccountBinding, Status

__all__ = [
    "MAX_PAGE",
    "STATES",
    "DashboardStore",
    "OperationView",
    "Row",
    "Summary",
    "build_summary",
    "decode_cursor",
    "encode_cursor",
    "operation_view",
]

STATES: Final = (
    "prepared", "running", "interrupted", "suspended", "completed", "failed", "cancelled",
    "superseded", "acknowledged", "abandoned",
)
MAX_PAGE: Final = 200  # rows a list page (or its JSON) holds at most
DEFAULT_PAGE: Final = 50
THROUGHPUT_MINUTES: Final = 60  # the throughput chart: the last hour, per minute
_MAX_CURSOR: Final = 400  # characters
_MAX_ID: Final = 200  # characters of an operation id in a URL


class DashboardStore(Store, Protocol):
    """The store contract plus the disposition markers' query (both stores have it)."""

    def dispositions(
        self, account: AccountBinding | None = None, scope: str | None = None
    ) -> list[DispositionRecord]: ...


@attrs.frozen
class Row:
    """One operation in the list (no content, no account)."""

    operation_id: str
    created_at: float
    state: str
    availability: str
    job_id: str | None
    attempts_used: int
    maximum_attempts: int
    failure: str | None  # the typed failure kind (or the failure reason), if any
    # The last interruption's code (the provider's error code, else the transport's, else
    # the HTTP status: the PostgreSQL store's ``failure_code`` column), the model, the
    # lease owner, and the last time the row visibly changed (its creation, an attempt,
    # its completion, its disposition): the list's filters and sorts.
    failure_code: str | None = None
    model: str | None = None
    owner: str | None = None
    updated_at: float = 0.0
    # Where the row sorts when that is not ``created_at``: a disposed operation (shown at
    # its disposition time) keeps the place its record had (see ``build_summary``).
    listed_at: float | None = None
    # Its lease names an owner whose process is gone (what ``recoverable sweep`` closes).
    orphaned: bool = False
    # The list's order: newest first, then by id (made once: the lists share it).
    key: tuple[float, str] = attrs.field(
        init=False, eq=False,
        default=attrs.Factory(lambda row: (
            -(row.created_at if row.listed_at is None else row.listed_at), row.operation_id,
        ), takes_self=True),
    )


@attrs.frozen
class GovernorState:
    """The shared rate governor of one endpoint (for some account: not named)."""

    endpoint_id: str
    operations: int
    paused_until: float | None
    requests_level: float | None
    tokens_level: float | None


@attrs.frozen
class Summary:
    built_at: float
    build_seconds: float
    txnid: int
    total: int
    unreadable: int
    by_state: dict[str, int]
    by_availability: dict[str, int]
    failures: list[tuple[str, int]]  # typed failure kind -> operations, most first
    attempts_histogram: list[tuple[int, int]]  # attempts used -> operations
    throughput: list[tuple[float, int, int]]  # minute start -> (completed, attempts spent)
    usage: Usage
    usage_reported: bool
    cost: float | None  # estimated USD; None when a model has no price (``unpriced``)
    unpriced: list[str]  # the models with reported usage and no price (at most 10)
    price_source: str  # where the prices come from (--prices, genai-prices, or none)
    cooldowns: list[tuple[str, float]]  # the soonest saved cooldowns (id, until)
    waiting: int  # operations in a saved cooldown
    governors: list[GovernorState]
    owners: list[Owner]
    workers: list[Worker]
    pace: Pace  # jobs/s, error rate, ETA between this summary and the ones before
    # The soonest moment a value shown here changes by time alone (a cooldown or a shared
    # pause ends, a lease expires): the summary is rebuilt then, with no commit to say so.
    changes_at: float | None
    rows: dict[str, list[Row]]  # "all" and each state -> rows sorted by ``Row.key``
    keys: dict[str, list[tuple[float, str]]]  # the same lists' keys (for bisection)

    def counts(self) -> dict[str, object]:
        """The counts (``/api/summary``; the overview shows them from the same summary)."""
        return {
            "total": self.total,
            "unreadable": self.unreadable,
            "by_state": self.by_state,
            "by_availability": self.by_availability,
            "waiting": self.waiting,
            "built_at": self.built_at,
            "orphaned": sum(owner.orphaned for owner in self.owners),
            "pace": {
                "jobs_per_second": self.pace.jobs_per_second,
                "error_rate": self.pace.error_rate,
                "eta_seconds": self.pace.eta_seconds,
                "remaining": self.pace.remaining,
                "why": self.pace.why,
            },
        }


def _failure_kind(record: OperationRecord) -> str | None:
    if record.last_failure is not None:
        return record.last_failure.kind
    return record.failure_reason


def failure_code(record: OperationRecord) -> str | None:
    """The last interruption's code, as the PostgreSQL store's ``failure_code`` column."""
    failure = record.last_failure
    if failure is None:
        return None
    return failure.provider_code or failure.transport_code or (
        None if failure.http_status is None else str(failure.http_status))


def _row(record: OperationRecord, status: Status, owner: str | None,
         orphaned: bool = False) -> Row:
    shows_failure = status.state != "completed"
    return Row(
        operation_id=record.operation_id,
        created_at=record.created_at,
        state=status.state,
        availability=status.availability,
        job_id=record.job_id,
        attempts_used=record.attempts_used,
        maximum_attempts=record.maximum_attempts,
        # The last typed failure while it still matters (a cooldown, an end), not once
        # a later attempt completed.
        failure=_failure_kind(record) if shows_failure else None,
        failure_code=failure_code(record) if shows_failure else None,
        model=record.model,
        owner=owner,
        updated_at=updated_at(record),
        orphaned=orphaned,
    )


def _disposed_row(marker: DispositionRecord, listed_at: float | None) -> Row:
    return Row(
        operation_id=marker.operation_id,
        created_at=marker.at,
        state=marker.disposition,
        availability=marker.disposition,
        job_id=marker.job_id,
        attempts_used=marker.attempts_used,
        maximum_attempts=marker.maximum_attempts,
        failure=None,
        updated_at=marker.at,
        listed_at=listed_at,
    )


def _lowest(first: float | None, second: float | None) -> float | None:
    """The lower bucket level; ``None`` (full) only when both are full."""
    if first is None or second is None:
        return second if first is None else first
    return min(first, second)


def _governors(
    store: Store, pairs: Counter[tuple[str, AccountBinding]], now: float
) -> list[GovernorState]:
    """One row per endpoint. Each account has its own governor row in the store, but the
    table names no account: two rows with the same endpoint would look like a duplicate.
    So the accounts of an endpoint are merged: their operations summed, the latest pause
    and the lowest bucket levels (the most constrained account) shown."""
    merged: dict[str, GovernorState] = {}
    for (endpoint_id, account), operations in sorted(
        pairs.items(), key=lambda item: (item[0][0], -item[1])
    ):
        if endpoint_id not in merged and len(merged) >= 20:
            continue
        row = load_governor(store.get_raw("governor", governor_key(endpoint_id, account)))
        paused = row.paused_until if row.paused_until > now else None
        seen = merged.get(endpoint_id)
        if seen is None:
            merged[endpoint_id] = GovernorState(
                endpoint_id=endpoint_id, operations=operations, paused_until=paused,
                requests_level=row.requests_level, tokens_level=row.tokens_level,
            )
            continue
        merged[endpoint_id] = GovernorState(
            endpoint_id=endpoint_id,
            operations=seen.operations + operations,
            paused_until=max((until for until in (seen.paused_until, paused)
                              if until is not None), default=None),
            requests_level=_lowest(seen.requests_level, row.requests_level),
            tokens_level=_lowest(seen.tokens_level, row.tokens_level),
        )
    return list(merged.values())


def _cost(
    records: Iterable[OperationRecord], prices: PriceTable
) -> tuple[Usage, bool, float, set[str]]:
    """The reported usage, whether any was, its cost and the models without a price (a
    cost leaving some out would look complete: it is then no cost at all)."""
    total = Usage()
    reported = False
    cost = 0.0
    unpriced: set[str] = set()
    for record in records:
        for attempt in record.attempts:
            if attempt.usage is None:
                continue
            reported = True
            total = total + attempt.usage
            price = prices.for_model(record.model, record.service_tier)
            if price is None:
                unpriced.add(record.model)
            else:
                cost += price.cost(attempt.usage)
    return total, reported, cost, unpriced


def _places(previous: Summary | None) -> dict[str, float]:
    """Each listed operation's place in the previous summary's list (its sort time)."""
    if previous is None:
        return {}
    return {row.operation_id: -row.key[0] for row in previous.rows.get("all", ())}


def build_summary(
    store: DashboardStore,
    *,
    now: float | None = None,
    prices: PriceTable | None = None,
    previous: Summary | None = None,
) -> Summary:
    """One pass over the store (synchronous: run it in a thread). ``prices``: the cost's
    price table (``--prices``; genai-prices' by default).

    The list pages walk a cursor (keyset, never an offset), which is only sound while a
    row's sort key stays put. A marker has no creation time, so an acknowledged or
    abandoned operation would jump from its record's place to its disposition time (the
    top): a walk under way would skip it. It keeps the place ``previous`` (the summary
    before) gave it instead; only a marker this process never saw as a record sorts at its
    disposition time, which does not move either."""
    prices = default_prices() if prices is None else prices
    started = time.perf_counter()
    txnid = store.last_txnid()
    now = time.time() if now is None else now
    records, unreadable = store.inventory()
    leases, commands = store.control_rows()
    markers = store.dispositions()
    # The markers are read after the records: an operation acknowledged or abandoned in
    # between is in both reads, and its marker (the newer state) stands for it alone.
    disposed = {marker.operation_id for marker in markers}
    records = [record for record in records if record.operation_id not in disposed]
    live: dict[str, bool] = {}
    owner_live: dict[str, bool] = {}  # owner id -> its process is alive
    rows: list[Row] = []
    failures: Counter[str] = Counter()
    attempts: Counter[int] = Counter()
    completed_minutes: Counter[float] = Counter()
    attempt_minutes: Counter[float] = Counter()
    pairs: Counter[tuple[str, AccountBinding]] = Counter()
    cooldowns: list[tuple[float, str]] = []
    horizon = (math.floor(now / 60.0) - THROUGHPUT_MINUTES + 1) * 60.0
    for record in records:
        lease = leases.get(record.operation_id)
        is_live = False
        if lease is not None:
            token = f"{lease.owner_id}\0{lease.token}"
            if token not in live:
                live[token] = store.lease_is_live(lease, now)
            is_live = live[token]
        command = commands.get(record.operation_id)
        status = derive_status(
            record, now=now, lease_live=is_live, viewer=record.account,
            command=command.kind if command is not None else None, lease=lease,
        )
        orphaned = False
        if lease is not None:
            if lease.owner_id not in owner_live:
                owner_live[lease.owner_id] = store.owner_is_live(lease.owner_id)
            orphaned = not owner_live[lease.owner_id]
        row = _row(record, status, lease.owner_id if lease is not None else None, orphaned)
        rows.append(row)
        if row.failure is not None and status.state == "failed":
            failures[row.failure] += 1
        attempts[record.attempts_used] += 1
        pairs[(record.endpoint_id, record.account)] += 1
        if status.availability == "waiting" and record.next_attempt_at is not None:
            cooldowns.append((record.next_attempt_at, record.operation_id))
        if record.completed_at is not None and record.completed_at >= horizon:
            completed_minutes[math.floor(record.completed_at / 60.0) * 60.0] += 1
        for attempt in record.attempts:
            if attempt.consumed_at >= horizon:
                attempt_minutes[math.floor(attempt.consumed_at / 60.0) * 60.0] += 1
    disposed_usage = Usage()
    places = _places(previous) if markers else {}
    for marker in markers:
        rows.append(_disposed_row(marker, places.get(marker.operation_id)))
        if marker.disposition == "acknowledged" and marker.at >= horizon:
            # Its completion time left with the record: the acknowledgement stands in.
            completed_minutes[math.floor(marker.at / 60.0) * 60.0] += 1
        attempts[marker.attempts_used] += 1
        if marker.usage is not None:
            disposed_usage = disposed_usage + marker.usage
    usage, reported, cost, unpriced = _cost(records, prices)
    usage = usage + disposed_usage
    rows.sort(key=lambda row: row.key)
    by_state: dict[str, list[Row]] = {"all": rows}
    for row in rows:
        by_state.setdefault(row.state, []).append(row)
    minutes = [horizon + 60.0 * index for index in range(THROUGHPUT_MINUTES)]
    cooldowns.sort()
    governors = _governors(store, pairs, now)
    owners = owners_of(store, leases, now)
    ends = [until for until, _ in cooldowns[:1] if until > now]
    ends += [gov.paused_until for gov in governors if gov.paused_until is not None]
    ends += [owner.next_expiry for owner in owners if owner.next_expiry is not None]
    counted = {state: len(by_state.get(state, ())) for state in STATES}
    return Summary(
        built_at=now,
        build_seconds=time.perf_counter() - started,
        txnid=txnid,
        total=len(rows),
        unreadable=len(unreadable),
        by_state=counted,
        by_availability=dict(Counter(row.availability for row in rows).most_common()),
        failures=failures.most_common(),
        attempts_histogram=sorted(attempts.items()),
        throughput=[(minute, completed_minutes[minute], attempt_minutes[minute])
                    for minute in minutes],
        usage=usage,
        usage_reported=reported or disposed_usage != Usage(),
        cost=None if unpriced else cost,
        unpriced=sorted(unpriced)[:10],
        price_source=prices.source,
        cooldowns=[(op_id, until) for until, op_id in cooldowns[:10]],
        waiting=len(cooldowns),
        governors=governors,
        owners=owners,
        workers=workers_of(store),
        pace=measure_pace(previous.pace if previous is not None else None, now, counted),
        changes_at=min(ends) if ends else None,
        rows=by_state,
        keys={state: [row.key for row in listed] for state, listed in by_state.items()},
    )


# -- pages ------------------------------------------------------------------------------


def encode_cursor(key: tuple[float, str]) -> str:
    raw = f"{key[0]!r}\n{key[1]}".encode()
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(text: str) -> tuple[float, str]:
    """A cursor from a previous page; anything else is ``InvalidRequest``."""
    if len(text) > _MAX_CURSOR:
        raise errors.InvalidRequest("cursor: too long")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
        number, sep, operation_id = raw.partition("\n")
        value = float(number)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise errors.InvalidRequest("cursor: not a cursor of this dashboard") from None
    if not sep or not math.isfinite(value):
        raise errors.InvalidRequest("cursor: not a cursor of this dashboard")
    return value, operation_id


# -- one operation ----------------------------------------------------------------------


def check_operation_id(operation_id: str) -> str:
    if not 0 < len(operation_id) <= _MAX_ID or not operation_id.isprintable():
        raise errors.InvalidRequest("not an operation id")
    return operation_id


@attrs.frozen
class OperationView:
    """What the operation page shows: its status (as its own account sees it: never
    content), the raw record for the timeline (``None`` once disposed), and whether the
    dashboard's account may act on it."""

    status: Status
    record: OperationRecord | None
    marker: DispositionRecord | None
    same_account: bool
    paused_until: float | None
    content: tuple[str | None, str | None] | None  # (request, completion) with --show-content
    # The failure in words and what to do (a failed operation), and the lineage as read
    # from the store (``dashboard/explain.py``).
    explanation: Explanation | None = None
    chain: Chain | None = None
    # The owner named by its lease when that owner's process is gone (orphaned: what
    # ``recoverable sweep`` closes); None otherwise.
    orphaned_by: str | None = None


def operation_view(
    store: Store,
    operation_id: str,
    *,
    viewer: AccountBinding | None,
    show_content: bool,
    now: float | None = None,
) -> OperationView:
    """The operation's view, fresh from the store; ``StateUnavailable`` if unknown."""
    check_operation_id(operation_id)
    now = time.time() if now is None else now
    marker = store.get_disposition(operation_id)
    if marker is not None:
        view = marker_view(marker, viewer)
        return attrs.evolve(view, chain=lineage_chain(
            store, operation_id, root=marker.root_operation_id,
            previous=marker.previous_operation_id, successor=None))
    record = store.get_operation(operation_id)
    if record is None:
        raise errors.StateUnavailable("no such operation", operation_id=operation_id)
    lease = store.get_lease(operation_id)
    live = lease is not None and store.lease_is_live(lease, now)
    command = store.get_command(operation_id)
    payloads = store.payload_kinds([operation_id])[operation_id]
    status = derive_status(
        record, now=now, lease_live=live, viewer=record.account,
        command=command.kind if command is not None else None, payloads=payloads, lease=lease,
    )
    status = submitted.with_queue_state(store, record, status)
    governor = load_governor(store.get_raw("governor", governor_key(record.endpoint_id,
                                                                    record.account)))
    same = viewer == record.account
    content = None
    if show_content and same:
        content = (_text(store.get_payload(operation_id, "body")),
                   _text(store.get_payload(operation_id, "completion")))
    successor = status.successor_id or (
        status.continuation.successor_id if status.continuation is not None else None)
    return OperationView(
        status=status, record=record, marker=None, same_account=same,
        paused_until=governor.paused_until if governor.paused_until > now else None,
        content=content, explanation=explain(record),
        orphaned_by=(lease.owner_id if lease is not None
                     and not store.owner_is_live(lease.owner_id) else None),
        chain=lineage_chain(store, operation_id, root=record.root_operation_id,
                            previous=record.previous_operation_id, successor=successor),
    )


def marker_view(marker: DispositionRecord, viewer: AccountBinding | None) -> OperationView:
    """The view of an acknowledged or abandoned operation: only its marker is left."""
    operation_id = marker.operation_id
    return OperationView(
        status=Status(
            operation_id=operation_id, state=marker.disposition,
            availability=marker.disposition, attempts_used=marker.attempts_used,
            maximum_attempts=marker.maximum_attempts,
            root_operation_id=marker.root_operation_id,
            previous_operation_id=marker.previous_operation_id, job_id=marker.job_id,
            input_revision=marker.input_revision, scope=marker.scope,
            usage=marker.usage or Usage(),
        ),
        record=None, marker=marker, same_account=viewer == marker.account,
        paused_until=None, content=None,
    )


_MAX_CONTENT: Final = 64 * 1024


def _text(raw: bytes | None) -> str | None:
    if raw is None:
        return None
    shown = raw[:_MAX_CONTENT].decode("utf-8", "replace")
    return shown + ("\n... (cut at 64 KiB)" if len(raw) > _MAX_CONTENT else "")
