"""Lifecycle commands as the machine states them (issue 13.2): what a pending suspend or
cancel means at each point the actors meet one. Pure functions, no store."""

from __future__ import annotations

import itertools
from typing import get_args

import pytest

from recoverable import errors
from recoverable import machine as m
from recoverable.machine import Stop
from recoverable.records import CommandKind, Phase

from .test_machine import attempt, record, transmitting

KINDS: tuple[CommandKind, ...] = get_args(CommandKind)
PHASES: tuple[Phase, ...] = get_args(Phase)


@pytest.mark.parametrize("existing", [None, *KINDS])
@pytest.mark.parametrize("new", KINDS)
def test_merge_never_downgrades_a_cancel(existing: CommandKind | None, new: CommandKind) -> None:
    merged = m.merge_command(existing, new)
    assert merged == ("cancel" if existing == "cancel" else new)


def test_a_pending_suspend_is_spent_by_opening_and_a_cancel_stands() -> None:
    assert m.command_at_open(None) is None
    assert m.command_at_open("suspend") is None
    assert m.command_at_open("cancel") == "cancel"
    assert m.command_spent_at_open("suspend")
    assert not m.command_spent_at_open("cancel") and not m.command_spent_at_open(None)


@pytest.mark.parametrize("existing", [None, *KINDS])
@pytest.mark.parametrize("new", KINDS)
def test_a_stored_cancel_stands_unchanged_for_a_live_owner(
    existing: CommandKind | None, new: CommandKind
) -> None:
    written = m.command_to_store(existing, new)
    if existing == "cancel":
        assert written is None  # the stored cancel row (and its serial) stands
    else:
        assert written == new


@pytest.mark.parametrize(("phase", "kind"), list(itertools.product(PHASES, KINDS)))
def test_a_command_is_folded_only_into_the_phase_that_says_it(
    phase: Phase, kind: CommandKind
) -> None:
    folded = m.command_folded(record(phase=phase), kind)
    # A superseded record (issue 16) is terminal and fences everything: it says any command.
    if kind == "cancel":
        assert folded == (phase in ("cancelled", "superseded"))  # never lost into a suspension
    else:
        assert folded == (phase in ("suspended", "cancelled", "superseded"))


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("command", [None, *KINDS])
def test_a_cancel_fences_delivery_from_the_moment_it_is_written(
    phase: Phase, command: CommandKind | None
) -> None:
    fenced = m.cancel_fences(record(phase=phase), command)
    assert fenced == (phase == "cancelled" or command == "cancel")


def test_the_callers_cancellation_suspends_and_keeps_the_spent_attempt() -> None:
    rec = transmitting(2)
    for command in (None, "suspend"):
        moved = m.caller_cancelled(rec, command)
        assert moved.record.phase == "suspended"
        assert moved.record.attempts_used == 2
        assert moved.record.attempts[-1].outcome == "interrupted"
        assert isinstance(moved.action, Stop)
        assert type(moved.action.error) is errors.OperationSuspended


def test_a_cancel_seen_as_the_caller_goes_away_wins() -> None:
    moved = m.caller_cancelled(transmitting(1), "cancel")
    assert moved.record.phase == "cancelled"
    assert isinstance(moved.action, Stop)
    assert type(moved.action.error) is errors.OperationCancelled
    assert moved.record == m.command_observed(transmitting(1), "cancel").record


def test_the_callers_cancellation_leaves_a_finished_record_alone() -> None:
    done = record(phase="completed", attempts=(attempt(1, "completed"),), attempts_used=1,
                  completed_at=1.0)
    assert m.caller_cancelled(done, None).record == done
