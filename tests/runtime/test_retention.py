"""Retention, quotas and privacy-preserving telemetry."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import trio
import trio.lowlevel

import recoverable
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, OTHER, REQUEST, Answer, Authorizer, make_backend

pytestmark = pytest.mark.both_stores


async def test_purge_after_sign_out_removes_idle_records_and_reports_busy_ones(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.complete({"answer": 1, "note": "a"}), Reply.stall(after_events=2)])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        done = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, scope="s1")
        await rt.send_recovering(done, response=Answer, authorize=Authorizer())
        idle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, scope="s1")
        acked = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, scope="s2")
        provider.script([Reply.complete({"answer": 2, "note": "b"}), Reply.stall(after_events=2)])
        await rt.send_recovering(acked, response=Answer, authorize=Authorizer())
        await rt.acknowledge(acked)
        busy = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, scope="s1")
        rt.sign_in(OTHER)
        foreign = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, scope="s1")
        rt.sign_in(ACCOUNT)
        async with trio.open_nursery() as nursery:

            async def stream() -> None:
                with pytest.raises(recoverable.OperationSuspended):
                    await rt.send_recovering(busy, response=Answer, authorize=Authorizer())

            nursery.start_soon(stream)
            await provider.wait_for_requests(3)
            rt.sign_out()
            # Scope-limited purge first: only s2's marker goes.
            only_s2 = store.purge_account(ACCOUNT, scope="s2")
            assert only_s2.removed == (acked.operation_id,)
            result = store.purge_account(ACCOUNT)
            assert set(result.removed) == {done.operation_id, idle.operation_id}
            assert result.skipped == (busy.operation_id,)
            rt.sign_in(ACCOUNT)
            await rt.suspend(busy)
        for handle in (done, idle, acked):
            assert store.get_operation(handle.operation_id) is None
            assert store.get_disposition(handle.operation_id) is None
            assert store.get_payload(handle.operation_id, "body") is None
        assert store.get_operation(foreign.operation_id) is not None  # another account's
        assert store.get_operation(busy.operation_id) is not None


async def test_cleanup_disposed_removes_only_old_markers_never_live_records(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        acked = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        await rt.send_recovering(acked, response=Answer, authorize=Authorizer())
        await rt.acknowledge(acked)
        unacknowledged = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        await rt.send_recovering(unacknowledged, response=Answer, authorize=Authorizer())
        unfinished = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        nothing = store.cleanup_disposed(before=time.time() - 3600, account=ACCOUNT)
        assert nothing.removed == ()
        result = store.cleanup_disposed(before=time.time() + 1, account=ACCOUNT)
        assert result.removed == (acked.operation_id,)
        with pytest.raises(recoverable.StateUnavailable):
            await rt.status(acked)  # once the marker is gone, status is unavailable
        assert (await rt.status(unacknowledged)).has_saved_completion
        assert (await rt.status(unfinished)).state == "prepared"
        assert store.get_payload(unacknowledged.operation_id, "completion") is not None


async def test_a_full_store_refuses_evicts_nothing_and_never_delivers_an_unsaved_completion(
    provider: FixtureProvider, tmp_path: Path
) -> None:
    with recoverable.RecoveryStore.open(str(tmp_path / "small"), max_bytes=64 * 1024) as store:
        async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
            first = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
            saved_body = store.get_payload(first.operation_id, "body")
            huge = "x" * (80 * 1024)
            provider.script([Reply.complete({"answer": 3, "note": huge})])
            with pytest.raises(recoverable.CompletionUnavailable):
                await rt.send_recovering(first, response=Answer, authorize=Authorizer())
            status = await rt.status(first)
            assert not status.has_saved_completion and status.attempts_used == 1
            big_request = recoverable.StructuredRequest(model="m", input="y" * (70 * 1024))
            with pytest.raises(recoverable.StorageLimitExceeded):
                await rt.prepare(big_request, response=Answer, maximum_attempts=1)
            assert store.get_payload(first.operation_id, "body") == saved_body
            records, unreadable = store.inventory()
            assert [r.operation_id for r in records] == [first.operation_id]
            assert unreadable == []


async def test_telemetry_and_logs_carry_no_prompt_output_token_or_account(
    provider: FixtureProvider, store: recoverable.RecoveryStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret_account = recoverable.AccountBinding("acct-PRIVATE-ACCOUNT-9", "api-key")
    prompt = "PROMPT-SECRET-TEXT-1"
    output = "OUTPUT-SECRET-TEXT-2"
    token = "sk-TOKEN-SECRET-3"
    events: list[recoverable.TelemetryEvent] = []
    logging_sink = recoverable.LoggingSink()

    def sink(event: recoverable.TelemetryEvent) -> None:
        events.append(event)
        logging_sink(event)

    provider.script([
        Reply.disconnect(after_events=3),
        Reply.rate_limited(retry_after=0.01),
        Reply.complete({"answer": 5, "note": output}),
    ])
    backend = recoverable.ResponsesBackend(
        provider.http_url,
        credentials=recoverable.StaticCredentials(token, account=secret_account),
        mode="sse", endpoint_id="fixture",
    )
    caplog.set_level(logging.DEBUG)
    request = recoverable.StructuredRequest(model="gpt-test", instructions=prompt, input=prompt)
    policy = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
    async with recoverable.open_runtime(
        store, backend, account=secret_account, telemetry=sink
    ) as rt:
        handle = await rt.prepare(
            request, response=Answer, maximum_attempts=4, retry_policy=policy,
            scope="SCOPE-SECRET-4", job_id="JOB-SECRET-5",
        )
        value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert value.note == output
        await rt.receipt(handle)
        await rt.acknowledge(handle)
    names = {e.name for e in events}
    assert {
        "recovery.operation.prepared",
        "recovery.attempt.reserved",
        "recovery.attempt.transmission_authorized",
        "recovery.attempt.failed",
        "recovery.operation.waiting",
        "recovery.receipt.saved",
        "recovery.receipt.retrieved",
        "recovery.receipt.acknowledged",
    } <= names
    assert all(e.event_version == 1 for e in events)
    emitted = "\n".join(repr(e) for e in events) + "\n".join(
        r.getMessage() + repr(getattr(r, "recovery_event", "")) for r in caplog.records
    )
    for secret in (prompt, output, token, "PRIVATE-ACCOUNT", "SCOPE-SECRET", "JOB-SECRET"):
        assert secret not in emitted


async def test_a_failing_sink_never_breaks_an_operation(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    def broken(event: recoverable.TelemetryEvent) -> None:
        raise RuntimeError("sink down")

    async with recoverable.open_runtime(
        store, make_backend(provider), account=ACCOUNT, telemetry=broken
    ) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
        assert isinstance(
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer()), Answer
        )
        await trio.lowlevel.checkpoint()
        assert rt.telemetry.failed >= 1
