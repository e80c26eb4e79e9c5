"""``_report.html``: a self-contained page for the people who open a nightly run the morning after.

:func:`render_html` turns the ``_report.json`` dict into one HTML page with inline CSS and
hand-built inline SVG charts: no scripts, no fonts, no network references, so it opens from a
bucket, a mail attachment or a printout.

The page is drawn from the report of the run that has just finished, so it reads the keys that
:class:`pipeline.report.schema.ReportData` (and the committed JSON Schema) say every report has,
without re-checking them. Values the schema allows to be null (a shard's unknown ``rows_in``,
latencies when nothing was scored, ``drift`` when it was not compared) render as "-" or a
sentence. A section that still cannot be drawn says so instead of costing the whole page: the
JSON is the record, the page only a view of it.
"""

from __future__ import annotations

import html
import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from pipeline.core.statuses import RunStatus, ShardStatus
from pipeline.report.schema import (
    DriftComparison,
    DriftNote,
    ErrorEntry,
    OutputStats,
    ReportData,
    ShardEntry,
    ValueCounts,
)

SHARD_TABLE_CAP = 500
SHARD_CHART_TOP = 50
ERRORS_SHOWN = 20
SLOW_FACTOR = 2.0
_W = 720  # SVG user-space width; CSS scales it to the page
_STATUS_CLASS: dict[str, str] = {
    RunStatus.SUCCEEDED: "ok",
    RunStatus.SUCCEEDED_WITH_ERRORS: "warn",
    RunStatus.SUCCEEDED_WITH_WARNINGS: "warn",
    RunStatus.FAILED: "bad",
    RunStatus.INTERRUPTED: "bad",  # no _SUCCESS: the output is incomplete until a rerun
}
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1a1a1a;
background:#fff;margin:0}
main{max-width:1100px;margin:0 auto;padding:16px 24px}
h1{font-size:22px;margin:8px 0}h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px}
h3{font-size:15px;margin:14px 0 6px}
table{border-collapse:collapse;margin:6px 0 12px;font-variant-numeric:tabular-nums}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}thead{display:table-header-group}
td.n{text-align:right}td.n,td.num{white-space:nowrap}
.kv th{width:14em}td{overflow-wrap:break-word}.kv td{overflow-wrap:anywhere}
td.n,td.num{overflow-wrap:normal}
.tw{overflow-x:auto;max-width:100%}p,li,h1,h2,h3,figcaption{overflow-wrap:break-word}
.banner{padding:10px 14px;border-radius:6px;border:2px solid;font-weight:600;font-size:16px}
.ok{background:#e6f4ea;border-color:#1e7e34;color:#14532d}
.warn{background:#fff4d6;border-color:#b7791f;color:#6b4403}
.bad{background:#fde8e8;border-color:#c53030;color:#7f1d1d}
.unknown{background:#eee;border-color:#777}
tr.alert td,tr.failed td{background:#fde8e8}tr.slow td{background:#fff4d6}
.note{color:#555;font-style:italic}
figure{margin:8px 0 14px;break-inside:avoid;page-break-inside:avoid;overflow-x:auto}
svg{width:100%;height:auto;max-width:900px;min-width:520px}svg text{font:11px sans-serif;fill:#222}
.bar{fill:#4a78b5}.bar.hi{fill:#d97706}.line{fill:none;stroke:#2f6db5;stroke-width:2}
.axis{stroke:#555}.grid{stroke:#e3e3e3}
@media print{body{font-size:11px;background:#fff!important;color:#000}main{max-width:none;
padding:0}.banner{background:#fff!important;color:#000}th{background:#fff}
tr.alert td,tr.failed td,tr.slow td{background:#fff;font-weight:600}
section{break-inside:auto}h2{break-after:avoid}svg{max-width:100%;min-width:0}.tw,figure{overflow:visible}}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: float | None) -> float | None:
    """The value as a float, None for null (and for NaN, which the schema refuses anyway)."""
    if value is None:
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def _fmt(value: float | None, digits: int = 0, suffix: str = "") -> str:
    f = _num(value)
    if f is None:
        return "-"
    if digits == 0 and isinstance(value, int):
        return f"{value:,}{suffix}"
    return f"{f:,.{digits}f}{suffix}"


#: Decimal places at most: a score of 1.898e-13 reads "<0.000001", never in exponent notation.
MAX_DECIMALS = 6


def _g(value: float | None) -> str:
    """A number as plain decimals, for quantiles, statistics and axis ticks.

    Whole numbers with thousands separators (``74,900``); from 1,000 up, rounded to a whole
    number; below, 4 significant digits with trailing zeros dropped (``0.9673``, ``12.35``,
    ``0.5``) but never more than :data:`MAX_DECIMALS` places, so a value too small to show is
    ``<0.000001`` (or ``>-0.000001``) rather than ``1.898e-13``.
    """
    f = _num(value)
    if f is None:
        return "-"
    if f == int(f) and abs(f) < 1e15:
        return f"{int(f):,}"
    if abs(f) >= 1000:
        return f"{f:,.0f}"
    places = min(MAX_DECIMALS, 3 - math.floor(math.log10(abs(f))))
    text = f"{f:.{places}f}".rstrip("0").rstrip(".")
    if text in ("0", "-0"):
        tiny = f"0.{'0' * (MAX_DECIMALS - 1)}1"
        return f"<{tiny}" if f > 0 else f">-{tiny}"
    return text


def _pct(value: float | None, signed: bool = False) -> str:
    f = _num(value)
    return "-" if f is None else f"{f * 100:{'+' if signed else ''}.2f}%"


def _plain(value: Any) -> str:
    """Any JSON value as text: "-" for None, compact JSON for lists and dicts."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, separators=(",", ":"), default=str, sort_keys=True)
    if isinstance(value, (int, float)):
        return _g(value)
    return str(value)


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], row_classes: Sequence[str] = ()
) -> str:
    """A table; cells are escaped, numeric-looking cells right-aligned."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{_e(row_classes[i])}"' if i < len(row_classes) and row_classes[i] else ""
        cells = "".join(
            f'<td class="n">{_e(c)}</td>' if _looks_numeric(c) else f"<td>{_e(c)}</td>" for c in row
        )
        body.append(f"<tr{cls}>{cells}</tr>")
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    return f'<div class="tw">{table}</div>'


def _looks_numeric(cell: Any) -> bool:
    s = str(cell).replace(",", "").replace("%", "").replace(" s", "").replace(" ms", "")
    s = s.lstrip("<>").lstrip("+-")
    return s.replace(".", "", 1).isdigit()


def _kv(pairs: Sequence[tuple[str, Any]]) -> str:
    """A two-column table of names and values; a numeric value never wraps (class ``num``)."""
    rows = []
    for k, v in pairs:
        text = _plain(v)
        cls = ' class="num"' if _looks_numeric(text) else ""
        rows.append(f"<tr><th>{_e(k)}</th><td{cls}>{_e(text)}</td></tr>")
    return f'<div class="tw"><table class="kv"><tbody>{"".join(rows)}</tbody></table></div>'


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi]."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    return [start + i * step for i in range(math.ceil((hi - start) / step - 1e-9) + 1)]


def _svg(height: float, label: str, body: str) -> str:
    return (
        f'<svg viewBox="0 0 {_W} {height:.0f}" role="img" '
        f'aria-label="{_e(label)}"><title>{_e(label)}</title>{body}</svg>'
    )


def bar_chart(items: Sequence[tuple[str, float, bool]], title: str, unit: str = "") -> str:
    """Horizontal bars ``(label, value, highlighted)``; values printed at the bar ends."""
    if not items:
        return ""
    left, right, row_h, top = 230, 90, 18, 8
    vmax = max(v for _, v, _ in items) or 1.0
    ticks = _ticks(0.0, vmax)
    scale = (_W - left - right) / ticks[-1]
    axis_y = top + len(items) * row_h + 4
    parts = []
    for t in ticks:
        x = left + t * scale
        parts.append(
            f'<line class="grid" x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{axis_y}"/>'
            f'<text x="{x:.1f}" y="{axis_y + 14}" text-anchor="middle">{_e(_g(t))}</text>'
        )
    for i, (label, value, hi) in enumerate(items):
        y = top + i * row_h
        shown = label if len(label) <= 34 else "…" + label[-33:]
        val = f"{_g(value)}{unit}"
        parts.append(
            f"<g><title>{_e(label)}: {_e(val)}{' (slow)' if hi else ''}</title>"
            f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">{_e(shown)}</text>'
            f'<rect class="bar{" hi" if hi else ""}" x="{left}" y="{y + 3}" '
            f'width="{max(value * scale, 1):.1f}" height="{row_h - 5}"/>'
            f'<text x="{left + value * scale + 4:.1f}" y="{y + 13}">{_e(val)}'
            f"{' ▲' if hi else ''}</text></g>"
        )
    parts.append(f'<line class="axis" x1="{left}" y1="{axis_y}" x2="{_W - right}" y2="{axis_y}"/>')
    parts.append(
        f'<text x="{(left + _W - right) / 2}" y="{axis_y + 30}" text-anchor="middle">'
        f"{_e(title)}</text>"
    )
    return _svg(axis_y + 38, title, "".join(parts))


#: Draws a chart's data given its x and y scales (data value -> SVG coordinate).
_Body = Callable[[Callable[[float], float], Callable[[float], float]], str]


def _plot(
    xs: Sequence[float], ys: Sequence[float], xlabel: str, ylabel: str, title: str, body: _Body
) -> str:
    """Axes with ticks for x in [min(xs), max(xs)] and y in [0, max(ys)]; ``body`` draws data."""
    left, right, top, bottom, h = 80, 20, 12, 48, 280
    xt, yt = _ticks(min(xs), max(xs)), _ticks(0.0, max(max(ys), 0.0) or 1.0)
    x0, x1, y1 = xt[0], xt[-1], yt[-1]

    def px(x: float) -> float:
        return left + (x - x0) / ((x1 - x0) or 1.0) * (_W - left - right)

    def py(y: float) -> float:
        return top + (1 - y / (y1 or 1.0)) * (h - top - bottom)

    parts = []
    for t in yt:
        parts.append(
            f'<line class="grid" x1="{left}" y1="{py(t):.1f}" x2="{_W - right}" y2="{py(t):.1f}"/>'
            f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{_e(_g(t))}</text>'
        )
    for t in xt:
        parts.append(
            f'<text x="{px(t):.1f}" y="{h - bottom + 16}" text-anchor="middle">{_e(_g(t))}</text>'
        )
    parts.append(body(px, py))
    base = h - bottom
    parts.append(
        f'<line class="axis" x1="{left}" y1="{base}" x2="{_W - right}" y2="{base}"/>'
        f'<line class="axis" x1="{left}" y1="{top}" x2="{left}" y2="{base}"/>'
        f'<text x="{(left + _W - right) / 2}" y="{h - 10}" text-anchor="middle">{_e(xlabel)}</text>'
        f'<text transform="translate(14 {(top + base) / 2}) rotate(-90)" text-anchor="middle">'
        f"{_e(ylabel)}</text>"
    )
    return _svg(h, title, "".join(parts))


def line_chart(points: Sequence[tuple[float, float]], xlabel: str, ylabel: str, title: str) -> str:
    pts = sorted(points)
    if len(pts) > 2000:  # keep the page small; the shape survives a stride
        stride = math.ceil(len(pts) / 2000)
        pts = pts[::stride] + ([pts[-1]] if (len(pts) - 1) % stride else [])

    def body(px: Callable[[float], float], py: Callable[[float], float]) -> str:
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        return f'<polyline class="line" points="{coords}"/>'

    return _plot([p[0] for p in pts], [p[1] for p in pts], xlabel, ylabel, title, body)


def histogram(edges: Sequence[float], counts: Sequence[float], xlabel: str, title: str) -> str:
    def body(px: Callable[[float], float], py: Callable[[float], float]) -> str:
        out = []
        for i, c in enumerate(counts):
            a, b = edges[i], edges[i + 1]
            x, w = px(a), max(px(b) - px(a) - 0.5, 0.5)
            if b == a:  # all values equal: one degenerate bin, drawn as a narrow bar
                x, w = px(a) - 4, 8.0
            out.append(
                f"<g><title>[{_e(_g(a))}, {_e(_g(b))}): {_e(_g(c))} rows</title>"
                f'<rect class="bar" x="{x:.1f}" y="{py(c):.1f}" width="{w:.1f}" '
                f'height="{py(0) - py(c):.1f}"/></g>'
            )
        return "".join(out)

    return _plot(list(edges), list(counts), xlabel, "rows", title, body)


def count_chart(values: Sequence[float], counts: Sequence[float], xlabel: str, title: str) -> str:
    """Vertical bars, one per value of a discrete column (argmax labels, 0/1 outputs).

    Each bar stands over its value's label with its row count on top: a 0/1 column shows two
    bars labelled 0 and 1, not 20 histogram bins with ticks at 0.2 to 0.8.
    """
    left, right, top, bottom, h = 80, 20, 20, 48, 280
    base = h - bottom
    yt = _ticks(0.0, max(max(counts, default=0.0), 0.0) or 1.0)

    def py(y: float) -> float:
        return top + (1 - y / (yt[-1] or 1.0)) * (base - top)

    slot = (_W - left - right) / max(len(values), 1)
    width = min(slot * 0.7, 80.0)
    parts = [
        f'<line class="grid" x1="{left}" y1="{py(t):.1f}" x2="{_W - right}" y2="{py(t):.1f}"/>'
        f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{_e(_g(t))}</text>'
        for t in yt
    ]
    for i, (v, c) in enumerate(zip(values, counts, strict=True)):
        mid = left + (i + 0.5) * slot
        label, n = _g(v), _g(c)
        parts.append(
            f"<g><title>{_e(xlabel)} = {_e(label)}: {_e(n)} rows</title>"
            f'<rect class="bar" x="{mid - width / 2:.1f}" y="{py(c):.1f}" width="{width:.1f}" '
            f'height="{base - py(c):.1f}"/>'
            f'<text x="{mid:.1f}" y="{py(c) - 4:.1f}" text-anchor="middle">{_e(n)}</text>'
            f'<text x="{mid:.1f}" y="{base + 16}" text-anchor="middle">{_e(label)}</text></g>'
        )
    parts.append(
        f'<line class="axis" x1="{left}" y1="{base}" x2="{_W - right}" y2="{base}"/>'
        f'<line class="axis" x1="{left}" y1="{top}" x2="{left}" y2="{base}"/>'
        f'<text x="{(left + _W - right) / 2}" y="{h - 10}" text-anchor="middle">{_e(xlabel)}</text>'
        f'<text transform="translate(14 {(top + base) / 2}) rotate(-90)" text-anchor="middle">'
        "rows</text>"
    )
    return _svg(h, title, "".join(parts))


def _figure(svg: str, caption: str) -> str:
    return f"<figure>{svg}<figcaption class='note'>{_e(caption)}</figcaption></figure>"


def _ul(items: Sequence[str]) -> str:
    return "<ul>" + "".join(f"<li>{_e(x)}</li>" for x in items) + "</ul>"


def _p(text: str, cls: str = "note") -> str:
    return f'<p class="{cls}">{_e(text)}</p>'


# ---------------------------------------------------------------- sections


def _status(r: ReportData) -> str:
    status = str(r["status"])
    cls = _STATUS_CLASS.get(status, "unknown")
    out = [
        f'<div class="banner {cls}">{_e(status.upper())} — run {_e(r["run_id"])}, '
        f"job {_e(r['job'])}</div>",
        _kv([("started", r["started_at"]), ("finished", r["finished_at"])]),
    ]
    if r["failure_reasons"]:
        out.append("<h3>Failure reasons</h3>" + _ul(r["failure_reasons"]))
    if r["warnings"]:
        out.append("<h3>Warnings</h3>" + _ul(r["warnings"]))
    errors: list[ErrorEntry] = r["errors"]
    if errors:
        rows = [[e["kind"], e["shard"], e["message"]] for e in errors[:ERRORS_SHOWN]]
        out.append(
            f"<h3>Errors ({len(errors):,})</h3>" + _table(("kind", "shard", "message"), rows)
        )
        if len(errors) > ERRORS_SHOWN:
            out.append(_p(f"… and {len(errors) - ERRORS_SHOWN:,} more errors in _report.json."))
    return "".join(out)


def _totals(r: ReportData) -> str:
    return _kv(
        [
            ("rows in", _fmt(r["rows_in"])),
            ("rows scored", _fmt(r["rows_out"])),
            ("rows rejected", _fmt(r["rows_rejected"])),
            ("rejected fraction", _pct(r["rejected_fraction"])),
            ("shards total", _fmt(r["shards_total"])),
            ("shards scored", _fmt(r["shards_scored"])),
            ("shards skipped (already done)", _fmt(r["shards_skipped"])),
            ("shards failed", _fmt(r["shards_failed"])),
            ("duration", _fmt(r["duration_s"], 1, " s")),
            ("rows/s", _fmt(r["rows_per_s"])),
            ("batch size", _fmt(r["batch_size"])),
            ("device", r["device"]),
        ]
    )


def _shard_row(s: ShardEntry, slow: set[str]) -> tuple[list[str], str]:
    failed = s["status"] == ShardStatus.FAILED
    row = [s["rel_path"], str(s["status"])]
    row += [_fmt(s["rows_in"]), _fmt(s["rows_out"]), _fmt(s["rows_rejected"])]
    row += [_fmt(s["started_s"], 1, " s"), _fmt(s["duration_s"], 2, " s")]
    row.append(_fmt(s["rows_per_s"]) if s["status"] == ShardStatus.SCORED else "-")
    row.append(" ".join(_plain(x) for x in (s["kind"], s["message"])) if failed else "")
    return row, "failed" if failed else "slow" if s["rel_path"] in slow else ""


def _shards(r: ReportData) -> str:
    shards = r["shards"]
    if not shards:
        return _p("No per-shard results in this report.")
    # Skipped shards (done by an earlier attempt) took no time in this run.
    timed = [(s["rel_path"], s["duration_s"]) for s in shards if s["status"] != ShardStatus.SKIPPED]
    median = statistics.median(d for _, d in timed) if timed else None
    slow = {p for p, d in timed if median and d > SLOW_FACTOR * median}
    out = []
    if timed:
        top = sorted(timed, key=lambda t: -t[1])[:SHARD_CHART_TOP]
        title = f"Slowest {len(top)} of {len(shards):,} shards by duration (s)"
        cap = f"Median shard duration {_g(median)} s; {len(slow):,} shards took more than "
        cap += f"{SLOW_FACTOR:g}x the median (marked ▲ and highlighted)."
        out.append(_figure(bar_chart([(p, d, p in slow) for p, d in top], title, " s"), cap))
    order = sorted(range(len(shards)), key=lambda i: (shards[i]["status"] != ShardStatus.FAILED, i))
    rows, classes = [], []
    for i in order[:SHARD_TABLE_CAP]:
        row, cls = _shard_row(shards[i], slow)
        rows.append(row)
        classes.append(cls)
    head = ("shard", "status", "rows in", "scored", "rejected", "started (+s)", "duration")
    out.append(_table((*head, "rows/s", "message"), rows, classes))
    if len(shards) > SHARD_TABLE_CAP:
        note = f"Showing {SHARD_TABLE_CAP:,} of {len(shards):,} shards (failed shards first); "
        out.append(_p(note + "the full list is in _report.json."))
    return "".join(out)


def _first_start(r: ReportData) -> float | None:
    """Seconds from the run's start to the first shard's start: when scoring began.

    None when no shard says (nothing ran); a malformed shard entry is the shards section's
    problem, so it is passed over here rather than costing this chart too.
    """
    starts = [_num(s.get("started_s")) for s in r["shards"] if isinstance(s, Mapping)]
    known = [t for t in starts if t is not None]
    return min(known) if known else None


def _throughput(r: ReportData) -> str:
    pts = sorted((float(p["t_s"]), float(p["rows"])) for p in r["throughput"])
    start = _first_start(r)
    if start is not None and len(pts) > 1:
        # The report's first point is (0, 0), the run's start. Planning, starting the cluster and
        # loading the model come before any shard starts: a line from (0, 0) would draw that
        # start-up as slow scoring. The line starts where the first shard started instead.
        pts = [(start, 0.0)] + [p for p in pts if p[0] >= start and p[1] > 0]
    if len(pts) < 2:
        return _p("Not enough throughput samples to draw a chart (fewer than 2 points).")
    (t0, n0), (t1, n1) = pts[0], pts[-1]
    rate = (n1 - n0) / (t1 - t0) if t1 > t0 else None
    chart = line_chart(pts, "seconds since the run started", "rows scored (cumulative)",
                       "Rows over time")  # fmt: skip
    cap = ""
    if start is not None:
        cap = f"Scoring began {_fmt(start, 1)} s after the run started (planning, starting "
        cap += "workers, loading the model); the line starts there. "
    cap += f"{len(pts):,} samples; {_g(n1)} rows scored by {_fmt(t1, 1)} s; average "
    cap += f"{_fmt(rate)} rows/s since scoring began. A flat stretch means nothing finished then."
    return _figure(chart, cap)


def _latency(r: ReportData) -> str:
    lat = r["batch_latency_ms"]
    values = (("p50", lat["p50"]), ("p95", lat["p95"]), ("p99", lat["p99"]))
    out = _table(["percentile", "batch latency (ms)"], [[k, _fmt(v, 2)] for k, v in values])
    items = [(k, v, False) for k, v in values if v is not None]
    if items:
        out += _figure(bar_chart(items, "batch latency (ms)", " ms"), "Per-batch model latency.")
    else:
        out += _p("No batch latencies were recorded (no batches were scored).")
    return out


_QUANTILE_KEYS = ("p01", "p05", "p25", "p50", "p75", "p95", "p99")


def _score_column(col: str, o: OutputStats) -> str:
    # Only ``count`` is always there: a column with no rows (or no sample) has no statistics.
    q = cast("Mapping[str, float]", o.get("quantiles") or {})
    stats = [_fmt(o["count"]), _g(o.get("mean")), _g(o.get("min")), _g(o.get("max"))]
    head = ["count", "mean", "min", "max", *_QUANTILE_KEYS]
    out = [f"<h3>{_e(col)}</h3>", _table(head, [stats + [_g(q.get(k)) for k in _QUANTILE_KEYS]])]
    discrete: ValueCounts | None = o.get("value_counts")
    if discrete and discrete["values"] and len(discrete["values"]) == len(discrete["counts"]):
        values, counts_ = list(discrete["values"]), list(discrete["counts"])
        shown = ", ".join(_g(v) for v in values)
        cap = (
            f"Rows per value of {col} ({len(values)} distinct: {shown}), from the report's sample."
        )
        out.append(_figure(count_chart(values, counts_, col, f"Rows per value of {col}"), cap))
        return "".join(out)
    h = o.get("histogram")
    edges, counts = (list(h["edges"]), list(h["counts"])) if h else ([], [])
    if counts and len(edges) == len(counts) + 1:
        cap = f"Histogram of {col}: {len(counts)} bins from {_g(edges[0])} to {_g(edges[-1])}."
        out.append(_figure(histogram(edges, counts, col, f"Distribution of {col}"), cap))
    else:
        out.append(_p(f"No histogram recorded for {col}."))
    return "".join(out)


def _scores(r: ReportData) -> str:
    if not r["outputs"]:
        return _p("No output statistics in this report (no rows were scored by this run).")
    return "".join(_score_column(col, o) for col, o in r["outputs"].items())


def _rejects(r: ReportData) -> str:
    by = {k: n for k, n in r["rejects_by_reason"].items() if n}
    if not by:
        return _p("No rows were rejected.", "")
    items = sorted(by.items(), key=lambda kv: -kv[1])
    total = sum(by.values())
    out = _figure(
        bar_chart([(k, v, False) for k, v in items], "rejected rows"), "Rejected rows by reason."
    )
    rows = [[k, _g(v), _pct(v / total)] for k, v in items]
    return out + _table(["reason", "rows", "share"], rows)


def _drift_columns(d: DriftComparison) -> str:
    table_rows, classes = [], []
    for col, c in d["columns"].items():
        table_rows.append([col, _g(c["psi"]), _g(c["ks"]), "ALERT" if c["alert"] else "ok"])
        classes.append("alert" if c["alert"] else "")
    return "<h3>Per column</h3>" + _table(["column", "PSI", "KS", "alert"], table_rows, classes)


def _verdict_lines(r: ReportData) -> list[tuple[str, Any]]:
    """Whose verdict on the dataset this is, and who accepted its alert."""
    v = r.get("verdict")
    if not v:
        return []
    lines: list[tuple[str, Any]] = [("dataset", v["dataset"])]
    if v["reused"]:
        lines.append(
            ("verdict", f"kept from run {v['judged_by']} ({v['judged_at']}): the data is unchanged")
        )
    acc = v.get("accepted")
    if acc:
        lines.append(("accepted", f"by {acc['by']} at {acc['at']}: {acc['reason']}"))
    return lines


def _drift(r: ReportData) -> str:
    drift: DriftComparison | DriftNote | None = r["drift"]
    if drift is None:
        return _p("No drift comparison for this run (monitoring.drift is off, or the run failed).")
    if drift["baseline"] is None:
        note = drift.get("note") or "No drift comparison for this run (no baseline run)."
        return _p(note) + (_kv(_verdict_lines(r)) if r.get("verdict") else "")
    d = drift  # a comparison: its baseline is a run, not None
    base, th, n = d["baseline"], d["thresholds"], d["rows"]
    verdict = r.get("verdict")
    accepted = verdict is not None and verdict["accepted"] is not None
    if d["alert"]:
        banner = ("warn", "DRIFT ALERT, ACCEPTED") if accepted else ("bad", "DRIFT ALERT")
    else:
        banner = ("ok", "No drift alert")
    out = [
        f'<div class="banner {banner[0]}">{banner[1]}</div>',
        _kv(
            [
                ("baseline run", base["run_id"]),
                ("baseline output", base["output"]),
                ("baseline finished", base["finished_at"]),
                (
                    "thresholds",
                    f"PSI > {_g(th['psi'])}, KS > {_g(th['ks'])}, "
                    f"row count change > {_pct(th['rows_change'])}",
                ),
                *_verdict_lines(r),
            ]
        ),
    ]
    if d["reasons"]:
        out.append(_ul(d["reasons"]))
    counts = [_fmt(n["previous"]), _fmt(n["current"]), _pct(n["change"], True)]
    out.append("<h3>Row count</h3>" + _table(["previous", "current", "change"], [counts]))
    if d["columns"]:
        out.append(_drift_columns(d))
    return "".join(out)


def _environment(r: ReportData) -> str:
    out = ["<h3>Model</h3>", _kv(list(r["model"].items()))]
    for title, items in (
        ("Execution", list(r["execution"].items())),
        ("Threads", list(r["threads"].items())),
        ("Versions", list(r["versions"].items())),
    ):
        out.append(f"<h3>{title}</h3>" + _kv(items))
    out.append("<h3>Locations</h3>")
    out.append(_kv([("input", r["input"]), ("output", r["output"]), ("rejects", r["rejects"])]))
    return "".join(out)


def _output_changes(r: ReportData) -> str:
    """What reconciling the output with the input removed, and files this tool did not write."""
    removed = r["removed_outputs"]
    out = (
        _table(["output", "reason"], [[x["output"], x["reason"]] for x in removed])
        if removed
        else _p("Nothing was removed: every output file belongs to a current input shard.", "")
    )
    if r["foreign_removed"]:
        out += "<h3>Foreign data files deleted (--on-foreign-output replace)</h3>"
        out += _ul(r["foreign_removed"])
    if r["foreign_kept"]:
        out += "<h3>Files in the output that score-catalog did not write (left alone)</h3>"
        out += _ul(r["foreign_kept"])
    return out


_SECTIONS: list[tuple[str, str, Callable[[ReportData], str]]] = [
    ("status", "Status", _status),
    ("totals", "Totals", _totals),
    ("shards", "Shards", _shards),
    ("throughput", "Throughput over time", _throughput),
    ("latency", "Batch latency", _latency),
    ("scores", "Score distributions", _scores),
    ("rejects", "Rejected rows", _rejects),
    ("output-changes", "Removed from the output", _output_changes),
    ("drift", "Drift against the previous run", _drift),
    ("environment", "Model and environment", _environment),
]


def render_html(report: ReportData) -> str:
    """The whole ``_report.html`` page for one ``_report.json`` (``schema_version`` 4).

    A section that fails on a malformed value says so on the page; the others still render.
    """
    parts = []
    for sid, title, fn in _SECTIONS:
        try:
            body = fn(report)
        except Exception as exc:  # a malformed field must not cost the rest of the page
            body = _p(f"This section could not be rendered: {type(exc).__name__}: {exc}")
        parts.append(f'<section id="{sid}"><h2>{_e(title)}</h2>{body}</section>')
    head = (
        f"score-catalog {report['job']} — {str(report['status']).upper()} — run {report['run_id']}"
    )
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(head)}</title><style>{_CSS}</style></head>"
        f"<body><main><h1>{_e(head)}</h1>{''.join(parts)}</main></body></html>\n"
    )
    # Pure ASCII (non-ASCII as character references): readable whatever encoding it is saved in.
    return page.encode("ascii", "xmlcharrefreplace").decode("ascii")
