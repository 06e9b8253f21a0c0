"""Issue 28 item 5 on a real server and real processes: a store URL's password is never
printed (whatever it holds), a connection error tells the server's or libpq's reason,
``batch --workers`` gives its workers the URL in their environment (never on their
command line, which ``ps`` shows), and a worker whose database sessions are ended stops
with one typed line.

The test cluster authenticates by ``trust``: a password in the URL is sent by nobody and
checked by nobody, so the printing tests point at a database that does not exist. One
test adds a ``scram-sha-256`` line for a role of its own (``pg_hba.conf``, reloaded) to
check a real password, right and wrong.
"""

from __future__ import annotations

import re
import secrets
import signal
import subprocess
import time
import urllib.parse
from pathlib import Path

import psycopg
import pytest
import trio
from psycopg import sql

import recoverable
from recoverable.cli import main
from recoverable.cli.batch_workers import STORE_ENV
from recoverable.cli.exits import EXIT_STORE_LOST
from recoverable.storage.pg_schema import SCHEMA_VERSION
from tests.cli.cli_helpers import REPO, child_env, cli_command, job_line, run_cli, write_jobs
from tests.cli.test_batch_workers import worker_pids
from tests.cli.test_worker_cli import (
    ACCOUNT,
    KEY_ENV,
    backend,
    phases_reach,
    start_provider,
    stop,
    submit_all,
)
from tests.pg.cluster import Cluster

# Unencoded: libpq splits such a URL at the wrong place (its messages are then not shown).
MISREAD = "Sup3r/{tag}?r#e@t:X"
# Unencoded too, but libpq reads it as written ('?' and '#' before the '@'): its reason
# for a failure is shown, with the password scrubbed.
READABLE = "Sup3r?{tag}#r3t"


def fragments(password: str) -> set[str]:
    """The password, and every piece of it a URL parser could show on its own."""
    decoded = urllib.parse.unquote(password)
    pieces = {password, decoded, urllib.parse.quote(decoded, safe="")}
    for text in (password, decoded):
        pieces.update(piece for piece in re.split(r"[/?#@:%]", text) if len(piece) >= 3)
    return pieces


def assert_hidden(text: str, password: str) -> None:
    for piece in fragments(password):
        assert piece not in text, (piece, text)


def url_with(cluster: Cluster, password: str, database: str, user: str = "postgres") -> str:
    return f"postgresql://{user}:{password}@{cluster.host}:{cluster.port}/{database}"


def command_args(command: str, url: str, tmp_path: Path) -> list[str]:
    if command == "db upgrade":
        return ["db", "upgrade", "--store", url]
    if command == "inventory":
        return ["inventory", "--store", url, "--account", "acct-1"]
    if command == "batch":
        jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0)])
        return ["batch", str(jobs), "--out", str(tmp_path / "out.jsonl"), "--store", url]
    source = tmp_path / "source"
    if not source.exists():
        recoverable.RecoveryStore.open(str(source)).close()  # an empty LMDB store
    return ["migrate-store", str(source), url]


