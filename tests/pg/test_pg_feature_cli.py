"""The CLI commands of issues 16, 18 and 21 on the PostgreSQL store (issue 17, wave 2):
``source set``, ``config set continuation.enabled`` and ``dashboard``, each a real process
given ``--store postgresql://...``; the URL's password never shows in what they print."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest

import recoverable
from recoverable.records import OperationRecord
from tests.cli.cli_helpers import run_cli
from tests.dashboard.helpers import (
    ACCOUNT,
    ACCOUNT_ID,
    OTHER,
    OTHER_ACCOUNT_ID,
    PROMPT_MARKER,
    _prepare,
    dashboard,
    signed_in,
    wait_for,
)
from tests.pg.cluster import Cluster
from tests.pg.proxy import PgProxy

PASSWORD = "pw-never-shown-5521"  # the test cluster trusts 127.0.0.1: it is never checked
SOURCE_ACCOUNT = recoverable.AccountBinding("acct-cli", "api-key")


def with_password(url: str) -> str:
    """``postgresql://user@host/db`` -> ``postgresql://user:PASSWORD@host/db``."""
    scheme, rest = url.split("://", 1)
    user, host = rest.split("@", 1)
    return f"{scheme}://{user}:{PASSWORD}@{host}"


def _bound(op_id: str) -> OperationRecord:
    return OperationRecord(
        operation_id=op_id, account=SOURCE_ACCOUNT, endpoint_id="fixture", created_at=1.0,
        maximum_attempts=3, model="gpt-test", format_name="Answer", format_hash="fh",
        body_hash="bh", root_operation_id=op_id,
        source=recoverable.SourceRef("doc-1", "sha256:v1"), attempt_timeout=10.0,
    )


def test_source_set_on_a_url_supersedes_the_old_digests_operations(pg_url: str) -> None:
    with recoverable.RecoveryStore.open(pg_url) as store:
        store.set_source_sync("doc-1", "sha256:v1")
        store.write_sync(lambda txn: txn.put_operation(_bound("op-old")))
    url = with_password(pg_url)
    done = run_cli("source", "set", "doc-1", "sha256:v2", "--store", url, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "key": "doc-1", "previous": "sha256:v1", "current": "sha256:v2",
        "superseded": ["op-old"], "superseded_total": 1, "unreadable": [],
        "unreadable_total": 0,
    }
    status = run_cli("status", "op-old", "--store", url, "--account", "acct-cli")
    assert status.returncode == 0, status.stderr
    assert "superseded" in status.stdout and "source_changed" in status.stdout
    with recoverable.RecoveryStore.open(pg_url) as store:  # durable, in the database
        record = store.get_operation("op-old")
        assert record is not None and record.superseded_reason == "source_changed"
    for shown in (done, status):
        assert PASSWORD not in shown.stdout + shown.stderr


def test_config_set_continuation_on_a_url_persists_in_the_database(pg_url: str) -> None:
    url = with_password(pg_url)
    got = run_cli("config", "get", "continuation.enabled", "--store", url, "--json")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["value"] is False  # off by default
    for key, value in (("continuation.enabled", "true"), ("continuation.budget", "2")):
        done = run_cli("config", "set", key, value, "--store", url)
        assert done.returncode == 0, done.stderr
        assert PASSWORD not in done.stdout + done.stderr
    bad = run_cli("config", "set", "continuation.budget", "11", "--store", url)
    assert bad.returncode == 2 and PASSWORD not in bad.stdout + bad.stderr
    with recoverable.RecoveryStore.open(pg_url) as store:  # another process reads it back
        preference = recoverable.continuation_preference(store)
        assert (preference.enabled, preference.budget) == (True, 2)
    got = run_cli("config", "get", "continuation.enabled", "--store", url)
    assert got.stdout == "continuation.enabled = true\n"


def _state(client: httpx.Client, operation_id: str) -> str:
    page = client.get(f"/operations/{operation_id}").text
    match = re.search(r'<b id="op-state">([a-z_]+)</b>', page)
    assert match is not None, page
    return match.group(1)


