"""The console in a real browser (headless Chromium under Selenium, as in
``test_dashboard_browser.py``; it fails, never skips, when the browser cannot start):
from the overview's failure count to the filtered list, the filter form (its values in
the URL), a bulk manual retry over the filter with its preview and one confirmation,
and the result. Saves the screenshots ``dashboard-console-list.png`` and
``dashboard-console-bulk.png`` (see ``test_dashboard_browser.IMAGES``)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import Select, WebDriverWait

from .console_store import CUTOFF, fill
from .helpers import ACCOUNT_ID, dashboard
from .test_dashboard_browser import WAIT, _screenshot, browser  # noqa: F401  (shared fixture)

# A form like the preview's confirmation, with the same fields, submitted by the page.
RESUBMIT = """
var fields = arguments[0];
var form = document.createElement('form');
form.method = 'post'; form.action = '/bulk/confirm';
Object.keys(fields).forEach(function(name){
  var input = document.createElement('input');
  input.type = 'hidden'; input.name = name; input.value = fields[name];
  form.appendChild(input);
});
document.body.appendChild(form); form.submit();
"""


def test_filtered_list_and_a_bulk_retry_in_the_browser(
    browser: WebDriver, tmp_path: Path  # noqa: F811
) -> None:
    store = tmp_path / "store"
    fill(str(store))
    with dashboard(store, "--account", ACCOUNT_ID) as info:
        browser.get(info["url"])
        WebDriverWait(browser, WAIT).until(
            expected_conditions.presence_of_element_located((By.ID, "count-total")))
        # The failure table's count is a link to its filtered list.
        link = 'a[href="/operations?state=failed&kind=http_rejected"]'
        browser.find_element(By.CSS_SELECTOR, link).click()
        WebDriverWait(browser, WAIT).until(
            lambda driver: driver.find_element(By.ID, "matching").text == "6")
        # Narrow it with the form: code and since; the filter goes into the URL.
        browser.find_element(By.ID, "filter-code").send_keys("server_error")
        browser.find_element(By.ID, "filter-since").send_keys(CUTOFF)
        browser.find_element(By.ID, "filter-apply").click()
        WebDriverWait(browser, WAIT).until(
            lambda driver: driver.find_element(By.ID, "matching").text == "3")
        query = parse_qs(urlsplit(browser.current_url).query)
        assert query["code"] == ["server_error"] and query["since"] == [CUTOFF]
        assert query["state"] == ["failed"] and query["kind"] == ["http_rejected"]
        shown = {box.get_attribute("value") for box in
                 browser.find_elements(By.CSS_SELECTOR, 'input[name="ids"]')}
        assert shown == {"op-se-1", "op-se-2", "op-other-0"}
        # The URL alone gives the same list (a link can be shared).
        browser.get(browser.current_url)
        assert browser.find_element(By.ID, "matching").text == "3"
        _screenshot(browser, "console-list")
        # Bulk manual retry over the filter: preview, then the one confirmation.
        Select(browser.find_element(By.ID, "bulk-action")).select_by_value("retry")
        browser.find_element(By.ID, "bulk-target-filter").click()
        browser.find_element(By.ID, "bulk-budget").send_keys("4")
        browser.find_element(By.ID, "bulk-preview").click()
        WebDriverWait(browser, WAIT).until(
            expected_conditions.presence_of_element_located((By.ID, "bulk-count")))
        assert browser.find_element(By.ID, "bulk-count").text == "3"
        assert browser.find_element(By.ID, "bulk-allowed").text == "2"
        assert browser.find_element(By.ID, "bulk-refused").text == "1"
        assert "belongs to another account" in browser.page_source
        _screenshot(browser, "console-bulk")
        fields = {element.get_attribute("name"): element.get_attribute("value") for element in
                  browser.find_elements(By.CSS_SELECTOR, "#bulk-confirm-form input")}
        assert set(fields) == {"csrf", "action_id"}
        browser.find_element(By.ID, "bulk-confirm").click()
        WebDriverWait(browser, WAIT).until(
            expected_conditions.presence_of_element_located((By.ID, "result-done")))
        assert browser.find_element(By.ID, "result-done").text == "2"
        assert browser.find_element(By.ID, "result-refused").text == "1"
        # The same confirmation submitted again (a double submit) does nothing.
        browser.execute_script(RESUBMIT, fields)
        WebDriverWait(browser, WAIT).until(
            expected_conditions.presence_of_element_located((By.ID, "bulk-note")))
        assert "nothing was done again" in browser.find_element(By.ID, "bulk-note").text
        # The successors are in the list: prepared, with the chosen budget.
        browser.get(info["base"] + "/operations?state=prepared&q=op_")
        WebDriverWait(browser, WAIT).until(
            lambda driver: driver.find_element(By.ID, "matching").text == "2")
        assert browser.page_source.count("0/4") == 2
