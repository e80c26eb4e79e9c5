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

import statistics
from collections.abc import Callable, Mapping
from typing import Any, cast

from pipeline.core.statuses import RunStatus, ShardStatus
from pipeline.report.charts import (
    bar_chart,
    count_chart,
    esc,
    figure,
    fmt,
    histogram,
    kv,
    line_chart,
    num,
    para,
    pct,
    plain,
    sig,
    table,
    ul,
)
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


# ---------------------------------------------------------------- sections


def _status(r: ReportData) -> str:
    status = str(r["status"])
    cls = _STATUS_CLASS.get(status, "unknown")
    out = [
        f'<div class="banner {cls}">{esc(status.upper())} — run {esc(r["run_id"])}, '
        f"job {esc(r['job'])}</div>",
        kv([("started", r["started_at"]), ("finished", r["finished_at"])]),
    ]
    if r["failure_reasons"]:
        out.append("<h3>Failure reasons</h3>" + ul(r["failure_reasons"]))
    if r["warnings"]:
        out.append("<h3>Warnings</h3>" + ul(r["warnings"]))
    errors: list[ErrorEntry] = r["errors"]
    if errors:
        rows = [[e["kind"], e["shard"], e["message"]] for e in errors[:ERRORS_SHOWN]]
        out.append(f"<h3>Errors ({len(errors):,})</h3>" + table(("kind", "shard", "message"), rows))
        if len(errors) > ERRORS_SHOWN:
            out.append(para(f"… and {len(errors) - ERRORS_SHOWN:,} more errors in _report.json."))
    return "".join(out)


#: What a run that scored nothing shows for its speed (a rerun over a finished output): not
#: "0 rows/s", which read on the morning-after page as a night that crawled.
NOTHING_SCORED = "— (nothing scored in this run)"


def _totals(r: ReportData) -> str:
    return kv(
        [
            ("rows in", fmt(r["rows_in"])),
            ("rows scored", fmt(r["rows_out"])),
            ("rows rejected", fmt(r["rows_rejected"])),
            ("rejected fraction", pct(r["rejected_fraction"])),
            ("shards total", fmt(r["shards_total"])),
            ("shards scored", fmt(r["shards_scored"])),
            ("shards skipped (already done)", fmt(r["shards_skipped"])),
            ("shards failed", fmt(r["shards_failed"])),
            ("duration", fmt(r["duration_s"], 1, " s")),
            ("rows/s", fmt(r["rows_per_s"]) if r["rows_processed"] else NOTHING_SCORED),
            ("batch size", fmt(r["batch_size"])),
            ("device", r["device"]),
        ]
    )


def _shard_row(s: ShardEntry, slow: set[str]) -> tuple[list[str], str]:
    failed = s["status"] == ShardStatus.FAILED
    row = [s["rel_path"], str(s["status"])]
    row += [fmt(s["rows_in"]), fmt(s["rows_out"]), fmt(s["rows_rejected"])]
    row += [fmt(s["started_s"], 1, " s"), fmt(s["duration_s"], 2, " s")]
    row.append(fmt(s["rows_per_s"]) if s["status"] == ShardStatus.SCORED else "-")
    row.append(" ".join(plain(x) for x in (s["kind"], s["message"])) if failed else "")
    return row, "failed" if failed else "slow" if s["rel_path"] in slow else ""


def _shards(r: ReportData) -> str:
    shards = r["shards"]
    if not shards:
        return para("No per-shard results in this report.")
    # Skipped shards (done by an earlier attempt) took no time in this run.
    timed = [(s["rel_path"], s["duration_s"]) for s in shards if s["status"] != ShardStatus.SKIPPED]
    median = statistics.median(d for _, d in timed) if timed else None
    slow = {p for p, d in timed if median and d > SLOW_FACTOR * median}
    out = []
    if timed:
        top = sorted(timed, key=lambda t: -t[1])[:SHARD_CHART_TOP]
        title = f"Slowest {len(top)} of {len(shards):,} shards by duration (s)"
        cap = f"Median shard duration {sig(median)} s; {len(slow):,} shards took more than "
        cap += f"{SLOW_FACTOR:g}x the median (marked ▲ and highlighted)."
        out.append(figure(bar_chart([(p, d, p in slow) for p, d in top], title, " s"), cap))
    order = sorted(range(len(shards)), key=lambda i: (shards[i]["status"] != ShardStatus.FAILED, i))
    rows, classes = [], []
    for i in order[:SHARD_TABLE_CAP]:
        row, cls = _shard_row(shards[i], slow)
        rows.append(row)
        classes.append(cls)
    head = ("shard", "status", "rows in", "scored", "rejected", "started (+s)", "duration")
    out.append(table((*head, "rows/s", "message"), rows, classes))
    if len(shards) > SHARD_TABLE_CAP:
        note = f"Showing {SHARD_TABLE_CAP:,} of {len(shards):,} shards (failed shards first); "
        out.append(para(note + "the full list is in _report.json."))
    return "".join(out)


