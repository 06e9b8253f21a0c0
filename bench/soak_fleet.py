"""Fleet soak: `recoverable batch --workers 2` stopped by random signals, rerun each time.

Run:  python bench/soak_fleet.py [--jobs 300] [--signals 20] [--seed 1]
                                 [--store lmdb|postgresql] [--bound 120] [--quick]

A fixture provider runs in its own process for the whole soak (with a reply delay and
random disconnects), so its request log counts every POST of every run. Each round starts
the same batch (`--workers 2`, the provider as `--endpoint`), waits a random moment (a
seeded RNG: between one and a few committed lines), then sends ONE random signal: SIGINT
or SIGTERM to the batch (a clean stop), SIGKILL to the batch, or SIGKILL to one of its
workers (then lets the batch go on to the next round's signal or its end). After every
stop it checks that no worker outlives its batch (within `--bound` seconds), then reruns.
A last run finishes the batch; no run may take longer than `--bound` seconds.

Checks (exit 1 on any violation): every job committed exactly once; POSTs per operation
within its budget, each attempt sent at most once, none after the receipt's attempt; no
worker process left; every run ended within the bound; a final rerun POSTs nothing.

``--quick``: 12 jobs, 2 signals, LMDB (the same path and checks).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.cli.cli_helpers import job_line, read_results, write_jobs  # noqa: E402
from tests.cli.test_batch_workers import worker_pids  # noqa: E402

KEY_ENV = "SOAK_FLEET_KEY"
MAX_ATTEMPTS = 8
SIGNALS = ("SIGINT", "SIGTERM", "SIGKILL batch", "SIGKILL worker")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECOVERABLE_KILL")}
    env[KEY_ENV] = "sk-soak-fleet"
    return env


def _committed(out: Path) -> int:
    try:
        return out.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _wait(predicate: Callable[[], Any], bound: float) -> bool:
    deadline = time.monotonic() + bound
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Soak:
    def __init__(self, workdir: Path, store: str, provider: dict[str, Any], jobs: int,
                 bound: float, log: Callable[[str], None]) -> None:
        self.workdir = workdir
        self.store = store
        self.provider = provider
        self.jobs = jobs
        self.bound = bound
        self.log = log
        self.out = workdir / "out.jsonl"
        self.violations: list[str] = []
        self.longest_run = 0.0
        self.runs = 0

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "recoverable", "batch", str(self.workdir / "jobs.jsonl"),
            "--out", str(self.out), "--store", self.store,
            "--endpoint", self.provider["http_url"], "--api-key-env", KEY_ENV,
            "--mode", "sse", "--concurrency", "8", "--max-attempts", str(MAX_ATTEMPTS),
            "--workers", "2", "--worker-restarts", "100", "--backoff", "0.05",
        ]

    def start(self) -> subprocess.Popen[bytes]:
        self.runs += 1
        return subprocess.Popen(self.command(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, cwd=ROOT, env=_env())

    def finish(self, batch: subprocess.Popen[bytes], started: float, what: str) -> None:
        """Wait for the batch (bounded), then for its workers to be gone (bounded)."""
        workers = worker_pids(batch.pid)
        try:
            batch.wait(timeout=self.bound)
        except subprocess.TimeoutExpired:
            self.violations.append(f"{what}: the batch did not end within {self.bound} s")
            batch.kill()
            batch.wait()
        if not _wait(lambda: not any(_alive(pid) for pid in workers), self.bound):
            self.violations.append(f"{what}: a worker outlived its batch by {self.bound} s")
            for pid in workers:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
        self.longest_run = max(self.longest_run, time.monotonic() - started)

    def round(self, rng: random.Random, index: int) -> None:
        kind = rng.choice(SIGNALS)
        target = _committed(self.out) + rng.randint(1, max(1, self.jobs // 20))
        batch = self.start()
        started = time.monotonic()
        reached = _wait(lambda: _committed(self.out) >= target or batch.poll() is not None,
                        self.bound)
        if not reached:
            self.violations.append(f"round {index}: no progress to {target} lines "
                                   f"within {self.bound} s")
        if batch.poll() is None:
            if kind == "SIGKILL worker":
                pids = sorted(worker_pids(batch.pid))
                if pids:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                # the batch goes on: the next round's signal (or its end) stops it
                kind += " (then SIGINT)"
                _wait(lambda: _committed(self.out) > target or batch.poll() is not None,
                      self.bound)
                if batch.poll() is None:
                    batch.send_signal(signal.SIGINT)
            elif kind == "SIGKILL batch":
                batch.kill()
            else:
                batch.send_signal(getattr(signal, kind))
        self.finish(batch, started, f"round {index} ({kind})")
        self.log(f"round {index}: {kind} at {_committed(self.out)}/{self.jobs} lines, "
                 f"exit {batch.returncode}")

    def last(self) -> None:
        batch = self.start()
        started = time.monotonic()
        self.finish(batch, started, "the last run")
        if batch.returncode != 0:
            stderr = batch.stderr.read().decode(errors="replace") if batch.stderr else ""
            self.violations.append(f"the last run exited {batch.returncode}: {stderr[-800:]}")

    def check(self) -> dict[str, Any]:
        results = read_results(self.out)
        keys = Counter((line["id"], line["revision"]) for line in results)
        if len(keys) != self.jobs or set(keys.values()) != {1}:
            self.violations.append(f"not every job exactly once: {keys.most_common(3)}, "
                                   f"{len(keys)} of {self.jobs}")
        log = httpx.get(self.provider["requests_url"], timeout=30).json()
        by_operation: dict[str, list[str]] = defaultdict(list)
        for request in log:
            attempt_id = request["attempt_id"] or "?.0"
            by_operation[attempt_id.rsplit(".", 1)[0]].append(attempt_id)
        for operation_id, attempts in by_operation.items():
            if len(set(attempts)) != len(attempts):
                self.violations.append(f"{operation_id}: an attempt sent twice: {attempts}")
            if len(attempts) > MAX_ATTEMPTS:
                self.violations.append(f"{operation_id}: {len(attempts)} POSTs, budget "
                                       f"{MAX_ATTEMPTS}")
        committed = {line["operation_id"] for line in results}
        strays = set(by_operation) - committed
        before = len(log)
        rerun = subprocess.run(self.command(), capture_output=True, cwd=ROOT, env=_env(),
                               timeout=self.bound)
        after = len(httpx.get(self.provider["requests_url"], timeout=30).json())
        if rerun.returncode != 0 or after != before:
            self.violations.append(f"the final rerun: exit {rerun.returncode}, "
                                   f"{after - before} POSTs")
        return {"posts": before, "operations with POSTs": len(by_operation),
                "superseded-by-lineage operations": len(strays),
                "replaced attempts": sum(len(a) - 1 for a in by_operation.values())}


def _provider(faults: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "recoverable", "fixture-provider", "--port", "0",
         "--reply-delay", "0.2", "--faults", faults],
        stdout=subprocess.PIPE, text=True, env=_env(),
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=None, help="300; quick 12")
    parser.add_argument("--signals", type=int, default=None, help="20; quick 2")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--store", choices=("lmdb", "postgresql"), default="lmdb")
    parser.add_argument("--faults", default="disconnect=0.05,seed=3")
    parser.add_argument("--bound", type=float, default=120.0,
                        help="seconds any run, and any worker after its batch, may take")
    parser.add_argument("--dir", help="work directory (kept); default: a temporary one")
    parser.add_argument("--quick", action="store_true", help="12 jobs, 2 signals")
    args = parser.parse_args()
    jobs = args.jobs if args.jobs is not None else (12 if args.quick else 300)
    signals = args.signals if args.signals is not None else (2 if args.quick else 20)
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="soak-fleet-"))
    workdir.mkdir(parents=True, exist_ok=True)
    write_jobs(workdir / "jobs.jsonl", [job_line(i) for i in range(jobs)])
    cluster = None
    provider_proc, provider = _provider(args.faults)
    try:
        if args.store == "postgresql":
            from tests.pg.cluster import start_cluster

            cluster = start_cluster()
            store = cluster.url()
        else:
            store = str(workdir / "store")
        soak = Soak(workdir, store, provider, jobs, args.bound,
                    lambda line: print(line, flush=True))
        rng = random.Random(args.seed)
        started = time.monotonic()
        for index in range(signals):
            soak.round(rng, index)
        soak.last()
        totals = soak.check()
        print(f"store={args.store} jobs={jobs} signals={signals} runs={soak.runs} "
              f"committed={len(read_results(soak.out))} longest run={soak.longest_run:.1f} s "
              f"(bound {args.bound:g} s) seconds={time.monotonic() - started:.1f}")
        print(" ".join(f"{name}={value}" for name, value in totals.items()))
    finally:
        provider_proc.send_signal(signal.SIGTERM)
        provider_proc.wait(timeout=30)
        if cluster is not None:
            cluster.stop()
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    for violation in soak.violations:
        print("VIOLATION:", violation)
    return 1 if soak.violations else 0


if __name__ == "__main__":
    sys.exit(main())
