from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from recoverable.testing import FixtureProvider


@pytest.fixture
async def provider() -> AsyncIterator[FixtureProvider]:
    async with FixtureProvider.serve() as p:
        yield p
