"""``recoverable source set KEY DIGEST | delete KEY --store DIR [--json]`` (issue 16), run
as a real process on a real store holding operations bound to a source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import recoverable
from recoverable.records import OperationRecord

from .cli_helpers import run_cli

ACCOUNT = recoverable.AccountBinding("acct-cli", "api-key")
pytestmark = pytest.mark.both_stores


def _bound(op_id: str, digest: str) -> OperationRecord:
    return OperationRecord(
        operation_id=op_id, account=ACCOUNT, endpoint_id="fixture", created_at=1.0,
        maximum_attempts=3, model="gpt-test", format_name="Answer", format_hash="fh",
        body_hash="bh", root_operation_id=op_id,
        source=recoverable.SourceRef("doc-1", digest), attempt_timeout=10.0,
    )


def _store(store_dir: Path | str) -> None:
    with recoverable.RecoveryStore.open(str(store_dir)) as store:
        store.set_source_sync("doc-1", "sha256:v1")
        store.write_sync(lambda txn: (
            txn.put_operation(_bound("op-old", "sha256:v1")),
            txn.put_operation(_bound("op-other", "sha256:v1")),
        ))


def test_source_set_supersedes_the_old_digests_operations(store_location: str) -> None:
    store_dir = store_location  # a directory (LMDB) or a database URL (PostgreSQL)
    _store(store_dir)
    done = run_cli("source", "set", "doc-1", "sha256:v2", "--store", str(store_dir), "--json")
    assert done.returncode == 0, done.stderr
    change = json.loads(done.stdout)
    assert change == {"key": "doc-1", "previous": "sha256:v1", "current": "sha256:v2",
                      "superseded": ["op-old", "op-other"], "superseded_total": 2,
                      "unreadable": [], "unreadable_total": 0}
    again = run_cli("source", "set", "doc-1", "sha256:v2", "--store", str(store_dir))
    assert again.returncode == 0, again.stderr
    assert again.stdout == "source doc-1: sha256:v2 -> sha256:v2; superseded 0 operation(s)\n"
    status = run_cli("status", "op-old", "--store", str(store_dir), "--account", "acct-cli")
    assert status.returncode == 0, status.stderr
    assert "superseded" in status.stdout and "source_changed" in status.stdout
    assert "doc-1 @ sha256:v1" in status.stdout


def test_source_delete_and_bad_input(tmp_path: Path, store_location: str) -> None:
    store_dir = store_location  # a directory (LMDB) or a database URL (PostgreSQL)
    _store(store_dir)
    deleted = run_cli("source", "delete", "doc-1", "--store", str(store_dir))
    assert deleted.returncode == 0, deleted.stderr
    assert deleted.stdout.splitlines() == [
        "source doc-1: sha256:v1 -> deleted; superseded 2 operation(s)",
        "  superseded op-old",
        "  superseded op-other",
    ]
    bad = run_cli("source", "set", "doc-1", "not a digest", "--store", str(store_dir), "--json")
    assert bad.returncode == 1
    assert json.loads(bad.stderr)["error"] == "invalid_parameter"
    with recoverable.RecoveryStore.open(str(store_dir)) as store:
        assert store.get_source("doc-1") is None  # nothing changed by the refused call
    missing = run_cli("source", "set", "k", "d", "--store", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "no recovery store" in missing.stderr
