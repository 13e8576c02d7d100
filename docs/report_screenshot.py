"""Make the README's screenshot of the matrix page from real reports.

    python docs/report_screenshot.py OUT.png REPORT... [--open ENTRY@ARCH] [--stage STAGE]

Merges the reports (``dsv4-numerics report merge``), writes the page to a temporary folder, loads it in
headless chromium (selenium + /usr/bin/chromedriver, as tests/report/test_report_page.py does),
optionally filters to a stage, clicks one cell (the first failing one by default) so its
decoded diff shows, and saves the PNG.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("out")
    p.add_argument("reports", nargs="+")
    p.add_argument("--open", default=None, metavar="ENTRY@ARCH", help="the cell to open (default: the first failing)")
    p.add_argument("--stage", default=None, help="show only this stage")
    p.add_argument("--size", default="1500,1000")
    a = p.parse_args(argv)

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from dsv4_numerics.report import html as report_html
    from dsv4_numerics.report.merge import merge_reports

    out = Path(a.out)
    profile = tempfile.mkdtemp(prefix="chromium-profile-")  # the page is written there too
    page = report_html.write_html(merge_reports(a.reports), Path(profile) / "matrix.html")
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--window-size={a.size}", f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    d = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        d.get(page.resolve().as_uri())
        if a.stage:
            Select(d.find_element(By.ID, "f-stage")).select_by_value(a.stage)
        cells = d.find_elements(By.CSS_SELECTOR, "#matrix td.cell")
        if a.open:
            entry, arch = a.open.rsplit("@", 1)
            pick = [c for c in cells if c.get_attribute("data-entry") == entry and c.get_attribute("data-arch") == arch]
        else:
            pick = [c for c in cells if c.get_attribute("data-verdict") in ("fail", "error")]
        if pick:
            pick[0].click()
        d.execute_script("window.scrollTo(0, 0)")
        d.save_screenshot(str(out))
    finally:
        d.quit()
        shutil.rmtree(profile, ignore_errors=True)
    print(f"{out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
