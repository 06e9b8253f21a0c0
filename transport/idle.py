"""The idle timer of one stream: a Trio cancel scope pushed forward by activity, lazily.

Setting a cancel scope's deadline re-registers it with Trio's deadline heap; a stream
that did so for every chunk and every message paid that per event on the shared path.
``IdleTimer.touch`` moves the deadline only when it is outside
``[now + timeout, now + timeout + slack]``: the timer never fires earlier than ``timeout``
after the last activity and at most ``slack`` later (``timeout / 16``, at most 1 s), and the
deadline moves at most once per ``slack`` of activity.
"""

from __future__ import annotations

import trio

__all__ = ["IdleTimer"]

_MAX_SLACK = 1.0


class IdleTimer:
    """``scope`` is cancelled once no ``touch`` came for ``timeout`` (+ at most ``slack``)."""

    __slots__ = ("scope", "slack", "timeout")

    def __init__(self, scope: trio.CancelScope, timeout: float) -> None:
        self.scope = scope
        self.timeout = timeout
        self.slack = min(timeout / 16.0, _MAX_SLACK)

    def touch(self) -> None:
        """Activity now: the scope's deadline is at least ``timeout`` away afterwards."""
        now = trio.current_time()
        deadline = self.scope.deadline
        if not now + self.timeout <= deadline <= now + self.timeout + self.slack:
            self.scope.deadline = now + self.timeout + self.slack
