"""The recovery store (``recoverable.storage``).

``RecoveryStore`` is the entry point, over an engine (``storage/engine.py``: LMDB, or
PostgreSQL when psycopg is installed); mutations receive a ``WriteTxn``; leases are
taken and released inside mutations with ``acquire_lease`` / ``release_lease``.
The contract a store implements (what the actors use) is ``storage.base``:
``Store``, ``WriteTransaction`` and ``RecordReader``.
"""

from recoverable.storage import migration as _migration  # registers the version-1 reader
from recoverable.storage.base import RecordReader, Store, WriteTransaction
from recoverable.storage.codec import (
    register_operation_upgrader,
    unregister_operation_upgrader,
)
from recoverable.storage.leases import acquire_lease, release_lease, renew_leases
from recoverable.storage.store import FORMAT_VERSION, TABLES, RecoveryStore, Table, WriteTxn

del _migration

try:  # the PostgreSQL engine (recoverable[postgres]) registers postgresql:// URLs
    from recoverable.storage import pg_engine as _pg_engine
except ImportError:  # psycopg is not installed: RecoveryStore.open(url) says so
    pass
else:
    del _pg_engine

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
