"""Public value types: what hosts build, persist and read.

Values that cross a boundary (disk, wire, the host's own store) are frozen
``msgspec.Struct`` types so they encode deterministically and decode strictly.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any, Literal

import msgspec

from recoverable.failure_policy import RetryPolicy as RetryPolicy  # saved with each operation
from recoverable.outcome import Interruption, Usage
from recoverable.output_roots import decode_as
from recoverable.output_types import JsonSchema as JsonSchema  # a response contract
from recoverable.wire_parameters import parameters_from_wire

AttemptReason = Literal["initial", "replacement", "authentication_reissue"]
Selection = Literal["preserve", "reselect"]

State = Literal[
    "prepared",
    "running",
    "interrupted",
    "completed",
    "failed",
    "cancelled",
    "suspended",
    "acknowledged",
    "abandoned",
    "superseded",  # its source changed or was deleted: no result of it may count
]
Availability = Literal[
    "ready",
    "running",
    "waiting",
    "replacement_eligible",
    "completion_saved",
    "suspended",
    "exhausted",
    "authentication_required",
    "permanently_cancelled",
    "failed",
    "expired",
    "acknowledged",
    "abandoned",
    "blocked",
    "endpoint_unavailable",  # the endpoint could not be connected to; nothing was spent
    "superseded",  # its source changed or was deleted: prepare a new operation
    # Failed, and an opt-in continuation is pending: a worker creates its one
    # successor at ``Status.continuation.due_at`` unless something cancels it first
    "continuation_pending",
]
Blocker = Literal[
    "endpoint_unavailable",
    "authentication_required",
    "account_mismatch",
    "configuration_unavailable",
    "incompatible_record",
    "storage_unavailable",
]
SuggestedAction = Literal[
    "execute",
    "resume",
    "read_receipt",
    "manual_retry",
    "use_successor",
    "sign_in",
    "acknowledge",
    "abandon",
    "wait",
]


class AccountBinding(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """The account (and credential source) an operation belongs to. Compared by value."""

    account_id: str
    source: str = "api-key"


class StructuredRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A tool-free structured request as the host describes it.

    ``input`` is a string or a list of Responses input items. The optional Responses
    parameters below are validated at prepare (``InvalidParameter`` naming the parameter)
    and frozen into the body only when set, so a request that leaves them ``None`` has
    the same frozen body as before they existed. ``verbosity`` is sent as
    ``text.verbosity``, ``reasoning_<name>`` as ``reasoning.<name>`` (effort, summary,
    mode, context); every other name is the wire name. See
    docs/parameters.md for the value ranges.

    ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``previous_response_id``,
    ``conversation``, ``store``, ``background`` and ``prompt`` exist only so that they
    can be refused explicitly (their no-op values ``[]``, ``"none"``, ``False`` are
    accepted): recovery never runs tools, keeps nothing on the provider and never
    continues a thread. A misspelled keyword is a ``TypeError`` naming it;
    ``StructuredRequest.from_params`` takes a Responses create body (wire names) and
    refuses unknown names with ``InvalidParameter``.
    """

    model: str
    instructions: str | None = None
    input: str | list[dict[str, Any]] = ""
    reasoning_effort: str | None = None
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: str | None = None
    previous_response_id: str | None = None
    conversation: str | None = None
    model_override: bool = False  # an explicit per-request model choice (binding on reselect)
    # Optional Responses parameters: omitted from the body while None.
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    user: str | None = None
    truncation: str | None = None
    verbosity: str | None = None  # text.verbosity
    reasoning_summary: str | None = None  # reasoning.summary
    reasoning_mode: str | None = None  # reasoning.mode
    reasoning_context: str | None = None  # reasoning.context
    include: list[str] | None = None
    moderation: dict[str, Any] | None = None
    # Refused unless None or their no-op value (server-side state or tools).
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None

    @classmethod
    def from_params(cls, params: Any) -> StructuredRequest:
        """Build a request from a Responses create body (wire names, e.g. a Batch API
        ``body`` without ``text.format``). Raises ``InvalidParameter`` naming any unknown,
        refused or malformed parameter; values are checked again at prepare."""
        return cls(**parameters_from_wire(params))


