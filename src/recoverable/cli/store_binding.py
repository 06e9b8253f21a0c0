"""One store, one result log: which ``--out`` file holds a store's batch results.

A batch acknowledges each job's operation once its line is in the result log, and
acknowledging removes the operation's content from the store: from then on, the result
log is the only place that says the job is done. A second batch on the same store with
another ``--out`` cannot see those lines, so it prepared and generated every acknowledged
job again (and, racing the first, had its waits fail ``state_unavailable`` when the other
acknowledged first).

So a store records, per account, the result log of its batches: the first batch that
runs on it binds it (the resolved path of its ``--out``, the file's device and inode, and
the machine's host name, in the store's ``meta`` table), and every later batch of that
account must write to the same file. The same file under another name (moved on the same
machine: same device and inode) is accepted and the binding follows it; another file is
refused before anything runs, with the first file named. A binding that cannot be read is
refused too (fail closed). To start over with another result log, use another store.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
from typing import Final

import msgspec

from recoverable.storage.base import WriteTransaction
from recoverable.storage.store import RecoveryStore
from recoverable.types import AccountBinding

__all__ = ["ResultLogBinding", "bind_result_log", "binding_name"]

BINDING_VERSION: Final = 1


class ResultLogBinding(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The result log of one account's batches on a store."""

    version: int = BINDING_VERSION
    path: str  # its resolved path when bound (or when it last moved)
    host: str  # the machine it is on (a path names a file only on one machine)
    device: int
    inode: int


_encode = msgspec.msgpack.Encoder(order="deterministic").encode
_decode = msgspec.msgpack.Decoder(ResultLogBinding).decode


def binding_name(account: AccountBinding) -> str:
    """The preference row of ``account``'s binding (ASCII, bounded)."""
    digest = hashlib.blake2b(
        f"{account.account_id}\0{account.source}".encode("utf-8", "surrogatepass"),
        digest_size=16,
    ).hexdigest()
    return "result_log." + digest


def _bind(
    account: AccountBinding, current: ResultLogBinding, store_name: str, txn: WriteTransaction
) -> str | None:
    name = binding_name(account)
    raw = txn.get_raw("meta", b"preference." + name.encode("ascii"))
    if raw is not None:
        try:
            bound = _decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return (f"the store {store_name} records a result log for account "
                    f"{account.account_id!r} that cannot be read (corrupt_record): nothing "
                    "is run; use another --store")
        same_file = bound.host == current.host and (
            bound.path == current.path or (bound.device, bound.inode) == (current.device,
                                                                         current.inode)
        )
        if not same_file:
            where = "" if bound.host == current.host else f" on {bound.host}"
            return (f"the store {store_name} keeps the batch results of account "
                    f"{account.account_id!r} in {bound.path}{where} (the --out of its first "
                    f"batch), not in {current.path}: a second result log would generate "
                    f"and write every job again. Rerun with --out {bound.path}, or use "
                    "another --store for another result log")
        if bound == current:
            return None
    txn.put_preference(name, _encode(current))
    return None


def bind_result_log(
    store: RecoveryStore, account: AccountBinding, out_path: str, *, store_name: str
) -> str | None:
    """Bind the store's result log of ``account`` to ``out_path`` (an existing file) on
    the first batch, or check that it is the bound one; why not, if it is not (nothing
    changed then). Raises ``RecoveryError`` when the store cannot be written."""
    found = os.stat(out_path)
    current = ResultLogBinding(
        path=os.path.realpath(out_path), host=socket.gethostname(),
        device=found.st_dev, inode=found.st_ino,
    )
    return store.write_sync(functools.partial(_bind, account, current, store_name))
