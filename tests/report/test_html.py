"""``_report.html``: well-formed, self-contained, escaped, for every shape the report schema allows
(null latencies, no outputs, no drift, failed shards) and for huge reports."""

from __future__ import annotations

import copy
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from typing import Any

import pytest

from pipeline.core.statuses import RunStatus
from pipeline.report.html import SHARD_TABLE_CAP, render_html
from pipeline.report.schema import SCHEMA_VERSION, validate_report

SECTIONS = (
    "status",
    "totals",
    "shards",
    "throughput",
    "latency",
    "scores",
    "rejects",
    "output-changes",
    "drift",
    "environment",
)
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}
EVIL = "<script>alert(1)</script> & co"


def _shard(i: int, status: str = "scored", duration: float = 0.4, **kw: Any) -> dict[str, Any]:
    d = {
        "rel_path": f"part-{i:05d}.parquet",
        "input": f"/data/catalog/part-{i:05d}.parquet",
        "status": status,
        "output": f"/out/part-{i:05d}.parquet",
        "rejects": None,
        "rows_in": 25000,
        "rows_out": 25000,
        "rows_rejected": 0,
        "duration_s": duration,
        "rows_per_s": 25000 / duration if duration else 0.0,
        "kind": None,
        "message": None,
        "oom_splits": 0,
        "duplicate_ids": 0,
        "null_ids": 0,
        "rejects_by_reason": {},
        "started_s": 0.1 * i,
        "finished_s": 0.1 * i + duration,
    }
    d.update(kw)
    return d


def _output(mean: float) -> dict[str, Any]:
    return {
        "count": 74900,
        "mean": mean,
        "min": 0.0,
        "max": 1.0,
        "quantiles": {"p01": 0.0, "p05": 0.01, "p25": 0.2, "p50": 0.5, "p75": 0.8, "p95": 0.99,
                      "p99": 1.0},
        "sketch": [i / 100 for i in range(101)],
        "histogram": {"edges": [i / 20 for i in range(21)], "counts": [3745] * 20},
    }  # fmt: skip


