"""Responses transports (WebSocket and HTTP SSE), the event parser, and the fixture provider.

The transport knows frames, headers and how a stream ended; it knows nothing of
budgets or policy. Names other than the outcome types load lazily, because
``recoverable.types`` imports ``recoverable.transport.outcome`` while the
backend needs ``recoverable.types``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from recoverable.transport.outcome import (
    QUOTA_CODES,
    Completed,
    Interruption,
    Outcome,
    Progress,
    Usage,
)

if TYPE_CHECKING:
    from recoverable.transport.backend import ResponsesBackend
    from recoverable.transport.base import (
        Credentials,
        StaticCredentials,
        StreamLimits,
        normalize_base_url,
        parse_retry_after,
    )

_LAZY = {
    "ResponsesBackend": "recoverable.transport.backend",
    "Credentials": "recoverable.transport.base",
    "StaticCredentials": "recoverable.transport.base",
    "StreamLimits": "recoverable.transport.base",
    "normalize_base_url": "recoverable.transport.base",
    "parse_retry_after": "recoverable.transport.base",
}

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'recoverable.transport' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
