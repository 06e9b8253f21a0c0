"""The integration scenarios of the specification, against the real fixture provider."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest
import trio

import recoverable
from recoverable.storage.store import WriteTxn
from recoverable.testing import FixtureProvider, Reply

from .conftest import (
    ACCOUNT,
    OTHER,
    REQUEST,
    Answer,
    Authorizer,
    RenewingCredentials,
    generation_requests,
    make_backend,
)

pytestmark = pytest.mark.both_stores

FAST = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)


async def test_saved_completion_is_returned_on_reopen_with_no_post_and_no_callback(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    provider.script([Reply.complete({"answer": 42, "note": "ok"})])
    backend = make_backend(provider, mode)
    async with recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        auth = Authorizer()
        value = await rt.send_recovering(handle, response=Answer, authorize=auth)
        assert value == Answer(42, "ok")
        assert len(auth.calls) == 1
    posts = len(provider.requests)
    backend2 = make_backend(provider, mode)
    async with recoverable.open_runtime(store, backend2, account=ACCOUNT) as rt2:
        auth2 = Authorizer()
        again = await rt2.send_recovering(handle, response=Answer, authorize=auth2)
        assert again == value
        assert auth2.calls == []
        status = await rt2.status(handle)
        assert status.state == "completed" and status.has_saved_completion
        assert "acknowledge" in status.suggested_actions
    assert len(provider.requests) == posts


async def test_frozen_body_is_sent_byte_for_byte_and_mid_stream_disconnect_is_replaced_once(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    provider.script(
        [Reply.disconnect(after_events=4), Reply.complete({"answer": 7, "note": "second"})]
    )
    async with recoverable.open_runtime(store, make_backend(provider, mode), account=ACCOUNT) as rt:
        handle = await rt.prepare(
            REQUEST, response=Answer, maximum_attempts=3, retry_policy=FAST
        )
        auth = Authorizer()
        value = await rt.send_recovering(handle, response=Answer, authorize=auth)
    assert value == Answer(7, "second")
    sent = generation_requests(provider, handle.operation_id)
    assert len(sent) == 2
    frozen = store.get_payload(handle.operation_id, "body")
    assert frozen is not None
    assert sent[0].body == frozen and sent[1].body == frozen
    body = msgspec.json.decode(frozen)
    assert body["tools"] == [] and body["tool_choice"] == "none"
    assert body["parallel_tool_calls"] is False and body["store"] is False
    assert body["text"]["format"]["strict"] is True
    assert [a.reason for a in auth.calls] == ["initial", "replacement"]
    assert [r.attempt_id for r in sent] == [a.attempt_id for a in auth.calls]
    assert auth.calls[1].previous_failure is not None
    assert auth.calls[1].previous_failure.kind in ("disconnected", "premature_eof")


async def test_three_concurrent_jobs_one_exhausts_its_budget_others_complete(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handles = [
            await rt.prepare(
                REQUEST, response=Answer, maximum_attempts=2, retry_policy=FAST,
                job_id=f"job-{i}", input_revision="r1",
            )
            for i in range(3)
        ]
        doomed = handles[1].operation_id
        provider.script_for(
            lambda attempt_id: Reply.disconnect(after_events=2)
            if attempt_id.startswith(doomed) else None
        )
        results: dict[int, object] = {}

        async def run(i: int) -> None:
            try:
                results[i] = await rt.send_recovering(
                    handles[i], response=Answer, authorize=Authorizer()
                )
            except recoverable.AttemptsExhausted as exc:
                results[i] = exc

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(run, i)
        assert isinstance(results[0], Answer) and isinstance(results[2], Answer)
        assert isinstance(results[1], recoverable.AttemptsExhausted)
        assert len(generation_requests(provider, doomed)) == 2
        status = await rt.status(handles[1])
        assert status.availability == "exhausted" and status.attempts_remaining == 0
        assert "manual_retry" in status.suggested_actions
        for i in (0, 2):
            assert (await rt.status(handles[i])).has_saved_completion


async def test_rate_limit_cooldown_survives_suspension_and_reopening_in_a_new_runtime(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script(
        [Reply.rate_limited(retry_after=0.6), Reply.complete({"answer": 1, "note": "n"})]
    )
    waiting = trio.Event()

    def sink(event: recoverable.TelemetryEvent) -> None:
        if event.name == "recovery.operation.waiting":
            waiting.set()

    backend = make_backend(provider)
    async with recoverable.open_runtime(store, backend, account=ACCOUNT, telemetry=sink) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        auth = Authorizer()
        # A hang guard, not a timing claim: the cancel is triggered by the persisted-cooldown
        # event; 60 s only bounds a run that never reaches it (loaded machines included).
        with trio.move_on_after(60) as scope:
            # Cancel once the cooldown is persisted: Trio cancellation suspends.
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    await waiting.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                await rt.send_recovering(handle, response=Answer, authorize=auth)
        assert not scope.cancelled_caught
        status = await rt.status(handle)
        assert status.state == "suspended" and status.next_attempt_at is not None
        cooldown_until = status.next_attempt_at.timestamp()
        assert len(auth.calls) == 1
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt2:
        stamps: list[float] = []

        async def stamped(attempt: recoverable.Attempt) -> bool:
            stamps.append(rt2.now())
            return True

        value = await rt2.send_recovering(handle, response=Answer, authorize=stamped)
    assert value == Answer(1, "n")
    assert len(stamps) == 1 and stamps[0] >= cooldown_until
    assert len(generation_requests(provider, handle.operation_id)) == 2


async def test_cancel_from_a_second_runtime_stops_the_owner_and_is_terminal(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    provider.script([Reply.stall(after_events=2)])
    backend = make_backend(provider, mode)
    async with recoverable.open_runtime(store, backend, account=ACCOUNT) as owner, \
            recoverable.open_runtime(store, make_backend(provider, mode), account=ACCOUNT) as other:
        handle = await owner.prepare(REQUEST, response=Answer, maximum_attempts=3)
        caught: list[BaseException] = []

        async def run() -> None:
            try:
                await owner.send_recovering(handle, response=Answer, authorize=Authorizer())
            except recoverable.RecoveryError as exc:
                caught.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await provider.wait_for_requests(1)
            await other.cancel(handle)
        assert len(caught) == 1 and isinstance(caught[0], recoverable.OperationCancelled)
        status = await other.status(handle)
        assert status.state == "cancelled" and status.availability == "permanently_cancelled"
        with pytest.raises(recoverable.OperationCancelled):
            await other.send_recovering(handle, response=Answer, authorize=Authorizer())
        with pytest.raises(recoverable.OperationCancelled):
            await other.receipt(handle)
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_suspension_during_authorization_reuses_the_pending_attempt_id(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt, \
            recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as other:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        entered = trio.Event()
        seen: list[str] = []

        async def slow_authorize(attempt: recoverable.Attempt) -> bool:
            seen.append(attempt.attempt_id)
            entered.set()
            await trio.sleep_forever()
            return True

        async def run() -> None:
            with pytest.raises(recoverable.OperationSuspended):
                await rt.send_recovering(handle, response=Answer, authorize=slow_authorize)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await entered.wait()
            await other.suspend(handle)
        status = await rt.status(handle)
        assert status.state == "suspended" and status.attempts_used == 0
        assert status.pending_attempt_id == seen[0]
        auth = Authorizer()
        await rt.send_recovering(handle, response=Answer, authorize=auth)
        assert auth.calls[0].attempt_id == seen[0]
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_late_authorization_answer_after_suspend_cannot_authorize_a_post(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt, \
            recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as other:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        entered = trio.Event()
        release = trio.Event()

        async def uncooperative(attempt: recoverable.Attempt) -> bool:
            entered.set()
            with trio.CancelScope(shield=True):  # ignores cancellation, answers late
                await release.wait()
            return True

        async def run() -> None:
            with pytest.raises(recoverable.OperationSuspended):
                await rt.send_recovering(handle, response=Answer, authorize=uncooperative)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await entered.wait()
            await other.suspend(handle)
            # The owner has observed the command (its watch scope is cancelled) at once.
            assert rt.monitor.command_for(handle.operation_id) == "suspend"
            release.set()
        status = await rt.status(handle)
        assert status.attempts_used == 0 and status.state == "suspended"
    assert generation_requests(provider, handle.operation_id) == []


async def test_401_reissue_consumes_budget_and_renewed_credentials_never_reach_disk(
    provider: FixtureProvider, store: recoverable.RecoveryStore, tmp_path: Path
) -> None:
    provider.script([Reply.unauthorized(), Reply.complete({"answer": 2, "note": "renewed"})])
    creds = RenewingCredentials("sk-first-SECRET-1", "sk-renewed-SECRET-2", ACCOUNT)
    backend = make_backend(provider, "sse", credentials=creds)
    async with recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        auth = Authorizer()
        value = await rt.send_recovering(handle, response=Answer, authorize=auth)
        status = await rt.status(handle)
    assert value == Answer(2, "renewed")
    assert [a.reason for a in auth.calls] == ["initial", "authentication_reissue"]
    assert status.attempts_used == 2 and creds.renewals == 1
    sent = generation_requests(provider, handle.operation_id)
    assert len(sent) == 2
    assert sent[0].headers["authorization"] != sent[1].headers["authorization"]
    for root, _dirs, files in os.walk(tmp_path):
        for name in files:
            data = (Path(root) / name).read_bytes()
            assert b"SECRET" not in data, name


async def test_account_switch_during_authorization_sends_nothing(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)

        async def switching(attempt: recoverable.Attempt) -> bool:
            rt.sign_in(OTHER)
            return True

        with pytest.raises(recoverable.AccountChanged):
            await rt.send_recovering(handle, response=Answer, authorize=switching)
        status_other = await rt.status(handle)
        assert status_other.redacted and "account_mismatch" in status_other.blockers
        rt.sign_in(ACCOUNT)
        status = await rt.status(handle)
        assert status.attempts_used == 0
    assert generation_requests(provider, handle.operation_id) == []


async def test_quota_is_terminal_with_its_cause_even_at_429(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    provider.script([Reply.quota_exceeded()])
    async with recoverable.open_runtime(store, make_backend(provider, mode), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=5)
        with pytest.raises(recoverable.ProviderError) as first:
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert first.value.interruption.is_quota and first.value.http_status == 429
        auth = Authorizer()
        with pytest.raises(recoverable.PermanentlyFailed) as again:
            await rt.send_recovering(handle, response=Answer, authorize=auth)
        assert again.value.last_failure is not None and again.value.last_failure.is_quota
        assert auth.calls == []
        status = await rt.status(handle)
        assert status.state == "failed" and status.last_failure is not None
        assert status.last_failure.is_quota and status.attempts_used == 1
    assert len(generation_requests(provider, handle.operation_id)) == 1


@pytest.mark.parametrize("reply", ["invalid_json", "schema_violation"])
async def test_invalid_output_stays_failed(
    provider: FixtureProvider, store: recoverable.RecoveryStore, reply: str
) -> None:
    provider.script([getattr(Reply, reply)()])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        with pytest.raises(recoverable.ProviderError) as info:
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert info.value.kind == "invalid_output"
        with pytest.raises(recoverable.PermanentlyFailed):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        status = await rt.status(handle)
        assert status.state == "failed" and not status.has_saved_completion
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_tool_activity_is_terminal_and_nothing_is_executed(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    provider.script([Reply.tool_call()])
    async with recoverable.open_runtime(store, make_backend(provider, mode), account=ACCOUNT) as rt:
        handle = await rt.prepare(
            REQUEST, response=Answer, maximum_attempts=3,
            retry_policy=recoverable.RetryPolicy(replace_invalid_output=True),
        )
        with pytest.raises(recoverable.ProviderError) as info:
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert info.value.interruption.had_tool_activity
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_a_second_concurrent_sender_gets_operation_busy(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.stall(after_events=2)])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        async with trio.open_nursery() as nursery:

            async def first() -> None:
                with pytest.raises(recoverable.OperationSuspended):
                    await rt.send_recovering(handle, response=Answer, authorize=Authorizer())

            nursery.start_soon(first)
            await provider.wait_for_requests(1)
            second = Authorizer()
            with pytest.raises(recoverable.OperationBusy):
                await rt.send_recovering(handle, response=Answer, authorize=second)
            assert second.calls == []
            await rt.suspend(handle)
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_callback_exception_escapes_unchanged_and_spends_nothing(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    class HostBroke(Exception):
        pass

    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)

        async def broken(attempt: recoverable.Attempt) -> bool:
            raise HostBroke("host failure")

        with pytest.raises(HostBroke):
            await rt.send_recovering(handle, response=Answer, authorize=broken)
        denied = Authorizer(approve=False)
        with pytest.raises(recoverable.AttemptNotAuthorized):
            await rt.send_recovering(handle, response=Answer, authorize=denied)
        status = await rt.status(handle)
        assert status.attempts_used == 0 and status.pending_attempt_id == denied.calls[0].attempt_id
        value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert isinstance(value, Answer)
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_format_mismatch_consumes_nothing_and_keeps_the_receipt(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    class Other(msgspec.Struct):
        value: str

    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(
            REQUEST, response=Answer, maximum_attempts=2, contract_version="v1"
        )
        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        with pytest.raises(recoverable.FormatMismatch):
            await rt.send_recovering(handle, response=Other, authorize=Authorizer())
        with pytest.raises(recoverable.FormatMismatch):
            await rt.send_recovering(
                handle, response=Answer, authorize=Authorizer(), expected_contract_version="v2"
            )
        receipt = await rt.receipt(handle)
        assert receipt.decode(Answer) == await rt.send_recovering(
            handle, response=Answer, authorize=Authorizer(), expected_contract_version="v1"
        )
        assert (await rt.status(handle)).attempts_used == 1


async def test_acknowledge_leaves_only_a_marker_and_blocks_generation(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        with pytest.raises(recoverable.CompletionUnavailable):
            await rt.acknowledge(handle)
        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        await rt.acknowledge(handle)
        await rt.acknowledge(handle)  # idempotent
        status = await rt.status(handle)
        assert status.state == "acknowledged"
        assert store.get_operation(handle.operation_id) is None
        assert store.get_payload(handle.operation_id, "completion") is None
        assert store.get_payload(handle.operation_id, "body") is None
        with pytest.raises(recoverable.StateUnavailable):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_cancelling_the_sending_task_mid_stream_suspends_in_both_modes(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    provider.script([Reply.stall(after_events=2)])
    async with recoverable.open_runtime(store, make_backend(provider, mode), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                await rt.send_recovering(handle, response=Answer, authorize=Authorizer())

            nursery.start_soon(send)
            await provider.wait_for_requests(1)
            nursery.cancel_scope.cancel()
        status = await rt.status(handle)
        assert status.state == "suspended" and status.attempts_used == 1
        assert status.attempts[0].outcome == "interrupted"
        value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert isinstance(value, Answer)
    assert len(generation_requests(provider, handle.operation_id)) == 2


async def test_missing_frozen_body_is_found_before_authorization_and_spends_nothing(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Issue 10.7: a damaged operation (its body row lost) never asks the host, never
    spends an attempt, on any reopen; status names the storage blocker."""
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)

        def damage(txn: WriteTxn) -> None:
            assert txn.delete_payload(handle.operation_id, "body")

        store.write_sync(damage)
        for _reopen in range(2):
            auth = Authorizer()
            with pytest.raises(recoverable.RequestUnavailable) as refused:
                await rt.send_recovering(handle, response=Answer, authorize=auth)
            assert refused.value.operation_id == handle.operation_id
            assert auth.calls == []
            status = await rt.status(handle)
            assert status.attempts_used == 0 and status.pending_attempt_id is None
            assert status.blockers == frozenset({"storage_unavailable"})
            assert status.availability == "blocked"
            assert status.suggested_actions == ("abandon",)
        inventory = await rt.inventory()
        listed = [s for s in inventory.operations if s.operation_id == handle.operation_id]
        assert listed[0].blockers == frozenset({"storage_unavailable"})
        await rt.abandon(handle)  # the suggested action works
    assert provider.requests == []


