"""The dashboard in a real browser: Debian's Chromium (headless) driven by Selenium through
Debian's chromedriver, against a real batch that is running while the page is open.

Scenario: a slow provider (``recoverable fixture-provider --reply-delay``) and a batch of
jobs over it; the dashboard on the batch's store; the overview's counts change by
themselves (the page polls the dashboard, no reload); an unfinished operation is opened
from the list and cancelled through the confirmation dialog; its state becomes ``cancelled``.
On a saved, validated result (a store made by real batch runs): the cancel's dialog says
what cancel really does to it (never delivered; kept until an abandon), and it is so; the
acknowledge asks for the same confirmation, and one click that is not confirmed does not
acknowledge.
Ten overview tabs in one browser (more than its six connections per host, more than the
old cap on streams): another page still loads, every tab updates and says "live", and
each says "disconnected" once the dashboard stops. Under a live overview, another process
takes a lease and a batch fails an operation: the cards, the failure table, the attempts
histogram, availability and the owners all show it.
A screenshot of each page is saved to ``bench/results/screenshots/dashboard-*.png`` (not
tracked: the CI artifact); ``RECOVERABLE_UPDATE_SCREENSHOTS=1`` writes them to
``docs/images/`` instead (the README's copies).

When the browser cannot start, the test FAILS with the reason (it never skips): CI
installs ``chromium`` and ``chromium-driver`` (``.ci/run``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, WebDriverException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

import recoverable

from ..cli.cli_helpers import child_env, cli_command, job_line, run_cli, write_jobs
from .helpers import (
    ACCOUNT_ID,
    PROMPT_MARKER,
    REPO,
    copy_store,
    dashboard,
    lease_held,
    make_small_store,
    make_store,
    signed_in,
    wait_for,
)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
IMAGES = (
    REPO / "docs" / "images"
    if os.environ.get("RECOVERABLE_UPDATE_SCREENSHOTS") == "1"
    else REPO / "bench" / "results" / "screenshots"
)
JOBS = 40
WAIT = 60.0  # seconds: generous, a loaded 2-core machine runs a browser and a batch
# The --show-content view's saved completion (the <pre> after its heading).
SAVED_COMPLETION = "//h3[text()='Saved completion']/following-sibling::pre[1]"
DIALOG = 10.0  # seconds for a confirmation dialog to show (a click without one acts at once)


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    """One headless Chromium for the module (a fresh profile directory)."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        pytest.fail(f"the browser tests need Debian's chromium and chromium-driver: missing "
                    f"{', '.join(missing)} (apt-get install chromium chromium-driver)")
    profile = tempfile.mkdtemp(prefix="dashboard-chromium-")
    options = Options()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync", "--no-first-run",
                     "--disable-extensions", f"--user-data-dir={profile}",
                     "--window-size=1280,1000"):
        options.add_argument(argument)
    try:
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER),
                                  options=options)
    except WebDriverException as exc:
        pytest.fail(f"Chromium could not start under chromedriver: {exc.msg}")
    driver.set_page_load_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def provider() -> Iterator[dict[str, Any]]:
    """A slow loopback provider: every reply is held 0.2 s; a seeded 15 % of the replies
    are cut (disconnects), so some operations wait in a long saved cooldown."""
    proc = subprocess.Popen(
        cli_command("fixture-provider", "--port", "0", "--reply-delay", "0.2",
                    "--faults", "disconnect=0.15,seed=5"),
        stdout=subprocess.PIPE, text=True, env=child_env(),
    )
    assert proc.stdout is not None
    info: dict[str, Any] = json.loads(proc.stdout.readline())
    try:
        yield info
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _count(driver: WebDriver, element_id: str) -> int:
    # Read in one script: the live region is replaced whole by each poll, so an element
    # found first and read after could be a stale one.
    text = driver.execute_script(
        "var node = document.getElementById(arguments[0]);"
        " return node === null ? null : node.textContent;", element_id)
    if text is None:
        raise NoSuchElementException(element_id)
    return int(str(text).strip())


def _screenshot(driver: WebDriver, name: str, height: int | None = None) -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    if height is not None:
        driver.set_window_size(1280, height)
    IMAGES.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(IMAGES / f"dashboard-{name}.png"))
    driver.set_window_size(1280, 1000)


