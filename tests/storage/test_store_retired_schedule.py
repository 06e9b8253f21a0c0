"""A store written before issue 13.4 retired the ``schedule`` index keeps opening, and its
old schedule rows stay harmless: dropped at open (their bytes given back to the quota),
never interpreted, and any row that still appears is only counted."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

from storage_helpers import ACCOUNT, make_op

from recoverable.storage import RecoveryStore

DATA = Path(__file__).resolve().parents[1] / "data" / "store_with_schedule_rows.mdb.gz.hex"
OLD_BYTES_USED = 2707
OLD_ENTRIES = 10


def unpack_old_store(directory: Path) -> str:
    lines = [ln for ln in DATA.read_text().splitlines() if ln and not ln.startswith("#")]
    directory.mkdir()
    (directory / "data.mdb").write_bytes(gzip.decompress(bytes.fromhex("".join(lines))))
    return str(directory)


def old_schedule_key(next_attempt_at: float, operation_id: str) -> bytes:
    """The key the old code wrote (8 sortable bytes of the time, then the operation id)."""
    (bits,) = struct.unpack(">Q", struct.pack(">d", next_attempt_at))
    bits = bits ^ 0xFFFFFFFFFFFFFFFF if bits >> 63 else bits | (1 << 63)
    return struct.pack(">Q", bits) + operation_id.encode()


def test_an_old_store_opens_without_its_schedule_rows_and_stays_consistent(
    tmp_path: Path,
) -> None:
    path = unpack_old_store(tmp_path / "old")
    rows = [old_schedule_key(1_700_000_500.0, "wait-1"), old_schedule_key(-5.0, "wait-2")]
    with RecoveryStore.open(path) as store:
        assert [store.get_raw("schedule", key) for key in rows] == [None, None]
        stats = store.stats()
        assert stats["entries"] == OLD_ENTRIES - 2
        assert stats["bytes_used"] == OLD_BYTES_USED - sum(len(key) for key in rows)
        assert store.check_integrity() == []  # the counter matches what is stored
        # Everything else reads as before.
        waiting = store.get_operation("wait-1")
        assert waiting is not None and waiting.phase == "waiting"
        assert waiting.next_attempt_at == 1_700_000_500.0
        assert store.ids_by_job(ACCOUNT, "s", "j") == ["wait-2"]
        assert sorted(r.operation_id for r in store.inventory()[0]) == ["idle", "wait-1", "wait-2"]
        assert store.get_payload("wait-1", "completion") == b"{}"
        command = store.get_command("wait-2")
        assert command is not None and command.kind == "suspend"
        # Writes go on: moving and deleting operations the old index named.
        store.write_sync(
            lambda t: t.put_operation(make_op("wait-1", phase="transmitting", fence=1))
        )
        assert store.write_sync(lambda t: t.delete_operation("wait-2")) is True
        assert store.check_integrity() == []
    with RecoveryStore.open(path) as store:  # reopening changes nothing more
        assert store.check_integrity() == []
        assert store.stats()["entries"] == OLD_ENTRIES - 2 - 2  # wait-2 and its hosts row


def test_a_schedule_row_written_later_is_counted_never_interpreted(tmp_path: Path) -> None:
    # (e.g. by a process still running the old version on the same store)
    with RecoveryStore.open(tmp_path / "store") as store:
        store.write_sync(lambda t: t.put_operation(make_op("op", phase="waiting")))
        key = old_schedule_key(3.0, "gone")  # names no operation: the old check flagged it
        store.write_sync(lambda t: t.put_raw("schedule", key, b""))
        assert store.check_integrity() == []
        assert store.get_operation("op") is not None
