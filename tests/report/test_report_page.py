"""The HTML page of ``report merge --html`` in a real headless browser (Debian's chromium with
chromedriver, driven by selenium): it loads from disk with no network request, shows every row
with its verdict marks and heatmap colours, filters by family, stage and architecture, and a
click on a cell opens its decoded diff. Skips with the reason where the browser is absent
(``.ci/run`` installs it)."""

from __future__ import annotations

import shutil

import pytest

from dsv4_numerics.report import html as report_html
from dsv4_numerics.report.merge import merge_reports

from .test_report_merge import E, three_runs

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs chromium and chromedriver "
                                "(apt-get install -y chromium chromium-driver)")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-dev-shm-usage", "--window-size=1400,900",
              f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield d
    d.quit()


def _cells(browser):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, "#matrix td.cell")


def test_page_shows_filters_and_opens_the_decoded_diff(tmp_path, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    m = merge_reports(list(three_runs(tmp_path)))
    page = report_html.write_html(m, tmp_path / "matrix.html", "test matrix")
    text = page.read_text()
    assert "http://" not in text and "https://" not in text and "<link" not in text and " src=" not in text
    browser.get(page.resolve().as_uri())
    # nothing fetched: the page is one file
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    assert browser.find_element(By.ID, "counts").text == "2 of 2 rows shown"
    heads = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#matrix th")]
    assert heads == ["entry", "stage", "sm90", "sm100", "family", "dtypes"]
    cells = {(c.get_attribute("data-entry"), c.get_attribute("data-arch")): c for c in _cells(browser)}
    assert len(cells) == 4
    h200 = cells[(E, "sm90")]
    assert h200.get_attribute("data-verdict") == "fail" and h200.text.startswith("\u2717 \u2260")  # fail, runs disagree
    assert h200.text.endswith("0.5")  # its headroom
    def rgb(cell):  # "rgba(r, g, b, a)" -> [r, g]
        c = cell.value_of_css_property("background-color")
        return [int(x) for x in c[c.index("(") + 1:].split(",")[:2]]

    red, green = rgb(h200), rgb(cells[(E, "sm100")])  # headroom 0.5 (fail) and 5
    assert red[0] > red[1] and green[1] > green[0], (red, green)  # red-dominant vs green-dominant
    assert cells[("vllm_cuda.kv_rope_insert", "sm90")].text == "\u2205"  # unavailable
    exact = cells[("vllm_cuda.kv_rope_insert", "sm100")]  # bit-exact: infinite headroom, blue
    assert exact.text == "\u2713 inf" and exact.value_of_css_property("background-color") == "rgba(169, 200, 240, 1)"
    assert "diverges" in browser.find_element(By.ID, "matrix").text
    # the detail panel: the decoded diff of the failing case and both runs' verdicts
    assert not browser.find_element(By.ID, "detail").is_displayed()
    h200.click()
    detail = browser.find_element(By.ID, "detail")
    assert detail.is_displayed() and "runs disagree" in detail.text
    assert 'out: 3 elements outside <tol> "quoted"' in detail.find_element(By.CSS_SELECTOR, "pre.diff").text
    assert h200.get_attribute("title").startswith('c2: numeric out: 3 elements outside <tol> "quoted"')  # escaped
    assert "h200-check.json" in detail.text and "h200-pytest.json" in detail.text
    browser.find_element(By.ID, "close").click()
    # filters: architecture, family, stage
    Select(browser.find_element(By.ID, "f-arch")).select_by_value("sm100")
    heads = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#matrix th")]
    assert heads[2] == "sm100" and "sm90" not in heads and len(_cells(browser)) == 2
    Select(browser.find_element(By.ID, "f-arch")).select_by_value("")
    Select(browser.find_element(By.ID, "f-stage")).select_by_value("swa_write")
    assert browser.find_element(By.ID, "counts").text == "1 of 2 rows shown"
    assert {c.get_attribute("data-entry") for c in _cells(browser)} == {"vllm_cuda.kv_rope_insert"}
    Select(browser.find_element(By.ID, "f-stage")).select_by_value("")
    Select(browser.find_element(By.ID, "f-family")).select_by_value("CUDA")
    assert browser.find_element(By.ID, "counts").text == "2 of 2 rows shown"  # both entries are CUDA-family
    opts = [o.text for o in Select(browser.find_element(By.ID, "f-family")).options]
    assert opts == ["all", "CUDA"]
