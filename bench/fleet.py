"""The fleet, latency-bound: ``recoverable batch --workers N`` on LMDB and PostgreSQL.

Run:  python bench/fleet.py [--jobs 3000] [--concurrency 128] [--reply-delay 0.5]
                            [--db-delay-ms 1] [--stop-seconds 10] [--mode websocket|sse]
                            [--quick]

One fixture provider process holding every generation ``--reply-delay`` seconds (so a
worker's ``--concurrency`` slots, not the CPU, should bound it: the ceiling is
``concurrency / reply_delay`` jobs/s per worker) and one throwaway PostgreSQL cluster
(``tests/pg/cluster.py``, fsync on, 127.0.0.1) serve every row, so the ratios are from one
run on one machine. Each row is a real ``recoverable batch`` process on a fresh store
(a fresh LMDB directory, or a fresh database):

1. LMDB and PostgreSQL, ``--workers 0`` (in-process), ``1`` and ``2``;
2. PostgreSQL through ``bench/_delay_proxy.py`` (``--db-delay-ms`` each way: every round
   trip to the database costs twice that more), ``--workers 1`` and ``2``;
3. PostgreSQL ``--workers 2`` with one worker SIGSTOPped for ``--stop-seconds`` once a
   fifth of the results are written: the results written per second during the stop
   against half the rate of the 5 s before it (the stopped worker's share gone, the other
   worker's kept: 1.00 means the other worker did not notice); and each other owner's
   (the batch host's, the other worker's) commits per second during the stop against the
   5 s before (``recoverable_txn_log``: the lowest is printed), and how much of the stop
   a stopped session held the writers' lock. This row runs enough jobs
   that the other worker still has work when the stop ends (both workers' ceiling through
   the stop and the 5 s before it, and half again); a run that drained anyway says so.

Printed: jobs/s per row; where each row's CPU went, per job (the batch process with its
workers, the database server's processes, the provider; Linux ``/proc`` and the reaped
children's rusage) and the share of the machine's cores they kept busy over the run (near
100%: the row is bound by the CPU, not by the slots); and the ratios the fleet store is
held to (``docs/benchmarks.md``):
PostgreSQL ``--workers 2`` / ``--workers 1``, PostgreSQL / LMDB at ``--workers 1``, the same
through the proxy, and the stop ratio. The round-trip time through the proxy is measured
and printed beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common
import workers

from tests.pg.cluster import Cluster, start_cluster
from tests.pg.fixtures import TEMPLATE, _prepare_template, new_database

HERE = Path(__file__).resolve().parent
CORES = os.cpu_count() or 1


@contextmanager
def delay_proxy(cluster: Cluster, delay_ms: float) -> Iterator[int]:
    """``bench/_delay_proxy.py`` in front of the cluster; yields its port."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_delay_proxy.py"), "--target",
         f"{cluster.host}:{cluster.port}", "--delay-ms", str(delay_ms)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the delay proxy exited with {proc.wait()}")
        yield int(json.loads(line)["port"])
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def server_cpu_seconds(cluster: Cluster | None) -> float:
    """The CPU seconds the PostgreSQL server has used so far: its postmaster's, with the
    backends it reaped, and each live process it started (Linux ``/proc``)."""
    if cluster is None:
        return 0.0
    postmaster = int((cluster.data / "postmaster.pid").read_text().split()[0])
    total = _common.process_cpu_seconds(postmaster, children=True)
    for pid in _common.child_pids(postmaster):
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            total += _common.process_cpu_seconds(pid)
    return total


