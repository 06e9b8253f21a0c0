"""Comparative harness (issue 7): the same N structured jobs through four systems.

Run:  python bench/harness.py [--quick] [--n 5000] [--concurrency 1000]
                              [--mode websocket|sse] [--faults SPEC]
                              [--system durable --system plain ...] [--soak-kills 8]
                              [--out bench/results/harness.md] [--no-png]

  (a) durable  recoverable: prepare + send_recovering + host commit + acknowledge
               on a fresh LMDB store (group commit);
  (b) plain    the same ``ResponsesBackend.stream`` of the same frozen body, with
               in-memory replacement and validation, nothing durable (the floor);
  (c) dbos     DBOS Transact 3.x on its SQLite system database: one workflow per
               job holding one step that streams through the same backend
               (``bench/baselines/dbos_runner.py`` says exactly how);
  (d) files    one JSON file per record: temp file + fsync + atomic rename +
               directory fsync at every durable point (``bench/baselines/file_store.py``).

The fixture provider runs in a SEPARATE process, once without faults, once
with ``--faults`` (default ``disconnect=0.05,rate_limited=0.05,seed=1``) and once
for the realistic scenario (``--realistic 200:500``: answers of ~1,400 characters, each
streamed in 200-500 delta events, no faults; the tiny scenarios stream 4). Every
(scenario, system) runs in its own fresh worker process (so peak RSS is per
system) after an untimed warm-up of as many jobs as the concurrency (so that every
timed window starts with all its connections open; concurrency/4 until 2026-12-01).
(a), (c) and (d) make the same host commit per job: a line in a group-committed, fsynced
JSON-lines log. DBOS needs ``pip install -e '.[bench]'``; without it (c) is reported as
not installed.

Duplicates after random kills are measured for (a) only, with the crash soak
driver (``tests/crash/soak_driver.py``: a host SIGKILLed at random moments,
restarted, invariants checked against the provider's request log).

Prints one table and writes it (with the run's parameters) to ``--out``, plus a
PNG bar chart next to it when matplotlib is installed. The table has the CPU share
(percent of one core over the timed window) of the worker process and of the
provider process (``/proc/<pid>/stat`` utime + stime read at the edges of the
window), so a reader can see which side is bound.

``--quick``: a smoke run of a few seconds through the same path (N=50,
concurrency 25, the faults and realistic scenarios (the latter streamed in 20-50 deltas),
every system, a 10-job crash soak with 1 kill);
it writes no results file unless ``--out`` is given. Without the ``bench`` extra
(DBOS, matplotlib) the DBOS row and the PNG are skipped and the output says so.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
from baselines import (
    ACCOUNT,
    FAST,
    MAX_ATTEMPTS,
    Answer,
    TrioHostLog,
    commit_line,
    make_backend,
    request_for,
    result_record,
    run_pool,
)

import recoverable

BENCH = Path(__file__).resolve().parent
SYSTEMS = ("durable", "plain", "dbos", "files")
LABELS = {
    "durable": "(a) recoverable",
    "plain": "(b) plain stream",
    "dbos": "(c) DBOS/SQLite",
    "files": "(d) JSON files",
}
REALISTIC_ANSWER_CHARS = 1400
DEFAULT_FAULTS = "disconnect=0.05,rate_limited=0.05,seed=1"


class WindowCpu:
    """``cpu_seconds`` for a phase: this process's CPU seconds, and at the same moments
    the provider process's. Every phase calls it exactly twice, at the edges of its
    timed window, so the first and last provider readings bound that window too."""

    def __init__(self, provider_pid: int | None) -> None:
        self.provider_pid = provider_pid
        self.provider: list[float] = []

    def __call__(self) -> float:
        if self.provider_pid:
            self.provider.append(_common.process_cpu_seconds(self.provider_pid))
        return _common.self_cpu_seconds()

    def provider_seconds(self) -> float | None:
        if len(self.provider) != 2:
            return None
        return self.provider[1] - self.provider[0]


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


# -- (a): recoverable ------------------------------------------------------------


async def durable_phase(
    *, base_url: str, mode: str, n: int, concurrency: int, warmup: int, workdir: str,
    cpu_seconds: Any, rss_mib: Any, posts: Any, store_location: str | None = None,
) -> dict[str, Any]:
    # ``store_location``: a PostgreSQL URL (bench/pg_store.py); default LMDB in workdir.
    store = recoverable.RecoveryStore.open(store_location or os.path.join(workdir, "store"))
    backend = make_backend(base_url, mode)
    host = TrioHostLog(os.path.join(workdir, "host.log"))
    failed = 0
    try:
        async with (
            backend,
            recoverable.open_runtime(store, backend, account=ACCOUNT) as rt,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(host.run)

            async def job(i: int) -> None:
                nonlocal failed
                handle = await rt.prepare(
                    request_for(i), response=Answer, maximum_attempts=MAX_ATTEMPTS,
                    retry_policy=FAST, job_id=f"job-{i}", input_revision="r1",
                )
                try:
                    value = await rt.send_recovering(handle, response=Answer, authorize=approve)
                except recoverable.RecoveryError:
                    failed += 1  # a typed terminal failure (budget spent, not replaceable)
                    await rt.abandon(handle)
                    return
                assert isinstance(value, Answer)
                await host.commit(commit_line(i, value, handle.operation_id))
                await rt.acknowledge(handle)

            await run_pool(warmup, concurrency, job, offset=n)
            failed = 0
            before = store.stats()
            host0 = host.file.fsyncs
            posts0 = posts()
            cpu0 = cpu_seconds()
            elapsed, latencies = await run_pool(n, concurrency, job)
            cpu = cpu_seconds() - cpu0
            post_count = posts() - posts0
            after = store.stats()
            pending = store.inventory(account=ACCOUNT)[0]
            assert not pending, f"{len(pending)} operations left unacknowledged"
            nursery.cancel_scope.cancel()
    finally:
        host.file.close()
        store.close()
    return result_record(
        elapsed, latencies, cpu, rss_mib(), posts=post_count, failed=failed,
        fsyncs=after["commits"] - before["commits"], writes=after["writes"] - before["writes"],
        host_fsyncs=host.file.fsyncs - host0,
    )


# -- worker process ----------------------------------------------------------------


def provider_post_count(requests_url: str) -> int:
    r = httpx.get(requests_url, timeout=120)
    r.raise_for_status()
    return len(r.json())


def worker_main(args: argparse.Namespace) -> None:
    _common.raise_fd_limit()
    window_cpu = WindowCpu(args.provider_pid)
    kwargs: dict[str, Any] = {
        "base_url": args.base_url, "mode": args.mode, "n": args.n,
        "concurrency": args.concurrency, "warmup": args.warmup, "workdir": args.dir,
        "cpu_seconds": window_cpu, "rss_mib": _common.peak_rss_mib,
    }
    # POSTs of the timed window: the warm-up is counted separately and subtracted.
    if args.worker == "dbos":
        try:
            from baselines import dbos_runner
        except ImportError as exc:
            print(json.dumps({"missing": f"dbos is not installed ({exc})"}), flush=True)
            return
        result = dbos_runner.run(**kwargs, posts=lambda: provider_post_count(args.requests_url))
    else:
        if args.worker == "durable":
            # A PostgreSQL store when bench/pg_store.py asks for one (default: LMDB).
            phase = functools.partial(
                durable_phase, store_location=os.environ.get("BENCH_STORE_LOCATION")
            )
        elif args.worker == "plain":
            from baselines import plain

            phase = plain.phase
        else:
            from baselines import file_store

            phase = file_store.phase
        result = trio.run(
            lambda: phase(**kwargs, posts=lambda: provider_post_count(args.requests_url))
        )
    result["provider_cpu"] = window_cpu.provider_seconds()
    print(json.dumps(result), flush=True)


def run_worker(system: str, args: argparse.Namespace, info: dict[str, Any],
               warmup: int, workdir: str, strace_out: str | None = None,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    argv = [
        sys.executable, __file__, "--worker", system, "--mode", args.mode, "--n", str(args.n),
        "--concurrency", str(args.concurrency), "--warmup", str(warmup),
        "--base-url", info["base_url"], "--requests-url", info["requests_url"], "--dir", workdir,
        "--provider-pid", str(info["pid"]),
    ]
    if strace_out:
        argv = ["strace", "-f", "-c", "-o", strace_out, "-e", f"trace={','.join(SYNC_CALLS)}",
                *argv]
    proc = subprocess.run(argv, capture_output=True, text=True,
                          env={**_common.child_env(), **(env or {})}, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} worker failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# -- syscall-level fsync counts (strace) ------------------------------------------------

SYNC_CALLS = ("fsync", "fdatasync", "msync", "sync_file_range")


def parse_strace_counts(path: str) -> dict[str, int]:
    """Calls per syscall from an ``strace -c`` summary."""
    counts: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[-1] in SYNC_CALLS and parts[3].isdigit():
            counts[parts[-1]] = int(parts[3])
    return counts


def count_fsyncs(args: argparse.Namespace, systems: list[str], warmup: int) -> list[list[str]]:
    """Marginal sync syscalls per job: two runs (n and 4n) under strace, the difference.

    Differencing removes the fixed costs (store creation, DBOS migrations, warm-up);
    what is left is what one more job costs. strace slows everything: no timings here.
    """
    if shutil.which("strace") is None:
        raise SystemExit("--count-fsyncs needs strace (apt-get install strace)")
    small, large = args.n, 4 * args.n
    rows = []
    base = tempfile.mkdtemp(prefix="harness-strace-")
    try:
        with _common.provider_process(None) as info:
            for system in systems:
                totals = []
                for n in (small, large):
                    workdir = tempfile.mkdtemp(prefix=f"{system}-", dir=base)
                    out = os.path.join(base, f"{system}-{n}.strace")
                    run_args = argparse.Namespace(**{**vars(args), "n": n})
                    result = run_worker(system, run_args, info, warmup, workdir, out)
                    if "missing" in result:
                        break
                    totals.append(parse_strace_counts(out))
                if len(totals) != 2:
                    rows.append([LABELS[system], "not installed", "", "", ""])
                    continue
                per_job = {c: (totals[1].get(c, 0) - totals[0].get(c, 0)) / (large - small)
                           for c in SYNC_CALLS}
                rows.append([LABELS[system]] + [f"{per_job[c]:.2f}" for c in SYNC_CALLS[:3]]
                            + [f"{sum(per_job.values()):.2f}"])
                print(f"  strace {system}: {rows[-1]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows


# -- duplicates after random kills (recoverable only) -------------------------------


def without_seed(spec: str) -> str:
    """``run_soak`` appends its own seed."""
    return ",".join(p for p in spec.split(",") if not p.strip().startswith("seed="))


def soak_duplicates(
    jobs: int, concurrency: int, kills: int, faults: str, idle_timeout: float = 3.0
) -> dict[str, Any]:
    sys.path.insert(0, str(BENCH.parent))
    from tests.crash.soak_driver import run_soak

    workdir = Path(tempfile.mkdtemp(prefix="harness-soak-"))
    try:
        result = run_soak(workdir, jobs=jobs, concurrency=concurrency, kills=kills,
                          faults=without_seed(faults), seed=1, idle_timeout=idle_timeout,
                          deadline=900.0)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"jobs": result.jobs, "kills": result.kills, "committed": result.committed,
            "failed": result.failed, "duplicates": result.duplicates, "lost": result.lost,
            "posts": result.posts, "violations": list(result.violations),
            "seconds": result.seconds}


# -- orchestration ---------------------------------------------------------------------


HEADERS = ["scenario", "system", "jobs/s", "ratio to (a)", "p50 ms", "p99 ms",
           "store fsyncs/job", "host fsyncs/job", "peak RSS MiB", "POSTs/job", "failed jobs",
           "duplicates after kills", "worker CPU % core", "provider CPU % core"]


def cpu_share(seconds: float | None, elapsed: float) -> str:
    """CPU seconds over the timed window as a percentage of one core."""
    return "n/a" if seconds is None else f"{100.0 * seconds / elapsed:.0f}"


def fsyncs_cell(system: str, r: dict[str, Any], n: int) -> str:
    if system == "durable":
        return f"{r['fsyncs'] / n:.3f}"
    if system == "files":
        return f"{r['fsyncs'] / n:.1f}"
    if system == "dbos":
        # SQLite in rollback-journal mode with synchronous=FULL: 3 fdatasync per commit
        # (journal twice, then the database), as --count-fsyncs measured with strace.
        return f"~{3 * r['sqlite_commits'] / n:.1f} ({r['sqlite_commits'] / n:.1f} commits)"
    return "0"


def build_rows(results: dict[tuple[str, str], dict[str, Any]], n: int,
               soak: dict[str, Any] | None) -> list[list[str]]:
    rows = []
    for (scenario, system), r in results.items():
        if "missing" in r:
            rows.append([scenario, LABELS[system], r["missing"]] + [""] * (len(HEADERS) - 3))
            continue
        rate = n / r["elapsed"]
        base = results.get((scenario, "durable"), {})
        ratio = (rate / (n / base["elapsed"])) if "elapsed" in base else math.nan
        if system == "durable":
            dup = (f"{soak['duplicates']} ({soak['kills']} kills, {soak['jobs']} jobs)"
                   if soak else "not measured")
        elif system == "plain":
            dup = "n/a (not durable)"
        else:
            dup = "not measured"
        rows.append([
            scenario, LABELS[system], f"{rate:.0f}",
            "1.00" if system == "durable" else f"{ratio:.3f}",
            _common.ms(_common.percentile(r["latencies"], 50)),
            _common.ms(_common.percentile(r["latencies"], 99)),
            fsyncs_cell(system, r, n),
            f"{r['host_fsyncs'] / n:.3f}" if "host_fsyncs" in r else "0",
            f"{r['rss_mib']:.0f}", f"{r['posts'] / n:.3f}", str(r["failed"]), dup,
            cpu_share(r["cpu"], r["elapsed"]), cpu_share(r.get("provider_cpu"), r["elapsed"]),
        ])
    return rows


def target_lines(results: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    """The issue's targets: (a) >= 0.8 x (b) and >= 20 x (c) in jobs/s."""
    lines = []
    for scenario in dict.fromkeys(s for s, _ in results):
        a = results.get((scenario, "durable"), {})
        if "elapsed" not in a:
            continue
        parts = []
        for other, target in (("plain", 0.95 if scenario == "realistic" else 0.8),
                              ("dbos", 20.0)):
            r = results.get((scenario, other), {})
            if "elapsed" in r:
                ratio = r["elapsed"] / a["elapsed"]
                verdict = "met" if ratio >= target else "NOT met"
                parts.append(f"(a)/({'b' if other == 'plain' else 'c'}) = {ratio:.2f}"
                             f" (target >= {target:g}: {verdict})")
        if parts:
            lines.append(f"{scenario}: " + "; ".join(parts))
    return lines


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_png(results: dict[tuple[str, str], dict[str, Any]], n: int, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    scenarios = sorted({s for s, _ in results}, key=lambda s: s != "no faults")
    systems = [s for s in SYSTEMS if any((sc, s) in results for sc in scenarios)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(scenarios))
    for k, scenario in enumerate(scenarios):
        rates = [
            n / results[(scenario, s)]["elapsed"]
            if "elapsed" in results.get((scenario, s), {}) else 0.0
            for s in systems
        ]
        xs = [x + k * width for x in range(len(systems))]
        bars = ax.bar(xs, rates, width, label=scenario)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([x + width * (len(scenarios) - 1) / 2 for x in range(len(systems))])
    ax.set_xticklabels([LABELS[s] for s in systems])
    ax.set_ylabel("jobs/s")
    ax.set_title(f"{n} structured jobs, provider in a separate process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, help="jobs per run (default 5000; quick 50)")
    parser.add_argument("--concurrency", type=int, default=None, help="1000; quick 25")
    parser.add_argument("--mode", choices=["websocket", "sse"], default="websocket")
    parser.add_argument("--faults", default=DEFAULT_FAULTS,
                        help="fault spec of the second scenario ('' to skip it)")
    parser.add_argument("--system", action="append", choices=SYSTEMS,
                        help="systems to run (repeatable; default all)")
    parser.add_argument("--soak-jobs", type=int, help="crash soak jobs (default 1000; quick 10)")
    parser.add_argument("--soak-kills", type=int, help="SIGKILLs in the soak (default 20; quick 1)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run of a few seconds through the same path (no file)")
    parser.add_argument("--out", default=None,
                        help="results file (default bench/results/harness.md; quick: none)")
    parser.add_argument("--realistic", default=None, metavar="LOW:HIGH",
                        help="the realistic scenario: ~1,400-character answers streamed in "
                        "LOW..HIGH delta events, no faults ('' to skip it; default 200:500; "
                        "quick 20:50)")
    parser.add_argument("--no-png", action="store_true")
    parser.add_argument("--count-fsyncs", action="store_true",
                        help="instead: count sync syscalls per job under strace (runs n and 4n, "
                             "no faults; default n=250) and write bench/results/harness_fsyncs.md")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed jobs first, at the same concurrency (default: the "
                        "concurrency, so every connection is open when the window starts)")
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--requests-url", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--provider-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.concurrency is None:
        args.concurrency = 25 if args.quick else 1000
    if args.out is None and not args.quick:
        args.out = str(BENCH / "results" / "harness.md")
    if args.worker:
        worker_main(args)
        return
    if args.count_fsyncs:
        args.n = args.n or 250
        warmup = args.warmup if args.warmup is not None else max(1, args.concurrency // 4)
        rows = count_fsyncs(args, args.system or list(SYSTEMS), warmup)
        headers = ["system", "fsync/job", "fdatasync/job", "msync/job", "all sync calls/job"]
        title = (f"sync syscalls per job (strace -f -c, marginal: runs of {args.n} and "
                 f"{4 * args.n} jobs, concurrency {args.concurrency}, {args.mode}, no faults)")
        print(title)
        print(_common.table(headers, rows))
        out = Path(args.out or BENCH / "results" / "harness.md").with_name("harness_fsyncs.md")
        out.write_text("\n".join([
            "# Sync syscalls per job (bench/harness.py --count-fsyncs)", "", title, "",
            "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(r) + " |" for r in rows), "",
        ]))
        print(f"wrote {out}")
        return
    args.n = args.n or (50 if args.quick else 5000)
    if args.realistic is None:
        args.realistic = "20:50" if args.quick else "200:500"
    soak_jobs = args.soak_jobs or (10 if args.quick else 1000)
    soak_kills = args.soak_kills if args.soak_kills is not None else (1 if args.quick else 20)
    # As many untimed jobs as the concurrency, for every system: each timed window starts
    # with all its connections open (the steady state of a long-running host).
    warmup = args.warmup if args.warmup is not None else args.concurrency
    systems = args.system or list(SYSTEMS)
    # (name, provider faults, more provider options, worker environment)
    scenarios: list[tuple[str, str | None, list[str], dict[str, str]]] = [
        ("no faults", None, [], {})
    ]
    if args.faults:
        scenarios.append(("faults", args.faults, [], {}))
    if args.quick and len(scenarios) == 2:
        # One provider process and three workers fewer: the faults scenario runs every
        # line the no-faults one does, plus the replacements.
        scenarios = scenarios[1:]
    if args.realistic:
        # Answers of ~1,400 characters streamed in 200-500 deltas (what real structured
        # answers stream), no faults: where the per-event work dilutes the durable cost.
        scenarios.append(("realistic", None, ["--deltas", args.realistic],
                          {"RECOVERABLE_BENCH_ANSWER_CHARS": str(REALISTIC_ANSWER_CHARS)}))
    started = time.monotonic()
    results: dict[tuple[str, str], dict[str, Any]] = {}
    base = tempfile.mkdtemp(prefix="harness-")
    try:
        for scenario, faults, provider_extra, env in scenarios:
            with _common.provider_process(faults, provider_extra) as info:
                for system in systems:
                    if system == "dbos" and importlib.util.find_spec("dbos") is None:
                        # No worker process just to find the import missing.
                        results[(scenario, system)] = {"missing": "dbos is not installed"}
                        continue
                    workdir = tempfile.mkdtemp(prefix=f"{system}-", dir=base)
                    t0 = time.monotonic()
                    results[(scenario, system)] = run_worker(system, args, info, warmup, workdir,
                                                             env=env)
                    print(f"  {scenario:>9} {system:>8}: {time.monotonic() - t0:.1f} s",
                          file=sys.stderr, flush=True)
                    shutil.rmtree(workdir, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    soak = None
    if "durable" in systems and soak_kills > 0:
        t0 = time.monotonic()
        soak = soak_duplicates(soak_jobs, min(100, soak_jobs), soak_kills,
                               args.faults or DEFAULT_FAULTS,
                               idle_timeout=1.0 if args.quick else 3.0)
        print(f"  soak: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    rows = build_rows(results, args.n, soak)
    title = (f"N={args.n} jobs, concurrency {args.concurrency}, {args.mode}, warm-up {warmup}, "
             f"faults scenario: {args.faults or 'none'}")
    print(title)
    print(_common.table(HEADERS, rows))
    targets = target_lines(results)
    for line in targets:
        print(line)
    if soak:
        print(f"soak: {soak}")
    for (scenario, system), r in results.items():
        if "missing" in r:
            print(f"skipped {LABELS[system]} ({scenario}): {r['missing']}; "
                  "pip install -e '.[bench]' for it")
    if args.out is None:
        print("no results file written (--quick; give --out to keep one)")
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    has_png = not args.no_png and write_png(results, args.n, png)
    if not args.no_png and not has_png:
        print("no PNG: matplotlib is not installed (pip install -e '.[bench]')")
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    text = [
        "# Comparative harness (bench/harness.py)", "",
        f"Command: `python bench/harness.py {' '.join(sys.argv[1:])}`".replace("  ", " "), "",
        f"{title}; machine: {machine}; total {time.monotonic() - started:.0f} s.", "",
        markdown_table(rows), "",
        *(f"- {line}" for line in targets), "",
        "Store fsyncs/job: (a) LMDB commits per job (group commit; each commit is one "
        "fdatasync plus an O_DSYNC meta-page write); (c) estimated from counted SQLite "
        "commits; (d) counted. `python bench/harness.py --count-fsyncs` counts the sync "
        "syscalls with strace (bench/results/harness_fsyncs.md).", "",
    ]
    if soak:
        text += [f"Crash soak for (a): {soak['jobs']} jobs, {soak['kills']} SIGKILLs, "
                 f"committed {soak['committed']}, failed {soak['failed']}, duplicates "
                 f"{soak['duplicates']}, lost {soak['lost']}, POSTs {soak['posts']}, "
                 f"violations {len(soak['violations'])}, {soak['seconds']:.0f} s.", ""]
    if has_png:
        text += [f"![jobs/s]({png.name})", ""]
    out.write_text("\n".join(text))
    print(f"wrote {out}" + (f" and {png}" if has_png else ""))


if __name__ == "__main__":
    main()
