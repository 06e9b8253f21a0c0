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

import functools
import random
import time
from pathlib import Path

import trio
import trio.testing

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


STOPPED = 300
PARKED_FOR = 15.0  # seconds: all are parked before the first is due, even on a loaded machine


async def test_a_clean_stop_with_hundreds_parked_then_the_rerun_completes_each_once(
    tmp_path: Path,
) -> None:
    """The clean stop and the rerun at scale: hundreds of operations parked on their
    persisted cooldowns when the host stops (its tasks cancelled, the runtime closed: no
    lease left behind, nothing lost); a new runtime then sends each of them again and
    each completes with exactly one more POST, and no lease is lost in either run."""
    first_attempts: set[str] = set()
    authorized: dict[str, list[int]] = {}
    handles: list[recoverable.Handle] = []
    started: dict[str, float] = {}  # operation id -> when its second attempt was authorized
    policy = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
    async with FixtureProvider.serve() as provider:
        # Long enough to be parked when the stop comes; short enough to be due at the rerun.
        provider.script_for(
            lambda attempt_id: Reply.rate_limited(PARKED_FOR)
            if attempt_id in first_attempts else None
        )

        def authorizer(op: str) -> recoverable.Authorize:
            numbers = authorized.setdefault(op, [])

            async def authorize(attempt: recoverable.Attempt) -> bool:
                numbers.append(attempt.number)
                if attempt.number == 1:
                    first_attempts.add(attempt.attempt_id)
                else:
                    started[op] = time.time()
                return True

            return authorize

        with recoverable.RecoveryStore.open(str(tmp_path / "store")) as store:
            with trio.fail_after(300):  # a bound, not a timing
                async with recoverable.open_runtime(
                    store, make_backend(provider, "sse"), account=ACCOUNT
                ) as rt:
                    async with trio.open_nursery() as nursery:

                        async def job(i: int) -> None:
                            request = recoverable.StructuredRequest(
                                model="gpt-test", instructions="wait", input=f"stopped {i}"
                            )
                            handle = await rt.prepare(request, response=Answer,
                                                      maximum_attempts=2, retry_policy=policy)
                            handles.append(handle)
                            await rt.send_recovering(handle, response=Answer,
                                                     authorize=authorizer(handle.operation_id))

                        all_parked = trio.Event()
                        park = rt.scheduler.wait_until

                        async def parked(at: float) -> None:
                            # Every operation parks here on its persisted cooldown.
                            if rt.scheduler.waiting + 1 >= STOPPED:
                                all_parked.set()
                            await park(at)

                        setattr(rt.scheduler, "wait_until", parked)  # noqa: B010 (observed)
                        for i in range(STOPPED):
                            nursery.start_soon(job, i)
                        await all_parked.wait()
                        await trio.testing.wait_all_tasks_blocked()  # the last one parked too
                        nursery.cancel_scope.cancel()  # the host stops
                    assert rt.leases.lost == 0
                # Closed: every lease let go; each operation suspended (its caller was
                # cancelled: docs/lifecycle.md) with its attempt spent and its cooldown saved.
                assert all(store.get_lease(handle.operation_id) is None for handle in handles)
                stopped = [store.get_operation(handle.operation_id) for handle in handles]
                assert all(record is not None and record.phase == "suspended"
                           and record.attempts_used == 1 and record.next_attempt_at is not None
                           for record in stopped)
                due = {record.operation_id: record.next_attempt_at
                       for record in stopped if record is not None}
                async with recoverable.open_runtime(
                    store, make_backend(provider, "sse"), account=ACCOUNT
                ) as rt:
                    async with trio.open_nursery() as nursery:
                        for handle in handles:
                            nursery.start_soon(functools.partial(
                                rt.send_recovering, handle, response=Answer,
                                authorize=authorizer(handle.operation_id)))
                    assert rt.leases.lost == 0
            finished = [store.get_operation(handle.operation_id) for handle in handles]
    assert len(handles) == STOPPED
    assert all(numbers == [1, 2] for numbers in authorized.values())
    assert all(record is not None and record.phase == "completed"
               and record.attempts_used == 2 for record in finished)
    assert len(provider.requests) == 2 * STOPPED  # one 429 and one completion each
    # The saved cooldown outlived the stop: no replacement was asked for before it.
    assert all(started[op] >= at for op, at in due.items() if at is not None)
