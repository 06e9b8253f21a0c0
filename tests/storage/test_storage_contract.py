"""The storage contract (issue 13.4): the actors know a store only through the Protocols of
``recoverable.storage.base``; the LMDB store implements every member of them (mypy checks
the signatures in ``storage/store.py``; this checks the names at run time)."""

from __future__ import annotations

import ast
from pathlib import Path

from recoverable.storage import RecordReader, RecoveryStore, Store, WriteTransaction, WriteTxn

ROOT = Path(__file__).resolve().parents[2]
# The LMDB implementation modules: an actor importing one of them is tied to LMDB.
LMDB_MODULES = {
    "recoverable.storage.store",
    "recoverable.storage.txn",
    "recoverable.storage.rows",
    "recoverable.storage.queries",
    "recoverable.storage.registry",
    "recoverable.storage.writer",
}


def _protocol_members(protocol: type) -> set[str]:
    members: set[str] = set()
    for klass in protocol.__mro__:
        if klass is object or klass.__name__ in ("Protocol", "Generic"):
            continue
        members |= {name for name in vars(klass) if not name.startswith("_")}
    return members


def test_the_actors_import_no_lmdb_store_module() -> None:
    found = []
    for path in sorted((ROOT / "actors").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in LMDB_MODULES:
                found.append(f"{path.name}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Import):
                found += [
                    f"{path.name}:{node.lineno} imports {alias.name}"
                    for alias in node.names
                    if alias.name in LMDB_MODULES
                ]
    assert found == []


def test_the_lmdb_store_has_every_member_of_the_contract() -> None:
    reader = _protocol_members(RecordReader)
    assert {"get_operation", "get_raw", "lease_is_live"} <= reader
    for implementation, protocol in ((RecoveryStore, Store), (WriteTxn, WriteTransaction)):
        members = _protocol_members(protocol)
        assert reader <= members
        missing = sorted(name for name in members if not hasattr(implementation, name))
        assert missing == [], f"{implementation.__name__} lacks {missing}"
