"""What one ``recoverable batch`` run is asked to do (its options, after parsing)."""

from __future__ import annotations

from typing import Final, Literal

import attrs

from recoverable.actors.governor import DEFAULT_BURST_SECONDS
from recoverable.fixture.provider import FaultSpec
from recoverable.pricing import PriceTable
from recoverable.transport.connect import UNREACHABLE_AFTER
from recoverable.transport.modes import DEFAULT_MODE, Mode

__all__ = ["DEFAULT_RETRY_PROVIDER_CODES", "MAXIMUM_RETRY_AFTER", "MINIMUM_RPS", "BatchConfig"]

MAXIMUM_RETRY_AFTER: Final = 600.0  # the batch waits at most this long for a Retry-After
MINIMUM_RPS: Final = 0.01  # --rps below this (one POST per 100 s) is refused
DEFAULT_RETRY_PROVIDER_CODES: frozenset[str] = frozenset(
    {"server_error", "server_is_overloaded", "slow_down", "rate_limit_exceeded"}
)


@attrs.frozen
class BatchConfig:
    jobs_path: str
    out_path: str
    store_path: str
    endpoint: str = "fixture"  # "fixture" or a base URL
    api_key_env: str = "OPENAI_API_KEY"
    account: str | None = None
    mode: Mode = DEFAULT_MODE
    concurrency: int = 64
    rps: float | None = None
    rpm: float | None = None  # --rpm / --tpm: the rate governor (docs/rate-limits.md)
    tpm: float | None = None
    rate_burst_seconds: float = DEFAULT_BURST_SECONDS
    faults: FaultSpec | None = None
    max_attempts: int = 8
    on_interruption: Literal["replace", "fail"] = "replace"  # saved with each new operation
    initial_backoff: float = 0.5
    maximum_backoff: float = 30.0
    maximum_retry_after: float = MAXIMUM_RETRY_AFTER
    idle_timeout: float = 120.0
    # The batch opts in explicitly to replacing these response.failed codes (the library
    # default replaces none); ``--retry-provider-codes`` overrides, "" disables.
    retry_provider_codes: frozenset[str] = DEFAULT_RETRY_PROVIDER_CODES
    prices: PriceTable | None = None  # --prices FILE (None: genai-prices, if installed)
    max_cost: float | None = None  # --max-cost: each new operation's maximum_cost_total
    prices_path: str | None = None  # that FILE (an input the outputs must not be)
    # The shape of the --out lines ("recoverable" or "openai-batch"), the
    # --errors file, --retry-failed, and the --revision of Batch API lines.
    output_format: str = "recoverable"
    errors_path: str | None = None
    retry_failed: bool = False
    revision: str | None = None
    # Run the jobs in N ``recoverable worker`` processes (0: in this process),
    # replacing a worker that dies at most ``worker_restarts`` times (None: 4 per worker).
    workers: int = 0
    worker_restarts: int | None = None
    # Nothing waits forever: the batch ends (exit 1, nothing spent) once the endpoint could not be
    # connected to for this long (``open_runtime(unreachable_after=)``; inf: no bound).
    unreachable_after: float = UNREACHABLE_AFTER
