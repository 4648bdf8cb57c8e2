"""The report of a tiny reproduction opened in headless Chromium (Debian's chromium and
chromium-driver, which .ci/run installs): no JavaScript error, every figure drawn, every claim's
links landing on an anchor, and the summary counts equal to claims.json. The test is skipped where
no ChromeDriver is installed, unless TASKGEOM_REQUIRE_BROWSER=1 (set by .ci/run), where it fails."""

from __future__ import annotations

import json
from collections import Counter

import pytest

pytestmark = pytest.mark.browser


def test_the_report_renders_in_chromium_with_every_figure_and_link(tiny_reproduction, browser, tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get((tiny_reproduction / "report.html").as_uri())
    plots = browser.execute_script("return document.querySelectorAll('div.plot').length")
    WebDriverWait(browser, 60).until(
        lambda d: d.execute_script("return document.querySelectorAll('div.plot .main-svg').length") >= plots
    )
    browser.save_screenshot(str(tmp_path / "report.png"))

    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == []
    assert plots >= 15
    drawn = browser.execute_script("""return Array.from(document.querySelectorAll('div.plot')).map(function (div) {
        var svg = div.querySelector('.main-svg'), box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
        return [div.id, box.width * box.height, div.querySelectorAll('.trace, .point, path.js-line').length]; });""")
    assert [d for d in drawn if d[1] < 10_000 or d[2] == 0] == []  # every plot has an area and something drawn in it
    images = browser.execute_script(
        "return Array.from(document.images).map(function (i) { return [i.src, i.naturalWidth]; })"
    )
    assert images and [src for src, width in images if width == 0] == []

    missing = browser.execute_script("""return Array.from(document.querySelectorAll('tr[id^="claim-"] a')).filter(function (a) {
        return !document.getElementById(a.getAttribute('href').slice(1)); }).map(function (a) { return a.getAttribute('href'); });""")
    assert missing == []
    link = browser.find_element("css selector", 'tr[id^="claim-"] a')
    target = link.get_attribute("href").split("#", 1)[1]
    link.click()
    assert browser.execute_script("return document.querySelector(':target').id") == target

    claims = json.loads((tiny_reproduction / "claims.json").read_text())
    counts = Counter(c["status"] for c in claims)
    rows = browser.execute_script("""return Array.from(document.querySelectorAll('#summary-table tr')).slice(1).map(function (tr) {
        return Array.from(tr.cells).slice(1).map(function (td) { return parseInt(td.textContent); }); });""")
    assert [sum(column) for column in zip(*rows)] == [counts["pass"], counts["fail"], counts["unstable"], counts["n/a"]]
    assert browser.find_element("id", "totals").text.startswith(
        f"{counts['pass']} pass, {counts['fail']} fail, {counts['unstable']} unstable, {counts['n/a']} n/a of {len(claims)} claims"
    )
    strips = browser.execute_script("""return Array.from(document.querySelectorAll('tr[id^="claim-"] svg.strip')).map(function (svg) {
        var box = svg.getBoundingClientRect(); return [box.width, svg.querySelectorAll('circle').length]; });""")
    measured = [c for c in claims if any(row["status"] != "n/a" and row["value"] is not None for row in c["seeds"])]
    assert len(strips) == len(measured) and all(
        width > 0 for width, _ in strips
    )  # a drawn strip of dots per measured claim
    assert sorted(dots for _, dots in strips) == sorted(
        sum(row["status"] != "n/a" and row["value"] is not None for row in c["seeds"]) for c in measured
    )
