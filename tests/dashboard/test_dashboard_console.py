"""The console over HTTP (httpx against the real dashboard process, a real LMDB store
written through the store's API): find and filter by every dimension, filters in the
URL, overview counts linking to their filtered lists, keyset paging of a filtered list,
and bulk actions (preview with how many and which, one confirmation, idempotent by its
action id, refusals with their reasons), with the security checks of every form."""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from .console_store import CUTOFF, fill
from .helpers import ACCOUNT_ID, dashboard, lease_held, signed_in, wait_for


@pytest.fixture(scope="module")
def console_store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("console-store")
    ids = fill(str(root / "store"))
    return {"store": root / "store", "ids": ids}


def _ids(client: httpx.Client, **params: str) -> set[str]:
    page = client.get("/api/operations", params={"limit": "200", **params})
    assert page.status_code == 200, page.text
    body = page.json()
    assert body["matching"] == len(body["operations"])
    return {row["operation_id"] for row in body["operations"]}


def _csrf(text: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', text)
    assert match is not None, "no form on the page"
    return match.group(1)


def _by_id(text: str, element_id: str) -> str:
    match = re.search(r'id="' + element_id + r'"[^>]*>([^<]*)<', text)
    assert match is not None, f"no #{element_id}"
    return html.unescape(match.group(1))


def test_filter_by_each_dimension(console_store: dict[str, Any]) -> None:
    ids = console_store["ids"]
    mine = set(ids["server_error"] + ids["rate_limited"] + ids["invalid"])
    with dashboard(console_store["store"]) as info, signed_in(info) as client:
        assert _ids(client, state="failed") == mine | set(ids["other"])
        assert _ids(client, state="prepared") == set(ids["prepared"])
        assert _ids(client, q="op-se-") == set(ids["server_error"])  # operation id prefix
        assert _ids(client, q="batch-rl") == set(ids["rate_limited"])  # job id prefix
        assert _ids(client, availability="completion_saved") == set(ids["completed"])
        assert _ids(client, kind="http_rejected") == set(
            ids["server_error"] + ids["rate_limited"] + ids["other"])
        assert _ids(client, code="server_error") == set(ids["server_error"] + ids["other"])
        assert _ids(client, code="rate_limit_exceeded") == set(ids["rate_limited"])
        assert _ids(client, kind="invalid_output") == set(ids["invalid"])
        assert _ids(client, model="gpt-b") == set(
            ids["invalid"] + ids["prepared"] + ids["completed"])
        # Time range: on the last update by default, or on the creation.
        assert _ids(client, code="server_error", since=CUTOFF) == {
            "op-se-1", "op-se-2", "op-other-0"}
        assert _ids(client, code="server_error", until=CUTOFF) == {"op-se-0"}
        assert _ids(client, state="prepared", since="2026-12-01T10:30:02Z",
                    time="created") == {"op-p-2", "op-p-3"}
        # Every condition at once.
        assert _ids(client, state="failed", code="server_error", model="gpt-a",
                    since=CUTOFF, q="op-se") == {"op-se-1", "op-se-2"}
        # Sorts: by attempts (largest first), by update (oldest first).
        rows = client.get("/api/operations", params={"sort": "attempts"}).json()
        assert [row["attempts_used"] for row in rows["operations"]][:1] == [1]
        assert rows["operations"][-1]["attempts_used"] == 0
        oldest = client.get("/api/operations", params={"sort": "updated", "order": "asc",
                                                        "limit": "1"}).json()
        assert oldest["operations"][0]["operation_id"] == "op-se-0"
        # Bad filters are typed 400s.
        for bad in ({"since": "yesterday"}, {"sort": "size"}, {"order": "up"},
                    {"time": "later"}, {"state": "nope"}, {"q": "x\ny"}, {"colour": "red"}):
            answer = client.get("/api/operations", params=bad)
            assert answer.status_code == 400, (bad, answer.text)
            assert answer.json()["error"] == "invalid_request"


def test_the_owner_filter_finds_the_lease_holder(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fill(str(store))
    with lease_held(store, "op-p-1") as owner:
        with dashboard(store) as info, signed_in(info) as client:
            assert _ids(client, owner=owner[:10]) == {"op-p-1"}
            overview = client.get("/").text
            # The owners table's lease count links to the owner's operations.
            assert f'href="/operations?owner={owner}"' in overview


def test_filters_live_in_the_url_and_paging_keeps_them(console_store: dict[str, Any]) -> None:
    with dashboard(console_store["store"]) as info, signed_in(info) as client:
        page = client.get("/operations", params={"model": "gpt-b", "limit": "2",
                                                 "sort": "updated"})
        assert page.status_code == 200
        assert _by_id(page.text, "matching") == "7"
        assert _by_id(page.text, "filter-text") == "model=gpt-b"
        assert 'id="filter-model" value="gpt-b"' in page.text  # the form shows the filter
        seen: list[str] = []
        url: str | None = "/operations?model=gpt-b&limit=2&sort=updated"
        while url is not None:
            text = client.get(html.unescape(url)).text
            seen += re.findall(r'name="ids" value="([^"]+)"', text)
            following = re.search(r'id="next-page" href="([^"]+)"', text)
            url = following.group(1) if following else None
            if url is not None:
                assert "model=gpt-b" in url and "sort=updated" in url
        assert len(seen) == len(set(seen)) == 7


def test_every_overview_count_links_to_its_filtered_list(
    console_store: dict[str, Any]
) -> None:
    with dashboard(console_store["store"]) as info, signed_in(info) as client:
        overview = client.get("/").text
        links = set(html.unescape(link) for link in re.findall(r'href="(/operations\?[^"]+)"',
                                                               overview))
        assert "/operations?state=failed" in links and "/operations?state=prepared" in links
        assert "/operations?availability=completion_saved" in links
        assert "/operations?state=failed&kind=http_rejected" in links
        assert "/operations?state=failed&kind=invalid_output" in links
        counts = client.get("/api/summary").json()
        # Each link's list holds as many operations as its count says.
        for state, count in counts["by_state"].items():
            if count:
                assert len(_ids(client, state=state)) == count, state
        for availability, count in counts["by_availability"].items():
            assert len(_ids(client, availability=availability)) == count, availability
        assert len(_ids(client, state="failed", kind="http_rejected")) == 6


def _preview(client: httpx.Client, origin: dict[str, str], **form: Any) -> httpx.Response:
    page = client.get("/operations").text
    return client.post("/bulk/preview", data={"csrf": _csrf(page), **form}, headers=origin)


def test_bulk_retry_over_a_filter_previews_confirms_once(
    console_store: dict[str, Any], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    fill(str(store))
    with dashboard(store, "--account", ACCOUNT_ID) as info, signed_in(info) as client:
        origin = {"origin": info["base"]}
        preview = _preview(client, origin, action="retry", target="filter",
                           filter=f"state=failed,code=server_error,since={CUTOFF}",
                           selection="reselect", max_attempts="4")
        assert preview.status_code == 200, preview.text
        text = preview.text
        # How many and which, and what the rules refuse now (another account's).
        assert _by_id(text, "bulk-count") == "3"
        assert _by_id(text, "bulk-allowed") == "2" and _by_id(text, "bulk-refused") == "1"
        for op_id in ("op-se-1", "op-se-2", "op-other-0"):
            assert f'href="/operations/{op_id}"' in text
        assert "op-se-0" not in text and "op-rl-0" not in text
        assert "belongs to another account than --account" in text
        assert "reselect, a budget of 4 attempt(s)" in text
        # Nothing was done by the preview.
        assert client.get("/api/summary").json()["by_state"]["superseded"] == 0
        assert _ids(client, state="prepared") == {f"op-p-{index}" for index in range(4)}
        action_id = _by_id(text, "bulk-action-id")
        confirm = {"csrf": _csrf(text), "action_id": action_id}
        done = client.post("/bulk/confirm", data=confirm, headers=origin)
        assert done.status_code == 303 and done.headers["location"] == f"/bulk/{action_id}"
        result = client.get(done.headers["location"]).text
        assert _by_id(result, "result-done") == "2"
        assert _by_id(result, "result-refused") == "1"
        assert "not_allowed: belongs to another account than --account" in result
        wait_for(lambda: len(_ids(client, state="prepared")) == 6, "the two successors")
        successors = _ids(client, state="prepared") - {f"op-p-{index}" for index in range(4)}
        for successor in successors:
            page = client.get(f"/operations/{successor}").text
            assert "4 used of" not in page and "used of 4" in page  # the chosen budget
        # The same action id again: nothing is done twice, the first result is shown.
        again = client.post("/bulk/confirm", data=confirm, headers=origin)
        assert again.status_code == 303
        repeated = client.get(again.headers["location"]).text
        assert "nothing was done again" in repeated
        assert _by_id(repeated, "result-done") == "2"
        assert _ids(client, state="prepared") - {f"op-p-{i}" for i in range(4)} == successors


def test_bulk_actions_over_ticked_operations_report_refusals(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fill(str(store))
    with dashboard(store, "--account", ACCOUNT_ID) as info, signed_in(info) as client:
        origin = {"origin": info["base"]}

        def bulk(action: str, chosen: list[str], **extra: str) -> str:
            preview = _preview(client, origin, action=action, target="selected",
                               ids=chosen, **extra)
            assert preview.status_code == 200, preview.text
            done = client.post("/bulk/confirm", headers=origin, data={
                "csrf": _csrf(preview.text),
                "action_id": _by_id(preview.text, "bulk-action-id")})
            assert done.status_code == 303
            return client.get(done.headers["location"]).text

        # Suspend: the prepared ones are suspended, the failed one refused with why.
        result = bulk("suspend", ["op-p-0", "op-p-1", "op-se-0"])
        assert _by_id(result, "result-done") == "2" and _by_id(result, "result-refused") == "1"
        assert "nothing to suspend: it is failed" in result
        wait_for(lambda: _ids(client, state="suspended") == {"op-p-0", "op-p-1"}, "suspended")
        # Acknowledge (the bulk confirmation stands for each one's): a failed one refused.
        result = bulk("acknowledge", ["op-c-0", "op-rl-0"])
        assert _by_id(result, "result-done") == "1" and _by_id(result, "result-refused") == "1"
        assert "acknowledge is for a completed operation" in result
        # Cancel of a saved result: refused without force (the preview offers no
        # confirmation: nothing is allowed), done with it.
        preview = _preview(client, origin, action="cancel", target="selected", ids=["op-c-1"])
        assert _by_id(preview.text, "bulk-allowed") == "0"
        assert "never delivered" in preview.text and 'id="bulk-confirm"' not in preview.text
        result = bulk("cancel", ["op-c-1"], force="1")
        assert _by_id(result, "result-done") == "1"
        result = bulk("abandon", ["op-p-2", "op-p-3"])
        assert _by_id(result, "result-done") == "2"
        wait_for(lambda: _ids(client, state="acknowledged") == {"op-c-0"}, "acknowledged")
        assert _ids(client, state="cancelled") == {"op-c-1"}
        wait_for(lambda: _ids(client, state="abandoned") == {"op-p-2", "op-p-3"}, "abandoned")


def test_bulk_forms_keep_the_security_checks(console_store: dict[str, Any]) -> None:
    with dashboard(console_store["store"], "--account", ACCOUNT_ID) as info, \
            signed_in(info) as client:
        origin = {"origin": info["base"]}
        form = {"action": "cancel", "target": "selected", "ids": "op-p-0"}
        # No CSRF token, a wrong one, another origin, no session: refused.
        assert client.post("/bulk/preview", data=form, headers=origin).status_code == 403
        assert client.post("/bulk/preview", data={**form, "csrf": "x"},
                           headers=origin).status_code == 403
        page = client.get("/operations").text
        other = client.post("/bulk/preview", data={**form, "csrf": _csrf(page)},
                            headers={"origin": "http://evil.example"})
        assert other.status_code == 403 and "origin_refused" in other.text
        with httpx.Client(base_url=info["base"]) as stranger:
            assert stranger.post("/bulk/preview", data=form,
                                 headers=origin).status_code == 401
            assert stranger.get("/bulk/whatever").status_code == 401
        # A confirmation needs its own preview (in this session).
        unknown = client.post("/bulk/confirm", headers=origin, data={
            "csrf": _csrf(page), "action_id": "dash-never-previewed"})
        assert unknown.status_code == 404
        # Ids are escaped in the preview.
        evil = client.post("/bulk/preview", headers=origin, data={
            **form, "ids": "<script>alert(1)</script>", "csrf": _csrf(page)})
        assert evil.status_code == 200 and "<script>alert" not in evil.text
    with dashboard(console_store["store"]) as info, signed_in(info) as client:
        page = client.get("/operations").text
        assert "read-only" in _by_id(page, "bulk-why")  # no --account: no bulk action
        refused = client.post("/bulk/preview", headers={"origin": info["base"]},
                              data={**form, "csrf": _csrf(page)})
        assert refused.status_code == 403
