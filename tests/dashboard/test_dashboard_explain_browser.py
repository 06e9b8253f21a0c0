"""The operation page's account and the glossary in a real browser (headless Chromium under
Selenium, as in ``test_dashboard_browser.py``; it fails, never skips, when the browser
cannot start): the failure's message and what to do, the recorded times, the lineage
chain followed by its links, and the glossary popover opened from the header (closed
until clicked; the availability's meaning in its tooltip). Saves the screenshot
``dashboard-explain.png`` (see ``test_dashboard_browser.IMAGES``)."""

from __future__ import annotations

from pathlib import Path

from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from recoverable.dashboard.glossary import AVAILABILITY_TERMS, TERMS
from recoverable.failure_errors import ended_error

from .explain_store import fill_explained
from .helpers import ACCOUNT_ID, dashboard
from .test_dashboard_browser import WAIT, _screenshot, browser  # noqa: F401  (shared fixture)


def test_the_operation_page_explains_and_the_glossary_opens(
    browser: WebDriver, tmp_path: Path  # noqa: F811
) -> None:
    store = tmp_path / "store"
    records = fill_explained(str(store))
    with dashboard(store, "--account", ACCOUNT_ID) as info:
        browser.get(info["url"])
        browser.get(f"{info['base']}/operations/op-mid")
        WebDriverWait(browser, WAIT).until(
            expected_conditions.presence_of_element_located((By.ID, "what-happened")))
        error = ended_error(records["op-mid"])
        message = browser.find_element(By.ID, "failure-message").text
        assert message == f"{error.code}: {error.what_happened()}"
        action = browser.find_element(By.ID, "failure-action").text
        assert action == f"What to do: {error.what_to_do()}"
        assert browser.find_element(By.ID, "op-created").text == "2026-12-01 10:29:00 UTC"
        finished = browser.find_element(By.CSS_SELECTOR, "#op-finished span")
        assert finished.text == "-"
        assert finished.get_attribute("title") == "not recorded in the store"
        # The lineage: root -> this one -> its successor, each a link.
        roles = [item.get_attribute("data-role") for item in
                 browser.find_elements(By.CSS_SELECTOR, "#lineage-chain li")]
        assert roles == ["previous", "current", "successor"]
        # The availability's meaning is its tooltip.
        availability = browser.find_element(By.ID, "op-availability")
        assert availability.text == "failed"
        assert availability.get_attribute("title") == AVAILABILITY_TERMS["failed"]
        # The glossary is closed until its summary is clicked; then it shows every term.
        fence = TERMS["Fence"].replace("`", "")
        body = browser.find_element(By.CSS_SELECTOR, "#glossary .glossary-body")
        assert not body.is_displayed()
        browser.find_element(By.CSS_SELECTOR, "#glossary summary").click()
        WebDriverWait(browser, WAIT).until(lambda driver: body.is_displayed())
        assert fence in body.text
        assert TERMS["Preserve / reselect"] in body.text
        assert "replacement_eligible" in body.text
        _screenshot(browser, "explain")
        # A second click closes it (it floats over the page while open).
        browser.find_element(By.CSS_SELECTOR, "#glossary summary").click()
        WebDriverWait(browser, WAIT).until(lambda driver: not body.is_displayed())
        # Following the chain: the successor's page, whose chain ends at it.
        browser.find_element(By.CSS_SELECTOR, '#lineage-chain li[data-role="successor"] a'
                             ).click()
        WebDriverWait(browser, WAIT).until(
            lambda driver: driver.current_url.endswith("/operations/op-last"))
        timeline = browser.find_element(By.ID, "timeline").text
        assert "5.50 s" in timeline
        roles = [item.get_attribute("data-role") for item in
                 browser.find_elements(By.CSS_SELECTOR, "#lineage-chain li")]
        assert roles == ["previous", "previous", "current"]
