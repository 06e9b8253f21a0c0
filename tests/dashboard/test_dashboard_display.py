"""The dashboard's display in a real browser (headless Chromium, as in
``test_dashboard_browser.py``): a very long id never widens the page (it is cut with an
ellipsis, the whole value in its tooltip), and the overview's "updated" time stays in UTC
when the live view updates it, whatever the browser's own time zone."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

import recoverable

from ..cli.cli_helpers import run_cli
from .helpers import ACCOUNT_ID, copy_store, dashboard, make_store
from .test_dashboard_browser import WAIT, browser  # noqa: F401  (the shared fixture)

LONG_RESPONSE_ID = "resp_" + "x" * 507  # 512 characters, no place to break a line


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_store(tmp_path_factory.mktemp("dashboard-display"))


def _give_a_long_response_id(store_dir: Path) -> str:
    """A failed operation's attempt now carries a 512-character response id (as a
    provider may send); returns the operation's id."""
    store = recoverable.RecoveryStore.open(str(store_dir))
    try:
        records, _unreadable = store.inventory()
        record = next(record for record in records if record.attempts)
        attempt = msgspec.structs.replace(record.attempts[0], response_id=LONG_RESPONSE_ID)
        changed = msgspec.structs.replace(record, attempts=(attempt, *record.attempts[1:]))
        store.write_sync(lambda txn: txn.put_operation(changed))
        return record.operation_id
    finally:
        store.close()


def test_a_long_response_id_never_widens_the_page(
    browser: WebDriver, made: dict[str, Any], tmp_path: Path  # noqa: F811
) -> None:
    store = copy_store(made, tmp_path)
    operation_id = _give_a_long_response_id(store)
    with dashboard(store) as info:
        browser.get(info["url"])
        browser.get(f"{info['base']}/operations/{operation_id}")
        assert LONG_RESPONSE_ID in browser.page_source
        overflow = browser.execute_script(
            "return document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the page is {overflow} px wider than the window"
        shown = browser.find_element(By.CSS_SELECTOR, f'code[title="{LONG_RESPONSE_ID}"]')
        assert shown.text.startswith("resp_xxx")
        assert shown.size["width"] < 600  # cut (with an ellipsis), on one line


def _text(driver: WebDriver, element_id: str) -> str:
    """An element's text, read in one script: each poll replaces the live region whole,
    so an element found first and read after could be a stale one."""
    return str(driver.execute_script(
        "var node = document.getElementById(arguments[0]);"
        " return node === null ? '' : node.textContent;", element_id)).strip()


def test_the_updated_time_stays_in_utc(
    browser: WebDriver, made: dict[str, Any], tmp_path: Path  # noqa: F811
) -> None:
    store = copy_store(made, tmp_path)
    utc = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} UTC$")
    # A browser far from UTC: its local time would differ by 5 h 30 min.
    browser.execute_cdp_cmd("Emulation.setTimezoneOverride", {"timezoneId": "Asia/Kolkata"})
    try:
        with dashboard(store) as info:
            browser.get(info["url"])
            assert utc.match(_text(browser, "updated"))  # served in UTC
            suspended = _text(browser, "count-by_state-suspended")
            # Another process changes the store: the live view updates the page.
            run = run_cli("suspend", "--store", str(store), "--account", ACCOUNT_ID,
                          made["idle"][0])
            assert run.returncode == 0, run.stderr
            WebDriverWait(browser, WAIT).until(
                lambda driver: _text(driver, "count-by_state-suspended") != suspended)
            stamp = _text(browser, "updated")
            assert utc.match(stamp), f"the live update switched zone: {stamp!r}"
    finally:
        browser.execute_cdp_cmd("Emulation.setTimezoneOverride", {"timezoneId": ""})

