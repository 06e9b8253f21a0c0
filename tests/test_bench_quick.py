"""Benchmarks that cannot rot (issue 20): every ``bench/`` entry point runs its ``--quick``
mode here, as a real subprocess with this interpreter (its own fixture provider process,
real LMDB, real sockets), and must exit 0 and print its usual table or ratio line.

The scripts run one after another (the machine is small). Optional extras (the ``bench``
extra: DBOS, matplotlib) are never required: a script without them skips just that
baseline and says so, and these tests check that it says so instead of skipping.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
# Generous: a --quick run takes a few seconds; the bound only stops a hung script from
# hanging the suite on a loaded machine. 180 s was once not enough for memory.py --quick
# (18 s on an idle machine) in a CI run beside the 1,000-operation parked test.
TIMEOUT = 420.0


def run_quick(script: str, *extra: str, quick: bool = True) -> str:
    """Run ``bench/<script> --quick`` (plus ``extra``); return its stdout, checked rc 0."""
    argv = [sys.executable, str(BENCH / script), *(["--quick"] if quick else []), *extra]
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=BENCH.parent)
    took = time.monotonic() - t0
    print(f"{' '.join(argv[1:])}: {took:.1f} s")
    assert proc.returncode == 0, (
        f"{script} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
        f"stderr:\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def table_rows(out: str, first_cell: str) -> list[list[str]]:
    """Data rows of a fixed-width table whose rows start with ``first_cell``."""
    return [line.split() for line in out.splitlines() if line.split()[:1] == [first_cell]]


def test_every_bench_entry_point_is_covered() -> None:
    """A new script in bench/ must get a --quick test here (no script silently unrun)."""
    scripts = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    covered = {name for name, _ in ENTRY_POINTS}
    assert scripts == covered, f"add --quick tests for: {sorted(scripts - covered)}"
    for path in BENCH.glob("*.py"):
        if path.name.startswith("_"):
            continue
        assert "--quick" in path.read_text(), f"{path.name} has no --quick mode"


def check_harness(out: str) -> None:
    # --quick runs the faults scenario only (it runs every line the other one does).
    assert re.search(r"^faults: \(a\)/\(b\) = \d+\.\d\d", out, re.M), out
    # The realistic scenario (answers streamed in 20-50 deltas in --quick) runs too.
    assert re.search(r"^realistic: \(a\)/\(b\) = \d+\.\d\d", out, re.M), out
    assert "worker CPU % core" in out and "provider CPU % core" in out
    assert "(a) recoverable" in out and "(b) plain stream" in out and "(d) JSON files" in out
    assert re.search(r"'violations': \[\]", out), out
    if importlib.util.find_spec("dbos") is None:
        assert "skipped (c) DBOS/SQLite" in out, out
    else:
        assert re.search(r"^faults: .*\(a\)/\(c\) = ", out, re.M), out
    if importlib.util.find_spec("matplotlib") is None:
        # --quick writes no file (and so no PNG) unless --out is given.
        assert "no results file written" in out, out


def check_durable_vs_plain(out: str) -> None:
    rows = table_rows(out, "sse")
    assert [r[2] for r in rows] == ["plain", "durable"], out
    durable = rows[1]
    assert float(durable[4]) > 0  # the durable/plain ratio
    assert durable[-1] == "100", out  # POSTs: one per job, no retries


def check_durable_parts(out: str) -> None:
    assert "durable path parts, µs per call (200 records)" in out, out
    for part in ("governor admission read", "codec.decode_operation", "WriteTxn.put_operation",
                 "nested txn", "await store.write(no-op)"):
        assert part in out, out


def check_memory(out: str) -> None:
    rows = [line for line in out.splitlines() if "in flight" not in line and (
        line.strip().startswith(("plain stream", "durable,")))]
    assert len(rows) == 3, out
    assert re.search(r"slope after the first quarter [+-]\d+\.\d KiB per 1,000 jobs", out), out


def check_cancel_latency(out: str) -> None:
    rows = table_rows(out, "sse")
    assert len(rows) == 1, out
    row = rows[0]
    # samples, then "other outcomes", "not cancelled", "ops != 1 POST" all zero
    assert row[2] == "5" and row[-3:] == ["0", "0", "0"], out


def check_scheduler_lateness(out: str) -> None:
    assert "early wakes + early starts: 0 (target 0)" in out, out
    assert re.search(r"bare Scheduler\s+500\s", out), out
    assert "real ops: wake (sse)" in out and "real ops: attempt start (sse)" in out, out


def check_soak(out: str) -> None:
    # 1 kill is asked for; a host that finishes first is not killed (not a failure).
    assert re.search(r"^kills=[01] jobs=10 committed=\d+ failed=\d+ duplicates=0 losses=0", out,
                     re.M), out
    assert "VIOLATION" not in out


def check_soak_fleet(out: str) -> None:
    assert re.search(r"^store=lmdb jobs=12 signals=2 runs=3 committed=12 ", out, re.M), out
    assert "VIOLATION" not in out, out


def check_store_commit(out: str) -> None:
    ratios = re.findall(r"\|\s+(\d+\.\d)x$", out, re.M)
    assert len(ratios) == 3, out


def check_dashboard_scale(out: str) -> None:
    assert "2000 operations" in out, out
    assert re.search(r"walk: every page of /api/operations \(200\)\s+10\s", out), out
    assert "10 pages, 2000 rows" in out and "GET /operations deepest page" in out, out
    # The console: filtered pages and a bulk preview of the completed tenth (200 here).
    assert re.search(r"filtered list page, a new filter each time\s+5\s", out), out
    assert re.search(r"filtered list page, the same filter again\s+5\s", out), out
    assert re.search(r"bulk preview of 200 operations \(POST /bulk/preview\)\s+3\s", out), out


def check_store_scale(out: str) -> None:
    assert "2000 operation records" in out, out
    assert "runtime.status(handle)" in out and "store.check_integrity()" in out, out
    assert re.search(r"store\.check_integrity\(\).*\b0 problems", out), out


def check_transport(out: str) -> None:
    rows = [line.split() for line in out.splitlines()
            if line.split()[:1] in (["websocket"], ["sse"])]
    assert len(rows) == 4, out
    assert all(r[3] == "0" for r in rows), out  # no failed stream


def check_workers(out: str) -> None:
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"])]
    assert [r[0] for r in rows] == ["0", "1", "2"], out
    for row in rows:
        # jobs, POSTs and committed lines agree: one POST and one line per job, no kill
        assert row[1] == row[6] == row[7] == "50" and row[8] == "0", out
    assert re.search(r"^ratio --workers 2 / --workers 0 = \d+\.\d\d$", out, re.M), out


def check_rate_limits(out: str) -> None:
    """bench/rate_limits.py (issue 29.6): batch --workers 2 --rpm 600, one burst of 1 s."""
    rows = table_rows(out, "2")
    assert len(rows) == 1, out
    row = rows[0]
    assert row[1:3] == ["600", "1"], out
    assert row[3] == row[4] == row[5], out  # jobs, POSTs, lines: one POST and line a job
    assert float(row[7]) > 0 and row[9:] == ["-", "-"], out  # 5 s: no 60 s window
    assert re.search(r"^burst 1 s: steady rate / rpm = \d\.\d{3}$", out, re.M), out


def check_sources(out: str) -> None:
    """bench/sources.py (issue 16): the manifest check on the receipt path, as ratios."""
    assert re.search(r"^manifest check: bound/plain in-txn = \d+\.\d\d, durable = \d+\.\d\d$",
                     out, re.M), out
    assert [row[0] for row in table_rows(out, "plain") + table_rows(out, "bound")] == [
        "plain", "bound"
    ], out


def check_live(out: str) -> None:
    rows = table_rows(out, "sse")
    assert len(rows) == 1, out
    row = rows[0]
    assert row[1] == "40" and float(row[4]) > 0 and float(row[7]) > 0, out  # both ratios
    assert row[-1] == "90", out  # POSTs: one per job (2 x 40, and 2 x 5 warm-up)
    assert re.search(r"^parser: \d+\.\d\d µs per delta event without on_delta", out, re.M), out


def check_reattach(out: str) -> None:
    rows = [line.split() for line in out.splitlines()
            if line.split()[:1] in (["faults"], ["cost"])]
    assert [(r[0], r[1]) for r in rows] == [
        ("faults", "no"), ("faults", "yes"), ("cost", "no"), ("cost", "yes")], out
    assert rows[2][3] == rows[3][3] == "1.000", out  # no faults: one POST per job
    assert re.search(r"^checkpoint cost \(no faults, same run\): writes/job ", out, re.M), out


def check_pg_cancel(out: str) -> None:
    for store in ("lmdb", "postgresql"):
        rows = table_rows(out, store)
        assert len(rows) == 1, out
        # 16 streams, 20 samples; "other outcomes", "not cancelled", "ops != 1 POST" zero
        assert rows[0][1:3] == ["16", "20"] and rows[0][-3:] == ["0", "0", "0"], out


def check_pg_store(out: str) -> None:
    library = {row[0]: row for row in (table_rows(out, "lmdb") + table_rows(out, "postgresql"))
               if len(row) == 9}
    assert set(library) == {"lmdb", "postgresql"}, out
    assert float(library["postgresql"][2]) > 0  # the ratio to LMDB
    fleet = [row for row in table_rows(out, "lmdb") + table_rows(out, "postgresql")
             if len(row) == 6]
    assert sorted((row[0], row[1]) for row in fleet) == [
        ("lmdb", "1"), ("lmdb", "2"), ("postgresql", "1"), ("postgresql", "2")
    ], out
    assert all(row[4] == row[5] == "30" for row in fleet), out  # one POST, one line a job
    if importlib.util.find_spec("dbos") is None:
        assert "DBOS: not installed" in out, out
    else:
        assert "recoverable on PostgreSQL / DBOS on PostgreSQL = " in out, out


def check_fleet(out: str) -> None:
    rows = [row for row in table_rows(out, "lmdb") + table_rows(out, "postgresql")
            if len(row) == 6]
    assert sorted((row[0], row[1]) for row in rows) == [
        ("lmdb", "0"), ("lmdb", "1"), ("lmdb", "2"),
        ("postgresql", "0"), ("postgresql", "1"), ("postgresql", "2"),
    ], out
    assert all(row[4] == row[5] == "60" for row in rows), out  # one POST, one line a job
    assert re.search(r"^PostgreSQL --workers 2 / --workers 1 = \d+\.\d\d", out, re.M), out
    assert re.search(r"^PostgreSQL / LMDB at --workers 1 = \d+\.\d\d", out, re.M), out


def check_pg_writers(out: str) -> None:
    for row in ("direct 1", "direct 2", "slow commit 1", "slow commit 2", "proxy 1", "proxy 2"):
        found = re.search(rf"^  {row} owner\(s\): +(\d+) writes/s$", out, re.M)
        assert found and int(found.group(1)) > 0, out
    assert re.search(r"^2 owners / 1 owner, direct: \d+\.\d\d$", out, re.M), out
    assert re.search(r"^2 owners / 1 owner, through the proxy: \d+\.\d\d$", out, re.M), out
    assert re.search(
        r"^2 owners / 1 owner, every commit \d+ ms slower: \d+\.\d\d$", out, re.M
    ), out


def check_claims(out: str) -> None:
    """bench/claims.py: two worker processes on one PostgreSQL database run every job once,
    and their claim rounds' reservations leave no claim lost to the other worker."""
    found = re.search(r"^ +all +(\d+) +(\d+) +(\d+)$", out, re.M)
    assert found is not None, out
    claimed, completed, busy = (int(group) for group in found.groups())
    assert completed == 60 and claimed == 60 and busy == 0, out
    assert re.search(r"^jobs/s \d+; busy per job 0\.000", out, re.M), out


