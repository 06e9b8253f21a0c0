"""Persisted record types.

Every record is a ``msgspec.Struct`` whose first field is ``version``. The codec
(``storage.codec``) decodes strictly: a record whose version is unknown, or that
fails validation, is *unreadable* — listed by id, never rewritten or deleted.

Payloads (the frozen request body, the original request, the validated
completion) are opaque bytes in their own table so that operation records stay
small and cheap to rewrite on every state change.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from recoverable.failure_policy import FailureReason as FailureReason
from recoverable.failure_policy import RetryPolicy
from recoverable.outcome import Interruption, ModelPrice, Usage
from recoverable.types import (
    AccountBinding,
    AttemptReason,
    SourceRef,
    StructuredRequest,
    SupersededReason,
)

OPERATION_VERSION = 2
COMMAND_VERSION = 1
LEASE_VERSION = 1
DISPOSITION_VERSION = 1

# The persisted phase of an operation. "interrupted" is never stored: a record in
# "authorizing"/"transmitting" whose lease has no live owner *reads* as interrupted.
Phase = Literal[
    "prepared",  # saved, never authorized
    "authorizing",  # a pending attempt id is saved; the host is being asked
    "transmitting",  # an attempt is consumed; the POST may be in flight
    "waiting",  # a replacement is eligible at next_attempt_at
    "completed",  # a validated completion is saved (receipt)
    "failed",  # terminal failure (see failure_reason)
    "suspended",  # suspended by the owner task's cancellation or by a suspend command
    "cancelled",  # permanently cancelled
    # Terminal: its source changed or was deleted, or a newer revision of its
    # job arrived; any completion was discarded (never saved, or removed unread).
    "superseded",
]

PayloadKind = Literal["body", "request", "completion"]

AttemptOutcome = Literal["in_flight", "failed", "completed", "interrupted"]

# What an interrupted attempt (disconnect, idle timeout, malformed stream, a crash or a
# lost lease while it was in flight) means for the operation: "replace" (seed 000: a
# replacement is eligible after the cooldown) or "fail" (it ends ``failed`` with
# ``failure_reason="interrupted"``, never replaced; a new action is needed).
OnInterruption = Literal["replace", "fail"]

# ``gc=False`` on every record below (and on the values they hold: ``outcome.Usage``,
# ``outcome.Interruption``, ``types.AccountBinding``, ``failure_policy.RetryPolicy``):
# the cyclic garbage collector never tracks them. Safe because no reference cycle can
# pass through them: they are frozen, and their fields hold only scalars, strings and
# tuples/frozensets of such frozen values, all of which exist before the record that
# refers to them — nothing can point back. Reference counting frees them. It matters
# for throughput: thousands of decoded records are alive at once in a busy runtime and
# every collection used to walk them (bench/results/profile-2026-11-30.md).


class PendingAttempt(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    attempt_id: str
    number: int
    reason: AttemptReason


class AttemptRecord(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    attempt_id: str
    number: int
    reason: AttemptReason
    consumed_at: float
    outcome: AttemptOutcome = "in_flight"
    response_id: str | None = None
    sequence_number: int | None = None
    failure: Interruption | None = None
    # The tokens the provider reported for this attempt (added after version 2 was
    # released: optional, so records written before decode unchanged; None = not reported).
    usage: Usage | None = None
    # Reattachment (optional, so records written before decode unchanged). For an
    # operation prepared with ``reattach=True``, ``response_id`` and ``sequence_number``
    # above are its reattachment checkpoint (saved fenced, the cursor never goes back):
    # ``checkpoint_at`` is when the cursor was last saved, ``reattachments`` how many
    # times a later execution (or the same one after a disconnect) resumed this attempt's
    # response by GET instead of generating it again (bounded per attempt).
    checkpoint_at: float | None = None
    reattachments: int = 0
    # The provider was asked to cancel this attempt's background response after
    # the operation was cancelled (best effort; None = not asked).
    server_cancel: str | None = None
    # Why this attempt's saved response id cannot be resumed (None: it can, as far as is
    # known): ``"background_ignored"`` when the server's response object did not say
    # ``background: true`` (a proxy that dropped the flag; nothing is stored to resume).
    not_resumable: str | None = None

    @property
    def reattached(self) -> bool:
        """This attempt's completion came by reattachment (a resume GET)."""
        return self.outcome == "completed" and self.reattachments > 0


