"""Issue 10 (items 10-12), as real processes: the store operations act only within the
account given by ``--account``; ``recoverable retry`` links a new budget to a spent one
(and the batch follows the lineage); ``cancel`` of a saved result needs ``--force``."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import msgspec
import pytest

import recoverable

from .cli_helpers import job_line, read_results, run_cli, write_jobs

ACCOUNT = ("--account", "batch")  # the batch's account with the embedded fixture


def _stat(summary: str, name: str) -> str:
    for line in summary.splitlines():
        if line.startswith(name):
            return line[len(name):].strip()
    raise AssertionError(f"{name!r} not in the summary:\n{summary}")


@pytest.fixture(scope="module")
def _killed_batch_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(store, operation id) of a job killed right after its receipt was saved. Made once
    per module (a batch process and its SIGKILL); each test works on a copy of it."""
    tmp_path = tmp_path_factory.mktemp("killed-batch")
    store_dir = tmp_path / "store"
    jobs = write_jobs(tmp_path / "saved.jsonl", [job_line(3)])
    killed = run_cli("batch", str(jobs), "--out", str(tmp_path / "out.jsonl"), "--store",
                     str(store_dir), env={"RECOVERABLE_KILL_AT": "receipt.saved"})
    assert killed.returncode == -signal.SIGKILL
    listing = run_cli("inventory", "--store", str(store_dir), *ACCOUNT, "--json")
    (status,) = msgspec.json.decode(listing.stdout, type=recoverable.Inventory).operations
    assert status.has_saved_completion
    return store_dir, status.operation_id


@pytest.fixture
def saved_but_uncommitted(
    _killed_batch_store: tuple[Path, str], tmp_path: Path
) -> tuple[str, str]:
    """A fresh copy of that store (the writer was SIGKILLed and is gone: the files are
    what it left), and the operation id."""
    original, op_id = _killed_batch_store
    store_dir = tmp_path / "store"
    shutil.copytree(original, store_dir)
    return str(store_dir), op_id


def test_ops_commands_act_only_within_the_given_account(
    saved_but_uncommitted: tuple[str, str]
) -> None:
    s, op_id = saved_but_uncommitted
    # Read-only status without --account: redacted (it exists, nothing more).
    bare = run_cli("status", "--store", s, op_id, "--json")
    assert bare.returncode == 0, bare.stderr
    redacted = msgspec.json.decode(bare.stdout, type=recoverable.Status)
    assert redacted.redacted and redacted.job_id is None and not redacted.has_saved_completion
    human = run_cli("status", "--store", s, op_id)
    assert "gen-0003" not in human.stdout and "pass --account" in human.stderr
    # Everything else needs --account, and never borrows the operation's own.
    for command in ("acknowledge", "abandon", "suspend", "cancel", "receipt"):
        refused = run_cli(command, "--store", s, op_id)
        assert refused.returncode == 2 and "--account" in refused.stderr, command
    assert run_cli("inventory", "--store", s).returncode == 2
    # Another account: refused (exit 1), redacted, and nothing changed.
    other = ("--account", "someone-else")
    for command in ("acknowledge", "abandon", "suspend", "receipt"):
        refused = run_cli(command, "--store", s, *other, op_id)
        assert refused.returncode == 1 and "account_changed" in refused.stderr, command
    assert run_cli("cancel", "--store", s, *other, op_id, "--force").returncode == 1
    theirs = msgspec.json.decode(
        run_cli("status", "--store", s, *other, op_id, "--json").stdout, type=recoverable.Status
    )
    assert theirs.redacted
    empty = run_cli("inventory", "--store", s, *other, "--json")
    assert msgspec.json.decode(empty.stdout, type=recoverable.Inventory).operations == ()
    # The right account still finds the saved result intact.
    mine = msgspec.json.decode(
        run_cli("status", "--store", s, *ACCOUNT, op_id, "--json").stdout,
        type=recoverable.Status,
    )
    assert mine.state == "completed" and mine.has_saved_completion and mine.job_id == "gen-0003"
    assert run_cli("receipt", "--store", s, *ACCOUNT, op_id).returncode == 0


