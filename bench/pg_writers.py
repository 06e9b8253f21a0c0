"""Writers of a fleet committing at once: does one owner's batch wait for another's?

Run:  python bench/pg_writers.py [--seconds 8] [--tasks 32] [--db-delay-ms 2]
                                 [--commit-delay-ms 10] [--quick]

Each row runs N processes (owners) on one fresh database of a throwaway cluster
(``tests/pg/cluster.py``, fsync on, 127.0.0.1); each process runs ``--tasks`` Trio tasks
that each write records of their own in a loop (``store.write``: one read and one write
of an operation, so every batch reads rows and writes them), for ``--seconds``. Nothing
is shared between the owners' rows, so their batches never conflict: what one costs the
other is the store's own serialization. Rows: 1 and 2 owners directly, then the same
through ``bench/_delay_proxy.py`` (``--db-delay-ms`` each way), where a lock held across
a batch's round trips costs most, then on a database whose every commit waits
``--commit-delay-ms`` before its WAL flush (``commit_delay``: a slow disk, a synchronous
standby), where a lock held across the commits of the fleet costs most.

Printed: commits (writes) per second of all owners per row, and 2 owners / 1 owner
directly, through the proxy and with slow commits (1.0: the second owner added nothing;
2.0: it doubled the fleet's writes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from fleet import delay_proxy, round_trip_ms

from tests.pg.cluster import start_cluster
from tests.pg.fixtures import TEMPLATE, _prepare_template, new_database

CHILD = r"""
import json, sys, time, trio
from recoverable.storage import RecoveryStore
from recoverable.records import OperationRecord
from recoverable.types import AccountBinding, RetryPolicy
import msgspec

url, name = sys.argv[1], sys.argv[2]
tasks, seconds, start_at = int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
ACCOUNT = AccountBinding("acct-1", "api-key")

def op(op_id: str) -> OperationRecord:
    return OperationRecord(operation_id=op_id, account=ACCOUNT, endpoint_id="fixture",
        created_at=1_700_000_000.25, maximum_attempts=1_000_000, model="m", format_name="A",
        format_hash="sha256:a", body_hash="sha256:b", root_operation_id=op_id,
        retry_policy=RetryPolicy())

async def main() -> None:
    store = RecoveryStore.open(url)
    count = 0
    async def worker(index: int) -> None:
        nonlocal count
        op_id = f"{name}-{index}"
        await store.write(lambda txn: txn.put_operation(op(op_id)))
        await trio.sleep_until(trio.current_time() + max(0.0, start_at - time.time()))
        end = time.time() + seconds
        while time.time() < end:
            def bump(txn):
                record = txn.get_operation(op_id)
                used = record.attempts_used + 1
                txn.put_operation(msgspec.structs.replace(record, attempts_used=used))
            await store.write(bump, touches=(op_id,))
            count += 1
    async with trio.open_nursery() as nursery:
        for index in range(tasks):
            nursery.start_soon(worker, index)
    store.close()
    print(json.dumps({"writes": count}))

trio.run(main)
"""


def run_row(url: str, owners: int, tasks: int, seconds: float) -> float:
    """Writes per second of ``owners`` processes writing at once."""
    start_at = time.time() + 3.0  # every process connected and warm before it
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, url, f"owner{index}", str(tasks), str(seconds),
             str(start_at)],
            stdout=subprocess.PIPE, text=True,
        )
        for index in range(owners)
    ]
    total = 0
    for proc in procs:
        out, _ = proc.communicate(timeout=seconds + 120)
        if proc.returncode != 0:
            raise RuntimeError(f"an owner exited with {proc.returncode}")
        total += json.loads(out.strip().splitlines()[-1])["writes"]
    return total / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--db-delay-ms", type=float, default=2.0)
    parser.add_argument("--commit-delay-ms", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="1 s rows, 4 tasks")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.tasks = 1.0, 4
    cluster = start_cluster()
    try:
        _prepare_template(cluster)
        rows: dict[str, float] = {}
        for owners in (1, 2):
            rows[f"direct {owners}"] = run_row(
                cluster.url(new_database(cluster, TEMPLATE)), owners, args.tasks, args.seconds
            )
        for owners in (1, 2):
            name = new_database(cluster, TEMPLATE)
            with psycopg.connect(cluster.url(), autocommit=True) as conn:
                # Every commit waits before its WAL flush (commit_siblings 0: always).
                conn.execute(f"ALTER DATABASE {name} SET commit_delay = "
                             f"{int(args.commit_delay_ms * 1000)}")
                conn.execute(f"ALTER DATABASE {name} SET commit_siblings = 0")
            rows[f"slow commit {owners}"] = run_row(
                cluster.url(name), owners, args.tasks, args.seconds
            )
        with delay_proxy(cluster, args.db_delay_ms) as port:
            for owners in (1, 2):
                name = new_database(cluster, TEMPLATE)
                url = f"postgresql://{cluster.user}@127.0.0.1:{port}/{name}"
                if owners == 1:
                    rtt = round_trip_ms(url)
                rows[f"proxy {owners}"] = run_row(url, owners, args.tasks, args.seconds)
    finally:
        cluster.stop()
    print(f"{args.tasks} tasks per owner, {args.seconds:g} s a row; round trip through the "
          f"proxy {rtt:.2f} ms")
    for name, rate in rows.items():
        print(f"  {name} owner(s): {rate:8.0f} writes/s")
    print(f"2 owners / 1 owner, direct: {rows['direct 2'] / rows['direct 1']:.2f}")
    print(f"2 owners / 1 owner, through the proxy: {rows['proxy 2'] / rows['proxy 1']:.2f}")
    print(f"2 owners / 1 owner, every commit {args.commit_delay_ms:g} ms slower: "
          f"{rows['slow commit 2'] / rows['slow commit 1']:.2f}")


if __name__ == "__main__":
    main()
