"""Claim races: worker processes of one PostgreSQL database starting the same operations.

Run:  python bench/claims.py [--jobs 2000] [--workers 2] [--concurrency 64]
                             [--reply-delay 0.05] [--mode websocket|sse] [--quick]

One throwaway PostgreSQL cluster (``tests/pg/cluster.py``) and one fixture provider
process (every generation held ``--reply-delay`` seconds). ``--jobs`` operations are
submitted to a fresh database (``runtime.submit``, the account and endpoint a
``recoverable worker --fixture-url`` serves), then ``--workers`` real ``recoverable
worker`` processes start at once on it and run the queue until every operation has its
receipt; then each is stopped (SIGTERM) and its report line read.

Printed per worker and in total: executions started (``claimed``), completed, and
``busy`` (an execution that found another worker had taken the operation's lease first:
a claim lost to a race, the work the claim round's reservations avoid,
``storage/pg_claims.py``), and jobs/s from the workers' start to the last receipt. The
figure the fleet is held to is busy per job (0 means no claim was lost); an older
checkout is measured by running this script with its ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common

import recoverable
from recoverable.cli.entry import build_parser
from recoverable.cli.worker import open_worker_backend, worker_account, worker_config
from tests.pg.cluster import Cluster, start_cluster
from tests.pg.fixtures import _prepare_template, new_database

REQUEST = recoverable.StructuredRequest(
    model="gpt-test", instructions="Answer briefly.", input="Label this: a or b?"
)
SCHEMA = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": ["a", "b"]}},
    "required": ["label"],
    "additionalProperties": False,
}
BOUND = 600.0  # seconds a run may take before the bench says why


def worker_argv(url: str, info: dict[str, Any], args: argparse.Namespace) -> list[str]:
    return [
        "worker", "--store", url, "--fixture-url", info["http_url"], "--mode", args.mode,
        "--concurrency", str(args.concurrency),
    ]


async def submit(url: str, info: dict[str, Any], args: argparse.Namespace) -> None:
    config = worker_config(build_parser().parse_args(worker_argv(url, info, args)))
    account = worker_account(config)
    response = recoverable.JsonSchema("label", SCHEMA)
    with recoverable.RecoveryStore.open(url) as store:
        async with (
            open_worker_backend(config, account) as backend,
            recoverable.open_runtime(store, backend, account=account) as rt,
        ):
            for index in range(args.jobs):
                await rt.submit(REQUEST, response=response, job_id=f"job-{index}",
                                maximum_attempts=3)


def receipts(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM recoverable_operations WHERE completed_at IS NOT NULL"
        ).fetchone()
    return int(row[0]) if row else 0


def run(cluster: Cluster, info: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    url = cluster.url(new_database(cluster))
    trio.run(submit, url, info, args)
    command = [sys.executable, "-c", "import sys; from recoverable.cli.entry import main;"
               " sys.exit(main(sys.argv[1:]))", *worker_argv(url, info, args)]
    start = time.perf_counter()
    procs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=_common.child_env())
        for _ in range(args.workers)
    ]
    try:
        while (done := receipts(url)) < args.jobs:
            if time.perf_counter() - start > BOUND:
                raise SystemExit(f"only {done} of {args.jobs} receipts after {BOUND:.0f} s")
            if any(proc.poll() is not None for proc in procs):
                raise SystemExit("a worker exited before the queue was run")
            time.sleep(0.02)
        elapsed = time.perf_counter() - start
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
    reports = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        reports.append(next(line for line in lines if line.get("worker") == "stopped"))
    return {"elapsed": elapsed, "reports": reports}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--reply-delay", type=float, default=0.05)
    parser.add_argument("--mode", choices=("websocket", "sse"), default="websocket")
    parser.add_argument("--quick", action="store_true", help="a small run (a smoke check)")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.concurrency = 60, 8
    cluster = start_cluster()
    try:
        _prepare_template(cluster)
        with _common.provider_process(extra=["--reply-delay", str(args.reply_delay)]) as info:
            result = run(cluster, info, args)
    finally:
        cluster.stop()
    rows = [
        [index, report["claimed"], report["completed"], report["busy"]]
        for index, report in enumerate(result["reports"])
    ]
    total = {key: sum(report[key] for report in result["reports"])
             for key in ("claimed", "completed", "busy")}
    rows.append(["all", total["claimed"], total["completed"], total["busy"]])
    print(f"{args.jobs} jobs, {args.workers} workers x --concurrency {args.concurrency}, "
          f"--reply-delay {args.reply_delay}, {args.mode}, {os.cpu_count()} cores")
    print(_common.table(["worker", "claimed", "completed", "busy"], rows))
    print(f"jobs/s {args.jobs / result['elapsed']:.0f}; busy per job "
          f"{total['busy'] / args.jobs:.3f} (claims lost to another worker)")


if __name__ == "__main__":
    main()
