"""(b) The floor: ``ResponsesBackend.stream`` of the same frozen body, nothing durable.

Freeze, stream, replace interrupted attempts by the library's own rule (in
memory), validate and decode the output. No store, no host commit: a crash
loses every job in flight (and the host would POST them again from scratch).
"""

from __future__ import annotations

from typing import Any

import trio

import recoverable
from recoverable.body import freeze_body
from recoverable.contract import OutputInvalid, contract_for

from . import (
    MAX_ATTEMPTS,
    TOKEN,
    Answer,
    JobFailed,
    make_backend,
    replacement_delay,
    request_for,
    result_record,
    run_pool,
)


async def stream_job(
    backend: recoverable.ResponsesBackend, body: bytes, job_name: str
) -> tuple[bytes, int]:
    """Stream ``body`` until a valid completion; returns (payload, attempts used)."""
    contract = contract_for(Answer)
    for number in range(1, MAX_ATTEMPTS + 1):
        outcome = await backend.stream(body, attempt_id=f"{job_name}.{number}", token=TOKEN)
        if isinstance(outcome, recoverable.Completed):
            try:
                return contract.validate(outcome.text), number
            except OutputInvalid as exc:
                raise JobFailed(f"{job_name}: invalid output") from exc
        delay = replacement_delay(outcome, number)
        if delay is None:
            raise JobFailed(f"{job_name}: {outcome.kind} not replaceable")
        if delay > 0:
            await trio.sleep(delay)
    raise JobFailed(f"{job_name}: attempts exhausted")


async def phase(
    *, base_url: str, mode: str, n: int, concurrency: int, warmup: int, workdir: str,
    cpu_seconds: Any, rss_mib: Any, posts: Any,
) -> dict[str, Any]:
    backend = make_backend(base_url, mode)
    contract = contract_for(Answer)
    failed = 0

    async with backend:

        async def job(i: int) -> None:
            nonlocal failed
            body = freeze_body(request_for(i), contract)
            try:
                payload, _ = await stream_job(backend, body, f"plain-{i}")
            except JobFailed:
                failed += 1
                return
            value = contract.decode(payload)
            assert isinstance(value, Answer)

        await run_pool(warmup, concurrency, job, offset=n)
        failed = 0
        posts0 = posts()
        cpu0 = cpu_seconds()
        elapsed, latencies = await run_pool(n, concurrency, job)
        cpu = cpu_seconds() - cpu0
        post_count = posts() - posts0
    return result_record(
        elapsed, latencies, cpu, rss_mib(), posts=post_count, failed=failed, fsyncs=0
    )