@pytest.mark.parametrize("command", ["db upgrade", "inventory", "batch", "migrate-store"])
def test_a_hostile_password_is_never_printed_and_the_reason_is(
    pg_cluster: Cluster, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process (``main``, as the script runs it): the same text, without a process
    start per case. Each case has a password of its own: one a case before it connected
    with is scrubbed from every later message of the process (``redact.remember``)."""
    tag = "C" + secrets.token_hex(3)
    for template in (MISREAD, READABLE):
        password = template.format(tag=tag)
        url = url_with(pg_cluster, password, "no_such_database")
        code = main(command_args(command, url, tmp_path))
        captured = capsys.readouterr()
        text = captured.out + captured.err
        assert code in (1, 2), text
        assert_hidden(text, password)
        assert "postgres:***@" in text, text  # the store is named, redacted
        if template == READABLE:  # the server's reason (issue 28 item 3)
            assert 'database "no_such_database" does not exist' in text, text
        else:
            assert "not shown: libpq reads this URL differently" in text, text


def _scram_role(cluster: Cluster, password: str) -> str:
    """A role whose password the server checks (its own scram-sha-256 line, ahead of the
    cluster's trust lines)."""
    role = f"app_{secrets.token_hex(4)}"
    with psycopg.connect(cluster.url(), autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN SUPERUSER PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(password)
            )
        )
    hba = cluster.data / "pg_hba.conf"
    hba.write_text(f"host all {role} 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
    with psycopg.connect(cluster.url(), autocommit=True) as conn:
        conn.execute("SELECT pg_reload_conf()")
    # The reload is asynchronous: poll until a wrong password is refused.
    wrong = url_with(cluster, "not-it", "postgres", user=role)
    deadline = time.monotonic() + 20
    while True:
        try:
            psycopg.connect(wrong, connect_timeout=5).close()
        except psycopg.OperationalError as exc:
            if "password authentication failed" in str(exc):
                return role
        if time.monotonic() > deadline:
            raise AssertionError("the server never asked for the password")
        time.sleep(0.02)  # polling the server's state, not a correctness sleep


def test_a_checked_password_works_encoded_and_a_wrong_one_is_told_without_it(
    pg_cluster: Cluster, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    password = "Sup3r/S3c?r#e@t:X"
    role = _scram_role(pg_cluster, password)
    database = pg_url.rsplit("/", 1)[1]
    encoded = url_with(pg_cluster, urllib.parse.quote(password, safe=""), database, role)
    done = run_cli("db", "upgrade", "--store", encoded)
    assert done.returncode == 0, done.stderr
    assert f"schema version {SCHEMA_VERSION}, up to date" in done.stdout
    assert f"{role}:***@" in done.stdout
    assert_hidden(done.stdout + done.stderr, password)

    wrong_password = "Wr0ng/Pa55?w#rd" + secrets.token_hex(3)
    wrong = url_with(pg_cluster, urllib.parse.quote(wrong_password, safe=""), database, role)
    for args in (["db", "upgrade", "--store", wrong],
                 ["inventory", "--store", wrong, "--account", "acct-1"]):
        code = main(args)  # in process: the same text, without a process start
        captured = capsys.readouterr()
        text = captured.out + captured.err
        assert code in (1, 2), text
        assert f'password authentication failed for user "{role}"' in text, text
        assert_hidden(text, wrong_password)
        assert_hidden(text, password)


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return [part.decode() for part in fh.read().split(b"\0") if part]


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        pairs = [part.decode().partition("=") for part in fh.read().split(b"\0") if part]
    return {name: value for name, _, value in pairs}


def test_batch_workers_get_the_store_url_in_their_environment_not_on_their_command_line(
    pg_cluster: Cluster, pg_url: str, tmp_path: Path
) -> None:
    password = "Ps%2FSup3r%40S3cret"  # the trust cluster never checks it
    url = pg_url.replace("postgres@", f"postgres:{password}@", 1)
    provider, info = start_provider("--reply-delay", "0.3")
    jobs = 4
    write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(jobs)])
    batch = subprocess.Popen(
        cli_command(
            "batch", str(tmp_path / "jobs.jsonl"), "--out", str(tmp_path / "out.jsonl"),
            "--store", url, "--endpoint", info["http_url"], "--mode", "sse",
            "--api-key-env", "WORKER_TEST_KEY", "--concurrency", "2", "--workers", "1",
        ),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**child_env(), **KEY_ENV},
    )
    try:
        own: list[str] = []
        deadline = time.monotonic() + 60  # generous: a loaded 2-core machine
        seen: dict[int, tuple[list[str], dict[str, str]]] = {}
        while not seen:
            own = own or _cmdline(batch.pid)  # empty until the child has exec'd
            for pid in worker_pids(batch.pid):
                try:
                    seen[pid] = (_cmdline(pid), _environ(pid))
                except OSError:
                    continue  # it ended between the listing and the read
            if batch.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.02)  # polling the process table, not a correctness sleep
        out, err = batch.communicate(timeout=120)
    finally:
        if batch.poll() is None:
            batch.kill()
            batch.wait()
        stop(provider)
    assert batch.returncode == 0, err[-3000:]
    assert (tmp_path / "out.jsonl").read_text().count("\n") == jobs
    assert seen, "no worker process was seen while the batch ran"
    assert url in own  # the batch's own command line holds it (the user typed it there)
    for argv, environ in seen.values():
        joined = " ".join(argv)
        assert_hidden(joined, password)
        assert "postgresql://" not in joined
        assert argv[argv.index("--store-env") + 1] == STORE_ENV
        assert environ[STORE_ENV] == url  # the URL reached the worker this way
    assert_hidden(out + err, password)


async def test_a_worker_whose_database_sessions_are_ended_stops_with_one_typed_line(
    pg_url: str, pg_cluster: Cluster
) -> None:
    provider, info = start_provider("--reply-delay", "0.5")
    store = recoverable.RecoveryStore.open(pg_url)
    worker: subprocess.Popen[str] | None = None
    try:
        async with recoverable.open_runtime(store, backend(info), account=ACCOUNT) as rt:
            handles = await submit_all(rt, 4)
        worker = subprocess.Popen(  # noqa: ASYNC220 (started, not awaited)
            cli_command(
                "worker", "--store-env", "TEST_WORKER_STORE", "--endpoint", info["http_url"],
                "--mode", "sse", "--api-key-env", "WORKER_TEST_KEY",
                "--account", ACCOUNT.account_id, "--concurrency", "4",
            ),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env={**child_env(), **KEY_ENV, "TEST_WORKER_STORE": pg_url},
        )
        await phases_reach(store, handles, {"transmitting"}, 1)  # it is running them
        store.close()
        database = pg_url.rsplit("/", 1)[1]
        with psycopg.connect(pg_cluster.url(), autocommit=True) as conn:
            ended = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = %s", (database,),
            ).fetchone()
        assert ended is not None and ended[0] >= 2  # at least its owner and writer sessions
        with trio.fail_after(30):  # generous; it takes about a heartbeat (1 s)
            await trio.to_thread.run_sync(worker.wait)
        _, err = worker.communicate(timeout=10)
    finally:
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGKILL)
            worker.wait()
        store.close()
        stop(provider)
    assert worker.returncode == EXIT_STORE_LOST, err  # distinct: a replacement may go on
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("recoverable worker: storage_unavailable: "), err
    assert "lost its ownership of the store" in lines[0]
