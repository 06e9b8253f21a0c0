"""The console says what happened and what to do, over HTTP (httpx against the real
dashboard process, a real LMDB store written through the store's API): a failed
operation's message and suggested action (the very sentences of the CLI's typed error),
each attempt's failure in words, the operation's and each attempt's recorded times ("-"
with a tooltip for what the store does not record), the lineage as a linked chain, the
glossary (its sentences are ``docs/architecture.md``'s), and the overview's fleet health:
owners and workers with their last heartbeat, orphaned operations pointing to
``recoverable sweep``, and a running batch's pace."""

from __future__ import annotations

import html
import re
import subprocess
from pathlib import Path
from typing import Any, get_args
from urllib.parse import quote

import pytest

import recoverable
from recoverable.dashboard.fleet import PACE_WINDOW, measure_pace
from recoverable.dashboard.glossary import AVAILABILITY_TERMS, TERMS
from recoverable.failure_errors import ended_error
from recoverable.failure_text import describe_interruption
from recoverable.records import AttemptRecord, RetryReservation
from recoverable.storage.queue import WorkerRow
from recoverable.types import Availability

from ..cli.cli_helpers import child_env, cli_command, job_line, run_cli, write_jobs
from .console_store import LATE, _record, save
from .explain_store import DEAD_OWNER, INVALID, SERVER_ERROR, add_orphan_and_worker, fill_explained
from .helpers import ACCOUNT, ACCOUNT_ID, PROMPT_MARKER, dashboard, signed_in, wait_for

REPO = Path(__file__).resolve().parents[2]
NOT_RECORDED = '<span class="muted" title="not recorded in the store">-</span>'


@pytest.fixture(scope="module")
def explained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("explain-store")
    records = fill_explained(str(root / "store"))
    return {"store": root / "store", "records": records}


def _element(text: str, element_id: str) -> str:
    """The inner HTML of the element with this id (no nested element of the same tag)."""
    match = re.search(r'<(\w+)[^>]* id="' + element_id + r'"[^>]*>(.*?)</\1>', text, re.S)
    assert match is not None, f"no #{element_id}"
    return match.group(2)


