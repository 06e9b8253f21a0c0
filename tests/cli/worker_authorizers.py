"""Host authorizers loaded by ``recoverable worker --authorizer`` in the worker tests."""

from __future__ import annotations

import os
from pathlib import Path

import recoverable


def decline(attempt: recoverable.Attempt) -> bool:
    """Declines every attempt; leaves a marker file (the test's barrier) when asked."""
    Path(os.environ["WORKER_TEST_MARKER"]).write_text(attempt.attempt_id)
    return False


def raising(attempt: recoverable.Attempt) -> bool:
    """A policy that breaks (its database is down, a bug): it raises."""
    raise RuntimeError("the policy's database is unreachable")


async def says_yes(attempt: recoverable.Attempt) -> bool:
    """A policy that answers a truthy string instead of True: never an authorization."""
    return "yes"  # type: ignore[return-value]
