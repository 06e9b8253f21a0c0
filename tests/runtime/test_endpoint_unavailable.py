"""Issue 11.7: a misconfigured endpoint or key never fails a job and never spends budget.

Real sockets on 127.0.0.1: a closed port (bound, its number taken, closed), then the
fixture provider started on that same port; a plaintext server behind an https URL.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

import recoverable
from recoverable.testing import FixtureProvider
from recoverable.transport.connect import EndpointGate

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests

# Short so the test does not wait long once the provider is up; the production default
# (0.5 s doubling to 30 s) is exercised with MockClock in tests/transport/test_connect.py.
FAST_CONNECT = recoverable.ConnectBackoff(initial=0.02, maximum=0.1)


async def closed_port() -> int:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = int(listener.socket.getsockname()[1])
    await listener.aclose()
    return port


def backend_for(url: str, mode: str, credentials: Any = None) -> recoverable.ResponsesBackend:
    creds = credentials or recoverable.StaticCredentials("sk-test-secret", account=ACCOUNT)
    return recoverable.ResponsesBackend(
        url, credentials=creds, mode=mode,  # type: ignore[arg-type]
        endpoint_id="the-endpoint",  # the same identity before and after the provider is up
        limits=recoverable.StreamLimits(idle_timeout=5.0, connect_timeout=5.0),
    )


def endpoint_id_of(rt: recoverable.Runtime) -> str:
    """The gate is keyed by the backend's endpoint id (a custom label is bound to its host)."""
    assert rt.backend is not None
    return rt.backend.endpoint_id


async def serve_on(
    port: int, *, task_status: trio.TaskStatus[FixtureProvider] = trio.TASK_STATUS_IGNORED
) -> None:
    async with FixtureProvider.serve(port=port) as provider:
        task_status.started(provider)
        await trio.sleep_forever()


async def until(gate: EndpointGate, predicate: Callable[[EndpointGate], bool]) -> None:
    """Wait (no fixed sleep) until the gate's state satisfies ``predicate``."""
    if predicate(gate):
        return
    changed = trio.Event()

    def listener(g: EndpointGate) -> None:
        if predicate(g):
            changed.set()

    gate.listeners.append(listener)
    try:
        await changed.wait()
    finally:
        gate.listeners.remove(listener)


async def test_refused_connection_spends_nothing_then_the_same_attempt_completes(
    tmp_path: Path, mode: str
) -> None:
    port = await closed_port()
    url = f"http://127.0.0.1:{port}/v1"
    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    authorize = Authorizer()
    try:
        async with recoverable.open_runtime(
            store, backend_for(url, mode), account=ACCOUNT, connect_backoff=FAST_CONNECT
        ) as rt:
            handles = [
                await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, job_id=f"j{i}")
                for i in range(3)
            ]
            results: dict[str, Answer] = {}

            async def run(handle: recoverable.Handle) -> None:
                results[handle.operation_id] = await rt.send_recovering(
                    handle, response=Answer, authorize=authorize
                )

            gate = rt.endpoint_gate(endpoint_id_of(rt))
            async with trio.open_nursery() as servers:
                with trio.fail_after(60):  # generous: a loaded CI machine; never reached
                    async with trio.open_nursery() as nursery:
                        for handle in handles:
                            nursery.start_soon(run, handle)
                        # Several failed rounds: the jobs keep waiting, nothing is spent.
                        await until(gate, lambda g: g.failures >= 3)
                        for handle in handles:
                            status = await rt.status(handle)
                            assert status.availability == "endpoint_unavailable"
                            assert status.endpoint_failure == "connect_refused"
                            assert "endpoint_unavailable" in status.blockers
                            assert status.attempts_used == 0 and status.attempts_remaining == 2
                            assert status.pending_attempt_id == f"{handle.operation_id}.1"
                            record = store.get_operation(handle.operation_id)
                            assert record is not None
                            assert record.endpoint_failure == "connect_refused"
                            assert record.attempts == ()
                        # One gate for the endpoint, shared by the three operations.
                        assert rt.endpoint_gate(endpoint_id_of(rt)) is gate
                        provider = await servers.start(serve_on, port)
                servers.cancel_scope.cancel()
            assert set(results) == {h.operation_id for h in handles}
            for handle in handles:
                status = await rt.status(handle)
                assert status.availability == "completion_saved"
                assert status.attempts_used == 1
                assert [a.attempt_id for a in status.attempts] == [f"{handle.operation_id}.1"]
                assert status.endpoint_failure is None
                sent = generation_requests(provider, handle.operation_id)
                assert [r.attempt_id for r in sent] == [f"{handle.operation_id}.1"]
            # A host callback replay for the same pending attempt is not a new charge:
            # every callback named attempt 1.
            assert {a.number for a in authorize.calls} == {1}
    finally:
        store.close()


