"""Issues 15 with 16: a ``reattach=True`` operation bound to a source. When a manifest
change supersedes it while its owner streams the background response, the owner is told
through the cancel path (``storage/sources.supersede_in``): like a cancel, the provider
is asked to stop the background response (best effort, recorded), since its result can
never count. Real LMDB store, the fixture provider's background responses on 127.0.0.1."""

from __future__ import annotations

from typing import Any

import pytest

import recoverable
from recoverable import errors
from recoverable.reattachment import MAX_REATTACHMENTS
from recoverable.storage.sources import change_source
from recoverable.testing import FixtureProvider

from .conftest import Answer, Authorizer, generation_requests
from .reattach_helpers import (
    Events,
    cut,
    fixture_runtime,
    interrupt_at_checkpoint,
    prepare,
    resumes,
)

DOC = recoverable.SourceRef("doc-1", "sha256:v1")


async def test_superseding_a_streaming_reattach_operation_cancels_it_on_the_server(
    store: recoverable.RecoveryStore,
) -> None:
    events = Events()
    await store.set_source("doc-1", "sha256:v1")
    # Slow enough that the manifest change lands mid-stream (200 deltas at 50 ms).
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.05) as provider:
        async with fixture_runtime(store, provider, events) as rt:
            handle = await prepare(rt, source=DOC)
            await interrupt_at_checkpoint(
                rt, handle, events, lambda: store.set_source("doc-1", "sha256:v2"),
                errors.OperationSuperseded,
            )
            status = await rt.status(handle)
    assert status.state == "superseded"
    rid = status.attempts[-1].response_id
    assert rid is not None
    cancels = resumes(provider, "cancel")
    assert [cancel.response_id for cancel in cancels] == [rid]
    stored = provider.stored_response(rid)
    assert stored is not None and stored.status == "cancelled"
    assert status.attempts[-1].server_cancel == "cancelled"
    assert [e.fields["result"] for e in events.named("attempt.server_cancel")] == ["cancelled"]


async def test_a_checkpoint_write_that_finds_the_operation_superseded_stops_the_stream(
    store: recoverable.RecoveryStore,
) -> None:
    """The race of a manifest change with a checkpoint write: the supersede commits (with
    its cancel command for the owner) and the owner's next fenced write (a checkpoint)
    commits before the owner's monitor polled the command table. That write reads the
    superseded record and deletes the command; the owner must still stop, with the typed
    error, and not stream the rest of the response for nothing. Reproduced exactly as
    the store is left by that race: the supersede and the command's removal in one
    transaction (so no poll can see the command in between)."""
    events = Events()
    await store.set_source("doc-1", "sha256:v1")
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.03) as provider:
        async with fixture_runtime(store, provider, events) as rt:
            handle = await prepare(rt, source=DOC)
            op_id = handle.operation_id

            def supersede_then_consume_the_command(txn: Any) -> None:
                change_source("doc-1", "sha256:v2", rt.now(), txn)
                assert txn.get_command(op_id) is not None  # the owner would be told...
                txn.delete_command(op_id)  # ...but a fenced write took it first

            await interrupt_at_checkpoint(
                rt, handle, events, lambda: store.write(supersede_then_consume_the_command),
                errors.OperationSuperseded,
            )
            status = await rt.status(handle)
    assert status.state == "superseded"
    # Stopped at the next checkpoint (every second at most), long before the ~6 s end.
    checkpoints = events.named("attempt.checkpointed")
    last = checkpoints[-1].fields["sequence_number"]
    assert isinstance(last, int) and last < 150, last
    assert status.attempts[-1].server_cancel == "cancelled"  # and told the provider


async def test_each_resume_get_is_cut_at_the_hard_attempt_timeout(
    store: recoverable.RecoveryStore,
) -> None:
    """Issue 16's hard ``attempt_timeout`` bounds every provider call of an attempt, the
    resume GETs of a ``reattach=True`` attempt too (without it, a GET is bounded only by
    the lease's transport deadline, which each heartbeat renewal moves forward). The
    response here streams for ~20 s (400 events at 50 ms); the timeout is 1 s: the POST
    is dropped after 2 events (~0.1 s: far inside the timeout on a loaded machine, where
    5 events once left little margin under 0.5 s), each of the bounded resume GETs is cut
    at the timeout, then seed 000 decides (one attempt: exhausted). Wall-clock: 1 s
    against ~20 s."""
    events = Events()
    await store.set_source("doc-1", "sha256:v1")
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.05) as provider:
        provider.script([cut(2)])
        async with fixture_runtime(store, provider, events) as rt:
            handle = await prepare(rt, maximum_attempts=1, source=DOC, attempt_timeout=1.0)
            with pytest.raises(errors.AttemptsExhausted) as exhausted:
                await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    last = exhausted.value.last_failure
    assert last is not None and (last.kind, last.transport_code) == ("timeout", "hard_timeout")
    assert len(resumes(provider)) == MAX_REATTACHMENTS
    assert len(events.named("attempt.hard_timeout")) == MAX_REATTACHMENTS
    assert len(generation_requests(provider, handle.operation_id)) == 1
