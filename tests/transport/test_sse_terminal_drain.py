"""An SSE stream that ends with a terminal event other than a completion (``response.failed``,
``response.incomplete``, an ``error`` event, a refusal) is read to its end like a completed
one: nothing is left to the garbage collector (httpx's and httpcore's inner async
generators otherwise are, which Trio reports as a ``ResourceWarning``, see
encode/httpx#3686) and the connection is kept for the next request.

Found by running ``tests/transport/test_transport_matrix.py`` under
``-W error::ResourceWarning``: the WebSocket cases were clean, these SSE cases were not.
"""

from __future__ import annotations

import gc
import warnings

import pytest
from transport_helpers import make_body

import recoverable
from recoverable import Interruption
from recoverable.testing import FixtureProvider, Reply

ACCOUNT = recoverable.AccountBinding("acct-1", "api-key")


@pytest.mark.parametrize(
    ("reply", "kind"),
    [
        (Reply.failed("server_error"), "provider_failed"),
        (Reply.incomplete("max_output_tokens"), "incomplete"),
        (Reply.refusal(), "refusal"),
        (Reply.error_event(error_type="server_error", code="server_error"), "provider_failed"),
        (Reply.error_event(error_type="rate_limit_error", code="rate_limit_exceeded",
                           status=429), "http_rejected"),
    ],
    ids=["failed", "incomplete", "refusal", "error_event", "error_event_with_status"],
)
async def test_a_terminal_failure_is_read_to_its_end(reply: Reply, kind: str) -> None:
    async with FixtureProvider.serve() as provider:
        provider.script([reply, Reply.complete({"ok": True})])
        backend = recoverable.ResponsesBackend(
            provider.http_url,
            credentials=recoverable.StaticCredentials("sk-test", account=ACCOUNT),
            mode="sse",
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            async with backend:
                first = await backend.stream(make_body(), attempt_id="op_x.1", token="sk-test")
                gc.collect()  # an unfinished generator would be finalized (and reported) here
                second = await backend.stream(make_body(), attempt_id="op_x.2", token="sk-test")
            gc.collect()
    assert isinstance(first, Interruption) and first.kind == kind, first
    assert isinstance(second, recoverable.Completed), second
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert leaks == []
    # The body ended normally, so the connection went back to the pool and was reused.
    first_request, second_request = provider.requests
    assert second_request.connection == first_request.connection
