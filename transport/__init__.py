"""Responses transports (WebSocket and HTTP SSE), the event parser, and the fixture provider.

The transport knows frames, headers and how a stream ended; it knows nothing of
budgets or policy. The values a stream ends with (``Completed``, ``Interruption``,
``Usage``) live in the core (``recoverable.outcome``); they are re-exported here.
"""

from __future__ import annotations

from recoverable.outcome import (
    QUOTA_CODES,
    Completed,
    Interruption,
    Outcome,
    Progress,
    Usage,
)
from recoverable.transport.backend import ResponsesBackend
from recoverable.transport.base import (
    Credentials,
    StaticCredentials,
    StreamLimits,
    normalize_base_url,
    parse_retry_after,
)

__all__ = [
    "QUOTA_CODES",
    "Completed",
    "Credentials",
    "Interruption",
    "Outcome",
    "Progress",
    "ResponsesBackend",
    "StaticCredentials",
    "StreamLimits",
    "Usage",
    "normalize_base_url",
    "parse_retry_after",
]
