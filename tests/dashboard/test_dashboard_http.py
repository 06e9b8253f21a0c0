"""The dashboard over HTTP (httpx against the real process on 127.0.0.1): the token, the
session cookie, CSRF and Origin checks, no content or account id in any page, bounded
pages, typed 400s, the overview's live endpoint, and the actions with their telemetry."""

from __future__ import annotations

import html
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

import recoverable

from ..cli.cli_helpers import run_cli
from .helpers import (
    ACCOUNT_ID,
    OTHER_ACCOUNT_ID,
    PROMPT_MARKER,
    copy_store,
    dashboard,
    lease_held,
    make_small_store,
    make_store,
    signed_in,
    wait_for,
)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_store(tmp_path_factory.mktemp("dashboard-store"))


@pytest.fixture(scope="module")
def readonly(made: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """One read-only dashboard (no --account) over the made store, for the read tests."""
    with dashboard(made["store"]) as info:
        yield info


def _operations(client: httpx.Client, state: str = "all") -> list[dict[str, Any]]:
    page = client.get("/api/operations", params={"state": state, "limit": 200})
    assert page.status_code == 200, page.text
    rows: list[dict[str, Any]] = page.json()["operations"]
    return rows


def _csrf(html: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', html)
    assert match is not None, "no form on the page"
    return match.group(1)


def _field(html: str, element_id: str, name: str) -> str:
    form = re.search(r'<form method="post"[^>]*>(?:(?!</form>).)*id="' + element_id + '"',
                     html)
    assert form is not None, f"no enabled {element_id}"
    value = re.search(r'name="' + name + r'" value="([^"]+)"', form.group(0))
    assert value is not None
    return value.group(1)


def _banner(client: httpx.Client, location: str, element_id: str) -> str:
    """The action's result on the page it redirected to (kept in the session: the URL
    carries none)."""
    assert "?" not in location, location
    page = client.get(location).text
    match = re.search(r'id="' + element_id + r'">([^<]*)</p>', page)
    assert match is not None, f"no {element_id} banner"
    return html.unescape(match.group(1))


def test_every_request_needs_the_printed_token(readonly: dict[str, Any]) -> None:
    base = readonly["base"]
    assert readonly["url"].startswith("http://127.0.0.1:")
    with httpx.Client(base_url=base, timeout=30, follow_redirects=False) as anonymous:
        for path in ("/", "/operations", "/api/summary", "/api/operations", "/api/overview",
                     "/operations/anything"):
            response = anonymous.get(path)
            assert response.status_code == 401, path
            assert "token_required" in response.text
        assert anonymous.get("/", params={"token": "not-the-token"}).status_code == 401
        assert anonymous.post("/operations/x/cancel").status_code == 401
        # A token in a POST opens nothing (only a GET with ?token= signs in).
        token = readonly["url"].split("token=")[1]
        assert anonymous.post("/", params={"token": token}).status_code == 401
    with httpx.Client(base_url=base, timeout=30, follow_redirects=False) as client:
        first = client.get(readonly["url"])
        assert first.status_code == 303
        assert first.headers["location"] == "/"  # the token leaves the address bar
        cookie = first.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert token not in cookie
        page = client.get("/")
        assert page.status_code == 200
        assert page.headers["cache-control"] == "no-store"
        assert "script-src 'nonce-" in page.headers["content-security-policy"]
        assert token not in page.text


def test_another_host_name_is_refused(readonly: dict[str, Any]) -> None:
    with signed_in(readonly) as client:
        port = readonly["port"]
        rebinding = client.get("/", headers={"host": f"attacker.example:{port}"})
        assert rebinding.status_code == 403
        assert "host_refused" in rebinding.text
        assert client.get("/", headers={"host": f"localhost:{port}"}).status_code == 200


def test_no_prompt_output_or_account_id_in_any_page(
    readonly: dict[str, Any], made: dict[str, Any]
) -> None:
    with signed_in(readonly) as client:
        rows = _operations(client)
        assert len(rows) == 10  # 2 failed + 1 saved + 3 acknowledged + 3 idle + 1 other
        pages = [client.get(path) for path in (
            "/", "/operations", "/api/summary", "/api/operations?limit=200",
            *(f"/operations?state={state}" for state in ("failed", "completed", "prepared")),
            *(f"/operations/{row['operation_id']}" for row in rows),
        )]
        for page in pages:
            assert page.status_code == 200, page.url
            for secret in (PROMPT_MARKER, ACCOUNT_ID, OTHER_ACCOUNT_ID, "sk-"):
                assert secret not in page.text, (page.url, secret)
        # The other account's operation shows its status dimensions, not its content.
        other = client.get(f"/operations/{made['other'][0]}")
        assert '<b id="op-state">prepared</b>' in other.text


def test_show_content_shows_only_the_bound_account_s_content(
    made: dict[str, Any], tmp_path: Path
) -> None:
    store = copy_store(made, tmp_path)
    with dashboard(store, "--account", ACCOUNT_ID, "--show-content") as info:
        assert info["show_content"] is True and info["account_bound"] is True
        with signed_in(info) as client:
            own = client.get(f"/operations/{made['idle'][0]}")
            assert PROMPT_MARKER in own.text  # the frozen request, for its own account
            other = client.get(f"/operations/{made['other'][0]}")
            assert PROMPT_MARKER not in other.text
            for page in (client.get("/"), client.get("/operations"), own, other):
                assert OTHER_ACCOUNT_ID not in page.text and ACCOUNT_ID not in page.text


def test_pages_are_bounded_and_bad_input_is_a_typed_400(readonly: dict[str, Any]) -> None:
    with signed_in(readonly) as client:
        for params in ({"limit": "0"}, {"limit": "201"}, {"limit": "abc"}, {"limit": "-1"},
                       {"state": "bogus"}, {"cursor": "%%%"}, {"cursor": "x" * 500},
                       {"cursor": "bm90IGEgY3Vyc29y"}, {"page": "2"}):
            response = client.get("/api/operations", params=params)
            assert response.status_code == 400, params
            assert response.json()["error"] == "invalid_request", params
            html = client.get("/operations", params=params)
            assert html.status_code == 400 and "invalid_request" in html.text
        # Walking the cursor visits every operation exactly once, two at a time.
        seen: list[str] = []
        cursor: str | None = None
        while True:
            params = {"limit": "2", **({"cursor": cursor} if cursor else {})}
            page = client.get("/api/operations", params=params).json()
            assert len(page["operations"]) <= 2
            seen += [row["operation_id"] for row in page["operations"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert len(seen) == len(set(seen)) == 10
        failed = client.get("/api/operations", params={"state": "failed"}).json()
        assert failed["matching"] == 2
        assert {row["failure"] for row in failed["operations"]} == {"invalid_output"}
        missing = client.get("/operations/op_does_not_exist")
        assert missing.status_code == 404 and "state_unavailable" in missing.text
        assert client.get("/operations/" + "x" * 300).status_code == 400
        summary = client.get("/api/summary").json()
        assert summary["total"] == 10
        assert summary["by_state"]["failed"] == 2
        assert summary["by_state"]["acknowledged"] == 3


def test_the_overview_updates_by_short_polls_with_no_cap(readonly: dict[str, Any]) -> None:
    """No connection is held between two updates, so any number of pages poll: each poll
    answers the live region (the same rendering as the page's) or only its version when
    the page already has it."""
    with signed_in(readonly) as client:
        page = client.get("/")
        version = re.search(r'id="live" data-version="(\d+)"', page.text)
        assert version is not None
        answers = [client.get("/api/overview") for _ in range(20)]  # over the old cap of 8
        assert all(answer.status_code == 200 for answer in answers)
        full = answers[-1].json()
        assert full["counts"]["total"] == 10
        assert 'id="count-total">10<' in full["html"]
        assert 'id="panel-failures"' in full["html"] and "invalid_output" in full["html"]
        if full["version"] == int(version.group(1)):  # no rebuild in between (15 s idle)
            assert full["html"] in page.text  # the first render is this very region
        same = client.get("/api/overview", params={"since": str(full["version"])})
        assert same.json() == {"version": full["version"]}


COOLDOWN = 3.0  # seconds: a saved cooldown that ends while the dashboard is idle
IDLE_REFRESH = 15.0  # the dashboard's rebuild without any commit (dashboard/app.py)


def test_a_cooldown_that_ends_leaves_the_overview_without_a_commit(tmp_path: Path) -> None:
    made = make_small_store(tmp_path)
    with dashboard(made["store"]) as info, signed_in(info) as client:
        # Another process saves a cooldown (as an execution that waits would).
        store = recoverable.RecoveryStore.open(str(made["store"]))
        try:
            record = store.get_operation(made["idle"][0])
            assert record is not None
            until = time.time() + COOLDOWN
            waiting = msgspec.structs.replace(record, phase="waiting", next_attempt_at=until)
            store.write_sync(lambda txn: txn.put_operation(waiting))
        finally:
            store.close()

        def region() -> dict[str, Any]:
            answer = client.get("/api/overview")
            assert answer.status_code == 200, answer.text
            data: dict[str, Any] = answer.json()
            return data

        shown = wait_for(lambda: region()["counts"]["waiting"] == 1 and region(),
                         "the overview to show the saved cooldown")
        assert made["idle"][0] in shown["html"] and "no saved cooldown" not in shown["html"]
        # Nothing commits when it ends: the overview drops it at once (not at the next
        # idle rebuild, 15 s after the commit).
        ended = wait_for(lambda: region()["counts"]["waiting"] == 0 and region(),
                         "the ended cooldown to leave the overview",
                         timeout=until - time.time() + IDLE_REFRESH / 2)
        assert "no saved cooldown" in ended["html"]


def test_actions_need_csrf_same_origin_and_the_account(
    made: dict[str, Any], tmp_path: Path
) -> None:
    store = copy_store(made, tmp_path)
    idle = made["idle"][0]
    with dashboard(store) as info, signed_in(info) as client:  # read-only: no --account
        page = client.get(f"/operations/{idle}").text
        assert 'disabled id="action-suspend"' in page
        assert "start the dashboard with --account ID" in page
        assert 'name="csrf"' not in page  # no enabled form without the binding
    with dashboard(store, "--account", ACCOUNT_ID) as info, signed_in(info) as client:
        origin = {"origin": info["base"]}
        page = client.get(f"/operations/{idle}").text
        csrf = _csrf(page)
        forged = client.post(f"/operations/{idle}/suspend", data={"csrf": "forged"},
                             headers=origin)
        assert forged.status_code == 403 and "csrf_refused" in forged.text
        cross = client.post(f"/operations/{idle}/suspend", data={"csrf": csrf},
                            headers={"origin": "http://attacker.example"})
        assert cross.status_code == 403 and "origin_refused" in cross.text
        no_origin = client.post(f"/operations/{idle}/suspend", data={"csrf": csrf})
        assert no_origin.status_code == 403
        assert _state(client, idle) == "prepared"  # none of them acted
        other = made["other"][0]
        refused = client.post(f"/operations/{other}/suspend", data={"csrf": csrf},
                              headers=origin)
        assert refused.status_code == 303
        assert "account_required" in _banner(client, refused.headers["location"],
                                             "action-error")
        assert _state(client, other) == "prepared"
        bad = client.post(f"/operations/{idle}/explode", data={"csrf": csrf}, headers=origin)
        assert bad.status_code == 400 and "invalid_request" in bad.text
        multipart = client.post(f"/operations/{idle}/suspend", files={"csrf": b"x"},
                                headers=origin)
        assert multipart.status_code == 400


def test_each_dashboard_has_its_own_session_cookie(made: dict[str, Any]) -> None:
    # Cookies are not scoped by port: with one shared name, signing into a second
    # dashboard on the same host replaced (logged out) the first one's session.
    with dashboard(made["store"]) as first, dashboard(made["store"]) as second, \
            httpx.Client(timeout=30, follow_redirects=False) as client:
        names = []
        for info in (first, second):
            opened = client.get(info["url"])
            assert opened.status_code == 303
            cookie = opened.headers["set-cookie"]
            names.append(cookie.split("=", 1)[0])
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
            assert "domain=" not in cookie.lower()  # the exact host only
        assert names == [f"recoverable_dashboard_{first['port']}",
                         f"recoverable_dashboard_{second['port']}"]
        for info in (first, second):  # one client (one cookie jar), both still signed in
            assert client.get(info["base"] + "/api/summary").status_code == 200


def test_the_server_refuses_what_the_page_does_not_offer(
    made: dict[str, Any], tmp_path: Path
) -> None:
    store = copy_store(made, tmp_path)
    leased = made["idle"][0]
    with lease_held(store, leased) as owner, \
            dashboard(store, "--account", ACCOUNT_ID) as info, signed_in(info) as client:
        origin = {"origin": info["base"]}

        def refused(operation_id: str, action: str, reason: str) -> None:
            page = client.get(f"/operations/{operation_id}").text
            assert f'disabled id="action-{action}"' in page  # not offered, and why
            assert reason in page
            before = client.get("/api/operations", params={"limit": 200}).json()
            answer = client.post(f"/operations/{operation_id}/{action}",
                                 data={"csrf": _csrf(page)}, headers=origin)
            assert answer.status_code == 303  # back to the page, with the reason
            error = _banner(client, answer.headers["location"], "action-error")
            assert error.startswith(f"{action}: not_allowed: ") and reason in error
            after = client.get("/api/operations", params={"limit": 200}).json()
            assert after == before  # nothing changed

        # A failed operation is settled: the library's suspend would change nothing.
        failed = _operations(client, "failed")[0]["operation_id"]
        refused(failed, "suspend", "nothing to suspend: it is failed")
        assert _state(client, failed) == "failed"
        # A leased operation (another process runs it): abandon would be OperationBusy.
        refused(leased, "abandon", f"another process runs it (lease owner {owner[:12]})")
        assert _state(client, leased) == "prepared"
        page = client.get(f"/operations/{leased}").text
        assert 'disabled id="action-suspend"' not in page  # suspend is a command it gets
    with dashboard(store, "--account", ACCOUNT_ID) as info, signed_in(info) as client:
        # The lease is gone with its owner: abandon is offered again, and done.
        page = client.get(f"/operations/{leased}").text
        assert 'disabled id="action-abandon"' not in page
        done = client.post(f"/operations/{leased}/abandon", data={"csrf": _csrf(page)},
                           headers={"origin": info["base"]})
        assert _banner(client, done.headers["location"], "flash").startswith("abandon")
        assert _state(client, leased) == "abandoned"


def _state(client: httpx.Client, operation_id: str) -> str:
    page = client.get(f"/operations/{operation_id}").text
    match = re.search(r'<b id="op-state">([a-z_]+)</b>', page)
    assert match is not None
    return match.group(1)


def test_each_action_is_the_cli_s_call_and_is_recorded(
    made: dict[str, Any], tmp_path: Path
) -> None:
    store = copy_store(made, tmp_path)
    idle = made["idle"]
    with dashboard(store, "--account", ACCOUNT_ID) as info, signed_in(info) as client:
        origin = {"origin": info["base"]}

        def act(operation_id: str, element_id: str, **extra: str) -> httpx.Response:
            page = client.get(f"/operations/{operation_id}").text
            fields = {"csrf": _csrf(page), **extra}
            for name in ("action_id", "selection", "force"):
                try:
                    fields.setdefault(name, _field(page, element_id, name))
                except AssertionError:
                    pass
            action = element_id.removeprefix("action-").split("-")[0]
            return client.post(f"/operations/{operation_id}/{action}", data=fields,
                               headers=origin)

        assert act(idle[0], "action-suspend").status_code == 303
        assert _state(client, idle[0]) == "suspended"
        assert act(idle[1], "action-cancel").status_code == 303
        assert _state(client, idle[1]) == "cancelled"
        assert act(idle[2], "action-abandon").status_code == 303
        assert _state(client, idle[2]) == "abandoned"
        # The saved completion: cancel without the confirmation's force is refused.
        saved = _operations(client, "completed")[0]["operation_id"]
        page = client.get(f"/operations/{saved}").text
        assert "NEVER delivered" in page  # the confirmation says what cancel does to it
        refused = client.post(f"/operations/{saved}/cancel", data={"csrf": _csrf(page)},
                              headers=origin)
        assert "completion_saved" in _banner(client, refused.headers["location"],
                                             "action-error")
        assert _state(client, saved) == "completed"
        assert act(saved, "action-acknowledge").status_code == 303
        assert _state(client, saved) == "acknowledged"
        # Manual retry: a fresh action id per form; the same form twice -> one successor.
        failed = _operations(client, "failed")[0]["operation_id"]
        page = client.get(f"/operations/{failed}").text
        action_id = _field(page, "action-retry", "action_id")
        assert action_id != _field(page, "action-retry-reselect", "action_id")
        form = {"csrf": _csrf(page), "action_id": action_id, "selection": "preserve"}
        first = client.post(f"/operations/{failed}/retry", data=form, headers=origin)
        assert first.status_code == 303
        successor = re.search(r"op_[0-9a-f]+", _banner(client, first.headers["location"],
                                                        "flash"))
        assert successor is not None
        again = client.post(f"/operations/{failed}/retry", data=form, headers=origin)
        assert again.status_code == 303
        assert successor.group(0) in _banner(client, again.headers["location"], "flash")
        assert _state(client, successor.group(0)) == "prepared"
        assert f'href="/operations/{successor.group(0)}"' in client.get(
            f"/operations/{failed}").text  # lineage: the successor
        # The live counts follow the actions.
        wait_for(lambda: client.get("/api/summary").json()["by_state"]["acknowledged"] == 4,
                 "the summary after the actions")
    events = [json.loads(line) for line in info["stderr"].splitlines()
              if line.startswith("{")]
    names = {event["telemetry"] for event in events}
    assert {"recovery.operation.suspended", "recovery.operation.cancelled",
            "recovery.operation.abandoned", "recovery.receipt.acknowledged",
            "recovery.operation.manual_retry_created"} <= names
    assert PROMPT_MARKER not in info["stderr"] and ACCOUNT_ID not in info["stderr"]
    # The CLI sees what the dashboard did (same store, same library calls).
    status = run_cli("status", "--store", str(store), "--account", ACCOUNT_ID, idle[0], "--json")
    assert json.loads(status.stdout)["state"] == "suspended"


def test_acknowledge_without_the_confirmation_is_refused(
    made: dict[str, Any], tmp_path: Path
) -> None:
    store = copy_store(made, tmp_path)
    with dashboard(store, "--account", ACCOUNT_ID) as info, signed_in(info) as client:
        origin = {"origin": info["base"]}
        saved = _operations(client, "completed")[0]["operation_id"]
        page = client.get(f"/operations/{saved}").text
        assert "REMOVES the saved" in page  # the button's confirmation says what it does
        assert _field(page, "action-acknowledge", "force") == "1"
        for form in ({"csrf": _csrf(page)}, {"csrf": _csrf(page), "force": "0"}):
            refused = client.post(f"/operations/{saved}/acknowledge", data=form,
                                  headers=origin)
            assert refused.status_code == 303
            error = _banner(client, refused.headers["location"], "action-error")
            assert error.startswith("acknowledge: confirmation_required: ")
            assert "removes the saved result for good" in error
            assert _state(client, saved) == "completed"
        confirmed = client.post(f"/operations/{saved}/acknowledge",
                                data={"csrf": _csrf(page), "force": "1"}, headers=origin)
        assert confirmed.status_code == 303
        assert _banner(client, confirmed.headers["location"], "flash").startswith("acknowledge")
        assert _state(client, saved) == "acknowledged"


def test_usage_errors_exit_2_without_credentials(made: dict[str, Any], tmp_path: Path) -> None:
    missing = run_cli("dashboard", "--store", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "no recovery store" in missing.stderr
    url = run_cli("dashboard", "--store", "postgresql://admin:hunter2@db.example/jobs")
    assert url.returncode == 2
    assert "hunter2" not in url.stderr and "admin" not in url.stderr
    port = run_cli("dashboard", "--store", str(tmp_path), "--port", "70000")
    assert port.returncode == 2 and "0..65535" in port.stderr
    store = copy_store(made, tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = run_cli("dashboard", "--store", str(store), "--port",
                       str(taken.getsockname()[1]))
    assert busy.returncode == 2 and "cannot listen on 127.0.0.1:" in busy.stderr, busy.stderr
    assert "Traceback" not in busy.stderr


def test_a_store_that_fails_is_a_typed_503_and_the_dashboard_stays_up(
    made: dict[str, Any], tmp_path: Path
) -> None:
    store = copy_store(made, tmp_path)
    with dashboard(store, "--account", ACCOUNT_ID) as info, signed_in(info) as client:
        assert client.get("/").status_code == 200
        idle = made["idle"][0]
        csrf = _csrf(client.get(f"/operations/{idle}").text)
        # The lock file is replaced: the next write finds out, and from then on the store
        # refuses every read and write in this process (fail closed, docs/failures.md).
        (store / "lock.mdb").unlink()
        action = client.post(f"/operations/{idle}/suspend", data={"csrf": csrf},
                             headers={"origin": info["base"]})
        assert action.status_code == 303
        # The operation's page cannot be read either: it answers the store's code.
        assert "store_lock_replaced" in client.get(action.headers["location"]).text

        def refused() -> bool:
            page = client.get("/api/summary")
            return page.status_code == 503 and page.json()["error"] == "store_lock_replaced"

        wait_for(refused, "the summary to report the store's failure")
        overview = client.get("/")
        assert overview.status_code == 503 and "store_lock_replaced" in overview.text
        one = client.get(f"/operations/{made['idle'][0]}")
        assert one.status_code == 503 and "store_lock_replaced" in one.text
        assert info["proc"].poll() is None  # still serving


def test_the_dashboard_knows_every_state() -> None:
    """Every state a status can have is counted and filterable (a new terminal state, such
    as issue 16's ``superseded``, must not vanish from the overview)."""
    from typing import get_args

    from recoverable.dashboard.data import STATES
    from recoverable.types import State

    assert sorted(STATES) == sorted(get_args(State))
