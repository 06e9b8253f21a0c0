"""Issue 14 (found by w-worker's bench): a healthy store whose last allocated pages were
never written is not "truncated".

LMDB does not write a page that a transaction allocated and freed again (a "loose" page,
``mdb_page_flush`` skips it): after such a commit ``data.mdb`` can be a few pages shorter
than ``(last_pgno + 1) * page size``, yet every page the snapshot uses is in the file. The
open-time check refused such a store as ``store_damaged: data.mdb is truncated`` — a new
worker process opening a busy store was refused ten times in a row. Only a page the
snapshot uses past the end of the file is damage (the half-truncated test stays so).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import lmdb

from recoverable.storage import RecoveryStore, integrity


def store_with_an_unwritten_tail(path: Path) -> dict[bytes, bytes]:
    """Seeded random transactions until a commit leaves the file shorter than its
    metadata's last page (then stop); return what the tables hold."""
    env = lmdb.open(str(path), map_size=256 << 20, max_dbs=4, writemap=False)
    dbs = [env.open_db(b"t%d" % i) for i in range(3)]
    rng = random.Random(1)
    content: dict[bytes, bytes] = {}
    try:
        for _ in range(3000):
            with env.begin(write=True) as txn:
                for _ in range(rng.randint(1, 40)):
                    index = rng.randrange(3)
                    mine = sorted(k for k in content if k[:1] == b"%d" % index)
                    if mine and rng.random() < 0.5:
                        key = rng.choice(mine)
                        txn.delete(key[1:], db=dbs[index])
                        del content[key]
                    else:
                        key = b"%08d" % rng.randrange(100000)
                        value = rng.randbytes(rng.choice([10, 100, 500, 3000, 9000]))
                        txn.put(key, value, db=dbs[index])
                        content[b"%d" % index + key] = value
            needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
            if os.path.getsize(path / "data.mdb") < needed:
                return content
        raise AssertionError("no commit left an unwritten tail (the seed no longer does)")
    finally:
        env.close()


def test_a_store_whose_last_pages_were_never_written_opens(tmp_path: Path) -> None:
    path = tmp_path / "store"
    path.mkdir()
    content = store_with_an_unwritten_tail(path)
    integrity.check_data_file(str(path))  # before the fix: StoreDamaged("... truncated")
    # LMDB reads every record back (no page it uses is past the end of the file).
    env = lmdb.open(str(path), max_dbs=4, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            for key, value in content.items():
                assert txn.get(key[1:], db=env.open_db(b"t" + key[:1], txn=txn)) == value
    finally:
        env.close()
    store = RecoveryStore.open(str(path))  # and the store opens (it adds its tables)
    try:
        assert store.queued() == []
    finally:
        store.close()
