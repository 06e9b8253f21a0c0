"""Branches of the operation actor and of manual retry that no other test executes.

Each test drives the real runtime (real LMDB on disk, the loopback fixture provider
over real sockets) into one rarely taken branch and checks both the typed error the
caller sees and what is durably left behind: nothing regenerated, nothing refunded.
"""

from __future__ import annotations

import os
import resource
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

import recoverable
from recoverable import _killpoints
from recoverable.storage.store import WriteTxn
from recoverable.testing import FixtureProvider, Reply

from .conftest import (
    ACCOUNT,
    REQUEST,
    Answer,
    Authorizer,
    RenewingCredentials,
    generation_requests,
    make_backend,
)

FAST = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)


class RenewalFails:
    """Credentials whose renewal is unavailable (a signed-out OAuth session, say)."""

    def __init__(self, account: recoverable.AccountBinding) -> None:
        self._account = account
        self.renewals = 0

    @property
    def account(self) -> recoverable.AccountBinding:
        return self._account

    async def token(self, *, renew: bool = False) -> str:
        if renew:
            self.renewals += 1
            raise RuntimeError("the identity provider is unreachable")
        return "sk-first"


# --- manual retry rows ---------------------------------------------------------------


async def test_tool_activity_refuses_a_manual_retry(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.tool_call()])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3, retry_policy=FAST)
        with pytest.raises(recoverable.RecoveryError) as failed:
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert isinstance(failed.value, recoverable.ProviderError)
        assert failed.value.interruption is not None
        assert failed.value.interruption.had_tool_activity
        record = store.get_operation(handle.operation_id)
        assert record is not None and record.failure_reason == "tool_activity"
        with pytest.raises(recoverable.RetryNotAllowed, match="tool activity"):
            await rt.retry(handle, retry_action_id="again", maximum_attempts=1)
        record = store.get_operation(handle.operation_id)
        assert record is not None and record.retry_reservation is None  # nothing reserved
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_renewal_failing_during_a_401_reissue_blocks_and_refuses_manual_retry(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.unauthorized()])
    creds = RenewalFails(ACCOUNT)
    authorizer = Authorizer()
    backend = make_backend(provider, credentials=creds)
    async with recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3, retry_policy=FAST)
        with pytest.raises(recoverable.AuthenticationRequired):
            await rt.send_recovering(handle, response=Answer, authorize=authorizer)
        assert creds.renewals == 1
        # The reissue was approved, but renewal failed before anything was spent.
        assert [a.reason for a in authorizer.calls] == ["initial", "authentication_reissue"]
        status = await rt.status(handle)
        assert status.availability == "authentication_required"
        assert "authentication_required" in status.blockers
        assert status.attempts_used == 1
        assert "sign_in" in status.suggested_actions
        with pytest.raises(recoverable.RetryNotAllowed, match="sign in"):
            await rt.retry(handle, retry_action_id="again", maximum_attempts=1)
    assert len(generation_requests(provider, handle.operation_id)) == 1
    # Signed in again (renewable credentials of the same account): the reissue goes out.
    renewing = RenewingCredentials("sk-old", "sk-new", ACCOUNT)
    backend = make_backend(provider, credentials=renewing)
    async with recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
        value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert isinstance(value, Answer)
        assert renewing.renewals == 1
        status = await rt.status(handle)
        assert status.attempts_used == 2
        assert [a.reason for a in status.attempts] == ["initial", "authentication_reissue"]
    assert len(generation_requests(provider, handle.operation_id)) == 2


async def test_suspended_and_exhausted_allows_a_manual_retry(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.stall(after_events=1)])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1, retry_policy=FAST)
        outcome: list[BaseException] = []

        async def send() -> None:
            try:
                await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
            except recoverable.RecoveryError as exc:
                outcome.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            await provider.wait_for_requests(1)  # the only attempt is in flight
            await rt.suspend(handle)
        assert [type(e) for e in outcome] == [recoverable.OperationSuspended]
        status = await rt.status(handle)
        assert (status.state, status.availability) == ("suspended", "exhausted")
        assert status.attempts_remaining == 0
        child = await rt.retry(handle, retry_action_id="more", maximum_attempts=2)
        assert (await rt.status(child)).previous_operation_id == handle.operation_id
        assert (await rt.status(handle)).attempts_used == 1  # the source keeps its history
        value = await rt.send_recovering(child, response=Answer, authorize=Authorizer())
        assert isinstance(value, Answer)
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_an_operation_of_another_endpoint_allows_a_manual_retry_here(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, retry_policy=FAST)
    moved = recoverable.ResponsesBackend(
        provider.http_url, endpoint_id="elsewhere",
        credentials=recoverable.StaticCredentials("sk-test", account=ACCOUNT),
    )
    async with recoverable.open_runtime(store, moved, account=ACCOUNT) as rt:
        status = await rt.status(handle)
        assert "configuration_unavailable" in status.blockers
        assert status.availability == "blocked"
        with pytest.raises(recoverable.ConfigurationUnavailable):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        child = await rt.retry(handle, retry_action_id="move", maximum_attempts=1)
        child_record = store.get_operation(child.operation_id)
        # A custom label is bound to the URL's host (issue 10.9): "elsewhere@127.0.0.1".
        assert child_record is not None and child_record.endpoint_id == moved.endpoint_id
        assert child_record.endpoint_id.startswith("elsewhere@")
        value = await rt.send_recovering(child, response=Answer, authorize=Authorizer())
        assert isinstance(value, Answer)
    assert generation_requests(provider, handle.operation_id) == []  # never sent elsewhere