def test_overview_goes_live_during_a_batch_and_a_cancel_shows(
    browser: WebDriver, provider: dict[str, Any], tmp_path: Path
) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [
        job_line(i, input=f"{PROMPT_MARKER} review number {i}") for i in range(JOBS)
    ])
    store = tmp_path / "store"
    recoverable.RecoveryStore.open(str(store)).close()  # the batch's store, empty for now
    batch: subprocess.Popen[str] | None = None

    def start_batch() -> subprocess.Popen[str]:
        nonlocal batch
        batch = subprocess.Popen(
            cli_command("batch", str(jobs), "--out", str(tmp_path / "out.jsonl"),
                        "--store", str(store), "--endpoint", provider["http_url"],
                        "--mode", "sse", "--api-key-env", "DASHBOARD_KEY",
                        "--account", ACCOUNT_ID, "--concurrency", "8", "--backoff", "60",
                        "--max-attempts", "3"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env={**child_env(), "DASHBOARD_KEY": "sk-dashboard-test"},
        )
        return batch

    try:
        with dashboard(store, "--account", ACCOUNT_ID) as info, signed_in(info) as api:
            cancelled_job = _scenario(browser, info, api, start_batch)
        assert batch is not None
        # The operations still in their cooldown would wait a minute: stop the batch (it
        # suspends them). The cancelled job was never committed; none was committed twice.
        batch.send_signal(signal.SIGINT)
        stdout, stderr = batch.communicate(timeout=WAIT * 2)
        lines = [json.loads(line) for line in
                 (tmp_path / "out.jsonl").read_text().splitlines()]
        assert len(lines) == len({line["id"] for line in lines}), (stdout, stderr)
        assert cancelled_job not in {line["id"] for line in lines}
    finally:
        if batch is not None and batch.poll() is None:
            batch.kill()
            batch.wait()


def _scenario(browser: WebDriver, info: dict[str, Any], api: Any,
              start_batch: Callable[[], subprocess.Popen[str]]) -> str:
    # The overview, opened with the printed URL (the token signs the browser in).
    browser.get(info["url"])
    assert browser.current_url == info["base"] + "/"  # the token left the address bar
    WebDriverWait(browser, WAIT).until(
        expected_conditions.presence_of_element_located((By.ID, "count-total")))
    assert _count(browser, "count-total") == 0
    # The batch starts while the page is open: its counts change by themselves (the
    # page polls), no reload.
    batch = start_batch()
    WebDriverWait(browser, WAIT).until(
        lambda driver: _count(driver, "count-by_state-acknowledged") > 0,
        "the overview's counts did not change during the batch")
    assert _count(browser, "count-total") > 0
    assert batch.poll() is None, "the batch ended before the page saw it run"
    WebDriverWait(browser, WAIT).until(
        lambda driver: _count(driver, "count-by_state-acknowledged") >= JOBS // 2,
        "the batch did not go on")
    browser.refresh()  # a fresh page for the screenshot
    WebDriverWait(browser, WAIT).until(
        expected_conditions.presence_of_element_located((By.ID, "count-total")))
    _screenshot(browser, "overview", height=1500)

    # An operation the batch is running (in its saved cooldown), from the list.
    def waiting() -> dict[str, Any] | None:
        rows = api.get("/api/operations", params={"state": "running"}).json()["operations"]
        return next((row for row in rows if row["availability"] == "waiting"), None)

    row = wait_for(waiting, "an operation in a saved cooldown")
    operation_id = row["operation_id"]
    browser.get(f"{info['base']}/operations?state=running")
    _screenshot(browser, "operations")
    browser.find_element(By.LINK_TEXT, operation_id).click()
    WebDriverWait(browser, WAIT).until(
        expected_conditions.presence_of_element_located((By.ID, "op-state")))
    assert operation_id in browser.title
    assert browser.find_element(By.ID, "op-state").text == "running"
    assert PROMPT_MARKER not in browser.page_source and ACCOUNT_ID not in browser.page_source

    # Cancel: the confirmation dialog says what it does; accepting it cancels.
    browser.find_element(By.ID, "action-cancel").click()
    dialog = WebDriverWait(browser, WAIT).until(expected_conditions.alert_is_present())
    assert dialog is not False
    assert "Cancel permanently" in dialog.text
    dialog.accept()
    WebDriverWait(browser, WAIT).until(
        expected_conditions.presence_of_element_located((By.ID, "flash")))
    assert browser.find_element(By.ID, "flash").text.startswith("cancel:")

    # Another process may be running it: it applies the cancel at its next check.
    def cancelled() -> bool:
        browser.refresh()
        return bool(re.fullmatch("cancelled", browser.find_element(By.ID, "op-state").text))

    wait_for(cancelled, "the operation's state to become cancelled")
    assert browser.find_element(By.ID, "op-availability").text == "permanently_cancelled"
    _screenshot(browser, "operation", height=1100)
    # The overview counts it (live).
    browser.get(info["base"] + "/")
    WebDriverWait(browser, WAIT).until(
        lambda driver: _count(driver, "count-by_state-cancelled") == 1,
        "the overview does not count the cancelled operation")
    return str(row["job_id"])


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A store made by real batch runs, with one saved, unacknowledged result."""
    return make_store(tmp_path_factory.mktemp("dashboard-browser-store"))


def _open_saved(browser: WebDriver, info: dict[str, Any], api: Any) -> str:
    """The saved result's page, opened in the browser (signed in with the printed URL)."""
    rows = api.get("/api/operations", params={"state": "completed"}).json()["operations"]
    assert len(rows) == 1, rows
    operation_id = str(rows[0]["operation_id"])
    browser.get(info["url"])
    browser.get(f"{info['base']}/operations/{operation_id}")
    WebDriverWait(browser, WAIT).until(
        expected_conditions.presence_of_element_located((By.ID, "op-state")))
    assert browser.find_element(By.ID, "op-state").text == "completed"
    return operation_id


def _confirm(browser: WebDriver, element_id: str) -> Any:
    browser.find_element(By.ID, element_id).click()
    dialog = WebDriverWait(browser, DIALOG).until(
        expected_conditions.alert_is_present(),
        f"{element_id}: one click acted without a confirmation dialog")
    assert dialog is not False
    return dialog


def test_cancel_of_a_saved_result_says_what_it_does_and_does_it(
    browser: WebDriver, made: dict[str, Any], tmp_path: Path
) -> None:
    store = copy_store(made, tmp_path)
    with dashboard(store, "--account", ACCOUNT_ID, "--show-content") as info, \
            signed_in(info) as api:
        operation_id = _open_saved(browser, info, api)
        completion = browser.find_element(By.XPATH, SAVED_COMPLETION).text
        assert completion and completion != "(none)"
        dialog = _confirm(browser, "action-cancel")
        # The promise is the library's: cancel never delivers it; the content stays in the
        # store until an abandon removes it (not "it can never be read").
        assert "never be read" not in dialog.text
        assert "NEVER delivered" in dialog.text and "until you Abandon" in dialog.text
        dialog.accept()
        WebDriverWait(browser, WAIT).until(
            expected_conditions.presence_of_element_located((By.ID, "flash")))
        assert browser.find_element(By.ID, "op-state").text == "cancelled"
        assert "stays in the store until you abandon" in browser.find_element(
            By.ID, "flash").text
        # And so it is: the content view still shows it, and says it is fenced off ...
        assert browser.find_element(By.XPATH, SAVED_COMPLETION).text == completion
        assert "never delivered" in browser.find_element(By.ID, "content-fenced").text
        # ... no read path of the library delivers it ...
        receipt = run_cli("receipt", "--store", str(store), "--account", ACCOUNT_ID,
                          operation_id)
        assert receipt.returncode == 1 and "operation_cancelled" in receipt.stderr
        assert completion not in receipt.stdout
        # ... and the abandon the dialog named removes it.
        _confirm(browser, "action-abandon").accept()
        WebDriverWait(browser, WAIT).until(
            lambda driver: driver.find_element(By.ID, "op-state").text == "abandoned")
        assert not browser.find_elements(By.XPATH, SAVED_COMPLETION)
        assert completion not in browser.page_source


def test_acknowledge_needs_the_confirmation(
    browser: WebDriver, made: dict[str, Any], tmp_path: Path
) -> None:
    store = copy_store(made, tmp_path)
    with dashboard(store, "--account", ACCOUNT_ID) as info, signed_in(info) as api:
        operation_id = _open_saved(browser, info, api)
        # One click asks first; declined, nothing is acknowledged.
        dialog = _confirm(browser, "action-acknowledge")
        assert "REMOVES the saved" in dialog.text
        dialog.dismiss()
        browser.refresh()
        assert browser.find_element(By.ID, "op-state").text == "completed"
        summary = api.get("/api/summary").json()["by_state"]
        assert summary.get("completed") == 1 and summary.get("acknowledged") == 3
        # Confirmed, it acknowledges.
        _confirm(browser, "action-acknowledge").accept()
        WebDriverWait(browser, WAIT).until(
            expected_conditions.presence_of_element_located((By.ID, "flash")))
        assert browser.find_element(By.ID, "flash").text == (
            f"acknowledge: {operation_id} is now acknowledged")
        assert browser.find_element(By.ID, "op-state").text == "acknowledged"


def _signed_in_page(browser: WebDriver, url: str) -> None:
    browser.get(url)
    assert "token_required" not in browser.page_source, f"not signed in at {url}"
    WebDriverWait(browser, WAIT).until(
        expected_conditions.presence_of_element_located((By.ID, "count-total")),
        f"not signed in at {url}: {browser.page_source[:300]}")


def test_two_dashboards_on_two_ports_keep_their_own_sessions(
    browser: WebDriver, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    recoverable.RecoveryStore.open(str(store)).close()
    with dashboard(store) as first, dashboard(store) as second:
        _signed_in_page(browser, first["url"])
        _signed_in_page(browser, second["url"])
        # Signing into the second kept the first signed in (the cookies of a host are
        # shared by all its ports: each dashboard has its own name).
        _signed_in_page(browser, first["base"] + "/")
        names = {cookie["name"] for cookie in browser.get_cookies()}
        assert {f"recoverable_dashboard_{first['port']}",
                f"recoverable_dashboard_{second['port']}"} <= names
        assert all(cookie["httpOnly"] and cookie["sameSite"] == "Strict"
                   for cookie in browser.get_cookies())


def test_the_page_offers_only_the_actions_the_server_allows(
    browser: WebDriver, tmp_path: Path
) -> None:
    made = make_small_store(tmp_path)
    leased = made["idle"][0]
    with lease_held(made["store"], leased), \
            dashboard(made["store"], "--account", ACCOUNT_ID) as info, signed_in(info) as api:
        failed = api.get("/api/operations", params={"state": "failed"}).json()["operations"]
        browser.get(info["url"])

        def offered(element_id: str) -> bool:
            return browser.find_element(By.ID, element_id).is_enabled()

        def why(element_id: str) -> str:
            return str(browser.find_element(By.ID, f"{element_id}-why").text)

        browser.get(f"{info['base']}/operations/{leased}")
        assert browser.find_element(By.ID, "op-state").text == "prepared"
        assert not offered("action-abandon")
        assert why("action-abandon").startswith("another process runs it (lease owner ")
        assert offered("action-suspend") and offered("action-cancel")
        browser.get(f"{info['base']}/operations/{failed[0]['operation_id']}")
        assert browser.find_element(By.ID, "op-state").text == "failed"
        assert not offered("action-suspend")
        assert why("action-suspend") == "nothing to suspend: it is failed"
        assert offered("action-cancel") and offered("action-retry")
        # An operation nobody runs may be abandoned.
        browser.get(f"{info['base']}/operations/{made['idle'][1]}")
        assert offered("action-abandon")


TABS = 10  # overview tabs in one browser: over the old cap of 8 streams and 6 connections
PAGE_LOAD = 20.0  # seconds: a page held up behind the browser's six connections never loads


def _live_state(driver: WebDriver) -> str:
    return str(driver.execute_script(
        "var node = document.getElementById('live-state');"
        " return node === null ? '' : node.textContent;")).strip()


def test_many_overview_tabs_all_update_and_say_when_the_dashboard_is_gone(
    browser: WebDriver, tmp_path: Path
) -> None:
    made = make_small_store(tmp_path)
    first_tab = browser.current_window_handle
    tabs: list[str] = []
    browser.set_page_load_timeout(PAGE_LOAD)
    try:
        with dashboard(made["store"], "--account", ACCOUNT_ID) as info:
            browser.get(info["url"])
            for _ in range(TABS):
                browser.switch_to.new_window("tab")
                tabs.append(browser.current_window_handle)
                browser.get(info["base"] + "/")
                WebDriverWait(browser, WAIT).until(
                    expected_conditions.presence_of_element_located((By.ID, "count-total")))
            # With every overview open, another page of the same dashboard still loads.
            browser.switch_to.new_window("tab")
            tabs.append(browser.current_window_handle)
            browser.get(f"{info['base']}/operations/{made['idle'][0]}")
            assert browser.find_element(By.ID, "op-state").text == "prepared"
            # Another process changes the store: every overview shows it, and says live.
            done = run_cli("suspend", "--store", str(made["store"]), "--account", ACCOUNT_ID,
                           made["idle"][1])
            assert done.returncode == 0, done.stderr
            for handle in tabs[:TABS]:
                browser.switch_to.window(handle)
                WebDriverWait(browser, WAIT).until(
                    lambda driver: _count(driver, "count-by_state-suspended") == 1
                    and _live_state(driver) == "live",
                    "an overview tab did not update")
        # The dashboard stopped: every overview says so instead of "live".
        for handle in tabs[:TABS]:
            browser.switch_to.window(handle)
            WebDriverWait(browser, WAIT).until(
                lambda driver: _live_state(driver) == "disconnected",
                "an overview tab still says live with the dashboard gone")
            assert "does not answer" in browser.find_element(By.ID, "live-reason").text
    finally:
        for handle in tabs:
            browser.switch_to.window(handle)
            browser.close()
        browser.switch_to.window(first_tab)
        browser.set_page_load_timeout(WAIT)


OWNER_LIVE = "#panel-owners tr:nth-child(2) td:nth-child(3)"  # the first owner's "live"


def _text(driver: WebDriver, element_id: str) -> str:
    """An element's whole text, hidden parts included (the charts' SVG titles)."""
    return str(driver.execute_script(
        "return document.getElementById(arguments[0]).textContent;", element_id))


def test_every_panel_of_a_live_overview_follows_the_store(
    browser: WebDriver, tmp_path: Path
) -> None:
    made = make_small_store(tmp_path)
    store = made["store"]
    with dashboard(store, "--account", ACCOUNT_ID) as info:
        browser.get(info["url"])
        WebDriverWait(browser, WAIT).until(
            expected_conditions.presence_of_element_located((By.ID, "count-total")))
        assert _count(browser, "count-by_state-failed") == 1
        assert "invalid_output1" in _text(browser, "panel-failures")
        assert "no process holds a lease" in _text(browser, "panel-owners")
        # Another process takes a lease: the owners panel shows it, live.
        with lease_held(store, made["idle"][0]) as owner_id:
            WebDriverWait(browser, WAIT).until(
                lambda driver: owner_id in str(driver.find_element(
                    By.CSS_SELECTOR, "#panel-owners code").get_attribute("title")),
                "the owners panel did not show the new lease")
            assert browser.find_element(By.CSS_SELECTOR, OWNER_LIVE).text == "yes"
        # Its process let go of the store: the same row, no longer live.
        WebDriverWait(browser, WAIT).until(
            lambda driver: driver.find_element(By.CSS_SELECTOR, OWNER_LIVE).text == "no",
            "the owners panel still shows a gone owner as live")
        # Another batch's operation fails: the card, the failure table, the attempts
        # histogram, the availability table all show it, from the same read.
        failing = write_jobs(tmp_path / "more.jsonl",
                             [job_line(2, input=f"{PROMPT_MARKER} more")])
        run = run_cli("batch", str(failing), "--out", str(tmp_path / "out.jsonl"),
                      "--store", str(store), "--account", ACCOUNT_ID,
                      "--faults", "schema_violation=1.0", "--max-attempts", "1")
        assert run.returncode == 1, run.stderr
        WebDriverWait(browser, WAIT).until(
            lambda driver: _count(driver, "count-by_state-failed") == 2,
            "the failed card did not update")
        assert _count(browser, "count-total") == 4
        assert "invalid_output2" in _text(browser, "panel-failures")
        assert "1 attempt(s): 2" in _text(browser, "panel-histogram")
        assert "failed2" in _text(browser, "panel-availability")
        assert _live_state(browser) == "live"
