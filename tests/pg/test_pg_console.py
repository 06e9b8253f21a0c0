"""The console on the PostgreSQL store (a throwaway cluster: the test fails, never skips,
when it cannot start): the dashboard's filters and a bulk action over HTTP, and the CLI's
bulk form, on records written through the PostgreSQL store's API."""

from __future__ import annotations

import html
import json
import re

from ..cli.cli_helpers import run_cli
from ..dashboard.console_store import CUTOFF, fill
from ..dashboard.helpers import ACCOUNT_ID, dashboard, signed_in, wait_for


def test_filter_and_bulk_actions_on_postgresql(pg_url: str) -> None:
    fill(pg_url)
    with dashboard(pg_url, "--account", ACCOUNT_ID) as info, signed_in(info) as client:
        origin = {"origin": info["base"]}

        def ids(**params: str) -> set[str]:
            page = client.get("/api/operations", params={"limit": "200", **params}).json()
            return {row["operation_id"] for row in page["operations"]}

        assert ids(state="failed", code="server_error", since=CUTOFF) == {
            "op-se-1", "op-se-2", "op-other-0"}
        assert ids(model="gpt-b", state="prepared") == {f"op-p-{index}" for index in range(4)}
        assert ids(q="batch-rl") == {"op-rl-0", "op-rl-1"}
        page = client.get("/operations", params={"state": "prepared"}).text
        csrf = re.search(r'name="csrf" value="([^"]+)"', page)
        assert csrf is not None
        preview = client.post("/bulk/preview", headers=origin, data={
            "csrf": csrf.group(1), "action": "suspend", "target": "filter",
            "filter": "state=prepared,q=op-p-"})
        assert preview.status_code == 200, preview.text
        count = re.search(r'id="bulk-count">(\d+)<', preview.text)
        action_id = re.search(r'id="bulk-action-id">([^<]+)<', preview.text)
        assert count is not None and count.group(1) == "4" and action_id is not None
        confirm = {"csrf": csrf.group(1), "action_id": html.unescape(action_id.group(1))}
        done = client.post("/bulk/confirm", headers=origin, data=confirm)
        assert done.status_code == 303
        assert 'id="result-done">4<' in client.get(done.headers["location"]).text
        wait_for(lambda: ids(state="suspended") == {f"op-p-{i}" for i in range(4)},
                 "the suspended operations")
        again = client.post("/bulk/confirm", headers=origin, data=confirm)
        assert "nothing was done again" in client.get(again.headers["location"]).text
    # The CLI's bulk form on the same store.
    spec = f"state=failed,code=server_error,since={CUTOFF}"
    proc = run_cli("retry", "--store", pg_url, "--account", ACCOUNT_ID, "--filter", spec,
                   "--yes", "--action-id", "bulk-pg-0001", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["done"] == 2 and result["refused"] == 1
    assert sorted(result["done_ids"]) == ["op-se-1", "op-se-2"]
