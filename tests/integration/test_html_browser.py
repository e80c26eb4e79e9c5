"""``_report.html`` rendered by a real headless Chromium (through Playwright), as a person sees it.

The HTML tests in tests/report/test_html.py check the markup; these check the layout a browser
makes of it, on a laptop-wide and on a phone-wide window: numbers on one line in every table
cell, no page wider than the window, a discrete output as labelled bars, and the throughput
time axis starting where the first shard started, not at the run's start.

The browser is the one the machine has: Debian's ``chromium-headless-shell`` or ``chromium``
(``apt-get install chromium-headless-shell``), a Chromium Playwright downloaded itself, or the
binary named by ``TEST_CHROMIUM``. Only when none of them exists is the module
skipped: Playwright cannot download a browser here (no network beyond package registries).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.report.html import render_html
from tests.integration.helpers import cli, control_of, job_args, report
from tests.report.test_html import full_report

pytestmark = pytest.mark.integration

BINARIES = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
WINDOWS = {"laptop": (1280, 900), "phone": (390, 844)}

# One script, run in the page: the layout facts the assertions need, as plain data.
MEASURE = """() => {
  const lines = el => {
    const r = document.createRange(); r.selectNodeContents(el);
    return new Set([...r.getClientRects()].filter(x => x.width > 0).map(x => Math.round(x.top)))
      .size;
  };
  const wrapped = [...document.querySelectorAll('td.n, td.num')]
    .filter(td => lines(td) > 1).map(td => td.textContent);
  const figs = [...document.querySelectorAll('#scores h3')].map(h => {
    let el = h.nextElementSibling;
    while (el && el.tagName !== 'FIGURE') el = el.nextElementSibling;
    const bars = el ? [...el.querySelectorAll('rect.bar')] : [];
    return {column: h.textContent, bars: bars.length,
            tall: bars.filter(b => b.getBoundingClientRect().height > 5).length};
  });
  const tp = document.querySelector('#throughput svg');
  const line = tp && tp.querySelector('polyline.line');
  const yaxis = tp && [...tp.querySelectorAll('line.axis')].find(l => l.x1.baseVal.value ===
    l.x2.baseVal.value);
  return {
    wrapped, figs,
    pageWidth: document.documentElement.scrollWidth, window: window.innerWidth,
    lineLeft: line ? line.getBoundingClientRect().left : null,
    lineWidth: line ? line.getBoundingClientRect().width : null,
    axisLeft: yaxis ? yaxis.getBoundingClientRect().left : null,
    xTicks: tp ? [...tp.querySelectorAll('text[y="248"]')].map(t => t.textContent) : [],
  };
}"""


def _browser_binary() -> str | None:
    named = os.environ.get("TEST_CHROMIUM")
    if named:
        return named
    for name in BINARIES:
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright  # a dev dependency: its absence is an error

    binary = _browser_binary()
    with sync_playwright() as p:
        if binary is None and not Path(p.chromium.executable_path).exists():
            pytest.skip(
                "no Chromium on this machine (apt-get install chromium-headless-shell); "
                "Playwright cannot download one here"
            )
        b = p.chromium.launch(executable_path=binary) if binary else p.chromium.launch()
        try:
            yield b
        finally:
            b.close()


def _render(browser: Any, page_file: Path, window: str, shot: Path) -> dict[str, Any]:
    width, height = WINDOWS[window]
    page = browser.new_page(viewport={"width": width, "height": height})
    try:
        page.goto(page_file.as_uri())
        facts: dict[str, Any] = page.evaluate(MEASURE)
        page.screenshot(path=str(shot), full_page=True)
    finally:
        page.close()
    assert shot.stat().st_size > 10_000  # a page was drawn, not a blank
    return facts


def _check_layout(facts: dict[str, Any]) -> None:
    assert facts["wrapped"] == [], "numbers broken over two lines"
    assert facts["pageWidth"] <= facts["window"], "the page is wider than the window"
    assert facts["lineLeft"] is not None and facts["axisLeft"] is not None
    # The throughput line is drawn, inside its axes.
    assert facts["lineWidth"] > 50 and facts["lineLeft"] >= facts["axisLeft"] - 1


@pytest.mark.parametrize("window", sorted(WINDOWS))
def test_a_synthetic_report_lays_out(browser: Any, tmp_path: Path, window: str) -> None:
    r: Any = full_report()
    for i, s in enumerate(r["shards"][:3]):
        s["started_s"], s["finished_s"] = 1.5 + 0.2 * i, 2.0 + 0.4 * i
    r["throughput"] = [{"t_s": 0.0, "rows": 0}, {"t_s": 2.0, "rows": 25000},
                       {"t_s": 2.4, "rows": 50000}, {"t_s": 2.8, "rows": 75000}]  # fmt: skip
    r["outputs"]["label"]["value_counts"] = {"values": [0, 1], "counts": [38000, 36900]}
    r["outputs"]["score"]["quantiles"].update(p01=1.898e-13, p05=123456.789, p25=0.0123456)
    page_file = tmp_path / "_report.html"
    page_file.write_text(render_html(r), encoding="ascii")
    facts = _render(browser, page_file, window, tmp_path / f"{window}.png")
    _check_layout(facts)
    figs = {f["column"]: f for f in facts["figs"]}
    assert figs["label"]["bars"] == figs["label"]["tall"] == 2  # two visible bars: 0 and 1
    assert figs["score"]["bars"] == 20  # a continuous column keeps its histogram
    # The time axis covers the scoring (from 1.5 s), not the start-up before it.
    assert facts["xTicks"][0] == "1.5" and "0" not in facts["xTicks"]


def test_a_real_runs_report_lays_out(
    browser: Any, catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    r = cli("run", *job_args(catalog, out, bundle_dir), "--scheduler", "sync")
    assert r.returncode == 0, r.stderr
    distinct = len(report(out)["outputs"]["label"]["value_counts"]["values"])
    page = control_of(out) / "_report.html"
    for window in sorted(WINDOWS):
        facts = _render(browser, page, window, tmp_path / f"{window}.png")
        _check_layout(facts)
        label = next(f for f in facts["figs"] if f["column"] == "label")
        assert label["bars"] == distinct  # the argmax label: one bar per class it took
