"""Rendering a job report (`_report.html`) in headless Chromium and reading back what a person would see: each
chart's series, the health table, the runs and replicas tables. Shared by the report, Ray and object-store tests."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import chromium
from batchgen.job.report import CHARTS

# What the page shows, read from the rendered DOM: every <figure data-chart> with its drawn series and its size.
READ_PAGE = """(() => {
  const charts = {};
  for (const f of document.querySelectorAll('figure[data-chart]')) {
    const box = f.querySelector('svg').getBoundingClientRect();
    charts[f.dataset.chart] = {empty: f.dataset.empty === '1', width: box.width, height: box.height,
      series: Array.from(f.querySelectorAll('[data-series]')).map(e => e.dataset.series),
      bars: Array.from(f.querySelectorAll('rect[data-series]')).map(e => e.nextElementSibling.textContent),
      drawn: Array.from(f.querySelectorAll('path[data-series]')).filter(p => p.getTotalLength() > 0).length
        + f.querySelectorAll('circle.lone').length};  // a series of one point is a dot
  }
  const health = {};
  for (const row of document.querySelectorAll('table.health tr')) {
    const cells = Array.from(row.children).map(c => c.textContent);
    health[cells[0]] = cells.slice(1);
  }
  const tableRows = title => {
    const h = Array.from(document.querySelectorAll('h2')).find(e => e.textContent === title);
    let t = h && h.nextElementSibling;
    while (t && t.tagName !== 'TABLE') t = t.nextElementSibling;
    return t ? Array.from(t.querySelectorAll('tr')).slice(1).map(r => Array.from(r.children).map(c => c.textContent)) : [];
  };
  return {charts, health, runs: tableRows('Runs'), replicas: tableRows('Replicas'), title: document.title};
})()"""


def browser_or_fail() -> None:
    """The report tests need Debian's chromium (scripts/test.sh installs it); without it they fail, unless
    BATCHGEN_SKIP_BROWSER_TESTS=1 says this machine cannot have one."""
    if not chromium.available():
        if os.environ.get("BATCHGEN_SKIP_BROWSER_TESTS") == "1":
            pytest.skip("no chromium, and BATCHGEN_SKIP_BROWSER_TESTS=1")
        pytest.fail("chromium is not installed (apt-get install chromium; scripts/test.sh does it)")


def render_report(page: Path, screenshot: bool = False) -> tuple[dict, bytes | None]:
    """The page as Chromium shows it: asserts that it loads without a console error and draws every chart."""
    browser_or_fail()
    check = chromium.check_page(str(page), evaluate=READ_PAGE, screenshot=screenshot)
    assert check.console_errors == [], check.console_errors
    shown = check.value
    assert list(shown["charts"]) == list(CHARTS), shown["charts"].keys()
    for name, chart in shown["charts"].items():
        assert chart["width"] > 200 and chart["height"] > 50, (name, chart)
        if not chart["empty"] and name != "errors":
            assert chart["drawn"] >= 1, (name, chart)  # a line with a length, not only an empty path
    return shown, check.screenshot
