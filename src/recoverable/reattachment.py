"""Reattach instead of regenerate: the machine's rules for background responses.

An operation prepared with ``reattach=True`` sends a body frozen with ``background: true,
store: true``: the provider keeps generating the response when the client goes away, and
keeps it (for a limited time) retrievable by its id. The attempt's ``response_id`` and
``sequence_number`` are its **reattachment checkpoint**, saved fenced by the lease's
generation (:func:`checkpoint`; the cursor never goes back). The frozen body never
changes; only this checkpoint does (seed 004: "immutable except for its fenced session
checkpoint").

Seed 004's rule: recovery may resume only where the external operation has a durable
reattachment contract. So before seed 000 replaces an attempt that was interrupted
(disconnect, idle timeout, premature end, a crash, a lost lease, a suspension), the next
step is :class:`~recoverable.transitions.Reattach`: resume the saved response after the
saved cursor — no new POST, no authorization, no budget. The attempt stays the same
attempt (in flight again), its ``reattachments`` count is saved before the GET (like a
consumed attempt), and it is bounded (:data:`MAX_REATTACHMENTS` per attempt): after that,
or when the response is gone (``reattach_unavailable``), failed, incomplete or cancelled
on the server, the attempt closes with that typed interruption and the seed-000 table
decides (a replacement within the budget, or a terminal failure). A reattached completion
is validated and saved like a streamed one (``completion_validated``).

Pure; no I/O, no clock: callers pass ``now``.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from recoverable.outcome import Interruption, Usage
from recoverable.preconditions import is_expired
from recoverable.records import AttemptRecord, OperationRecord
from recoverable.transitions import (
    Context,
    Reattach,
    Transition,
    evolve,
    moved,
    require_in_flight,
    with_last_attempt,
)

__all__ = [
    "BACKGROUND_IGNORED",
    "CHECKPOINT_EVERY_EVENTS",
    "CHECKPOINT_EVERY_SECONDS",
    "MAX_REATTACHMENTS",
    "REATTACHABLE_KINDS",
    "after_failure",
    "at_open",
    "begin",
    "can_resume",
    "checkpoint",
    "checkpoint_due",
    "closed_attempt",
    "keeps_through_owner_loss",
    "lease_lost",
    "reattach_target",
]

# Resume GETs started for one attempt before it closes and seed 000 decides. Each one is
# bounded in time by the stream's idle timeout and the lease's transport deadline.
MAX_REATTACHMENTS: Final = 3

# How an attempt may have ended and still be resumed: the client lost the stream, not the
# server the response. A provider failure, an incomplete or refused response, a bound, a
# malformed stream or tool activity is never resumed (the table decides those).
REATTACHABLE_KINDS: Final = frozenset({"disconnected", "timeout", "premature_eof", "interrupted"})

# The cursor (``sequence_number``) is saved at bounded intervals, not per event: every
# CHECKPOINT_EVERY_EVENTS events or CHECKPOINT_EVERY_SECONDS, whichever comes first (the
# response id is saved at once, with ``response.created``). bench/reattach.py measures it.
CHECKPOINT_EVERY_EVENTS: Final = 256
# ``AttemptRecord.not_resumable``: the server answered a background POST with a response
# that is not a background one (``background`` absent or false): it stores nothing to
# resume (the LiteLLM proxy, bridging a model to chat completions, drops the flag).
BACKGROUND_IGNORED: Final = "background_ignored"
CHECKPOINT_EVERY_SECONDS: Final = 1.0


def reattach_target(rec: OperationRecord) -> AttemptRecord | None:
    """The last attempt when it can be resumed by its saved response id, else ``None``.

    It can when the operation was prepared with ``reattach=True``, has no completion, the
    attempt has a saved response id and reattachment tries left, and it is either still
    marked in flight (its owner died) or closed by one of :data:`REATTACHABLE_KINDS`.
    """
    if not rec.reattach or not rec.attempts or rec.has_completion:
        return None
    last = rec.attempts[-1]
    if last.response_id is None or last.reattachments >= MAX_REATTACHMENTS:
        return None
    if last.not_resumable is not None:
        return None
    if last.outcome == "in_flight":
        return last
    failure = last.failure
    if (
        last.outcome in ("interrupted", "failed")
        and failure is not None
        and failure.kind in REATTACHABLE_KINDS
        and not failure.had_tool_activity
    ):
        return last
    return None


def _account_allows(rec: OperationRecord, ctx: Context) -> bool:
    if ctx.account is None or ctx.account != rec.account:
        return False
    return ctx.credentials_account is None or ctx.credentials_account == rec.account


def begin(rec: OperationRecord, last: AttemptRecord) -> Transition:
    """The :class:`Reattach` step: the attempt is in flight again (``transmitting``) with
    one more reattachment counted; the driver saves this before its first GET."""
    assert last.response_id is not None
    reopened = msgspec.structs.replace(
        last, outcome="in_flight", failure=None, reattachments=last.reattachments + 1
    )
    new = with_last_attempt(rec, reopened)
    new = evolve(new, phase="transmitting", pending=None, next_attempt_at=None)
    return moved(rec, new, Reattach(last.attempt_id, last.response_id, last.sequence_number))


def at_open(rec: OperationRecord, ctx: Context) -> Transition | None:
    """An execution opens (after the account, cancel, format, completion and body checks of
    ``open_operation``): reattach first when the last attempt can be resumed.

    A record left ``failed`` or ``cancelled`` is never reopened; an expired one is not
    resumed (seed 000 says what it means). The saved cooldown (``next_attempt_at``) is
    not waited: it paces replacements, and a reattachment is not one.
    """
    if rec.phase not in ("transmitting", "waiting", "suspended", "authorizing"):
        return None
    if is_expired(rec, ctx.now) or not _account_allows(rec, ctx):
        return None
    last = reattach_target(rec)
    return None if last is None else begin(rec, last)


def after_failure(
    rec: OperationRecord, attempt_id: str, failure: Interruption, ctx: Context
) -> Transition | None:
    """The attempt in flight lost its stream in this execution (``attempt_failed``): resume
    it instead of closing it, when it can be resumed and nothing forbids going on (no
    lifecycle command, the same account, not expired). ``None``: the machine closes it."""
    last = require_in_flight("attempt_failed", rec, attempt_id)
    if not rec.reattach or ctx.command is not None or is_expired(rec, ctx.now):
        return None
    if not _account_allows(rec, ctx):
        return None
    closed = _closed(last, failure)
    target = reattach_target(with_last_attempt(rec, closed))
    if target is None:
        return None
    # The record says what happened to the stream (``last_failure``); the attempt itself is
    # in flight again, with no failure of its own.
    step = begin(with_last_attempt(rec, closed, last_failure=closed.failure), target)
    return Transition(step.record, step.action, True)


def _closed(last: AttemptRecord, failure: Interruption) -> AttemptRecord:
    """The attempt as this failure would close it, its checkpoint merged (never backwards)."""
    return msgspec.structs.replace(
        last,
        outcome="failed",
        response_id=last.response_id or failure.response_id,
        sequence_number=_later(last.sequence_number, failure.sequence_number),
        failure=msgspec.structs.replace(failure, usage=None, usage_malformed=False,
                                        rate_limits=None),
        usage=failure.usage if failure.usage is not None else last.usage,
    )


def closed_attempt(
    rec: OperationRecord, last: AttemptRecord, outcome: Literal["failed", "completed"], *,
    response_id: str | None, sequence_number: int | None,
    failure: Interruption | None, usage: Usage | None,
) -> AttemptRecord:
    """The attempt ``last`` closed with ``outcome``, with the response id and cursor it ends
    with. For a ``reattach=True`` operation they are its checkpoint: the saved id is kept
    and the cursor never goes backwards. Otherwise (diagnostics only) the last report
    wins."""
    if rec.reattach:
        response_id = last.response_id or response_id
        sequence_number = _later(last.sequence_number, sequence_number)
    else:
        response_id = response_id or last.response_id
        if sequence_number is None:
            sequence_number = last.sequence_number
    return msgspec.structs.replace(
        last, outcome=outcome, response_id=response_id, sequence_number=sequence_number,
        failure=failure, usage=usage,
    )


def _later(saved: int | None, seen: int | None) -> int | None:
    if seen is None:
        return saved
    if saved is None:
        return seen
    return max(saved, seen)


def checkpoint(
    rec: OperationRecord,
    attempt_id: str,
    response_id: str | None,
    sequence_number: int | None,
    now: float,
    background: bool | None = None,
) -> Transition:
    """Save the attempt's reattachment checkpoint (a fenced write by the driver).

    The response id is taken once (the first one seen; the stream of one attempt is one
    response) and the cursor only moves forward: an event at or below the saved number
    is never applied twice, so the saved number never goes backwards. ``background``
    is what the stream's response object said (``Progress.background``): ``False`` on an
    operation prepared with ``reattach=True`` means the server ignored the flag, and the
    attempt is saved as not resumable (``not_resumable="background_ignored"``: no resume
    GET is ever spent on it; seed 000 replaces it after an interruption).
    """
    last = require_in_flight("checkpoint", rec, attempt_id)
    ignored = rec.reattach and background is False and last.not_resumable is None
    saved = msgspec.structs.replace(
        last,
        response_id=last.response_id or response_id,
        sequence_number=_later(last.sequence_number, sequence_number),
        not_resumable=BACKGROUND_IGNORED if ignored else last.not_resumable,
    )
    if saved == last:
        return moved(rec, rec, None)
    saved = msgspec.structs.replace(saved, checkpoint_at=now)
    return moved(rec, with_last_attempt(rec, saved), None)


def checkpoint_due(
    saved: AttemptRecord,
    response_id: str | None,
    sequence_number: int | None,
    *,
    events_since: int,
    seconds_since: float,
) -> bool:
    """Whether the driver writes a checkpoint now: at once for a new response id, then for
    the cursor every :data:`CHECKPOINT_EVERY_EVENTS` events or
    :data:`CHECKPOINT_EVERY_SECONDS`, whichever comes first."""
    if response_id is not None and saved.response_id is None:
        return True
    if sequence_number is None or saved.response_id is None:
        return False
    if saved.sequence_number is not None and sequence_number <= saved.sequence_number:
        return False
    return events_since >= CHECKPOINT_EVERY_EVENTS or seconds_since >= CHECKPOINT_EVERY_SECONDS


def can_resume(rec: OperationRecord, now: float) -> bool:
    """The operation can still run by resuming its last attempt's saved response (an
    execution opening it now would reattach, spending no budget): manual retry refuses
    it ("resume it instead") even when its attempt budget is spent."""
    return (
        rec.phase in ("transmitting", "waiting", "suspended", "authorizing")
        and not is_expired(rec, now)
        and reattach_target(rec) is not None
    )


def keeps_through_owner_loss(closed: OperationRecord) -> bool:
    """``owner_lost``: the closed attempt can still be resumed, so neither a spent budget
    nor ``on_interruption="fail"`` ends the operation yet (a reattachment spends no
    budget and replaces nothing); the next owner resumes it first."""
    return reattach_target(closed) is not None


def lease_lost(
    rec: OperationRecord,
    attempt_id: str,
    response_id: str | None,
    sequence_number: int | None,
    now: float,
    background: bool | None = None,
) -> Transition | None:
    """An execution lost its lease mid-stream: when the attempt can be resumed it stays in
    flight with its latest checkpoint (the next owner reattaches; no reattachment is
    counted for a GET that never happens). ``None``: close it as an interruption."""
    if not rec.reattach:
        return None
    step = checkpoint(rec, attempt_id, response_id, sequence_number, now, background)
    return step if reattach_target(step.record) is not None else None
