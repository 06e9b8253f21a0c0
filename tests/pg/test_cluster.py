"""The throwaway cluster the PostgreSQL tests run against (issue 17, step 1)."""

from __future__ import annotations

import psycopg

from tests.pg.cluster import Cluster


def test_the_cluster_runs_on_loopback_with_fsync_on(pg_cluster: Cluster, pg_url: str) -> None:
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SHOW fsync").fetchone() == ("on",)
        assert conn.execute("SELECT inet_server_addr()::text").fetchone() == ("127.0.0.1/32",)
        assert conn.execute("SHOW port").fetchone() == (str(pg_cluster.port),)


def test_each_test_gets_its_own_database(pg_cluster: Cluster, pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE mine (x int)")
    with psycopg.connect(pg_cluster.url("recoverable_template")) as conn:
        found = conn.execute("SELECT to_regclass('mine')").fetchone()
    assert found == (None,)
