"""The recovery store (``recoverable.storage``).

``RecoveryStore`` is the entry point, over an engine (``storage/engine.py``: LMDB, or
PostgreSQL when psycopg is installed); mutations receive a ``WriteTxn``; leases are
taken and released inside mutations with ``acquire_lease`` / ``release_lease``.
The contract a store implements (what the actors use) is ``storage.base``:
``Store``, ``WriteTransaction`` and ``RecordReader``.
"""

from importlib.util import find_spec as _find_spec

from recoverable.errors import InvalidRequest as _InvalidRequest
from recoverable.storage import migration as _migration  # registers the version-1 reader
from recoverable.storage.base import RecordReader, Store, WriteTransaction
from recoverable.storage.codec import (
    register_operation_upgrader,
    unregister_operation_upgrader,
)
from recoverable.storage.engine import StoreEngine as _StoreEngine
from recoverable.storage.leases import acquire_lease, release_lease, renew_leases
from recoverable.storage.registry import StoreOptions as _StoreOptions
from recoverable.storage.store import FORMAT_VERSION, TABLES, RecoveryStore, Table, WriteTxn
from recoverable.storage.store import POSTGRESQL_SCHEMES as _POSTGRESQL_SCHEMES
from recoverable.storage.store import register_url_store as _register_url_store

del _migration


def _open_postgresql(url: str, options: _StoreOptions) -> _StoreEngine:
    """The PostgreSQL engine (recoverable[postgres]), imported at the first
    ``postgresql://`` store a process opens: psycopg takes about 0.1 s to import, which
    a process on an LMDB store (every CLI command on one) never pays."""
    try:
        from recoverable.storage.pg_engine import PgEngine
    except ImportError as exc:  # psycopg is there but cannot load (no libpq, say)
        raise _InvalidRequest(
            f"the PostgreSQL store cannot be loaded ({exc}); reinstall it: "
            "pip install 'recoverable[postgres]'"
        ) from exc
    return PgEngine(url, options)


# postgresql:// URLs open the PostgreSQL engine when psycopg is installed; without it,
# RecoveryStore.open(url) says how to install it.
if _find_spec("psycopg") is not None:
    _register_url_store(_POSTGRESQL_SCHEMES, _open_postgresql)

__all__ = [
    "FORMAT_VERSION",
    "TABLES",
    "RecordReader",
    "RecoveryStore",
    "Store",
    "Table",
    "WriteTransaction",
    "WriteTxn",
    "acquire_lease",
    "register_operation_upgrader",
    "release_lease",
    "renew_leases",
    "unregister_operation_upgrader",
]