def test_cancel_of_a_saved_result_needs_force(saved_but_uncommitted: tuple[str, str]) -> None:
    s, op_id = saved_but_uncommitted
    refused = run_cli("cancel", "--store", s, *ACCOUNT, op_id)
    assert refused.returncode == 2
    assert "saved, validated result" in refused.stderr and "--force" in refused.stderr
    as_json = run_cli("cancel", "--store", s, *ACCOUNT, op_id, "--json")
    assert as_json.returncode == 2
    assert json.loads(as_json.stderr)["error"] == "completion_saved"
    assert run_cli("receipt", "--store", s, *ACCOUNT, op_id).returncode == 0  # still there
    forced = run_cli("cancel", "--store", s, *ACCOUNT, op_id, "--force")
    assert forced.returncode == 0, forced.stderr
    assert "is now cancelled" in forced.stdout
    gone = run_cli("receipt", "--store", s, *ACCOUNT, op_id)
    assert gone.returncode == 1 and "operation_cancelled" in gone.stderr


def test_retry_links_a_new_budget_and_the_batch_follows_the_lineage(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(1), job_line(2)])
    out = tmp_path / "out.jsonl"
    store_dir = tmp_path / "store"
    s = str(store_dir)
    base = ("batch", str(jobs), "--out", str(out), "--store", s, "--max-attempts", "2")
    failed = run_cli(*base, "--faults", "schema_violation=1.0")
    assert failed.returncode == 1
    # The hint is the linked retry, never "abandon, then rerun" (a fresh, unlinked budget).
    assert "abandon" not in failed.stderr
    assert "recoverable retry --store" in failed.stderr and "--action-id" in failed.stderr
    inventory = msgspec.json.decode(
        run_cli("inventory", "--store", s, *ACCOUNT, "--json").stdout, type=recoverable.Inventory
    )
    sources = {st.job_id: st for st in inventory.operations}
    source = sources["gen-0001"]
    assert source.state == "failed" and source.attempts_used == 1

    retried = run_cli("retry", "--store", s, *ACCOUNT, source.operation_id,
                      "--action-id", "retry-1", "--max-attempts", "3", "--json")
    assert retried.returncode == 0, retried.stderr
    successor = msgspec.json.decode(retried.stdout, type=recoverable.Status)
    assert successor.previous_operation_id == source.operation_id
    assert successor.maximum_attempts == 3 and successor.attempts_used == 0
    assert successor.job_id == "gen-0001" and successor.input_revision == "r1"
    # The same decision again: the same successor (idempotent); another one is refused.
    again = run_cli("retry", "--store", s, *ACCOUNT, source.operation_id,
                    "--action-id", "retry-1", "--max-attempts", "3")
    assert again.returncode == 0 and successor.operation_id in again.stdout
    other = run_cli("retry", "--store", s, *ACCOUNT, source.operation_id,
                    "--action-id", "retry-2")
    assert other.returncode == 1 and "retry_already_created" in other.stderr
    # Without --account, no retry.
    assert run_cli("retry", "--store", s, source.operation_id, "--action-id", "x").returncode == 2

    # The rerun runs the successor for gen-0001 (the source is never run again).
    rerun = run_cli(*base)
    assert rerun.returncode == 1  # gen-0002 stays failed: nobody retried it
    assert _stat(rerun.stdout, "POSTs (attempts spent)") == "1"
    (line,) = read_results(out)
    assert (line["id"], line["operation_id"]) == ("gen-0001", successor.operation_id)
    kept = msgspec.json.decode(
        run_cli("status", "--store", s, *ACCOUNT, source.operation_id, "--json").stdout,
        type=recoverable.Status,
    )
    assert kept.state == "failed" and kept.attempts_used == 1  # its history is unchanged
    assert kept.successor_id == successor.operation_id
