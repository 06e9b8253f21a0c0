"""What a durable job costs the event loop above a plain stream: task steps and cancel scopes.

Run:  python bench/durable_steps.py [--n 1000] [--concurrency 100] [--quick]

The same jobs, in this process, against the fixture provider in its own process
(WebSocket), after an untimed warm-up of one concurrency's worth of jobs:

- durable: ``prepare`` + ``send_recovering`` (a plain ``def`` policy) + ``acknowledge``
  on a fresh LMDB store;
- plain: ``freeze_body`` + ``ResponsesBackend.stream`` of the same body.

Counted per job: Trio task steps (``Instrument.before_task_step``: each is a park and a
wake) and cancel scopes entered (``trio.CancelScope.__enter__``), and where the durable
side's extra scopes are entered. Issue 34 asks for one park per durable boundary and no
cancel scope or checkpoint where the writer's completion already wakes the task: a
durable job here makes five store writes (prepare, acquire, the consumed attempt, the
receipt with the release, the acknowledgement), each one park, plus the supervisor's
task (started, then its outcome waited for: two steps); its extra scopes are the
supervisor's, the lease's watch, the stream's interruptible scope and the transport's
deadline. Counts, not times: the figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

import recoverable
from recoverable.body import freeze_body
from recoverable.contract import contract_for
from recoverable.types import StructuredRequest

SCHEMA = recoverable.JsonSchema("label", {
    "type": "object", "properties": {"label": {"type": "string", "enum": ["a", "b"]}},
    "required": ["label"], "additionalProperties": False,
})
ACCOUNT = recoverable.AccountBinding("acct-steps", "api-key")
TIMER = "_timeouts.py:sleep_until"  # where trio.sleep_until enters its scope


class Counts(trio.abc.Instrument):
    """Task steps, and cancel scopes entered (by where they were entered)."""

    def __init__(self) -> None:
        self.steps = 0
        self.scopes = 0
        self.where: collections.Counter[str] = collections.Counter()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1


def count_scopes(counts: Counts) -> Callable[[], None]:
    """Count every ``CancelScope.__enter__`` into ``counts``; returns the undo."""
    original = trio.CancelScope.__enter__

    def enter(self: trio.CancelScope) -> trio.CancelScope:
        counts.scopes += 1
        caller = sys._getframe(1)
        counts.where[f"{Path(caller.f_code.co_filename).name}:{caller.f_code.co_name}"] += 1
        return original(self)

    trio.CancelScope.__enter__ = enter  # type: ignore[method-assign]

    def undo() -> None:
        trio.CancelScope.__enter__ = original  # type: ignore[method-assign]

    return undo


async def measured(counts: Counts, one: Callable[[int], Awaitable[None]], n: int,
                   concurrency: int) -> tuple[float, float, collections.Counter[str]]:
    async def lane(indices: range) -> None:
        for i in indices:
            await one(i)

    async def run(first: int, count: int) -> None:
        async with trio.open_nursery() as nursery:
            for lane_index in range(concurrency):
                nursery.start_soon(lane, range(first + lane_index, first + count, concurrency))

    await run(0, concurrency)  # warm-up: every connection open
    steps, scopes = counts.steps, counts.scopes
    counts.where.clear()
    await run(concurrency, n)
    return (counts.steps - steps) / n, (counts.scopes - scopes) / n, counts.where.copy()


def backend(info: dict[str, Any]) -> recoverable.ResponsesBackend:
    return recoverable.ResponsesBackend(
        info["http_url"], mode="websocket",
        credentials=recoverable.StaticCredentials("sk-steps", account=ACCOUNT),
    )


async def durable(info: dict[str, Any], store_path: str, counts: Counts, n: int,
                  concurrency: int) -> tuple[float, float, collections.Counter[str]]:
    with recoverable.RecoveryStore.open(store_path) as store:
        async with backend(info) as sender, recoverable.open_runtime(
            store, sender, account=ACCOUNT
        ) as rt:
            async def one(i: int) -> None:
                handle = await rt.prepare(StructuredRequest(model="gpt-steps", input=f"q{i}"),
                                          response=SCHEMA, maximum_attempts=3)
                await rt.send_recovering(handle, response=SCHEMA, authorize=lambda _: True)
                await rt.acknowledge(handle)

            return await measured(counts, one, n, concurrency)


async def plain(info: dict[str, Any], counts: Counts, n: int,
                concurrency: int) -> tuple[float, float, collections.Counter[str]]:
    contract = contract_for(SCHEMA)
    async with backend(info) as sender:
        async def one(i: int) -> None:
            body = freeze_body(StructuredRequest(model="gpt-steps", input=f"q{i}"), contract)
            outcome = await sender.stream(body, attempt_id=f"plain{i}.1", token="sk-steps")
            assert isinstance(outcome, recoverable.outcome.Completed), outcome
            contract.decode(contract.validate(outcome.text))

        return await measured(counts, one, n, concurrency)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=None, help="jobs (default 1000; quick 100)")
    parser.add_argument("--concurrency", type=int, default=None, help="default 100; quick 20")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = parser.parse_args()
    n = args.n or (100 if args.quick else 1000)
    concurrency = args.concurrency or (20 if args.quick else 100)
    rows = {}
    with _common.provider_process() as info, tempfile.TemporaryDirectory() as tmp:
        for name in ("durable", "plain"):
            counts = Counts()
            undo = count_scopes(counts)
            try:
                if name == "durable":
                    rows[name] = trio.run(durable, info, str(Path(tmp) / "store"), counts, n,
                                          concurrency, instruments=[counts])
                else:
                    rows[name] = trio.run(plain, info, counts, n, concurrency,
                                          instruments=[counts])
            finally:
                undo()
    print(f"{n} jobs, concurrency {concurrency}, WebSocket")
    print(_common.table(["path", "task steps/job", "cancel scopes/job"],
                        [[name, f"{steps:.1f}", f"{scopes:.1f}"]
                         for name, (steps, scopes, _) in rows.items()]))
    # Timers (the monitor's poll, the heartbeat's beat: ``trio.sleep_until``) run by the
    # clock, not per job: a loaded machine makes more of them per job. Each is one scope
    # and one step; they are reported apart and left out of the per-job differences.
    timers = {name: where[TIMER] / n for name, (_, _, where) in rows.items()}
    extra = rows["durable"][2] - rows["plain"][2]
    del extra[TIMER]
    print("durable's extra scopes/job: " + ", ".join(
        f"{where} {count / n:.2f}" for where, count in extra.most_common() if count / n >= 0.05
    ))
    print(f"timers (by the clock, not per job): durable {timers['durable']:.2f}/job, "
          f"plain {timers['plain']:.2f}/job")
    sites = sorted(where for where, count in extra.items() if count / n >= 0.9)
    print("extra scope sites (>= 0.9/job): " + ", ".join(sites))
    steps = {name: rows[name][0] - timers[name] for name in rows}
    scopes = {name: rows[name][1] - timers[name] for name in rows}
    print(f"durable - plain, timers left out: task steps/job "
          f"{steps['durable'] - steps['plain']:.1f}, "
          f"cancel scopes/job {scopes['durable'] - scopes['plain']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