class RetryReservation(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """Saved on the source before the successor exists (crash-safe manual retry)."""

    retry_action_id: str
    successor_id: str
    settings_hash: str
    created: bool = False


# The state of an opt-in continuation after a terminal stream failure
# (``recoverable.continuation``): "pending" until its persisted due time, "dispatched"
# once its one successor exists, "cancelled" when something invalidated it before
# dispatch, "declined" when the preference was on but the failure did not qualify.
ContinuationState = Literal["pending", "dispatched", "cancelled", "declined"]


class ContinuationRecord(msgspec.Struct, frozen=True, gc=False, kw_only=True,
                         forbid_unknown_fields=True):
    """The one durable dispatch record of a failed operation's continuation.

    Kept on the failed operation itself (so it is keyed by it, written in the same fenced
    transaction that ended the operation, and removed with it by acknowledge, abandon or
    purge). ``reason`` is a stable code (``continuation.Reason``), never provider text."""

    state: ContinuationState
    reason: str
    decided_at: float
    due_at: float | None = None  # wall-clock seconds: the dispatch is eligible from then on
    budget: int = 0  # the lineage's continuation budget when it was decided
    successor_id: str | None = None  # the deterministic successor (once dispatched)


class OperationRecord(
    msgspec.Struct, frozen=True, gc=False, kw_only=True, forbid_unknown_fields=True
):
    version: int = OPERATION_VERSION
    operation_id: str
    account: AccountBinding
    endpoint_id: str
    created_at: float
    phase: Phase = "prepared"
    maximum_attempts: int
    attempts_used: int = 0
    attempts: tuple[AttemptRecord, ...] = ()
    pending: PendingAttempt | None = None
    next_attempt_at: float | None = None
    expires_at: float | None = None
    retry_policy: RetryPolicy = RetryPolicy()
    model: str
    reasoning_effort: str | None = None
    model_override: bool = False
    format_name: str
    format_hash: str
    contract_version: str | None = None
    scope: str | None = None
    job_id: str | None = None
    input_revision: str | None = None
    body_hash: str
    root_operation_id: str
    previous_operation_id: str | None = None
    retry_reservation: RetryReservation | None = None
    last_failure: Interruption | None = None
    failure_reason: FailureReason | None = None
    renew_next: bool = False  # the next attempt is a 401 authentication reissue
    completed_at: float | None = None
    fence: int = 0  # generation fence: incremented by every lease acquisition
    upgraded_from: int | None = None  # set when migrated from an older record version
    # The typed connect failure (transport.connect.ConnectKind) seen while trying to send
    # the pending attempt; no budget was spent for it. Cleared when an attempt is consumed.
    endpoint_failure: str | None = None
    # The optional token budget of this operation: once the output tokens reported across
    # its attempts reach it, no replacement is authorized (added after version 2 was
    # released: optional, so records written before decode unchanged; None = no budget).
    maximum_output_tokens_total: int | None = None
    # The optional cost budget (USD) and the price it is counted at, frozen at admission
    # (the request's model and service tier; a price list that changes later never changes
    # what this operation's budget counts): once the cost of the usage reported across its
    # attempts reaches the budget, no replacement is authorized. The service tier the
    # request asked for (priced by the ledger). Optional: older records decode unchanged.
    maximum_cost_total: float | None = None
    cost_price: ModelPrice | None = None
    service_tier: str | None = None
    # The interruption policy chosen at prepare (added after version 2 was released:
    # optional, so records written before decode unchanged, as "replace").
    on_interruption: OnInterruption = "replace"
    # A live operation: partial views may be shown while it streams, so its
    # interruptions are never replaced (on_interruption is "fail"). Optional: records
    # written before decode unchanged, as not live.
    live: bool = False
    # Source-bound results: the source this operation's result is derived from, at a digest (an
    # admission field; None: not source-bound), the hard timeout of each of its attempts
    # in seconds (shorter than the lease; None: none), and why it was superseded.
    # Optional: records written before decode unchanged.
    source: SourceRef | None = None
    attempt_timeout: float | None = None
    superseded_reason: SupersededReason | None = None
    # Reattachment, chosen at prepare (an admission field, never changed): the frozen body asks
    # for a background, stored response, and an interrupted attempt is first resumed by
    # its saved response id (no new POST, no budget) before seed 000 replaces it.
    reattach: bool = False

    @property
    def reattachments(self) -> int:
        """The resume GETs started across every attempt of this operation."""
        return sum(attempt.reattachments for attempt in self.attempts)
    # The continuation dispatch record of this failed operation (None: none was
    # decided), and how many automatic continuations its lineage already used (carried to
    # every successor, manual ones included: the continuation budget never resets).
    continuation: ContinuationRecord | None = None
    continuations_used: int = 0
    # A thread turn the host committed (``actors/thread.py``): its saved input
    # and validated output are the history of the thread's next turn.
    thread_committed: bool = False
    # Unclaimed work: submitted for workers; once no live worker of its account and endpoint
    # has served it for this many seconds, any sweep ends it ``failed``/``no_worker``
    # (an admission field, saved by ``submit``; None: not bounded, e.g. prepared only).
    # Optional: records written before decode unchanged.
    unclaimed_after: float | None = None

    @property
    def attempts_remaining(self) -> int:
        return max(0, self.maximum_attempts - self.attempts_used)

    @property
    def usage(self) -> Usage:
        """The tokens reported across every attempt of this operation (zeros if none)."""
        total = Usage()
        for attempt in self.attempts:
            if attempt.usage is not None:
                total = total + attempt.usage
        return total

    @property
    def token_budget_spent(self) -> bool:
        """The output tokens reported so far reached ``maximum_output_tokens_total``."""
        limit = self.maximum_output_tokens_total
        return limit is not None and self.usage.output_tokens >= limit

    @property
    def cost(self) -> float | None:
        """USD of the usage reported so far at the admitted price (None: no cost budget)."""
        return None if self.cost_price is None else self.cost_price.cost(self.usage)

    @property
    def cost_budget_spent(self) -> bool:
        """The cost of the usage reported so far reached ``maximum_cost_total`` (a budget
        without its price, which ``prepare`` never saves, counts as spent: fail closed)."""
        limit, cost = self.maximum_cost_total, self.cost
        return limit is not None and (cost is None or cost >= limit)

    @property
    def has_completion(self) -> bool:
        return self.completed_at is not None

    @property
    def awaiting_upgrade(self) -> bool:
        """A version-1 record read through the upgrader but not rewritten yet: its body is
        frozen (and its completion moved to a payload) by ``storage.migration``."""
        return self.upgraded_from == 1 and not self.body_hash


CommandKind = Literal["suspend", "cancel"]


class CommandRecord(
    msgspec.Struct, frozen=True, gc=False, kw_only=True, forbid_unknown_fields=True
):
    """A lifecycle command written by any runtime; the owner's monitor reacts to it."""

    version: int = COMMAND_VERSION
    operation_id: str
    kind: CommandKind
    issued_at: float
    serial: int  # increases with every command written to the store


class LeaseRecord(msgspec.Struct, frozen=True, gc=False, kw_only=True, forbid_unknown_fields=True):
    """Names the owner (a store opener holding an flock) and the acquisition's fence."""

    version: int = LEASE_VERSION
    operation_id: str
    owner_id: str
    token: str  # unique per acquisition (two tasks of one process are told apart)
    fence: int
    acquired_at: float
    # Wall-clock seconds (the clock every process shares) after which the lease is no
    # longer live, even while its owner's lock is held (a hung owner is reclaimable);
    # moved forward by each renewal. None (rows written before leases expired): the
    # lease lives as long as its owner process (added after version 1 was released:
    # optional, so rows written before decode unchanged).
    expires_at: float | None = None


Disposition = Literal["acknowledged", "abandoned"]


class DispositionRecord(
    msgspec.Struct, frozen=True, gc=False, kw_only=True, forbid_unknown_fields=True
):
    """The small marker left after acknowledge/abandon (content removed)."""

    version: int = DISPOSITION_VERSION
    operation_id: str
    disposition: Disposition
    at: float
    account: AccountBinding
    scope: str | None = None
    job_id: str | None = None
    input_revision: str | None = None
    root_operation_id: str | None = None
    previous_operation_id: str | None = None
    attempts_used: int = 0
    maximum_attempts: int = 0
    removal_complete: bool = False  # payloads and the operation record are gone
    # The tokens reported across the operation's attempts (counts only; added after
    # version 1 was released: optional, so markers written before decode unchanged).
    usage: Usage | None = None


class StoredRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The original request and contract (payload kind "request"), kept for reselection."""

    version: int = 1
    request: StructuredRequest
    format_name: str
    schema: dict[str, Any]
