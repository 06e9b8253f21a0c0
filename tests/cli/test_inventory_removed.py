"""``inventory`` right after a batch: nothing is kept (every result was acknowledged once
written), and it says so with the counts of the removed operations' markers."""

from __future__ import annotations

import json
from pathlib import Path

from .cli_helpers import job_line, run_cli, write_jobs


def test_inventory_after_a_batch_counts_the_acknowledged_operations(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(3)])
    out = tmp_path / "out.jsonl"
    store = str(out) + ".store"
    batch = run_cli("batch", str(jobs), "--out", str(out))
    assert batch.returncode == 0, batch.stderr
    text = run_cli("inventory", "--store", store, "--account", "batch")
    assert text.returncode == 0, text.stderr
    assert ("0 operation(s) kept; 3 acknowledged operation(s) were removed"
            in text.stdout), text.stdout
    listing = json.loads(
        run_cli("inventory", "--store", store, "--account", "batch", "--json").stdout)
    assert listing["operations"] == [] and listing["total"] == 0
    assert listing["removed"] == {"acknowledged": 3, "abandoned": 0}
    # Another account's markers are not counted.
    other = json.loads(
        run_cli("inventory", "--store", store, "--account", "other", "--json").stdout)
    assert other["removed"] == {"acknowledged": 0, "abandoned": 0}
