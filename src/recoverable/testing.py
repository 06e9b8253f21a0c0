"""Test helpers for hosts and for this library's own tests.

``FixtureProvider`` is a real loopback Responses provider (HTTP SSE and
WebSocket on one port) answering scripted ``Reply`` values, recording every
generation request as a ``RecordedRequest``::

    async with FixtureProvider.serve() as provider:
        provider.script([Reply.disconnect(after_events=3), Reply.complete({"answer": 42})])
        backend = ResponsesBackend(provider.http_url, credentials=StaticCredentials("k"))
"""

from __future__ import annotations

from recoverable.fixture.background import StoredResponse
from recoverable.fixture.provider import (
    FaultSpec,
    FixtureProvider,
    RecordedRequest,
    RecordedRetrieval,
    Reply,
    ResumeFault,
    fixture_main,
)
from recoverable.fixture.replies import synthesize_value

__all__ = [
    "FaultSpec",
    "FixtureProvider",
    "RecordedRequest",
    "RecordedRetrieval",
    "Reply",
    "ResumeFault",
    "StoredResponse",
    "fixture_main",
    "synthesize_value",
]
