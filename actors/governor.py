"""The rate governor: one per runtime, shared with every process on the same store.

Before an operation connects for an attempt (so before anything is spent), it asks
the governor of its endpoint and account for admission. The governor holds, per
endpoint+account, one row in the store's ``governor`` table:

- ``paused_until``: a shared cooldown. A 429 with Retry-After on ANY operation (of
  any process on the store) pauses every operation of that endpoint and account
  until then; so does an ``x-ratelimit-remaining-*: 0`` header (until its reset).
  Bounded by the operation's ``RetryPolicy.maximum_retry_after``. Persisted: a
  restarted runtime honours it.
- two token buckets, when limits are configured: requests per minute and tokens per
  minute. A bucket holds at most ``limit * burst_seconds / 60`` and refills at
  ``limit / 60`` per second (``DEFAULT_BURST_SECONDS``: 5 s, so that no 60-second window
  holds more than the limit: a full bucket, 5 s of budget, plus one minute of refill at
  the 95% aim is 1.03 x the limit; a burst of 60 s would allow 1.9 x). Every admission
  claims its cost from the shared row in one store transaction (claims of one process
  are group-committed), so the budget is exact across processes: N processes together
  stay within one limit.
- small limits (nothing waits forever): a request is admitted once its bucket holds its cost, or,
  when its cost is larger than the whole bucket (``--rpm 1``: a bucket of 0.08
  requests at the default 5 s; one request estimated above ``tpm * burst / 60``
  tokens), once the bucket is full. It is charged its whole cost either way: the bucket
  goes into debt and the next request waits until one request's worth has been
  refilled, so the rate stays the limit (``_need`` and ``_claim``).

The tokens of a request are estimated from its frozen body
(:func:`~recoverable.transport.ratelimit.estimate_tokens`) when it is admitted and
corrected UP by the usage the provider reports when the attempt ends (never down:
a provider counts ``max_output_tokens`` at admission, so a refund would overshoot).
``x-ratelimit-remaining-*`` headers lower the levels (never raise them).

Times in the row are wall-clock seconds (``Runtime.now``), the one clock every
process shares. The row is advisory state, not budget: an unreadable row is
replaced by a fresh one (and reported by ``check_integrity``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final, Literal

import msgspec

from recoverable import errors
from recoverable.outcome import Interruption, Outcome
from recoverable.records import OperationRecord
from recoverable.storage.governor import GOVERNOR_VERSION as GOVERNOR_VERSION
from recoverable.storage.governor import GovernorRecord as GovernorRecord
from recoverable.storage.governor import check_governor_entry as check_governor_entry
from recoverable.storage.governor import encode_governor as _encode
from recoverable.storage.governor import governor_key
from recoverable.storage.governor import load_governor as _load
from recoverable.types import AccountBinding, Status, to_datetime

if TYPE_CHECKING:
    from recoverable.storage.base import Store as RecoveryStore
    from recoverable.storage.base import WriteTransaction as WriteTxn
    from recoverable.telemetry import Telemetry

__all__ = [
    "GovernorRecord",
    "RateGovernor",
    "WaitReason",
    "check_governor_entry",
    "validate_limits",
]

# The governor aims this fraction below the configured limits (bucket size and refill):
# a request is counted when it is admitted and by the provider when it arrives, a
# varying moment later, so an exact aim would sometimes arrive a little early.
RATE_MARGIN: Final = 0.05
WaitReason = Literal["paused", "requests", "tokens"]
# An upper bound on any one pause (also when a policy allows a longer Retry-After).
MAXIMUM_PAUSE: Final = 24 * 3600.0
_MAX_LIMIT: Final = 1e12
# The least requests_per_minute / tokens_per_minute (and --rpm/--tpm): at 0.01 requests
# per minute, one request every 100 minutes (105 with the margin). Any positive limit would
# admit requests (``_need``); the floor keeps each wait one a person would still call a
# rate limit, and a date ``rate_limited_until`` can show (1e-300 would not be).
MINIMUM_PER_MINUTE: Final = 0.01
# The default burst: what a bucket may spend at once, in seconds of refill. Short enough
# that any 60 s window stays within the limit at the 95% aim (5/60 x 0.95 + 0.95 = 1.03),
# which a provider counting per minute, or over shorter periods, also accepts.
DEFAULT_BURST_SECONDS: Final = 5.0


def validate_limits(
    requests_per_minute: float | None, tokens_per_minute: float | None, burst_seconds: float
) -> None:
    for name, value in (("requests_per_minute", requests_per_minute),
                        ("tokens_per_minute", tokens_per_minute)):
        if value is None:
            continue
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or not MINIMUM_PER_MINUTE <= value <= _MAX_LIMIT):
            raise errors.InvalidRequest(f"{name} must be a number in 0.01..1e12 (per minute)")
    if (isinstance(burst_seconds, bool) or not isinstance(burst_seconds, int | float)
            or not math.isfinite(burst_seconds) or not 0 < burst_seconds <= 3600):
        raise errors.InvalidRequest("rate_burst_seconds must be in (0, 3600]")


def _level(level: float | None, at: float, now: float, per_minute: float, burst: float) -> float:
    """The bucket at ``now``: ``per_minute`` is the effective (margined) limit. It may be
    negative: a request larger than the bucket leaves it in debt (``_need``)."""
    capacity = per_minute * burst / 60.0
    if level is None:
        return capacity
    return min(capacity, level + max(0.0, now - at) * per_minute / 60.0)


# A level within this fraction of what is needed counts as enough: the refill computed at
# the moment a wait ends can fall an ulp short of the level the wait was computed for,
# and a caller woken exactly then (a clock that jumps to it) would be refused for ever.
_FULL: Final = 1.0 - 1e-9


def _need(cost: float, per_minute: float, burst: float) -> float:
    """The level a bucket must reach before a request of ``cost`` is admitted.

    Where the numbers come from: the bucket holds ``per_minute * burst / 60`` (the
    effective, margined limit times the burst seconds, in requests or tokens) and a
    request costs 1 request and its estimated tokens. A request is admitted once the
    bucket holds its cost; when its cost is larger than the whole bucket, once the bucket
    is full (the ``min``), else it would wait for ever: ``--rpm 1`` holds 1 x 0.95 x 60 /
    60 = 0.95 requests, ``--rpm 60 --rate-burst-seconds 1`` 0.95 too. ``_claim`` charges
    the whole cost, so the level goes below 0 and the next request waits for one
    request's worth of refill: ``60 / per_minute`` seconds per request (63 s at --rpm 1,
    per_minute 0.95), the configured rate, never more."""
    return min(cost, per_minute * burst / 60.0)


class RateGovernor:
    """Admission before connecting, and the settlement of every attempt's outcome."""

    def __init__(
        self,
        store: RecoveryStore,
        *,
        wall_clock: Callable[[], float],
        telemetry: Telemetry,
        requests_per_minute: float | None = None,
        tokens_per_minute: float | None = None,
        burst_seconds: float = DEFAULT_BURST_SECONDS,
        margin: float = RATE_MARGIN,
    ) -> None:
        validate_limits(requests_per_minute, tokens_per_minute, burst_seconds)
        if not 0.0 <= margin < 1.0:
            raise errors.InvalidRequest("the rate margin must be in [0, 1)")
        self._store = store
        self._wall = wall_clock
        self._telemetry = telemetry
        # The effective limits: the configured ones less the margin.
        self.requests_per_minute = (
            None if requests_per_minute is None else requests_per_minute * (1.0 - margin)
        )
        self.tokens_per_minute = (
            None if tokens_per_minute is None else tokens_per_minute * (1.0 - margin)
        )
        self.burst_seconds = float(burst_seconds)
        # operation id -> (why, wall-clock time it may go on) while it waits here.
        self.waiting: dict[str, tuple[WaitReason, float]] = {}
        self.waits = 0  # admissions that had to wait (all reasons)
        # Without limits an admission only reads the shared pause. On a store whose reads
        # are round trips (PostgreSQL: ``advisory_read_seconds``), the pause read is kept
        # that long per endpoint+account (a pause another process wrote is seen at most
        # that late; one this process writes, at once): key -> (paused_until, read at).
        self._fresh_for = float(getattr(store, "advisory_read_seconds", 0.0))
        self._pauses: dict[bytes, tuple[float, float]] = {}
        self.pause_reads = 0  # reads of the shared pause row (no limits configured)

    @property
    def limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    def _capacity_tokens(self) -> float:
        assert self.tokens_per_minute is not None
        return self.tokens_per_minute * self.burst_seconds / 60.0

    # -- admission -------------------------------------------------------------------

    def _claim(
        self, key: bytes, tokens: int, now: float, txn: WriteTxn
    ) -> tuple[WaitReason | None, float]:
        """One transaction: the pause, then both buckets; charge both only if both allow."""
        record = _load(txn.get_raw("governor", key))
        if record.paused_until > now:
            return "paused", record.paused_until
        burst = self.burst_seconds
        rpm, tpm = self.requests_per_minute, self.tokens_per_minute
        requests = tokens_level = None
        wait_until = now
        reason: WaitReason | None = None
        if rpm is not None:
            requests = _level(record.requests_level, record.requests_at, now, rpm, burst)
            need = _need(1.0, rpm, burst)  # a bucket under 1 request: once it is full
            if requests < need * _FULL:
                wait_until = now + (need - requests) * 60.0 / rpm
                reason = "requests"
        if tpm is not None:
            need = _need(float(tokens), tpm, burst)  # an oversized one: once it is full
            tokens_level = _level(record.tokens_level, record.tokens_at, now, tpm, burst)
            if tokens_level < need * _FULL:
                at = now + (need - tokens_level) * 60.0 / tpm
                if at > wait_until:
                    wait_until, reason = at, "tokens"
        if reason is not None:
            return reason, wait_until
        # A claim computed at an earlier ``now`` than the row's (another process committed
        # first) keeps the row's time: refill is never counted twice. The whole cost is
        # charged, also beyond the bucket (debt: the next request waits for it, ``_need``).
        txn.put_raw("governor", key, _encode(msgspec.structs.replace(
            record,
            requests_level=None if requests is None else requests - 1.0,
            requests_at=max(now, record.requests_at) if requests is not None
            else record.requests_at,
            tokens_level=None if tokens_level is None else tokens_level - float(tokens),
            tokens_at=max(now, record.tokens_at) if tokens_level is not None
            else record.tokens_at,
        )))
        return None, now

    def paused_until(self, endpoint_id: str, account: AccountBinding) -> float | None:
        """The shared pause of an endpoint+account (wall clock), if one is in force."""
        record = _load(self._store.get_raw("governor", governor_key(endpoint_id, account)))
        return record.paused_until if record.paused_until > self._wall() else None

    def mark_status(
        self,
        record: OperationRecord,
        status: Status,
        pauses: dict[tuple[str, AccountBinding], float | None] | None = None,
    ) -> Status:
        """Mark a status whose operation waits for the governor: in this runtime (why, and
        until when), or behind a shared pause of its endpoint+account (any process).
        ``pauses`` caches the shared pauses read over one inventory."""
        if status.state in ("completed", "failed", "cancelled", "superseded") or status.redacted:
            return status
        waiting = self.waiting.get(record.operation_id)
        if waiting is not None:
            return msgspec.structs.replace(
                status, rate_limited=waiting[0], rate_limited_until=to_datetime(waiting[1])
            )
        where = (record.endpoint_id, record.account)
        if pauses is not None and where in pauses:
            paused = pauses[where]
        else:
            paused = self.paused_until(*where)
            if pauses is not None:
                pauses[where] = paused
        if paused is None:
            return status
        return msgspec.structs.replace(
            status, rate_limited="paused", rate_limited_until=to_datetime(paused)
        )

    def budget_wait(
        self, endpoint_id: str, account: AccountBinding
    ) -> tuple[WaitReason, float] | None:
        """Whether a request of this endpoint+account would wait now, read from the shared
        row without claiming anything: why, and until when (wall clock; for tokens, the
        estimate of a 1-token request). For a display of what OTHER processes wait for
        (``batch --workers``: the workers run the requests); None: it would not wait."""
        now = self._wall()
        record = _load(self._store.get_raw("governor", governor_key(endpoint_id, account)))
        if record.paused_until > now:
            return "paused", record.paused_until
        buckets: tuple[tuple[WaitReason, float | None, float | None, float], ...] = (
            ("requests", self.requests_per_minute, record.requests_level, record.requests_at),
            ("tokens", self.tokens_per_minute, record.tokens_level, record.tokens_at),
        )
        for reason, per_minute, level, at in buckets:
            if per_minute is None:
                continue
            current = _level(level, at, now, per_minute, self.burst_seconds)
            need = _need(1.0, per_minute, self.burst_seconds)  # one request, one token
            if current < need:
                return reason, now + (need - current) * 60.0 / per_minute
        return None

    async def admit(
        self,
        operation_id: str,
        endpoint_id: str,
        account: AccountBinding,
        tokens: int,
        wait_until: Callable[[float], Awaitable[None]],
    ) -> None:
        """Return once this attempt may connect: no pause in force and (with limits) its
        request and estimated tokens claimed. Cancellable while waiting (nothing claimed)."""
        key = governor_key(endpoint_id, account)
        waited = False
        try:
            while True:
                now = self._wall()
                if self.limited:
                    reason, until = await self._store.write(
                        functools.partial(self._claim, key, tokens, now)
                    )
                else:
                    paused = self._paused_until(key, now)
                    reason, until = ("paused", paused) if paused > now else (None, now)
                if reason is None:
                    return
                self.waiting[operation_id] = (reason, until)
                if not waited:
                    waited = True
                    self.waits += 1
                    self._telemetry.emit("operation.rate_limited", operation_id, reason=reason,
                                         seconds=round(max(0.0, until - now), 3))
                await wait_until(until)
        finally:
            self.waiting.pop(operation_id, None)

    def _paused_until(self, key: bytes, now: float) -> float:
        """The shared pause of ``key`` (0.0: none), read again once ``_fresh_for`` passed."""
        seen = self._pauses.get(key)
        if seen is not None and 0.0 <= now - seen[1] < self._fresh_for:
            return seen[0]
        paused = _load(self._store.get_raw("governor", key)).paused_until
        self.pause_reads += 1
        if self._fresh_for > 0.0:
            self._pauses[key] = (paused, now)
        return paused

    # -- settlement ------------------------------------------------------------------

    async def settle(
        self,
        operation_id: str,
        endpoint_id: str,
        account: AccountBinding,
        *,
        estimate: int,
        outcome: Outcome,
        maximum_pause: float,
    ) -> None:
        """After an attempt ended: the shared pause (429 Retry-After, or a remaining
        count of 0 until its reset), the headers' remaining counts, and the usage
        correction. One write, only when something changes."""
        now = self._wall()
        cap = min(max(0.0, maximum_pause), MAXIMUM_PAUSE)
        pause_until = 0.0
        if (isinstance(outcome, Interruption) and outcome.is_rate_limit
                and outcome.retry_after is not None and outcome.retry_after > 0):
            pause_until = now + min(outcome.retry_after, cap)
        limits = outcome.rate_limits
        if limits is not None:
            for remaining, reset in ((limits.remaining_requests, limits.reset_requests),
                                     (limits.remaining_tokens, limits.reset_tokens)):
                if remaining == 0 and reset is not None and reset > 0:
                    pause_until = max(pause_until, now + min(reset, cap))
        extra = 0
        if self.tokens_per_minute is not None and outcome.usage is not None:
            extra = max(0, outcome.usage.total_tokens - estimate)
        lower_requests = (limits.remaining_requests if limits is not None
                          and self.requests_per_minute is not None else None)
        lower_tokens = (limits.remaining_tokens if limits is not None
                        and self.tokens_per_minute is not None else None)
        if pause_until <= now and not extra and lower_requests is None and lower_tokens is None:
            return
        key = governor_key(endpoint_id, account)
        burst = self.burst_seconds

        def update(txn: WriteTxn) -> bool:
            record = _load(txn.get_raw("governor", key))
            changes: dict[str, float | None] = {}
            if pause_until > record.paused_until:
                changes["paused_until"] = pause_until
            rpm, tpm = self.requests_per_minute, self.tokens_per_minute
            if rpm is not None and lower_requests is not None:
                level = _level(record.requests_level, record.requests_at, now, rpm, burst)
                if lower_requests < level:
                    changes["requests_level"] = float(lower_requests)
                    changes["requests_at"] = max(now, record.requests_at)
            if tpm is not None and (extra or lower_tokens is not None):
                level = _level(record.tokens_level, record.tokens_at, now, tpm, burst)
                new = level - extra
                if lower_tokens is not None:
                    new = min(new, float(lower_tokens))
                # A correction never goes below one burst in debt (a huge one waits at most 2
                # bursts); a claim's own debt (``_need``) is kept as it is.
                new = max(new, -self._capacity_tokens())
                if new < level:
                    changes["tokens_level"] = new
                    changes["tokens_at"] = max(now, record.tokens_at)
            if not changes:
                return False
            txn.put_raw("governor", key, _encode(msgspec.structs.replace(record, **changes)))
            return True

        try:
            await self._store.write(update)
        except errors.RecoveryError as exc:
            # Advisory state: the attempt's own record is already saved; a store that
            # cannot take this row refuses the next admission's claim as well.
            self._telemetry.emit("governor.unavailable", operation_id, code=exc.code)
            return
        if pause_until > now:
            seen = self._pauses.get(key)
            if seen is not None:  # this process's own pause counts at once
                self._pauses[key] = (max(seen[0], pause_until), seen[1])
            self._telemetry.emit("endpoint.paused", operation_id,
                                 seconds=round(pause_until - now, 3))
