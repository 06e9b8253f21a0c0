"""The dashboard's actions: suspend, cancel, manual retry, acknowledge, abandon.

Each is the library call the CLI makes (``Runtime.suspend/cancel/acknowledge/abandon``,
``Runtime.retry`` on a runtime whose backend only names the source's endpoint and never
generates: ``cli/ops.NoGeneration``), within the account given by ``--account`` (the
binding the CLI requires: without it every action is refused, and an operation of another
account is refused by the library itself). Each is recorded in telemetry by the runtime
that makes it (``recovery.operation.suspended``/``cancelled``/``abandoned``,
``recovery.receipt.acknowledged``, ``recovery.operation.manual_retry_created``).
Cancel keeps the CLI's guard: an operation with a saved completion is cancelled only with
``force=1``. Cancel fences the completion off (never delivered) but keeps its content until
an abandon removes it (docs/lifecycle.md), and the confirmation says exactly that.
Acknowledge removes a saved, paid-for result, so it asks for the same confirmation: the
confirmed form carries ``force=1`` and the server refuses the action without it.

What may be done to an operation is decided once, by :func:`refusals`: the page disables
the buttons it refuses (with its reason) and :func:`perform` refuses the same actions
(``not_allowed``, with the reason) before any library call, so a stale page or a hand-made
POST never gets an answer the page would not have offered.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from typing import Final

from recoverable import errors
from recoverable.actors.runtime import Runtime, open_runtime
from recoverable.cli.ops import NoGeneration
from recoverable.dashboard.data import OperationView
from recoverable.dashboard.pages import ActionButton
from recoverable.preconditions import MAX_ATTEMPTS
from recoverable.status import SETTLED_STATES
from recoverable.telemetry import TelemetrySink
from recoverable.types import Handle

__all__ = [
    "ACTIONS", "ActionRefused", "binding_refusal_text", "buttons", "new_action_id", "perform",
    "refusals",
]

ACTIONS: Final = ("suspend", "cancel", "retry", "acknowledge", "abandon")
ACTION_ID: Final = re.compile(r"[A-Za-z0-9_-]{8,100}")
_ENDED_FOR_GOOD: Final = frozenset({"cancelled", "superseded", "acknowledged", "abandoned"})
# The saved completion stays in the store after a cancel (only an abandon removes content),
# so the warning promises no more than the library does.
FENCE_WARNING: Final = (
    "Cancel permanently? This operation has a saved, validated (paid-for) completion: after "
    "cancel it is NEVER delivered (receipt refuses it, it cannot be acknowledged). Its "
    "content stays in the store until you Abandon the operation, which removes it."
)
CANCEL_WARNING: Final = (
    "Cancel permanently? No further attempt will ever be made for this operation."
)
ACKNOWLEDGE_WARNING: Final = (
    "Acknowledge? This REMOVES the saved, validated (paid-for) result for good: its request "
    "and response are deleted, only a small marker is kept. Acknowledge only after your "
    "system has committed the result (read it with `recoverable receipt` first)."
)
# What a confirmed form carries (the CLI's --force, for cancel); the server checks it, so
# a POST that skipped the page's confirmation is refused.
CONFIRM_FIELD: Final = "force"


class ActionRefused(errors.RecoveryError):
    """The dashboard refused an action before calling the library (the binding the CLI
    requires is missing, or the CLI's own guard applies)."""

    code = "action_refused"

    def __init__(self, message: str, *, code: str, operation_id: str | None = None) -> None:
        super().__init__(message, operation_id=operation_id)
        self.code = code

    def __str__(self) -> str:
        return str(self.args[0])


def new_action_id() -> str:
    """A fresh manual-retry action id per rendered form (a resubmitted form repeats it,
    and the library returns the same successor)."""
    return "dash-" + secrets.token_urlsafe(12)


def binding_refusal_text(runtime: Runtime) -> str | None:
    """Why this dashboard acts on nothing at all (no ``--account``), or ``None``."""
    if runtime.account is None:
        return "read-only: start the dashboard with --account ID (the operation's account) to act"
    return None


def _binding_refusal(runtime: Runtime, view: OperationView) -> str | None:
    if runtime.account is None:
        return binding_refusal_text(runtime)
    if not view.same_account:
        return "belongs to another account than --account"
    return None


def _busy(view: OperationView) -> str | None:
    """Why an operation is not free to dispose of: a live lease (the dashboard's own
    runtime never executes, so its holder is another process)."""
    owner = view.status.lease_owner
    if owner is None:
        return None
    return (f"another process runs it (lease owner {owner[:12]}): suspend or cancel it "
            "first, and wait until it has stopped")


def refusals(
    runtime: Runtime, view: OperationView, *, retry_action_id: str | None = None
) -> dict[str, str | None]:
    """For each action, why it is refused now (``None``: allowed): the one statement the
    page's buttons and ``perform`` share. The rules are the library's own:

    - suspend: not once the operation is settled (``SETTLED_STATES``) or suspended, where
      the library's suspend changes nothing (``command_on_idle``);
    - cancel: not once it ended for good (cancelled, superseded, acknowledged, abandoned);
    - manual retry: only where the status suggests it (``manual_retry``) and no successor
      exists, or as the resubmission of the form that made the successor (its
      ``retry_action_id``: the library returns the same successor);
    - acknowledge and abandon: only where the status suggests them (its availability and
      blockers), and never under a live lease (the library's ``OperationBusy``).
    """
    status = view.status
    state = status.state
    common = _binding_refusal(runtime, view)
    if view.marker is not None:
        common = f"already {state}: only a marker is left"
    suggested = status.suggested_actions
    busy = _busy(view)
    reservation = view.record.retry_reservation if view.record is not None else None
    resubmitted = reservation is not None and reservation.retry_action_id == retry_action_id
    retry = None
    if status.successor_id is not None and not resubmitted:
        retry = f"its successor {status.successor_id} exists: retry from it"
    elif "manual_retry" not in suggested and not resubmitted:
        retry = "manual retry is for a failed or exhausted operation"
    rules: dict[str, str | None] = {
        "suspend": (f"nothing to suspend: it is {state}"
                    if state in SETTLED_STATES or state == "suspended" else None),
        "cancel": f"already {state}" if state in _ENDED_FOR_GOOD else None,
        "retry": retry,
        "acknowledge": (None if "acknowledge" in suggested
                        else "acknowledge is for a completed operation whose result the "
                        "host committed (and whose saved result is readable)") or busy,
        "abandon": busy or (None if "abandon" in suggested
                            else f"not while it is {status.availability}"),
    }
    return {action: common or reason for action, reason in rules.items()}


def buttons(runtime: Runtime, view: OperationView) -> list[ActionButton]:
    """The operation page's actions, each enabled or disabled with why (``refusals``)."""
    refused = refusals(runtime, view)
    saved = view.status.has_saved_completion
    return [
        ActionButton("suspend", "Suspend", disabled=refused["suspend"]),
        ActionButton("cancel", "Cancel…", danger=True,
                     disabled=refused["cancel"],
                     confirm=FENCE_WARNING if saved else CANCEL_WARNING,
                     fields={CONFIRM_FIELD: "1"} if saved else {}),
        ActionButton("retry", "Manual retry (preserve)",
                     disabled=refused["retry"],
                     fields={"action_id": new_action_id(), "selection": "preserve"}),
        ActionButton("retry", "Manual retry (reselect)", suffix="reselect",
                     disabled=refused["retry"] and "as above",
                     fields={"action_id": new_action_id(), "selection": "reselect"}),
        ActionButton("acknowledge", "Acknowledge…", danger=True,
                     disabled=refused["acknowledge"],
                     confirm=ACKNOWLEDGE_WARNING, fields={CONFIRM_FIELD: "1"}),
        ActionButton("abandon", "Abandon…", danger=True,
                     disabled=refused["abandon"],
                     confirm="Abandon? Its request and any saved result are removed; only a "
                     "small marker is kept."),
    ]


async def perform(
    runtime: Runtime,
    view: OperationView,
    action: str,
    form: Mapping[str, str],
    *,
    telemetry: TelemetrySink,
) -> str:
    """Make the action; return what happened, for the page. Raises a typed error."""
    operation_id = view.status.operation_id
    if action not in ACTIONS:
        raise errors.InvalidRequest(f"action: one of {', '.join(ACTIONS)}")
    refusal = _binding_refusal(runtime, view)
    if refusal is not None:
        raise ActionRefused(refusal, code="account_required", operation_id=operation_id)
    refusal = refusals(runtime, view, retry_action_id=form.get("action_id"))[action]
    if refusal is not None:
        raise ActionRefused(refusal, code="not_allowed", operation_id=operation_id)
    handle = Handle(operation_id)
    match action:
        case "suspend":
            await runtime.suspend(handle)
        case "cancel":
            if view.status.has_saved_completion:
                _require_confirmed(
                    form, "it has a saved, validated result: cancel means it is never "
                    "delivered; confirm the cancel that says so", code="completion_saved",
                    operation_id=operation_id)
            await runtime.cancel(handle)
        case "acknowledge":
            _require_confirmed(
                form, "acknowledge removes the saved result for good; confirm the "
                "acknowledge that says so", code="confirmation_required",
                operation_id=operation_id)
            await runtime.acknowledge(handle)
        case "abandon":
            await runtime.abandon(handle)
        case "retry":
            return await _retry(runtime, view, form, telemetry)
    after = runtime.status_of(operation_id)
    if after.state == view.status.state and action in ("suspend", "cancel"):
        return (f"{action}: requested; another process runs it and applies the {action} at "
                "its next check")
    kept = (after.state == "cancelled" and view.status.has_saved_completion)
    return f"{action}: {operation_id} is now {after.state}" + (
        "; its saved result is never delivered and stays in the store until you abandon "
        "the operation" if kept else "")


def _require_confirmed(
    form: Mapping[str, str], message: str, *, code: str, operation_id: str
) -> None:
    """Refuse an action whose form did not come through the page's confirmation."""
    if form.get(CONFIRM_FIELD) != "1":
        raise ActionRefused(message, code=code, operation_id=operation_id)


async def _retry(
    runtime: Runtime, view: OperationView, form: Mapping[str, str], telemetry: TelemetrySink
) -> str:
    operation_id = view.status.operation_id
    action_id = form.get("action_id", "")
    selection = form.get("selection", "")
    if ACTION_ID.fullmatch(action_id) is None:
        raise errors.InvalidRequest("action_id: 8..100 of A-Z a-z 0-9 _ -")
    if selection not in ("preserve", "reselect"):
        raise errors.InvalidRequest("selection: preserve or reselect")
    if view.record is None:
        raise errors.StateUnavailable("the operation is already disposed",
                                      operation_id=operation_id)
    budget = view.status.maximum_attempts
    chosen = form.get("max_attempts", "")
    if chosen:
        if not chosen.isdigit() or not 1 <= int(chosen) <= MAX_ATTEMPTS:
            raise errors.InvalidRequest(f"max_attempts: an integer 1..{MAX_ATTEMPTS}")
        budget = int(chosen)
    account = runtime.account
    assert account is not None
    backend = NoGeneration(view.record.endpoint_id, account)
    async with open_runtime(runtime.store, backend, account=account, telemetry=telemetry,
                            monitor_interval=0.25) as retrying:
        successor = await retrying.retry(
            Handle(operation_id), retry_action_id=action_id,
            maximum_attempts=budget,
            selection="reselect" if selection == "reselect" else "preserve",
        )
    return (f"retry: {successor.operation_id} is the successor of {operation_id} "
            f"(selection {selection}); nothing was sent: a rerun of the batch (or a worker) "
            "runs it")