def _plain(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def test_a_failure_says_what_happened_and_what_to_do(explained: dict[str, Any]) -> None:
    records = explained["records"]
    with dashboard(explained["store"]) as info, signed_in(info) as client:
        for op_id in ("op-root", "op-mid"):
            page = client.get(f"/operations/{op_id}")
            assert page.status_code == 200, page.text
            error = ended_error(records[op_id])  # what the CLI's batch prints for it
            message = _plain(_element(page.text, "failure-message"))
            action = _plain(_element(page.text, "failure-action"))
            assert message == f"{error.code}: {error.what_happened()}"
            assert action == f"What to do: {error.what_to_do()}"
            assert str(error).endswith(f"{error.what_happened()}; {error.what_to_do()}")
        # Each attempt's failure in words, as the CLI's errors describe it.
        root = html.unescape(client.get("/operations/op-root").text)
        assert describe_interruption(SERVER_ERROR) in root
        assert "HTTP 500" in root
        mid = html.unescape(client.get("/operations/op-mid").text)
        assert describe_interruption(INVALID) in mid
        # A completed operation has nothing to explain.
        assert 'id="what-happened"' not in client.get("/operations/op-last").text


def test_times_are_those_recorded_and_never_invented(explained: dict[str, Any]) -> None:
    with dashboard(explained["store"]) as info, signed_in(info) as client:
        last = client.get("/operations/op-last").text
        assert _plain(_element(last, "op-created")) == "2026-12-01 10:30:00 UTC"
        assert _plain(_element(last, "op-updated")) == "2026-12-01 10:30:06 UTC"
        assert _plain(_element(last, "op-finished")) == "2026-12-01 10:30:06 UTC"
        assert "finished (completed)" in last
        timeline = last[last.index("Attempt timeline"):]
        # started, ended (the completion), duration, time to first event (not recorded)
        assert "<td>2026-12-01 10:30:01 UTC</td><td>2026-12-01 10:30:06 UTC</td>" in timeline
        assert "<td>5.50 s</td><td>" + NOT_RECORDED + "</td>" in timeline
        # A failed operation's end and its attempt's end are not recorded: "-".
        root = client.get("/operations/op-root").text
        assert 'id="op-finished">' + NOT_RECORDED in root and "finished (failed)" in root
        root_timeline = root[root.index("Attempt timeline"):]
        assert ("<td>2026-12-01 10:28:10 UTC</td><td>" + NOT_RECORDED + "</td><td>"
                + NOT_RECORDED + "</td><td>" + NOT_RECORDED + "</td>") in root_timeline


def test_the_lineage_is_a_linked_chain(explained: dict[str, Any]) -> None:
    with dashboard(explained["store"]) as info, signed_in(info) as client:
        def chain(op_id: str) -> list[tuple[str, str]]:
            text = _element(client.get(f"/operations/{op_id}").text, "lineage-chain")
            return re.findall(r'<li data-role="(\w+)">.*?title="([^"]+)"', text)

        assert chain("op-mid") == [("previous", "op-root"), ("current", "op-mid"),
                                   ("successor", "op-last")]
        assert chain("op-root") == [("current", "op-root"), ("successor", "op-mid"),
                                    ("successor", "op-last")]
        assert chain("op-last") == [("previous", "op-root"), ("previous", "op-mid"),
                                    ("current", "op-last")]
        mid = client.get("/operations/op-mid").text
        assert 'href="/operations/op-root"' in mid and 'href="/operations/op-last"' in mid


def _glossary_doc() -> dict[str, str]:
    """``docs/architecture.md``'s glossary: each term's and availability value's text."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("## 7. Glossary"):text.index("## Where it is going")]
    found: dict[str, str] = {}
    entries = re.split(r"\n(?=- \*\*|  - `)", section)
    for entry in entries:
        flat = " ".join(entry.split())
        term = re.match(r"- \*\*(.+?)\*\* \(.*?\): (.*)", flat)
        if term is not None:
            found[term.group(1)] = term.group(2)
        value = re.match(r"- `(\w+)`: (.*)", flat)
        if value is not None:
            found[f"availability:{value.group(1)}"] = value.group(2)
    return found


def test_the_glossary_is_the_documents_and_on_every_page(explained: dict[str, Any]) -> None:
    documented = _glossary_doc()
    for term, text in TERMS.items():
        assert documented[term] == text, term
    for value, text in AVAILABILITY_TERMS.items():
        assert documented[f"availability:{value}"] == text, value
    # Every availability value a status can have is explained.
    assert set(AVAILABILITY_TERMS) == set(get_args(Availability))
    with dashboard(explained["store"]) as info, signed_in(info) as client:
        for path in ("/", "/operations", "/operations/op-mid"):
            page = client.get(path).text
            glossary = _plain(_element(page, "glossary"))
            for term in ("Fence", "Lease", "Preserve / reselect"):
                assert term in glossary and TERMS[term].replace("`", "") in glossary
            for value, text in AVAILABILITY_TERMS.items():
                assert value in glossary and text.replace("`", "") in glossary
        # The availability shown has its meaning as a tooltip: on the overview, in the
        # list and on the operation's page.
        failed = (f'<abbr class="term" title="{html.escape(AVAILABILITY_TERMS["failed"])}">'
                  "failed</abbr>")
        assert failed in _element(client.get("/").text, "panel-availability")
        assert failed in client.get("/operations").text
        mid = client.get("/operations/op-mid").text
        assert (f'<abbr class="term" id="op-availability" title="'
                f'{html.escape(AVAILABILITY_TERMS["failed"])}">failed</abbr>') in mid


def test_fleet_health_flags_orphans_and_shows_heartbeats(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    fill_explained(store)
    with dashboard(store) as info, signed_in(info) as client:
        assert client.get("/api/summary").json()["orphaned"] == 0
        assert 'id="orphaned"' not in client.get("/").text
        # A process dies holding a lease (its owner is gone) while the dashboard runs.
        add_orphan_and_worker(store)
        wait_for(lambda: client.get("/api/summary").json()["orphaned"] == 1, "the orphan")
        page = client.get("/").text
        owners = _element(page, "panel-owners")
        assert DEAD_OWNER in owners
        assert 'data-orphaned="1"' in owners
        orphaned = _plain(_element(page, "orphaned"))
        assert orphaned.startswith("1 operation(s) orphaned")
        assert "recoverable sweep --store STORE" in orphaned
        assert "10:30:32" in owners  # the lease was renewed until LATE + 32
        workers = _plain(_element(page, "panel-workers"))
        assert "10:30:30" in workers and "fixture" in workers  # BEAT: LATE + 30 s
        alone = client.get("/operations/op-orphan").text
        assert 'id="lineage-chain-alone"' in alone
        flag = _plain(_element(alone, "op-orphaned"))
        assert flag.startswith("orphaned: its lease names the owner")
        assert "recoverable sweep --store STORE" in flag and DEAD_OWNER in alone
        assert 'id="op-orphaned"' not in client.get("/operations/op-mid").text
        # Still under way: not finished (an "-" that says so).
        unfinished = '<span class="muted" title="not finished">-</span>'
        assert 'id="op-finished">' + unfinished in alone
        # The owner's leases link to their list, which holds the orphan.
        listed = client.get("/api/operations", params={"owner": DEAD_OWNER[:8]}).json()
        assert [row["operation_id"] for row in listed["operations"]] == ["op-orphan"]
        assert listed["operations"][0]["orphaned"] is True
        listing = client.get("/operations", params={"owner": DEAD_OWNER[:8]}).text
        assert ">orphaned</span>" in listing and "recoverable sweep closes it" in listing
        # Nothing runs: the pace says "-" and why.
        pace = client.get("/api/summary").json()["pace"]
        assert pace["eta_seconds"] is None and pace["why"]
        assert _plain(_element(page, "pace-eta")) == "-"


def test_a_running_batch_shows_its_pace(tmp_path: Path) -> None:
    """A real batch on a worker process, throttled (about 4 POSTs per second) so it runs
    for several seconds: the overview measures its jobs/s, error rate and ETA between live
    updates, and shows the live worker with its heartbeat."""
    store = tmp_path / "store"
    jobs = write_jobs(tmp_path / "jobs.jsonl",
                      [job_line(index, input=f"{PROMPT_MARKER} {index}") for index in range(40)])
    seed = run_cli("batch", str(write_jobs(tmp_path / "seed.jsonl", [job_line(99)])),
                   "--out", str(tmp_path / "out.jsonl"), "--store", str(store),
                   "--account", ACCOUNT_ID)
    assert seed.returncode == 0, seed.stderr
    with dashboard(store) as info, signed_in(info) as client:
        batch = subprocess.Popen(
            cli_command("batch", str(jobs), "--out", str(tmp_path / "out.jsonl"), "--store",
                        str(store), "--account", ACCOUNT_ID, "--workers", "1",
                        "--rpm", "240", "--rate-burst-seconds", "1"),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env=child_env())
        try:
            def measured() -> str | None:
                page = client.get("/").text  # one summary: the pace and the workers
                return page if _plain(_element(page, "pace-eta")) != "-" else None

            page = wait_for(measured, "a measured pace", timeout=60)
            # Measured and positive; at most the throttle's 4 POSTs a second with its
            # burst (a loaded machine measured 0.16 jobs/s: no lower bound on speed).
            assert 0.0 < float(_plain(_element(page, "pace-rate"))) < 20
            assert _plain(_element(page, "pace-errors")) == "0.0 %"
            assert re.fullmatch(r"\d+ s|\d+ min", _plain(_element(page, "pace-eta")))
            assert int(_plain(_element(page, "pace-remaining"))) > 0
            workers = _element(page, "workers-table")
            assert '<span class="ok">yes</span>' in workers  # the batch's worker, live
            pace = client.get("/api/summary").json()["pace"]
            assert set(pace) == {"jobs_per_second", "error_rate", "eta_seconds", "remaining",
                                 "why"}
        finally:
            _out, err = batch.communicate(timeout=120)
        assert batch.returncode == 0, err


HOSTILE_ID = '"><img src=x onerror=alert(1)>'
HOSTILE_ENDPOINT = "<script>alert(2)</script>"


def test_the_new_fields_stay_escaped(tmp_path: Path) -> None:
    """Stored text reaches the new fields only escaped: an operation id in the lineage
    chain, a worker's endpoint, a provider's code in an attempt's failure sentence."""
    store = str(tmp_path / "store")
    hostile = recoverable.Interruption(kind="http_rejected", http_status=400,
                                       provider_code="<b>code</b>")
    members = [
        _record(HOSTILE_ID, ACCOUNT, "gpt-a", LATE - 60, "job-x", phase="failed",
                failure_reason="rejected", attempts_used=1, last_failure=hostile,
                retry_reservation=RetryReservation(retry_action_id="r", successor_id="op-x",
                                                   settings_hash="0" * 16, created=True),
                attempts=(AttemptRecord("hostile.1", 1, "initial", LATE - 50, "failed",
                                        failure=hostile),)),
        _record("op-x", ACCOUNT, "gpt-a", LATE, "job-x", root_operation_id=HOSTILE_ID,
                previous_operation_id=HOSTILE_ID),
    ]

    save(store, members)
    with dashboard(store) as info, signed_in(info) as client:
        opened = recoverable.RecoveryStore.open(store)
        try:
            opened.write_sync(lambda txn: txn.register_worker("h" * 16, WorkerRow(
                account_id=ACCOUNT.account_id, source=ACCOUNT.source,
                endpoint_id=HOSTILE_ENDPOINT, concurrency=1, started_at=LATE)))
        finally:
            opened.close()
        chain_page = client.get("/operations/op-x").text
        assert "<img" not in chain_page
        assert html.escape(HOSTILE_ID) in _element(chain_page, "lineage-chain")
        failed = client.get("/operations/" + quote(HOSTILE_ID, safe="")).text
        assert failed.count("<img") == 0 and "<b>code</b>" not in failed
        assert 'id="failure-message"' in failed
        # The element itself (the page's script names the id too, before any row).
        overview = wait_for(lambda: (
            lambda page: page if 'id="workers-table"' in page else None
        )(client.get("/").text), "the worker row")
        assert "<script>alert(2)" not in overview
        assert html.escape(HOSTILE_ENDPOINT) in _element(overview, "workers-table")


def test_the_pace_is_measured_over_the_window_and_says_why_not() -> None:
    """``measure_pace`` alone, on given counts: "-" (None) with a reason until measurable;
    then settled per second, failed among them and the ETA of what is left; samples older
    than the window are dropped."""
    def counts(settled: int, failed: int, left: int) -> dict[str, int]:
        return {"acknowledged": settled - failed, "failed": failed, "prepared": left}

    first = measure_pace(None, 1000.0, counts(0, 0, 100))
    assert first.jobs_per_second is None and "not enough data" in first.why
    early = measure_pace(first, 1001.0, counts(2, 0, 98))
    assert early.jobs_per_second is None  # 1 s apart: under PACE_MIN_SPAN
    later = measure_pace(early, 1010.0, counts(20, 5, 80))
    assert later.jobs_per_second == pytest.approx(2.0)  # 20 settled in 10 s
    assert later.error_rate == pytest.approx(0.25)
    assert later.eta_seconds == pytest.approx(40.0)  # 80 left at 2 per second
    assert later.why == ""
    stalled = measure_pace(later, 1020.0, counts(20, 5, 80))
    assert stalled.jobs_per_second == pytest.approx(1.0)  # still over the whole window
    moved_on = measure_pace(stalled, 1000.0 + PACE_WINDOW + 15, counts(20, 5, 80))
    assert moved_on.samples[0][0] == 1020.0  # the samples before the window are gone
    assert moved_on.jobs_per_second == 0.0 and moved_on.eta_seconds is None
    assert "no operation settled" in moved_on.why
    done = measure_pace(moved_on, 1100.0, counts(100, 5, 0))
    assert done.eta_seconds is None and done.why == "nothing left to run"


def test_a_disposed_operation_shows_its_marker_time_and_lineage(tmp_path: Path) -> None:
    """Acknowledged, only its marker is left: finished at the acknowledgement, created and
    updated "-" (not kept), and its lineage still read from the store."""
    store = str(tmp_path / "store")
    fill_explained(store)
    run = run_cli("acknowledge", "--store", store, "--account", ACCOUNT_ID, "op-last")
    assert run.returncode == 0, run.stderr
    with dashboard(store) as info, signed_in(info) as client:
        page = client.get("/operations/op-last").text
        assert "finished (acknowledged)" in page
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC",
                            _plain(_element(page, "op-finished")))
        gone = '<span class="muted" title="not kept once only a marker is left">-</span>'
        assert 'id="op-created">' + gone in page and 'id="op-updated">' + gone in page
        roles = re.findall(r'<li data-role="(\w+)">', _element(page, "lineage-chain"))
        assert roles == ["previous", "previous", "current"]
        # Its predecessor's chain still links to it.
        assert 'href="/operations/op-last"' in client.get("/operations/op-mid").text


