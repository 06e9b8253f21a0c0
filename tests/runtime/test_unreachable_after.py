"""Issue 29.5: an endpoint that never answers is no longer waited on forever.

``open_runtime(unreachable_after=S)`` bounds the shared connect backoff: once the endpoint
has been unreachable for S seconds (from the first failed connect of its gate with no
success since), every operation waiting on it ends with ``EndpointUnavailable`` naming the
kind; nothing is spent (the approved attempt is consumed only once a connection exists),
the operation rests ``prepared`` with its pending attempt id, and a later call (or a
rerun) sends that same attempt 1. ``run_worker`` stops and raises it, its operations still
queued.

The bound is measured on Trio's clock: the first tests drive it with ``MockClock`` and a
backend that never connects (no socket, no thread but the store's writer, whose commits
``autojump`` may take for idleness: the assertions are one-sided in Trio time, which the
jumps cannot break). The last test uses a real closed port and the real transport.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import recoverable
from recoverable.actors.worker import run_worker
from recoverable.outcome import Completed, Interruption, Outcome, Progress
from recoverable.testing import FixtureProvider

from ..mock_clock import commits_take_no_time
from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests
from .test_endpoint_unavailable import FAST_CONNECT, backend_for, closed_port

BOUND = 20.0
BACKOFF = recoverable.ConnectBackoff(initial=1.0, maximum=4.0)


class Unreachable:
    """A backend whose connections are never established (a closed port), until ``up``:
    then every stream connects (``before_send``: the attempt is consumed) and completes."""

    endpoint_id = "the-endpoint"

    def __init__(self) -> None:
        self.credentials = recoverable.StaticCredentials("sk-test", account=ACCOUNT)
        self.up = False
        self.tries = 0  # connects attempted
        self.sent: list[str] = []  # attempt ids whose request was sent

    async def stream(
        self,
        body: bytes,
        *,
        attempt_id: str,
        token: str,
        on_progress: Callable[[Progress], None] | None = None,
        before_send: Callable[[], Awaitable[None]] | None = None,
        on_delta: Callable[[str], None] | None = None,
    ) -> Outcome:
        self.tries += 1
        await trio.sleep(0.01)  # connecting takes a moment
        if not self.up:
            return Interruption(kind="disconnected", transport_code="connect_refused")
        assert before_send is not None
        await before_send()
        self.sent.append(attempt_id)
        return Completed(text='{"answer": 42, "note": "ok"}', response_id=f"resp-{attempt_id}")


def runtime(store: recoverable.RecoveryStore, backend: Any, **options: Any) -> Any:
    return recoverable.open_runtime(
        store, backend, account=ACCOUNT,
        # monitor_interval: nothing to watch here: fewer idle wake-ups under MockClock
        **{"monitor_interval": 1.0, "unreachable_after": BOUND, "connect_backoff": BACKOFF,
           **options},
    )


def test_every_waiting_operation_ends_at_the_bound_with_nothing_spent(tmp_path: Path) -> None:
    backend = Unreachable()

    async def main() -> None:
        store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
        try:
            async with runtime(store, backend) as rt:
                handles = [
                    await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, job_id=f"j{i}")
                    for i in range(3)
                ]
                ended: dict[str, tuple[float, recoverable.EndpointUnavailable]] = {}
                authorize = Authorizer()

                async def run(handle: recoverable.Handle) -> None:
                    with pytest.raises(recoverable.EndpointUnavailable) as info:
                        await rt.send_recovering(handle, response=Answer, authorize=authorize)
                    ended[handle.operation_id] = (trio.current_time(), info.value)

                async with trio.open_nursery() as nursery:
                    for handle in handles:
                        nursery.start_soon(run, handle)
                gate = rt.endpoint_gate(backend.endpoint_id)
                assert gate.down_since is not None
                assert gate.give_up_at() == gate.down_since + BOUND
                assert backend.sent == [] and backend.tries >= 3  # probed, never connected
                for handle in handles:
                    at, error = ended[handle.operation_id]
                    assert at >= gate.give_up_at()  # never before the bound
                    assert isinstance(error, recoverable.EndpointUnavailable)
                    assert error.code == "endpoint_unavailable"
                    assert (error.kind, error.unreachable_after) == ("connect_refused", BOUND)
                    assert error.operation_id == handle.operation_id
                    assert "connect_refused" in str(error) and "20 s" in str(error)
                    record = store.get_operation(handle.operation_id)
                    assert record is not None
                    assert record.phase == "prepared"  # as it was: nothing spent
                    assert record.attempts == () and record.attempts_used == 0
                    assert record.pending is not None
                    assert record.pending.attempt_id == f"{handle.operation_id}.1"
                    assert record.endpoint_failure == "connect_refused"
                    assert store.get_lease(handle.operation_id) is None  # released
                    status = await rt.status(handle)
                    assert status.availability == "endpoint_unavailable"
                    assert status.attempts_remaining == 2
                assert {a.number for a in authorize.calls} == {1}
                # The endpoint is back: a new call tries at once (it is owed a probe even
                # though the gate is past its bound) and sends the same attempt 1.
                backend.up = True
                value = await rt.send_recovering(handles[0], response=Answer,
                                                 authorize=Authorizer())
                assert value == Answer(answer=42, note="ok")
                assert backend.sent == [f"{handles[0].operation_id}.1"]
                status = await rt.status(handles[0])
                assert status.attempts_used == 1 and status.endpoint_failure is None
                assert gate.down_since is None  # a success ends the outage and its clock
        finally:
            store.close()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_without_a_bound_the_wait_has_no_end(tmp_path: Path) -> None:
    """``unreachable_after=math.inf``: the wait of before, still waiting after an hour
    (twelve times the default bound; the default backoff probes every 30 s). The writer's
    commits take no Trio time here (``commits_take_no_time``): the hour is the backoff's."""
    backend = Unreachable()

    async def main() -> None:
        store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
        try:
            async with commits_take_no_time(), runtime(
                store, backend, unreachable_after=math.inf,
                connect_backoff=recoverable.ConnectBackoff(),
            ) as rt:
                handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
                with trio.move_on_after(3600) as waited:
                    await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
                assert waited.cancelled_caught
                # At 0, then 0.5, 1, 2, 4, 8, 16 s later (31.5 s), then every 30 s: 125 tries
                # in the hour (each takes 0.01 s to fail).
                assert backend.sent == [] and backend.tries == 125
                record = store.get_operation(handle.operation_id)
                assert record is not None and record.attempts_used == 0
        finally:
            store.close()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("bad", [-1.0, math.nan, "300", None])