async def test_a_saved_completion_lost_from_the_store_is_never_acknowledged(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Issue 10.1 (acknowledge's check, the same for every record version): acknowledge
    needs a completion the host could read; a lost one fails closed and nothing changes."""
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())

        def damage(txn: WriteTxn) -> None:
            assert txn.delete_payload(handle.operation_id, "completion")

        store.write_sync(damage)
        status = await rt.status(handle)
        assert status.state == "completed" and status.has_saved_completion
        assert status.blockers == frozenset({"storage_unavailable"})
        assert status.availability == "blocked" and status.suggested_actions == ("abandon",)
        with pytest.raises(recoverable.CompletionUnavailable):
            await rt.receipt(handle)
        with pytest.raises(recoverable.CompletionUnavailable):
            await rt.acknowledge(handle)
        assert store.get_operation(handle.operation_id) is not None
        assert store.get_disposition(handle.operation_id) is None
        # Never a regeneration either: a missing receipt is not permission to send.
        auth = Authorizer()
        with pytest.raises(recoverable.CompletionUnavailable):
            await rt.send_recovering(handle, response=Answer, authorize=auth)
        assert auth.calls == []
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_previous_operation_id_is_diagnostics_only_and_never_links_budgets(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Issue 10.13 (seed H13): a new request may name a prior operation; nothing else."""
    provider.script([Reply.disconnect(after_events=2)])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        old = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1, retry_policy=FAST)
        with pytest.raises(recoverable.AttemptsExhausted):
            await rt.send_recovering(old, response=Answer, authorize=Authorizer())
        new = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                               previous_operation_id=old.operation_id)
        assert new.previous_operation_id == old.operation_id
        assert new.root_operation_id == new.operation_id  # its own chain: not a successor
        status = await rt.status(new)
        assert status.previous_operation_id == old.operation_id
        assert status.root_operation_id == new.operation_id
        assert status.attempts_used == 0 and status.attempts_remaining == 2
        before = await rt.status(old)
        assert before.successor_id is None and before.attempts_used == 1
        # The old operation is still a retry source of its own (no link was reserved),
        # and a prior id that no longer exists is accepted (diagnostics only).
        child = await rt.retry(old, retry_action_id="click", maximum_attempts=1)
        assert child.operation_id != new.operation_id
        unknown = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1,
                                   previous_operation_id="op_gone")
        assert (await rt.status(unknown)).previous_operation_id == "op_gone"
        with pytest.raises(recoverable.InvalidRequest):
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=1,
                             previous_operation_id="x" * 2000)
        await rt.send_recovering(new, response=Answer, authorize=Authorizer())
        receipt = await rt.receipt(new)
        assert receipt.previous_operation_id == old.operation_id
        await rt.acknowledge(new)
        assert (await rt.status(new)).previous_operation_id == old.operation_id


