"""Manual retry: the source-condition table of the specification, row by row."""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import os
import signal
import sys
from pathlib import Path

import msgspec
import pytest
import trio

import recoverable
from recoverable.actors import retry as manual_retry
from recoverable.storage.store import WriteTxn
from recoverable.testing import FixtureProvider, Reply

from .conftest import (
    ACCOUNT,
    OTHER,
    REQUEST,
    Answer,
    Authorizer,
    generation_requests,
    make_backend,
)

FAST = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)


async def exhausted_operation(
    rt: recoverable.Runtime, provider: FixtureProvider, job_id: str = "j", **prepare: object
) -> recoverable.Handle:
    # One job is one operation (the same job and revision again is the same handle), so
    # a test that needs several exhausted operations names a job for each.
    provider.script([Reply.disconnect(after_events=2)])
    handle = await rt.prepare(
        REQUEST, response=Answer, maximum_attempts=1, retry_policy=FAST, job_id=job_id,
        input_revision="r1", **prepare,  # type: ignore[arg-type]
    )
    with pytest.raises(recoverable.AttemptsExhausted):
        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    return handle


async def test_exhausted_source_gets_one_linked_successor_with_a_fresh_budget(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        source = await exhausted_operation(rt, provider)
        before = await rt.status(source)
        child = await rt.retry(source, retry_action_id="user-click-1", maximum_attempts=2)
        assert child.operation_id != source.operation_id
        assert child.previous_operation_id == source.operation_id
        assert child.root_operation_id == source.operation_id
        assert generation_requests(provider, child.operation_id) == []  # retry does not generate
        after = await rt.status(source)
        assert after.attempts_used == before.attempts_used == 1
        assert after.successor_id == child.operation_id
        status = await rt.status(child)
        assert status.attempts_remaining == 2
        assert status.previous_operation_id == source.operation_id
        assert status.job_id == "j" and status.input_revision == "r1"
        # Same action, same settings: the same child. Different action: rejected.
        again = await rt.retry(source, retry_action_id="user-click-1", maximum_attempts=2)
        assert again == child
        with pytest.raises(recoverable.RetryAlreadyCreated):
            await rt.retry(source, retry_action_id="user-click-2", maximum_attempts=2)
        with pytest.raises(recoverable.RetryConfigurationMismatch):
            await rt.retry(source, retry_action_id="user-click-1", maximum_attempts=3)
        value = await rt.send_recovering(child, response=Answer, authorize=Authorizer())
        assert isinstance(value, Answer)
        assert store.get_payload(child.operation_id, "body") == store.get_payload(
            source.operation_id, "body"
        )


async def test_source_conditions_that_refuse_a_manual_retry(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        # Suspended (or idle) with attempts left: resume instead.
        idle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        await rt.suspend(idle)
        with pytest.raises(recoverable.RetryNotAllowed):
            await rt.retry(idle, retry_action_id="a", maximum_attempts=1)
        # A saved completion must be read, not regenerated.
        done = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        await rt.send_recovering(done, response=Answer, authorize=Authorizer())
        with pytest.raises(recoverable.RetryNotAllowed):
            await rt.retry(done, retry_action_id="a", maximum_attempts=1)
        # Permanently cancelled: terminal.
        cancelled = await exhausted_operation(rt, provider)
        await rt.cancel(cancelled)
        with pytest.raises(recoverable.RetryNotAllowed):
            await rt.retry(cancelled, retry_action_id="a", maximum_attempts=1)
        # Acknowledged / abandoned / missing: nothing to clone.
        await rt.acknowledge(done)
        with pytest.raises(recoverable.StateUnavailable):
            await rt.retry(done, retry_action_id="b", maximum_attempts=1)
        gone = await exhausted_operation(rt, provider, job_id="gone")
        await rt.abandon(gone)
        with pytest.raises(recoverable.StateUnavailable):
            await rt.retry(gone, retry_action_id="a", maximum_attempts=1)
        with pytest.raises(recoverable.StateUnavailable):
            await rt.retry(recoverable.Handle("op_missing"), retry_action_id="a",
                           maximum_attempts=1)
        # Another account's (or a signed-out) request cannot be copied.
        mine = await exhausted_operation(rt, provider, job_id="mine")
        rt.sign_in(OTHER)
        with pytest.raises(recoverable.AccountChanged):
            await rt.retry(mine, retry_action_id="a", maximum_attempts=1)
        rt.sign_out()
        with pytest.raises(recoverable.AccountChanged):
            await rt.retry(mine, retry_action_id="a", maximum_attempts=1)
        rt.sign_in(ACCOUNT)
        # Budget bounds hold for successors too.
        with pytest.raises(recoverable.InvalidRequest):
            await rt.retry(mine, retry_action_id="a", maximum_attempts=1001)


async def test_another_accounts_reserved_source_is_account_changed_never_its_successor(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Issue 29.3: the owner check comes before anything retry reads or reuses of the
    source, its retry reservation included. Another account's retry of a source whose
    successor is reserved (not yet created: what a SIGKILL at ``retry.reserved`` leaves) or
    already created is ``AccountChanged``: it neither creates the child on the owner's
    behalf nor returns (or names) the owner's successor."""
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        source = await exhausted_operation(rt, provider)
        op_id = source.operation_id
        checked = store.get_operation(op_id)
        assert checked is not None
        plan = manual_retry.plan_retry(
            op_id, retry_action_id="mine", maximum_attempts=2, selection="preserve",
            expires_at=None, retry_policy=None, account=ACCOUNT, endpoint_id="fixture",
            now=rt.now(),
        )
        await store.write(
            functools.partial(manual_retry.reserve_successor, plan, checked.body_hash)
        )
        reserved = store.get_operation(op_id)
        assert reserved is not None and reserved.retry_reservation is not None
        assert not reserved.retry_reservation.created
        successor_id = reserved.retry_reservation.successor_id
        rt.sign_in(OTHER)
        for action in ("mine", "theirs"):  # the reserved action, and another one
            with pytest.raises(recoverable.AccountChanged) as refused:
                await rt.retry(source, retry_action_id=action, maximum_attempts=2)
            assert successor_id not in str(refused.value)
        assert store.get_operation(successor_id) is None  # not created for the other account
        assert store.get_operation(op_id) == reserved  # the source untouched
        rt.sign_in(ACCOUNT)  # its owner completes it
        child = await rt.retry(source, retry_action_id="mine", maximum_attempts=2)
        assert child.operation_id == successor_id
        created = store.get_operation(op_id)
        successor = store.get_operation(successor_id)
        rt.sign_in(OTHER)
        for action in ("mine", "theirs"):
            with pytest.raises(recoverable.AccountChanged) as refused:
                await rt.retry(source, retry_action_id=action, maximum_attempts=2)
            assert successor_id not in str(refused.value)
        assert store.get_operation(op_id) == created
        assert store.get_operation(successor_id) == successor
    assert generation_requests(provider, successor_id) == []


async def test_quota_failure_and_expiry_allow_a_deliberate_successor(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        provider.script([Reply.quota_exceeded()])
        quota = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        with pytest.raises(recoverable.ProviderError):
            await rt.send_recovering(quota, response=Answer, authorize=Authorizer())
        child = await rt.retry(quota, retry_action_id="after-top-up", maximum_attempts=1)
        assert (await rt.status(child)).attempts_remaining == 1
        past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        expired = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3, expires_at=past)
        with pytest.raises(recoverable.StateExpired):
            await rt.send_recovering(expired, response=Answer, authorize=Authorizer())
        assert (await rt.status(expired)).availability == "expired"
        successor = await rt.retry(expired, retry_action_id="renew", maximum_attempts=1)
        value = await rt.send_recovering(successor, response=Answer, authorize=Authorizer())
        assert isinstance(value, Answer)


async def test_reselect_picks_a_newly_available_model_while_preserve_keeps_the_body(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    available = {"model": "gpt-old"}

    def selector(request: recoverable.StructuredRequest) -> recoverable.StructuredRequest:
        return msgspec.structs.replace(request, model=available["model"])

    backend = make_backend(provider)
    async with recoverable.open_runtime(
        store, backend, account=ACCOUNT, selector=selector
    ) as rt:
        source = await exhausted_operation(rt, provider)
        assert (await rt.status(source)).model == "gpt-old"
        available["model"] = "gpt-new"
        kept = await rt.retry(source, retry_action_id="p", maximum_attempts=1)
        source_body = store.get_payload(source.operation_id, "body")
        assert store.get_payload(kept.operation_id, "body") == source_body
        second = await exhausted_operation(rt, provider, job_id="second")
        fresh = await rt.retry(second, retry_action_id="r", maximum_attempts=1,
                               selection="reselect")
        body = msgspec.json.decode(store.get_payload(fresh.operation_id, "body") or b"")
        assert body["model"] == "gpt-new"
        assert (await rt.status(fresh)).model == "gpt-new"
        # An explicit per-request model override stays binding on reselection.
        pinned_request = msgspec.structs.replace(REQUEST, model="gpt-pinned", model_override=True)
        provider.script([Reply.disconnect(after_events=2)])
        pinned = await rt.prepare(pinned_request, response=Answer, maximum_attempts=1,
                                  retry_policy=FAST)
        with pytest.raises(recoverable.AttemptsExhausted):
            await rt.send_recovering(pinned, response=Answer, authorize=Authorizer())
        redo = await rt.retry(pinned, retry_action_id="r", maximum_attempts=1,
                              selection="reselect")
        assert msgspec.json.decode(store.get_payload(redo.operation_id, "body") or b"")[
            "model"
        ] == "gpt-pinned"


ROOT = str(Path(__file__).resolve().parents[2])
RETRY_CHILD = """
import sys, trio, recoverable
from tests.runtime.test_retry import child_main
sys.exit(trio.run(child_main, sys.argv[1], sys.argv[2]))
"""


async def child_main(store_path: str, operation_id: str) -> int:
    store = recoverable.RecoveryStore.open(store_path)
    backend = recoverable.ResponsesBackend(
        "http://127.0.0.1:9/v1",
        credentials=recoverable.StaticCredentials("k", account=ACCOUNT),
        endpoint_id="fixture",
    )
    async with recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
        await rt.retry(recoverable.Handle(operation_id), retry_action_id="crashy",
                       maximum_attempts=2)
    return 0


async def test_sigkill_between_reservation_and_child_creation_then_same_action_completes(
    provider: FixtureProvider, store: recoverable.RecoveryStore, tmp_path: Path
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        source = await exhausted_operation(rt, provider)
        env = dict(os.environ, RECOVERABLE_KILL_AT="retry.reserved")
        proc = await trio.run_process(
            [sys.executable, "-c", RETRY_CHILD, str(tmp_path / "store"), source.operation_id],
            env=env, cwd=ROOT, check=False, capture_stderr=True,
        )
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        record = store.get_operation(source.operation_id)
        assert record is not None and record.retry_reservation is not None
        assert not record.retry_reservation.created
        successor_id = record.retry_reservation.successor_id
        assert store.get_operation(successor_id) is None
        child = await rt.retry(source, retry_action_id="crashy", maximum_attempts=2)
        assert child.operation_id == successor_id
        assert (await rt.status(child)).attempts_remaining == 2
        with pytest.raises(recoverable.RetryAlreadyCreated):
            await rt.retry(source, retry_action_id="other", maximum_attempts=2)


def delete_body(store: recoverable.RecoveryStore, operation_id: str) -> None:
    """Damage the store the way a lost payload row would: the frozen body is gone."""

    def damage(txn: WriteTxn) -> None:
        assert txn.delete_payload(operation_id, "body")

    store.write_sync(damage)


async def test_a_source_without_a_frozen_body_is_refused_before_any_reservation(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Issue 10.2: check first, reserve second. No dangling successor id."""
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        source = await exhausted_operation(rt, provider)
        delete_body(store, source.operation_id)
        status = await rt.status(source)
        assert status.blockers == frozenset({"storage_unavailable"})
        assert "manual_retry" not in status.suggested_actions
        for action in ("click-1", "click-2"):  # every action gets the same typed refusal
            with pytest.raises(recoverable.RequestUnavailable) as refused:
                await rt.retry(source, retry_action_id=action, maximum_attempts=2)
            assert refused.value.code == "request_unavailable"
            assert isinstance(refused.value, recoverable.StorageUnavailable)
        record = store.get_operation(source.operation_id)
        assert record is not None and record.retry_reservation is None
        assert (await rt.status(source)).successor_id is None
        successor_id = "op_" + hashlib.sha256(
            f"{source.operation_id}\0click-1".encode()
        ).hexdigest()[:32]
        assert store.get_operation(successor_id) is None
    assert len(provider.requests) == 1


async def test_configuration_blocked_source_gets_a_successor_for_the_current_endpoint(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Seed 000, retry-source table: "configuration-blocked" may create one successor."""
    old = recoverable.ResponsesBackend(
        provider.http_url, credentials=recoverable.StaticCredentials("k", account=ACCOUNT),
        mode="sse", endpoint_id="old-endpoint",
    )
    async with recoverable.open_runtime(store, old, account=ACCOUNT) as rt:
        source = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        status = await rt.status(source)
        assert status.availability == "blocked"
        assert status.blockers == frozenset({"configuration_unavailable"})
        assert status.attempts_remaining == 2 and "manual_retry" in status.suggested_actions
        with pytest.raises(recoverable.ConfigurationUnavailable):
            await rt.send_recovering(source, response=Answer, authorize=Authorizer())
        child = await rt.retry(source, retry_action_id="move", maximum_attempts=1)
        assert (await rt.status(child)).blockers == frozenset()
        assert (await rt.status(source)).attempts_used == 0  # the source is unchanged
        value = await rt.send_recovering(child, response=Answer, authorize=Authorizer())
        assert isinstance(value, Answer)
    assert generation_requests(provider, source.operation_id) == []
    assert len(generation_requests(provider, child.operation_id)) == 1


async def test_suspended_and_exhausted_source_gets_a_successor(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Seed 000, retry-source table: "suspended and exhausted" may create a successor
    (while "suspended with attempts left" must be resumed instead)."""
    provider.script([Reply.stall(after_events=2)])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        source = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                with pytest.raises(recoverable.OperationSuspended):
                    await rt.send_recovering(source, response=Answer, authorize=Authorizer())

            nursery.start_soon(send)
            await provider.wait_for_requests(1)
            await rt.suspend(source)
        status = await rt.status(source)
        assert status.state == "suspended" and status.attempts_remaining == 0
        assert status.availability == "exhausted"
        assert "manual_retry" in status.suggested_actions
        child = await rt.retry(source, retry_action_id="again", maximum_attempts=1)
        assert (await rt.status(source)).successor_id == child.operation_id
        value = await rt.send_recovering(child, response=Answer, authorize=Authorizer())
        assert isinstance(value, Answer)
    assert len(generation_requests(provider, source.operation_id)) == 1
