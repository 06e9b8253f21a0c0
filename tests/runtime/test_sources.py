"""Source-bound (derivative) operations, end to end (issue 16, docs/sources.md).

Real LMDB store, the fixture provider on a loopback socket, both transports. A source
mutation is made at an exact point of an attempt through :class:`Hooked`, a backend that
forwards to the real ``ResponsesBackend`` and runs a host action once the attempt is
consumed (durably started) or once its stream ended (the completion is in hand, not yet
saved): barriers, never sleeps.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import recoverable
from recoverable import errors
from recoverable.outcome import Outcome, Progress
from recoverable.testing import FixtureProvider, Reply
from recoverable.transport.base import Credentials

from ..cli.cli_helpers import run_cli
from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend

pytestmark = pytest.mark.both_stores

DOC = recoverable.SourceRef("doc-1", "sha256:v1")
ANSWER = {"answer": 42, "note": "six times seven"}
Action = Callable[[], Awaitable[None]]


class Hooked:
    """The real backend, with a host action after the attempt is consumed (before its body
    is sent) and/or after its stream ended (before the receipt is saved)."""

    def __init__(self, inner: recoverable.ResponsesBackend) -> None:
        self.inner = inner
        self.after_send: Action | None = None
        self.after_stream: Action | None = None

    @property
    def endpoint_id(self) -> str:
        return self.inner.endpoint_id

    @property
    def credentials(self) -> Credentials:
        return self.inner.credentials

    async def stream(
        self,
        body: bytes,
        *,
        attempt_id: str,
        token: str,
        on_progress: Callable[[Progress], None] | None = None,
        before_send: Callable[[], Awaitable[None]] | None = None,
    ) -> Outcome:
        async def sent() -> None:
            if before_send is not None:
                await before_send()
            if self.after_send is not None:
                await self.after_send()

        result = await self.inner.stream(
            body, attempt_id=attempt_id, token=token, on_progress=on_progress, before_send=sent
        )
        if self.after_stream is not None:
            await self.after_stream()
        return result


async def _prepare(rt: recoverable.Runtime, **options: Any) -> recoverable.Handle:
    return await rt.prepare(REQUEST, response=Answer, maximum_attempts=3, source=DOC, **options)


@asynccontextmanager
async def _runtime(
    store: recoverable.RecoveryStore, provider: FixtureProvider, mode: str = "sse",
    **options: Any,
) -> AsyncIterator[recoverable.Runtime]:
    """A runtime over the provider's backend (``mode``), DOC current in the manifest."""
    await store.set_source("doc-1", "sha256:v1")
    async with make_backend(provider, mode) as backend, recoverable.open_runtime(
        store, backend, account=ACCOUNT, **options
    ) as rt:
        yield rt


@asynccontextmanager
async def _hooked_runtime(
    store: recoverable.RecoveryStore, provider: FixtureProvider, mode: str = "sse"
) -> AsyncIterator[tuple[recoverable.Runtime, Hooked]]:
    """``_runtime`` over a :class:`Hooked` backend, with the hooks to set."""
    await store.set_source("doc-1", "sha256:v1")
    async with make_backend(provider, mode) as backend, recoverable.open_runtime(
        store, (hooked := Hooked(backend)), account=ACCOUNT
    ) as rt:
        yield rt, hooked


async def _superseded_after_stream(
    store: recoverable.RecoveryStore,
    provider: FixtureProvider,
    change: Callable[[recoverable.Handle], Awaitable[None]],
) -> recoverable.Handle:
    """One operation whose stream ends, then ``change`` changes its source before its
    receipt is saved: the send is refused as superseded (``source_changed``). Returns its
    handle once the runtime is closed."""
    provider.script([Reply.complete(ANSWER)])
    async with _hooked_runtime(store, provider) as (rt, hooked):
        handle = await _prepare(rt)
        hooked.after_stream = functools.partial(change, handle)
        with pytest.raises(errors.OperationSuperseded) as superseded:
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert superseded.value.reason == "source_changed"
    return handle


async def _cut_while_streaming(
    rt: recoverable.Runtime, handle: recoverable.Handle, change: Action
) -> None:
    """Send ``handle`` in the background while ``change`` (it waits for the owner to
    stream, then changes the source) runs: the send ends superseded."""
    outcome: list[BaseException] = []

    async def run() -> None:
        try:
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        except errors.RecoveryError as exc:
            outcome.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await change()
    assert len(outcome) == 1 and isinstance(outcome[0], errors.OperationSuperseded)