def check_partial_json(out: str) -> None:
    assert "views read differently: 0" in out, out
    assert re.search(r"^handwritten / jiter = \d+\.\d\d$", out, re.M), out


def check_batch_writes(out: str) -> None:
    """bench/batch_writes.py (issue 34): the folded batch writes one store write less per
    job than prepare-then-send, and sends nothing twice."""
    written = json.loads(out.strip().splitlines()[-1])
    assert written["folded"] <= 3.5, out
    assert written["apart_steps"] - written["folded_steps"] >= 0.9, out
    assert re.search(r"^\s*folded\s+\d+\.\d\d\s+\d+\s+1\.00\s+50$", out, re.M), out


def check_durable_steps(out: str) -> None:
    """bench/durable_steps.py (issue 34): one park per durable boundary (five writes and
    the supervisor's task; the clock's timers left out), and a cancel scope only where a
    guarantee needs one: the supervisor's, the lease's watch, the interruptible stream and
    its transport deadline (none around a store write, none for a plain ``def`` policy)."""
    assert ("extra scope sites (>= 0.9/job): heartbeat.py:transport_scope, "
            "operation.py:run, send.py:_connect_and_send, supervisor.py:_supervise") in out, out
    found = re.search(r"^durable - plain, timers left out: task steps/job (\d+\.\d)", out,
                      re.M)
    assert found is not None and 7.0 <= float(found.group(1)) <= 9.0, out


