"""Scheduler lateness with many waiting operations (target p99 <= 10 ms, zero early starts).

Run:  python bench/scheduler_lateness.py [--n 10000] [--spread 10] [--real-n 10000]
      [--mode sse|websocket] [--quick | --medium] [--collector default|tuned]

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

How the real operations are observed (current internals, nothing else changed): the
operation actor parks a waiting operation with ``await rt.scheduler.wait_until(at)``
from the task that called ``send_recovering``, with ``at`` the ``next_attempt_at``
it has just persisted. The bench wraps that method on the runtime's scheduler
instance and names the operation through a context variable set by the job task;
the wrapper checks ``at`` against the record read back from the store. An
operation whose ``retry_after`` had already passed when its failure was processed
is never parked (the machine goes straight to the host's authorization): it is
counted as "not parked" and has no lateness sample, instead of crashing the run.
Any early wake or early start makes the script exit 1.

``--quick``: a few seconds (500 bare waiters and 20 real operations over 0.3 s).
``--medium``: between that and the default (2,000 bare waiters, 300 real operations over
2 s): enough parked SSE connections for the connection pool's cost per request to show
(issue 36), still under a minute; ``tests/test_bench_quick.py`` runs it.

``--collector tuned`` runs the whole bench under the garbage-collector setting the
``batch`` and ``worker`` commands use (``recoverable.cli.gc_tuning``); the default is
Python's own, as a host embedding the library has it. An operation that fails (any
``RecoveryError``, e.g. ``LeaseLost``) is counted in ``failures`` by its error type, and
makes the script exit 1, as an early start does.
"""

from __future__ import annotations

import argparse
import contextlib
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

import recoverable
from recoverable.actors.scheduler import Scheduler
from recoverable.cli.gc_tuning import tuned_collector

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


async def bare(n: int, spread: float, lead: float) -> tuple[list[object], int]:
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
    return summary("bare Scheduler", lateness, early, f"peak waiting {parked}"), early


