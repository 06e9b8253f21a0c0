"""A cancel is never downgraded (issue 13.2): the actors decide with ``machine.merge_command``.

Where two lifecycle commands meet — the store's command row while an execution runs,
the monitor's watch of that execution, the actor folding a command into its record —
a later ``suspend`` never turns a ``cancel`` back into a resumable suspension.
"""

from __future__ import annotations

import pytest
import trio

import recoverable
from recoverable.actors.fenced import folds
from recoverable.actors.monitor import Watch
from recoverable.records import CommandKind, CommandRecord, OperationRecord, Phase
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend


async def test_a_suspend_after_a_cancel_of_a_running_operation_leaves_it_cancelled(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.stall(after_events=2)])
    async with recoverable.open_runtime(
        store, make_backend(provider), account=ACCOUNT
    ) as owner, recoverable.open_runtime(
        store, make_backend(provider), account=ACCOUNT, monitor_interval=3600
    ) as other:
        handle = await owner.prepare(REQUEST, response=Answer, maximum_attempts=3)
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                with pytest.raises(recoverable.OperationCancelled):
                    await owner.send_recovering(handle, response=Answer, authorize=Authorizer())

            nursery.start_soon(send)
            await provider.wait_for_requests(1)
            # Both written at once: the cancel stands, whichever happened first — the
            # suspend met the cancel row (kept: never downgraded), or the owner (told in
            # process at once) already folded the cancel into its record and the suspend
            # met an idle, cancelled operation (no change). Never a resumable suspension.
            await other.cancel(handle)
            await other.suspend(handle)
            command = store.get_command(handle.operation_id)
            current = store.get_operation(handle.operation_id)
            assert current is not None
            if command is not None:
                assert command.kind == "cancel"
            else:
                assert current.phase == "cancelled"
            assert current.phase != "suspended"
        record = store.get_operation(handle.operation_id)
        assert record is not None and record.phase == "cancelled"
        assert store.get_command(handle.operation_id) is None  # folded into the record
        with pytest.raises(recoverable.OperationCancelled):
            await owner.send_recovering(handle, response=Answer, authorize=Authorizer())
    assert len(generation_requests(provider, handle.operation_id)) == 1


def _command(kind: CommandKind, serial: int) -> CommandRecord:
    return CommandRecord(operation_id="op_1", kind=kind, serial=serial, issued_at=0.0)


async def test_the_watch_keeps_a_cancel_when_a_suspend_arrives_after_it() -> None:
    watch = Watch("op_1", baseline_serial=0)
    watch.deliver(_command("cancel", 1))
    assert watch.command == "cancel" and watch.command_serial == 1
    assert watch.cancel_scope.cancel_called
    watch.deliver(_command("suspend", 2))
    assert watch.command == "cancel" and watch.command_serial == 1
    watch.deliver(_command("cancel", 0))  # at or before the baseline: already accounted for
    assert watch.command_serial == 1
    fresh = Watch("op_1", baseline_serial=0)
    fresh.deliver(_command("suspend", 1))
    fresh.deliver(_command("cancel", 2))  # a cancel upgrades a suspend
    assert fresh.command == "cancel" and fresh.command_serial == 2


@pytest.mark.parametrize(
    ("command", "phase", "folded"),
    [
        ("suspend", "suspended", True),
        ("suspend", "cancelled", True),
        ("cancel", "cancelled", True),
        ("cancel", "suspended", False),  # never lost into a resumable suspension
        ("suspend", "transmitting", False),
        ("cancel", "completed", False),
    ],
)
def test_a_command_is_folded_only_into_a_record_that_says_as_much(
    command: CommandKind, phase: Phase, folded: bool
) -> None:
    record = OperationRecord(
        operation_id="op_1", account=ACCOUNT, endpoint_id="fixture", created_at=0.0,
        phase=phase, maximum_attempts=1, model="gpt-test", format_name="answer",
        format_hash="h", body_hash="b", root_operation_id="op_1",
    )
    assert folds(command, record) is folded
