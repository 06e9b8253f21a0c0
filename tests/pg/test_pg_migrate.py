"""``recoverable migrate-store SRC DST`` (issue 17): an LMDB store's live operations move
to PostgreSQL and go on there: a saved receipt is delivered without a POST, a prepared
operation is sent, serials continue, nothing is lost or counted twice."""

from __future__ import annotations

from pathlib import Path

import recoverable
from recoverable.storage.keys import META_BYTES, META_SERIAL, u64
from recoverable.testing import FixtureProvider, Reply
from tests.cli.cli_helpers import run_cli
from tests.runtime.conftest import ACCOUNT, REQUEST, Answer, Authorizer, make_backend


async def test_live_operations_move_from_lmdb_to_postgresql(
    tmp_path: Path, pg_url: str
) -> None:
    lmdb_path = str(tmp_path / "store")
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.complete({"answer": 42, "note": "ok"})])
        store = recoverable.RecoveryStore.open(lmdb_path)
        try:
            async with recoverable.open_runtime(
                store, make_backend(provider), account=ACCOUNT
            ) as rt:
                done = await rt.prepare(REQUEST, response=Answer, maximum_attempts=3)
                assert await rt.send_recovering(
                    done, response=Answer, authorize=Authorizer()
                ) == Answer(42, "ok")
                waiting = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
                await rt.suspend(waiting)
            # A command row: the destination's serials must continue after it.
            store.write_sync(lambda txn: txn.put_command("phantom", "suspend", 1.0))
            # Open here: the move is refused (the source would go on changing).
            busy = run_cli("migrate-store", lmdb_path, pg_url)
            assert busy.returncode == 1 and "other process" in busy.stderr
            serial = u64(store.get_raw("meta", META_SERIAL))
            used = u64(store.get_raw("meta", META_BYTES))
            assert serial >= 1
        finally:
            store.close()
        moved = run_cli("migrate-store", lmdb_path, pg_url)
        assert moved.returncode == 0, moved.stderr
        assert "copied" in moved.stdout
        again = run_cli("migrate-store", lmdb_path, pg_url)
        assert again.returncode == 1 and "not empty" in again.stderr

        posts = len(provider.requests)
        provider.script([Reply.complete({"answer": 7, "note": "moved"})])
        pg = recoverable.RecoveryStore.open(pg_url)
        try:
            assert pg.check_integrity() == []
            assert u64(pg.get_raw("meta", META_BYTES)) == used
            async with recoverable.open_runtime(
                pg, make_backend(provider), account=ACCOUNT
            ) as rt:
                auth = Authorizer()
                assert await rt.send_recovering(
                    done, response=Answer, authorize=auth
                ) == Answer(42, "ok")
                assert auth.calls == [] and len(provider.requests) == posts
                assert await rt.send_recovering(
                    waiting, response=Answer, authorize=Authorizer()
                ) == Answer(7, "moved")
            assert u64(pg.get_raw("meta", META_SERIAL)) == serial
            fresh = pg.write_sync(lambda txn: txn.put_command("phantom-2", "cancel", 2.0))
            assert fresh.serial == serial + 1
            assert pg.check_integrity() == []
        finally:
            pg.close()


async def test_the_continuation_preference_and_the_source_manifest_move_too(
    tmp_path: Path, pg_url: str
) -> None:
    """Issue 18's store-wide preference (a ``meta`` row) and issue 16's manifest move
    with the operations: a store that had continuation turned on has it on after the
    move (before the fix the preference stayed behind and continuation silently stopped)."""
    lmdb_path = str(tmp_path / "store")
    with recoverable.RecoveryStore.open(lmdb_path) as store:
        on = await recoverable.set_continuation_preference(
            store, enabled=True, delay_seconds=7, budget=4
        )
        await store.set_source("doc-1", "sha256:v1")
    moved = run_cli("migrate-store", lmdb_path, pg_url)
    assert moved.returncode == 0, moved.stderr
    with recoverable.RecoveryStore.open(pg_url) as fleet:
        assert recoverable.continuation_preference(fleet) == on
        assert fleet.get_source("doc-1") is not None
        shown = run_cli("config", "get", "continuation.enabled", "--store", pg_url)
        assert shown.stdout == "continuation.enabled = true\n"
    back = str(tmp_path / "back")  # and back to a directory: the same rows
    moved = run_cli("migrate-store", pg_url, back)
    assert moved.returncode == 0, moved.stderr
    with recoverable.RecoveryStore.open(back) as store:
        assert recoverable.continuation_preference(store) == on
        assert store.get_source("doc-1") is not None
