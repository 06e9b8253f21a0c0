"""The operation page's account of what happened: the failure in a person's words and what
to do about it (the very sentences the CLI prints: the typed error the record stands for,
``failure_errors.ended_error``, and ``describe_interruption`` for each attempt), the
operation's and each attempt's times as the store recorded them, and its lineage as a
short chain of linked operations.

A time the store does not record is shown as "-" (its tooltip says it is not recorded);
nothing is estimated. Every value is escaped here; no prompt, output, token or account is
read.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Final

import attrs

from recoverable import errors
from recoverable.dashboard.html import full_time, operation_link
from recoverable.failure_errors import ended_error
from recoverable.failure_text import describe_interruption
from recoverable.outcome import Interruption
from recoverable.records import AttemptRecord, DispositionRecord, OperationRecord
from recoverable.storage.base import Store

__all__ = [
    "Chain",
    "Explanation",
    "attempt_timing",
    "explain",
    "explanation_html",
    "failure_sentence",
    "lineage_chain",
    "lineage_html",
    "time_rows",
    "updated_at",
]

MAX_CHAIN_STEPS: Final = 8  # operations read each way along a lineage (one read each)
NOT_RECORDED: Final = "not recorded in the store"


@attrs.frozen
class Explanation:
    """What happened to the operation and what to do, as the CLI says it."""

    code: str  # the typed error's code (``attempts_exhausted``, ``provider_error``...)
    what: str
    todo: str


def explain(record: OperationRecord | None) -> Explanation | None:
    """The failed operation's explanation: the error its record stands for (what the CLI's
    batch prints for it); None for an operation that did not fail."""
    if record is None or record.phase != "failed":
        return None
    error = ended_error(record)
    return Explanation(code=error.code, what=error.what_happened(), todo=error.what_to_do())


def failure_sentence(failure: Interruption | None) -> str:
    """One attempt's failure in words (the CLI's ``describe_interruption``), or "-"."""
    return "-" if failure is None else describe_interruption(failure)


@attrs.frozen
class Chain:
    """An operation's lineage: the operations before it (oldest first) and after it."""

    root: str | None  # the lineage's root, when it is not among ``before``
    gap: bool  # some operations between ``root`` and ``before`` were not read
    before: tuple[str, ...]
    current: str
    after: tuple[str, ...]


def _successor(record: OperationRecord) -> str | None:
    """The operation made from this one: a manual retry's, else a dispatched
    continuation's."""
    if record.retry_reservation is not None:
        return record.retry_reservation.successor_id
    if record.continuation is not None:
        return record.continuation.successor_id
    return None


def _read(store: Store, operation_id: str) -> OperationRecord | DispositionRecord | None:
    """The operation's record or marker (None: neither, or unreadable)."""
    try:
        marker = store.get_disposition(operation_id)
        return marker if marker is not None else store.get_operation(operation_id)
    except errors.RecoveryError:
        return None


def lineage_chain(
    store: Store, operation_id: str, *, root: str | None, previous: str | None,
    successor: str | None,
) -> Chain:
    """Walk the lineage from the store, at most :data:`MAX_CHAIN_STEPS` operations each
    way; an operation the store does not hold (purged, or a successor only reserved) ends
    the walk, so every link of the chain leads to a page."""
    before: list[str] = []
    earliest_previous: str | None = None  # where the walk back stopped
    step = previous
    while step is not None and len(before) < MAX_CHAIN_STEPS and step not in before:
        found = _read(store, step)
        if found is None:
            earliest_previous = step
            break
        before.append(step)
        step = earliest_previous = found.previous_operation_id
    before.reverse()
    after: list[str] = []
    step = successor
    while step is not None and len(after) < MAX_CHAIN_STEPS and step not in after:
        found = _read(store, step)
        if found is None:
            break
        after.append(step)
        step = _successor(found) if isinstance(found, OperationRecord) else None
    shown_root = root if root not in (None, operation_id, *before) else None
    if shown_root is not None and _read(store, shown_root) is None:
        shown_root = None  # purged: no page to link to
    gap = shown_root is not None and earliest_previous != root
    return Chain(root=shown_root, gap=gap, before=tuple(before), current=operation_id,
                 after=tuple(after))


