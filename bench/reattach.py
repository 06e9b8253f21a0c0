"""Reattach instead of regenerate (issue 15): POSTs and tokens per job, and the checkpoint cost.

Run:  python bench/reattach.py [--n 500] [--concurrency 50] [--faults disconnect=0.2]
                               [--deltas 200] [--quick]

Two scenarios, each with its own fixture provider process and long answers (``--deltas``
delta events per answer, default 200), each running the same N durable jobs twice on a
fresh LMDB store, ``reattach=False`` then ``reattach=True``:

- **faults** (``--faults``, default ``disconnect=0.2``): the provider drops 20% of the
  streams mid-way. Without reattachment every drop is replaced by a new POST (a second
  generation); with it, the dropped background response is resumed by GET. Reported:
  POSTs per job (target with reattach: <= 1.01), resume GETs per job, and tokens
  generated per job = the provider's generations (POSTs) x the output tokens of one
  answer (every POST the provider accepts generates a whole answer: a background one
  keeps generating after the drop, and a plain one is billed for what it generated).
- **cost** (no faults): the price of the fenced checkpoint on the durable path. Reported:
  store writes and commits (fsyncs) per job and jobs/s, and the ratio reattach/plain
  measured in the same run.

The provider runs in its own process (``_common.provider_process``); sockets on
127.0.0.1, LMDB on disk.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
from baselines import run_pool

import recoverable

ACCOUNT = recoverable.AccountBinding("acct-bench", "api-key")
FAST = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)


ANSWER_CHARS = 1400  # long answers: the provider streams them in --deltas events


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: Annotated[str, msgspec.Meta(min_length=ANSWER_CHARS)]


def request_for(i: int) -> recoverable.StructuredRequest:
    return recoverable.StructuredRequest(
        model="gpt-bench", instructions="Answer at length.", input=f"Question {i}"
    )


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


async def run_jobs(
    info: dict[str, Any], directory: Path, *, n: int, concurrency: int, reattach: bool,
    prefix: str,
) -> dict[str, Any]:
    """N durable jobs (prepare, send_recovering, acknowledge) on a fresh store."""
    store = recoverable.RecoveryStore.open(str(directory / f"store-{prefix}"))
    backend = recoverable.ResponsesBackend(
        info["base_url"], mode="sse", endpoint_id="fixture",
        credentials=recoverable.StaticCredentials("sk-bench-secret", account=ACCOUNT),
    )
    output_tokens: list[int] = []
    reattachments = 0
    try:
        async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:

            async def job(i: int) -> None:
                nonlocal reattachments
                handle = await rt.prepare(
                    request_for(i), response=Answer, maximum_attempts=10, retry_policy=FAST,
                    job_id=f"{prefix}-{i}", input_revision="r1", reattach=reattach,
                )
                value = await rt.send_recovering(handle, response=Answer, authorize=approve)
                assert isinstance(value, Answer)
                status = await rt.status(handle)
                last = status.attempts[-1]
                if last.usage is not None:
                    output_tokens.append(last.usage.output_tokens)
                reattachments += status.reattachments
                await rt.acknowledge(handle)

            before = store.stats()
            started = time.perf_counter()
            await run_pool(n, concurrency, job)
            elapsed = time.perf_counter() - started
            after = store.stats()
    finally:
        store.close()
    return {
        "elapsed": elapsed,
        "commits": after["commits"] - before["commits"],
        "writes": after["writes"] - before["writes"],
        "tokens_per_answer": sum(output_tokens) / len(output_tokens) if output_tokens else 0.0,
        "reattachments": reattachments,
    }


def _log(info: dict[str, Any], which: str) -> list[dict[str, Any]]:
    url = info["requests_url"].replace("/_fixture/requests", f"/_fixture/{which}")
    response = httpx.get(url, timeout=60)
    response.raise_for_status()
    log: list[dict[str, Any]] = response.json()
    return log


async def scenario(
    info: dict[str, Any], directory: Path, args: argparse.Namespace
) -> dict[bool, dict[str, Any]]:
    results: dict[bool, dict[str, Any]] = {}
    for reattach in (False, True):
        posts_before = len(_log(info, "requests"))
        gets_before = len(_log(info, "retrievals"))
        result = await run_jobs(info, directory, n=args.n, concurrency=args.concurrency,
                                reattach=reattach, prefix=f"r{int(reattach)}")
        result["posts"] = len(_log(info, "requests")) - posts_before
        result["gets"] = sum(1 for r in _log(info, "retrievals")[gets_before:]
                             if r.get("kind") == "resume")
        results[reattach] = result
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=None, help="jobs per phase (default 500)")
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--faults", default="disconnect=0.2,seed=7")
    parser.add_argument("--deltas", type=int, default=200, help="delta events per answer")
    parser.add_argument("--quick", action="store_true", help="N=30: the script works")
    args = parser.parse_args(argv)
    if args.n is None:
        args.n = 30 if args.quick else 500
    if args.deltas < 1:
        parser.error("--deltas must be at least 1")
    deltas = ["--deltas", f"{args.deltas}:{args.deltas}"]
    directory = Path(tempfile.mkdtemp(prefix="bench-reattach-"))
    try:
        with _common.provider_process(args.faults, extra=deltas) as info:
            faults = trio.run(scenario, info, directory / "faults", args)
        with _common.provider_process(None, extra=deltas) as info:
            cost = trio.run(scenario, info, directory / "cost", args)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    n = args.n
    rows = []
    for name, results in (("faults", faults), ("cost", cost)):
        for reattach in (False, True):
            r = results[reattach]
            rows.append([
                name, "yes" if reattach else "no", n, f"{r['posts'] / n:.3f}",
                f"{r['gets'] / n:.3f}",
                f"{r['posts'] / n * r['tokens_per_answer']:.0f}",
                f"{r['writes'] / n:.2f}", f"{r['commits'] / n:.3f}", f"{n / r['elapsed']:.0f}",
            ])
    print(f"reattach vs replace: {args.deltas} deltas per answer, concurrency {args.concurrency},"
          f" faults {args.faults!r} (provider in a separate process)")
    print(_common.table(["scenario", "reattach", "N", "POSTs/job", "GETs/job",
                         "tokens generated/job", "writes/job", "fsync/job", "jobs/s"], rows))
    with_r, without = faults[True], faults[False]
    print(f"POSTs per job under {args.faults}: {without['posts'] / n:.3f} without reattach, "
          f"{with_r['posts'] / n:.3f} with (target <= 1.01)")
    plain, checkpointed = cost[False], cost[True]
    print(f"checkpoint cost (no faults, same run): writes/job {plain['writes'] / n:.2f} -> "
          f"{checkpointed['writes'] / n:.2f}, fsync/job {plain['commits'] / n:.3f} -> "
          f"{checkpointed['commits'] / n:.3f}, jobs/s ratio reattach/plain "
          f"{(n / checkpointed['elapsed']) / (n / plain['elapsed']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
