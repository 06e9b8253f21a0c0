"""recoverable: durable, crash-safe, tool-free structured LLM requests for Trio.

One call (docs/client.md)::

    async with recoverable.open_client(".recovery", endpoint=url, account="acct-1") as client:
        answer = await client.parse(model=..., input=..., text_format=Answer, job_id="job-42")

Quick tour of the full handoff (see docs/ and the README)::

    store = recoverable.RecoveryStore.open(path)
    backend = recoverable.ResponsesBackend(url, credentials=recoverable.StaticCredentials(key))
    async with recoverable.open_runtime(store, backend, account=account) as runtime:
        handle = await runtime.prepare(request, response=Output, maximum_attempts=3)
        ...persist the handle in the host's own transaction...
        value = await runtime.send_recovering(handle, response=Output, authorize=authorize)
        ...commit value keyed by (job, revision)...
        await runtime.acknowledge(handle)
"""

from __future__ import annotations

from recoverable.actors.continuation import (
    ContinuationPreference,
    continuation_preference,
    set_continuation_preference,
)
from recoverable.actors.runtime import Backend, Runtime, open_runtime
from recoverable.blocking import AsyncioRuntime, BlockingRuntime
from recoverable.client import Client, MapResult, open_client
from recoverable.client_hosts import AsyncioClient, BlockingClient
from recoverable.errors import *  # noqa: F403
from recoverable.errors import __all__ as _errors_all
from recoverable.outcome import Completed, Interruption, Usage
from recoverable.partial import PartialView
from recoverable.storage.store import RecoveryStore
from recoverable.telemetry import LoggingSink, TelemetryEvent, TelemetrySink
from recoverable.transport.backend import ResponsesBackend
from recoverable.transport.base import Credentials, StaticCredentials, StreamLimits
from recoverable.transport.connect import ConnectBackoff
from recoverable.types import (
    AccountBinding,
    Attempt,
    AttemptSummary,
    CleanupResult,
    ContinuationStatus,
    Handle,
    Inventory,
    JsonSchema,
    Receipt,
    RetryPolicy,
    SourceRef,
    Status,
    StructuredRequest,
)

__all__ = [
    "AccountBinding",
    "AsyncioClient",
    "AsyncioRuntime",
    "Attempt",
    "AttemptSummary",
    "Backend",
    "BlockingClient",
    "BlockingRuntime",
    "CleanupResult",
    "Client",
    "Completed",
    "ConnectBackoff",
    "ContinuationPreference",
    "ContinuationStatus",
    "Credentials",
    "Handle",
    "Interruption",
    "Inventory",
    "JsonSchema",
    "LoggingSink",
    "MapResult",
    "PartialView",
    "Receipt",
    "RecoveryStore",
    "ResponsesBackend",
    "RetryPolicy",
    "Runtime",
    "SourceRef",
    "StaticCredentials",
    "Status",
    "StreamLimits",
    "StructuredRequest",
    "TelemetryEvent",
    "TelemetrySink",
    "Usage",
    "continuation_preference",
    "open_client",
    "open_runtime",
    "set_continuation_preference",
    *_errors_all,
]
