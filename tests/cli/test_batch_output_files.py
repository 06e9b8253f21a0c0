"""What a batch writes is never what it reads, nor another file of the user's.

The second adversarial probe found the only guard comparing spelled paths: a symbolic
link to ``--out`` given as ``--errors`` emptied 5 committed lines (and the next run POSTed
those 5 again), a hard link to the jobs file emptied it, ``--errors STORE/data.mdb``
emptied the store before it opened, and ``--errors`` pointed at the ``--prices`` file
emptied it. Files are now told apart by identity (``cli/output_files.py``), and the errors
file is written beside its path and renamed over it at the end (``report.ErrorLog``).

And one store keeps one result log (``cli/store_binding.py``): two batches on one store
with different ``--out`` generated every job twice (400 POSTs for 200 jobs).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

import recoverable
from recoverable.cli import main

from .cli_helpers import job_line, read_results, run_cli, write_jobs

PRICES = {"gpt-test": {"input": 1.0, "cached_input": 0.5, "output": 2.0}}


def _stat(stdout: str, name: str) -> str:
    for line in stdout.splitlines():
        if line.startswith(name + " "):
            return line[len(name):].strip()
    raise AssertionError(f"no {name!r} in:\n{stdout}")


class _Files:
    """A committed batch: jobs, result log with two lines, its store, a price file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.jobs = write_jobs(root / "jobs.jsonl", [job_line(0), job_line(1)])
        self.out = root / "out.jsonl"
        self.store = root / "store"
        self.prices = root / "prices.json"
        self.prices.write_text(json.dumps(PRICES))
        self.notes = root / "notes.txt"
        self.notes.write_text("my own notes\n")

    def batch(self, *extra: str) -> int:
        return main(["batch", str(self.jobs), "--out", str(self.out), "--store",
                     str(self.store), "--prices", str(self.prices), *extra])

    def contents(self) -> dict[str, bytes]:
        files = [self.jobs, self.out, self.prices, self.notes, self.store / "data.mdb"]
        return {str(path): path.read_bytes() for path in files}


@pytest.fixture
def committed(tmp_path: Path) -> _Files:
    files = _Files(tmp_path)
    assert files.batch() == 0
    assert len(read_results(files.out)) == 2
    return files


def _symlink_to_out(files: _Files) -> list[str]:
    link = files.root / "errors-link.jsonl"
    link.symlink_to(files.out)
    return ["--errors", str(link)]


def _hard_link_to_jobs(files: _Files) -> list[str]:
    link = files.root / "errors-hard.jsonl"
    os.link(files.jobs, link)
    return ["--errors", str(link)]


def _relative_name_of_out(files: _Files) -> list[str]:
    return ["--errors", os.path.relpath(files.out)]


# (name, the options that make the batch write over something, what the message says)
REFUSED: list[tuple[str, Callable[[_Files], list[str]], str]] = [
    ("errors-is-a-symlink-to-out", _symlink_to_out, "is the result log (--out) itself"),
    ("errors-is-a-hard-link-to-the-jobs", _hard_link_to_jobs, "is the jobs file itself"),
    ("errors-is-out-by-another-name", _relative_name_of_out, "is the result log (--out)"),
    ("errors-is-the-store-data-file", lambda f: ["--errors", str(f.store / "data.mdb")],
     "is inside the store"),
    ("errors-is-the-store-lock-file", lambda f: ["--errors", str(f.store / "lock.mdb")],
     "is inside the store"),
    ("errors-is-the-price-table", lambda f: ["--errors", str(f.prices)],
     "is the price table (--prices) itself"),
    ("errors-is-a-file-that-is-not-ours", lambda f: ["--errors", str(f.notes)],
     "is not an errors file written by recoverable batch"),
    ("errors-is-a-directory", lambda f: ["--errors", str(f.root)], "is not a regular file"),
]