def _first_start(r: ReportData) -> float | None:
    """Seconds from the run's start to the first shard's start: when scoring began.

    None when no shard says (nothing ran); a malformed shard entry is the shards section's
    problem, so it is passed over here rather than costing this chart too.
    """
    starts = [num(s.get("started_s")) for s in r["shards"] if isinstance(s, Mapping)]
    known = [t for t in starts if t is not None]
    return min(known) if known else None


def _throughput(r: ReportData) -> str:
    if not r["rows_processed"] and r["shards_skipped"]:
        return para(
            f"Nothing was scored in this run: all {r['shards_skipped']:,} shards were already "
            "done by an earlier run (skipped below). The totals, scores and drift on this page "
            "are of the whole output; its speed is in that run's log and metrics."
        )
    pts = sorted((float(p["t_s"]), float(p["rows"])) for p in r["throughput"])
    start = _first_start(r)
    if start is not None and len(pts) > 1:
        # The report's first point is (0, 0), the run's start. Planning, starting the cluster and
        # loading the model come before any shard starts: a line from (0, 0) would draw that
        # start-up as slow scoring. The line starts where the first shard started instead.
        pts = [(start, 0.0)] + [p for p in pts if p[0] >= start and p[1] > 0]
    if len(pts) < 2:
        return para("Not enough throughput samples to draw a chart (fewer than 2 points).")
    (t0, n0), (t1, n1) = pts[0], pts[-1]
    rate = (n1 - n0) / (t1 - t0) if t1 > t0 else None
    chart = line_chart(pts, "seconds since the run started", "rows scored (cumulative)",
                       "Rows over time")  # fmt: skip
    cap = ""
    if start is not None:
        cap = f"Scoring began {fmt(start, 1)} s after the run started (planning, starting "
        cap += "workers, loading the model); the line starts there. "
    cap += f"{len(pts):,} samples; {sig(n1)} rows scored by {fmt(t1, 1)} s; average "
    cap += f"{fmt(rate)} rows/s since scoring began. A flat stretch means nothing finished then."
    return figure(chart, cap)


def _latency(r: ReportData) -> str:
    lat = r["batch_latency_ms"]
    values = (("p50", lat["p50"]), ("p95", lat["p95"]), ("p99", lat["p99"]))
    out = table(["percentile", "batch latency (ms)"], [[k, fmt(v, 2)] for k, v in values])
    items = [(k, v, False) for k, v in values if v is not None]
    if items:
        out += figure(bar_chart(items, "batch latency (ms)", " ms"), "Per-batch model latency.")
    else:
        out += para("No batch latencies were recorded (no batches were scored).")
    return out


_QUANTILE_KEYS = ("p01", "p05", "p25", "p50", "p75", "p95", "p99")


def _score_column(col: str, o: OutputStats) -> str:
    # Only ``count`` is always there: a column with no rows (or no sample) has no statistics.
    q = cast("Mapping[str, float]", o.get("quantiles") or {})
    stats = [fmt(o["count"]), sig(o.get("mean")), sig(o.get("min")), sig(o.get("max"))]
    head = ["count", "mean", "min", "max", *_QUANTILE_KEYS]
    out = [f"<h3>{esc(col)}</h3>", table(head, [stats + [sig(q.get(k)) for k in _QUANTILE_KEYS]])]
    discrete: ValueCounts | None = o.get("value_counts")
    if discrete and discrete["values"] and len(discrete["values"]) == len(discrete["counts"]):
        values, counts_ = list(discrete["values"]), list(discrete["counts"])
        shown = ", ".join(sig(v) for v in values)
        cap = (
            f"Rows per value of {col} ({len(values)} distinct: {shown}), from the report's sample."
        )
        out.append(figure(count_chart(values, counts_, col, f"Rows per value of {col}"), cap))
        return "".join(out)
    h = o.get("histogram")
    edges, counts = (list(h["edges"]), list(h["counts"])) if h else ([], [])
    if counts and len(edges) == len(counts) + 1:
        cap = f"Histogram of {col}: {len(counts)} bins from {sig(edges[0])} to {sig(edges[-1])}."
        out.append(figure(histogram(edges, counts, col, f"Distribution of {col}"), cap))
    else:
        out.append(para(f"No histogram recorded for {col}."))
    return "".join(out)


def _scores(r: ReportData) -> str:
    if not r["outputs"]:
        return para("No output statistics in this report (no rows were scored by this run).")
    return "".join(_score_column(col, o) for col, o in r["outputs"].items())


def _rejects(r: ReportData) -> str:
    by = {k: n for k, n in r["rejects_by_reason"].items() if n}
    if not by:
        return para("No rows were rejected.", "")
    items = sorted(by.items(), key=lambda kv: -kv[1])
    total = sum(by.values())
    out = figure(
        bar_chart([(k, v, False) for k, v in items], "rejected rows"), "Rejected rows by reason."
    )
    rows = [[k, sig(v), pct(v / total)] for k, v in items]
    return out + table(["reason", "rows", "share"], rows)


