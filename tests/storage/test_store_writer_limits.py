"""The writer's rare branches (issue 12.6), each driven through real LMDB.

- the map full at its maximum size (a small maximum makes it reachable);
- ``MapResizedError`` after another *process* grew the map (write and read paths);
- a generic commit error (``EFBIG`` from a real ``RLIMIT_FSIZE`` in a child process);
- ``TxnFullError`` batch splitting. LMDB only raises it past ~131,072 dirty pages in
  one transaction (about 512 MiB written in one batch), which no test here can
  afford, so the error is raised by the mutation itself (the real ``lmdb`` class)
  while LMDB does everything else for real.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
from storage_helpers import read_line

from recoverable.errors import StorageLimitExceeded, StorageUnavailable
from recoverable.storage import RecoveryStore
from recoverable.storage.writer import MapGuard, MutationContext, Writer

DAMAGE_CHILD = str(Path(__file__).with_name("damage_child.py"))
MiB = 2**20


class RawContext(MutationContext):
    """What a mutation gets from a bare ``Writer``: the nested LMDB transaction."""

    def __init__(self, txn: lmdb.Transaction[bytes]) -> None:
        super().__init__()
        self.txn = txn


@pytest.fixture
def raw_env(tmp_path: Path) -> Iterator[lmdb.Environment]:
    env = lmdb.open(str(tmp_path / "env"), map_size=MiB, max_dbs=1, sync=True)
    yield env
    env.close()


def one_batch(
    writer: Writer[RawContext], mutations: list[Callable[[RawContext], Any]]
) -> list[Any]:
    """Run ``mutations`` in ONE batch: a first mutation holds the writer thread while the
    others are queued behind it. Returns each outcome (value or exception)."""
    entered, release = threading.Event(), threading.Event()

    def blocker(_: RawContext) -> None:
        entered.set()
        release.wait(60)

    first = threading.Thread(target=writer.write_sync, args=(blocker,))
    first.start()
    assert entered.wait(60)
    results: list[Any] = [None] * len(mutations)

    def run(i: int) -> None:
        try:
            results[i] = writer.write_sync(mutations[i])
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(mutations))]
    for thread in threads:
        thread.start()
    while writer.queued < len(mutations):  # all queued behind the blocker
        threading.Event().wait(0.001)
    release.set()
    first.join(60)
    for thread in threads:
        thread.join(60)
    return results


def put(key: bytes, value: bytes) -> Callable[[RawContext], None]:
    def mutation(ctx: RawContext) -> None:
        ctx.txn.put(key, value)

    return mutation


def test_map_full_at_its_maximum_is_a_typed_limit_and_spares_the_rest_of_the_batch(
    raw_env: lmdb.Environment,
) -> None:
    writer: Writer[RawContext] = Writer(raw_env, MapGuard(), RawContext, max_map_size=2 * MiB)
    try:
        writer.write_sync(put(b"a", b"x" * 400_000))
        small, huge = one_batch(writer, [put(b"b", b"y" * 1000), put(b"c", os.urandom(3 * MiB))])
        assert isinstance(huge, StorageLimitExceeded)
        assert "maximum" in str(huge)
        assert small is None  # committed: the huge write's limit is not its batch's
        assert writer.map_growths == 1
        assert raw_env.info()["map_size"] == 2 * MiB
        with raw_env.begin() as txn:
            assert txn.get(b"a") == b"x" * 400_000
            assert txn.get(b"b") == b"y" * 1000
            assert txn.get(b"c") is None  # nothing of the refused write
        writer.write_sync(put(b"d", b"z"))  # and the writer goes on
    finally:
        writer.stop()


def test_txn_full_splits_the_batch_so_only_the_oversized_write_fails(
    raw_env: lmdb.Environment,
) -> None:
    writer: Writer[RawContext] = Writer(raw_env, MapGuard(), RawContext, max_map_size=4 * MiB)
    aborted: list[str] = []

    def oversized(ctx: RawContext) -> None:
        ctx.txn.put(b"big", b"partial")
        ctx.on_abort(lambda: aborted.append("big"))
        raise lmdb.TxnFullError("injected: too many dirty pages for one transaction")

    try:
        results = one_batch(
            writer, [put(b"k1", b"1"), oversized, put(b"k2", b"2"), put(b"k3", b"3")]
        )
        assert results[0] is None and results[2] is None and results[3] is None
        assert isinstance(results[1], StorageLimitExceeded)
        assert "too large for one LMDB transaction" in str(results[1])
        assert aborted.count("big") >= 2  # its run in the batch, then its run alone
        with raw_env.begin() as txn:
            assert [txn.get(k) for k in (b"k1", b"k2", b"k3", b"big")] == [b"1", b"2", b"3", None]
    finally:
        writer.stop()


def spawn_serve(path: str, initial: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, DAMAGE_CHILD, "serve", path, str(initial)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def ask(proc: subprocess.Popen[str], command: str) -> str:
    assert proc.stdin is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return read_line(proc)


def test_a_map_grown_by_another_process_is_adopted_by_writes_and_reads(
    store_path: str,
) -> None:
    store = RecoveryStore.open(store_path, initial_map_size=MiB)
    other = spawn_serve(store_path, MiB)
    try:
        assert read_line(other).startswith("ready")
        assert ask(other, "payload big-1 1500000").startswith("ok")  # grows its map
        assert int(ask(other, "mapsize").split()[-1]) > MiB
        # Our map is now smaller than the data: the write meets MapResizedError first.
        store.write_sync(lambda t: t.put_payload("mine", "body", b"m"))
        assert store.stats()["map_adoptions"] == 1
        assert ask(other, "payload big-2 3000000").startswith("ok")  # grows it again
        big = store.get_payload("big-2", "body")  # the read path adopts it too
        assert big is not None and len(big) == 3_000_000
        assert store.stats()["map_size"] > 2 * MiB
        assert ask(other, "read mine").split()[:2] == ["ok", "read"]
    finally:
        assert other.stdin is not None
        other.stdin.close()
        assert other.wait(60) == 0
        store.close()


def test_a_generic_commit_error_is_storage_unavailable_and_the_store_goes_on(
    store_path: str,
) -> None:
    done = subprocess.run(
        [sys.executable, DAMAGE_CHILD, "file-size-limit", store_path], capture_output=True,
        text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("error storage_unavailable big"), lines
    assert lines[1].startswith("ok small-1"), lines
    with RecoveryStore.open(store_path) as store:
        assert store.get_payload("big", "body") is None
        assert store.get_payload("small-0", "body") == b"s"
        assert store.get_payload("small-1", "body") == b"s"
        assert store.check_integrity() == []


def test_storage_unavailable_is_the_base_of_the_new_typed_errors() -> None:
    from recoverable.errors import StoreDamaged, StoreLockReplaced

    assert issubclass(StoreDamaged, StorageUnavailable)
    assert issubclass(StoreLockReplaced, StorageUnavailable)
    assert (StoreDamaged.code, StoreLockReplaced.code) == ("store_damaged", "store_lock_replaced")
