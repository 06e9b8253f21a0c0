"""The SSE transport closes the stream it reads (issue 19.9): its ``aiter_raw()`` async
generator is never left for the garbage collector (Trio reports that as a
``ResourceWarning``). httpx's and httpcore's own inner generators still do when a stream
is left before its end (upstream: encode/httpx#3686); those are not ours to close."""

from __future__ import annotations

import gc
import warnings

import pytest
from transport_helpers import make_body

import recoverable
from recoverable.testing import FixtureProvider, Reply

ACCOUNT = recoverable.AccountBinding("acct-1", "api-key")


@pytest.mark.parametrize(
    "reply",
    [
        Reply.complete({"answer": 1, "label": "yes", "note": None, "items": []}),
        # An error body larger than the bound: the reader stops early (``break``).
        Reply.http_error(500, {"error": {"message": "x" * (200 * 1024)}}),
    ],
    ids=["completed", "rejected_large_body"],
)
async def test_sse_stream_leaves_no_unclosed_async_generator(reply: Reply) -> None:
    async with FixtureProvider.serve() as provider:
        provider.script([reply])
        backend = recoverable.ResponsesBackend(
            provider.http_url,
            credentials=recoverable.StaticCredentials("sk-test", account=ACCOUNT),
            mode="sse",
        )
        gc.collect()  # what earlier tests in this process left is not this test's to count
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            async with backend:
                outcome = await backend.stream(make_body(), attempt_id="op_x.1", token="sk-test")
            gc.collect()
    assert outcome is not None
    everything = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    if isinstance(outcome, recoverable.Completed):
        # A completed stream is read to its end: nothing at all is left to the collector.
        assert everything == []
    leaks = [
        str(w.message)
        for w in caught
        if issubclass(w.category, ResourceWarning) and "aiter_raw" in str(w.message)
    ]
    assert leaks == []
