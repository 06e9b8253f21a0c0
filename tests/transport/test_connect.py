"""Issue 11.7: connect before the attempt is consumed; typed connect failures; the gate."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing
from transport_helpers import make_body

from recoverable.errors import EndpointUnavailable, InvalidRequest
from recoverable.outcome import Completed, Interruption
from recoverable.testing import FixtureProvider
from recoverable.transport.backend import ResponsesBackend
from recoverable.transport.base import StaticCredentials
from recoverable.transport.connect import (
    ConnectBackoff,
    EndpointGate,
    check_unreachable_after,
    classify_connect_error,
)

MODES = ["sse", "websocket"]
BODY = make_body()


def backend(url: str, mode: str) -> ResponsesBackend:
    return ResponsesBackend(url, credentials=StaticCredentials("sk-test"), mode=mode)  # type: ignore[arg-type]


# --- before_send: after the connection, before the request -------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_before_send_runs_once_connected_and_before_anything_is_sent(
    provider: FixtureProvider, mode: str
) -> None:
    seen: list[int] = []

    async def before_send() -> None:
        seen.append(len(provider.requests))

    async with backend(provider.http_url, mode) as b:
        for attempt in ("a1", "a2"):  # the second one reuses a pooled connection
            outcome = await b.stream(BODY, attempt_id=attempt, token="sk-test",
                                     before_send=before_send)
            assert isinstance(outcome, Completed)
    assert seen == [0, 1]  # called once per stream, before the provider saw the request
    assert len(provider.requests) == 2


class Refused(Exception):
    pass


@pytest.mark.parametrize("mode", MODES)
async def test_an_exception_from_before_send_aborts_without_sending(
    provider: FixtureProvider, mode: str
) -> None:
    async def before_send() -> None:
        raise Refused

    async with backend(provider.http_url, mode) as b:
        with pytest.raises(Refused):
            await b.stream(BODY, attempt_id="a1", token="sk-test", before_send=before_send)
        # The backend is still usable and the provider never received a generation request.
        outcome = await b.stream(BODY, attempt_id="a2", token="sk-test")
        assert isinstance(outcome, Completed)
    assert [r.attempt_id for r in provider.requests] == ["a2"]


@pytest.mark.parametrize("mode", MODES)
async def test_a_refused_connection_never_calls_before_send(mode: str) -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()
    called: list[bool] = []

    async def before_send() -> None:
        called.append(True)

    b = backend(f"http://127.0.0.1:{port}/v1", mode)
    outcome = await b.stream(BODY, attempt_id="a", token="sk-test", before_send=before_send)
    await b.aclose()
    assert called == []
    assert isinstance(outcome, Interruption)
    assert (outcome.kind, outcome.transport_code) == ("disconnected", "connect_refused")


@pytest.mark.parametrize("mode", MODES)
async def test_tls_failure_is_typed_without_waiting_for_the_timeout(mode: str) -> None:
    async def plaintext(stream: trio.SocketStream) -> None:
        try:
            await stream.receive_some(1024)
            await stream.send_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        except trio.BrokenResourceError:
            pass
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, plaintext, 0)
        port = listeners[0].socket.getsockname()[1]
        b = backend(f"https://127.0.0.1:{port}/v1", mode)
        # Far below the 15 s connect timeout: before, WebSocket mode only saw a timeout.
        with trio.fail_after(10):
            outcome = await b.stream(BODY, attempt_id="a", token="sk-test")
        await b.aclose()
        nursery.cancel_scope.cancel()
    assert isinstance(outcome, Interruption)
    assert outcome.transport_code == "tls_failure"


# --- classification ----------------------------------------------------------------------


def _chained(outer: BaseException, inner: BaseException) -> BaseException:
    outer.__cause__ = inner
    return outer


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (_chained(OSError("all attempts failed"), ExceptionGroup(
            "x", [ConnectionRefusedError(111, "refused")])), "connect_refused"),
        (_chained(OSError("x"), socket.gaierror(-2, "Name or service not known")), "dns_failure"),
        (_chained(trio.BrokenResourceError(), ssl.SSLError(1, "WRONG_VERSION_NUMBER")),
         "tls_failure"),
        (_chained(OSError("x"), ssl.SSLCertVerificationError(1, "verify failed")),
         "tls_failure"),
        (trio.TooSlowError(), "connect_timeout"),
        (OSError(113, "No route to host"), "connect_failed"),
    ],
)
def test_classify_connect_error(exc: BaseException, kind: str) -> None:
    assert classify_connect_error(exc) == kind


# --- the shared gate (MockClock: no thread, no socket) -----------------------------------


def test_connect_backoff_is_bounded_exponential() -> None:
    backoff = ConnectBackoff()
    assert [backoff.delay(n) for n in (1, 2, 3, 7, 8, 200, 10**6)] == [
        0.5, 1.0, 2.0, 30.0, 30.0, 30.0, 30.0
    ]
    for bad in (dict(initial=0), dict(maximum=-1), dict(multiplier=0.5),
                dict(initial=2, maximum=1), dict(initial=float("nan"))):
        with pytest.raises(InvalidRequest):
            ConnectBackoff(**bad)  # type: ignore[arg-type]


def test_gate_one_probe_per_round_with_bounded_backoff() -> None:
    async def main() -> None:
        gate = EndpointGate("e", ConnectBackoff(initial=0.5, maximum=4.0))
        # Open: five operations connect at once and all fail -> one failed round, not five.
        tickets = [await gate.admit() for _ in range(5)]
        for ticket in tickets:
            gate.failed(ticket, "connect_refused")
        assert gate.failures == 1 and gate.failure == "connect_refused"
        assert gate.seconds_until_retry() == pytest.approx(0.5)
        start = trio.current_time()
        script = ["fail", "fail", "fail", "fail", "ok"]
        probes: list[tuple[float, str]] = []
        through: list[tuple[float, str]] = []

        async def operation(name: str) -> None:
            while True:
                ticket = await gate.admit()
                now = trio.current_time() - start
                if gate.available:
                    through.append((now, name))
                    return
                probes.append((now, name))
                await trio.sleep(0.01)  # the connect attempt itself takes a moment
                if script.pop(0) == "ok":
                    gate.succeeded(ticket)
                    through.append((now, name))
                    return
                gate.failed(ticket, "connect_refused")

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(operation, f"op{i}")
        # Three operations, yet one probe per round, at bounded exponential delays
        # (0.5, 1, 2, 4, 4 after each failed round; each probe takes 0.01).
        assert [t for t, _ in probes] == pytest.approx([0.5, 1.51, 3.52, 7.53, 11.54])
        assert len(through) == 3 and all(t >= 11.54 for t, _ in through)
        assert gate.available and gate.failures == 0 and gate.retry_at is None

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_gate_without_a_result_lets_another_probe() -> None:
    async def main() -> None:
        gate = EndpointGate("e", ConnectBackoff(initial=1.0, maximum=1.0))
        gate.failed(await gate.admit(), "dns_failure")
        order: list[str] = []
        probe_scope = trio.CancelScope()

        async def probe() -> None:
            with probe_scope:
                ticket = await gate.admit()
                order.append("probe")
                try:
                    await trio.sleep_forever()
                finally:
                    gate.abandon(ticket)  # cancelled before any result

        async def waiter() -> None:
            ticket = await gate.admit()
            order.append("waiter")
            gate.succeeded(ticket)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe)
            await trio.sleep(1.2)  # past retry_at: "probe" holds the only probe
            nursery.start_soon(waiter)
            await trio.sleep(0.5)
            assert order == ["probe"]  # the waiter waits for the probe's result
            probe_scope.cancel()
        assert order == ["probe", "waiter"]
        assert gate.available

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# --- issue 29.5: the bound of the wait (unreachable_after) -------------------------------


def test_unreachable_after_is_seconds_at_least_zero_or_inf() -> None:
    assert check_unreachable_after(0) == 0.0
    assert check_unreachable_after(300) == 300.0
    assert check_unreachable_after(float("inf")) == float("inf")
    for bad in (-1, -0.5, float("nan"), "300", None, True):
        with pytest.raises(InvalidRequest):
            check_unreachable_after(bad)


def _prober(
    gate: EndpointGate, start: float, probes: list[float], ended: dict[str, float],
    *, takes: float = 0.01, succeeds_at: float | None = None,
) -> Callable[[str], Awaitable[None]]:
    """An operation's connect loop over ``gate`` (its first try first=True, like the
    actor's): every probe fails after 0.01 s, but one that starts at ``succeeds_at`` or
    later succeeds after ``takes`` s."""

    async def operation(name: str) -> None:
        first = True
        while True:
            try:
                ticket = await gate.admit(first=first)
            except EndpointUnavailable as exc:
                assert exc.kind == "connect_refused"
                assert exc.unreachable_after == gate.unreachable_after
                ended[name] = trio.current_time() - start
                return
            first = False
            now = trio.current_time() - start
            if gate.available:
                ended[name] = -now  # through: negative marks "connected"
                return
            probes.append(now)
            late = succeeds_at is not None and now >= succeeds_at
            await trio.sleep(takes if late else 0.01)
            if late:
                gate.succeeded(ticket)
                ended[name] = -now
                return
            gate.failed(ticket, "connect_refused")

    return operation


def test_every_waiter_gives_up_at_the_bound_and_a_later_call_gets_one_probe() -> None:
    async def main() -> None:
        gate = EndpointGate("e", ConnectBackoff(initial=1.0, maximum=4.0), unreachable_after=10)
        start = trio.current_time()
        gate.failed(await gate.admit(), "connect_refused")  # t=0: the outage starts
        assert gate.down_since == start and gate.give_up_at() == start + 10.0
        probes: list[float] = []
        ended: dict[str, float] = {}
        operation = _prober(gate, start, probes, ended)
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(operation, f"op{i}")
        # One probe per round (1, then 2 and 4 s after each failure); the next one would
        # be due at 11.03, past the bound: all three give up at 10 s, none before.
        assert probes == pytest.approx([1.0, 3.01, 7.02])
        assert ended == {f"op{i}": pytest.approx(10.0) for i in range(3)}
        # Two calls after the bound share ONE probe (first try: owed an answer), then end.
        await trio.sleep(0.5)
        probes.clear()
        ended.clear()
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(operation, f"late{i}")
        assert probes == pytest.approx([10.5])
        assert ended == {"late0": pytest.approx(10.51), "late1": pytest.approx(10.51)}
        assert gate.down_since == start  # still the same outage: its clock keeps running
        # The endpoint is back: the next call's probe succeeds and the bound is reset.
        probes.clear()
        ended.clear()
        back = _prober(gate, start, probes, ended, succeeds_at=0.0)
        await back("again")
        assert gate.available and gate.down_since is None
        assert gate.give_up_at() == float("inf")

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_probe_in_flight_at_the_bound_is_waited_for() -> None:
    """At the bound a probe is still connecting: the waiters take its result (here a
    success: nobody gives up); with unreachable_after=inf nobody ever gives up."""

    async def main() -> None:
        gate = EndpointGate("e", ConnectBackoff(initial=1.0, maximum=4.0), unreachable_after=5)
        start = trio.current_time()
        gate.failed(await gate.admit(), "connect_refused")
        probes: list[float] = []
        ended: dict[str, float] = {}
        # The probe at 1 fails; the one at 3.01 is still connecting at the bound (5) and
        # succeeds at 7.01: the waiters take that result, nobody gives up.
        operation = _prober(gate, start, probes, ended, takes=4.0, succeeds_at=3.0)
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(operation, f"op{i}")
        assert probes == pytest.approx([1.0, 3.01])
        assert sorted(-t for t in ended.values()) == pytest.approx([3.01, 7.01, 7.01])
        assert gate.available and gate.down_since is None

        forever = EndpointGate("f", ConnectBackoff(initial=1.0, maximum=30.0))
        assert forever.unreachable_after == float("inf")
        forever.failed(await forever.admit(), "dns_failure")
        probes.clear()
        with trio.move_on_after(100_000):
            await _prober(forever, trio.current_time(), probes, ended)("waits")
        assert len(probes) > 3000  # still probing every 30 s, never given up

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_a_websocket_handshake_answered_with_a_status_is_an_established_connection() -> None:
    """The server answered (429 on the upgrade): the attempt is spent like any 429."""

    async def reject(stream: trio.SocketStream) -> None:
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(4096)
            body = b'{"error":{"type":"requests","code":"rate_limit_exceeded","message":"x"}}'
            await stream.send_all(
                b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
                b"retry-after: 3\r\ncontent-length: %d\r\n\r\n" % len(body) + body
            )
        except trio.BrokenResourceError:
            pass
        finally:
            await stream.aclose()

    called: list[bool] = []

    async def before_send() -> None:
        called.append(True)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, reject, 0)
        port = listeners[0].socket.getsockname()[1]
        b = backend(f"http://127.0.0.1:{port}/v1", "websocket")
        outcome = await b.stream(BODY, attempt_id="a", token="sk-test", before_send=before_send)
        await b.aclose()
        nursery.cancel_scope.cancel()
    assert called == [True]
    assert isinstance(outcome, Interruption)
    assert (outcome.kind, outcome.http_status, outcome.retry_after) == ("http_rejected", 429, 3.0)
