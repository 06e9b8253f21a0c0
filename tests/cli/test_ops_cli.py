"""The store operations (status, inventory, receipt, lifecycle, purge) as real processes."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import msgspec
import pytest
import trio

import recoverable
from recoverable.cli import main
from recoverable.cli.provider import FIXTURE_ACCOUNT

from .cli_helpers import job_line, read_results, run_cli, write_jobs

ACCOUNT = ("--account", "batch")  # the batch's account with the embedded fixture


def _prepare_idle_operations(store_dir: Path, n: int) -> list[str]:
    """Operations prepared in scope "batch" by the batch's account, never sent."""

    async def prepare() -> list[str]:
        store = recoverable.RecoveryStore.open(str(store_dir))
        backend = recoverable.ResponsesBackend(
            "http://127.0.0.1:9/v1",
            credentials=recoverable.StaticCredentials("sk-unused", account=FIXTURE_ACCOUNT),
            endpoint_id="fixture",
        )
        try:
            async with recoverable.open_runtime(store, backend, account=FIXTURE_ACCOUNT) as rt:
                ids = []
                for i in range(n):
                    line = job_line(100 + i)
                    handle = await rt.prepare(
                        recoverable.StructuredRequest(model="gpt-test", input=line["input"]),
                        response=recoverable.JsonSchema("label", line["schema"]),
                        maximum_attempts=3, scope="batch", job_id=line["id"],
                        input_revision="r1",
                    )
                    ids.append(handle.operation_id)
                return ids
        finally:
            store.close()

    return trio.run(prepare)


