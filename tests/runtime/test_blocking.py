"""Blocking and asyncio hosts (issue 19.6) and a synchronous ``authorize`` (issue 19.9).

The fixture provider runs in-process in a Trio thread of its own, so the host side
of each test is plain threads or a real ``asyncio.run`` app, as a user's would be.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio

import recoverable
from recoverable.testing import FixtureProvider, Reply
from recoverable.transport.sse import SseTransport

from .conftest import ACCOUNT, REQUEST, Answer, generation_requests, make_backend

T = TypeVar("T")

FAST = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)


class ProviderThread:
    """A ``FixtureProvider`` served by ``trio.run`` in its own thread."""

    def __init__(self, provider: FixtureProvider, token: trio.lowlevel.TrioToken) -> None:
        self.provider = provider
        self.token = token

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    def script(self, replies: list[Reply]) -> None:
        self.run_sync(self.provider.script, replies)

    def wait_for_requests(self, n: int) -> None:
        trio.from_thread.run(self.provider.wait_for_requests, n, trio_token=self.token)

    def requests_of(self, operation_id: str) -> list[Any]:
        return self.run_sync(generation_requests, self.provider, operation_id)


@contextmanager
def provider_thread() -> Iterator[ProviderThread]:
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        async with FixtureProvider.serve() as provider:
            box["stop"] = trio.Event()
            box["ctl"] = ProviderThread(provider, trio.lowlevel.current_trio_token())
            ready.set()
            await box["stop"].wait()

    def run() -> None:
        try:
            trio.run(main)
        finally:
            ready.set()

    thread = threading.Thread(target=run, name="fixture-provider", daemon=True)
    thread.start()
    ready.wait()
    ctl: ProviderThread = box["ctl"]
    try:
        yield ctl
    finally:
        ctl.token.run_sync_soon(box["stop"].set)
        thread.join()


@pytest.fixture
def served() -> Iterator[ProviderThread]:
    with provider_thread() as ctl:
        yield ctl


@pytest.fixture
def store_path(tmp_path: Path) -> str:
    return str(tmp_path / "store")


# --- blocking hosts -----------------------------------------------------------------------


def test_blocking_runtime_from_many_threads_at_once(
    served: ProviderThread, store_path: str
) -> None:
    threads_n = 8
    barrier = threading.Barrier(threads_n)
    results: dict[int, Any] = {}
    failures: list[BaseException] = []
    with (
        recoverable.RecoveryStore.open(store_path) as store,
        recoverable.BlockingRuntime(
            store, make_backend(served.provider, "sse"), account=ACCOUNT
        ) as runtime,
    ):

        def host(i: int) -> None:
            try:
                me = threading.get_ident()
                seen: list[int] = []

                def authorize(attempt: recoverable.Attempt) -> bool:  # a plain def
                    seen.append(threading.get_ident())
                    return True

                barrier.wait()  # every thread calls at the same moment
                handle = runtime.prepare(REQUEST, response=Answer, maximum_attempts=2)
                value = runtime.send_recovering(handle, response=Answer, authorize=authorize)
                assert seen == [me]  # the callback ran once, in the calling thread
                assert runtime.status(handle).state == "completed"
                assert runtime.receipt(handle).operation_id == handle.operation_id
                runtime.acknowledge(handle)
                results[i] = (handle, value)
            except BaseException as exc:  # reported below
                failures.append(exc)

        workers = [threading.Thread(target=host, args=(i,)) for i in range(threads_n)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert failures == []
        assert len(results) == threads_n
        for handle, value in results.values():
            assert isinstance(value, Answer)
            assert runtime.status(handle).state == "acknowledged"
            assert len(served.requests_of(handle.operation_id)) == 1
        assert len(runtime.inventory().operations) == 0  # acknowledged: content removed


def test_closing_the_blocking_runtime_suspends_a_running_send(
    served: ProviderThread, store_path: str
) -> None:
    served.script([Reply.stall(after_events=2)])
    outcome: list[BaseException | object] = []
    with recoverable.RecoveryStore.open(store_path) as store:
        runtime = recoverable.BlockingRuntime(
            store, make_backend(served.provider, "sse"), account=ACCOUNT
        )
        with runtime:
            handle = runtime.prepare(
                REQUEST, response=Answer, maximum_attempts=3, retry_policy=FAST
            )

            def host() -> None:
                try:
                    outcome.append(
                        runtime.send_recovering(handle, response=Answer, authorize=lambda a: True)
                    )
                except BaseException as exc:
                    outcome.append(exc)

            caller = threading.Thread(target=host)
            caller.start()
            served.wait_for_requests(1)  # the attempt is streaming (stalled)
        # The context exit returned: the send was stopped and its suspension saved.
        caller.join()
        assert len(outcome) == 1 and isinstance(outcome[0], recoverable.OperationSuspended)
        assert outcome[0].code == "operation_suspended"
        with pytest.raises(recoverable.RuntimeClosed) as closed:
            runtime.status(handle)
        assert closed.value.code == "runtime_closed"
        with recoverable.BlockingRuntime(
            store, make_backend(served.provider, "sse"), account=ACCOUNT
        ) as again:
            status = again.status(handle)
            assert status.state == "suspended" and status.attempts_used == 1
            # Resumable: the interrupted attempt is replaced and completes.
            value = again.send_recovering(handle, response=Answer, authorize=lambda a: True)
            assert isinstance(value, Answer)
            assert again.status(handle).attempts_used == 2


def test_suspend_from_another_thread_stops_a_blocked_send(
    served: ProviderThread, store_path: str
) -> None:
    served.script([Reply.stall(after_events=2)])
    with (
        recoverable.RecoveryStore.open(store_path) as store,
        recoverable.BlockingRuntime(
            store, make_backend(served.provider, "websocket"), account=ACCOUNT
        ) as runtime,
    ):
        handle = runtime.prepare(REQUEST, response=Answer, maximum_attempts=3)
        errors: list[BaseException] = []

        def host() -> None:
            try:
                runtime.send_recovering(handle, response=Answer, authorize=lambda a: True)
            except BaseException as exc:
                errors.append(exc)

        caller = threading.Thread(target=host)
        caller.start()
        served.wait_for_requests(1)
        runtime.suspend(handle)
        caller.join()
        assert len(errors) == 1 and isinstance(errors[0], recoverable.OperationSuspended)
        assert runtime.status(handle).state == "suspended"


def test_blocking_runtime_rejects_an_async_authorize_at_the_call(
    served: ProviderThread, store_path: str
) -> None:
    async def authorize(attempt: recoverable.Attempt) -> bool:
        return True

    with (
        recoverable.RecoveryStore.open(store_path) as store,
        recoverable.BlockingRuntime(
            store, make_backend(served.provider, "sse"), account=ACCOUNT
        ) as runtime,
    ):
        handle = runtime.prepare(REQUEST, response=Answer, maximum_attempts=2)
        with pytest.raises(recoverable.InvalidRequest, match="AsyncioRuntime"):
            runtime.send_recovering(handle, response=Answer, authorize=authorize)  # type: ignore[arg-type]
        assert runtime.status(handle).attempts_used == 0
        assert served.requests_of(handle.operation_id) == []


def test_a_callback_exception_escapes_unchanged_and_spends_nothing(
    served: ProviderThread, store_path: str
) -> None:
    class HostDown(Exception):
        pass

    def authorize(attempt: recoverable.Attempt) -> bool:
        raise HostDown

    with (
        recoverable.RecoveryStore.open(store_path) as store,
        recoverable.BlockingRuntime(
            store, make_backend(served.provider, "sse"), account=ACCOUNT
        ) as runtime,
    ):
        handle = runtime.prepare(REQUEST, response=Answer, maximum_attempts=2)
        with pytest.raises(HostDown):
            runtime.send_recovering(handle, response=Answer, authorize=authorize)
        assert runtime.status(handle).attempts_used == 0
        with pytest.raises(recoverable.AttemptNotAuthorized):
            runtime.send_recovering(handle, response=Answer, authorize=lambda a: False)
        assert served.requests_of(handle.operation_id) == []


def test_blocking_runtime_not_started_or_failing_to_open_is_typed(store_path: str) -> None:
    with recoverable.RecoveryStore.open(store_path) as store:
        runtime = recoverable.BlockingRuntime(store, None, account=ACCOUNT)
        with pytest.raises(recoverable.RuntimeClosed):
            runtime.inventory()
        bad = recoverable.BlockingRuntime(store, None, account=ACCOUNT, no_such_option=1)
        with pytest.raises(TypeError):
            bad.start()


# --- asyncio hosts ------------------------------------------------------------------------


def test_asyncio_app_with_concurrent_tasks(served: ProviderThread, store_path: str) -> None:
    tasks_n = 8

    async def app(store: recoverable.RecoveryStore) -> list[Any]:
        loop_thread = threading.get_ident()
        calls: list[int] = []

        async def authorize(attempt: recoverable.Attempt) -> bool:  # runs on this loop
            calls.append(threading.get_ident())
            await asyncio.sleep(0)
            return True

        async with recoverable.AsyncioRuntime(
            store, make_backend(served.provider, "websocket"), account=ACCOUNT
        ) as runtime:

            async def job() -> Any:
                handle = await runtime.prepare(REQUEST, response=Answer, maximum_attempts=2)
                value = await runtime.send_recovering(
                    handle, response=Answer, authorize=authorize
                )
                assert (await runtime.status(handle)).state == "completed"
                await runtime.acknowledge(handle)
                return handle, value

            done = await asyncio.gather(*(job() for _ in range(tasks_n)))
            assert calls == [loop_thread] * tasks_n
            assert (await runtime.inventory()).operations == ()
            return done

    with recoverable.RecoveryStore.open(store_path) as store:
        done = asyncio.run(app(store))
    assert len(done) == tasks_n
    assert len({h.operation_id for h, _ in done}) == tasks_n
    for handle, value in done:
        assert isinstance(value, Answer)
        assert len(served.requests_of(handle.operation_id)) == 1


def test_cancelling_the_asyncio_task_suspends_the_operation(
    served: ProviderThread, store_path: str
) -> None:
    served.script([Reply.stall(after_events=2)])

    async def app(store: recoverable.RecoveryStore) -> None:
        with recoverable.BlockingRuntime(
            store, make_backend(served.provider, "sse"), account=ACCOUNT
        ) as blocking:
            runtime = blocking.asyncio()  # a view: the with block owns the runtime
            handle = await runtime.prepare(
                REQUEST, response=Answer, maximum_attempts=3, retry_policy=FAST
            )
            task = asyncio.create_task(
                runtime.send_recovering(handle, response=Answer, authorize=lambda a: True)
            )
            # The loop stays free while the send streams (stalled): it runs this wait.
            await asyncio.to_thread(served.wait_for_requests, 1)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The cancellation propagated only after the suspension was saved.
            status = await runtime.status(handle)
            assert status.state == "suspended" and status.attempts_used == 1
            assert "resume" in status.suggested_actions or "execute" in status.suggested_actions
            value = await runtime.send_recovering(handle, response=Answer, authorize=lambda a: True)
            assert isinstance(value, Answer)

    with recoverable.RecoveryStore.open(store_path) as store:
        asyncio.run(app(store))


def test_open_runtime_under_asyncio_raises_a_typed_error(store_path: str) -> None:
    async def app(store: recoverable.RecoveryStore) -> None:
        async with recoverable.open_runtime(store, None, account=ACCOUNT):
            pass  # pragma: no cover - never reached

    with recoverable.RecoveryStore.open(store_path) as store:
        with pytest.raises(recoverable.TrioRequired) as caught:
            asyncio.run(app(store))
    assert caught.value.code == "trio_required"
    assert isinstance(caught.value, recoverable.RecoveryError)
    assert "BlockingRuntime" in str(caught.value) and "AsyncioRuntime" in str(caught.value)


# --- a synchronous authorize in the Trio runtime (issue 19.9) ------------------------------


async def test_a_plain_def_authorize_is_accepted_by_the_trio_runtime(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    seen: list[recoverable.Attempt] = []

    def authorize(attempt: recoverable.Attempt) -> bool:
        seen.append(attempt)
        return True

    backend = make_backend(provider)
    async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        value = await rt.send_recovering(handle, response=Answer, authorize=authorize)
        assert isinstance(value, Answer)
        assert [a.reason for a in seen] == ["initial"]
        denied = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        with pytest.raises(recoverable.AttemptNotAuthorized):
            await rt.send_recovering(denied, response=Answer, authorize=lambda a: False)
        assert (await rt.status(denied)).attempts_used == 0


def test_an_interrupt_in_the_waiting_thread_suspends_before_it_propagates(
    served: ProviderThread, store_path: str
) -> None:
    def authorize(attempt: recoverable.Attempt) -> bool:
        raise KeyboardInterrupt  # as a Ctrl-C while the calling thread waits

    with (
        recoverable.RecoveryStore.open(store_path) as store,
        recoverable.BlockingRuntime(
            store, make_backend(served.provider, "sse"), account=ACCOUNT
        ) as runtime,
    ):
        handle = runtime.prepare(REQUEST, response=Answer, maximum_attempts=2)
        with pytest.raises(KeyboardInterrupt):
            runtime.send_recovering(handle, response=Answer, authorize=authorize)
        status = runtime.status(handle)  # already saved when the interrupt propagated
        assert status.state == "suspended" and status.attempts_used == 0
        assert served.requests_of(handle.operation_id) == []
        value = runtime.send_recovering(handle, response=Answer, authorize=lambda a: True)
        assert isinstance(value, Answer)


def test_the_blocking_runtime_opens_and_closes_the_backend_in_its_thread(
    served: ProviderThread, store_path: str
) -> None:
    backend = make_backend(served.provider, "sse")
    transport = backend._transport
    assert isinstance(transport, SseTransport)  # white-box: its httpx pools
    with (
        recoverable.RecoveryStore.open(store_path) as store,
        recoverable.BlockingRuntime(store, backend, account=ACCOUNT) as runtime,
    ):
        handle = runtime.prepare(REQUEST, response=Answer, maximum_attempts=2)
        runtime.send_recovering(handle, response=Answer, authorize=lambda a: True)
        clients = transport.clients
        assert clients and not any(client.is_closed for client in clients)
    # pooled connections closed with the runtime, in its own run
    assert all(client.is_closed for client in clients)
