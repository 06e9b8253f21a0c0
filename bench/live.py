"""Live operations vs send_recovering: what showing partial views costs (issue 16).

Run:  python bench/live.py [--n 500] [--concurrency 100] [--rounds 3]
                           [--mode websocket --mode sse] [--deltas 100:200] [--quick]

One fixture provider process streams every answer in ``--deltas`` delta events (a real
answer of a few hundred tokens). In ONE process and one Trio run, per mode, rounds
alternate the two kinds of the same N jobs on one LMDB store (so both see the same
machine load):

- durable: ``prepare`` + ``send_recovering`` + ``acknowledge``;
- live:    ``prepare(live=True)`` + ``runtime.live`` with a consumer that takes every view
  it can (each view parses the text so far: ``PartialView.partial``) + ``acknowledge``.

Reported per mode: jobs/s and client CPU ms per job of each kind (summed over the rounds),
the live/durable ratios (throughput and CPU), views taken per job and deltas per job.
Then the parser alone: a stream of deltas fed to ``ResponseStream`` with and without
``on_delta`` (the only code a non-live stream shares with a live one).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
from baselines import run_pool

import recoverable
from recoverable.transport.events import response_stream

ACCOUNT = recoverable.AccountBinding("acct-bench-live", "api-key")
FAST = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


def request_for(i: int) -> recoverable.StructuredRequest:
    return recoverable.StructuredRequest(
        model="gpt-bench", instructions="Answer briefly.", input=f"Question {i}"
    )


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


class Counts:
    def __init__(self) -> None:
        self.views = 0
        self.elapsed = 0.0
        self.cpu = 0.0
        self.jobs = 0


async def run_kind(rt: recoverable.Runtime, kind: str, n: int, offset: int, concurrency: int,
                   counts: Counts) -> None:
    async def job(i: int) -> None:
        handle = await rt.prepare(request_for(i), response=Answer, maximum_attempts=3,
                                  retry_policy=FAST, live=kind == "live")
        if kind == "live":
            async with rt.live(handle, response=Answer, authorize=approve) as live:
                async for view in live:
                    counts.views += 1
                    assert view.partial is None or isinstance(view.partial, dict)
            value = live.value
        else:
            value = await rt.send_recovering(handle, response=Answer, authorize=approve)
        assert isinstance(value, Answer)
        await rt.acknowledge(handle)

    cpu0 = _common.self_cpu_seconds()
    elapsed, _ = await run_pool(n, concurrency, job, offset=offset)
    counts.cpu += _common.self_cpu_seconds() - cpu0
    counts.elapsed += elapsed
    counts.jobs += n


async def run_mode(args: argparse.Namespace, mode: str, base_url: str, workdir: str
                   ) -> dict[str, Counts]:
    store = recoverable.RecoveryStore.open(str(Path(workdir) / f"store-{mode}"))
    backend = recoverable.ResponsesBackend(
        base_url, credentials=recoverable.StaticCredentials("sk-bench", account=ACCOUNT),
        mode=mode, endpoint_id="fixture",
    )
    counts = {"durable": Counts(), "live": Counts()}
    try:
        async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
            offset = 0
            for kind in ("durable", "live"):  # warm-up, untimed
                await run_kind(rt, kind, args.warmup, offset, args.concurrency, Counts())
                offset += args.warmup
            for round_number in range(args.rounds):
                # Alternate which kind goes first, so drift in load hits both alike.
                order = ("durable", "live") if round_number % 2 == 0 else ("live", "durable")
                for kind in order:
                    await run_kind(rt, kind, args.n, offset, args.concurrency, counts[kind])
                    offset += args.n
    finally:
        store.close()
    return counts


def parser_cost(deltas: int, repeat: int) -> tuple[float, float]:
    """µs per delta event fed to ResponseStream: without on_delta, and with one."""
    frames = [msgspec.json.encode({
        "type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
        "content_index": 0, "delta": "tok ", "sequence_number": i + 4, "logprobs": [],
    }) for i in range(deltas)]
    sink: list[str] = []
    results = []
    for hook in (None, sink.append):
        best = float("inf")
        for _ in range(repeat):
            stream = response_stream(max_events=deltas + 10, on_progress=None, on_delta=hook)
            t0 = time.perf_counter()
            for frame in frames:
                stream.feed(frame)
            best = min(best, time.perf_counter() - t0)
            sink.clear()
        results.append(best / deltas * 1e6)
    return results[0], results[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=None, help="jobs per kind per round")
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--mode", action="append", choices=["websocket", "sse"])
    parser.add_argument("--deltas", default="100:200", help="LOW:HIGH deltas per answer")
    parser.add_argument("--quick", action="store_true",
                        help="a few seconds: n=40, concurrency 10, one round, sse only")
    args = parser.parse_args()
    args.n = args.n or (40 if args.quick else 500)
    args.concurrency = args.concurrency or (10 if args.quick else 100)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.warmup = args.warmup if args.warmup is not None else max(1, args.concurrency // 2)
    modes = args.mode or (["sse"] if args.quick else ["websocket", "sse"])
    _common.raise_fd_limit()
    workdir = tempfile.mkdtemp(prefix="bench-live-")
    rows = []
    try:
        with _common.provider_process(extra=["--deltas", args.deltas]) as info:
            for mode in modes:
                posts0 = len(_common.provider_requests(info))
                counts = trio.run(run_mode, args, mode, info["base_url"], workdir)
                posts = len(_common.provider_requests(info)) - posts0
                durable, live = counts["durable"], counts["live"]
                expected = durable.jobs + live.jobs + 2 * args.warmup
                assert posts == expected, f"{posts} POSTs for {expected} jobs"
                rate = {kind: c.jobs / c.elapsed for kind, c in counts.items()}
                cpu = {kind: c.cpu / c.jobs for kind, c in counts.items()}
                rows.append([
                    mode, durable.jobs, f"{rate['durable']:.0f}", f"{rate['live']:.0f}",
                    f"{rate['live'] / rate['durable']:.2f}", _common.ms(cpu["durable"]),
                    _common.ms(cpu["live"]), f"{cpu['live'] / cpu['durable']:.2f}",
                    f"{live.views / live.jobs:.1f}", posts,
                ])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"live vs send_recovering, {args.rounds} alternating round(s), concurrency "
          f"{args.concurrency}, {args.deltas} deltas per answer (provider in its own process)")
    print(_common.table(
        ["mode", "jobs", "durable jobs/s", "live jobs/s", "ratio", "durable CPU ms/job",
         "live CPU ms/job", "CPU ratio", "views/job", "POSTs"], rows))
    without, with_hook = parser_cost(deltas=2000, repeat=5 if args.quick else 30)
    print(f"parser: {without:.2f} µs per delta event without on_delta, {with_hook:.2f} µs "
          f"with one (only a live operation's stream has one)")


if __name__ == "__main__":
    main()
