"""Store writes per job of ``recoverable batch`` (``--workers 0``), by kind of mutation.

Run:  python bench/batch_writes.py [--jobs 2000] [--concurrency 256] [--mode websocket|sse]
                                   [--quick]

``recoverable batch`` runs in this process (``recoverable.cli.main``) against the fixture
provider in its own process, on a fresh LMDB store, twice in the same run:

- ``apart``: the job's operation prepared in one write and acquired in the next (the path
  of a host that saves the handle in between; the batch's path before the fold);
- ``folded``: today's batch, where an admitted operation is created by its first
  acquisition (``actors/prepare_send.py``): one write less per job.

Every call of the store's writer (``storage.writer.Writer.write``) is counted and named
by its mutation: a fenced write by the phase it writes (``+release`` when it gives the
lease back), an acquisition ``+create`` when it creates its operation, any other by its
function's name. Reported per row: writes per job (target of issue 34: <= 3.5), jobs/s
and POSTs per job (1.00: the fold sends nothing twice). The heartbeat's renewals are
counted too (one write per runtime every ``lease_seconds/3``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
import workers

from recoverable.actors import fenced
from recoverable.cli import host as batch_host
from recoverable.cli.entry import main as cli_main
from recoverable.storage import writer as store_writer
from recoverable.types import Handle

KEY_ENV = workers.KEY_ENV


def kind_of(fn: Any) -> str:
    """A short name for one store mutation."""
    if isinstance(fn, fenced.FencedWrite):
        phase = fn.transition.record.phase
        return f"fenced {phase}" + ("+release" if fn.release_token is not None else "")
    if isinstance(fn, fenced.Acquisition):
        return "acquisition" + ("+create" if fn.create is not None else "")
    target = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(target, "__name__", type(target).__name__)


@contextlib.contextmanager
def counting() -> Iterator[Counter[str]]:
    """Count every ``Writer.write`` by its mutation's kind while inside."""
    counts: Counter[str] = Counter()
    original = store_writer.Writer.write

    async def write(self: Any, fn: Any, touches: Any = ()) -> Any:
        counts[kind_of(fn)] += 1
        return await original(self, fn, touches)

    store_writer.Writer.write = write  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        store_writer.Writer.write = original  # type: ignore[method-assign]


@contextlib.contextmanager
def prepared_apart() -> Iterator[None]:
    """The batch's path before the fold: prepare (one write), then send."""
    original = batch_host.BatchHost._handle

    async def handle(self: Any, job: Any) -> Handle:
        op_id = await self.find_existing(job)
        await self.supersede_older(job)
        if op_id is not None:
            self.summary.adopted += 1
            return Handle(op_id)
        prepared: Handle = await self.rt.prepare(job.request, **self.admission(job))
        self.summary.prepared += 1
        return prepared

    batch_host.BatchHost._handle = handle  # type: ignore[method-assign]
    try:
        yield
    finally:
        batch_host.BatchHost._handle = original  # type: ignore[method-assign]


def run_row(name: str, jobs_file: Path, info: dict[str, Any], args: argparse.Namespace,
            workdir: Path) -> dict[str, Any]:
    workdir.mkdir(exist_ok=True)
    store = workdir / f"store-{name}"
    out = workdir / f"out-{name}.jsonl"
    argv = ["batch", str(jobs_file), "--out", str(out), "--store", str(store),
            "--endpoint", info["base_url"], "--api-key-env", KEY_ENV,
            "--concurrency", str(args.concurrency), "--mode", args.mode]
    posts_before = len(_common.provider_requests(info))
    patch = prepared_apart() if name == "apart" else contextlib.nullcontext()
    with patch, counting() as counts, contextlib.redirect_stderr(io.StringIO()), \
            contextlib.redirect_stdout(io.StringIO()):
        started = time.perf_counter()
        code = cli_main(argv)
        elapsed = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"recoverable batch ({name}) exited {code}")
    posts = len(_common.provider_requests(info)) - posts_before
    lines = sum(1 for _ in out.open())
    return {"name": name, "counts": counts, "elapsed": elapsed, "posts": posts,
            "lines": lines}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=None, help="jobs (default 2000; quick 50)")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--mode", default="websocket", choices=["websocket", "sse"])
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds, each path once, in alternating order (default 2; quick 1)")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = parser.parse_args()
    n = args.jobs or (50 if args.quick else 2000)
    os.environ[KEY_ENV] = "bench-key"
    rows = []
    with tempfile.TemporaryDirectory() as tmp, _common.provider_process() as info:
        workdir = Path(tmp)
        jobs_file = workdir / "jobs.jsonl"
        workers.write_jobs(jobs_file, n)
        rounds = args.rounds or (1 if args.quick else 2)
        for index in range(rounds):
            order = ("apart", "folded") if index % 2 == 0 else ("folded", "apart")
            for name in order:
                rows.append(run_row(name, jobs_file, info, args, workdir / f"{index}"))
    print(f"recoverable batch, {n} jobs, --concurrency {args.concurrency}, {args.mode}")
    print(_common.table(
        ["path", "writes/job", "jobs/s", "POSTs/job", "lines"],
        [[r["name"], f"{sum(r['counts'].values()) / n:.2f}", f"{n / r['elapsed']:.0f}",
          f"{r['posts'] / n:.2f}", str(r["lines"])] for r in rows],
    ))
    for r in rows:
        kinds = ", ".join(f"{kind} {count / n:.2f}" for kind, count in r["counts"].most_common())
        print(f"{r['name']}: {kinds}")
    # Disposal is batched by timing (how many acknowledgements one write carries varies
    # run to run), so the per-job steps are also given without it: the fold's claim is
    # one write less per job on the path every job takes.
    per_path: dict[str, list[float]] = {}
    for r in rows:
        counts = r["counts"]
        per_path.setdefault(r["name"], []).append(sum(counts.values()) / n)
        steps = sum(c for kind, c in counts.items() if not kind.startswith("dispose"))
        per_path.setdefault(f"{r['name']}_steps", []).append(steps / n)
    print(json.dumps({name: round(sum(v) / len(v), 3) for name, v in per_path.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