def lineage_html(chain: Chain) -> str:
    """The chain as one line of links: root, ..., previous, this one (bold), successors."""
    items: list[str] = []
    if chain.root is not None:
        items.append(f'<li data-role="root">{operation_link(chain.root)} <span class="muted">'
                     "(root)</span></li>")
        if chain.gap:
            items.append('<li class="muted" title="operations not read between the root '
                         'and the ones shown">…</li>')
    items += [f'<li data-role="previous">{operation_link(op_id)}</li>' for op_id in chain.before]
    items.append(f'<li data-role="current"><b><code class="clip" title="'
                 f'{escape(chain.current)}">{escape(chain.current)}</code></b> '
                 '<span class="muted">(this one)</span></li>')
    items += [f'<li data-role="successor">{operation_link(op_id)}</li>' for op_id in chain.after]
    if len(items) == 1:
        return ('<p class="muted" id="lineage-chain-alone">no earlier or later operation '
                "in the store</p>")
    return f'<ol class="chain" id="lineage-chain">{"".join(items)}</ol>'


def _stamp(moment: float | None, *, why: str = NOT_RECORDED) -> str:
    """A UTC time, or "-" with a tooltip saying it is not recorded."""
    if moment is None:
        return f'<span class="muted" title="{escape(why)}">-</span>'
    return full_time(moment)


def _seconds(value: float | None) -> str:
    if value is None:
        return _stamp(None)
    if value < 60:
        return f"{value:.2f} s"
    minutes, seconds = divmod(value, 60)
    return f"{int(minutes)} min {seconds:.0f} s"


def _finished(record: OperationRecord | None,
              marker: DispositionRecord | None) -> tuple[str, float | None]:
    """What ended the operation and when, as recorded (``None``: not recorded)."""
    if marker is not None:
        return marker.disposition, marker.at
    if record is None:
        return "", None
    if record.completed_at is not None:
        return "completed", record.completed_at
    if record.continuation is not None and record.phase == "failed":
        return "failed (its continuation was decided then)", record.continuation.decided_at
    # Ended, at a moment the store does not record (a failure, a cancel, a supersession).
    ended = record.phase in ("failed", "cancelled", "superseded")
    return (record.phase if ended else ""), None


def updated_at(record: OperationRecord) -> float:
    """The last time the operation visibly changed: its creation, its last attempt, its
    completion (the list's "updated" sort uses the same)."""
    moments = [record.created_at]
    if record.attempts:
        moments.append(record.attempts[-1].consumed_at)
    if record.completed_at is not None:
        moments.append(record.completed_at)
    return max(moments)


def time_rows(record: OperationRecord | None,
              marker: DispositionRecord | None) -> list[list[str]]:
    """The operation's created / updated / finished rows (name, value: HTML cells)."""
    created = None if record is None else record.created_at
    updated = None if record is None else updated_at(record)
    ended, finished = _finished(record, marker)
    gone = "not kept once only a marker is left"
    label = f"finished ({escape(ended)})" if ended else "finished"
    values = (
        ("created", "op-created", _stamp(created, why=gone)),
        ("updated (last attempt or completion)", "op-updated", _stamp(updated, why=gone)),
        (label, "op-finished", _stamp(finished, why=NOT_RECORDED if ended else "not finished")),
    )
    return [[name, f'<span id="{element_id}">{value}</span>']
            for name, element_id, value in values]


def attempt_timing(record: OperationRecord | None, attempt: AttemptRecord) -> Sequence[str]:
    """One attempt's cells: started (consumed), ended, duration, time to first event.

    Only the completing attempt has a recorded end (the operation's completion); the store
    records no first-event time, so that cell is "-" with its tooltip."""
    ended = None
    if (record is not None and record.completed_at is not None
            and attempt.outcome == "completed" and record.attempts
            and record.attempts[-1].attempt_id == attempt.attempt_id):
        ended = record.completed_at
    duration = None if ended is None else max(0.0, ended - attempt.consumed_at)
    return (_stamp(attempt.consumed_at), _stamp(ended), _seconds(duration), _stamp(None))


def explanation_html(explanation: Explanation | None, last_failure: Interruption | None,
                     state: str) -> str:
    """The "What happened" box: the failure and what to do, or the last interruption of
    an operation still under way, or nothing."""
    if explanation is not None:
        return (
            '<div class="box" id="what-happened"><h2>What happened</h2>'
            f'<p id="failure-message"><code>{escape(explanation.code)}</code>: '
            f"{escape(explanation.what)}</p>"
            f'<p id="failure-action"><b>What to do:</b> {escape(explanation.todo)}</p></div>'
        )
    if last_failure is not None and state not in ("completed", "acknowledged"):
        return (
            '<div class="box" id="what-happened"><h2>What happened</h2>'
            f'<p id="failure-message">last interruption: '
            f"{escape(describe_interruption(last_failure))}</p></div>"
        )
    return ""
