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


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # One suite, two stores (issue 17): a module listing STORE_KINDS = ("lmdb",
    # "postgresql") runs each test using ``store`` on both; the others on LMDB only.
    if "store_kind" in metafunc.fixturenames:
        metafunc.parametrize("store_kind", getattr(metafunc.module, "STORE_KINDS", ("lmdb",)))


@pytest.fixture
def store_location(store_kind: str, store_path: str, request: pytest.FixtureRequest) -> str:
    """Where ``store`` lives: the LMDB directory, or a fresh PostgreSQL database's URL."""
    if store_kind == "postgresql":
        url: str = request.getfixturevalue("pg_url")
        return url
    return store_path


@pytest.fixture
def store(store_location: str) -> Iterator[RecoveryStore]:
    with RecoveryStore.open(store_location) as opened:
        yield opened
    assert opened.closed