def _assert_cut_and_superseded(store: recoverable.RecoveryStore, operation_id: str) -> None:
    """Cut mid-stream by a source change: superseded, the attempt closed, the lease gone."""
    record = store.get_operation(operation_id)
    assert record is not None and record.phase == "superseded"
    assert record.attempts[-1].outcome == "interrupted"  # closed, nothing invented
    assert record.attempts[-1].usage is None
    assert store.get_lease(operation_id) is None


async def test_a_result_is_saved_while_its_digest_is_current(
    store: recoverable.RecoveryStore, provider: FixtureProvider, mode: str
) -> None:
    provider.script([Reply.complete(ANSWER)])
    async with _runtime(store, provider, mode) as rt:
        handle = await _prepare(rt)
        value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert value == Answer(**ANSWER)
        status = await rt.status(handle)
        assert (status.state, status.source, status.superseded_reason) == ("completed", DOC, None)
        receipt = await rt.receipt(handle)
        assert receipt.payload == b'{"answer":42,"note":"six times seven"}'
        await rt.acknowledge(handle)


async def test_prepare_refuses_a_digest_the_manifest_does_not_hold(
    store: recoverable.RecoveryStore, provider: FixtureProvider
) -> None:
    async with make_backend(provider) as backend, recoverable.open_runtime(
        store, backend, account=ACCOUNT
    ) as rt:
        with pytest.raises(errors.InvalidParameter) as unknown:
            await _prepare(rt)  # the manifest has no doc-1 yet
        assert (unknown.value.parameter, unknown.value.reason) == ("source", "not_current")
        await store.set_source("doc-1", "sha256:v2")
        with pytest.raises(errors.InvalidParameter):
            await _prepare(rt)  # stale at birth
        with pytest.raises(errors.InvalidParameter) as bad:
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=1,
                             source=("doc-1", "sha256:v2"))  # type: ignore[arg-type]
        assert bad.value.parameter == "source"
        assert (await rt.inventory()).operations == ()  # nothing was saved


async def test_the_hard_timeout_must_be_shorter_than_the_lease(
    store: recoverable.RecoveryStore, provider: FixtureProvider
) -> None:
    async with _runtime(store, provider, lease_seconds=30.0) as rt:
        for too_long in (30.0, 45.0, float("inf"), 0.0, -1.0, True):
            with pytest.raises(errors.InvalidParameter) as refused:
                await _prepare(rt, attempt_timeout=too_long)
            assert refused.value.parameter == "attempt_timeout"
        assert (await rt.inventory()).operations == ()
        named = await _prepare(rt, attempt_timeout=29.5)
        default = await _prepare(rt)
        plain = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
    records = [store.get_operation(h.operation_id) for h in (named, default, plain)]
    assert [r.attempt_timeout for r in records if r is not None] == [29.5, 20.0, None]


@pytest.mark.parametrize("when", ["after_send", "after_stream"])
@pytest.mark.parametrize("change", ["mutation", "deletion"])
async def test_a_source_change_during_the_attempt_refuses_its_completion(
    store: recoverable.RecoveryStore, provider: FixtureProvider, mode: str, when: str,
    change: str,
) -> None:
    """Mutation (or deletion) between the attempt's start and its completion: the
    completion is never saved, the operation is superseded, the caller gets a typed error."""
    provider.script([Reply.complete(ANSWER)])
    async with _hooked_runtime(store, provider, mode) as (rt, hooked):
        handle = await _prepare(rt)

        async def mutate() -> None:
            if change == "mutation":
                await store.set_source("doc-1", "sha256:v2")
            else:
                await store.delete_source("doc-1")

        setattr(hooked, when, mutate)
        with pytest.raises(errors.OperationSuperseded) as superseded:
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        reason = "source_changed" if change == "mutation" else "source_deleted"
        assert superseded.value.reason == reason
        assert superseded.value.code == "operation_superseded"
        record = store.get_operation(handle.operation_id)
        assert record is not None
        assert (record.phase, record.superseded_reason) == ("superseded", reason)
        assert record.attempts_used == 1 and not record.has_completion  # spent, nothing saved
        assert store.get_payload(handle.operation_id, "completion") is None
        assert store.get_lease(handle.operation_id) is None
        status = await rt.status(handle)
        assert (status.state, status.availability) == ("superseded", "superseded")
        assert status.suggested_actions == ("abandon",)
        with pytest.raises(errors.OperationSuperseded):
            await rt.receipt(handle)
        with pytest.raises(errors.OperationSuperseded):  # reopening: no POST, no callback
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        with pytest.raises(errors.RetryNotAllowed):
            await rt.retry(handle, retry_action_id="again", maximum_attempts=1)
        await rt.abandon(handle)
    # Spent once; cut before its body was sent when the change came right after consumption.
    sent = len(generation_requests(provider, handle.operation_id))
    assert sent == 1 if when == "after_stream" else sent <= 1


