from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # storage_helpers, also for child processes

from recoverable.storage import RecoveryStore


@pytest.fixture
def store_path(tmp_path: Path) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def store(store_location: str) -> Iterator[RecoveryStore]:
    with RecoveryStore.open(store_location) as opened:
        yield opened
    assert opened.closed
