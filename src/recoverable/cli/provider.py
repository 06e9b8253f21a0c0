"""The provider a batch talks to: the embedded fixture (the default) or a base URL."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import Final

from recoverable.cli.config import BatchConfig
from recoverable.fixture.provider import FixtureProvider
from recoverable.transport.backend import ResponsesBackend
from recoverable.transport.base import StaticCredentials, StreamLimits
from recoverable.types import AccountBinding

__all__ = ["FIXTURE_ACCOUNT", "FIXTURE_NOTICE", "batch_account", "open_backend"]

FIXTURE_ACCOUNT: Final = AccountBinding("batch", "api-key")
FIXTURE_NOTICE: Final = (
    "provider: embedded fixture: answers are synthesized test data, not a model's "
    "(use --endpoint URL for a real provider)"
)
FIXTURE_KEY: Final = "sk-fixture-batch"  # the embedded provider accepts any key


def batch_account(config: BatchConfig) -> AccountBinding:
    if config.account is not None:
        return AccountBinding(config.account, "api-key")
    return FIXTURE_ACCOUNT if config.endpoint == "fixture" else AccountBinding("default")


@contextlib.asynccontextmanager
async def open_backend(
    config: BatchConfig, account: AccountBinding
) -> AsyncIterator[ResponsesBackend]:
    """The batch's backend, open for the run: a fixture provider served on loopback for
    this run, or the endpoint with the key from ``--api-key-env``."""
    limits = StreamLimits(idle_timeout=config.idle_timeout)
    if config.endpoint == "fixture":
        async with FixtureProvider.serve(faults=config.faults) as provider:
            backend = ResponsesBackend(
                provider.http_url,
                credentials=StaticCredentials(FIXTURE_KEY, account=account),
                mode=config.mode,
                limits=limits,
                endpoint_id="fixture",  # the port changes per run; the identity must not
            )
            async with backend:
                yield backend
        return
    key = os.environ.get(config.api_key_env, "")
    backend = ResponsesBackend(
        config.endpoint,
        credentials=StaticCredentials(key, account=account),
        mode=config.mode,
        limits=limits,
    )
    async with backend:
        yield backend