async def test_the_receipt_write_itself_checks_the_manifest(
    store: recoverable.RecoveryStore, provider: FixtureProvider
) -> None:
    """Defense in depth: the manifest row alone changes (no index scan supersedes the
    operation first); the transaction that would save the completion reads it and writes
    ``superseded`` instead."""
    async def manifest_row_only(handle: recoverable.Handle) -> None:
        await store.write(lambda txn: txn.put_source("doc-1", "sha256:v9"))
        record = store.get_operation(handle.operation_id)
        assert record is not None and record.phase == "transmitting"  # not superseded yet

    handle = await _superseded_after_stream(store, provider, manifest_row_only)
    record = store.get_operation(handle.operation_id)
    assert record is not None and record.phase == "superseded"
    assert store.get_payload(handle.operation_id, "completion") is None
    assert store.get_lease(handle.operation_id) is None
    assert store.write_sync(lambda txn: txn.source_bound("doc-1")) == []


async def test_a_change_after_the_receipt_before_acknowledgement_invalidates_it(
    store: recoverable.RecoveryStore, provider: FixtureProvider
) -> None:
    provider.script([Reply.complete(ANSWER)])
    async with _runtime(store, provider) as rt:
        handle = await _prepare(rt)
        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert store.get_payload(handle.operation_id, "completion") is not None
        change = await store.set_source("doc-1", "sha256:v2")
        assert change.superseded == (handle.operation_id,)
        assert store.get_payload(handle.operation_id, "completion") is None
        with pytest.raises(errors.OperationSuperseded):
            await rt.receipt(handle)
        with pytest.raises(errors.OperationSuperseded):  # the host's commit point refuses
            await rt.acknowledge(handle)
        with pytest.raises(errors.OperationSuperseded):  # nothing is delivered either
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        # An acknowledged receipt is history: a later change leaves its marker alone.
        provider.script([Reply.complete(ANSWER)])
        await store.set_source("doc-1", "sha256:v1")
        kept = await _prepare(rt)
        await rt.send_recovering(kept, response=Answer, authorize=Authorizer())
        await rt.acknowledge(kept)
        assert (await store.set_source("doc-1", "sha256:v3")).superseded == ()
        assert (await rt.status(kept)).state == "acknowledged"


async def test_a_streaming_owner_is_cut_by_a_source_change(
    store: recoverable.RecoveryStore, provider: FixtureProvider, mode: str
) -> None:
    """The owner streams (the provider stalls mid-stream); the manifest change supersedes
    the record and writes a cancel command, so the owner's monitor cuts the stream; the
    record says superseded, not cancelled."""
    provider.script([Reply.stall(after_events=2)])
    streaming = trio.Event()
    async with _hooked_runtime(store, provider, mode) as (rt, hooked):
        handle = await _prepare(rt)

        async def consumed() -> None:
            streaming.set()

        async def mutate() -> None:
            await streaming.wait()
            await provider.wait_for_requests(1)
            change = await store.set_source("doc-1", "sha256:v2")
            assert change.superseded == (handle.operation_id,)

        hooked.after_send = consumed
        await _cut_while_streaming(rt, handle, mutate)
    _assert_cut_and_superseded(store, handle.operation_id)
    assert store.get_command(handle.operation_id) is None  # folded by nobody: removed


async def test_a_hung_attempt_ends_at_its_hard_timeout_and_the_budget_bounds_it(
    store: recoverable.RecoveryStore, provider: FixtureProvider
) -> None:
    """Provider execution shorter than the lease: a stalled stream is cut at the hard
    timeout (a timeout interruption); with the budget spent the failure is terminal."""
    # A real 0.2 s timeout (the stream stalls forever, so only the timeout can end it;
    # nothing depends on how long anything else takes).
    provider.script([Reply.stall(after_events=2), Reply.stall(after_events=2)])
    async with _runtime(store, provider) as rt:
        handle = await rt.prepare(
            REQUEST, response=Answer, maximum_attempts=2, source=DOC, attempt_timeout=0.2,
            retry_policy=recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0),
        )
        with pytest.raises(errors.AttemptsExhausted) as exhausted:
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        last = exhausted.value.last_failure
        assert last is not None and (last.kind, last.transport_code) == ("timeout", "hard_timeout")
    record = store.get_operation(handle.operation_id)
    assert record is not None and record.phase == "failed" and record.attempts_used == 2
    assert len(generation_requests(provider, handle.operation_id)) == 2