ENTRY_POINTS = [
    ("durable_steps.py", check_durable_steps),
    ("batch_writes.py", check_batch_writes),
    ("harness.py", check_harness),
    ("live.py", check_live),
    ("durable_vs_plain.py", check_durable_vs_plain),
    ("durable_parts.py", check_durable_parts),
    ("memory.py", check_memory),
    ("cancel_latency.py", check_cancel_latency),
    ("dashboard_scale.py", check_dashboard_scale),
    ("scheduler_lateness.py", check_scheduler_lateness),
    ("soak.py", check_soak),
    ("soak_fleet.py", check_soak_fleet),
    ("sources.py", check_sources),
    ("store_commit.py", check_store_commit),
    ("store_scale.py", check_store_scale),
    ("transport.py", check_transport),
    ("workers.py", check_workers),
    ("rate_limits.py", check_rate_limits),
    ("reattach.py", check_reattach),
    ("pg_cancel.py", check_pg_cancel),
    ("pg_store.py", check_pg_store),
    ("fleet.py", check_fleet),
    ("pg_writers.py", check_pg_writers),
    ("claims.py", check_claims),
    ("partial_json.py", check_partial_json),
]


@pytest.mark.parametrize(("script", "check"), ENTRY_POINTS, ids=[n for n, _ in ENTRY_POINTS])
def test_quick_mode_runs_and_prints_its_table(script: str, check: object) -> None:
    out = run_quick(script)
    assert callable(check)
    check(out)


