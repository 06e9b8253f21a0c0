"""Smaller defects of the dashboard, over HTTP against the real process: redirects that
stay on the dashboard, odd paths answered cleanly, action banners carried in the session
(never the URL), the token always leaving the address bar, remote binds refused without
``--allow-remote``, the pages' small display faults, the cost's missing prices
(``--prices``) and a list walk that sees every row while the store changes."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..cli.cli_helpers import run_cli
from .helpers import ACCOUNT_ID, copy_store, dashboard, make_store, signed_in, wait_for


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_store(tmp_path_factory.mktemp("dashboard-defects"))


@pytest.fixture(scope="module")
def readonly(made: dict[str, Any]) -> Iterator[dict[str, Any]]:
    with dashboard(made["store"]) as info:
        yield info
    assert "Traceback" not in info["stderr"]


def _token(info: dict[str, Any]) -> str:
    return str(info["url"].split("token=")[1])


def _same_origin_path(location: str) -> bool:
    """A path of this origin: one '/' first, never '//' or '/\\' (both leave the site)."""
    return (location.startswith("/") and not location.startswith(("//", "/\\"))
            and "\\" not in location and "\r" not in location and "\n" not in location)


def test_the_sign_in_redirect_never_leaves_the_dashboard(readonly: dict[str, Any]) -> None:
    token = _token(readonly)
    for raw in ("/%5Cevil.example", "/%5C%5Cevil.example", "//evil.example",
                "/%2F%2Fevil.example", "/%5C/evil.example", "/./%5Cevil.example",
                "/%09/evil.example"):
        with httpx.Client(base_url=readonly["base"], timeout=30,
                          follow_redirects=False) as client:
            response = client.get(f"{raw}?token={token}")
            assert response.status_code == 303, raw
            location = response.headers["location"]
            assert _same_origin_path(location), (raw, location)
            # What a browser makes of it stays on the dashboard.
            resolved = httpx.URL(readonly["base"] + "/").join(location.replace("\\", "/"))
            assert resolved.host == "127.0.0.1" and resolved.port == readonly["port"], raw
            assert token not in location


def test_odd_paths_are_a_clean_400_or_404(readonly: dict[str, Any]) -> None:
    token = _token(readonly)
    odd = ("/operations/%E2%82%AC", "/%E2%82%AC", "/operations/a%0D%0Ab", "/%0D%0Ax",
           "/operations/%FF", "/%0Aset-cookie:%20x=1")
    with httpx.Client(base_url=readonly["base"], timeout=30,
                      follow_redirects=False) as anonymous:
        for raw in odd:  # the sign-in redirect of the same paths
            response = anonymous.get(f"{raw}?token={token}")
            assert response.status_code in (303, 400, 404), (raw, response.text)
            assert "Traceback" not in response.text
            if response.status_code == 303:
                assert _same_origin_path(response.headers["location"]), raw
                assert "set-cookie: x" not in str(response.headers).lower()
    with signed_in(readonly) as client:
        for raw in odd:
            response = client.get(raw)
            assert response.status_code in (400, 404), (raw, response.status_code)
            assert "Traceback" not in response.text


def test_a_token_url_always_leaves_the_address_bar(readonly: dict[str, Any]) -> None:
    token = _token(readonly)
    with signed_in(readonly) as client:
        for url, expected in ((f"/?token={token}", "/"),
                              (f"/operations?state=failed&token={token}",
                               "/operations?state=failed")):
            again = client.get(url)  # a session exists: still redirected without it
            assert again.status_code == 303, url
            assert again.headers["location"] == expected
            assert "set-cookie" not in again.headers  # the session it has is kept
            assert client.get(again.headers["location"]).status_code == 200


def test_action_banners_come_from_the_session_never_the_url(
    made: dict[str, Any], tmp_path: Path
) -> None:
    store = copy_store(made, tmp_path)
    idle = made["idle"][0]
    with dashboard(store, "--account", ACCOUNT_ID) as info, signed_in(info) as client:
        forged = client.get(f"/operations/{idle}",
                            params={"done": "FORGED-DONE", "error": "FORGED-ERROR"}).text
        assert "FORGED" not in forged
        assert 'id="flash"' not in forged and 'id="action-error"' not in forged
        csrf = re.search(r'name="csrf" value="([^"]+)"', forged)
        assert csrf is not None
        answer = client.post(f"/operations/{idle}/suspend", data={"csrf": csrf.group(1)},
                             headers={"origin": info["base"]})
        assert answer.status_code == 303
        assert answer.headers["location"] == f"/operations/{idle}"  # no banner in the URL
        shown = client.get(answer.headers["location"]).text
        assert re.search(r'id="flash">suspend', shown), "the result is shown"
        assert 'id="flash"' not in client.get(f"/operations/{idle}").text  # once only
        # Another session (another browser) never sees this one's banner.
        answer = client.post(f"/operations/{idle}/suspend", data={"csrf": csrf.group(1)},
                             headers={"origin": info["base"]})
        with signed_in(info) as other:
            assert 'id="action-error"' not in other.get(f"/operations/{idle}").text
        assert 'id="action-error"' in client.get(f"/operations/{idle}").text


def test_a_remote_bind_needs_allow_remote_and_warns(made: dict[str, Any],
                                                    tmp_path: Path) -> None:
    store = copy_store(made, tmp_path)
    for host in ("0.0.0.0", "::", "192.0.2.7", "dashboard.example"):
        refused = run_cli("dashboard", "--store", str(store), "--host", host)
        assert refused.returncode == 2, (host, refused.stderr)
        assert f"--host {host} is not a loopback address" in refused.stderr
        assert "--allow-remote" in refused.stderr and "Traceback" not in refused.stderr
        assert refused.stdout == ""  # nothing served, no URL printed
    with dashboard(store, "--host", "0.0.0.0", "--allow-remote") as info:
        assert info["host"] == "0.0.0.0"
    assert "warning: the dashboard listens on 0.0.0.0" in info["stderr"]
    with dashboard(store, "--host", "127.0.0.1") as quiet:
        pass
    assert "warning" not in quiet["stderr"]


def test_a_disposed_operation_s_page_says_where_its_attempts_went(
    readonly: dict[str, Any]
) -> None:
    with signed_in(readonly) as client:
        acknowledged = client.get("/api/operations", params={"state": "acknowledged"})
        row = acknowledged.json()["operations"][0]
        assert row["attempts_used"] == 1
        page = html.unescape(client.get(f"/operations/{row['operation_id']}").text)
        assert "no attempt authorized yet" not in page  # one was: it left with the record
        assert ("1 attempt(s) used; their timeline was removed with the operation's "
                "record when it was acknowledged") in page


def test_the_governor_table_has_one_row_per_endpoint(readonly: dict[str, Any]) -> None:
    # Two accounts' operations on the endpoint "fixture": two governor rows in the store,
    # one row in the table (it names no account, two would look like a duplicate).
    with signed_in(readonly) as client:
        page = client.get("/").text
    table = page.split("<h2>Rate governor</h2>", 1)[1].split("</table>", 1)[0]
    endpoints = re.findall(r"<tr><td>([^<]*)</td>", table)
    assert endpoints, table
    assert len(endpoints) == len(set(endpoints)), endpoints
    assert "fixture@127.0.0.1" in endpoints


def _cost_line(client: httpx.Client) -> str:
    page = html.unescape(client.get("/").text)
    match = re.search(r"<p>cost: ([^<]*)</p>", page)
    assert match is not None
    return match.group(1)


def test_the_cost_names_the_model_without_a_price_and_prices_can_be_given(
    made: dict[str, Any], readonly: dict[str, Any], tmp_path: Path
) -> None:
    with signed_in(readonly) as client:
        assert _cost_line(client) == (
            "unknown: no price for gpt-test (give its prices with --prices FILE)")
    prices = tmp_path / "prices.json"
    prices.write_text('{"gpt-test": {"input": 1.0, "cached_input": 0.5, "output": 2.0}}')
    with dashboard(made["store"], "--prices", str(prices)) as info, \
            signed_in(info) as client:
        cost = _cost_line(client)
        assert re.match(r"^\$\d+\.\d{4} \(estimate; prices: ", cost), cost
        assert str(prices) in cost
    for text, reason in (
        ('{"gpt-test": {"input": -1, "output": 2}}', "gpt-test.input must be a number"),
        ('{"gpt-test": {"input": 1}}', "the price file must be a JSON object"),
        ('{"gpt-test": {"input": 1, "output": 1}, "gpt-test": {"input": 2, "output": 2}}',
         "model 'gpt-test' is given twice"),
        ("[1, 2]", "the price file must be a JSON object"),
    ):
        prices.write_text(text)
        refused = run_cli("dashboard", "--store", str(made["store"]), "--prices", str(prices))
        assert refused.returncode == 2, text
        assert refused.stderr.count("--prices: ") == 1 and reason in refused.stderr, (
            text, refused.stderr)
        assert "Traceback" not in refused.stderr and refused.stdout == ""
    missing = run_cli("dashboard", "--store", str(made["store"]), "--prices",
                      str(tmp_path / "nothing.json"))
    assert missing.returncode == 2 and "--prices: cannot read the price file" in missing.stderr


def test_a_list_walk_sees_every_operation_while_one_is_disposed(
    made: dict[str, Any], tmp_path: Path
) -> None:
    store = copy_store(made, tmp_path)
    with dashboard(store) as info, signed_in(info) as client:
        everything = client.get("/api/operations", params={"limit": 200}).json()
        listed = [row["operation_id"] for row in everything["operations"]]
        oldest_failed = next(row["operation_id"] for row in reversed(everything["operations"])
                             if row["state"] == "failed")
        first = client.get("/api/operations", params={"limit": 2}).json()
        seen = [row["operation_id"] for row in first["operations"]]
        assert oldest_failed not in seen  # still ahead of the walk
        # Another process abandons it while the walk is under way: its row must not jump
        # to the top (behind the cursor), where the walk would never see it.
        run = run_cli("abandon", "--store", str(store), "--account", ACCOUNT_ID,
                      oldest_failed)
        assert run.returncode == 0, run.stderr
        wait_for(lambda: client.get("/api/summary").json()["by_state"]["abandoned"] == 1,
                 "the summary to see the abandon")
        cursor = first["next_cursor"]
        while cursor is not None:
            page = client.get("/api/operations", params={"limit": 2, "cursor": cursor}).json()
            seen += [row["operation_id"] for row in page["operations"]]
            cursor = page["next_cursor"]
        assert sorted(seen) == sorted(listed), "the walk skipped or repeated a row"
        after = client.get("/api/operations", params={"limit": 200}).json()["operations"]
        assert [row["operation_id"] for row in after] == listed  # the same order
        assert {row["operation_id"]: row["state"] for row in after}[oldest_failed] == (
            "abandoned")