class _Line(msgspec.Struct):
    name: str
    quantity: int


class _Order(msgspec.Struct):
    lines: list[_Line]


async def test_a_schema_violation_names_where_the_output_broke_the_contract(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    secret = "PAYLOAD-TEXT-7431"
    provider.script([Reply.complete({"lines": [{"name": "a", "quantity": 1},
                                               {"name": "b", "quantity": secret}]})])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=_Order, maximum_attempts=2)
        with pytest.raises(recoverable.ProviderError) as info:
            await rt.send_recovering(handle, response=_Order, authorize=Authorizer())
        failure = info.value.interruption
        assert failure.kind == "invalid_output" and failure.provider_code == "schema_violation"
        # A JSON pointer into the output, from the contract's own names and indexes.
        assert failure.output_path == "/lines/1/quantity"
        assert "at /lines/1/quantity" in str(info.value)
        assert secret not in str(info.value)
        # Saved with the failure: status and a later reopen say the same.
        status = await rt.status(handle)
        assert status.last_failure is not None
        assert status.last_failure.output_path == "/lines/1/quantity"
        with pytest.raises(recoverable.PermanentlyFailed) as again:
            await rt.send_recovering(handle, response=_Order, authorize=Authorizer())
        assert "/lines/1/quantity" in str(again.value)


async def test_a_cancel_seen_as_the_caller_goes_away_stays_permanent(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """The host cancels permanently and, at the same moment, the sending task is cancelled:
    the saved record is cancelled (never a resumable suspension), and nothing generates."""
    provider.script([Reply.rate_limited(retry_after=30.0)])
    waiting = trio.Event()

    def sink(event: recoverable.TelemetryEvent) -> None:
        if event.name == "recovery.operation.waiting":
            waiting.set()  # the sender parks in its 30 s cooldown right after this event

    async with recoverable.open_runtime(
        store, make_backend(provider), account=ACCOUNT, telemetry=sink
    ) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        caller = trio.CancelScope()

        async def send() -> None:
            with caller:
                await rt.send_recovering(handle, response=Answer, authorize=Authorizer())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            with trio.fail_after(60):  # hang guard only
                await waiting.wait()
            assert (await rt.status(handle)).availability == "waiting"
            await rt.cancel(handle)  # the watch sees the cancel at once (same process)
            caller.cancel()  # ... and the caller goes away before the operation runs again
        record = store.get_operation(handle.operation_id)
        assert record is not None and record.phase == "cancelled"
        with pytest.raises(recoverable.OperationCancelled):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    assert len(generation_requests(provider, handle.operation_id)) == 1
