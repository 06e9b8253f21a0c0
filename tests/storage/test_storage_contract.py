"""The storage contract: the actors know a store only through the Protocols of
``recoverable.storage.base``; ``RecoveryStore`` implements every member of them (mypy checks
the signatures in ``storage/store.py``; this checks the names at run time). Below it, the
seam (``storage/engine.py``): every engine implements every member of ``StoreEngine``, the
engines are siblings, and only ``storage/`` names an engine."""

from __future__ import annotations

import ast
from pathlib import Path

from recoverable.storage import RecordReader, RecoveryStore, Store, WriteTransaction, WriteTxn
from recoverable.storage.engine import StoreEngine
from recoverable.storage.lmdb_engine import LmdbEngine
from recoverable.storage.pg_engine import PgEngine

ROOT = Path(__file__).resolve().parents[2]
# The LMDB implementation modules: an actor importing one of them is tied to LMDB.
LMDB_MODULES = {
    "recoverable.storage.store",
    "recoverable.storage.txn",
    "recoverable.storage.rows",
    "recoverable.storage.queries",
    "recoverable.storage.registry",
    "recoverable.storage.writer",
    "recoverable.storage.lmdb_engine",
    "recoverable.storage.pg_engine",
    "recoverable.storage.pg_writer",
}
ENGINE_MODULES = ("lmdb_engine", "pg_engine")


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


def test_every_engine_has_every_member_of_the_seam() -> None:
    members = _protocol_members(StoreEngine) | set(StoreEngine.__annotations__)
    assert {"read", "write", "write_sync", "owner_is_live", "last_txnid", "tables"} <= members
    for engine in (LmdbEngine, PgEngine):
        # Attributes set in __init__ are checked on an instance by the engines' own
        # suites; here, the methods and class attributes.
        declared = {name for name in members if name in vars(StoreEngine)}
        missing = sorted(name for name in declared if not hasattr(engine, name))
        assert missing == [], f"{engine.__name__} lacks {missing}"


def test_the_engines_are_siblings() -> None:
    assert not issubclass(PgEngine, LmdbEngine) and not issubclass(LmdbEngine, PgEngine)
    assert not issubclass(PgEngine, RecoveryStore) and not issubclass(LmdbEngine, RecoveryStore)
    assert LmdbEngine.__mro__[1:] == (object,) and PgEngine.__mro__[1:] == (object,)


def test_only_the_storage_package_names_an_engine() -> None:
    """An engine is reached through ``RecoveryStore.open`` (the URL scheme's registration),
    never imported by the actors, the facade, the CLI or the dashboard."""
    found = []
    for folder in ("actors", "transport", "src/recoverable"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            for module in ENGINE_MODULES:
                if f"storage.{module}" in text or f"import {module}" in text:
                    found.append(f"{path.relative_to(ROOT)} names {module}")
    assert found == [], found
