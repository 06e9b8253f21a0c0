"""Opening: permissions, one environment per process per path, format version."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import lmdb
import pytest

from recoverable.errors import InvalidRequest, StorageUnavailable, UnsupportedRecordVersion
from recoverable.storage import RecoveryStore


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_directory_is_0700_and_files_0600_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "perm"
    old = os.umask(0)
    try:
        with RecoveryStore.open(path) as store:
            owner_file = path / "owners" / f"{store.owner_id}.lock"
            assert mode(path) == 0o700
            assert mode(path / "owners") == 0o700
            assert mode(path / "data.mdb") == 0o600
            assert mode(path / "lock.mdb") == 0o600
            assert mode(owner_file) == 0o600
    finally:
        os.umask(old)
    os.chmod(path, 0o755)  # loosened by someone: tightened again at open
    with RecoveryStore.open(path):
        assert mode(path) == 0o700


def test_second_open_in_a_process_reuses_the_store_until_the_last_close(tmp_path: Path) -> None:
    path = tmp_path / "shared"
    first = RecoveryStore.open(path)
    os.symlink(path, tmp_path / "alias")
    second = RecoveryStore.open(tmp_path / "alias")  # same directory through another name
    assert second is first
    first.close()
    assert not second.closed
    second.write_sync(lambda t: t.put_payload("k", "body", b"v"))
    second.close()
    assert first.closed
    with pytest.raises(StorageUnavailable):
        first.get_payload("k", "body")
    third = RecoveryStore.open(path)
    try:
        assert third is not first and third.owner_id != first.owner_id
        assert third.get_payload("k", "body") == b"v"
    finally:
        third.close()


def test_second_open_with_different_options_is_refused(tmp_path: Path) -> None:
    with RecoveryStore.open(tmp_path / "s", max_bytes=10_000_000) as store:
        with pytest.raises(ValueError, match="different options"):
            RecoveryStore.open(tmp_path / "s", max_bytes=20_000_000)
        assert not store.closed


def test_bad_options_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest):
        RecoveryStore.open(tmp_path / "x", max_bytes=0)
    with pytest.raises(InvalidRequest):
        RecoveryStore.open(tmp_path / "x", max_record_bytes=-1)


def test_unopenable_location_is_storage_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    with pytest.raises(StorageUnavailable):
        RecoveryStore.open(blocker / "store")


def test_an_unknown_store_format_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "future"
    with RecoveryStore.open(path):
        pass
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"format_version", (99).to_bytes(8, "big"), db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(UnsupportedRecordVersion, match="format 99"):
        RecoveryStore.open(path)
    assert os.listdir(path / "owners") == []  # nothing left behind by the failed open
