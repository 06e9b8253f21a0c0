"""The cost of the source manifest check on the receipt path (issue 16).

Run:  python bench/sources.py [--n 2000] [--rounds 3] [--quick]

The receipt write is ``actors.fenced.persist`` with a validated completion: one fenced
transaction saving the completion payload and the completed record (and releasing the
lease). For a source-bound operation it also reads the stored record's phase and the
manifest's digest of its source, in the same transaction. Both variants run in the same
process on the same machine, interleaved, best of ``--rounds``:

- ``in-txn``: the CPU time of ``persist`` itself, N receipt writes inside ONE LMDB
  transaction (no commit): what the check adds to the work of the write;
- ``durable``: N receipt writes through ``RecoveryStore.write`` from 50 concurrent Trio
  tasks (group commit, every write durable when its caller resumes).

Prints one row per variant and the bound/plain ratios. ``--quick``: N=200, 1 round.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "storage"))

from storage_helpers import make_op

from recoverable import machine
from recoverable.actors import fenced
from recoverable.records import AttemptRecord, OperationRecord
from recoverable.storage import RecoveryStore, WriteTxn
from recoverable.types import SourceRef

SOURCE = SourceRef("doc-bench", "sha256:" + "ab" * 32)
COMPLETION = b'{"answer":42,"note":"six times seven"}'
TASKS = 50


Writes = tuple[list[OperationRecord], list[fenced.FencedWrite]]


def _writes(prefix: str, n: int, bound: bool) -> Writes:
    """N records in flight and the receipt write of each."""
    source = SOURCE if bound else None
    stored: list[OperationRecord] = []
    writes: list[fenced.FencedWrite] = []
    for i in range(n):
        op_id = f"{prefix}-{i}"
        attempt = AttemptRecord(f"{op_id}.1", 1, "initial", 1.0)
        running = make_op(op_id, phase="transmitting", attempts_used=1, attempts=(attempt,),
                          source=source, attempt_timeout=20.0 if bound else None, fence=1)
        done = machine.evolve(
            running, phase="completed", completed_at=2.0,
            attempts=(AttemptRecord(f"{op_id}.1", 1, "initial", 1.0, outcome="completed"),),
        )
        stored.append(running)
        writes.append(fenced.FencedWrite(
            operation_id=op_id, transition=machine.Transition(done, machine.Deliver(), True),
            fence=1, known_serial=0, check_commands=True, completion=COMPLETION,
        ))
    return stored, writes


def _put_all(records: list[OperationRecord], txn: WriteTxn) -> None:
    for record in records:
        txn.put_operation(record)


def in_txn(store: RecoveryStore, prefix: str, n: int, bound: bool) -> float:
    """Seconds of ``persist`` for N receipt writes in one transaction (no commit)."""
    stored, writes = _writes(prefix, n, bound)
    store.write_sync(functools.partial(_put_all, stored))

    def run(txn: WriteTxn) -> float:
        start = time.perf_counter()
        for write in writes:
            written = fenced.persist(write, txn).transition
            assert written.record.phase == "completed"
        return time.perf_counter() - start

    return store.write_sync(run)


async def durable(store: RecoveryStore, prefix: str, n: int, bound: bool) -> float:
    """Seconds for N durable receipt writes from TASKS concurrent tasks (group commit)."""
    stored, writes = _writes(prefix, n, bound)
    await store.write(functools.partial(_put_all, stored))

    async def task(k: int) -> None:
        for write in writes[k::TASKS]:
            persisted = await store.write(functools.partial(fenced.persist, write))
            assert persisted.transition.record.phase == "completed"

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for k in range(TASKS):
            nursery.start_soon(task, k)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n, rounds = (200, 1) if args.quick else (args.n, args.rounds)
    best: dict[tuple[str, str], float] = {}
    root = tempfile.mkdtemp(prefix="bench-sources-")
    try:
        with RecoveryStore.open(str(Path(root) / "store"), max_bytes=2**31) as store:
            store.set_source_sync(SOURCE.key, SOURCE.digest)
            for variant in ("plain", "bound"):  # warm-up, not counted
                in_txn(store, f"w{variant}", min(n, 200), variant == "bound")
            for r in range(rounds):
                for variant in ("plain", "bound"):  # interleaved: the same conditions
                    bound = variant == "bound"
                    cpu = in_txn(store, f"c{r}{variant}", n, bound)
                    wall = trio.run(durable, store, f"d{r}{variant}", n, bound)
                    for kind, seconds in (("in-txn", cpu), ("durable", wall)):
                        key = (variant, kind)
                        best[key] = min(best.get(key, seconds), seconds)
            assert store.check_integrity() == []
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"receipt writes: {n} per variant, best of {rounds}; durable from {TASKS} tasks")
    print(f"{'variant':<8} {'in-txn us/write':>16} {'durable writes/s':>17}")
    for variant in ("plain", "bound"):
        cpu, wall = best[(variant, "in-txn")], best[(variant, "durable")]
        print(f"{variant:<8} {cpu / n * 1e6:>16.2f} {n / wall:>17.0f}")
    cpu_ratio = best[("bound", "in-txn")] / best[("plain", "in-txn")]
    wall_ratio = best[("bound", "durable")] / best[("plain", "durable")]
    print(f"manifest check: bound/plain in-txn = {cpu_ratio:.2f}, durable = {wall_ratio:.2f}")


if __name__ == "__main__":
    main()
