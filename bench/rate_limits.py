"""Requests per minute at the provider under ``recoverable batch --workers N --rpm R``
(issue 29.6): the workers share one budget through the store's governor row, so the
fleet together must stay within R (the governor aims 5% below it).

Run:  python bench/rate_limits.py [--rpm 600] [--minutes 2] [--workers 2]
                                  [--burst 1 --burst 60] [--concurrency 32] [--quick]

For each ``--burst`` (``--rate-burst-seconds``), one real ``recoverable batch`` process on
a fresh LMDB store, with enough jobs to keep the fleet busy for ``--minutes`` at the
limit, against one fixture provider in its own process (its request log gives each
POST's arrival time). Reported per run: the POSTs, the span from the first arrival to the
last, the steady rate (the POSTs of the second half of the span, per minute: the refill
rate once the first bucket has gone) and the most POSTs the provider saw in any 60 s
window (when the run spans 60 s), each as a ratio to R. The bucket starts full: with a
burst of 60 s the first minute may hold up to 0.95 R + 0.95 R (the bucket, then its
refill; docs/rate-limits.md), so the per-minute bound R x 1.05 holds with a short burst
(the library's default of 5 s: 1.03 R; this script's default 1 s), and the second figure
of a 60 s burst shows the first minute's excess.

``--quick``: 5 s at R = 600 (about 60 jobs), one burst of 1 s; no 60 s window.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
from workers import KEY_ENV, write_jobs

MARGIN = 0.05  # the governor's (actors/governor.py RATE_MARGIN)


def most_in_window(arrivals: Sequence[float], window: float) -> int:
    times = sorted(arrivals)
    best = j = 0
    for i, t in enumerate(times):
        while times[j] <= t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def run(info: dict[str, Any], args: argparse.Namespace, burst: float, seconds: float
        ) -> dict[str, Any]:
    rate = args.rpm * (1 - MARGIN) / 60  # per second, as the governor aims
    bucket = rate * burst
    jobs = math.ceil(rate * seconds + bucket)
    with tempfile.TemporaryDirectory(prefix="bench-rate-") as tmp:
        root = Path(tmp)
        write_jobs(root / "jobs.jsonl", jobs)
        argv = [
            sys.executable, "-m", "recoverable", "batch", str(root / "jobs.jsonl"),
            "--out", str(root / "out.jsonl"), "--store", str(root / "store"),
            "--endpoint", info["http_url"], "--api-key-env", KEY_ENV, "--mode", args.mode,
            "--concurrency", str(args.concurrency), "--workers", str(args.workers),
            "--rpm", repr(args.rpm), "--rate-burst-seconds", repr(burst),
        ]
        before = len(_common.provider_requests(info))
        t0, started = time.monotonic(), time.time()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=3600,
                              env={**os.environ, KEY_ENV: "sk-bench"})
        wall = time.monotonic() - t0
        if done.returncode != 0:
            raise RuntimeError(f"batch exited {done.returncode}:\n{done.stderr[-3000:]}")
        committed = int(re.search(r"^committed \(this run\)\s+(\d+)", done.stdout,
                                  re.M).group(1))  # type: ignore[union-attr]
    arrivals = sorted(r["received_at"] for r in _common.provider_requests(info)[before:])
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    # The refill rate: the POSTs of the second half of the span, over its length. The
    # first bucket has gone by then (as long as the run outlasts the burst), and so have
    # the first POSTs of each worker, which open connections and may arrive late.
    middle = arrivals[0] + span / 2 if arrivals else 0.0
    second = [t for t in arrivals if t > middle]
    steady = len(second) / (span / 2) * 60 if span > 0 else 0.0
    print(f"burst {burst:g} s: batch process {wall:.1f} s, first POST after "
          f"{arrivals[0] - started:.1f} s, last {arrivals[-1] - started:.1f} s", flush=True)
    window = most_in_window(arrivals, 60.0) if span >= 60.0 else None
    return {"burst": burst, "jobs": jobs, "posts": len(arrivals), "committed": committed,
            "wall": wall, "span": span, "steady": steady, "window": window}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rpm", type=float, default=600.0)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--burst", type=float, action="append",
                        help="--rate-burst-seconds of a run (repeatable; default 1)")
    parser.add_argument("--concurrency", type=int, default=32, help="per worker")
    parser.add_argument("--mode", choices=("websocket", "sse"), default="websocket")
    parser.add_argument("--quick", action="store_true", help="5 s (the suite's check)")
    args = parser.parse_args()
    seconds = 5.0 if args.quick else args.minutes * 60
    bursts = [1.0] if args.quick else (args.burst or [1.0])
    print(f"batch --workers {args.workers} --rpm {args.rpm:g}, {seconds:g} s of work per run "
          f"at the limit, --concurrency {args.concurrency} per worker, {args.mode}, "
          f"{os.cpu_count()} cores, provider in its own process")
    with _common.provider_process(extra=["--reply-delay", "0.2"]) as info:
        rows = [run(info, args, burst, seconds) for burst in bursts]
    print(f"{'workers':>7} {'rpm':>7} {'burst s':>7} {'jobs':>6} {'POSTs':>6} {'lines':>6} "
          f"{'span s':>7} {'steady/min':>10} {'/rpm':>6} {'max 60s':>7} {'/rpm':>6}")
    for r in rows:
        window = "-" if r["window"] is None else str(r["window"])
        ratio = "-" if r["window"] is None else f"{r['window'] / args.rpm:.3f}"
        print(f"{args.workers:>7} {args.rpm:>7g} {r['burst']:>7g} {r['jobs']:>6} "
              f"{r['posts']:>6} {r['committed']:>6} {r['span']:>7.1f} {r['steady']:>10.1f} "
              f"{r['steady'] / args.rpm:>6.3f} {window:>7} {ratio:>6}")
    for r in rows:
        print(f"burst {r['burst']:g} s: steady rate / rpm = {r['steady'] / args.rpm:.3f}"
              + ("" if r["window"] is None else
                 f", max POSTs in any 60 s / rpm = {r['window'] / args.rpm:.3f}"))


if __name__ == "__main__":
    main()
