"""Durable writes/s: the group-committing writer vs one LMDB transaction per write.

Run:  python bench/store_commit.py [--writes 2000] [--dir DIR] [--quick]

For 1, 100 and 1,000 concurrent Trio writers, the same total number of durable
writes (one operation record each) is made

- through ``RecoveryStore.write`` (one writer thread, group commit), and
- through one LMDB write transaction per write (begin/put/commit, ``sync=True``,
  ``metasync=True``), each in a worker thread (``trio.to_thread``, as many
  threads as writers; LMDB serializes them on its write lock).

"commits/write" counts durable commits (each commit is an fdatasync of the data
pages plus one of the meta page). Every write is durable when its caller resumes.

``--quick``: 50 writes at 1, 10 and 50 writers (a few seconds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import lmdb
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "storage"))

from storage_helpers import make_op

from recoverable.storage import RecoveryStore
from recoverable.storage.codec import encode


async def group_commit(path: str, writers: int, total: int) -> tuple[float, int]:
    per_task = total // writers
    with RecoveryStore.open(path) as store:
        records = [make_op(f"w{w}-{i}") for w in range(writers) for i in range(per_task)]
        before = store.stats()["commits"]

        async def writer(w: int) -> None:
            for i in range(per_task):
                record = records[w * per_task + i]
                await store.write(lambda t, r=record: t.put_operation(r))

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for w in range(writers):
                nursery.start_soon(writer, w)
        elapsed = time.perf_counter() - start
        commits = store.stats()["commits"] - before
        assert len(store.inventory()[0]) == writers * per_task
    return elapsed, commits


async def one_txn_per_write(path: str, writers: int, total: int) -> tuple[float, int]:
    per_task = total // writers
    os.makedirs(path, mode=0o700, exist_ok=True)
    env = lmdb.open(path, map_size=2**30, max_dbs=2, sync=True, metasync=True, writemap=False)
    db = env.open_db(b"operations")
    values = {
        f"w{w}-{i}": encode(make_op(f"w{w}-{i}")) for w in range(writers) for i in range(per_task)
    }
    limiter = trio.CapacityLimiter(writers)

    def put_one(key: str) -> None:
        with env.begin(write=True) as txn:  # commit (and fsync) on exit
            txn.put(key.encode(), values[key], db=db)

    async def writer(w: int) -> None:
        for i in range(per_task):
            await trio.to_thread.run_sync(put_one, f"w{w}-{i}", limiter=limiter)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for w in range(writers):
            nursery.start_soon(writer, w)
    elapsed = time.perf_counter() - start
    with env.begin() as txn:
        assert txn.stat(db)["entries"] == writers * per_task
    env.close()
    return elapsed, writers * per_task


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=None,
                        help="durable writes per measurement (2000; quick 50)")
    parser.add_argument("--dir", default=None, help="where to create the stores (default: tmp)")
    parser.add_argument("--quick", action="store_true",
                        help="a few seconds: 50 writes at 1, 10 and 50 writers")
    args = parser.parse_args()
    writes = args.writes if args.writes is not None else (50 if args.quick else 2000)
    levels = (1, 10, 50) if args.quick else (1, 100, 1000)
    base = tempfile.mkdtemp(prefix="store-commit-", dir=args.dir)
    rows = []
    try:
        for writers in levels:
            total = max(writers, writes // writers * writers)
            g_time, g_commits = await group_commit(
                os.path.join(base, f"g{writers}"), writers, total
            )
            b_time, b_commits = await one_txn_per_write(
                os.path.join(base, f"b{writers}"), writers, total
            )
            rows.append(
                (
                    writers,
                    total,
                    total / g_time,
                    g_commits / total,
                    total / b_time,
                    b_commits / total,
                )
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"{'writers':>7} {'writes':>6} | {'group w/s':>10} {'commits/w':>9} | "
        f"{'1-txn w/s':>10} {'commits/w':>9} | {'ratio':>6}"
    )
    for writers, total, g_rate, g_cpw, b_rate, b_cpw in rows:
        print(
            f"{writers:>7} {total:>6} | {g_rate:>10.0f} {g_cpw:>9.3f} | "
            f"{b_rate:>10.0f} {b_cpw:>9.3f} | {g_rate / b_rate:>5.1f}x"
        )


if __name__ == "__main__":
    trio.run(main)
