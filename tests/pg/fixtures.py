"""pytest fixtures of the PostgreSQL store's tests (loaded by ``tests/conftest.py``).

``pg_cluster``: one throwaway cluster per test process (xdist worker), started on first
use, stopped at the end. ``pg_url``: a fresh database for one test, copied from a
migrated template (``CREATE DATABASE ... TEMPLATE``: a fraction of a second). A cluster that
cannot start FAILS the test that needs it, with the reason (never a skip).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from recoverable.storage import pg_schema

from tests.pg.cluster import Cluster, ClusterUnavailable, start_cluster

TEMPLATE = "recoverable_template"
_serial = itertools.count(1)


def _prepare_template(cluster: Cluster) -> None:
    with psycopg.connect(cluster.url(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {TEMPLATE}")
    with psycopg.connect(cluster.url(TEMPLATE), autocommit=True) as conn:
        pg_schema.upgrade(conn)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[Cluster]:
    try:
        cluster = start_cluster()
    except ClusterUnavailable as exc:
        pytest.fail(f"PostgreSQL could not start, so the PostgreSQL tests fail: {exc}")
    try:
        _prepare_template(cluster)
        yield cluster
    finally:
        cluster.stop()


def new_database(cluster: Cluster, template: str = TEMPLATE) -> str:
    name = f"t{next(_serial)}"
    with psycopg.connect(cluster.url(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template}")
    return name


def drop_database(cluster: Cluster, name: str) -> None:
    with psycopg.connect(cluster.url(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def pg_url(pg_cluster: Cluster) -> str:
    """The URL of a fresh, migrated database. Not dropped after the test (a drop costs a
    checkpoint): the whole cluster is removed at the end of the session."""
    return pg_cluster.url(new_database(pg_cluster))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One suite, two stores: a test module listing ``STORE_KINDS = ("lmdb",
    "postgresql")`` runs each test that uses ``store_kind`` (directly, or through
    ``store_location`` / a ``store`` fixture built on it) on both; others on LMDB only."""
    if "store_kind" in metafunc.fixturenames:
        metafunc.parametrize("store_kind", getattr(metafunc.module, "STORE_KINDS", ("lmdb",)))


@pytest.fixture
def store_location(store_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """Where a test's store lives: ``tmp_path/"store"`` (LMDB), or a fresh PostgreSQL
    database's URL (the cluster is started only for the PostgreSQL runs)."""
    if store_kind == "postgresql":
        url: str = request.getfixturevalue("pg_url")
        return url
    return str(tmp_path / "store")
