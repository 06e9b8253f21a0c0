"""Issue 10.3: sign-out and an account change stop running work, against the real fixture.

``runtime.sign_out()`` / ``runtime.sign_in(other)`` cancel the running execution's
transport, cooldown wait or authorization wait at once (the monitor's scope, the
same path a local ``cancel`` takes), record what happened honestly (an attempt in
flight stays spent, as an interruption), and keep a completion that was already
received as the original account's receipt instead of discarding it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

import recoverable
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

# Generous wall-clock bound for the sender to unwind after the stop (the stop itself
# is asserted synchronously: the scope is cancelled before sign_out() returns). It is
# far below the stall (forever) and the cooldown (an hour) it must cut short.
UNWIND_BOUND = 20.0
HOUR = 3600.0


def _switch(rt: Any, how: str) -> None:
    if how == "sign_out":
        rt.sign_out()
    else:
        rt.sign_in(OTHER)


def _code(how: str) -> str:
    return "signed_out" if how == "sign_out" else "account_changed"


async def _run_until(
    rt: Any,
    handle: recoverable.Handle,
    ready: Callable[[], Awaitable[None]],
    how: str,
    authorize: Any = None,
) -> BaseException | None:
    """Start ``send_recovering``, wait for ``ready``, switch the account, return the error."""
    caught: list[BaseException] = []
    finished = trio.Event()

    async def send() -> None:
        try:
            await rt.send_recovering(handle, response=Answer, authorize=authorize or Authorizer())
        except recoverable.RecoveryError as exc:
            caught.append(exc)
        finally:
            finished.set()

    with trio.fail_after(UNWIND_BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            await ready()
            assert rt.monitor.account_stop_for(handle.operation_id) is None
            _switch(rt, how)
            # Stopped synchronously, before sign_out()/sign_in() returned.
            assert rt.monitor.account_stop_for(handle.operation_id) == _code(how)
            await finished.wait()
    return caught[0] if caught else None


@pytest.mark.parametrize("how", ["sign_out", "account_change"])
async def test_sign_out_or_account_change_while_streaming_stops_the_transport(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str, how: str
) -> None:
    provider.script([Reply.stall(after_events=2)])
    async with recoverable.open_runtime(store, make_backend(provider, mode), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)

        async def streaming() -> None:
            await provider.wait_for_requests(1)

        error = await _run_until(rt, handle, streaming, how)
        assert isinstance(error, recoverable.AccountChanged)
        assert error.operation_id == handle.operation_id
        # Another account (or nobody) sees a redacted status.
        hidden = await rt.status(handle)
        assert hidden.redacted
        rt.sign_in(ACCOUNT)
        status = await rt.status(handle)
        # Not "running": the execution ended and released its lease.
        assert status.state == "interrupted"
        assert status.availability == "replacement_eligible"
        assert status.attempts_used == 1 and not status.has_saved_completion
        [summary] = status.attempts
        assert summary.outcome == "interrupted" and summary.failure is not None
        assert summary.failure.kind == "interrupted"
        assert summary.failure.transport_code == _code(how)
        assert status.last_failure == summary.failure
        # The original account resumes within the same budget (nothing refunded).
        provider.script([Reply.complete({"answer": 5, "note": "again"})])
        auth = Authorizer()
        value = await rt.send_recovering(handle, response=Answer, authorize=auth)
        assert value == Answer(5, "again")
        assert [a.reason for a in auth.calls] == ["replacement"]
        assert (await rt.status(handle)).attempts_used == 2
    assert len(generation_requests(provider, handle.operation_id)) == 2


@pytest.mark.parametrize("how", ["sign_out", "account_change"])
async def test_sign_out_or_account_change_during_a_cooldown_stops_the_wait(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str, how: str
) -> None:
    provider.script([Reply.rate_limited(retry_after=HOUR)])
    waiting = trio.Event()

    def sink(event: recoverable.TelemetryEvent) -> None:
        if event.name == "recovery.operation.waiting":
            waiting.set()

    policy = recoverable.RetryPolicy(maximum_retry_after=2 * HOUR)
    async with recoverable.open_runtime(
        store, make_backend(provider, mode), account=ACCOUNT, telemetry=sink
    ) as rt:
        handle = await rt.prepare(
            REQUEST, response=Answer, maximum_attempts=3, retry_policy=policy
        )
        auth = Authorizer()
        error = await _run_until(rt, handle, waiting.wait, how, authorize=auth)
        assert isinstance(error, recoverable.AccountChanged)
        rt.sign_in(ACCOUNT)
        status = await rt.status(handle)
        assert status.state == "interrupted" and status.availability == "waiting"
        # The cooldown survived the stop; nothing more was spent or asked.
        assert status.next_attempt_at is not None
        assert status.next_attempt_at.timestamp() > rt.now() + HOUR / 2
        assert status.attempts_used == 1 and len(auth.calls) == 1
        assert status.attempts[0].outcome == "failed"
    assert len(generation_requests(provider, handle.operation_id)) == 1


@pytest.mark.parametrize("how", ["sign_out", "account_change"])
async def test_sign_out_during_authorization_spends_nothing_and_keeps_the_pending_id(
    provider: FixtureProvider, store: recoverable.RecoveryStore, how: str
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        entered = trio.Event()
        seen: list[str] = []

        async def slow(attempt: recoverable.Attempt) -> bool:
            seen.append(attempt.attempt_id)
            entered.set()
            await trio.sleep_forever()
            return True

        error = await _run_until(rt, handle, entered.wait, how, authorize=slow)
        assert isinstance(error, recoverable.AccountChanged)
        rt.sign_in(ACCOUNT)
        status = await rt.status(handle)
        assert status.attempts_used == 0 and status.pending_attempt_id == seen[0]
        auth = Authorizer()
        await rt.send_recovering(handle, response=Answer, authorize=auth)
        assert [a.attempt_id for a in auth.calls] == seen
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_late_approval_after_sign_out_authorizes_no_post(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        entered = trio.Event()
        release = trio.Event()

        async def uncooperative(attempt: recoverable.Attempt) -> bool:
            entered.set()
            with trio.CancelScope(shield=True):  # ignores cancellation, answers late
                await release.wait()
            return True

        async def ready() -> None:
            await entered.wait()

        caught: list[BaseException] = []

        async def send() -> None:
            try:
                await rt.send_recovering(handle, response=Answer, authorize=uncooperative)
            except recoverable.RecoveryError as exc:
                caught.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            await entered.wait()
            rt.sign_out()
            rt.sign_in(ACCOUNT)  # back before the callback answers: still no POST now
            release.set()
        assert len(caught) == 1 and isinstance(caught[0], recoverable.AccountChanged)
        assert (await rt.status(handle)).attempts_used == 0
    assert generation_requests(provider, handle.operation_id) == []


class _SignOutOnArrival:
    """The real backend; the host signs out just as the full response has arrived
    (after the transport returned it, before the runtime validated and saved it)."""

    def __init__(self, inner: recoverable.ResponsesBackend, on_arrival: Callable[[], None]):
        self._inner = inner
        self._on_arrival = on_arrival

    @property
    def endpoint_id(self) -> str:
        return self._inner.endpoint_id

    @property
    def credentials(self) -> Any:
        return self._inner.credentials

    async def stream(self, body: bytes, **kwargs: Any) -> Any:
        outcome = await self._inner.stream(body, **kwargs)
        self._on_arrival()
        return outcome


@pytest.mark.parametrize("how", ["sign_out", "account_change"])
async def test_a_completion_received_before_the_stop_is_kept_as_the_receipt(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str, how: str
) -> None:
    provider.script([Reply.complete({"answer": 9, "note": "paid"})])
    holder: list[Any] = []
    backend = _SignOutOnArrival(make_backend(provider, mode), lambda: _switch(holder[0], how))
    async with recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
        holder.append(rt)
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        with pytest.raises(recoverable.AccountChanged):
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        # Nothing is delivered to whoever is signed in now.
        with pytest.raises(recoverable.AccountChanged):
            await rt.receipt(handle)
        rt.sign_in(ACCOUNT)
        status = await rt.status(handle)
        assert status.state == "completed" and status.has_saved_completion
        assert status.attempts_used == 1 and status.attempts[0].outcome == "completed"
        receipt = await rt.receipt(handle)
        assert receipt.decode(Answer) == Answer(9, "paid")
        auth = Authorizer()
        value = await rt.send_recovering(handle, response=Answer, authorize=auth)
        assert value == Answer(9, "paid") and auth.calls == []
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_sign_in_of_the_same_account_does_not_stop_running_work(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    provider.script([Reply.stall(after_events=2)])
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                with pytest.raises(recoverable.OperationSuspended):
                    await rt.send_recovering(handle, response=Answer, authorize=Authorizer())

            nursery.start_soon(send)
            await provider.wait_for_requests(1)
            rt.sign_in(ACCOUNT)  # the same binding (by value): nothing changes
            assert rt.monitor.account_stop_for(handle.operation_id) is None
            assert (await rt.status(handle)).state == "running"
            await rt.suspend(handle)


async def test_signing_the_same_account_back_in_at_once_still_stops_the_stream(
    provider: FixtureProvider, store: recoverable.RecoveryStore, mode: str
) -> None:
    # The sign-out happened: the execution stops even if the host signs the same
    # account back in before it unwound; the host reopens the handle.
    provider.script([Reply.stall(after_events=2), Reply.complete({"answer": 3, "note": "r"})])
    async with recoverable.open_runtime(store, make_backend(provider, mode), account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        caught: list[BaseException] = []

        async def send() -> None:
            try:
                await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
            except recoverable.RecoveryError as exc:
                caught.append(exc)

        with trio.fail_after(UNWIND_BOUND):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                await provider.wait_for_requests(1)
                rt.sign_out()
                rt.sign_in(ACCOUNT)
        assert len(caught) == 1 and isinstance(caught[0], recoverable.AccountChanged)
        status = await rt.status(handle)
        assert status.attempts_used == 1 and status.state == "interrupted"
        assert status.attempts[0].failure is not None
        assert status.attempts[0].failure.transport_code == "signed_out"
        value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert value == Answer(3, "r")
    assert len(generation_requests(provider, handle.operation_id)) == 2


async def test_sign_out_while_streaming_on_a_pooled_websocket_connection(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    # With ``async with backend`` WebSocket mode reuses connections: the stopped
    # stream's connection must not be handed to the next attempt half-read.
    provider.script([Reply.stall(after_events=2), Reply.complete({"answer": 4, "note": "p"})])
    backend = make_backend(provider, "websocket")
    async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)

        async def streaming() -> None:
            await provider.wait_for_requests(1)

        error = await _run_until(rt, handle, streaming, "sign_out")
        assert isinstance(error, recoverable.AccountChanged)
        rt.sign_in(ACCOUNT)
        with trio.fail_after(UNWIND_BOUND):
            value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert value == Answer(4, "p")
        assert (await rt.status(handle)).attempts_used == 2
    assert len(generation_requests(provider, handle.operation_id)) == 2
