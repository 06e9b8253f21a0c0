"""Opening a store while another process is creating it (storage/creation.py).

LMDB makes ``lock.mdb`` first and ``data.mdb`` after, holding a POSIX record lock on the
lock file meanwhile. A real child process stands in for that creator: it makes the lock
file, holds the lock, and creates the store itself only when told to. An open in between
waits for it instead of calling the store damaged; with nobody holding the lock, a lock
file without its data file is damage, as before."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from recoverable.errors import StorageUnavailable, StoreDamaged
from recoverable.storage import RecoveryStore, creation
from tests.storage.storage_helpers import make_op

BOUND = 30.0

CREATOR = r"""
import fcntl, os, sys
path = sys.argv[1]
os.makedirs(path, exist_ok=True)
fd = os.open(os.path.join(path, "lock.mdb"), os.O_RDWR | os.O_CREAT, 0o600)
fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0)   # what LMDB holds while it creates the store
print("holding", flush=True)
if sys.stdin.readline().strip() == "create":
    import lmdb
    env = lmdb.open(path, subdir=True, max_dbs=16)   # LMDB makes data.mdb now
    print("created", flush=True)
    sys.stdin.readline()
    env.close()
"""


@contextmanager
def creator(path: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CREATOR, str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "holding"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(BOUND)


def test_an_open_during_another_process_creating_the_store_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "store"
    asked = threading.Event()
    real_holder = creation.lock_holder

    def holder(where: str) -> int | None:
        found = real_holder(where)
        asked.set()  # the open met the unfinished store and asked who holds its lock
        return found

    monkeypatch.setattr(creation, "lock_holder", holder)
    with creator(path) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        assert not (path / "data.mdb").exists()
        opened: list[RecoveryStore | BaseException] = []

        def open_store() -> None:
            try:
                opened.append(RecoveryStore.open(str(path)))
            except BaseException as exc:
                opened.append(exc)

        thread = threading.Thread(target=open_store)
        thread.start()
        assert asked.wait(BOUND)
        assert not opened, opened  # still waiting: not refused as damaged
        proc.stdin.write("create\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "created"
        thread.join(BOUND)
        assert not thread.is_alive()
        (store,) = opened
        assert isinstance(store, RecoveryStore), store
        try:
            store.write_sync(lambda txn: txn.put_operation(make_op("op-1")))
            assert store.get_operation("op-1") is not None
        finally:
            store.close()
            proc.stdin.write("exit\n")
            proc.stdin.flush()


def test_a_creator_that_never_finishes_is_named_after_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(creation, "CREATION_WAIT_SECONDS", 0.2)
    path = tmp_path / "store"
    with creator(path) as proc:
        with pytest.raises(StorageUnavailable) as raised:
            RecoveryStore.open(str(path))
        assert f"pid {proc.pid}" in str(raised.value)
        assert "being created or used by another process" in str(raised.value)
        assert not isinstance(raised.value, StoreDamaged)
        assert not (path / "data.mdb").exists()  # nothing of the creator's was touched


def test_a_lock_file_nobody_holds_without_its_data_file_is_damage(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with creator(path) as proc:
        assert proc.stdin is not None
        proc.stdin.write("exit\n")  # the creator dies before making data.mdb
        proc.stdin.flush()
        proc.wait(BOUND)
    assert creation.lock_holder(str(path)) is None
    with pytest.raises(StoreDamaged, match=r"data\.mdb is missing"):
        RecoveryStore.open(str(path))