def full_report() -> dict[str, Any]:
    """A ``_report.json`` of the current schema (``test_full_report_matches_the_schema``)."""
    shards = [
        _shard(0, duration=0.43),
        _shard(1, duration=0.47, rows_rejected=100, rows_out=24900,
               rejects_by_reason={"f3 is NaN": 60, "f7 is out of range": 40}),
        _shard(2, duration=2.9),  # a straggler (> 2x the median)
        _shard(
            3, "failed", 1.1, rows_in=None, rows_out=0, rows_per_s=0.0, kind="schema",
            message="missing column f3", output=None, started_s=None, finished_s=None,
        ),
    ]  # fmt: skip
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": "20261129T222511Z-0c60d1",
        "job": "score_catalog",
        "status": "succeeded_with_errors",
        "failure_reasons": [],
        "started_at": "2026-11-29T22:25:11.973494+00:00",
        "finished_at": "2026-11-29T22:25:16.513862+00:00",
        "duration_s": 4.54,
        "input": "/work/main/data/catalog",
        "output": "/tmp/out",
        "rejects": "/work/main/data/rejects/run_date=2026-11-29",
        "rows_in": 75000,
        "rows_out": 74900,
        "rows_rejected": 100,
        "rows_processed": 75000,
        "rows_per_s": 16519.8,
        "rejected_fraction": 100 / 75000,
        "accounting_ok": True,
        "shards_total": 4,
        "shards_scored": 3,
        "shards_skipped": 0,
        "shards_failed": 1,
        "shards_not_scored": 0,
        "batch_size": 4096,
        "execution": {"precision": "fp32", "compile": False, "compile_s": None, "tf32": False,
                      "overlap": True,
                      "parity": {"rows": 4096, "tolerance": 0.01, "reference": "fp32 on the CPU",
                                 "columns": {"score": {"max_abs_diff": 1e-6}}},
                      "batch_size_auto": None},
        "device": "cpu",
        "threads": {"scheduler": "local", "cores": 2, "workers": 2, "threads_per_worker": 1,
                    "torch_threads": 1},
        "model": {"uri": "data/models/catalog-mlp", "name": "catalog-mlp", "version": "1",
                  "format": "exported_program", "sha256": "c8801493d2db06b045e39b2d103d1337" * 2,
                  "width": 16, "out_width": 2},
        "settings": {"inputs": [f"f{i}" for i in range(16)],
                     "outputs": [["score", "softmax:1"], ["label", "argmax"]],
                     "id_column": "item_id", "passthrough": [], "precision": "fp32"},
        "lock_taken_over": None,
        "oom_splits": 0,
        "duplicate_ids": 0,
        "null_ids": 0,
        "error_budget": {"max_failed_shards": 1, "max_rejected_fraction": 0.01},
        "versions": {"python": "3.11.7", "torch": "2.13.0+cpu", "pyarrow": "26.0.1",
                     "dask": "2026.8.0"},
        "batch_latency_ms": {"p50": 26.66, "p95": 36.83, "p99": 53.06},
        "outputs": {"score": _output(0.506), "label": _output(0.5061)},
        "rejects_by_reason": {"f3 is NaN": 60, "f7 is out of range": 40},
        "throughput": [{"t_s": 0.0, "rows": 0}, {"t_s": 0.9, "rows": 25000},
                       {"t_s": 1.2, "rows": 50000}, {"t_s": 3.3, "rows": 75000}],
        "drift": {
            "baseline": {"run_id": "20261128T222511Z-aaaaaa", "output": "/out/prev",
                         "finished_at": "2026-11-28T22:25:16+00:00"},
            "rows": {"previous": 80000, "current": 74900, "change": 74900 / 80000 - 1},
            "columns": {"score": {"psi": 0.31, "ks": 0.12, "alert": True},
                        "label": {"psi": 0.01, "ks": 0.004, "alert": False}},
            "thresholds": {"psi": 0.2, "ks": 0.1, "rows_change": 0.5},
            "alert": True,
            "reasons": ["score: PSI 0.31 > 0.2 against run 20261128T222511Z-aaaaaa"],
        },
        "verdict": {"dataset": "0123456789abcdef", "judged_by": "20261129T222511Z-bbbbbb",
                    "judged_at": "2026-11-29T22:25:16+00:00", "reused": False, "accepted": None},
        "errors": [{"shard": "/data/catalog/part-00003.parquet", "kind": "schema",
                    "message": "missing column f3"}],
        "warnings": ["drift: score: PSI 0.31 > 0.2 against run 20261128T222511Z-aaaaaa"],
        "lossy_casts": [],
        "shards": shards,
        "removed_outputs": [{"output": "/data/scored/part-00009.parquet",
                             "reason": "its input shard no longer exists", "rejects": None}],
        "foreign_removed": [],
        "foreign_kept": [],
    }  # fmt: skip