def test_the_dashboard_serves_a_postgresql_store(pg_url: str) -> None:
    idle = _prepare(pg_url, ACCOUNT, ["idle-1", "idle-2"])
    other = _prepare(pg_url, OTHER, ["other-1"])
    url = with_password(pg_url)
    with dashboard(url, "--account", ACCOUNT_ID) as info, signed_in(info) as client:
        listed = client.get("/api/operations", params={"state": "all", "limit": 200})
        assert listed.status_code == 200, listed.text
        rows = listed.json()["operations"]
        assert sorted(row["operation_id"] for row in rows) == sorted(idle + other)
        pages = [client.get(path) for path in (
            "/", "/operations", "/api/summary", *(f"/operations/{op}" for op in idle + other),
        )]
        for page in pages:
            assert page.status_code == 200, page.url
            for secret in (PROMPT_MARKER, ACCOUNT_ID, OTHER_ACCOUNT_ID, PASSWORD, "sk-"):
                assert secret not in page.text, (page.url, secret)
        # An action is the library's call on the database: the CLI sees it.
        page = client.get(f"/operations/{idle[0]}").text
        csrf = re.search(r'name="csrf" value="([^"]+)"', page)
        assert csrf is not None
        done = client.post(f"/operations/{idle[0]}/suspend", data={"csrf": csrf.group(1)},
                           headers={"origin": info["base"]})
        assert done.status_code == 303 and "error" not in done.headers["location"]
        assert _state(client, idle[0]) == "suspended"
        # The summary is rebuilt in the dashboard's thread after a commit: wait for it.
        wait_for(lambda: client.get("/api/summary").json()["by_state"]["suspended"] == 1,
                 "the summary to count the suspension")
    status = run_cli("status", "--store", url, "--account", ACCOUNT_ID, idle[0], "--json")
    assert json.loads(status.stdout)["state"] == "suspended"
    assert PASSWORD not in json.dumps({k: v for k, v in info.items() if k != "proc"})


@pytest.fixture
def proxy(pg_cluster: Cluster) -> Iterator[PgProxy]:
    relay = PgProxy(pg_cluster.port)
    yield relay
    relay.close()


def test_an_unreachable_database_is_a_typed_503_and_the_dashboard_stays_up(
    proxy: PgProxy, pg_url: str
) -> None:
    """The database goes away under a running dashboard (its connections cut, new ones
    refused): an action is refused with ``storage_unavailable``, every page is a typed 503,
    the process keeps serving, and nothing was written."""
    [idle] = _prepare(pg_url, ACCOUNT, ["idle-1"])
    relayed = proxy.url(pg_url.rsplit("/", 1)[1])
    with dashboard(relayed, "--account", ACCOUNT_ID) as info, signed_in(info) as client:
        assert client.get("/").status_code == 200
        csrf = re.search(r'name="csrf" value="([^"]+)"', client.get(f"/operations/{idle}").text)
        assert csrf is not None
        proxy.down()
        action = client.post(f"/operations/{idle}/suspend", data={"csrf": csrf.group(1)},
                             headers={"origin": info["base"]})
        assert action.status_code == 303
        # The refusal is the next page's banner (kept in the session, never in the URL).
        location = action.headers["location"]
        assert "?" not in location

        def refused() -> bool:
            page = client.get("/api/summary")
            return page.status_code == 503 and page.json()["error"] == "storage_unavailable"

        wait_for(refused, "the summary to report the database's failure")
        for path in ("/", f"/operations/{idle}"):
            page = client.get(path)
            assert page.status_code == 503 and "storage_unavailable" in page.text
        assert info["proc"].poll() is None  # still serving
        proxy.up()

        def served() -> bool:
            return client.get("/api/summary").status_code == 200

        wait_for(served, "the dashboard to read the database again")
        banner = re.search(r'id="action-error">([^<]*)</p>', client.get(location).text)
        assert banner is not None and "storage_unavailable" in banner.group(1)
    with recoverable.RecoveryStore.open(pg_url) as store:  # the refused action wrote nothing
        assert store.get_command(idle) is None


def test_the_live_counts_follow_a_change_made_by_another_process(pg_url: str) -> None:
    """The dashboard notices another process's commit on the database (the commit count,
    ``last_txnid``, moves for every process's commits) and its overview's poll answers
    the new counts."""
    [first, second] = _prepare(pg_url, ACCOUNT, ["idle-1", "idle-2"])
    with dashboard(pg_url) as info, signed_in(info) as client:
        answer = client.get("/api/overview")
        assert answer.status_code == 200
        counts = answer.json()["counts"]
        assert counts["total"] == 2 and counts["by_state"]["prepared"] == 2
        for op_id in (first, second):  # another process: the CLI, on the same database
            done = run_cli("suspend", "--store", pg_url, "--account", ACCOUNT_ID, op_id)
            assert done.returncode == 0, done.stderr

        def suspended() -> bool:
            live = client.get("/api/overview").json()["counts"]["by_state"]
            return bool(live.get("suspended") == 2)

        wait_for(suspended, "the overview to count both suspended operations")
