"""The durable path's parts, each timed alone (issue 20's profile, made reproducible).

Run:  python bench/durable_parts.py [--records 2000] [--repeat 2000] [--quick]

On a real store on disk (records shaped like ``store_scale.py``'s), single-threaded where
possible, this times the pieces the profile of ``durable_vs_plain.py`` names, in µs per call:

CPU µs of the calling thread (``time.thread_time``), except the one-at-a-time hand-off (wall).

- the governor's admission read when no limit is configured (``store.get_raw`` of the
  governor row on the event loop: a read transaction per admission);
- decoding and encoding one operation record (``codec.decode_operation``, ``codec.encode``);
- inside one write closure: reading a record (decode), ``put_operation`` of a changed copy
  (its fence check, encoding and index upkeep), both per record over distinct records;
- the nested LMDB transaction each write runs in (``begin(parent=)`` + one put + child
  commit) against the same put straight in the batch's transaction (raw ``lmdb``);
- a full ``gc.collect()`` with every record decoded and alive (and how many objects the
  collector tracks then): what each full collection costs a runtime with that many
  operations in flight;
- the hand-off: ``await store.write(no-op)`` one at a time (a round trip through the writer
  thread) and 1,000 at once (batched), as process CPU per write; and one real write per record
  at once (read + ``put_operation``), as process CPU per write.

``--quick``: 200 records, 200 repeats (a few seconds). The figures of a quick run mean
nothing; it proves the script still works.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
import store_scale

import recoverable
from recoverable.storage import codec
from recoverable.storage.store import governor_key


def per_call_us(fn: Callable[[], Any], repeat: int) -> float:
    """Median over 5 rounds of the mean CPU µs (this thread) per call of ``repeat`` calls.
    CPU time, not wall time: on a shared machine a preempted thread's wall time says little."""
    rounds = []
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(repeat):
            fn()
        rounds.append((time.thread_time() - t0) / repeat * 1e6)
    return sorted(rounds)[2]


def in_closure_us(store: recoverable.RecoveryStore, ids: list[str]) -> tuple[float, float]:
    """(get_operation, put_operation) CPU µs per record inside one write closure (the
    writer thread's CPU time)."""
    times: dict[str, float] = {}

    def work(txn: Any) -> None:
        t0 = time.thread_time()
        records = [txn.get_operation(op_id) for op_id in ids]
        t1 = time.thread_time()
        for record in records:
            txn.put_operation(msgspec.structs.replace(record, attempts_used=record.attempts_used),
                              expect_fence=record.fence)
        t2 = time.thread_time()
        times["get"] = (t1 - t0) / len(ids) * 1e6
        times["put"] = (t2 - t1) / len(ids) * 1e6

    store.write_sync(work)
    return times["get"], times["put"]


def nested_txn_us(path: str, writes: int) -> tuple[float, float]:
    """(put in a child transaction + child commit, put straight in the parent) µs per write,
    ``writes`` distinct keys in one batch transaction (not committed: no fsync timed)."""
    env = lmdb.open(path, map_size=2**30, max_dbs=2)
    db = env.open_db(b"t")
    value = b"x" * 400
    try:
        results = []
        for nested in (True, False):
            rounds = []
            for r in range(5):
                with env.begin(write=True) as parent:
                    t0 = time.thread_time()
                    for i in range(writes):
                        key = b"%d-%d" % (r, i)
                        if nested:
                            child = env.begin(write=True, parent=parent)
                            child.put(key, value, db=db)
                            child.commit()
                        else:
                            parent.put(key, value, db=db)
                    rounds.append((time.thread_time() - t0) / writes * 1e6)
                    parent.abort()
            results.append(sorted(rounds)[2])
        return results[0], results[1]
    finally:
        env.close()


