"""Acting on many operations: one function for the dashboard and the command line.

filter (or a list of ids) -> selection -> for each operation, the per-operation rule
(``dashboard.actions.refusals``) and the per-operation action (``dashboard.actions.
perform``: the library call the CLI makes) -> a summary: how many were done, how many
were refused and why.

- :func:`selection_of` turns a filter (``cli/selection.py``) or explicit ids into the
  operation ids, from one summary of the store (``build_summary``);
- :func:`preview` says, without acting, how many and which, and which of them the
  rules refuse now (each read fresh from the store);
- :func:`act_on_many` acts, once per action id: each operation is read fresh again and
  checked by the same rules first (an operation that changed since the preview is
  refused with its reason, never forced). A manual retry uses the action id as each
  successor's retry action id, so repeating it returns the same successors (the
  library's idempotence); the dashboard also remembers each action id's result
  (:class:`Ledger`), so a repeated confirmation does nothing a second time.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import Final, Literal

import attrs

from recoverable import errors
from recoverable.actors.runtime import Runtime
from recoverable.cli.selection import Filter, Sort, select
from recoverable.dashboard.actions import ActionRefused, perform, refusals
from recoverable.dashboard.data import (
    DashboardStore,
    OperationView,
    Summary,
    check_operation_id,
    marker_view,
    operation_view,
)
from recoverable.machine import derive_status
from recoverable.records import OperationRecord
from recoverable.storage.keys import operation_key
from recoverable.storage.rows import decode_row
from recoverable.telemetry import TelemetrySink

__all__ = [
    "BULK_ACTIONS",
    "BulkAction",
    "BulkOptions",
    "BulkPreview",
    "BulkResult",
    "Ledger",
    "act_on_many",
    "preview",
    "selection_of",
]

BulkAction = Literal["retry", "cancel", "suspend", "acknowledge", "abandon"]
BULK_ACTIONS: Final[tuple[BulkAction, ...]] = (
    "retry", "cancel", "suspend", "acknowledge", "abandon")
MAX_SELECTION: Final = 100_000  # operations one bulk action may name
_LEDGER: Final = 256  # action ids a dashboard remembers
_CHUNK: Final = 2000  # operations a preview reads from one snapshot of each table


@attrs.frozen
class BulkOptions:
    """What each operation gets: a retry's selection and budget (``None``: the source's
    own), and whether a cancel also fences off a saved, validated result (``force``)."""

    selection: Literal["preserve", "reselect"] = "preserve"
    max_attempts: int | None = None
    force: bool = False


@attrs.frozen
class BulkPreview:
    action: BulkAction
    operation_ids: tuple[str, ...]  # the selection, in the list's order
    refused: tuple[tuple[str, str], ...]  # (operation id, why), as the rules say now

    @property
    def allowed(self) -> int:
        return len(self.operation_ids) - len(self.refused)

    def reasons(self) -> list[tuple[str, int]]:
        """Why operations are refused: each reason with how many, most first."""
        return Counter(reason for _, reason in self.refused).most_common()


@attrs.frozen
class BulkResult:
    action_id: str
    action: BulkAction
    selected: int
    done: tuple[tuple[str, str], ...]  # (operation id, what happened)
    refused: tuple[tuple[str, str, str], ...]  # (operation id, code, why)
    repeated: bool = False  # the action id was done before: nothing was done now

    def reasons(self) -> list[tuple[str, int]]:
        """Each refusal (code: why) with how many, most first."""
        return Counter(f"{code}: {why}" for _, code, why in self.refused).most_common()

    def counts(self) -> dict[str, object]:
        return {
            "action_id": self.action_id, "action": self.action, "selected": self.selected,
            "done": len(self.done), "refused": len(self.refused), "repeated": self.repeated,
            "reasons": [{"reason": reason, "operations": count}
                        for reason, count in self.reasons()],
        }


def selection_of(
    summary: Summary,
    chosen: Filter | None = None,
    operation_ids: Sequence[str] = (),
    *,
    sort: Sort = "created",
    descending: bool = True,
) -> tuple[str, ...]:
    """The operation ids a bulk action names: those ``chosen`` selects (in the list's
    order), or the explicit ``operation_ids`` (each once, in their order)."""
    if chosen is not None:
        ids = tuple(row.operation_id for row in select(
            summary, chosen, sort=sort, descending=descending).rows)
    else:
        ids = tuple(dict.fromkeys(operation_ids))
    if len(ids) > MAX_SELECTION:
        raise errors.InvalidRequest(
            f"the selection names {len(ids)} operations; a bulk action takes at most "
            f"{MAX_SELECTION}: narrow the filter")
    return ids


def _view(store: DashboardStore, runtime: Runtime, operation_id: str) -> OperationView:
    return operation_view(store, operation_id, viewer=runtime.account, show_content=False)


def _precheck(runtime: Runtime, view: OperationView, action: BulkAction,
              options: BulkOptions, action_id: str | None) -> str | None:
    """Why the action would be refused now: the page's rule, and the guards ``perform``
    adds for a confirmed bulk action (a cancel of a saved result needs ``force``)."""
    refusal = refusals(runtime, view, retry_action_id=action_id)[action]
    if refusal is None and action == "cancel" and view.status.has_saved_completion \
            and not options.force:
        return ("it has a saved, validated result: cancel means it is never delivered "
                "(force it: --force, or the bulk form's box)")
    return refusal


def _snapshot_views(
    store: DashboardStore, runtime: Runtime, ids: Sequence[str], now: float
) -> dict[str, OperationView | errors.RecoveryError]:
    """The views of many operations, each table read once for all of them (the markers,
    the records, the leases and commands, the payloads' kinds): what the per-operation
    rules read. (The queue's state is left to the check each action makes fresh.)"""
    keys = [operation_key(operation_id) for operation_id in ids]
    markers = store.get_raw_many("dispositions", keys)
    records = store.get_raw_many("operations", keys)
    leases, commands = store.control_rows()
    payloads = store.payload_kinds(ids)
    live: dict[tuple[str, str], bool] = {}
    views: dict[str, OperationView | errors.RecoveryError] = {}
    for operation_id, marker_raw, record_raw in zip(ids, markers, records, strict=True):
        try:
            check_operation_id(operation_id)
            if marker_raw is not None:
                views[operation_id] = marker_view(
                    decode_row("dispositions", marker_raw, operation_id), runtime.account)
                continue
            if record_raw is None:
                raise errors.StateUnavailable("no such operation", operation_id=operation_id)
            record: OperationRecord = decode_row("operations", record_raw, operation_id)
        except errors.RecoveryError as exc:
            views[operation_id] = exc
            continue
        lease = leases.get(operation_id)
        is_live = False
        if lease is not None:
            holder = (lease.owner_id, lease.token)
            if holder not in live:
                live[holder] = store.lease_is_live(lease, now)
            is_live = live[holder]
        command = commands.get(operation_id)
        status = derive_status(
            record, now=now, lease_live=is_live, viewer=record.account,
            command=command.kind if command is not None else None,
            payloads=payloads.get(operation_id), lease=lease)
        views[operation_id] = OperationView(
            status=status, record=record, marker=None,
            same_account=runtime.account == record.account, paused_until=None, content=None)
    return views


def preview(
    runtime: Runtime,
    store: DashboardStore,
    operation_ids: Iterable[str],
    action: BulkAction,
    options: BulkOptions,
) -> BulkPreview:
    """How many and which, and which of them would be refused now and why (nothing is
    done). The operations are read from the store now, ``_CHUNK`` at a time."""
    if action not in BULK_ACTIONS:
        raise errors.InvalidRequest(f"action: one of {', '.join(BULK_ACTIONS)}")
    ids = tuple(operation_ids)
    refused: list[tuple[str, str]] = []
    now = time.time()
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start:start + _CHUNK]
        views = _snapshot_views(store, runtime, chunk, now)
        for operation_id in chunk:
            view = views[operation_id]
            if isinstance(view, errors.RecoveryError):
                refused.append((operation_id, f"{view.code}: {view}"))
                continue
            reason = _precheck(runtime, view, action, options, None)
            if reason is not None:
                refused.append((operation_id, reason))
    return BulkPreview(action=action, operation_ids=ids, refused=tuple(refused))


def _form(action: BulkAction, options: BulkOptions, action_id: str) -> dict[str, str]:
    """The per-operation form ``perform`` reads: the bulk confirmation stands for each
    operation's (acknowledge's ``force``; cancel's only when ``force`` was chosen)."""
    form = {"action_id": action_id, "selection": options.selection}
    if options.max_attempts is not None:
        form["max_attempts"] = str(options.max_attempts)
    if action == "acknowledge" or (action == "cancel" and options.force):
        form["force"] = "1"
    return form


async def act_on_many(
    runtime: Runtime,
    store: DashboardStore,
    operation_ids: Iterable[str],
    action: BulkAction,
    options: BulkOptions,
    *,
    action_id: str,
    telemetry: TelemetrySink,
    ledger: Ledger | None = None,
) -> BulkResult:
    """Act on each operation (read fresh, checked by the per-operation rules first);
    return what was done and what was refused, and why. With a ``ledger``, an action id
    already done returns its first result and does nothing."""
    if action not in BULK_ACTIONS:
        raise errors.InvalidRequest(f"action: one of {', '.join(BULK_ACTIONS)}")
    if ledger is not None:
        earlier = ledger.get(action_id)
        if earlier is not None:
            return attrs.evolve(earlier, repeated=True)
        ledger.begin(action_id)
    try:
        result = await _each(runtime, store, tuple(operation_ids), action, options,
                             action_id=action_id, telemetry=telemetry)
    finally:
        if ledger is not None:
            ledger.end(action_id)
    if ledger is not None:
        ledger.put(result)
    return result


async def _each(runtime: Runtime, store: DashboardStore, ids: tuple[str, ...],
                action: BulkAction, options: BulkOptions, *, action_id: str,
                telemetry: TelemetrySink) -> BulkResult:
    form = _form(action, options, action_id)
    done: list[tuple[str, str]] = []
    refused: list[tuple[str, str, str]] = []
    for operation_id in ids:
        try:
            view = _view(store, runtime, operation_id)
            reason = _precheck(runtime, view, action, options, action_id)
            if reason is not None:
                raise ActionRefused(reason, code="not_allowed", operation_id=operation_id)
            done.append((operation_id, await perform(runtime, view, action, form,
                                                     telemetry=telemetry)))
        except (errors.RecoveryError, ActionRefused) as exc:
            refused.append((operation_id, exc.code, str(exc)))
    return BulkResult(action_id=action_id, action=action, selected=len(ids),
                      done=tuple(done), refused=tuple(refused))


class Ledger:
    """The results of the last bulk actions, by action id (in memory, per dashboard)."""

    def __init__(self) -> None:
        self._results: OrderedDict[str, BulkResult] = OrderedDict()
        self._running: set[str] = set()

    def begin(self, action_id: str) -> None:
        """Mark the action id as under way (a second confirmation meanwhile is refused)."""
        if action_id in self._running:
            raise ActionRefused("this bulk action is under way: its result page shows it "
                                "when it is done", code="action_in_progress")
        self._running.add(action_id)

    def end(self, action_id: str) -> None:
        self._running.discard(action_id)

    def get(self, action_id: str) -> BulkResult | None:
        return self._results.get(action_id)

    def put(self, result: BulkResult) -> None:
        self._results[result.action_id] = result
        while len(self._results) > _LEDGER:
            self._results.popitem(last=False)