class BalanceChecker(HTMLParser):
    """Fails on a closing tag that does not match the open one, or on unclosed elements."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.problems: list[str] = []
        self.ids: list[str] = []
        self.attrs: list[tuple[str, str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.attrs.extend((tag, k, v) for k, v in attrs)
        self.ids.extend(v for k, v in attrs if k == "id" and v)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.attrs.extend((tag, k, v) for k, v in attrs)  # <rect/> etc.: opens and closes

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.problems.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def check(page: str) -> BalanceChecker:
    """Assert the page is balanced, self-contained and its SVGs are well-formed XML."""
    p = BalanceChecker()
    p.feed(page)
    p.close()
    assert not p.problems, p.problems[:5]
    assert not p.stack, f"unclosed: {p.stack}"
    lower = page.lower()
    for bad in ("http://", "https://", "//cdn", "<script", "@import", "url(", "<link", "<iframe"):
        assert bad not in lower, bad
    for tag, key, value in p.attrs:
        if key in ("src", "href", "xlink:href", "action"):
            assert value is None or value.startswith(("#", "data:")), (tag, key, value)
        assert not key.startswith("on"), (tag, key)  # no inline event handlers either
    for svg in re.findall(r"<svg\b.*?</svg>", page, flags=re.S):
        ET.fromstring(svg)  # raises on anything not well-formed
    assert "could not be rendered" not in page
    return p


def test_full_report_has_every_section_and_is_self_contained() -> None:
    page = render_html(full_report())
    p = check(page)
    assert page.startswith("<!DOCTYPE html>")
    for sid in SECTIONS:
        assert sid in p.ids
    assert page.count("<section") == len(SECTIONS)
    assert "@media print" in page
    assert page.isascii()  # non-ASCII travels as character references
    assert page.count("<svg") == 6  # shards, throughput, latency, 2 histograms, rejects


def test_full_report_content() -> None:
    page = render_html(full_report())
    assert 'class="banner warn"' in page and "SUCCEEDED_WITH_ERRORS" in page
    assert "75,000" in page and "74,900" in page and "0.13%" in page  # totals, rejected fraction
    assert "missing column f3" in page and 'class="failed"' in page  # failed shard
    assert 'class="bar hi"' in page and 'class="slow"' in page  # the 2.9 s straggler
    assert "f3 is NaN" in page and "f7 is out of range" in page
    assert "DRIFT ALERT" in page and "ALERT</td>" in page and 'class="alert"' in page
    assert "PSI &gt; 0.2" in page and "-6.37%" in page  # thresholds and row change shown
    assert "<polyline" in page
    assert page.count("<h3>score</h3>") == 1 and page.count("<h3>label</h3>") == 1
    assert "26.66" in page and "53.06" in page
    assert "c8801493d2db06b045e39b2d103d1337" in page
    assert "&quot;max_abs_diff&quot;:1e-06" in page  # nested dict as JSON
    assert "fp32 on the CPU" in page


def test_full_report_matches_the_schema() -> None:
    validate_report(full_report())


@pytest.mark.parametrize("status, cls", [("succeeded", "ok"), ("succeeded_with_warnings", "warn"),
                                         ("succeeded_with_errors", "warn"), ("failed", "bad"),
                                         ("interrupted", "bad"), ("weird", "unknown")])  # fmt: skip
def test_status_banner_colour(status: str, cls: str) -> None:
    r = full_report()
    r["status"] = status
    assert f'class="banner {cls}"' in render_html(r)


def test_user_strings_are_escaped() -> None:
    r = full_report()
    r["job"] = EVIL
    r["shards"][0]["rel_path"] = EVIL
    r["shards"][3]["message"] = EVIL
    r["errors"][0]["message"] = EVIL
    r["warnings"].append(EVIL)
    r["rejects_by_reason"][EVIL] = 5
    r["outputs"][EVIL] = r["outputs"]["score"]
    r["drift"]["columns"][EVIL] = {"psi": 0.5, "ks": 0.5, "alert": True}
    r["execution"][EVIL] = EVIL
    r["model"]["name"] = EVIL
    page = render_html(r)
    check(page)
    assert "<script" not in page and "alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; co" in page


def failed_early_report() -> dict[str, Any]:
    """A run that failed with nothing scored: every shard unreadable, no outputs, no drift."""
    r = full_report()
    r.update(
        status=RunStatus.FAILED.value,
        failure_reasons=["4 failed shards > errors.max_failed_shards = 1"],
        rows_in=0, rows_out=0, rows_rejected=0, rows_processed=0, rows_per_s=0.0,
        rejected_fraction=0.0, shards_scored=0, shards_failed=4,
        batch_latency_ms={"p50": None, "p95": None, "p99": None},
        outputs={}, rejects_by_reason={}, throughput=[{"t_s": 0.0, "rows": 0}], drift=None,
        warnings=[],
        errors=[{"shard": f"/in/{i}", "kind": "unreadable", "message": "bad footer"}
                for i in range(4)],
    )  # fmt: skip
    r["shards"] = [
        _shard(i, "failed", 0.0, rows_in=None, rows_out=0, rows_per_s=0.0, kind="unreadable",
               message="bad footer", output=None, started_s=None, finished_s=None)
        for i in range(4)
    ]  # fmt: skip
    return r


def test_failed_report_without_scores_renders() -> None:
    r = failed_early_report()
    validate_report(r)
    page = render_html(r)
    p = check(page)
    for sid in SECTIONS:
        assert sid in p.ids
    assert 'class="banner bad"' in page and "4 failed shards" in page
    assert "No rows were rejected." in page
    assert "fewer than 2 points" in page
    assert "No batch latencies were recorded" in page
    assert "No output statistics" in page
    assert "monitoring.drift is off, or the run failed" in page


def test_every_nullable_value_null_renders() -> None:
    r = failed_early_report()
    r["execution"].update(compile_s=None, parity=None, batch_size_auto=None)
    r["threads"].update(workers=None, threads_per_worker=None, torch_threads=None)
    for s in r["shards"]:
        s.update(rejects=None, kind=None, message=None)
    r["shards"][0].update(status="skipped", rows_in=1000, rows_out=1000, kind=None)
    validate_report(r)
    page = render_html(r)
    check(page)
    assert "skipped" in page


def test_edge_values_the_schema_allows() -> None:
    r = full_report()
    r["outputs"]["score"]["histogram"] = {"edges": [0.0, 1.0], "counts": [1, 2, 3]}  # no match
    r["outputs"]["label"]["histogram"] = {"edges": [0.5, 0.5], "counts": [74900]}  # all equal
    r["outputs"]["extra"] = {"count": 0}
    r["outputs"]["empty"] = {"count": 3, "mean": None, "min": None, "max": None, "sketch": [],
                             "histogram": {"edges": [], "counts": []}}  # fmt: skip
    r["batch_latency_ms"] = {"p50": None, "p95": None, "p99": None}
    r["rejects_by_reason"] = {"zero": 0}
    r["drift"]["columns"]["gone"] = {"psi": None, "ks": None, "alert": True}
    r["drift"]["rows"]["change"] = None
    validate_report(r)
    page = render_html(r)
    check(page)
    assert "No histogram recorded for score." in page
    assert "No histogram recorded for extra." in page
    assert "No histogram recorded for empty." in page
    assert "No batch latencies were recorded" in page
    assert "No rows were rejected." in page


def test_a_malformed_section_costs_only_that_section() -> None:
    r: Any = full_report()
    r["shards"].append("not a dict")
    page = render_html(r)
    shards = page.split('id="shards"')[1].split("</section>")[0]
    assert "could not be rendered: TypeError" in shards
    assert page.count("could not be rendered") == 1
    assert "DRIFT ALERT" in page and "f3 is NaN" in page  # the other sections are all there


@pytest.mark.parametrize(
    "drift, expected",
    [
        (None, "monitoring.drift is off"),
        ({"baseline": None, "note": "first run of this job: no baseline"}, "first run of this job"),
    ],
)
def test_drift_without_baseline(drift: Any, expected: str) -> None:
    r = full_report()
    r["drift"] = drift
    page = render_html(r)
    check(page)
    assert expected in page
    assert "DRIFT ALERT" not in page


def test_drift_without_alert() -> None:
    r = full_report()
    r["drift"]["alert"] = False
    r["drift"]["reasons"] = []
    for c in r["drift"]["columns"].values():
        c["alert"] = False
    page = render_html(r)
    check(page)
    assert "No drift alert" in page and "ALERT</td>" not in page


def test_errors_are_capped_with_a_count() -> None:
    r = full_report()
    r["errors"] = [{"shard": f"s{i}", "kind": "error", "message": f"boom {i}"} for i in range(45)]
    page = render_html(r)
    assert "boom 19" in page and "boom 20" not in page
    assert "25 more errors" in page and "Errors (45)" in page


@pytest.mark.slow
def test_ten_thousand_shards_the_table_and_chart_are_capped() -> None:
    r = full_report()
    r["shards"] = [_shard(i, duration=0.2 + (i % 97) / 100) for i in range(10_000)]
    r["shards"][9_999] = _shard(9_999, "failed", 0.1, kind="error", message="late failure")
    r["throughput"] = [{"t_s": i * 0.01, "rows": i * 25000} for i in range(10_001)]
    validate_report(r)
    page = render_html(r)
    check(page)
    body = page.split('id="shards"')[1].split("</section>")[0]
    table = body.split("<tbody>")[1]
    assert table.count("<tr") == SHARD_TABLE_CAP
    assert f"Showing {SHARD_TABLE_CAP} of 10,000 shards" in body
    assert "late failure" in body  # failed shards come first, so the cap never hides them
    assert body.count("<g><title>") == 50  # the straggler chart shows the top 50
    assert len(page) < 2_000_000


def test_render_does_not_mutate_the_report() -> None:
    r = full_report()
    before = copy.deepcopy(r)
    render_html(r)
    assert r == before


def test_removed_outputs_are_listed_with_their_reason() -> None:
    page = render_html(full_report())  # type: ignore[arg-type]
    assert "Removed from the output" in page
    assert "part-00009.parquet" in page and "its input shard no longer exists" in page


def test_a_tables_section_is_on_the_page_as_its_sink_titled_it() -> None:
    r = full_report()
    r["output_format"] = {
        "format": "delta",
        "title": "Delta table",
        "summary": "s3://bucket/scored partition run_date=2026-12-01: committed version 17",
        "table": "s3://bucket/scored",
        "partition": "run_date=2026-12-01",
        "app_id": "score-catalog/nightly/run_date=2026-12-01",
        "run_version": 4,
        "version": 17,
        "committed": True,
        "files_added": 8,
        "files_removed": 8,
    }
    validate_report(r)
    page = render_html(r)  # type: ignore[arg-type]
    assert "<h3>Delta table</h3>" in page
    for text in ("s3://bucket/scored", "run_date=2026-12-01", ">17<"):
        assert text in page, text
    r["output_format"] = {"format": "parquet_folder"}
    assert "Delta table" not in render_html(r)  # type: ignore[arg-type]


# ---------------------------------------------------------------- a page that reads right


def _section(page: str, sid: str) -> str:
    return page.split(f'id="{sid}"')[1].split("</section>")[0]


def _points(page: str) -> list[tuple[float, float]]:
    (poly,) = re.findall(r'<polyline class="line" points="([^"]+)"', _section(page, "throughput"))
    return [(float(x), float(y)) for x, y in (p.split(",") for p in poly.split())]


def test_throughput_starts_at_the_first_shards_start_not_at_zero() -> None:
    r = full_report()
    # 2.5 s of start-up (planning, workers, model) before the first shard started.
    for i, s in enumerate(r["shards"][:3]):
        s["started_s"], s["finished_s"] = 2.5 + 0.2 * i, 3.0 + 0.3 * i
    r["throughput"] = [{"t_s": 0.0, "rows": 0}, {"t_s": 3.0, "rows": 25000},
                       {"t_s": 3.3, "rows": 50000}, {"t_s": 5.4, "rows": 75000}]  # fmt: skip
    validate_report(r)
    page = render_html(r)
    check(page)
    pts = _points(page)
    assert len(pts) == 4
    (x0, y0), base = pts[0], max(y for _, y in pts)
    assert y0 == base  # the line starts at 0 rows...
    # ...at 2.5 s, well right of the y axis (x = 80), where (0, 0) would have put it: the axis
    # runs from 2 to 6 s over 620 units, so 2.5 s sits at 80 + 0.5 / 4 * 620.
    assert x0 == pytest.approx(80 + 0.5 / 4 * 620, abs=0.1)
    # Ticks cover the scoring time only; start-up is said in words.
    ticks = re.findall(r'text-anchor="middle">([0-9.]+)</text>', _section(page, "throughput"))
    assert "0" not in ticks and ticks[0] == "2"
    assert "Scoring began 2.5 s after the run started" in page
    # The average counts from when scoring began, not from the run's start.
    assert f"average {75000 / (5.4 - 2.5):,.0f} rows/s since scoring began" in page


def test_throughput_without_shard_starts_keeps_the_run_start() -> None:
    r = full_report()
    for s in r["shards"]:
        s["started_s"] = s["finished_s"] = None
    pts = _points(render_html(r))
    assert pts[0][0] == pytest.approx(80.0)  # (0, 0): nothing says when scoring began
    assert "Scoring began" not in render_html(r)


def test_a_discrete_output_is_a_bar_chart_of_counts() -> None:
    r = full_report()
    label = r["outputs"]["label"]
    label.update(min=0.0, max=1.0, mean=36900 / 74900)
    label["histogram"] = {
        "edges": [i / 20 for i in range(21)],
        "counts": [38000] + [0] * 18 + [36900],
    }
    label["value_counts"] = {"values": [0, 1], "counts": [38000, 36900]}
    validate_report(r)
    page = render_html(r)
    check(page)
    scores = _section(page, "scores")
    label_part = scores.split("<h3>label</h3>")[1]
    score_part = scores.split("<h3>score</h3>")[1].split("<h3>")[0]
    # Two bars, labelled 0 and 1 with their counts; no 20 bins, no ticks at 0.2 ... 0.8.
    assert label_part.count('<rect class="bar"') == 2
    assert ">38,000</text>" in label_part and ">36,900</text>" in label_part
    assert '<text x="235.0" y="248" text-anchor="middle">0</text>' in label_part
    assert '<text x="545.0" y="248" text-anchor="middle">1</text>' in label_part
    for tick in ("0.2", "0.4", "0.6", "0.8"):
        assert f">{tick}</text>" not in label_part
    assert "Rows per value of label (2 distinct: 0, 1)" in label_part
    # A continuous column keeps its 20-bin histogram.
    assert score_part.count('<rect class="bar"') == 20


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1.898e-13, "<0.000001"),
        (-3e-9, ">-0.000001"),
        (0.0, "0"),
        (1.0, "1"),
        (74900, "74,900"),
        (0.96734, "0.9673"),
        (0.5, "0.5"),
        (0.0123456, "0.01235"),
        (0.000123456, "0.000123"),
        (12.3456, "12.35"),
        (-0.25, "-0.25"),
        (123456.7, "123,457"),
        (1e300, f"{1e300:,.0f}"),
        (None, "-"),
    ],
)
def test_numbers_are_plain_decimals(value: float | None, text: str) -> None:
    from pipeline.report.charts import sig as _g

    assert _g(value) == text


def test_quantiles_in_the_page_have_no_exponent() -> None:
    r = full_report()
    q = r["outputs"]["score"]["quantiles"]
    q.update(p01=1.898e-13, p05=2.5e-7, p25=0.0123456)
    page = render_html(r)
    check(page)
    scores = _section(page, "scores")
    assert not re.search(r"\d[eE][-+]?\d", scores), re.findall(r"[\d.]+[eE][-+]?\d+", scores)
    assert '<td class="n">&lt;0.000001</td>' in scores  # p01 and p05: too small to show
    assert '<td class="n">0.01235</td>' in scores


def test_numbers_never_wrap_inside_a_cell() -> None:
    page = render_html(full_report())
    css = page.split("<style>")[1].split("</style>")[0]
    assert "td.n,td.num{white-space:nowrap}" in css  # numbers stay on one line...
    assert "td.n,td.num{overflow-wrap:normal}" in css  # ...while long paths still break
    assert ".kv td{overflow-wrap:anywhere}" in css
    assert "font-variant-numeric:tabular-nums" in css
    totals = _section(page, "totals")
    assert '<td class="num">75,000</td>' in totals and '<td class="num">4.5 s</td>' in totals
    assert "<td>cpu</td>" in totals  # text keeps the default
    # Every table sits in a box that scrolls sideways on a narrow screen instead of wrapping.
    assert page.count("<table") == page.count('<div class="tw"><table')
