"""The transport table: every mode ``ResponsesBackend`` can stream over, and its class.

This is the one list of modes. ``ResponsesBackend`` makes its transport from it, the
CLI offers its keys as ``--mode`` choices, and the mode check reads it. Adding a
transport is one module whose class implements ``transport.base.Transport`` plus one
row here (and its name in ``Mode``: the static type mypy needs; a test checks that the
two agree). See docs/architecture.md, "Adding a transport".
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, Literal

from recoverable.transport.base import TransportFactory
from recoverable.transport.sse import SseTransport
from recoverable.transport.websocket import WebSocketTransport

__all__ = ["DEFAULT_MODE", "MODES", "TRANSPORTS", "Mode", "mode_problem"]

Mode = Literal["websocket", "sse"]

#: mode -> transport class, in the order the CLI shows them (the first is the default).
TRANSPORTS: Final[Mapping[Mode, TransportFactory]] = MappingProxyType({
    "websocket": WebSocketTransport,
    "sse": SseTransport,
})

MODES: Final[tuple[Mode, ...]] = tuple(TRANSPORTS)
DEFAULT_MODE: Final[Mode] = MODES[0]


def mode_problem(mode: object) -> str | None:
    """Why ``mode`` is not a transport mode (the message of the caller's typed error),
    or ``None`` when it is one."""
    if isinstance(mode, str) and mode in TRANSPORTS:
        return None
    names = " or ".join(repr(name) for name in MODES)
    return f"mode must be {names}, got {mode!r}"