async def test_rerun_after_a_run_against_a_closed_port_completes_with_attempt_one(
    tmp_path: Path, mode: str
) -> None:
    """Between runs of the same store: the first run ends (suspended) while the endpoint
    refuses connections; the status read from the store says endpoint_unavailable; a rerun
    with the provider listening completes the job with attempt 1."""
    port = await closed_port()
    url = f"http://127.0.0.1:{port}/v1"
    path = str(tmp_path / "store")
    store = recoverable.RecoveryStore.open(path)
    try:
        async with recoverable.open_runtime(
            store, backend_for(url, mode), account=ACCOUNT, connect_backoff=FAST_CONNECT
        ) as rt:
            handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
            gate = rt.endpoint_gate(endpoint_id_of(rt))
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(
                        lambda: rt.send_recovering(handle, response=Answer, authorize=Authorizer())
                    )
                    await until(gate, lambda g: g.failures >= 2)
                    scope.cancel()  # the host's own bound on the run: the operation suspends
    finally:
        store.close()
    store = recoverable.RecoveryStore.open(path)
    try:
        async with recoverable.open_runtime(store, None, account=ACCOUNT) as reader:
            status = await reader.status(handle)
        assert status.state == "suspended"
        assert status.availability == "endpoint_unavailable"
        assert status.endpoint_failure == "connect_refused"
        assert status.attempts_used == 0 and status.attempts_remaining == 1
        assert status.pending_attempt_id == f"{handle.operation_id}.1"
        assert "resume" in status.suggested_actions
        async with FixtureProvider.serve(port=port) as provider:
            async with recoverable.open_runtime(
                store, backend_for(url, mode), account=ACCOUNT
            ) as rt:
                value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
                assert isinstance(value, Answer)
                status = await rt.status(handle)
        assert status.attempts_used == 1 and status.availability == "completion_saved"
        assert [r.attempt_id for r in provider.requests] == [f"{handle.operation_id}.1"]
    finally:
        store.close()


async def test_suspend_while_waiting_for_the_endpoint_keeps_budget_and_pending_id(
    tmp_path: Path
) -> None:
    port = await closed_port()
    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    try:
        async with recoverable.open_runtime(
            store, backend_for(f"http://127.0.0.1:{port}/v1", "sse"), account=ACCOUNT,
            connect_backoff=FAST_CONNECT,
        ) as rt:
            handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
            gate = rt.endpoint_gate(endpoint_id_of(rt))
            outcome: list[BaseException] = []

            async def run() -> None:
                try:
                    await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
                except recoverable.OperationSuspended as exc:
                    outcome.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                await until(gate, lambda g: g.failures >= 1)
                await rt.suspend(handle)
            assert len(outcome) == 1
            status = await rt.status(handle)
            assert status.state == "suspended"
            assert status.attempts_used == 0
            assert status.pending_attempt_id == f"{handle.operation_id}.1"
    finally:
        store.close()


async def test_tls_failure_is_reported_precisely(tmp_path: Path, mode: str) -> None:
    """An https URL in front of a plaintext server: tls_failure, nothing spent."""

    async def plaintext(stream: trio.SocketStream) -> None:
        try:
            await stream.receive_some(1024)
            await stream.send_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        except trio.BrokenResourceError:
            pass
        finally:
            await stream.aclose()

    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    try:
        async with trio.open_nursery() as servers:
            listeners = await servers.start(
                trio.serve_tcp, plaintext, 0
            )
            port = listeners[0].socket.getsockname()[1]
            async with recoverable.open_runtime(
                store, backend_for(f"https://127.0.0.1:{port}/v1", mode), account=ACCOUNT,
                connect_backoff=FAST_CONNECT,
            ) as rt:
                handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
                gate = rt.endpoint_gate(endpoint_id_of(rt))
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(
                        lambda: rt.send_recovering(handle, response=Answer, authorize=Authorizer())
                    )
                    await until(gate, lambda g: g.failures >= 1)
                    status = await rt.status(handle)
                    nursery.cancel_scope.cancel()
                assert gate.failure == "tls_failure"
                assert status.endpoint_failure == "tls_failure"
                assert status.availability == "endpoint_unavailable"
                assert (await rt.status(handle)).attempts_used == 0
            servers.cancel_scope.cancel()
    finally:
        store.close()


