"""What an attempt leaves behind is freed by reference counting, not the collector.

A rejected WebSocket handshake leaves no reference cycle behind.

Each 429 on the opening handshake (a rate limit) raised trio-websocket's
``ConnectionRejected`` from inside the handler of the reader's exception group, so the
rejection got the group that holds it as its ``__context__``: a cycle that kept every
frame, task and nursery of the failed handshake (about 165 objects per rejection) for the
full collector. With thousands of operations parked after a 429, those passes stalled
the event loop for hundreds of milliseconds (``bench/scheduler_lateness.py``). Freed by
reference counting now: with the collector off, a collection finds none of them.

An SSE attempt's streamed ``httpx.Response`` and the ``BoundAsyncStream`` it reads point at
each other (httpx's design); once closed, the transport cuts the response from its stream,
so the request, the pool's request and the connection's stream go with the response.
"""

from __future__ import annotations

import pytest
from transport_helpers import make_body

from recoverable.outcome import Completed, Interruption
from recoverable.testing import FixtureProvider, Reply
from recoverable.transport.backend import ResponsesBackend
from recoverable.transport.base import StaticCredentials
from tests.collector import unreachable

REJECTIONS = 20


async def test_a_rejected_handshake_is_freed_without_the_collector(
    provider: FixtureProvider, collector_off: None
) -> None:
    provider.script([Reply.rate_limited(1.0)] * REJECTIONS)
    async with ResponsesBackend(
        provider.http_url, credentials=StaticCredentials("sk-test"), mode="websocket"
    ) as backend:
        for i in range(REJECTIONS):
            outcome = await backend.stream(make_body(), attempt_id=f"op_r.{i}", token="sk-test")
            assert isinstance(outcome, Interruption) and outcome.http_status == 429
        assert unreachable("ConnectionRejected") == 0
        assert unreachable("WebSocketConnection") == 0


@pytest.mark.parametrize("reply", ["complete", "rejected"])
async def test_a_closed_sse_response_is_freed_without_the_collector(
    provider: FixtureProvider, collector_off: None, reply: str
) -> None:
    if reply == "rejected":
        provider.script([Reply.rate_limited(1.0)] * REJECTIONS)
    async with ResponsesBackend(
        provider.http_url, credentials=StaticCredentials("sk-test"), mode="sse"
    ) as backend:
        for i in range(REJECTIONS):
            outcome = await backend.stream(make_body(), attempt_id=f"op_s.{i}", token="sk-test")
            assert isinstance(outcome, Interruption if reply == "rejected" else Completed)
        assert unreachable("Response") == 0
        assert unreachable("BoundAsyncStream") == 0
