"""No row that every commit of the fleet updates (storage/pg_changes.py, storage/pg_sql.py):
a batch writes its own rows, its change row, its owner's commit count and its owner's
share of ``bytes_used``, and nothing another owner's batch writes too. The totals a
reader sees (``bytes_used``, the commit count) are what they were with one shared row."""

from __future__ import annotations

import psycopg

from recoverable.storage import RecoveryStore
from recoverable.storage.pg_engine import PgEngine
from tests.pg.fixtures import other_owner_url
from tests.storage.storage_helpers import make_op


def _meta_versions(conn: psycopg.Connection[object]) -> dict[bytes, str]:
    """Every physical ``meta`` row's version (its xmin changes whenever it is updated)."""
    return {
        bytes(key): str(xmin)
        for key, xmin in conn.execute("SELECT key, xmin::text FROM recoverable_meta")
    }


def test_commits_of_two_owners_update_no_shared_row(pg_url: str) -> None:
    """Operations written by two owners: no ``meta`` row changes (``bytes_used`` grows in
    each owner's row of ``recoverable_bytes``), each owner's commit count moves in its own
    ``recoverable_txn_log`` row, and the total the stores read is the stored size."""
    first = RecoveryStore.open(pg_url)
    second = RecoveryStore.open(other_owner_url(pg_url))
    try:
        assert isinstance(first.engine, PgEngine) and isinstance(second.engine, PgEngine)
        with psycopg.connect(pg_url, autocommit=True) as conn:
            before = _meta_versions(conn)
            used_before = first.stats()["bytes_used"]
            commits_before = first.engine.last_txnid()
            for index in range(3):
                first.write_sync(lambda txn, i=index: txn.put_operation(make_op(f"a-{i}")))
                second.write_sync(lambda txn, i=index: txn.put_operation(make_op(f"b-{i}")))
            assert _meta_versions(conn) == before
            shares = dict(conn.execute("SELECT owner_id, bytes FROM recoverable_bytes"))
            assert set(shares) == {first.owner_id, second.owner_id}
            assert all(share > 0 for share in shares.values())
            counts = dict(conn.execute(
                "SELECT owner_id, commits FROM recoverable_txn_log WHERE owner_id = ANY(%s)",
                ([first.owner_id, second.owner_id],),
            ))
            assert counts == {first.owner_id: 3, second.owner_id: 3}
        assert first.engine.last_txnid() == second.engine.last_txnid() == commits_before + 6
        used = first.stats()["bytes_used"]
        assert used == second.stats()["bytes_used"] == used_before + sum(shares.values())
        assert first.check_integrity() == []  # the total is the stored rows' size
    finally:
        second.close()
        first.close()


def test_a_closed_owners_share_is_folded_into_the_total(pg_url: str) -> None:
    """Closing an owner folds its ``bytes_used`` row into the ``meta`` row (so the rows
    do not pile up with every process that ever opened the store); the total is the
    same before and after, and still the stored size."""
    keeper = RecoveryStore.open(pg_url)
    try:
        with RecoveryStore.open(other_owner_url(pg_url)) as leaving:
            leaving.write_sync(lambda txn: txn.put_operation(make_op("gone-1")))
            total = leaving.stats()["bytes_used"]
            gone = leaving.owner_id
        assert keeper.stats()["bytes_used"] == total
        with psycopg.connect(pg_url, autocommit=True) as conn:
            owners = [row[0] for row in conn.execute("SELECT owner_id FROM recoverable_bytes")]
        assert gone not in owners
        assert keeper.check_integrity() == []
    finally:
        keeper.close()