async def test_dns_failure_is_reported_precisely(tmp_path: Path, mode: str) -> None:
    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    try:
        # .invalid never resolves (RFC 6761).
        async with recoverable.open_runtime(
            store, backend_for("http://recoverable-test.invalid/v1", mode), account=ACCOUNT,
            connect_backoff=FAST_CONNECT,
        ) as rt:
            handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
            gate = rt.endpoint_gate(endpoint_id_of(rt))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    lambda: rt.send_recovering(handle, response=Answer, authorize=Authorizer())
                )
                await until(gate, lambda g: g.failures >= 1)
                nursery.cancel_scope.cancel()
            assert gate.failure == "dns_failure"
            status = await rt.status(handle)
            assert status.endpoint_failure == "dns_failure" and status.attempts_used == 0
    finally:
        store.close()


# --- keys ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["", "sk-caf\u00e9", "sk-abc\r", "sk-abc\n", "sk abc", " sk-abc", "sk-abc\t", "sk-\x00x"],
)
def test_static_credentials_reject_keys_that_cannot_be_sent(key: str) -> None:
    with pytest.raises(recoverable.InvalidCredentials) as info:
        recoverable.StaticCredentials(key)
    assert info.value.code == "invalid_credentials"
    assert isinstance(info.value, recoverable.InvalidRequest)
    if len(key) > 3:
        assert key not in str(info.value)  # never echo the key


def test_static_credentials_accept_a_normal_key() -> None:
    creds = recoverable.StaticCredentials("sk-proj-AZaz09_-.~+/=")
    assert "sk-proj" not in repr(creds)


class BadTokenCredentials:
    """Dynamic credentials whose token cannot be sent (a header with a line break)."""

    @property
    def account(self) -> recoverable.AccountBinding:
        return ACCOUNT

    async def token(self, *, renew: bool = False) -> str:
        return "sk-good\r\nx-injected: 1"


async def test_dynamic_token_is_validated_before_any_attempt_is_consumed(
    tmp_path: Path, mode: str
) -> None:
    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    try:
        async with FixtureProvider.serve() as provider:
            backend = backend_for(provider.http_url, mode, credentials=BadTokenCredentials())
            async with recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
                handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
                with pytest.raises(recoverable.InvalidCredentials):
                    await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
                status = await rt.status(handle)
                assert status.attempts_used == 0 and status.attempts_remaining == 2
            assert provider.requests == []
    finally:
        store.close()


async def test_sign_out_while_waiting_for_the_endpoint_stops_without_spending(
    tmp_path: Path
) -> None:
    """The approval is rechecked before every new try, not only at consumption."""
    port = await closed_port()
    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    try:
        async with recoverable.open_runtime(
            store, backend_for(f"http://127.0.0.1:{port}/v1", "websocket"), account=ACCOUNT,
            connect_backoff=FAST_CONNECT,
        ) as rt:
            handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
            gate = rt.endpoint_gate(endpoint_id_of(rt))
            raised: list[BaseException] = []

            async def run() -> None:
                try:
                    await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
                except recoverable.AccountChanged as exc:
                    raised.append(exc)

            with trio.fail_after(60):  # generous: CI load; the stop follows the next round
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run)
                    await until(gate, lambda g: g.failures >= 1)
                    rt.sign_out()
            assert len(raised) == 1
            rt.sign_in(ACCOUNT)
            status = await rt.status(handle)
            assert status.attempts_used == 0 and status.attempts_remaining == 1
            assert status.pending_attempt_id == f"{handle.operation_id}.1"
    finally:
        store.close()
