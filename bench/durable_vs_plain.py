"""Durable vs plain throughput: the same N jobs through the same provider process.

Run:  python bench/durable_vs_plain.py [--n 1000 --n 10000] [--concurrency 1000]
                                       [--mode websocket --mode sse] [--quick]
(default: N = 1,000 and 10,000, WebSocket; add ``--mode sse --n 1000`` for SSE)

One fixture provider runs in its own process for the whole run. For every
(mode, N) the same N jobs (job i asks "Question i") are run twice, each phase
in a fresh worker process (so peak RSS is per phase):

- durable: ``prepare`` + ``send_recovering`` + ``acknowledge`` on a fresh
  LMDB store (every durable step fsynced; group commit);
- plain:   ``freeze_body`` + ``ResponsesBackend.stream`` of the same frozen body
  + the same output validation and decoding, no store.

Reported: jobs/s, durable/plain ratio (target >= 0.8), store commits (fsyncs)
per operation (target <= 0.5), p50/p99 latency per job, peak RSS, POSTs seen by
the provider (must be N: no retries are expected, no fault is injected).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
from baselines import run_pool

import recoverable
from recoverable.body import freeze_body
from recoverable.contract import contract_for

ACCOUNT = recoverable.AccountBinding("acct-bench", "api-key")
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


def make_backend(args: argparse.Namespace) -> recoverable.ResponsesBackend:
    return recoverable.ResponsesBackend(
        args.base_url,
        credentials=recoverable.StaticCredentials("sk-bench-secret", account=ACCOUNT),
        mode=args.mode,
        endpoint_id="fixture",
    )


async def durable_phase(args: argparse.Namespace) -> dict[str, Any]:
    store = recoverable.RecoveryStore.open(str(Path(args.dir) / "store"))
    backend = make_backend(args)
    try:
        async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:

            async def job(i: int) -> None:
                handle = await rt.prepare(
                    request_for(i), response=Answer, maximum_attempts=3, retry_policy=FAST,
                    job_id=f"job-{i}", input_revision="r1",
                )
                value = await rt.send_recovering(handle, response=Answer, authorize=approve)
                assert isinstance(value, Answer)
                await rt.acknowledge(handle)

            await run_pool(args.warmup, args.concurrency, job, offset=args.n)
            _after_warmup(args)
            before = store.stats()
            cpu0, split0, switches0 = _cpu_marks()
            elapsed, latencies = await run_pool(args.n, args.concurrency, job)
            cpu, split, switches = _cpu_since(cpu0, split0, switches0)
            after = store.stats()
            pending = store.inventory(account=ACCOUNT)[0]
            assert not pending, f"{len(pending)} operations left unacknowledged"
    finally:
        store.close()
    return {
        "elapsed": elapsed,
        "latencies": latencies,
        "commits": after["commits"] - before["commits"],
        "writes": after["writes"] - before["writes"],
        "largest_batch": after["largest_batch"],
        "cpu": cpu,
        "loop_cpu": split[0],
        "thread_cpu": split[1],
        "gc_cpu": split[2],
        "gc_by_generation": [GC.seconds, GC.collections],
        "switches": switches,
        "rss_mib": _common.peak_rss_mib(),
    }


async def plain_phase(args: argparse.Namespace) -> dict[str, Any]:
    backend = make_backend(args)
    contract = contract_for(Answer)
    token = await backend.credentials.token()
    async with backend:

        async def job(i: int) -> None:
            body = freeze_body(request_for(i), contract)
            outcome = await backend.stream(body, attempt_id=f"plain-{i}.1", token=token)
            assert isinstance(outcome, recoverable.Completed), outcome
            value = contract.decode(contract.validate(outcome.text))
            assert isinstance(value, Answer)

        await run_pool(args.warmup, args.concurrency, job, offset=args.n)
        _after_warmup(args)
        cpu0, split0, switches0 = _cpu_marks()
        elapsed, latencies = await run_pool(args.n, args.concurrency, job)
        cpu, split, switches = _cpu_since(cpu0, split0, switches0)
    return {"elapsed": elapsed, "latencies": latencies, "cpu": cpu, "loop_cpu": split[0],
            "thread_cpu": split[1], "gc_cpu": split[2], "switches": switches,
            "gc_by_generation": [GC.seconds, GC.collections],
            "rss_mib": _common.peak_rss_mib()}


GC = _common.GcClock()


def _after_warmup(args: argparse.Namespace) -> None:
    if "gc-freeze" in (args.experiment or []):
        import gc

        gc.freeze()
        gc.set_threshold(10_000, 10, 10)


def _cpu_marks() -> tuple[float, tuple[float, float, float], tuple[int, int]]:
    main, other = _common.thread_cpu_seconds()
    return _common.self_cpu_seconds(), (main, other, GC.total()), _common.context_switches()


def _cpu_since(
    cpu0: float, split0: tuple[float, float, float], switches0: tuple[int, int]
) -> tuple[float, tuple[float, float, float], tuple[int, int]]:
    """CPU seconds (all threads; event-loop thread, other threads, the cyclic garbage
    collector in any thread) and context switches (voluntary, involuntary) since the marks."""
    cpu1, split1, switches1 = _cpu_marks()
    return (
        cpu1 - cpu0,
        (split1[0] - split0[0], split1[1] - split0[1], split1[2] - split0[2]),
        (switches1[0] - switches0[0], switches1[1] - switches0[1]),
    )


EXPERIMENTS = {
    "governor-no-read": "RateGovernor.admit returns at once when no limit is configured (no store "
    "read per admission; cross-process pauses unseen: an upper bound of the gain)",
    "no-nested-txn": "the writer runs each mutation straight in the batch transaction (no "
    "child transaction; a failing mutation would not be rolled back alone: measurement only)",
    "switch-interval-1ms": "sys.setswitchinterval(0.001) (the GIL is handed over sooner)",
    "writer-context-per-write": "the writer makes a new mutation context for every write of "
    "a batch, as before issue 20 wave 2 (measures what one shared context per batch gains)",
    "gc-off": "gc.disable() in the worker (what Python's cyclic garbage collector costs)",
    "gc-freeze": "gc.freeze() after the warm-up and gc.set_threshold(10_000, 10, 10): what a "
    "host can do without touching the library",
}


def apply_experiments(names: list[str]) -> None:
    """Bench-side patches that measure what a change would gain before it is made. They
    break guarantees (see EXPERIMENTS) and exist only in this worker process."""
    import outcome

    from recoverable.actors.governor import RateGovernor
    from recoverable.storage.writer import Writer

    for name in names:
        if name == "governor-no-read":
            async def fast_admit(
                self: RateGovernor, *a: Any, _admit: Any = RateGovernor.admit, **k: Any
            ) -> None:
                if not self.limited:
                    return
                await _admit(self, *a, **k)

            RateGovernor.admit = fast_admit  # type: ignore[method-assign]
        elif name == "no-nested-txn":

            def run_one(self: Writer, parent: Any, job: Any) -> bool:
                ctx = self._make_context(parent)
                job.ctx = ctx
                try:
                    value = job.fn(ctx)
                    ctx.finish()
                except BaseException as exc:
                    job.result = outcome.Error(exc)
                    return False
                job.result = outcome.Value(value)
                return True

            Writer._run_one = run_one  # type: ignore[method-assign]
        elif name == "writer-context-per-write":
            def fresh_context(
                self: Writer, ctx: Any, job: Any, _run: Any = Writer._run_direct
            ) -> None:
                _run(self, self._make_context(ctx._txn), job)

            Writer._run_direct = fresh_context  # type: ignore[method-assign]
        elif name == "switch-interval-1ms":
            sys.setswitchinterval(0.001)
        elif name == "gc-off":
            import gc

            gc.disable()
        elif name == "gc-freeze":
            pass  # applied after the warm-up (_after_warmup)
        else:
            raise SystemExit(f"unknown experiment {name!r}: {sorted(EXPERIMENTS)}")


def worker_main(args: argparse.Namespace) -> None:
    _common.raise_fd_limit()
    GC.install()
    apply_experiments(args.experiment or [])
    phase = durable_phase if args.worker == "durable" else plain_phase
    if args.profile:
        # CPU attribution of the event-loop thread (thread_time: waits are not counted).
        import cProfile
        import io
        import pstats

        from recoverable.storage.writer import Writer

        # The store's writer thread too, in its own profile (a bench-side wrapper of the
        # thread's main function; the library is unchanged).
        writer_profiler = cProfile.Profile(time.thread_time)
        run_writer = Writer._run

        def profiled_run(self: Writer) -> None:
            writer_profiler.runcall(run_writer, self)

        Writer._run = profiled_run  # type: ignore[method-assign]
        profiler = cProfile.Profile(time.thread_time)
        result = profiler.runcall(trio.run, phase, args)
        text = io.StringIO()
        for title, prof in (("event-loop thread", profiler), ("writer thread", writer_profiler)):
            if not prof.getstats():
                continue
            text.write(f"===== {title}\n")
            if args.profile_raw:
                prof.dump_stats(f"{args.profile}.{title.split()[0]}.prof")
            stats = pstats.Stats(prof, stream=text).strip_dirs()
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumulative").print_stats(80)
        Path(args.profile).write_text(text.getvalue())
    else:
        result = trio.run(phase, args)
    print(json.dumps(result), flush=True)


def run_worker(
    phase: str, mode: str, n: int, concurrency: int, warmup: int, base_url: str, workdir: str,
    profile: str | None, profile_raw: bool = False, experiments: list[str] | None = None,
) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--worker", phase, "--mode", mode, "--n", str(n),
            "--concurrency", str(concurrency), "--warmup", str(warmup), "--base-url", base_url,
            "--dir", workdir]
    if profile:
        argv += ["--profile", profile]
        if profile_raw:
            argv.append("--profile-raw")
    for name in experiments or []:  # the patches of the durable path are inert in plain
        argv += ["--experiment", name]
    proc = subprocess.run(argv, capture_output=True, text=True, env=_common.child_env(),
                          timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{phase} worker failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, action="append", help="jobs per run (repeatable)")
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--mode", action="append", choices=["websocket", "sse"])
    parser.add_argument("--warmup", type=int, default=None, help="untimed jobs first (default c/4)")
    parser.add_argument("--quick", action="store_true",
                        help="a few seconds: n=100, concurrency 25, sse only")
    parser.add_argument("--profile", metavar="DIR",
                        help="write cProfile CPU profiles (event-loop thread) of workers to DIR")
    parser.add_argument("--profile-raw", action="store_true",
                        help="with --profile: also keep the raw cProfile files (*.prof)")
    parser.add_argument("--experiment", action="append", choices=sorted(EXPERIMENTS),
                        help="a bench-side patch in both workers (those of the durable path "
                        "are inert in plain) that measures a change's gain before it is made "
                        "(some break guarantees; never for real figures)")
    parser.add_argument("--worker", choices=["durable", "plain"], help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.n = args.n[0]
        args.mode = args.mode[0]
        worker_main(args)
        return
    sizes = args.n or ([100] if args.quick else [1000, 10000])
    modes = args.mode or (["sse"] if args.quick else ["websocket"])
    concurrency = 25 if args.quick and args.concurrency == 1000 else args.concurrency
    warmup = args.warmup if args.warmup is not None else max(1, concurrency // 4)
    rows = []
    base = tempfile.mkdtemp(prefix="durable-vs-plain-")
    try:
        with _common.provider_process() as info:
            posts_before = len(_common.provider_requests(info))
            for mode in modes:
                for n in sizes:
                    results: dict[str, dict[str, Any]] = {}
                    for phase in ("plain", "durable"):
                        workdir = tempfile.mkdtemp(prefix=f"{phase}-", dir=base)
                        profile = (
                            str(Path(args.profile) / f"{phase}-{mode}-{n}.txt")
                            if args.profile else None
                        )
                        provider_cpu0 = _common.process_cpu_seconds(info["pid"])
                        results[phase] = run_worker(
                            phase, mode, n, concurrency, warmup, info["base_url"], workdir, profile,
                            args.profile_raw, args.experiment,
                        )
                        results[phase]["provider_cpu"] = (
                            _common.process_cpu_seconds(info["pid"]) - provider_cpu0
                        )
                        posts = len(_common.provider_requests(info))
                        results[phase]["posts"] = posts - posts_before - warmup
                        posts_before = posts
                    rows.append((mode, n, results))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"durable vs plain, concurrency {concurrency} (provider in a separate process)")
    headers = ["mode", "N", "phase", "jobs/s", "ratio", "fsync/op", "writes/op", "p50 ms",
               "p99 ms", "client CPU ms/job", "loop ms/job", "threads ms/job", "gc ms/job",
               "csw/job",
               "provider CPU ms/job", "peak RSS MiB", "POSTs"]
    out = []
    for mode, n, results in rows:
        plain_rate = n / results["plain"]["elapsed"]
        for phase in ("plain", "durable"):
            r = results[phase]
            rate = n / r["elapsed"]
            lat = r["latencies"]
            out.append([
                mode, n, phase, f"{rate:.0f}",
                f"{rate / plain_rate:.2f}" if phase == "durable" else "",
                f"{r['commits'] / n:.3f}" if "commits" in r else "",
                f"{r['writes'] / n:.1f}" if "writes" in r else "",
                _common.ms(_common.percentile(lat, 50)), _common.ms(_common.percentile(lat, 99)),
                f"{r['cpu'] / n * 1000:.2f}", f"{r['loop_cpu'] / n * 1000:.2f}",
                f"{r['thread_cpu'] / n * 1000:.2f}", f"{r['gc_cpu'] / n * 1000:.2f}",
                f"{sum(r['switches']) / n:.1f}",
                f"{r['provider_cpu'] / (n + warmup) * 1000:.2f}",
                f"{r['rss_mib']:.0f}", r["posts"],
            ])
    print(_common.table(headers, out))
    for mode, n, results in rows:
        for phase in ("plain", "durable"):
            seconds, counts = results[phase]["gc_by_generation"]
            by_generation = ", ".join(
                f"gen{g} {counts[g]} collections {seconds[g] * 1000:.0f} ms" for g in range(3)
            )
            print(f"cyclic GC over the whole {phase} worker ({mode}, N={n}, warm-up "
                  f"included): {by_generation}")


if __name__ == "__main__":
    main()
