"""Host authorizers loaded by ``recoverable worker --authorizer`` in the worker tests."""

from __future__ import annotations

import os
from pathlib import Path

import recoverable


def decline(attempt: recoverable.Attempt) -> bool:
    """Declines every attempt; leaves a marker file (the test's barrier) when asked."""
    Path(os.environ["WORKER_TEST_MARKER"]).write_text(attempt.attempt_id)
    return False
