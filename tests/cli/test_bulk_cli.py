"""``recoverable retry|cancel|suspend|acknowledge|abandon --filter ...``: the bulk form of
the single-operation commands, as real processes over a real LMDB store: ``--dry-run``
shows how many and which (and does nothing), ``--yes`` acts through the dashboard's own
function (``cli/bulk.py``), refusals are reported with their reasons, a repeated retry
with the same action id creates no second successor, and usage errors exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..dashboard.console_store import CUTOFF, fill
from ..dashboard.helpers import ACCOUNT_ID
from .cli_helpers import run_cli


def _status(store: Path, operation_id: str) -> dict[str, Any]:
    proc = run_cli("status", "--store", str(store), "--account", ACCOUNT_ID, operation_id,
                   "--json")
    assert proc.returncode == 0, proc.stderr
    status: dict[str, Any] = json.loads(proc.stdout)
    return status


def _bulk(store: Path, command: str, *extra: str) -> dict[str, Any]:
    proc = run_cli(command, "--store", str(store), "--account", ACCOUNT_ID, *extra, "--json")
    assert proc.returncode == 0, proc.stderr
    answer: dict[str, Any] = json.loads(proc.stdout)
    return answer


def test_dry_run_shows_how_many_and_which_and_does_nothing(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fill(str(store))
    spec = f"state=failed,code=server_error,since={CUTOFF}"
    seen = _bulk(store, "retry", "--filter", spec, "--dry-run", "--action-id", "bulk-cli-01")
    assert seen["dry_run"] is True and seen["selected"] == 3
    assert sorted(seen["operation_ids"]) == ["op-other-0", "op-se-1", "op-se-2"]
    assert seen["allowed"] == 2 and seen["refused"] == 1
    assert seen["reasons"] == [{"reason": "belongs to another account than --account",
                                "operations": 1}]
    assert seen["filter"] == {"state": "failed", "code": "server_error",
                              "since": "2026-12-01T10:00:00Z"}
    assert _status(store, "op-se-1")["successor_id"] is None  # nothing was done
    human = run_cli("cancel", "--store", str(store), "--account", ACCOUNT_ID, "--filter",
                    "model=gpt-b,state=completed", "--dry-run")
    assert human.returncode == 0, human.stderr
    assert human.stdout.startswith(
        "cancel (dry run, nothing done): 2 operation(s) match state=completed,model=gpt-b; "
        "0 allowed now, 2 refused\n")
    assert "refused 2: it has a saved, validated result" in human.stdout
    assert _status(store, "op-c-0")["state"] == "completed"


def test_yes_acts_reports_refusals_and_repeats_nothing(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fill(str(store))
    spec = f"state=failed,code=server_error,since={CUTOFF}"
    first = _bulk(store, "retry", "--filter", spec, "--yes", "--action-id", "bulk-cli-02",
                  "--max-attempts", "5", "--selection", "reselect")
    assert first["done"] == 2 and first["refused"] == 1 and first["selected"] == 3
    assert first["reasons"] == [{"reason": "not_allowed: belongs to another account than "
                                 "--account", "operations": 1}]
    successors = {}
    for source in ("op-se-1", "op-se-2"):
        successor = _status(store, source)["successor_id"]
        assert successor is not None
        successors[source] = successor
        assert _status(store, successor)["maximum_attempts"] == 5
    assert _status(store, "op-se-0")["successor_id"] is None  # before the cutoff
    # The same action id again: the same successors, no new one.
    again = _bulk(store, "retry", "--filter", spec, "--yes", "--action-id", "bulk-cli-02",
                  "--max-attempts", "5", "--selection", "reselect")
    assert again["done"] == 2
    for source, successor in successors.items():
        assert _status(store, source)["successor_id"] == successor
    prepared = _bulk(store, "suspend", "--filter", "state=prepared", "--dry-run")
    assert prepared["selected"] == 6  # the 4 prepared and the 2 successors: no third
    # Another action id: the successors exist, so it is refused with the reason.
    other = _bulk(store, "retry", "--filter", spec, "--yes", "--action-id", "bulk-cli-03")
    assert other["done"] == 0 and other["refused"] == 3
    assert any("successor" in reason["reason"] for reason in other["reasons"])
    # Suspend many, then acknowledge with --yes; human output.
    human = run_cli("suspend", "--store", str(store), "--account", ACCOUNT_ID, "--filter",
                    "q=batch-p", "--yes")
    assert human.returncode == 0, human.stderr
    assert ": 4 done, 0 refused, of 4 matching q=batch-p" in human.stdout
    assert _status(store, "op-p-3")["state"] == "suspended"
    done = _bulk(store, "acknowledge", "--filter", "state=completed", "--yes")
    assert done["done"] == 2 and _status(store, "op-c-1")["state"] == "acknowledged"


def test_bulk_usage_errors_exit_2(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fill(str(store))
    base = ("--store", str(store), "--account", ACCOUNT_ID)
    for argv, says in (
        (("cancel", *base, "--filter", "state=failed"), "--dry-run"),
        (("cancel", *base, "--filter", "state=failed", "--dry-run", "--yes"), "not allowed"),
        (("cancel", *base, "op-se-0", "--filter", "state=failed", "--yes"), "not both"),
        (("cancel", *base, "op-se-0", "--yes"), "go with --filter"),
        (("cancel", *base), "OPERATION_ID or --filter"),
        (("cancel", *base, "--filter", "colour=red", "--yes"), "KEY=VALUE"),
        (("cancel", *base, "--filter", "since=soon", "--yes"), "not a time"),
        (("cancel", *base, "--filter", "state=done", "--yes"), "state: one of"),
        (("retry", *base, "--filter", "state=failed", "--yes", "--action-id", "a b"),
         "--action-id"),
    ):
        proc = run_cli(*argv)
        assert proc.returncode == 2, (argv, proc.stdout, proc.stderr)
        assert says in proc.stderr, (argv, proc.stderr)
    assert _status(store, "op-se-0")["state"] == "failed"
