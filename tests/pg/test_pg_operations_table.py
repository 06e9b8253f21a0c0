"""Issue 30, items 3 and 5: ``recoverable_operations`` as a relational table.

Typed columns projected from each record in the statement that writes it (schema version
3); a database written at version 2 gains them, filled from its records, with ``db
upgrade``; triggers refuse, whatever client writes, a falling fence or attempts count, a
finished phase made live again, a changed admission column or frozen body; and the
example queries of ``docs/fleet.md`` run as written. A real PostgreSQL cluster.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psycopg
import pytest

import recoverable
from recoverable.storage import codec
from recoverable.storage.keys import key_str
from recoverable.storage.pg_operations import COLUMNS, columns_of
from recoverable.storage.pg_schema import SCHEMA_VERSION
from recoverable.testing import FixtureProvider, Reply
from tests.cli.cli_helpers import run_cli
from tests.pg.cluster import Cluster
from tests.pg.fixtures import drop_database, new_database
from tests.runtime.conftest import ACCOUNT, Answer, Authorizer, make_backend

FLEET_DOC = Path(__file__).resolve().parents[2] / "docs" / "fleet.md"
NAMES = [name for name, _, _ in COLUMNS]


async def populate(url: str) -> dict[str, str]:
    """Operations in several phases, written by the library: name -> operation id."""
    policy = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
    found: dict[str, str] = {}
    async with FixtureProvider.serve() as provider:
        provider.script([
            Reply.complete({"answer": 1, "note": "done"}),
            Reply.rate_limited(0.0),
        ])
        with recoverable.RecoveryStore.open(url) as store:
            async with recoverable.open_runtime(
                store, make_backend(provider), account=ACCOUNT
            ) as rt:
                def request(text: str) -> recoverable.StructuredRequest:
                    return recoverable.StructuredRequest(
                        model="gpt-test", instructions="i", input=text
                    )

                done = await rt.prepare(request("done"), response=Answer, maximum_attempts=2,
                                        scope="fleet", job_id="job-done")
                await rt.send_recovering(done, response=Answer, authorize=Authorizer())
                failed = await rt.prepare(request("failed"), response=Answer,
                                          maximum_attempts=1, retry_policy=policy)
                with pytest.raises(recoverable.RecoveryError):
                    await rt.send_recovering(failed, response=Answer, authorize=Authorizer())
                prepared = await rt.prepare(request("prepared"), response=Answer,
                                            maximum_attempts=3)
                found = {"done": done.operation_id, "failed": failed.operation_id,
                         "prepared": prepared.operation_id}
    return found


def typed_rows(conn: psycopg.Connection[Any]) -> dict[str, tuple[Any, ...]]:
    rows = conn.execute(
        f"SELECT key, value, {', '.join(NAMES)} FROM recoverable_operations"
    ).fetchall()
    return {key_str(bytes(row[0])): row for row in rows}


def typed_rows_of(url: str) -> dict[str, tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return typed_rows(conn)


def expected(value: bytes) -> tuple[Any, ...]:
    """The projection as the database shows it (times as epoch seconds compared apart)."""
    return columns_of(value)


def assert_columns_match_records(conn: psycopg.Connection[Any]) -> None:
    rows = typed_rows(conn)
    assert rows
    for row in rows.values():
        want = expected(bytes(row[1]))
        got = row[2:]
        for name, have, should in zip(NAMES, got, want, strict=True):
            if name.endswith("_at"):
                assert (have is None) == (should is None), name
                if have is not None:
                    assert have.timestamp() == pytest.approx(should, abs=1e-5), name
            else:
                assert have == should, name


async def test_the_typed_columns_follow_every_write(pg_url: str) -> None:
    ids = await populate(pg_url)
    with psycopg.connect(pg_url) as conn:
        assert_columns_match_records(conn)
        phases = dict(conn.execute(
            "SELECT operation_id, phase FROM recoverable_operations"
        ).fetchall())
        assert phases[ids["done"]] == "completed"
        assert phases[ids["failed"]] == "failed"
        assert phases[ids["prepared"]] == "prepared"
        row = conn.execute(
            "SELECT fence, attempts_used, maximum_attempts, failure_reason, failure_code,"
            " scope, job_id, account_id, updated_at >= created_at"
            " FROM recoverable_operations WHERE operation_id = %s", (ids["failed"],)
        ).fetchone()
        assert row is not None and row[:4] == (1, 1, 1, "exhausted")
        assert row[4] in ("rate_limit_exceeded", "429")  # the provider's code, or the status
        assert row[5:] == (None, None, ACCOUNT.account_id, True)
        assert conn.execute(
            "SELECT scope, job_id FROM recoverable_operations WHERE operation_id = %s",
            (ids["done"],),
        ).fetchone() == ("fleet", "job-done")


async def test_a_version_2_database_gains_its_typed_columns_with_db_upgrade(
    pg_cluster: Cluster,
) -> None:
    """Records written as version 2 keeps them (key and value only) get their columns,
    filled from the records, their indexes and their guards, in place."""
    name = new_database(pg_cluster, template="template0")
    url = pg_cluster.url(name)
    try:
        assert run_cli("db", "upgrade", "--store", url).returncode == 0
        ids = await populate(url)
        with psycopg.connect(url, autocommit=True) as conn:  # as version 2 left it
            conn.execute("DROP TRIGGER recoverable_operations_guard ON recoverable_operations")
            conn.execute("DROP TRIGGER recoverable_body_frozen ON recoverable_payloads")
            conn.execute("DROP FUNCTION recoverable_operations_guard()")
            conn.execute("DROP FUNCTION recoverable_body_frozen()")
            for column in [*NAMES, "updated_at"]:
                conn.execute(f"ALTER TABLE recoverable_operations DROP COLUMN {column}")
            conn.execute("UPDATE recoverable_schema SET version = 2")
        done = run_cli("db", "upgrade", "--store", url)
        assert done.returncode == 0, done.stderr
        assert f"from version 2 to {SCHEMA_VERSION}" in done.stdout, done.stdout
        with psycopg.connect(url) as conn:
            assert_columns_match_records(conn)
            assert conn.execute(
                "SELECT phase FROM recoverable_operations WHERE operation_id = %s",
                (ids["done"],),
            ).fetchone() == ("completed",)
            with pytest.raises(psycopg.errors.CheckViolation):
                conn.execute("UPDATE recoverable_operations SET fence = fence - 1")
        with recoverable.RecoveryStore.open(url) as store:  # and the store reads it
            record = store.get_operation(ids["done"])
            assert record is not None and record.phase == "completed"
    finally:
        drop_database(pg_cluster, name)


@pytest.mark.parametrize(("rule", "statement"), [
    ("recoverable_fence_never_falls",
     "UPDATE recoverable_operations SET fence = fence - 1 WHERE operation_id = %(done)s"),
    ("recoverable_attempts_never_fall",
     "UPDATE recoverable_operations SET attempts_used = 0 WHERE operation_id = %(done)s"),
    ("recoverable_finished_stays_finished",
     "UPDATE recoverable_operations SET phase = 'waiting' WHERE operation_id = %(done)s"),
    ("recoverable_admission_fixed",
     "UPDATE recoverable_operations SET account_id = 'other' WHERE operation_id = %(done)s"),
    ("recoverable_admission_fixed",
     "UPDATE recoverable_operations SET job_id = 'other' WHERE operation_id = %(done)s"),
    ("recoverable_body_frozen",
     "UPDATE recoverable_payloads SET value = value || '\\x20'::bytea"
     " WHERE key = convert_to(%(done)s, 'UTF8') || '\\x00626f6479'::bytea"),
])
async def test_the_database_refuses_a_raw_write_that_undoes_progress(
    pg_url: str, rule: str, statement: str
) -> None:
    ids = await populate(pg_url)
    with psycopg.connect(pg_url) as conn:
        before = typed_rows(conn)
        with pytest.raises(psycopg.errors.CheckViolation) as refused:
            conn.execute(statement, ids)
        assert refused.value.diag.constraint_name == rule
        assert "recoverable:" in str(refused.value)
        conn.rollback()
        assert typed_rows(conn) == before  # nothing changed
        # What the rules allow: progress, the sign-in reopening, deleting (retention).
        conn.execute(
            "UPDATE recoverable_operations SET fence = fence + 1 WHERE operation_id = %s",
            (ids["prepared"],),
        )
        conn.execute("DELETE FROM recoverable_operations WHERE operation_id = %s",
                     (ids["failed"],))
        conn.commit()


async def test_the_sign_in_reopening_passes_the_guard(pg_url: str) -> None:
    ids = await populate(pg_url)
    with psycopg.connect(pg_url) as conn:
        conn.execute(
            "UPDATE recoverable_operations SET failure_reason = 'authentication_required'"
            " WHERE operation_id = %s", (ids["failed"],),
        )
        conn.execute(
            "UPDATE recoverable_operations SET phase = 'prepared' WHERE operation_id = %s",
            (ids["failed"],),
        )
        conn.commit()


def fleet_queries() -> list[str]:
    text = FLEET_DOC.read_text()
    section = text[text.index("## The operations table"):]
    return re.findall(r"```sql\n(.*?)```", section, re.S)


async def test_the_example_queries_of_the_fleet_doc_run(pg_url: str) -> None:
    ids = await populate(pg_url)
    queries = fleet_queries()
    assert len(queries) >= 3
    with psycopg.connect(pg_url) as conn:
        results = [conn.execute(query).fetchall() for query in queries]
        record = codec.decode_operation(bytes(typed_rows(conn)[ids["done"]][1]))
    failed_last_hour, by_phase, _ = results[:3]
    code = columns_of(bytes(typed_rows_of(pg_url)[ids["failed"]][1]))[NAMES.index("failure_code")]
    assert (code, "exhausted", 1) in [tuple(row) for row in failed_last_hour]
    assert {"completed", "failed", "prepared"} <= {row[1] for row in by_phase}
    assert record.phase == "completed"
