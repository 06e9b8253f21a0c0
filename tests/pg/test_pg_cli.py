"""The CLI on the PostgreSQL store (issue 17): ``db upgrade``, ``--store URL``, and no
password in anything the CLI prints."""

from __future__ import annotations

import psycopg

from recoverable.storage.pg_schema import SCHEMA_VERSION
from tests.cli.cli_helpers import run_cli
from tests.pg.cluster import Cluster
from tests.pg.fixtures import drop_database, new_database


def test_db_upgrade_migrates_once_then_reports_up_to_date(pg_cluster: Cluster) -> None:
    name = new_database(pg_cluster, template="template0")  # never migrated
    url = pg_cluster.url(name)
    try:
        first = run_cli("db", "upgrade", "--store", url)
        assert first.returncode == 0, first.stderr
        assert f"upgraded from version 0 to {SCHEMA_VERSION}" in first.stdout
        again = run_cli("db", "upgrade", "--store", url)
        assert again.returncode == 0 and "up to date" in again.stdout
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT version FROM recoverable_schema").fetchone() == (
                SCHEMA_VERSION,
            )
    finally:
        drop_database(pg_cluster, name)


def test_a_version_1_database_gains_the_sources_table(pg_cluster: Cluster) -> None:
    """A database migrated before the source manifest (issue 16) existed is brought to
    the current version by ``db upgrade``: the sources table is created."""
    name = new_database(pg_cluster, template="template0")
    url = pg_cluster.url(name)
    try:
        assert run_cli("db", "upgrade", "--store", url).returncode == 0
        with psycopg.connect(url, autocommit=True) as conn:  # as version 1 left it
            conn.execute("DROP TABLE recoverable_sources")
            conn.execute("UPDATE recoverable_schema SET version = 1")
        done = run_cli("db", "upgrade", "--store", url)
        assert done.returncode == 0, done
        assert f"from version 1 to {SCHEMA_VERSION}" in done.stdout, done
        with psycopg.connect(url) as conn:
            found = conn.execute("SELECT to_regclass('recoverable_sources')").fetchone()
            assert found is not None and found[0] is not None
    finally:
        drop_database(pg_cluster, name)


def test_db_upgrade_of_a_directory_is_a_usage_error(tmp_path: object) -> None:
    done = run_cli("db", "upgrade", "--store", str(tmp_path))
    assert done.returncode == 2 and "postgresql://" in done.stderr


def test_store_commands_take_a_url_and_never_print_its_password(
    pg_cluster: Cluster, pg_url: str
) -> None:
    inventory = run_cli("inventory", "--store", pg_url, "--account", "acct-1")
    assert inventory.returncode == 0, inventory.stderr
    assert "0 operation(s)" in inventory.stdout
    wrong = f"postgresql://postgres:hunter2@127.0.0.1:{pg_cluster.port}/no_such_db"
    for args in (
        ("inventory", "--store", wrong, "--account", "acct-1"),
        ("db", "upgrade", "--store", wrong),
    ):
        done = run_cli(*args)
        assert done.returncode != 0
        assert "hunter2" not in done.stdout + done.stderr