def test_a_long_lineage_is_cut_and_a_purged_one_ends_the_walk(tmp_path: Path) -> None:
    """Eleven operations, each the manual retry of the one before: from either end the
    chain reads 8 steps; from the last, the root then "…" lead it. An operation whose
    previous one (its root) was purged links to nothing it cannot show."""
    store = str(tmp_path / "store")
    ids = [f"op-l-{index:02d}" for index in range(11)]
    members = [
        _record(op_id, ACCOUNT, "gpt-a", LATE + index, "job-l", root_operation_id=ids[0],
                previous_operation_id=ids[index - 1] if index else None,
                retry_reservation=(RetryReservation(
                    retry_action_id="r", successor_id=ids[index + 1], settings_hash="0" * 16,
                    created=True) if index < 10 else None))
        for index, op_id in enumerate(ids)
    ]
    members.append(_record("op-after-gone", ACCOUNT, "gpt-a", LATE, "job-g",
                           root_operation_id="op-gone", previous_operation_id="op-gone"))

    save(store, members)
    with dashboard(store) as info, signed_in(info) as client:
        def chain(op_id: str) -> list[str]:
            text = _element(client.get(f"/operations/{op_id}").text, "lineage-chain")
            items = re.findall(r"<li[^>]*>(.*?)</li>", text)
            return [html.unescape(_plain(item)) if item == "…" else
                    re.findall(r'title="([^"]+)"', item)[0] for item in items]

        last = chain(ids[10])
        assert last == [ids[0], "…", *ids[2:10], ids[10]]  # the root, "…", 8, this one
        assert chain(ids[0]) == ids[0:9]  # this one, then 8 successors
        page = client.get("/operations/op-after-gone").text
        assert 'id="lineage-chain-alone"' in page
        assert "no earlier or later operation in the store" in page