# Why an operation is ``superseded`` (docs/sources.md): its source's digest
# changed, its source was deleted, or a newer revision of its batch job arrived.
SupersededReason = Literal["source_changed", "source_deleted", "newer_revision"]


class SourceRef(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """The source an operation's result is derived from, at a digest (a source-bound result).

    ``key`` names the source in the host's terms (a document id, a record id); ``digest``
    is the host's digest of the source's current content. Both are bounded text, checked
    at prepare (``InvalidParameter``, ``parameter="source"``): see
    ``recoverable.sources_rules``. The store's source manifest (``store.set_source``)
    says which digest is current; a result is saved only while its digest is.
    """

    key: str
    digest: str


class Handle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the host persists to reopen an operation. Encode with ``msgspec.json``."""

    operation_id: str
    root_operation_id: str | None = None
    previous_operation_id: str | None = None


class Attempt(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """Passed to the host's ``authorize`` callback; ``attempt_id`` is stable across replays."""

    operation_id: str
    attempt_id: str
    number: int
    maximum_attempts: int
    reason: AttemptReason
    previous_failure: Interruption | None = None
    previous_response_id: str | None = None
    previous_sequence_number: int | None = None


class AttemptSummary(msgspec.Struct, frozen=True, kw_only=True):
    attempt_id: str
    number: int
    reason: AttemptReason
    outcome: str  # in_flight | failed | completed | interrupted
    response_id: str | None = None
    sequence_number: int | None = None
    failure: Interruption | None = None
    usage: Usage | None = None  # the tokens the provider reported (None: not reported)
    # Reattachment (reattach=True): resume GETs of this attempt's saved response, whether its
    # completion came by one, and what the provider answered to its cancel (if asked).
    reattachments: int = 0
    reattached: bool = False
    server_cancel: str | None = None
    # Why its saved response id cannot be resumed (``"background_ignored"``: the server
    # did not keep it as a background response); None: nothing known against it.
    not_resumable: str | None = None


class ContinuationStatus(msgspec.Struct, frozen=True, kw_only=True):
    """A failed operation's opt-in continuation (docs/continuation.md).

    ``state``: ``pending`` (a successor is created at ``due_at``), ``dispatched`` (it
    exists: ``successor_id``), ``cancelled`` (something invalidated it before dispatch:
    ``reason``) or ``declined`` (the preference was on but the failure did not qualify:
    ``reason``). ``budget_left``: automatic continuations the lineage may still use
    (a pending one included, a dispatched one not)."""

    state: Literal["pending", "dispatched", "cancelled", "declined"]
    reason: str
    due_at: _dt.datetime | None = None
    budget_left: int = 0
    successor_id: str | None = None


class Status(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of an operation's independent dimensions (not an authorization token)."""

    operation_id: str
    state: State
    availability: Availability
    blockers: frozenset[Blocker] = frozenset()
    has_saved_completion: bool = False
    attempts_used: int = 0
    maximum_attempts: int = 0
    attempts_remaining: int = 0
    next_attempt_at: _dt.datetime | None = None
    expires_at: _dt.datetime | None = None
    root_operation_id: str | None = None
    previous_operation_id: str | None = None
    successor_id: str | None = None
    attempts: tuple[AttemptSummary, ...] = ()
    response_id: str | None = None
    sequence_number: int | None = None
    last_failure: Interruption | None = None
    suggested_actions: tuple[SuggestedAction, ...] = ()
    redacted: bool = False
    model: str | None = None
    job_id: str | None = None
    input_revision: str | None = None
    scope: str | None = None
    pending_attempt_id: str | None = None
    # The typed connect failure (connect_refused, dns_failure, tls_failure, connect_timeout,
    # handshake_failed, connect_failed) while availability is "endpoint_unavailable".
    endpoint_failure: str | None = None
    # The tokens reported across every attempt (replacements included), and the saved
    # output-token budget (None: none) — see docs/usage.md.
    usage: Usage = Usage()
    maximum_output_tokens_total: int | None = None
    # The saved cost budget (USD; None: none) and the cost of ``usage`` at the price it
    # was admitted with (None without a budget).
    maximum_cost_total: float | None = None
    cost: float | None = None
    # Waiting for the rate governor (docs/rate-limits.md): "paused" (a shared 429 pause
    # of its endpoint and account, seen from any process), "requests" or "tokens" (the
    # per-minute budget, in the runtime that runs it), and until when (an estimate).
    rate_limited: Literal["paused", "requests", "tokens"] | None = None
    rate_limited_until: _dt.datetime | None = None
    # Submitted for workers (docs/workers.md): "queued" (a live worker serves its account
    # and endpoint), "resuming" (suspended by a stopping worker; the next one resumes it)
    # or "waiting_for_worker" (no live worker serves its account and endpoint).
    queue: Literal["queued", "resuming", "waiting_for_worker"] | None = None
    # Why nothing runs it: with "waiting_for_worker", "no_worker_for_endpoint" (no live worker
    # serves its endpoint) or "no_worker_for_account" (live workers serve its endpoint for
    # other accounts only), and when it ends failed/no_worker if no worker comes by then
    # (its saved unclaimed bound; None: none). With the blocker "incompatible_record":
    # "damaged_queue_row" or "damaged_lease_row" (no worker would ever run it).
    queue_reason: Literal[
        "no_worker_for_endpoint", "no_worker_for_account", "damaged_queue_row",
        "damaged_lease_row",
    ] | None = None
    no_worker_at: _dt.datetime | None = None
    # Who runs it now: the owner id (an opaque store-opener id, not an account)
    # of the live lease and when that lease expires unless renewed (None: no live lease,
    # or a lease without expiry), and the generation fence (incremented by every claim).
    lease_owner: str | None = None
    lease_expires_at: _dt.datetime | None = None
    fence: int = 0
    # The source it is bound to (None: not source-bound), and why it was
    # superseded while its state is "superseded".
    source: SourceRef | None = None
    superseded_reason: SupersededReason | None = None
    # Reattachment (docs/reattach.md): prepared with reattach=True; the resume GETs across its
    # attempts; whether its saved result came by reattachment (no second generation).
    reattach: bool = False
    reattachments: int = 0
    reattached: bool = False
    # The opt-in continuation decided for this failed operation, if any.
    continuation: ContinuationStatus | None = None


class Receipt(msgspec.Struct, frozen=True, kw_only=True):
    """A saved, validated completion; decode ``payload`` with the original type."""

    operation_id: str
    payload: bytes
    format_name: str
    format_hash: str
    contract_version: str | None
    job_id: str | None
    input_revision: str | None
    scope: str | None
    completed_at: _dt.datetime
    root_operation_id: str
    previous_operation_id: str | None
    response_id: str | None
    account: AccountBinding
    # The tokens reported across every attempt of the operation, including the attempts
    # replaced before this result (what the result cost).
    usage: Usage = Usage()
    # The result came by reattachment (a resume GET of the saved background
    # response, no second generation), and the resume GETs across the operation.
    reattached: bool = False
    reattachments: int = 0

    def decode(self, type: Any) -> Any:
        """Decode the payload as ``type``: the ``response=`` type (a msgspec Struct, a pydantic
        model, a dataclass, a TypedDict, a non-object root such as ``list[Item]``, sent and
        saved wrapped as ``{"items": ...}``), ``dict`` etc., or a ``JsonSchema`` (plain
        JSON)."""
        return decode_as(self.payload, type)


class Inventory(msgspec.Struct, frozen=True, kw_only=True):
    operations: tuple[Status, ...]
    unreadable: tuple[str, ...]


class CleanupResult(msgspec.Struct, frozen=True, kw_only=True):
    removed: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()  # busy or unreadable: reported, never guessed


def to_datetime(ts: float | None) -> _dt.datetime | None:
    if ts is None:
        return None
    return _dt.datetime.fromtimestamp(ts, tz=_dt.UTC)


def to_timestamp(value: _dt.datetime | None) -> float | None:
    if value is None:
        return None
    if value.tzinfo is None:
        raise ValueError("datetimes must be timezone-aware (UTC)")
    return value.timestamp()
