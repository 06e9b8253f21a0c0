"""Fixtures of the one-call client's tests: a fixture provider served on 127.0.0.1 by the
test's own Trio loop, a store path on disk, and the API key in the environment."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from recoverable.testing import FixtureProvider

KEY_ENV = "RECOVERABLE_TEST_CLIENT_KEY"
ACCOUNT = "acct-1"


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


@pytest.fixture
async def provider() -> AsyncIterator[FixtureProvider]:
    async with FixtureProvider.serve() as served:
        yield served


@pytest.fixture
def path(store_location: str) -> str:
    """The client's store: a directory on disk, or (modules marked ``both_stores``) also a
    fresh PostgreSQL database's URL (tests/pg/fixtures.py)."""
    return store_location


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(KEY_ENV, "sk-test-client-secret")
    return "sk-test-client-secret"


def options(provider: FixtureProvider, **extra: Any) -> dict[str, Any]:
    """``open_client``'s arguments for the served provider (SSE: one POST per attempt)."""
    return {"endpoint": provider.http_url, "api_key_env": KEY_ENV, "account": ACCOUNT,
            "mode": "sse", **extra}


def posts(provider: FixtureProvider) -> int:
    """Generation POSTs the provider received."""
    return len(provider.requests)


def job_posts(provider: FixtureProvider, operation_id: str) -> int:
    return sum(1 for request in provider.requests
               if (request.attempt_id or "").startswith(operation_id + "."))

