"""Store-scale figures: reads over a store holding 100,000 operation records.

Run:  python bench/store_scale.py [--records 100000] [--samples 1000] [--scopes 100]
                                  [--out bench/results/store_scale.md] [--dir DIR] [--quick]

The store is filled quickly (batched ``store.write_sync``, 2,000 records per
commit) with records shaped like real ones: each has its own frozen body (about
1 KiB: a ~900-character input through ``freeze_body``), its stored request, and
an ``OperationRecord`` written through ``WriteTxn.put_operation`` (so the
hosts index is maintained). Mix: 70% prepared, 20% waiting (one
failed attempt, a cooldown an hour away), 10% completed (a receipt payload).
Each record has a unique job id and one of ``--scopes`` scopes (100 scopes: 1%
of the records each).

Measured (page cache warm; this is the steady state of a running host):
- reopen: ``close`` + ``RecoveryStore.open`` + first ``inventory(account=)``;
- ``runtime.status(handle)`` p50/p99 over ``--samples`` random handles;
- ``runtime.inventory()`` for the whole store and for one scope (1%);
- ``store.ids_by_job(account, scope, job)`` p50/p99 over ``--samples`` jobs;
- ``check_integrity()`` (the ``store.waiting()`` scan left with the retired schedule
  index, issue 13.4).

``--quick``: 2,000 records, 50 samples, 10 scopes (a few seconds); it writes no
results file unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

import recoverable
from recoverable.body import body_hash, freeze_body
from recoverable.contract import contract_for
from recoverable.records import (
    AttemptRecord,
    OperationRecord,
    StoredRequest,
)

ACCOUNT = recoverable.AccountBinding("acct-scale", "api-key")
GiB = 2**30
BATCH = 2000
FILLER = ("Summarise the following position and answer with a number and a short note. ") * 12


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


def scope_of(i: int, scopes: int) -> str:
    return f"scope-{i % scopes:03d}"


def build(store: recoverable.RecoveryStore, records: int, scopes: int) -> list[str]:
    contract = contract_for(Answer)
    now = time.time()
    policy = recoverable.RetryPolicy()
    ids: list[str] = []
    body_sizes: list[int] = []
    for start in range(0, records, BATCH):
        batch: list[tuple[OperationRecord, bytes, bytes, bytes | None]] = []
        for i in range(start, min(records, start + BATCH)):
            request = recoverable.StructuredRequest(
                model="gpt-scale", instructions="Answer briefly.",
                input=f"Question {i}. {FILLER[: 880 - len(str(i))]}",
            )
            body = freeze_body(request, contract)
            body_sizes.append(len(body))
            op_id = f"op_{i:032x}"
            stored = msgspec.json.encode(
                StoredRequest(request=request, format_name=contract.name, schema=contract.schema)
            )
            kind = i % 10
            extra: dict[str, Any] = {}
            completion: bytes | None = None
            if kind == 0:  # completed: a receipt waits for acknowledgement
                completion = msgspec.json.encode(Answer(answer=i, note="forty-two"))
                extra = dict(
                    phase="completed", attempts_used=1, completed_at=now,
                    attempts=(AttemptRecord(f"{op_id}.1", 1, "initial", now, "completed",
                                            response_id=f"resp_{i}", sequence_number=9),),
                )
            elif kind in (1, 2):  # waiting: one disconnect, a cooldown an hour away
                failure = recoverable.Interruption(kind="disconnected",
                                                   transport_code="ws_close_1006")
                extra = dict(
                    phase="waiting", attempts_used=1, next_attempt_at=now + 3600 + i,
                    last_failure=failure,
                    attempts=(AttemptRecord(f"{op_id}.1", 1, "initial", now, "failed",
                                            failure=failure),),
                )
            record = OperationRecord(
                operation_id=op_id, account=ACCOUNT, endpoint_id="fixture", created_at=now,
                maximum_attempts=3, retry_policy=policy, model=request.model,
                format_name=contract.name, format_hash=contract.format_hash,
                scope=scope_of(i, scopes), job_id=f"job-{i}", input_revision="r1",
                body_hash=body_hash(body), root_operation_id=op_id, **extra,
            )
            batch.append((record, body, stored, completion))
            ids.append(op_id)

        def write(txn: Any, batch: list[tuple[OperationRecord, bytes, bytes, bytes | None]]
                  = batch) -> None:
            for record, body, stored, completion in batch:
                txn.put_payload(record.operation_id, "body", body)
                txn.put_payload(record.operation_id, "request", stored)
                if completion is not None:
                    txn.put_payload(record.operation_id, "completion", completion)
                txn.put_operation(record)

        store.write_sync(write)
    print(f"  bodies: mean {statistics.mean(body_sizes):.0f} bytes", file=sys.stderr)
    return ids


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def timed(fn: Any, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def dir_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


async def measure(path: str, ids: list[str], samples: int, scopes: int,
                  options: dict[str, Any]) -> list[list[str]]:
    rng = random.Random(7)
    rows: list[list[str]] = []

    def row(what: str, values: list[float], note: str = "") -> None:
        rows.append([what, str(len(values)), fmt_ms(_common.percentile(values, 50)),
                     fmt_ms(_common.percentile(values, 99)), fmt_ms(max(values)), note])

    # Open alone, then reopen: close + open + first inventory (what a restarting host pays).
    open_only: list[float] = []
    for _ in range(5):
        t0 = time.perf_counter()
        store = recoverable.RecoveryStore.open(path, **options)
        open_only.append(time.perf_counter() - t0)
        store.close()
    row("RecoveryStore.open alone", open_only)
    reopen: list[float] = []
    found = 0
    for _ in range(5):
        t0 = time.perf_counter()
        store = recoverable.RecoveryStore.open(path, **options)
        found = len(store.inventory(account=ACCOUNT)[0])
        reopen.append(time.perf_counter() - t0)
        store.close()
    row("reopen (close + open + first inventory)", reopen, f"{found} records read")

    store = recoverable.RecoveryStore.open(path, **options)
    try:
        async with recoverable.open_runtime(store, None, account=ACCOUNT) as rt:
            handles = [recoverable.Handle(rng.choice(ids)) for _ in range(samples)]
            status_times = []
            for handle in handles:
                t0 = time.perf_counter()
                await rt.status(handle)
                status_times.append(time.perf_counter() - t0)
            row("runtime.status(handle)", status_times, "random handles")

            whole: list[float] = []
            count = 0
            for _ in range(5):
                t0 = time.perf_counter()
                count = len((await rt.inventory()).operations)
                whole.append(time.perf_counter() - t0)
            row("runtime.inventory() whole store", whole, f"{count} statuses")

            one_scope: list[float] = []
            for k in range(20):
                t0 = time.perf_counter()
                count = len((await rt.inventory(scope=scope_of(k, scopes))).operations)
                one_scope.append(time.perf_counter() - t0)
            row("runtime.inventory(scope=) one scope", one_scope,
                f"{count} statuses ({100 / scopes:g}% of the store)")

        jobs = [rng.randrange(len(ids)) for _ in range(samples)]
        by_job: list[float] = []
        for i in jobs:
            t0 = time.perf_counter()
            got = store.ids_by_job(ACCOUNT, scope_of(i, scopes), f"job-{i}")
            by_job.append(time.perf_counter() - t0)
            assert got == [ids[i]], got
        row("store.ids_by_job(account, scope, job)", by_job, "1 id each")

        problems: list[str] = []

        def integrity() -> None:
            problems[:] = store.check_integrity()

        row("store.check_integrity()", timed(integrity, 2), f"{len(problems)} problems")
    finally:
        store.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=None, help="100000; quick 2000")
    parser.add_argument("--samples", type=int, default=None, help="1000; quick 50")
    parser.add_argument("--scopes", type=int, default=None, help="100; quick 10")
    parser.add_argument("--dir", help="work directory (kept); default: a temporary one")
    parser.add_argument("--out", default=None,
                        help="results file (default bench/results/store_scale.md; "
                             "quick: none)")
    parser.add_argument("--quick", action="store_true",
                        help="a few seconds: 2000 records, 50 samples, 10 scopes, no file")
    args = parser.parse_args()
    quick = args.quick
    args.records = args.records if args.records is not None else (2000 if quick else 100_000)
    args.samples = args.samples if args.samples is not None else (50 if quick else 1000)
    args.scopes = args.scopes if args.scopes is not None else (10 if quick else 100)
    if args.out is None and not quick:
        args.out = str(Path(__file__).resolve().parent / "results" / "store_scale.md")
    base = args.dir or tempfile.mkdtemp(prefix="store-scale-")
    path = os.path.join(base, "store")
    # A generous quota so the fill never meets it: the quota is a setting, not what is
    # measured here.
    options: dict[str, Any] = {"max_bytes": 8 * GiB}
    try:
        store = recoverable.RecoveryStore.open(path, **options)
        t0 = time.perf_counter()
        try:
            ids = build(store, args.records, args.scopes)
            stats = store.stats()
        finally:
            store.close()
        fill = time.perf_counter() - t0
        size = dir_bytes(path)
        rows = trio.run(measure, path, ids, args.samples, args.scopes, options)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    headers = ["what", "samples", "p50 ms", "p99 ms", "max ms", "note"]
    title = (f"{args.records} operation records ({args.scopes} scopes), filled in {fill:.1f} s "
             f"({stats.get('commits', 0)} commits), store files {size / 2**20:.0f} MiB")
    print(title)
    print(_common.table(headers, rows))
    if args.out is None:
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = ["# Store scale (bench/store_scale.py)", "",
          f"Command: `python bench/store_scale.py {' '.join(sys.argv[1:])}`".replace("  ", " "),
          "", title + f"; {os.cpu_count()} CPUs, page cache warm.", "",
          "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    out.write_text("\n".join(md) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
