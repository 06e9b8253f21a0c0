"""pytest fixtures of the PostgreSQL store's tests (loaded by ``tests/conftest.py``).

``pg_cluster``: one throwaway cluster per test process (xdist worker), started on first
use, stopped at the end. ``pg_url``: a database for one test in the state of a freshly
migrated one. A database a finished test gave back is reused after a reset (every other
session on it terminated, every table emptied, the sequences restarted, the template's
rows put back): ``CREATE DATABASE`` writes the whole template (~8 MB) and took 40-170 ms
per test, a reset takes a few. One whose tables or columns a test changed (the migration
tests) is never reused: a new one is copied from the migrated template. A cluster that
cannot start FAILS the test that needs it, with the reason (never a skip).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from recoverable.storage import pg_schema
from tests.pg.cluster import Cluster, ClusterUnavailable, start_cluster

TEMPLATE = "recoverable_template"
_serial = itertools.count(1)
_POOL: list[str] = []  # databases given back by finished tests, reset before reuse
_SHAPE = (
    "SELECT c.relname, c.relkind, a.attname, format_type(a.atttypid, a.atttypmod)"
    " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
    " LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped"
    " WHERE n.nspname = 'public' AND c.relkind IN ('r', 'S')"
    " UNION ALL SELECT conname, 'c', pg_get_constraintdef(oid), '' FROM pg_constraint"
    " WHERE connamespace = 'public'::regnamespace ORDER BY 1, 2, 3"
)


class _Template:
    """What a freshly migrated database holds: its shape, and its rows per table."""

    shape: list[Any] = []
    rows: dict[str, list[Any]] = {}
    sequences: list[str] = []


def _prepare_template(cluster: Cluster) -> None:
    with psycopg.connect(cluster.url(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {TEMPLATE}")
    with psycopg.connect(cluster.url(TEMPLATE), autocommit=True) as conn:
        pg_schema.upgrade(conn)
        _Template.shape = conn.execute(_SHAPE).fetchall()
        tables = [row[0] for row in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1"
        )]
        _Template.rows = {
            table: conn.execute(f"SELECT * FROM {table}").fetchall() for table in tables
        }
        _Template.sequences = [row[0] for row in conn.execute(
            "SELECT sequencename FROM pg_sequences WHERE schemaname = 'public'"
        )]


def _reset(cluster: Cluster, name: str) -> bool:
    """Put a used database back in the template's state (False: it cannot be)."""
    try:
        with psycopg.connect(cluster.url(name), autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            if conn.execute(_SHAPE).fetchall() != _Template.shape:
                return False  # a test changed the schema: never reused
            with conn.transaction():
                conn.execute("SET LOCAL lock_timeout = '10s'")
                conn.execute("TRUNCATE " + ", ".join(_Template.rows))
                for sequence in _Template.sequences:
                    conn.execute(f"ALTER SEQUENCE {sequence} RESTART")
                for table, rows in _Template.rows.items():
                    for row in rows:
                        marks = ", ".join(["%s"] * len(row))
                        conn.execute(f"INSERT INTO {table} VALUES ({marks})", row)
        return True
    except psycopg.Error:
        return False


def _database(cluster: Cluster) -> str:
    while _POOL:
        name = _POOL.pop()
        if _reset(cluster, name):
            return name
    return new_database(cluster)


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
        cluster.stop(wait=False)


def new_database(cluster: Cluster, template: str = TEMPLATE) -> str:
    name = f"t{next(_serial)}"
    with psycopg.connect(cluster.url(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template}")
    return name


def drop_database(cluster: Cluster, name: str) -> None:
    with psycopg.connect(cluster.url(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def pg_url(pg_cluster: Cluster) -> Iterator[str]:
    """The URL of a database in the state of a freshly migrated one (see the module doc).
    Never dropped (a drop costs a checkpoint): given back for the next test, and the whole
    cluster is removed at the end of the session."""
    name = _database(pg_cluster)
    yield pg_cluster.url(name)
    _POOL.append(name)


def other_owner_url(pg_url: str) -> str:
    """The same database by another URL: opened in this process it is a second owner, as
    another machine's process would be (one URL opened twice in a process is one store)."""
    return pg_url + "?sslmode=disable"


STORE_KINDS = ("lmdb", "postgresql")
"""The stores a test of the storage contract runs on; the first is the default."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "both_stores: each test of the module (or class, or function) that uses store_kind"
        " runs on every one of STORE_KINDS instead of the first (LMDB) alone",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One suite, two stores: a test marked ``both_stores`` (a module's ``pytestmark =
    pytest.mark.both_stores``) that uses ``store_kind`` (directly, or through
    ``store_location`` / a ``store`` fixture built on it) runs on each of ``STORE_KINDS``;
    any other test that uses it on LMDB alone (its id still says ``lmdb``)."""
    if "store_kind" in metafunc.fixturenames:
        both = metafunc.definition.get_closest_marker("both_stores") is not None
        metafunc.parametrize("store_kind", STORE_KINDS if both else STORE_KINDS[:1])


@pytest.fixture
def store_location(store_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """Where a test's store lives: ``tmp_path/"store"`` (LMDB), or a fresh PostgreSQL
    database's URL (the cluster is started only for the PostgreSQL runs)."""
    if store_kind == "postgresql":
        url: str = request.getfixturevalue("pg_url")
        return url
    return str(tmp_path / "store")
