"""Jobs/s of ``recoverable batch --workers N`` (N worker processes) vs today's in-process
path (``--workers 0``), in the same run, against one fixture provider in its own process.

Run:  python bench/workers.py [--jobs 2000] [--workers 0 --workers 1 --workers 2]
                              [--concurrency 64] [--mode websocket|sse] [--kills K] [--quick]

For each N the same jobs file runs as a real ``recoverable batch`` process on a fresh store,
with ``--endpoint`` the provider's URL. Reported per N: wall time (process start to exit,
workers' start-up included), the batch's own elapsed time and jobs/s, the ratio to
``--workers 0``, the POSTs the provider saw and the lines committed. ``--kills K`` SIGKILLs
K worker processes during each ``--workers N > 0`` run (at seeded moments of progress) to
show the cost of adoption; POSTs then exceed the jobs by the attempts interrupted.

Leases and their heartbeat run on every path (``--workers 0`` included): one renewal
write per runtime every ``lease_seconds/3``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

SCHEMA = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": ["a", "b"]},
                   "score": {"type": "integer", "minimum": 0, "maximum": 10}},
    "required": ["label", "score"],
    "additionalProperties": False,
}
KEY_ENV = "BENCH_WORKERS_KEY"


def write_jobs(path: Path, count: int) -> None:
    with path.open("w") as fh:
        for i in range(count):
            fh.write(json.dumps({
                "id": f"job-{i:05d}", "revision": "r1", "model": "gpt-bench",
                "instructions": "Label the text.", "input": f"text number {i}",
                "schema": SCHEMA, "schema_name": "label",
            }) + "\n")


def worker_pids(parent: int) -> list[int]:
    found = []
    for pid in _common.child_pids(parent):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        if b"\0worker\0" in cmdline:
            found.append(pid)
    return found


def lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def run_batch(
    info: dict[str, Any], workers: int, jobs: int, args: argparse.Namespace, seed: int,
    store: str | None = None,
) -> dict[str, Any]:
    """One ``recoverable batch`` run; ``store``: a PostgreSQL URL (bench/pg_store.py),
    default a fresh LMDB directory."""
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp:
        root = Path(tmp)
        write_jobs(root / "jobs.jsonl", jobs)
        out = root / "out.jsonl"
        argv = [
            sys.executable, "-m", "recoverable", "batch", str(root / "jobs.jsonl"),
            "--out", str(out), "--store", store or str(root / "store"), "--endpoint",
            info["http_url"], "--api-key-env", KEY_ENV, "--mode", args.mode,
            "--concurrency", str(args.concurrency), "--workers", str(workers),
        ]
        if workers and args.kills:
            argv += ["--worker-restarts", str(args.kills + 4)]
        before = len(_common.provider_requests(info))
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, KEY_ENV: "sk-bench"})
        kills = 0
        if workers and args.kills:
            rng = random.Random(seed)
            for threshold in sorted(rng.sample(range(jobs // 10, jobs * 8 // 10), args.kills)):
                while lines(out) < threshold and proc.poll() is None:
                    time.sleep(0.005)  # polling the output file (a progress barrier)
                pids = worker_pids(proc.pid)
                if proc.poll() is not None or not pids:
                    break
                os.kill(rng.choice(pids), signal.SIGKILL)
                kills += 1
        stdout, stderr = proc.communicate(timeout=3600)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"batch --workers {workers} exited {proc.returncode}:\n"
                               f"{stderr[-3000:]}")
        elapsed = float(re.search(r"^elapsed\s+([\d.]+) s", stdout, re.M).group(1))  # type: ignore[union-attr]
        posts = len(_common.provider_requests(info)) - before
        return {"workers": workers, "jobs": jobs, "wall": wall, "elapsed": elapsed,
                "jobs_per_s": jobs / elapsed if elapsed > 0 else 0.0,
                "posts": posts, "committed": lines(out), "kills": kills}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--workers", type=int, action="append")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--mode", choices=("websocket", "sse"), default="websocket")
    parser.add_argument("--kills", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="50 jobs (the suite's check)")
    args = parser.parse_args()
    jobs = 50 if args.quick else args.jobs
    counts = args.workers or [0, 1, 2]
    print(f"{jobs} jobs per run, --concurrency {args.concurrency}, {args.mode}, "
          f"{os.cpu_count()} cores, provider in its own process"
          + (f", {args.kills} worker SIGKILL(s) per run" if args.kills else ""))
    rows = []
    with _common.provider_process() as info:
        for index, workers in enumerate(counts):
            rows.append(run_batch(info, workers, jobs, args, seed=index))
    base = next((r for r in rows if r["workers"] == 0), None)
    print(f"{'workers':>7} {'jobs':>6} {'wall s':>7} {'batch s':>8} {'jobs/s':>8} "
          f"{'vs 0':>6} {'POSTs':>6} {'lines':>6} {'kills':>5}")
    for r in rows:
        ratio = r["jobs_per_s"] / base["jobs_per_s"] if base and base["jobs_per_s"] else 0.0
        print(f"{r['workers']:>7} {r['jobs']:>6} {r['wall']:>7.2f} {r['elapsed']:>8.2f} "
              f"{r['jobs_per_s']:>8.1f} {ratio:>6.2f} {r['posts']:>6} {r['committed']:>6} "
              f"{r['kills']:>5}")
    if base is not None:
        for r in rows:
            if r["workers"]:
                print(f"ratio --workers {r['workers']} / --workers 0 = "
                      f"{r['jobs_per_s'] / base['jobs_per_s']:.2f}")


if __name__ == "__main__":
    main()
