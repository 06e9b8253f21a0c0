"""The batch and worker processes tune the garbage collector for a run, and give the
previous setting back (a host calling ``recoverable.cli.main`` in-process keeps its own)."""

from __future__ import annotations

import gc
from pathlib import Path

from recoverable.cli import main
from recoverable.cli.gc_tuning import RUN_THRESHOLDS, tuned_collector

from .cli_helpers import job_line, write_jobs


def test_the_run_setting_applies_inside_and_the_old_one_comes_back() -> None:
    before = gc.get_threshold()
    frozen_before = gc.get_freeze_count()
    with tuned_collector():
        assert gc.get_threshold() == RUN_THRESHOLDS
        assert gc.get_freeze_count() > frozen_before  # what was alive is no longer walked
        assert gc.isenabled()  # cycles are still collected
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_an_in_process_batch_gives_the_collector_setting_back(tmp_path: Path) -> None:
    original = gc.get_threshold()
    gc.set_threshold(1234, 5, 6)
    try:
        jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(index) for index in range(3)])
        code = main(
            ["batch", str(jobs), "--out", str(tmp_path / "out.jsonl"),
             "--store", str(tmp_path / "store")]
        )
        assert code == 0
        assert gc.get_threshold() == (1234, 5, 6)
        assert gc.get_freeze_count() == 0
    finally:
        gc.set_threshold(*original)