async def test_a_provider_failure_is_a_bounded_terminal_failure(
    store: recoverable.RecoveryStore, provider: FixtureProvider
) -> None:
    provider.script([Reply.quota_exceeded()])
    async with _runtime(store, provider) as rt:
        handle = await _prepare(rt)
        with pytest.raises(errors.ProviderError) as failed:
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert failed.value.code == "provider_error"
        record = store.get_operation(handle.operation_id)
        assert record is not None and record.phase == "failed" and record.attempts_used == 1
        # Terminal without a result: a later manifest change has nothing to supersede.
        assert (await store.set_source("doc-1", "sha256:v2")).superseded == ()


def test_the_source_shows_in_the_cli_status(tmp_path: Path) -> None:
    from recoverable.cli.formatting import format_status

    status = recoverable.Status(
        operation_id="op", state="superseded", availability="superseded",
        source=DOC, superseded_reason="source_changed",
    )
    text = format_status(status)
    assert "doc-1 @ sha256:v1" in text and "source_changed" in text


async def test_a_retry_successor_inherits_the_binding_and_only_while_current(
    store: recoverable.RecoveryStore, provider: FixtureProvider
) -> None:
    """A failed derivative is not superseded (no result to protect); its manual retry
    inherits the source binding, and is refused while the digest is not current."""
    provider.script([Reply.quota_exceeded(), Reply.complete(ANSWER)])
    async with _runtime(store, provider) as rt:
        handle = await _prepare(rt)
        with pytest.raises(errors.ProviderError):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        await store.set_source("doc-1", "sha256:v2")
        with pytest.raises(errors.InvalidParameter) as stale:
            await rt.retry(handle, retry_action_id="again", maximum_attempts=2)
        assert stale.value.reason == "not_current"
        await store.set_source("doc-1", "sha256:v1")  # the source went back
        successor = await rt.retry(handle, retry_action_id="again", maximum_attempts=2)
        record = store.get_operation(successor.operation_id)
        assert record is not None and record.source == DOC and record.attempt_timeout == 20.0
        value = await rt.send_recovering(successor, response=Answer, authorize=Authorizer())
        assert value == Answer(**ANSWER)


def _source_set_elsewhere(store_location: str, digest: str) -> None:
    """``recoverable source set`` in another process (a CLI on another machine)."""
    done = run_cli("source", "set", "doc-1", digest, "--store", store_location)
    assert done.returncode == 0, done.stderr


async def test_a_source_change_by_another_process_refuses_the_completion(
    store: recoverable.RecoveryStore, store_location: str, provider: FixtureProvider
) -> None:
    """The change is committed by another process after this one read the manifest (at
    prepare and at the attempt's start) and before its receipt write: that write reads the
    new row (on PostgreSQL the writer's row cache must not serve the old one)."""
    async def elsewhere(handle: recoverable.Handle) -> None:
        await trio.to_thread.run_sync(_source_set_elsewhere, store_location, "sha256:v2")

    handle = await _superseded_after_stream(store, provider, elsewhere)
    record = store.get_operation(handle.operation_id)
    assert record is not None and record.phase == "superseded" and not record.has_completion
    assert store.get_payload(handle.operation_id, "completion") is None
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_a_streaming_owner_is_cut_by_a_source_change_in_another_process(
    store: recoverable.RecoveryStore, store_location: str, provider: FixtureProvider
) -> None:
    """The cancel command the change writes reaches this process's monitor from another
    process (LMDB: the poll of the commit id; PostgreSQL: NOTIFY, or the bounded poll)."""
    provider.script([Reply.stall(after_events=2)])
    async with _runtime(store, provider) as rt:
        handle = await _prepare(rt)

        async def elsewhere() -> None:
            await provider.wait_for_requests(1)
            await trio.to_thread.run_sync(_source_set_elsewhere, store_location, "sha256:v2")

        with trio.fail_after(60):  # generous: a loaded 2-core machine; a guard, no barrier
            await _cut_while_streaming(rt, handle, elsewhere)
    _assert_cut_and_superseded(store, handle.operation_id)
