"""Issue 36: a thousand operations parked at once in one runtime over SSE.

Each operation's first POST is answered 429 with a Retry-After of one to three seconds;
it parks on the scheduler at its persisted ``next_attempt_at`` with its HTTP connection
kept alive, and its replacement completes. With one large httpx connection pool every
request start and end examined every kept connection (a socket probe each), which starved
the event loop at a few hundred parked operations and made their own owner lose its
leases (``LeaseLost`` with no other owner anywhere). Not timed: it asserts that every
operation completed exactly once, with two POSTs, and no lease was lost.
"""

from __future__ import annotations

import random
from pathlib import Path

import trio

import recoverable
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, Answer, make_backend

OPERATIONS = 1000


async def test_a_thousand_parked_sse_operations_complete_once_with_no_lease_lost(
    tmp_path: Path,
) -> None:
    rng = random.Random(36)
    first_attempts: set[str] = set()
    authorized: dict[str, list[int]] = {}
    policy = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
    async with FixtureProvider.serve() as provider:
        provider.script_for(
            lambda attempt_id: Reply.rate_limited(rng.uniform(1.0, 3.0))
            if attempt_id in first_attempts else None
        )
        with recoverable.RecoveryStore.open(str(tmp_path / "store")) as store:
            async with recoverable.open_runtime(
                store, make_backend(provider, "sse"), account=ACCOUNT
            ) as rt:

                async def job(i: int) -> None:
                    request = recoverable.StructuredRequest(
                        model="gpt-test", instructions="wait", input=f"parked {i}"
                    )
                    handle = await rt.prepare(
                        request, response=Answer, maximum_attempts=2, retry_policy=policy
                    )
                    numbers = authorized.setdefault(handle.operation_id, [])

                    async def authorize(attempt: recoverable.Attempt) -> bool:
                        numbers.append(attempt.number)
                        if attempt.number == 1:
                            first_attempts.add(attempt.attempt_id)
                        return True

                    value = await rt.send_recovering(
                        handle, response=Answer, authorize=authorize
                    )
                    assert isinstance(value, Answer)

                # A bound, not a timing: a starved loop shows as LeaseLost or as this.
                with trio.fail_after(300):
                    async with trio.open_nursery() as nursery:
                        for i in range(OPERATIONS):
                            nursery.start_soon(job, i)
                assert rt.leases.lost == 0
                parked = rt.scheduler.woken
            statuses = [store.get_operation(op) for op in authorized]
    assert len(authorized) == OPERATIONS
    assert all(numbers == [1, 2] for numbers in authorized.values())
    assert all(
        record is not None and record.phase == "completed" and record.attempts_used == 2
        for record in statuses
    )
    requests = provider.requests
    assert len(requests) == 2 * OPERATIONS  # one 429 and one completion each, no more
    # Nearly all of them waited on the scheduler (one whose cooldown had passed before
    # its failure was processed goes straight on: a loaded machine may see a few).
    assert parked >= 0.9 * OPERATIONS