def children_cpu_seconds() -> float:
    """CPU seconds of this process's reaped children (and theirs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def round_trip_ms(url: str, count: int = 200) -> float:
    """The median time of ``SELECT 1`` on one connection (ms)."""
    with psycopg.connect(url, autocommit=True) as conn:
        samples = []
        for _ in range(count):
            started = time.perf_counter()
            conn.execute("SELECT 1").fetchone()
            samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000.0


def run(
    info: dict[str, Any], args: argparse.Namespace, workers_count: int, store: str | None,
    *, stop: bool = False, cluster: Cluster | None = None,
) -> dict[str, Any]:
    """One ``recoverable batch`` run (see the module doc); ``stop``: the SIGSTOP row."""
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        root = Path(tmp)
        workers.write_jobs(root / "jobs.jsonl", args.jobs)
        out = root / "out.jsonl"
        argv = [
            sys.executable, "-m", "recoverable", "batch", str(root / "jobs.jsonl"),
            "--out", str(out), "--store", store or str(root / "store"), "--endpoint",
            info["http_url"], "--api-key-env", workers.KEY_ENV, "--mode", args.mode,
            "--concurrency", str(args.concurrency), "--workers", str(workers_count),
        ]
        before = len(_common.provider_requests(info))
        cpu_before = (children_cpu_seconds(), server_cpu_seconds(cluster),
                      _common.process_cpu_seconds(info["pid"]))
        started = time.monotonic()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, workers.KEY_ENV: "sk-bench"})
        stopped: dict[str, float] = {}
        if stop:
            assert store is not None
            stopped = stop_one_worker(proc, out, args, store)
        stdout, stderr = proc.communicate(timeout=3600)
        wall = time.monotonic() - started
        cpu = (children_cpu_seconds() - cpu_before[0],  # the batch, its workers included
               server_cpu_seconds(cluster) - cpu_before[1],
               _common.process_cpu_seconds(info["pid"]) - cpu_before[2])
        if proc.returncode != 0:
            raise RuntimeError(f"batch --workers {workers_count} exited {proc.returncode}:\n"
                               f"{stderr[-3000:]}")
        found = re.search(r"^elapsed\s+([\d.]+) s", stdout, re.M)
        elapsed = float(found.group(1)) if found else wall
        return {
            "workers": workers_count, "jobs": args.jobs, "wall": wall, "elapsed": elapsed,
            "jobs_per_s": args.jobs / elapsed if elapsed > 0 else 0.0,
            "posts": len(_common.provider_requests(info)) - before,
            "lines": workers.lines(out), "cpu": cpu, "busy": sum(cpu) / (wall * CORES),
            **stopped,
        }


def _wait_lines(proc: subprocess.Popen[str], out: Path, count: int) -> None:
    while workers.lines(out) < count and proc.poll() is None:
        time.sleep(0.02)  # polling the output file (a progress barrier)


# The fleet's writers' lock (storage/pg_schema.py: LOCK_NAMESPACE, WRITER_LOCK) held by a
# session whose client sends nothing ("idle in transaction"): a stopped writer holding it.
_LOCK_IDLE = (
    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
    " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = 21061 AND l.objid = 0"
    " AND l.objsubid = 2 AND a.state = 'idle in transaction'"
)


class LockSampler:
    """Samples, every 50 ms on its own connection, whether a session idle in its
    transaction holds the writers' lock (the stall the stop row looks for)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._stop = threading.Event()
        self.samples = 0
        self.held = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with psycopg.connect(self._url, autocommit=True) as conn:
            while not self._stop.wait(0.05):
                row = conn.execute(_LOCK_IDLE).fetchone()
                self.samples += 1
                self.held += bool(row and row[0])

    def finish(self) -> float:
        """The share of the samples that found the lock held by an idle session."""
        self._stop.set()
        self._thread.join(timeout=10)
        return self.held / self.samples if self.samples else 0.0


def owner_commits(url: str) -> dict[str, int]:
    """Each owner's count of committed batches (``recoverable_txn_log``)."""
    with psycopg.connect(url, autocommit=True) as conn:
        return {str(owner): int(count) for owner, count in conn.execute(
            "SELECT owner_id, commits FROM recoverable_txn_log"
        )}


def others_commit_ratio(
    counts: tuple[dict[str, int], dict[str, int], dict[str, int]], before_s: float,
    during_s: float,
) -> float:
    """The lowest ratio, among the owners that kept committing (the batch host and the
    worker that was not stopped: all but the one whose commits fell the most), of their
    commits per second during the stop to those in the window before it."""
    c0, c1, c2 = counts
    rates = {
        owner: ((c1[owner] - c0[owner]) / before_s, (c2.get(owner, c1[owner]) - c1[owner])
                / during_s)
        for owner in c0 if owner in c1 and c1[owner] > c0[owner]
    }
    if len(rates) < 2:
        return float("nan")
    stopped = min(rates, key=lambda owner: rates[owner][1] / rates[owner][0])
    return min(during / before for owner, (before, during) in rates.items()
               if owner != stopped)


