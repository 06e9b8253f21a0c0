"""An execution and its attempts are freed by reference counting, not the collector.

An ``Execution`` points at its attempt in flight (``sending``, for a lease lost mid
stream) and the attempt at its execution (its transport callbacks): a cycle that kept
both, with the attempt's transition, lease, watch and cancel scopes, for the full
collector (about 20 objects per operation), whose passes stall the event loop once
thousands of operations are parked. The ended attempt is dropped when the operation
parks (nothing is in flight while it waits) and when the execution ends.
"""

from __future__ import annotations

import gc

import trio

import recoverable
from recoverable.testing import FixtureProvider, Reply

from ..collector import unreachable
from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, make_backend


async def test_a_parked_then_completed_execution_needs_no_collector(
    provider: FixtureProvider, store: recoverable.RecoveryStore, collector_off: None
) -> None:
    provider.script(
        [Reply.rate_limited(retry_after=0.05), Reply.complete({"answer": 1, "note": "n"})]
    )
    parked: list[int] = []

    def sink(event: recoverable.TelemetryEvent) -> None:
        if event.name == "recovery.operation.waiting":
            # While it waits, its rejected attempt is already gone (not even reachable).
            parked.append(sum(1 for obj in gc.get_objects() if type(obj).__name__ == "_Attempt"))

    async with recoverable.open_runtime(
        store, make_backend(provider), account=ACCOUNT, telemetry=sink
    ) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
        with trio.fail_after(30):
            value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        assert value == Answer(answer=1, note="n")
    assert len(provider.requests) == 2 and parked == [0]
    assert unreachable("Execution", "_Attempt") == 0
