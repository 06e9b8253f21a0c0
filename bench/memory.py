"""Memory of the durable path (issue 20): RSS per 1,000 concurrent operations, with
100,000 operations at rest in the store, and the RSS slope across a 20,000-job run.

Run:  python bench/memory.py [--concurrency 1000] [--records 100000] [--jobs 20000] [--quick]

Every measurement runs in a fresh worker process against the fixture provider in its own
process (``bench/_common.py``), on a real LMDB store in a temporary directory:

- **in flight**: the provider holds every reply for ``--hold`` seconds (``--reply-delay``),
  so all ``--concurrency`` operations are prepared, authorized and waiting on their stream
  at once; RSS is sampled every 20 ms, anonymous (the heap) and file-backed (the LMDB map's
  pages touched) apart. Reported: RSS before (runtime open, after a warm-up of 50 jobs),
  the peak while they are in flight, and the difference per 1,000 operations.
  Once on an empty store, once on a store holding ``--records`` operations at rest (the mix
  of ``store_scale.py``: 70% prepared, 20% waiting on a cooldown an hour away, 10%
  completed awaiting acknowledgement), filled beforehand by another process. The plain
  stream (no store) in flight is measured too, for comparison.
- **slope**: ``--jobs`` jobs at concurrency ``--concurrency`` with no hold; RSS sampled 40
  times (every ``jobs / 40`` finished jobs, at least 100); the least-squares slope over the
  samples after the first 25% and over the last half (KiB per 1,000 jobs; 0 means no
  growth). The store's key caches (``functools.lru_cache`` of 16,384 operation keys and
  16,384 hashed key parts, about 0.4 KiB per operation) fill during the first 16,384 jobs;
  a run longer than that shows what grows after them.

``--quick``: concurrency 50, 500 records, 300 jobs, a 0.3 s hold (a few seconds). The
figures of a quick run mean nothing; it proves the script still works.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
import store_scale
from baselines import ACCOUNT, FAST, Answer, make_backend, request_for, run_pool

import recoverable
from recoverable.body import freeze_body
from recoverable.contract import contract_for

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 2**20


def rss_bytes() -> tuple[int, int]:
    """This process's resident set now, (anonymous, file-backed) bytes (``/proc/self/status``:
    ``RssAnon``, ``RssFile``). File-backed pages are mostly the LMDB map's pages touched
    (page cache, shared, reclaimable); anonymous pages are the heap."""
    anon = file = 0
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
            elif line.startswith(("RssFile:", "RssShmem:")):
                file += int(line.split()[1]) * 1024
    return anon, file


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


class Sampler:
    """The peak RSS (anonymous, file-backed; each its own peak) seen by a task that samples
    every ``every`` seconds."""

    def __init__(self, every: float = 0.02) -> None:
        self.every = every
        self.peak = (0, 0)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            anon, file = rss_bytes()
            self.peak = (max(self.peak[0], anon), max(self.peak[1], file))
            await trio.sleep(self.every)


async def durable_jobs(args: argparse.Namespace) -> dict[str, Any]:
    store = recoverable.RecoveryStore.open(str(Path(args.dir) / "store"), max_bytes=8 * 2**30)
    backend = make_backend(args.base_url, "websocket")
    try:
        async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:

            async def job(i: int) -> None:
                handle = await rt.prepare(
                    request_for(i), response=Answer, maximum_attempts=3, retry_policy=FAST,
                    job_id=f"mem-{i}", input_revision="r1",
                )
                value = await rt.send_recovering(handle, response=Answer, authorize=approve)
                assert isinstance(value, Answer)
                await rt.acknowledge(handle)

            return await measure(args, job)
    finally:
        store.close()


async def plain_jobs(args: argparse.Namespace) -> dict[str, Any]:
    backend = make_backend(args.base_url, "websocket")
    contract = contract_for(Answer)
    token = await backend.credentials.token()
    async with backend:

        async def job(i: int) -> None:
            body = freeze_body(request_for(i), contract)
            outcome = await backend.stream(body, attempt_id=f"plain-{i}.1", token=token)
            assert isinstance(outcome, recoverable.Completed), outcome
            assert isinstance(contract.decode(contract.validate(outcome.text)), Answer)

        return await measure(args, job)


async def measure(args: argparse.Namespace, job: Any) -> dict[str, Any]:
    offset = 10_000_000  # job ids apart from a filled store's
    await run_pool(50, 50, job, offset=offset)
    before = rss_bytes()
    if args.worker_kind == "slope":
        samples: list[tuple[int, int]] = []
        done = 0
        every = max(100, args.jobs // 40)

        async def counted(i: int) -> None:
            nonlocal done
            await job(i)
            done += 1
            if done % every == 0:
                samples.append((done, rss_bytes()))

        elapsed, _ = await run_pool(args.jobs, args.concurrency, counted, offset=offset + 100)
        return {"before": before, "samples": samples, "elapsed": elapsed}
    sampler = Sampler()
    async with trio.open_nursery() as nursery:
        await nursery.start(sampler.run)
        elapsed, _ = await run_pool(args.concurrency, args.concurrency, job, offset=offset + 100)
        nursery.cancel_scope.cancel()
    return {"before": before, "peak": sampler.peak, "elapsed": elapsed}


def fill(args: argparse.Namespace) -> dict[str, Any]:
    store = recoverable.RecoveryStore.open(str(Path(args.dir) / "store"), max_bytes=8 * 2**30)
    try:
        store_scale.build(store, args.records, 100)
    finally:
        store.close()
    return {}


def worker_main(args: argparse.Namespace) -> None:
    _common.raise_fd_limit()
    if args.worker_kind == "fill":
        result = fill(args)
    elif args.worker_kind == "plain":
        result = trio.run(plain_jobs, args)
    else:
        result = trio.run(durable_jobs, args)
    print(json.dumps(result), flush=True)


def run_worker(kind: str, args: argparse.Namespace, base_url: str, workdir: str) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--worker-kind", kind, "--concurrency",
            str(args.concurrency), "--records", str(args.records), "--jobs", str(args.jobs),
            "--base-url", base_url, "--dir", workdir]
    proc = subprocess.run(argv, capture_output=True, text=True, env=_common.child_env(),
                          timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def slope_kib_per_1000(samples: list[tuple[int, int]], skip: float = 0.25) -> float:
    """Least-squares slope of RSS over jobs, after the first ``skip`` of the samples, in KiB
    per 1,000 jobs."""
    tail = samples[int(len(samples) * skip) :]
    if len(tail) < 2:
        return float("nan")
    xs = [x for x, _ in tail]
    ys = [y for _, y in tail]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    return cov / var * 1000 / 1024


class _Skip(Exception):
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--hold", type=float, default=None,
                        help="seconds the provider holds each reply in the in-flight runs "
                        "(default 8; quick 0.3)")
    parser.add_argument("--part", action="append", choices=["inflight", "slope"],
                        help="run only this part (repeatable; default both)")
    parser.add_argument("--quick", action="store_true",
                        help="concurrency 50, 500 records, 300 jobs, 0.3 s hold")
    parser.add_argument("--worker-kind", choices=["durable", "plain", "slope", "fill"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_kind:
        worker_main(args)
        return
    if args.quick:
        args.concurrency, args.records, args.jobs = 50, 500, 300
    hold = args.hold if args.hold is not None else (0.3 if args.quick else 8.0)
    base = tempfile.mkdtemp(prefix="memory-")
    rows: list[list[str]] = []
    parts = args.part or ["inflight", "slope"]
    r: dict[str, Any] = {}
    try:
        with _common.provider_process(extra=["--reply-delay", str(hold)]) as held:
            if "inflight" not in parts:
                raise _Skip
            for label, kind, records in (
                ("plain stream, no store", "plain", 0),
                ("durable, empty store", "durable", 0),
                (f"durable, {args.records:,} operations at rest", "durable", args.records),
            ):
                workdir = tempfile.mkdtemp(dir=base)
                if records:
                    t0 = time.monotonic()
                    run_worker("fill", args, held["base_url"], workdir)
                    print(f"  filled {records:,} records in {time.monotonic() - t0:.0f} s",
                          file=sys.stderr)
                r = run_worker(kind, args, held["base_url"], workdir)
                scale = 1000 / max(1, args.concurrency) / MiB
                (anon0, file0), (anon1, file1) = r["before"], r["peak"]
                rows.append([label, f"{args.concurrency:,}", f"{anon0 / MiB:.0f}",
                             f"{anon1 / MiB:.0f}", f"{(anon1 - anon0) * scale:.1f}",
                             f"{file0 / MiB:.0f}", f"{file1 / MiB:.0f}",
                             f"{(file1 - file0) * scale:.1f}"])
                shutil.rmtree(workdir, ignore_errors=True)
    except _Skip:
        pass
    try:
        if "slope" in parts:
            with _common.provider_process() as info:
                workdir = tempfile.mkdtemp(dir=base)
                r = run_worker("slope", args, info["base_url"], workdir)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if rows:
        print(f"RSS with operations in flight (each reply held {hold:g} s by the provider)")
        print(_common.table(["workload", "in flight", "anon before MiB", "anon peak MiB",
                             "anon MiB per 1,000", "file before MiB", "file peak MiB",
                             "file MiB per 1,000"], rows))
        print("(anon: the heap; file: pages of the LMDB map and libraries touched, page "
              "cache)")
    if not r:
        return
    samples = r["samples"]
    for i, what in ((0, "anon"), (1, "file")):
        series = [(n, rss[i]) for n, rss in samples]
        slope = slope_kib_per_1000(series)
        late = slope_kib_per_1000(series, 0.5)
        shown = ", ".join(
            f"{n:,} {rss / MiB:.0f}" for n, rss in series[:: max(1, len(series) // 8)]
        )
        print(f"RSS {what} across {args.jobs:,} durable jobs at concurrency "
              f"{args.concurrency:,} ({args.jobs / r['elapsed']:.0f} jobs/s): start "
              f"{r['before'][i] / MiB:.0f} MiB, {shown} MiB; slope after the first quarter "
              f"{slope:+.1f} KiB per 1,000 jobs, over the last half {late:+.1f}")


if __name__ == "__main__":
    main()
