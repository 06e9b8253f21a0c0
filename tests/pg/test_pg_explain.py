"""The operation page's account and the fleet health on the PostgreSQL store (a throwaway
cluster: the test fails, never skips, when it cannot start), on records written through
the PostgreSQL store's API: a failure's message and what to do, the lineage chain, an
orphaned operation and a worker's last heartbeat."""

from __future__ import annotations

import html
import re

from recoverable.failure_errors import ended_error

from ..dashboard.explain_store import DEAD_OWNER, add_orphan_and_worker, fill_explained
from ..dashboard.helpers import dashboard, signed_in, wait_for


def test_the_account_and_the_fleet_health_on_postgresql(pg_url: str) -> None:
    records = fill_explained(pg_url)
    with dashboard(pg_url) as info, signed_in(info) as client:
        page = client.get("/operations/op-mid").text
        error = ended_error(records["op-mid"])
        message = re.search(r'id="failure-message">(.*?)</p>', page)
        assert message is not None
        assert html.unescape(re.sub(r"<[^>]+>", "", message.group(1))) == (
            f"{error.code}: {error.what_happened()}")
        chain = re.search(r'<ol class="chain" id="lineage-chain">(.*?)</ol>', page)
        assert chain is not None
        assert re.findall(r'data-role="(\w+)"', chain.group(1)) == [
            "previous", "current", "successor"]
        add_orphan_and_worker(pg_url)
        wait_for(lambda: client.get("/api/summary").json()["orphaned"] == 1, "the orphan")
        overview = client.get("/").text
        assert DEAD_OWNER in overview and 'id="orphaned"' in overview
        workers = re.search(r'<table id="workers-table">(.*?)</table>', overview)
        assert workers is not None and "10:30:30" in workers.group(1)
