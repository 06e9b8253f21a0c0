"""The LMDB recovery store (``recoverable.storage``).

``RecoveryStore`` is the entry point; mutations receive a ``WriteTxn``; leases are
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

try:  # the PostgreSQL store (recoverable[postgres]) registers postgresql:// URLs
    from recoverable.storage import pg_store as _pg_store
except ImportError:  # psycopg is not installed: RecoveryStore.open(url) says so
    pass
else:
    del _pg_store

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