@pytest.mark.parametrize(("name", "options", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_an_errors_file_that_is_another_file_is_refused_and_nothing_is_touched(
    committed: _Files, capsys: pytest.CaptureFixture[str], name: str,
    options: Callable[[_Files], list[str]], message: str,
) -> None:
    extra = options(committed)
    capsys.readouterr()
    before = committed.contents()
    assert committed.batch(*extra) == 2
    assert message in capsys.readouterr().err
    assert committed.contents() == before


def test_an_output_that_is_an_input_or_inside_the_store_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = _Files(tmp_path)
    files.store.mkdir()
    inside = files.store / "results.jsonl"
    for out, message in [
        (files.prices, "is the price table (--prices) itself"),
        (inside, "is inside the store"),
        (files.jobs, "is the jobs file itself"),
    ]:
        before = files.prices.read_bytes(), files.jobs.read_bytes()
        assert main(["batch", str(files.jobs), "--out", str(out), "--store",
                     str(files.store), "--prices", str(files.prices)]) == 2
        assert message in capsys.readouterr().err
        assert (files.prices.read_bytes(), files.jobs.read_bytes()) == before
        assert not inside.exists()
    assert main(["batch", str(files.jobs), "--out", str(files.out), "--store",
                 str(files.jobs)]) == 2
    assert "--store" in capsys.readouterr().err and not files.out.exists()


def test_the_errors_file_replaces_its_link_and_its_previous_run_never_the_target(
    tmp_path: Path,
) -> None:
    """A link at ``--errors`` is replaced by the file, never written through; an errors
    file of an earlier run is replaced; a run refused before it started leaves it."""
    files = _Files(tmp_path)
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_bytes(b"")  # an empty file: acceptable as an errors file
    link = tmp_path / "errors.jsonl"
    link.symlink_to(elsewhere)
    bad = write_jobs(tmp_path / "jobs.jsonl", [job_line(0), "{not json"])
    assert main(["batch", str(bad), "--out", str(files.out), "--errors", str(link)]) == 1
    assert not link.is_symlink() and elsewhere.read_bytes() == b""
    (line,) = [json.loads(text) for text in link.read_text().splitlines()]
    assert line["code"] == "invalid_job_line" and line["line"] == 2
    # The next run replaces it (it is ours); a refused run leaves it as it was.
    assert main(["batch", str(bad), "--out", str(files.out), "--errors", str(link),
                 "--store", str(files.jobs)]) == 2
    assert json.loads(link.read_text())["line"] == 2
    write_jobs(bad, [job_line(0)])
    assert main(["batch", str(bad), "--out", str(files.out), "--errors", str(link)]) == 0
    assert link.read_bytes() == b""
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".recoverable-tmp")] == []


# -- one store, one result log ----------------------------------------------------------------


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_second_result_log_on_one_store_is_refused_naming_the_first(
    committed: _Files, workers: str
) -> None:
    other = committed.root / "other.jsonl"
    proc = run_cli("batch", str(committed.jobs), "--out", str(other), "--store",
                   str(committed.store), "--workers", workers)
    assert proc.returncode == 2, proc.stderr
    assert f"in {committed.out} (the --out of its first batch)" in proc.stderr
    assert f"Rerun with --out {committed.out}" in proc.stderr
    assert read_results(other) == []
    with recoverable.RecoveryStore.open(str(committed.store)) as store:
        assert store.inventory()[0] == []  # nothing prepared (both jobs acknowledged)


def test_a_second_result_log_on_one_postgresql_store_is_refused(
    tmp_path: Path, pg_url: str
) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0)])
    first = run_cli("batch", str(jobs), "--out", str(tmp_path / "a.jsonl"), "--store", pg_url)
    assert first.returncode == 0, first.stderr
    second = run_cli("batch", str(jobs), "--out", str(tmp_path / "b.jsonl"), "--store",
                     pg_url, "--workers", "1")
    assert second.returncode == 2, second.stderr
    assert "a.jsonl (the --out of its first batch)" in second.stderr
    assert read_results(tmp_path / "b.jsonl") == []


def test_the_result_log_may_move_and_the_binding_follows_it(
    committed: _Files, capsys: pytest.CaptureFixture[str]
) -> None:
    moved = committed.root / "moved.jsonl"
    committed.out.rename(moved)
    jobs = write_jobs(committed.jobs, [job_line(0), job_line(1), job_line(2)])
    capsys.readouterr()
    assert main(["batch", str(jobs), "--out", str(moved), "--store",
                 str(committed.store)]) == 0
    stdout = capsys.readouterr().out
    assert _stat(stdout, "committed (earlier runs)") == "2"
    assert _stat(stdout, "POSTs (attempts spent)") == "1"  # only the new job
    # The old name is not the result log any more: a new file there is refused.
    assert main(["batch", str(jobs), "--out", str(committed.out), "--store",
                 str(committed.store)]) == 2
    assert f"in {moved}" in capsys.readouterr().err


@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_job_acknowledged_but_missing_from_the_result_log_is_not_generated_again(
    committed: _Files, workers: str
) -> None:
    """The result log lost its lines (emptied by hand): the jobs were acknowledged, so a
    rerun reports them `already_acknowledged` (the original operation named) and POSTs
    nothing, with and without workers."""
    lines = read_results(committed.out)
    committed.out.write_bytes(b"")
    rerun = run_cli("batch", str(committed.jobs), "--out", str(committed.out), "--store",
                    str(committed.store), "--workers", workers)
    assert rerun.returncode == 1, rerun.stderr
    assert _stat(rerun.stdout, "POSTs (attempts spent)") == "0"
    assert _stat(rerun.stdout, "failed") == "2"
    for line in lines:
        assert f"operation {line['operation_id']}" in rerun.stderr
    assert "already_acknowledged" in rerun.stderr and read_results(committed.out) == []