def _drift_columns(d: DriftComparison) -> str:
    table_rows, classes = [], []
    for col, c in d["columns"].items():
        table_rows.append([col, sig(c["psi"]), sig(c["ks"]), "ALERT" if c["alert"] else "ok"])
        classes.append("alert" if c["alert"] else "")
    return "<h3>Per column</h3>" + table(["column", "PSI", "KS", "alert"], table_rows, classes)


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
        return para(
            "No drift comparison for this run (monitoring.drift is off, or the run failed)."
        )
    if drift["baseline"] is None:
        note = drift.get("note") or "No drift comparison for this run (no baseline run)."
        return para(note) + (kv(_verdict_lines(r)) if r.get("verdict") else "")
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
        kv(
            [
                ("baseline run", base["run_id"]),
                ("baseline output", base["output"]),
                ("baseline finished", base["finished_at"]),
                (
                    "thresholds",
                    f"PSI > {sig(th['psi'])}, KS > {sig(th['ks'])}, "
                    f"row count change > {pct(th['rows_change'])}",
                ),
                *_verdict_lines(r),
            ]
        ),
    ]
    if d["reasons"]:
        out.append(ul(d["reasons"]))
    counts = [fmt(n["previous"]), fmt(n["current"]), pct(n["change"], True)]
    out.append("<h3>Row count</h3>" + table(["previous", "current", "change"], [counts]))
    if d["columns"]:
        out.append(_drift_columns(d))
    return "".join(out)


def _environment(r: ReportData) -> str:
    out = ["<h3>Model</h3>", kv(list(r["model"].items()))]
    for title, items in (
        ("Execution", list(r["execution"].items())),
        ("Threads", list(r["threads"].items())),
        ("Versions", list(r["versions"].items())),
    ):
        out.append(f"<h3>{title}</h3>" + kv(items))
    out.append("<h3>Locations</h3>")
    out.append(kv([("input", r["input"]), ("output", r["output"]), ("rejects", r["rejects"])]))
    fmt = r.get("output_format")
    if fmt is not None and fmt.get("title"):
        # A table's commit: the version readers see, and the token that made it once.
        shown = [(k, v) for k, v in fmt.items() if k not in ("title", "summary")]
        out.append(f"<h3>{esc(str(fmt['title']))}</h3>" + kv(shown))
    return "".join(out)


def _incremental(r: ReportData) -> str:
    """An incremental night: what went through the model and what was carried, and from
    which baseline (docs/incremental.md)."""
    inc = r.get("incremental")
    if not inc:
        return ""
    rows: list[tuple[str, Any]] = [
        ("rows through the model", fmt(inc["rows_scored"])),
        ("… of which new ids", fmt(inc["rows_new"])),
        ("… of which changed", fmt(inc["rows_changed"])),
        ("rows carried from the baseline", fmt(inc["rows_carried"])),
        ("rows kept from an earlier run", fmt(inc["rows_kept"])),
        ("baseline ids gone from the input", fmt(inc["rows_removed"])),
    ]
    base = inc["baseline"]
    if base is None:
        out = para(f"Every row went through the model: {inc['full_reason']}.", "")
    else:
        out = ""
        rows += [(f"baseline {k}", v) for k, v in base.items()]
    return out + kv(rows)


def _output_changes(r: ReportData) -> str:
    """What reconciling the output with the input removed, and files this tool did not write."""
    removed = r["removed_outputs"]
    out = (
        table(["output", "reason"], [[x["output"], x["reason"]] for x in removed])
        if removed
        else para("Nothing was removed: every output file belongs to a current input shard.", "")
    )
    if r["foreign_removed"]:
        out += "<h3>Foreign data files deleted (--on-foreign-output replace)</h3>"
        out += ul(r["foreign_removed"])
    if r["foreign_kept"]:
        out += "<h3>Files in the output that score-catalog did not write (left alone)</h3>"
        out += ul(r["foreign_kept"])
    return out


_SECTIONS: list[tuple[str, str, Callable[[ReportData], str]]] = [
    ("status", "Status", _status),
    ("totals", "Totals", _totals),
    ("incremental", "Scored and carried (incremental)", _incremental),
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
        if sid == "incremental" and not report.get("incremental"):
            continue  # a run that is not incremental has nothing to say here
        try:
            body = fn(report)
        except Exception as exc:  # a malformed field must not cost the rest of the page
            body = para(f"This section could not be rendered: {type(exc).__name__}: {exc}")
        parts.append(f'<section id="{sid}"><h2>{esc(title)}</h2>{body}</section>')
    head = (
        f"score-catalog {report['job']} — {str(report['status']).upper()} — run {report['run_id']}"
    )
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(head)}</title><style>{_CSS}</style></head>"
        f"<body><main><h1>{esc(head)}</h1>{''.join(parts)}</main></body></html>\n"
    )
    # Pure ASCII (non-ASCII as character references): readable whatever encoding it is saved in.
    return page.encode("ascii", "xmlcharrefreplace").decode("ascii")
