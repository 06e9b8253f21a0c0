"""recoverable: durable, crash-safe, tool-free structured LLM requests for Trio."""

from __future__ import annotations

from recoverable.types import (
    AccountBinding,
    Attempt,
    AttemptSummary,
    CleanupResult,
    Handle,
    Inventory,
    JsonSchema,
    Receipt,
    RetryPolicy,
    Status,
    StructuredRequest,
)
from recoverable.errors import *  # noqa: F403
from recoverable.errors import __all__ as _errors_all

__all__ = [
    "AccountBinding",
    "Attempt",
    "AttemptSummary",
    "CleanupResult",
    "Handle",
    "Inventory",
    "JsonSchema",
    "Receipt",
    "RetryPolicy",
    "Status",
    "StructuredRequest",
    *_errors_all,
]
