"""The batch host's per-job reads leave the event loop on PostgreSQL.

A ``--workers N`` host waits on every job at once; on PostgreSQL each of its reads (is
the job already here? has its operation settled? what did it spend?) is a round trip.
Made on the event loop they run one after another, and the host, not the workers, bounds
the fleet (measured through a 2 ms proxy: 22 jobs/s whatever the workers). They run in
worker threads (``RecoveryStore.read_off_loop``): this test runs a real ``batch
--workers 1`` host in this process (its worker is a real process) and counts the reads of
the host's store made on the event loop's thread: a handful, however many jobs.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from recoverable.cli import main as cli_main
from recoverable.storage.pg_engine import PgEngine

from .cli_helpers import assert_exactly_once, job_line, read_results, write_jobs

JOBS = 24
READS = ("get", "get_raw_rows", "get_raw_many", "ids_by_job", "last_txnid", "read")


def test_a_workers_host_makes_no_per_job_read_on_its_event_loop(
    tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_loop: collections.Counter[str] = collections.Counter()
    off_loop: collections.Counter[str] = collections.Counter()

    def counted(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def read(self: PgEngine, *args: Any, **kwargs: Any) -> Any:
            main = threading.current_thread() is threading.main_thread()
            (on_loop if main else off_loop)[name] += 1
            return method(self, *args, **kwargs)
        return read

    for name in READS:
        monkeypatch.setattr(PgEngine, name, counted(name, getattr(PgEngine, name)))
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(JOBS)])
    out = tmp_path / "out.jsonl"
    code = cli_main(["batch", str(jobs), "--out", str(out), "--store", pg_url,
                     "--workers", "1", "--concurrency", "8"])
    assert code == 0
    assert_exactly_once(read_results(out), {(f"gen-{i:04d}", "r1") for i in range(JOBS)})
    # Every job's lookup and settled reads ran off the loop...
    assert on_loop["ids_by_job"] == 0 and off_loop["ids_by_job"] >= JOBS
    assert on_loop["get_raw_rows"] == 0 and off_loop["get_raw_rows"] >= JOBS
    # ... and what stayed on it (opening, the sweep, the rate governor's shared pause
    # row, kept for a moment) does not grow with the jobs.
    assert sum(on_loop.values()) < JOBS, on_loop