def stop_one_worker(
    proc: subprocess.Popen[str], out: Path, args: argparse.Namespace, store: str
) -> dict[str, float]:
    """SIGSTOP one worker for ``--stop-seconds`` once a fifth of the lines are written;
    the lines per second in the 5 s before and during the stop, and the share of the stop
    the writers' lock was held by an idle (stopped) session."""
    _wait_lines(proc, out, args.jobs // 5)
    t0, l0, c0 = time.monotonic(), workers.lines(out), owner_commits(store)
    time.sleep(5.0)  # the window before the stop (a measurement window, not a barrier)
    pids = workers.worker_pids(proc.pid)
    if proc.poll() is not None or not pids:
        return {}
    t1, l1, c1 = time.monotonic(), workers.lines(out), owner_commits(store)
    sampler = LockSampler(store)
    os.kill(pids[0], signal.SIGSTOP)
    try:
        time.sleep(args.stop_seconds)  # the stop itself
        t2, l2, c2 = time.monotonic(), workers.lines(out), owner_commits(store)
    finally:
        os.kill(pids[0], signal.SIGCONT)
        lock_held = sampler.finish()
    commit_ratio = others_commit_ratio((c0, c1, c2), t1 - t0, t2 - t1)
    before = (l1 - l0) / (t1 - t0)
    during = (l2 - l1) / (t2 - t1)
    # Work left for the other worker all through the stop, or the ratio measures a
    # drained queue, not a stall (the stopped worker's own operations wait for it).
    drained = l2 >= args.jobs - 2 * args.concurrency
    return {"before_per_s": before, "during_per_s": during, "drained": drained,
            "stop_ratio": during / (before / 2) if before else 0.0, "lock_held": lock_held,
            "commit_ratio": commit_ratio}


def stop_jobs(args: argparse.Namespace) -> int:
    """Jobs for the stop row: enough that the other worker, at both workers' ceiling,
    still has work when the stop ends (a fifth first, the 5 s before, the stop)."""
    ceiling = args.concurrency / args.reply_delay if args.reply_delay else 1000.0
    return max(args.jobs, int(2 * ceiling * (5 + args.stop_seconds) * 1.5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--reply-delay", type=float, default=0.5)
    parser.add_argument("--db-delay-ms", type=float, default=1.0)
    parser.add_argument("--stop-seconds", type=float, default=10.0)
    parser.add_argument("--mode", choices=("websocket", "sse"), default="websocket")
    parser.add_argument("--rows", default="plain,proxy,stop",
                        help="which rows: plain (LMDB and PostgreSQL at 0/1/2 workers), "
                        "proxy, stop (comma-separated)")
    parser.add_argument("--stores", default="lmdb,postgresql",
                        help="the plain rows' stores (comma-separated)")
    parser.add_argument("--workers", default="0,1,2",
                        help="the plain rows' worker counts (comma-separated)")
    parser.add_argument("--quick", action="store_true",
                        help="60 jobs at concurrency 16, no proxy or stop rows")
    args = parser.parse_args()
    wanted = set(args.rows.split(","))
    if args.quick:
        args.jobs, args.concurrency, args.reply_delay = 60, 16, 0.05
        wanted = {"plain"}
    _common.raise_fd_limit()
    cluster = start_cluster()
    rows: list[tuple[str, dict[str, Any]]] = []
    try:
        _prepare_template(cluster)
        direct_rtt = round_trip_ms(cluster.url())
        proxy_rtt = float("nan")
        with _common.provider_process(extra=["--reply-delay", str(args.reply_delay)]) as info:
            def add(kind: str, row: dict[str, Any]) -> None:
                rows.append((kind, row))
                print(f"  {kind} --workers {row['workers']}: {row['jobs_per_s']:.0f} jobs/s"
                      f" ({row['elapsed']:.1f} s)", flush=True)

            if "plain" in wanted:
                for kind in args.stores.split(","):
                    for count in (int(text) for text in args.workers.split(",")):
                        store = None if kind == "lmdb" else cluster.url(
                            new_database(cluster, TEMPLATE))
                        add(kind, run(info, args, count, store,
                                      cluster=None if store is None else cluster))
            if "proxy" in wanted:
                with delay_proxy(cluster, args.db_delay_ms) as port:
                    proxied = f"postgresql://{cluster.user}@127.0.0.1:{port}"
                    proxy_rtt = round_trip_ms(f"{proxied}/postgres")
                    for count in (1, 2):
                        dbname = new_database(cluster, TEMPLATE)
                        add("postgresql+delay", run(info, args, count, f"{proxied}/{dbname}",
                                                    cluster=cluster))
            if "stop" in wanted:
                store = cluster.url(new_database(cluster, TEMPLATE))
                stop_args = argparse.Namespace(**{**vars(args), "jobs": stop_jobs(args)})
                add("postgresql, 1 stopped", run(info, stop_args, 2, store, stop=True,
                                                 cluster=cluster))
    finally:
        cluster.stop()
    ceiling = args.concurrency / args.reply_delay if args.reply_delay else float("inf")
    print(f"{args.jobs} jobs, --concurrency {args.concurrency} per worker, reply delay "
          f"{args.reply_delay} s (ceiling {ceiling:.0f} jobs/s per worker), {args.mode}, "
          f"{os.cpu_count()} cores; round trip to the database {direct_rtt:.2f} ms direct, "
          f"{proxy_rtt:.2f} ms through the proxy")
    print(_common.table(
        ["store", "workers", "batch s", "jobs/s", "POSTs", "lines"],
        [[kind, r["workers"], f"{r['elapsed']:.2f}", f"{r['jobs_per_s']:.0f}", r["posts"],
          r["lines"]] for kind, r in rows],
    ))
    print("CPU per job (ms): the batch (host and workers), the database server, the provider;"
          " and the share of the machine's cores the three kept busy over the run")
    print(_common.table(
        ["store", "workers", "batch ms", "server ms", "provider ms", "total ms", "cores busy"],
        [[kind, r["workers"], *(f"{1000 * part / r['jobs']:.2f}" for part in r["cpu"]),
          f"{1000 * sum(r['cpu']) / r['jobs']:.2f}", f"{r['busy']:.0%}"] for kind, r in rows],
    ))
    rate = {(kind, r["workers"]): r["jobs_per_s"] for kind, r in rows if "stop_ratio" not in r}

    def ratio(top: tuple[str, int], bottom: tuple[str, int]) -> str:
        if top in rate and rate.get(bottom):
            return f"{rate[top] / rate[bottom]:.2f}"
        return "-"

    print(f"PostgreSQL --workers 2 / --workers 1 = {ratio(('postgresql', 2), ('postgresql', 1))}"
          " (target >= 1.6)")
    print(f"PostgreSQL / LMDB at --workers 1 = {ratio(('postgresql', 1), ('lmdb', 1))}"
          " (target >= 0.9)")
    print("PostgreSQL through the proxy, --workers 2 / --workers 1 = "
          f"{ratio(('postgresql+delay', 2), ('postgresql+delay', 1))} (target >= 1.5)")
    for _kind, r in rows:
        if "stop_ratio" in r:
            print(f"one of 2 workers stopped {args.stop_seconds:.0f} s: {r['during_per_s']:.0f} "
                  f"results/s during the stop, {r['before_per_s']:.0f}/s before (both): the "
                  f"other worker kept {r['stop_ratio']:.2f} of its share (target >= 0.80)"
                  + (" -- the queue drained during the stop: not a measure of a stall"
                     if r.get("drained") else "") + f"; {r['jobs']} jobs; the writers' lock "
                  f"held by an idle (stopped) session {r['lock_held']:.0%} of the stop")
            print("the other owners (the batch host, the other worker) committed, per second"
                  f" during the stop, at least {r['commit_ratio']:.2f} of their rate before"
                  " it (target >= 0.80)")


if __name__ == "__main__":
    main()