def test_ops_commands_on_a_store_made_by_a_batch(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    out = tmp_path / "out.jsonl"
    # Two jobs answered invalidly: failed operations, kept in the store.
    failing = write_jobs(tmp_path / "failing.jsonl", [job_line(1), job_line(2)])
    run = run_cli("batch", str(failing), "--out", str(out), "--store", str(store_dir),
                  "--faults", "schema_violation=1.0")
    assert run.returncode == 1
    # One job killed right after its receipt was saved: completed, not acknowledged.
    saved_job = write_jobs(tmp_path / "saved.jsonl", [job_line(3)])
    killed = run_cli("batch", str(saved_job), "--out", str(out), "--store", str(store_dir),
                     env={"RECOVERABLE_KILL_AT": "receipt.saved"})
    assert killed.returncode == -signal.SIGKILL
    assert read_results(out) == []
    idle = _prepare_idle_operations(store_dir, 2)
    s = str(store_dir)

    listing = run_cli("inventory", "--store", s, *ACCOUNT)
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.splitlines()[0].split() == [
        "OPERATION", "STATE", "AVAILABILITY", "ATTEMPTS", "JOB", "REVISION", "OWNER"]
    assert "5 operation(s)" in listing.stdout
    inventory = msgspec.json.decode(
        run_cli("inventory", "--store", s, *ACCOUNT, "--json").stdout, type=recoverable.Inventory
    )
    by_job = {st.job_id: st for st in inventory.operations}
    assert set(by_job) == {"gen-0001", "gen-0002", "gen-0003", "gen-0100", "gen-0101"}
    assert by_job["gen-0001"].state == "failed"
    assert by_job["gen-0003"].has_saved_completion
    failed_id = by_job["gen-0001"].operation_id
    done_id = by_job["gen-0003"].operation_id

    human = run_cli("status", "--store", s, *ACCOUNT, failed_id)
    assert human.returncode == 0
    assert "failed" in human.stdout and "gen-0001" in human.stdout
    assert "invalid_output" in human.stdout
    status = msgspec.json.decode(
        run_cli("status", "--store", s, *ACCOUNT, failed_id, "--json").stdout,
        type=recoverable.Status,
    )
    assert status.state == "failed" and status.attempts_used == 1 and status.scope == "batch"

    receipt_text = run_cli("receipt", "--store", s, *ACCOUNT, done_id)
    assert receipt_text.returncode == 0, receipt_text.stderr
    assert "result:" in receipt_text.stdout and '"label"' in receipt_text.stdout
    receipt_json = json.loads(run_cli("receipt", "--store", s, *ACCOUNT, done_id, "--json").stdout)
    assert receipt_json["job_id"] == "gen-0003"
    assert set(receipt_json["result"]) == {"label", "score"}
    receipt = msgspec.json.decode(json.dumps(receipt_json), type=recoverable.Receipt)
    assert msgspec.json.decode(receipt.payload) == receipt_json["result"]

    no_receipt = run_cli("receipt", "--store", s, *ACCOUNT, failed_id, "--json")
    assert no_receipt.returncode == 1
    assert json.loads(no_receipt.stderr)["error"] == "completion_unavailable"

    ack = run_cli("acknowledge", "--store", s, *ACCOUNT, done_id)
    assert ack.returncode == 0 and "now acknowledged" in ack.stdout
    gone = run_cli("receipt", "--store", s, *ACCOUNT, done_id)
    assert gone.returncode == 1 and "state_unavailable" in gone.stderr
    abandoned = msgspec.json.decode(
        run_cli("abandon", "--store", s, *ACCOUNT, failed_id, "--json").stdout,
        type=recoverable.Status,
    )
    assert abandoned.state == "abandoned"
    suspended = run_cli("suspend", "--store", s, *ACCOUNT, idle[0])
    assert suspended.returncode == 0 and "now suspended" in suspended.stdout
    cancelled = run_cli("cancel", "--store", s, *ACCOUNT, idle[1], "--json")
    assert msgspec.json.decode(cancelled.stdout, type=recoverable.Status).state == "cancelled"
    refused = run_cli("receipt", "--store", s, *ACCOUNT, idle[1])
    assert refused.returncode == 1 and "operation_cancelled" in refused.stderr
    states = {
        st.operation_id: st.state
        for st in msgspec.json.decode(
            run_cli("inventory", "--store", s, *ACCOUNT, "--json").stdout,
            type=recoverable.Inventory,
        ).operations
    }
    assert states[idle[0]] == "suspended" and states[idle[1]] == "cancelled"
    assert done_id not in states and failed_id not in states  # content removed

    purge = run_cli("purge", "--store", s, "--account", "batch")
    # RecoveryStore.purge_account exists: purge must really remove every idle record.
    assert purge.returncode == 0, purge.stderr
    # Three live records (gen-0002 failed, the suspended and the cancelled one) and the
    # two markers left by acknowledge and abandon.
    assert purge.stdout.startswith("purged 5 record(s) of account 'batch'"), purge.stdout
    assert "skipped" not in purge.stdout
    empty = msgspec.json.decode(
        run_cli("inventory", "--store", s, "--account", "batch", "--json").stdout,
        type=recoverable.Inventory,
    )
    assert empty.operations == ()
    again = run_cli("purge", "--store", s, "--account", "batch")
    assert again.returncode == 0 and again.stdout.startswith("purged 0 record(s)"), again.stdout


def test_usage_errors_exit_2_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # In-process (same code path as the script; no subprocess needed for argument errors).
    store_dir = tmp_path / "store"
    _prepare_idle_operations(store_dir, 1)
    s = str(store_dir)
    assert main(["status", "--store", s, "--account", "batch", "op_" + "0" * 32]) == 2
    assert "no operation" in capsys.readouterr().err
    assert main(["inventory", "--store", str(tmp_path / "missing"), "--account", "a"]) == 2
    assert "no recovery store" in capsys.readouterr().err
    assert main(["purge", "--store", s]) == 2
    assert "--account" in capsys.readouterr().err
    assert main(["status", "--store", s]) == 2  # OPERATION_ID is required
    assert main(["batch", "jobs.jsonl"]) == 2  # --out is required
    assert main(["batch", "j", "--out", "o", "--concurrency", "0"]) == 2
    assert main(["batch", "j", "--out", "o", "--max-attempts", "1001"]) == 2
    assert main(["batch", "j", "--out", "o", "--endpoint", "ftp://x", "--faults", "seed=1"]) == 2
    assert main(["fixture-provider", "--faults", "bogus=1"]) == 2
    capsys.readouterr()
    assert main(["inventory", "--store", s, "--account", "someone-else"]) == 0
    assert "0 operation(s)" in capsys.readouterr().out  # another account sees nothing


def test_the_script_entry_point_runs() -> None:
    helped = run_cli("--help")
    assert helped.returncode == 0 and "batch" in helped.stdout and "inventory" in helped.stdout


async def test_a_command_requested_of_a_running_process_is_reported_so_once_applied(
    tmp_path: Path,
) -> None:
    """Whether a suspend or cancel was requested of the process that runs the operation
    is what its write said, not what the CLI reads after it: that process may have applied
    the command row (and removed it) by then. A CI run printed "its pending continuation
    was cancelled" for a suspend the running batch had just applied. Here the read after
    finds no row and an unchanged record: requested or not, only the write can say."""
    from recoverable.cli.ops import _command_outcome, _snapshot
    from recoverable.testing import FixtureProvider
    from tests.runtime.conftest import ACCOUNT as RUNTIME_ACCOUNT
    from tests.runtime.conftest import REQUEST, Answer, make_backend

    async with FixtureProvider.serve() as provider:
        with recoverable.RecoveryStore.open(str(tmp_path / "store")) as store:
            async with make_backend(provider) as backend, recoverable.open_runtime(
                store, backend, account=RUNTIME_ACCOUNT
            ) as rt:
                handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
                op = handle.operation_id
                before = _snapshot(rt, op)
                status = rt.status_of(op)
                said = _command_outcome(rt, "suspend", op, status, before, True)
                assert said == (
                    f"suspend: requested; {op} is {status.state} in another process, which "
                    "applies the suspend at its next check (see `recoverable status`)\n"
                )
                said = _command_outcome(rt, "cancel", op, status, before, False)
                assert said.startswith(f"cancel: nothing to cancel: {op} is {status.state}")
