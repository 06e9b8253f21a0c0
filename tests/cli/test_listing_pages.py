"""Long listings are printed a page at a time, with the total and the next cursor.

The probe: ``recoverable source set --json`` printed 1,500 superseded ids with no cap, and
``inventory`` printed every operation of the store. Now ``inventory`` prints at most
``--limit`` operations (default 1,000) in operation-id order, the total, and the cursor of
the next page (``--after ID``); ``source set``/``delete`` print at most ``--limit`` ids
(default 100) and the total. ``--limit 0`` prints everything (an explicit choice).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import recoverable
from recoverable.cli import main
from recoverable.records import OperationRecord

from ..storage.storage_helpers import ACCOUNT, make_op

OPERATIONS = 1_005  # one more page than the default limit's


def _bound(op_id: str) -> OperationRecord:
    return make_op(op_id, source=recoverable.SourceRef("doc-1", "sha256:v1"),
                   attempt_timeout=10.0)


@pytest.fixture
def store(tmp_path: Path) -> str:
    path = str(tmp_path / "store")
    with recoverable.RecoveryStore.open(path) as opened:
        opened.set_source_sync("doc-1", "sha256:v1")
        opened.write_sync(lambda txn: [
            txn.put_operation(_bound(f"op-{i:05d}")) for i in range(OPERATIONS)
        ])
    return path


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(list(args)) == 0
    return capsys.readouterr().out


def test_inventory_is_paged_with_its_total_and_next_cursor(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    account = ("--store", store, "--account", ACCOUNT.account_id)
    default = _run(capsys, "inventory", *account)
    assert len(default.splitlines()) == 1 + 1000 + 1  # header, the page, the count
    assert f"1000 of {OPERATIONS} operation(s) shown; next page: --after op-00999" in default
    seen: list[str] = []
    after: list[str] = []
    while True:
        listing = json.loads(_run(capsys, "inventory", *account, "--json", "--limit", "400",
                                  *after))
        assert listing["total"] == OPERATIONS and listing["unreadable_total"] == 0
        seen += [status["operation_id"] for status in listing["operations"]]
        if listing["next_after"] is None:
            break
        after = ["--after", listing["next_after"]]
    assert seen == [f"op-{i:05d}" for i in range(OPERATIONS)]  # every one once, in order
    everything = _run(capsys, "inventory", *account, "--limit", "0")
    assert f"{OPERATIONS} operation(s)" in everything


def test_a_source_change_prints_at_most_limit_ids_and_the_total(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    change = json.loads(_run(capsys, "source", "set", "doc-1", "sha256:v2", "--store", store,
                             "--json"))
    assert change["superseded_total"] == OPERATIONS
    assert change["superseded"] == [f"op-{i:05d}" for i in range(100)]
    text = _run(capsys, "source", "set", "doc-1", "sha256:v3", "--store", store)
    assert text.startswith("source doc-1: sha256:v2 -> sha256:v3; superseded 0 operation(s)")


def test_a_source_change_as_text_names_what_it_did_not_print(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "small")
    with recoverable.RecoveryStore.open(path) as opened:
        opened.set_source_sync("doc-1", "sha256:v1")
        opened.write_sync(lambda txn: [txn.put_operation(_bound(f"op-{i}")) for i in range(7)])
    text = _run(capsys, "source", "delete", "doc-1", "--store", path, "--limit", "3")
    lines = text.splitlines()
    assert lines[0].endswith("superseded 7 operation(s)")
    assert lines[1:] == ["  superseded op-0", "  superseded op-1", "  superseded op-2",
                         "  ... and 4 more superseded (--limit 0 shows all)"]


def test_a_limit_outside_its_range_is_a_usage_error(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for bad in ("-1", "1000001", "ten"):
        assert main(["inventory", "--store", store, "--account", "x", "--limit", bad]) == 2
        assert "--limit" in capsys.readouterr().err
