"""Connecting before an attempt is spent: typed connect failures and the endpoint gate.

A generation attempt is consumed only once a connection to the endpoint is
established (TCP, TLS if any, and the WebSocket handshake in WebSocket mode;
an open connection from the httpx pool for SSE). A connection that was never
established sent nothing, so it spends no budget: the transport reports it as
an :class:`~recoverable.outcome.Interruption` whose ``transport_code``
is one of :data:`CONNECT_CODES`, *without* having called the caller's
``before_send`` hook.

:class:`EndpointGate` is the shared, bounded backoff of one endpoint in one
runtime: when connecting fails, every operation of the runtime waits on the
same gate (exponential, capped) and a single probe at a time tries again. The wait is
bounded: once the endpoint has been unreachable for ``unreachable_after`` seconds (from
the first failed connect with no success since), every operation waiting on the gate
ends with :class:`~recoverable.errors.EndpointUnavailable`.
"""

from __future__ import annotations

import math
import socket
import ssl
from collections.abc import Callable
from typing import Final, Literal

import attrs
import trio

from recoverable.errors import EndpointUnavailable, InvalidRequest

__all__ = [
    "CONNECT_CODES",
    "UNREACHABLE_AFTER",
    "ConnectBackoff",
    "ConnectKind",
    "EndpointGate",
    "check_unreachable_after",
    "classify_connect_error",
]

UNREACHABLE_AFTER: Final = 300.0  # seconds: the default bound of the wait for an endpoint


def check_unreachable_after(value: object) -> float:
    """``unreachable_after`` as a float: a number of seconds, at least 0 (``inf``: wait
    for the endpoint without end); anything else is ``InvalidRequest``."""
    if (
        isinstance(value, bool) or not isinstance(value, int | float)
        or math.isnan(value) or value < 0
    ):
        raise InvalidRequest(
            "unreachable_after must be a number of seconds >= 0 (math.inf: no bound)"
        )
    return float(value)

ConnectKind = Literal[
    "connect_refused",  # nothing listens on the port (ECONNREFUSED)
    "dns_failure",  # the host name did not resolve
    "tls_failure",  # TCP connected but the TLS handshake failed (certificate, protocol)
    "connect_timeout",  # no connection within StreamLimits.connect_timeout
    "handshake_failed",  # the peer broke the WebSocket opening handshake (not an HTTP status)
    "connect_failed",  # any other failure to establish the connection (unreachable, reset)
]

CONNECT_CODES: Final[frozenset[str]] = frozenset(
    {
        "connect_refused",
        "dns_failure",
        "tls_failure",
        "connect_timeout",
        "handshake_failed",
        "connect_failed",
    }
)


def _walk(exc: BaseException) -> list[BaseException]:
    """``exc``, its causes/contexts and the members of any exception group, once each."""
    seen: set[int] = set()
    out: list[BaseException] = []
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        out.append(current)
        if isinstance(current, BaseExceptionGroup):
            todo.extend(current.exceptions)
        for nxt in (current.__cause__, current.__context__):
            if nxt is not None:
                todo.append(nxt)
    return out


def classify_connect_error(exc: BaseException, *, default: ConnectKind = "connect_failed") -> (
    ConnectKind
):
    """The typed kind of a failure to connect, from the exception chain (never a message).

    DNS before TLS before refused before timeout: a name that does not resolve
    is reported as such even when a timeout ended the wait.
    """
    chain = _walk(exc)
    if any(isinstance(error, socket.gaierror) for error in chain):
        return "dns_failure"
    if any(isinstance(error, ssl.SSLError | ssl.CertificateError) for error in chain):
        return "tls_failure"
    if any(isinstance(error, ConnectionRefusedError) for error in chain):
        return "connect_refused"
    if any(isinstance(error, TimeoutError | trio.TooSlowError) for error in chain):
        return "connect_timeout"
    return default