async def handoff_us(store: recoverable.RecoveryStore, n: int) -> tuple[float, float]:
    """(µs wall per ``await store.write(no-op)`` one at a time, process CPU µs per write
    with ``n`` writes in flight at once)."""

    def nothing(txn: Any) -> None:
        return None

    t0 = time.perf_counter()
    for _ in range(n):
        await store.write(nothing)
    serial = (time.perf_counter() - t0) / n * 1e6

    cpu0 = _common.self_cpu_seconds()
    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(store.write, nothing)
    batched = (_common.self_cpu_seconds() - cpu0) / n * 1e6
    return serial, batched


async def handoff_put_us(store: recoverable.RecoveryStore, ids: list[str]) -> float:
    """Process CPU µs per write with one write per record in flight at once, each a real
    mutation (read the record, ``put_operation`` of a changed copy): the writer's per-write
    machinery (child transaction or not) plus the closure's own work."""

    async def bump(op_id: str) -> None:
        def mutation(txn: Any) -> None:
            record = txn.get_operation(op_id)
            txn.put_operation(msgspec.structs.replace(record, attempts_used=record.attempts_used),
                              expect_fence=record.fence)

        await store.write(mutation)

    cpu0 = _common.self_cpu_seconds()
    async with trio.open_nursery() as nursery:
        for op_id in ids:
            nursery.start_soon(bump, op_id)
    return (_common.self_cpu_seconds() - cpu0) / len(ids) * 1e6


def full_collection(store: recoverable.RecoveryStore, ids: list[str]) -> tuple[float, int]:
    """(CPU µs of one full ``gc.collect()``, objects the collector tracks) with every record
    of ``ids`` decoded and alive, as in a runtime with that many operations in flight."""
    records = [store.get_operation(op_id) for op_id in ids]
    gc.collect()
    tracked = len(gc.get_objects())
    rounds = []
    for _ in range(5):
        t0 = time.thread_time()
        gc.collect()
        rounds.append((time.thread_time() - t0) * 1e6)
    del records
    return sorted(rounds)[2], tracked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="200 records, 200 repeats")
    args = parser.parse_args()
    if args.quick:
        args.records, args.repeat = 200, 200
    base = tempfile.mkdtemp(prefix="durable-parts-")
    try:
        store = recoverable.RecoveryStore.open(str(Path(base) / "store"))
        try:
            ids = store_scale.build(store, args.records, 10)
            account = store_scale.ACCOUNT
            gkey = governor_key("fixture", account)
            rows: list[list[str]] = []

            def row(what: str, us: float, where: str) -> None:
                rows.append([what, f"{us:.1f}", where])

            row("governor admission read, no limits (store.get_raw)",
                per_call_us(lambda: store.get_raw("governor", gkey), args.repeat), "event loop")
            raw = store.get_raw("operations", ids[0].encode())
            assert raw is not None
            record = codec.decode_operation(raw)
            row("codec.decode_operation (one record)",
                per_call_us(lambda: codec.decode_operation(raw), args.repeat), "writer")
            row("codec.encode (one record)",
                per_call_us(lambda: codec.encode(record), args.repeat), "writer")
            get_us, put_us = in_closure_us(store, ids)
            row("WriteTxn.get_operation (uncached: read + decode)", get_us, "writer")
            row("WriteTxn.put_operation (fence, encode, indexes)", put_us, "writer")
            child_us, direct_us = nested_txn_us(str(Path(base) / "raw"), args.records)
            row("raw LMDB put in a nested txn + child commit", child_us, "writer")
            row("raw LMDB put straight in the batch txn", direct_us, "writer")
            gc_us, tracked = full_collection(store, ids)
            row(f"full gc.collect() with {args.records} decoded records alive "
                f"({tracked} tracked objects)", gc_us, "any")
            row(f"await store.write(read + put_operation), {args.records} at once "
                "(process CPU)", trio.run(handoff_put_us, store, ids), "both")
            serial, batched = trio.run(handoff_us, store, args.records)
            row("await store.write(no-op), one at a time (wall)", serial, "both")
            row(f"await store.write(no-op), {args.records} at once (process CPU)", batched,
                "both")
        finally:
            store.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"durable path parts, µs per call ({args.records} records)")
    print(_common.table(["part", "µs/call", "thread"], rows))


if __name__ == "__main__":
    main()
