"""Scheduler lateness with many waiting operations (target p99 <= 10 ms, zero early starts).

Run:  python bench/scheduler_lateness.py [--n 10000] [--spread 10] [--real-n 10000] [--quick]

1. Bare ``actors.scheduler.Scheduler`` (wall clock ``time.time``): ``--n`` tasks
   each ``wait_until(at)`` with ``at`` spread uniformly over ``--spread`` seconds,
   all parked before the first is due. lateness = wall time at wake - at.
2. Real operations (``--real-n``; 0 skips): each is prepared and sent; its first
   POST gets ``rate_limited(retry_after=...)`` from the provider (a separate
   process, scripted through ``POST /_fixture/script``) with ``retry_after``
   spread over ``--spread`` seconds after a lead long enough for all of them to
   park; the replacement then completes. For every park we read the persisted
   ``next_attempt_at`` from the store when the operation starts waiting, and
   measure (a) scheduler wake lateness (the runtime's ``wait_until`` returning)
   and (b) attempt-start lateness (the host's authorize callback for attempt 2,
   after the wake was persisted). An early start is any wake or attempt start
   before the persisted ``next_attempt_at``.
"""

from __future__ import annotations

import argparse
import contextvars
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import msgspec
import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
from recoverable.actors.scheduler import Scheduler

import recoverable

ACCOUNT = recoverable.AccountBinding("acct-sched", "api-key")
CURRENT_OP: contextvars.ContextVar[str] = contextvars.ContextVar("current_op")


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


def summary(name: str, lateness: list[float], early: int, extra: str = "") -> list[object]:
    return [
        name, len(lateness),
        _common.ms(_common.percentile(lateness, 50)),
        _common.ms(_common.percentile(lateness, 99)),
        _common.ms(max(lateness) if lateness else float("nan")),
        early, extra,
    ]


async def bare(n: int, spread: float, lead: float) -> list[object]:
    scheduler = Scheduler(time.time)
    lateness: list[float] = []
    early = 0
    done = trio.Event()

    async def waiter(at: float) -> None:
        nonlocal early
        await scheduler.wait_until(at)
        woke = time.time()
        lateness.append(woke - at)
        if woke < at:
            early += 1
        if len(lateness) == n:
            done.set()

    rng = random.Random(1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler.run)
        base = time.time() + lead
        for at in (base + rng.uniform(0.0, spread) for _ in range(n)):
            nursery.start_soon(waiter, at)
        await trio.testing.wait_all_tasks_blocked()
        parked = scheduler.waiting
        assert time.time() < base, "the waiters parked too late: raise --lead"
        await done.wait()
        nursery.cancel_scope.cancel()
    return summary("bare Scheduler", lateness, early, f"peak waiting {parked}")


async def real(
    info: dict[str, Any], n: int, spread: float, lead: float, workdir: str,
    mode: Literal["sse", "websocket"],
) -> list[list[object]]:
    rng = random.Random(2)
    _common.script_provider(info, [
        {"kind": "rate_limited", "retry_after": lead + rng.uniform(0.0, spread)}
        for _ in range(n)
    ])
    store = recoverable.RecoveryStore.open(str(Path(workdir) / "store"))
    backend = recoverable.ResponsesBackend(
        info["base_url"], credentials=recoverable.StaticCredentials("sk-sched", account=ACCOUNT),
        mode=mode, endpoint_id="fixture",
    )
    policy = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
    persisted: dict[str, float] = {}
    wake_late: list[float] = []
    start_late: list[float] = []
    early_wakes = 0
    early_starts = 0
    peak_waiting = 0
    try:
        async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
            scheduler = rt.scheduler
            original: Callable[[float], Awaitable[None]] = scheduler.wait_until

            async def instrumented(at: float) -> None:
                nonlocal early_wakes, peak_waiting
                op = CURRENT_OP.get()
                record = store.get_operation(op)
                assert record is not None and record.next_attempt_at is not None
                assert record.next_attempt_at == at, (record.next_attempt_at, at)
                persisted[op] = record.next_attempt_at
                peak_waiting = max(peak_waiting, scheduler.waiting + 1)
                await original(at)
                woke = time.time()
                wake_late.append(woke - persisted[op])
                if woke < persisted[op]:
                    early_wakes += 1

            setattr(scheduler, "wait_until", instrumented)  # noqa: B010 (bench instrumentation)

            async def job(i: int) -> None:
                nonlocal early_starts
                request = recoverable.StructuredRequest(
                    model="gpt-test", instructions="wait", input=f"parked {i}"
                )
                handle = await rt.prepare(request, response=Answer, maximum_attempts=3,
                                          retry_policy=policy)
                op = handle.operation_id
                CURRENT_OP.set(op)

                async def authorize(attempt: recoverable.Attempt) -> bool:
                    nonlocal early_starts
                    if attempt.number == 2:
                        now = time.time()
                        start_late.append(now - persisted[op])
                        if now < persisted[op]:
                            early_starts += 1
                    return True

                value = await rt.send_recovering(handle, response=Answer, authorize=authorize)
                assert isinstance(value, Answer)

            t0 = time.time()
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(job, i)
            elapsed = time.time() - t0
    finally:
        store.close()
    if len(wake_late) != n:
        raise RuntimeError(f"only {len(wake_late)} of {n} operations parked")
    note = f"peak waiting {peak_waiting}; run {elapsed:.0f} s"
    return [
        summary(f"real ops: wake ({mode})", wake_late, early_wakes, note),
        summary(f"real ops: attempt start ({mode})", start_late, early_starts),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10000, help="bare scheduler waiters")
    parser.add_argument("--spread", type=float, default=10.0, help="seconds the wakes spread over")
    parser.add_argument("--lead", type=float, default=3.0, help="bare: seconds before the first")
    parser.add_argument("--real-n", type=int, default=10000, help="real parked ops (0: skip)")
    parser.add_argument("--real-lead", type=float, default=None,
                        help="real: minimum retry-after (default: 5 s + 5 ms per operation)")
    parser.add_argument("--mode", default="sse", choices=["sse", "websocket"])
    parser.add_argument("--quick", action="store_true", help="n=2000, real-n=300, spread 3 s")
    args = parser.parse_args()
    if args.quick:
        args.n, args.real_n, args.spread = 2000, 300, 3.0
    _common.raise_fd_limit()
    rows = [trio.run(bare, args.n, args.spread, args.lead)]
    if args.real_n:
        lead = args.real_lead if args.real_lead is not None else 5.0 + 0.005 * args.real_n
        base = tempfile.mkdtemp(prefix="sched-lateness-")
        try:
            with _common.provider_process() as info:
                rows += trio.run(real, info, args.real_n, args.spread, lead, base, args.mode)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    print(f"scheduler lateness (wakes spread over {args.spread:.0f} s)")
    print(_common.table(
        ["what", "samples", "p50 ms", "p99 ms", "max ms", "early", "notes"], rows
    ))


if __name__ == "__main__":
    main()