async def test_unreachable_after_is_checked_when_the_runtime_opens(
    tmp_path: Path, bad: Any
) -> None:
    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    try:
        with pytest.raises(recoverable.InvalidRequest, match="unreachable_after"):
            async with recoverable.open_runtime(
                store, Unreachable(), account=ACCOUNT, unreachable_after=bad
            ):
                pass  # pragma: no cover
        async with recoverable.open_runtime(
            store, Unreachable(), account=ACCOUNT, unreachable_after=math.inf
        ) as rt:
            assert rt.unreachable_after == math.inf
        async with recoverable.open_runtime(store, Unreachable(), account=ACCOUNT) as rt:
            assert rt.unreachable_after == 300.0  # the default
    finally:
        store.close()


def test_a_worker_stops_at_the_bound_and_its_operations_stay_queued(tmp_path: Path) -> None:
    backend = Unreachable()

    async def main() -> None:
        store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
        try:
            async with runtime(store, backend) as rt:
                handles = [
                    await rt.submit(REQUEST, response=Answer, maximum_attempts=2, job_id=f"j{i}")
                    for i in range(3)
                ]
                with pytest.raises(recoverable.EndpointUnavailable) as info:
                    await run_worker(rt, concurrency=8, authorize=Authorizer())
                assert info.value.kind == "connect_refused"
                assert info.value.operation_id is None  # the worker's, not one operation's
                assert trio.current_time() >= rt.endpoint_gate("the-endpoint").give_up_at()
                queued = {entry.operation_id for entry in store.queued()}
                assert queued == {handle.operation_id for handle in handles}
                for handle in handles:
                    record = store.get_operation(handle.operation_id)
                    assert record is not None and record.attempts_used == 0
                    assert record.phase in ("prepared", "suspended")
                    assert record.pending is not None
                    assert store.get_lease(handle.operation_id) is None
                assert backend.sent == []
        finally:
            store.close()
        # The next worker (another runtime: a fresh gate) finds the endpoint back and runs
        # every operation with its attempt 1.
        backend.up = True
        store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
        try:
            async with runtime(store, backend) as rt:
                stop = trio.Event()
                values = []
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(lambda: run_worker(
                        rt, concurrency=8, authorize=Authorizer(), stop=stop
                    ))
                    for handle in handles:
                        values.append(await rt.wait(handle, response=Answer))
                    stop.set()
                assert values == [Answer(answer=42, note="ok")] * 3
                assert sorted(backend.sent) == sorted(f"{h.operation_id}.1" for h in handles)
        finally:
            store.close()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_a_closed_port_ends_with_the_typed_error_then_attempt_one_completes(
    tmp_path: Path, mode: str
) -> None:
    """The real transport against a real closed port: nothing reaches any server; the
    provider then listens on that port and a rerun completes with attempt 1."""
    port = await closed_port()
    url = f"http://127.0.0.1:{port}/v1"
    path = str(tmp_path / "store")
    store = recoverable.RecoveryStore.open(path)
    try:
        async with recoverable.open_runtime(
            store, backend_for(url, mode), account=ACCOUNT, connect_backoff=FAST_CONNECT,
            unreachable_after=0.3,
        ) as rt:
            handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
            with trio.fail_after(60):  # generous: a loaded CI machine; the bound is 0.3 s
                with pytest.raises(recoverable.EndpointUnavailable) as info:
                    await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
            assert info.value.kind == "connect_refused"
            status = await rt.status(handle)
            assert status.state == "prepared" and status.availability == "endpoint_unavailable"
            assert status.attempts_used == 0 and status.attempts_remaining == 1
            assert status.pending_attempt_id == f"{handle.operation_id}.1"
    finally:
        store.close()
    store = recoverable.RecoveryStore.open(path)
    try:
        async with FixtureProvider.serve(port=port) as provider:
            async with recoverable.open_runtime(
                store, backend_for(url, mode), account=ACCOUNT
            ) as rt:
                value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
                assert isinstance(value, Answer)
                status = await rt.status(handle)
        assert status.attempts_used == 1 and status.availability == "completion_saved"
        sent = generation_requests(provider, handle.operation_id)
        assert [r.attempt_id for r in sent] == [f"{handle.operation_id}.1"]
    finally:
        store.close()