@attrs.frozen
class ConnectBackoff:
    """The shared backoff while an endpoint cannot be connected to:
    ``min(maximum, initial * multiplier**(failures-1))`` seconds between probes."""

    initial: float = 0.5
    maximum: float = 30.0
    multiplier: float = 2.0

    def __attrs_post_init__(self) -> None:
        for name in ("initial", "maximum"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise InvalidRequest(f"ConnectBackoff.{name} must be a positive number")
        if not math.isfinite(self.multiplier) or self.multiplier < 1:
            raise InvalidRequest("ConnectBackoff.multiplier must be finite and >= 1")
        if self.maximum < self.initial:
            raise InvalidRequest("ConnectBackoff.maximum must be >= initial")

    def delay(self, failures: int) -> float:
        try:
            value = self.initial * self.multiplier ** max(0, failures - 1)
        except OverflowError:
            return self.maximum
        return min(self.maximum, value)


class EndpointGate:
    """Whether one endpoint is reachable, shared by every operation of a runtime.

    While the endpoint is available, :meth:`admit` returns at once and any
    number of operations connect concurrently. After a failure to connect, the
    gate closes until ``retry_at``; then exactly one waiting operation (the
    probe) is admitted, and the others wait for its result. A success opens the
    gate for everyone; a failure doubles the delay (bounded by
    ``ConnectBackoff.maximum``). Failures of connections started before the
    last change are counted once, so a burst of simultaneous failures does not
    jump straight to the maximum.

    The bound: ``down_since`` is when the first connect of the current outage failed (no
    success since). Once ``unreachable_after`` seconds have passed since then, a waiting
    task gives up (:meth:`admit` raises ``EndpointUnavailable``) unless a probe is in
    flight (it waits for that result) or due (it probes). A caller's first try is owed one
    answer from the endpoint: past the bound it probes at once (or takes the result of
    the probe in flight) before it gives up, so a host that calls again after fixing the
    endpoint is never refused without a try, and the callers that arrive together share
    one probe. So every operation waiting on the gate ends at the bound (after one last
    probe when none answered it while it waited), and a later one after one probe.

    Times are Trio's clock (``trio.current_time``), so ``MockClock`` drives it.
    """

    def __init__(
        self,
        endpoint_id: str,
        backoff: ConnectBackoff = ConnectBackoff(),
        unreachable_after: float = math.inf,
    ) -> None:
        self.endpoint_id = endpoint_id
        self.backoff = backoff
        self.unreachable_after = check_unreachable_after(unreachable_after)
        self.failure: ConnectKind | None = None  # None: available
        self.failures = 0  # consecutive failed rounds
        self.retry_at: float | None = None  # trio time of the next probe
        self.down_since: float | None = None  # trio time of the outage's first failure
        self._epoch = 0  # bumped on every change of state
        self._probing = False
        self._changed = trio.Event()
        self.listeners: list[Callable[[EndpointGate], None]] = []

    @property
    def available(self) -> bool:
        return self.failure is None

    def _notify(self) -> None:
        self._epoch += 1
        self._changed.set()
        self._changed = trio.Event()
        for listener in list(self.listeners):
            listener(self)

    async def admit(self, *, first: bool = False) -> int:
        """Wait until this task may try to connect; return the ticket for :meth:`report`.

        Raises ``EndpointUnavailable`` (no operation id: the caller's to add) once the
        endpoint has been unreachable for ``unreachable_after`` seconds (see the class).
        ``first``: the caller's first try (a new execution), which past the bound still
        gets one answer from the endpoint before it gives up: it probes at once, or takes
        the result of the probe in flight (its later tries, ``first=False``, do not).
        Cancellable at any point (a caller that is cancelled while probing must
        call :meth:`abandon` with its ticket, which :meth:`report` callers do in
        a ``finally``).
        """
        entered = self._epoch
        while True:
            if self.failure is None:
                return self._epoch
            changed = self._changed
            if not self._probing:
                assert self.retry_at is not None
                now = trio.current_time()
                deadline = self.give_up_at()
                # No probe result reached a first try since it came: it is owed one.
                owed = first and self._epoch == entered
                if now >= self.retry_at or (owed and now >= deadline):
                    self._probing = True
                    return self._epoch
                if now >= deadline:
                    raise EndpointUnavailable(
                        kind=self.failure, unreachable_after=self.unreachable_after
                    )
                with trio.move_on_at(min(self.retry_at, deadline)):
                    await changed.wait()
            else:
                await changed.wait()

    def give_up_at(self) -> float:
        """When a task waiting on the closed gate gives up (``inf``: never)."""
        if self.down_since is None:
            return math.inf
        return self.down_since + self.unreachable_after

    def succeeded(self, ticket: int) -> None:
        """A connection was established."""
        del ticket
        was_closed = self.failure is not None
        self._probing = False
        if was_closed or self.failures:
            self.failure = None
            self.failures = 0
            self.retry_at = None
            self.down_since = None
            self._notify()

    def failed(self, ticket: int, kind: ConnectKind) -> None:
        """Connecting failed; counted once per round (``ticket`` from :meth:`admit`)."""
        if ticket != self._epoch:
            return  # another connection of the same round already reported it
        self._probing = False
        if self.failure is None:
            self.down_since = trio.current_time()  # the outage starts: its bound runs
        self.failures += 1
        self.failure = kind
        self.retry_at = trio.current_time() + self.backoff.delay(self.failures)
        self._notify()

    def abandon(self, ticket: int) -> None:
        """The admitted task gave up without a result (cancelled): let another probe."""
        if ticket == self._epoch and self._probing:
            self._probing = False
            self._changed.set()
            self._changed = trio.Event()

    def seconds_until_retry(self) -> float | None:
        if self.retry_at is None:
            return None
        return max(0.0, self.retry_at - trio.current_time())