# --- the operation actor ------------------------------------------------------------


async def saved_receipt(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> recoverable.Handle:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, retry_policy=FAST)
        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    return handle


async def test_a_missing_saved_completion_fails_closed_without_generating(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    handle = await saved_receipt(provider, store)
    op = handle.operation_id

    def lose(txn: WriteTxn) -> None:  # the payload row is lost; the record still says saved
        assert txn.delete_payload(op, "completion")

    store.write_sync(lose)
    authorizer = Authorizer()
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        with pytest.raises(recoverable.CompletionUnavailable, match="missing"):
            await rt.send_recovering(handle, response=Answer, authorize=authorizer)
        assert (await rt.status(handle)).has_saved_completion
    assert authorizer.calls == []  # never permission to regenerate
    assert len(generation_requests(provider, op)) == 1


async def test_an_undecodable_saved_completion_is_a_format_mismatch(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    handle = await saved_receipt(provider, store)
    op = handle.operation_id

    def damage(txn: WriteTxn) -> None:
        txn.put_payload(op, "completion", b'{"answer": "not an int"')

    store.write_sync(damage)
    authorizer = Authorizer()
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        with pytest.raises(recoverable.FormatMismatch):
            await rt.send_recovering(handle, response=Answer, authorize=authorizer)
    assert authorizer.calls == []
    assert len(generation_requests(provider, op)) == 1


async def test_a_store_quota_reached_while_saving_the_completion(
    provider: FixtureProvider, tmp_path: Path
) -> None:
    big = "x" * (256 * 1024)
    provider.script([Reply.complete({"answer": 1, "note": big})])
    with recoverable.RecoveryStore.open(str(tmp_path / "small"), max_bytes=128 * 1024) as store:
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT
        ) as rt:
            handle = await rt.prepare(
                REQUEST, response=Answer, maximum_attempts=2, retry_policy=FAST
            )
            with pytest.raises(recoverable.CompletionUnavailable, match="store full") as exc:
                await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
            assert isinstance(exc.value.__cause__, recoverable.StorageLimitExceeded)
            status = await rt.status(handle)
            assert not status.has_saved_completion
            assert status.attempts_used == 1  # the generated attempt stays spent
        assert store.get_payload(handle.operation_id, "completion") is None


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """A real write failure: files of this process cannot grow past ``limit`` bytes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


async def test_an_io_error_while_saving_the_completion_is_completion_unavailable(
    provider: FixtureProvider, store: recoverable.RecoveryStore, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    big = "y" * (2 * 1024 * 1024)
    provider.script([Reply.complete({"answer": 1, "note": big})])
    data = tmp_path / "store" / "data.mdb"
    limits: list[Callable[[], None]] = []
    real_hit = _killpoints.hit

    def hit(name: str) -> None:
        # Just before the receipt write: the data file may not grow by 2 MiB any more.
        if name == "receipt.before_save":
            cm = file_size_limit(os.path.getsize(data) + 512 * 1024)
            cm.__enter__()
            limits.append(lambda: cm.__exit__(None, None, None))
        real_hit(name)

    monkeypatch.setattr(_killpoints, "hit", hit)
    try:
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT
        ) as rt:
            handle = await rt.prepare(
                REQUEST, response=Answer, maximum_attempts=2, retry_policy=FAST
            )
            with pytest.raises(recoverable.CompletionUnavailable) as exc:
                await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
            assert isinstance(exc.value.__cause__, recoverable.StorageUnavailable)
            # The advice matches what happens next: the lost result is generated again.
            assert exc.value.unsaved and "replacement" in str(exc.value)
            for undo in limits:
                undo()
            limits.clear()
            status = await rt.status(handle)
            assert not status.has_saved_completion
            assert status.attempts_used == 1
            # The storage works again: the next execution replaces within the budget.
            value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
            assert isinstance(value, Answer)
            assert (await rt.status(handle)).attempts_used == 2
    finally:
        for undo in limits:
            undo()
    assert len(generation_requests(provider, handle.operation_id)) == 2


async def test_a_cancel_seen_at_delivery_fences_the_saved_result(
    provider: FixtureProvider, store: recoverable.RecoveryStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, retry_policy=FAST)
        op = handle.operation_id
        real_hit = _killpoints.hit

        def hit(name: str) -> None:
            # The receipt is saved; before it is delivered, another process cancels: the
            # command is durably written, and the monitor's scan (what its poll does when
            # another process committed) hands it to the running execution.
            if name == "receipt.saved":
                store.write_sync(lambda txn: txn.put_command(op, "cancel", rt.now()))
                rt.monitor.scan()
            real_hit(name)

        monkeypatch.setattr(_killpoints, "hit", hit)
        with pytest.raises(recoverable.OperationCancelled):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        monkeypatch.setattr(_killpoints, "hit", real_hit)
        status = await rt.status(handle)
        assert (status.state, status.availability) == ("cancelled", "permanently_cancelled")
        with pytest.raises(recoverable.RecoveryError):
            await rt.receipt(handle)
        with pytest.raises(recoverable.OperationCancelled):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
    assert len(generation_requests(provider, op)) == 1