async def real(
    info: dict[str, Any], n: int, spread: float, lead: float, workdir: str,
    mode: Literal["sse", "websocket"],
) -> tuple[list[list[object]], int, int]:
    """Rows for the real operations, the number of early wakes + early starts, and the
    number of operations that failed."""
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
    persisted: dict[str, float] = {}  # operation id -> persisted next_attempt_at it parked at
    failures: dict[str, int] = {}  # error type -> operations that ended with it
    wake_late: list[float] = []
    start_late: list[float] = []
    early_wakes = 0
    early_starts = 0
    not_parked = 0
    peak_waiting = 0
    try:
        async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
            scheduler = rt.scheduler
            original: Callable[[float], Awaitable[None]] = scheduler.wait_until

            async def instrumented(at: float) -> None:
                nonlocal early_wakes, peak_waiting
                op = CURRENT_OP.get(None)
                if op is None:
                    raise RuntimeError(
                        "scheduler.wait_until was not called from the send_recovering task: "
                        "the actor's waiting path changed; this bench needs updating"
                    )
                record = store.get_operation(op)
                if record is None or record.next_attempt_at != at:
                    raise RuntimeError(
                        f"{op} waits until {at}, but the store says "
                        f"{None if record is None else record.next_attempt_at}"
                    )
                persisted[op] = at
                peak_waiting = max(peak_waiting, scheduler.waiting + 1)
                await original(at)
                woke = time.time()
                wake_late.append(woke - at)
                if woke < at:
                    early_wakes += 1

            setattr(scheduler, "wait_until", instrumented)  # noqa: B010 (bench instrumentation)

            async def job(i: int) -> None:
                nonlocal early_starts, not_parked
                request = recoverable.StructuredRequest(
                    model="gpt-test", instructions="wait", input=f"parked {i}"
                )
                handle = await rt.prepare(request, response=Answer, maximum_attempts=3,
                                          retry_policy=policy)
                op = handle.operation_id
                CURRENT_OP.set(op)

                async def authorize(attempt: recoverable.Attempt) -> bool:
                    nonlocal early_starts, not_parked
                    if attempt.number != 2:
                        return True
                    now = time.time()
                    at = persisted.get(op)
                    if at is None:
                        not_parked += 1  # its cooldown had passed before it could park
                        return True
                    start_late.append(now - at)
                    if now < at:
                        early_starts += 1
                    return True

                try:
                    value = await rt.send_recovering(
                        handle, response=Answer, authorize=authorize
                    )
                except recoverable.RecoveryError as exc:
                    name = type(exc).__name__
                    failures[name] = failures.get(name, 0) + 1
                    return
                assert isinstance(value, Answer)

            t0 = time.time()
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(job, i)
            elapsed = time.time() - t0
    finally:
        store.close()
    note = f"peak waiting {peak_waiting}; run {elapsed:.1f} s"
    failed = sum(failures.values())
    if failed:
        note += "; failures: " + ", ".join(f"{k} {v}" for k, v in sorted(failures.items()))
    if not_parked:
        note += f"; {not_parked} not parked (raise --real-lead)"
    rows = [
        summary(f"real ops: wake ({mode})", wake_late, early_wakes, note),
        summary(f"real ops: attempt start ({mode})", start_late, early_starts),
    ]
    return rows, early_wakes + early_starts, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=None,
                        help="bare scheduler waiters (10000; 0: skip)")
    parser.add_argument("--spread", type=float, default=None,
                        help="seconds the wakes spread over (10)")
    parser.add_argument("--lead", type=float, default=None,
                        help="bare: seconds before the first (3)")
    parser.add_argument("--real-n", type=int, default=None,
                        help="real parked ops (10000; 0: skip)")
    parser.add_argument("--real-lead", type=float, default=None,
                        help="real: minimum retry-after (default: 5 s + 5 ms per operation; "
                             "quick: 0.5 s + 5 ms per operation)")
    parser.add_argument("--mode", default="sse", choices=["sse", "websocket"])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="a few seconds: n=500, real-n=20, spread 0.3 s, lead 0.3 s")
    size.add_argument("--medium", action="store_true",
                      help="under a minute: n=2000, real-n=300, spread 2 s, lead 1 s")
    parser.add_argument("--collector", default="default", choices=["default", "tuned"],
                        help="the garbage collector's setting: Python's (default) or the "
                             "batch command's (tuned)")
    args = parser.parse_args()
    quick = args.quick
    size_name = "quick" if quick else "medium" if args.medium else "full"
    defaults = {  # n, spread, bare lead, real n, real lead base
        "quick": (500, 0.3, 0.3, 20, 0.5),
        "medium": (2000, 2.0, 1.0, 300, 1.0),
        "full": (10000, 10.0, 3.0, 10000, 5.0),
    }[size_name]
    n = args.n if args.n is not None else defaults[0]
    spread = args.spread if args.spread is not None else defaults[1]
    bare_lead = args.lead if args.lead is not None else defaults[2]
    real_n = args.real_n if args.real_n is not None else defaults[3]
    _common.raise_fd_limit()
    with contextlib.ExitStack() as stack:
        if args.collector == "tuned":
            stack.enter_context(tuned_collector())
        return measure(args, n, spread, bare_lead, real_n, defaults[4])


def measure(
    args: argparse.Namespace, n: int, spread: float, bare_lead: float, real_n: int,
    lead_base: float,
) -> int:
    failed = 0
    rows: list[list[object]] = []
    early = 0
    if n:  # --n 0 skips the bare scheduler (its waiter would wait for ever for none)
        bare_row, early = trio.run(bare, n, spread, bare_lead)
        rows.append(bare_row)
    if real_n:
        lead = (args.real_lead if args.real_lead is not None
                else lead_base + 0.005 * real_n)
        base = tempfile.mkdtemp(prefix="sched-lateness-")
        try:
            with _common.provider_process() as info:
                real_rows, real_early, failed = trio.run(
                    real, info, real_n, spread, lead, base, args.mode
                )
                rows += real_rows
                early += real_early
        finally:
            shutil.rmtree(base, ignore_errors=True)
    print(f"scheduler lateness (wakes spread over {spread:g} s; collector: {args.collector})")
    print(_common.table(
        ["what", "samples", "p50 ms", "p99 ms", "max ms", "early", "notes"], rows
    ))
    print(f"early wakes + early starts: {early} (target 0)")
    print(f"failed operations: {failed} (target 0)")
    return 1 if early or failed else 0


if __name__ == "__main__":
    sys.exit(main())