def test_scheduler_lateness_survives_operations_that_never_park() -> None:
    """Regression: with a cooldown that has passed before the failure is processed, the
    machine goes straight to the host's authorization (no ``scheduler.wait_until``); the
    bench crashed there with ``KeyError`` in its authorize. It now counts them."""
    out = run_quick(
        "scheduler_lateness.py", "--n", "1", "--lead", "0.05", "--real-n", "10",
        "--real-lead", "0", "--spread", "0", quick=False,
    )
    assert "early wakes + early starts: 0 (target 0)" in out, out
    assert "10 not parked (raise --real-lead)" in out, out


def test_scheduler_lateness_medium_parks_hundreds_over_sse_with_no_failure() -> None:
    """Issue 36: the size between ``--quick`` and the default (300 real operations parked
    over SSE, 2,000 bare waiters): every operation completes (no ``LeaseLost``), none
    starts early. Its lateness is printed, not asserted (a loaded machine is slow)."""
    out = run_quick("scheduler_lateness.py", "--medium", "--mode", "sse", quick=False)
    assert "early wakes + early starts: 0 (target 0)" in out, out
    assert "failed operations: 0 (target 0)" in out, out
    assert re.search(r"real ops: wake \(sse\)\s+\d+\s", out), out
    assert re.search(r"bare Scheduler\s+2000\s", out), out
