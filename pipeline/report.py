"""The run report: ``_report.json`` (schema in the README, versioned) and the CLI summary table."""

from __future__ import annotations

import platform
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline import drift as drift_mod
from pipeline.errors import EXIT_DRIFT, EXIT_OK, EXIT_RUN_FAILED

if TYPE_CHECKING:  # `score-catalog report` reads reports without importing torch
    from pipeline.scoring import ShardResult

REPORT_NAME = "_report.json"
HTML_NAME = "_report.html"
SCHEMA_VERSION = 2
QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)
STATUSES = ("succeeded", "succeeded_with_errors", "succeeded_with_warnings", "failed")
# The driver keeps at most this many sampled scores per output column, however many shards the
# archive has; beyond it the sample is compressed to evenly weighted quantiles (memory stays flat).
MAX_SAMPLE = 200_000
COMPRESSED_SAMPLE = 20_000
HISTOGRAM_BINS = 20


@dataclass
class RunReport:
    """The outcome of :func:`pipeline.run`; ``data`` is exactly what ``_report.json`` holds."""

    data: dict[str, Any]

    @property
    def status(self) -> str:
        return str(self.data["status"])

    @property
    def exit_code(self) -> int:
        if self.status == "failed":
            return EXIT_RUN_FAILED
        drift = self.data.get("drift") or {}
        return EXIT_DRIFT if drift.get("alert") else EXIT_OK

    def __getitem__(self, key: str) -> Any:
        return self.data[key]


def versions() -> dict[str, str]:
    import dask
    import pyarrow
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyarrow": pyarrow.__version__,
        "dask": dask.__version__,
    }


def _weighted_quantiles(values: np.ndarray, weights: np.ndarray) -> dict[str, float]:
    qs = drift_mod.weighted_quantiles(values, weights, np.asarray(QUANTILES))
    return {f"p{round(q * 100):02d}": float(x) for q, x in zip(QUANTILES, qs, strict=True)}


class ScoreProfile:
    """Per output column: exact count, sum, min and max, and a bounded weighted sample of scores.

    Each shard sends every k-th score with weight k; the driver merges them here. Quantiles,
    the drift sketch and the histogram come from the merged sample.
    """

    def __init__(self) -> None:
        self.cols: dict[str, dict[str, Any]] = {}

    def add(self, r: ShardResult) -> None:
        for col, (count, total, lo, hi) in r.stats.items():
            m = self.cols.setdefault(
                col,
                {"count": 0, "sum": 0.0, "min": np.inf, "max": -np.inf, "v": [], "w": [], "n": 0},
            )
            m["count"] += count
            m["sum"] += total
            m["min"] = min(m["min"], lo)
            m["max"] = max(m["max"], hi)
            vals = np.asarray(r.samples.get(col, []), dtype=float)
            if len(vals):
                m["v"].append(vals)
                m["w"].append(np.full(len(vals), r.sample_weight))
                m["n"] += len(vals)
            if m["n"] > MAX_SAMPLE:
                v, w = np.concatenate(m["v"]), np.concatenate(m["w"])
                levels = (np.arange(COMPRESSED_SAMPLE) + 0.5) / COMPRESSED_SAMPLE
                m["v"] = [drift_mod.weighted_quantiles(v, w, levels)]
                m["w"] = [np.full(COMPRESSED_SAMPLE, w.sum() / COMPRESSED_SAMPLE)]
                m["n"] = COMPRESSED_SAMPLE

    def summary(self) -> dict[str, dict[str, Any]]:
        """The ``outputs`` section of ``_report.json``."""
        out: dict[str, dict[str, Any]] = {}
        for col, m in self.cols.items():
            entry: dict[str, Any] = {"count": int(m["count"])}
            if m["count"]:
                v = np.concatenate(m["v"]) if m["v"] else np.zeros(0)
                w = np.concatenate(m["w"]) if m["w"] else np.zeros(0)
                entry.update(mean=m["sum"] / m["count"], min=float(m["min"]), max=float(m["max"]))
                if len(v):
                    entry["quantiles"] = _weighted_quantiles(v, w)
                    entry["sketch"] = drift_mod.sketch(v, w)
                    entry["histogram"] = drift_mod.histogram(v, w, bins=HISTOGRAM_BINS)
            out[col] = entry
        return out


def output_summary(results: Iterable[ShardResult]) -> dict[str, dict[str, Any]]:
    """Per output column: count, mean, min, max (exact); quantiles, sketch, histogram (sampled)."""
    profile = ScoreProfile()
    for r in results:
        profile.add(r)
    return profile.summary()


def latency_summary(results: Iterable[ShardResult]) -> dict[str, float | None]:
    lat = np.asarray([x for r in results for x in r.latencies_ms], dtype=float)
    if not len(lat):
        return {"p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(lat, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}


def _fmt_int(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def summary_table(report: RunReport, *, max_shards: int = 20) -> str:
    """A short human summary of the run for the terminal (and cron's mail)."""
    d = report.data
    lines = [
        f"score-catalog run {d['run_id']}: {d['status'].upper()}",
        f"  job       {d['job']}",
        f"  model     {d['model']['name']} v{d['model']['version']} ({d['model']['sha256'][:12]}) "
        f"on {d['device']}, batch {d['batch_size']}",
        f"  output    {d['output']}",
        f"  shards    {d['shards_total']} total: {d['shards_scored']} scored, "
        f"{d['shards_skipped']} skipped (already done), {d['shards_failed']} failed",
        f"  rows      {_fmt_int(d['rows_in'])} in, {_fmt_int(d['rows_out'])} scored, "
        f"{_fmt_int(d['rows_rejected'])} rejected",
        f"  speed     {d['rows_per_s']:,.0f} rows/s over {d['rows_processed']:,} rows scored in "
        f"{d['duration_s']:.1f}s",
    ]
    lat = d["batch_latency_ms"]
    if lat["p50"] is not None:
        lines.append(
            f"  batch ms  p50 {lat['p50']:.2f}  p95 {lat['p95']:.2f}  p99 {lat['p99']:.2f}"
        )
    shards = d["shards"]
    if shards:
        lines.append("")
        w = max(len("shard"), *(len(s["rel_path"]) for s in shards[:max_shards]))
        lines.append(
            f"  {'shard':<{w}}  {'status':<8} {'rows in':>10} {'scored':>10} "
            f"{'rejected':>9} {'rows/s':>11}"
        )
        for s in shards[:max_shards]:
            rate = f"{s['rows_per_s']:,.0f}" if s["status"] == "scored" else "-"
            lines.append(
                f"  {s['rel_path']:<{w}}  {s['status']:<8} {_fmt_int(s['rows_in']):>10} "
                f"{_fmt_int(s['rows_out']):>10} {_fmt_int(s['rows_rejected']):>9} {rate:>11}"
            )
        if len(shards) > max_shards:
            lines.append(f"  ... {len(shards) - max_shards} more shards in _report.json")
    for warning in d.get("warnings", []):
        lines.append(f"  WARNING {warning}")
    for err in d["errors"][:10]:
        lines.append(f"  ERROR [{err['kind']}] {err['message']}")
    if len(d["errors"]) > 10:
        lines.append(f"  ... {len(d['errors']) - 10} more errors in _report.json")
    return "\n".join(lines)


def load_report(uri: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``_report.json`` of a run: ``uri`` is its output root or the report file itself."""
    from pipeline import storage
    from pipeline.errors import InputError

    loc = storage.locate(uri, options)
    if not loc.path.endswith(".json"):
        loc = loc.child(REPORT_NAME)
    data = storage.read_json(loc)
    if not isinstance(data, dict) or "run_id" not in data:
        raise InputError(
            f"{loc.uri}: no run report there; give a run's output root (the folder holding "
            f"{REPORT_NAME}) or the report file"
        )
    return data


def _num(v: Any, fmt: str = ",.0f") -> str:
    return "-" if v is None else format(v, fmt)


def diff_table(current: dict[str, Any], other: dict[str, Any]) -> str:
    """Two runs side by side: counts, throughput, score quantiles and drift of ``current``."""
    a, b = current, other
    lines = [
        f"score-catalog report: {a['run_id']} vs {b['run_id']}",
        f"  {'':<22} {'this run':>22} {'other run':>22} {'change':>10}",
    ]

    def row(label: str, x: Any, y: Any, fmt: str = ",.0f") -> None:
        change = "-"
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y:
            change = f"{(x / y - 1) * 100:+.1f}%"
        lines.append(f"  {label:<22} {_num(x, fmt):>22} {_num(y, fmt):>22} {change:>10}")

    lines.append(f"  {'status':<22} {a.get('status', '-'):>22} {b.get('status', '-'):>22}")
    lines.append(
        f"  {'model':<22} {str((a.get('model') or {}).get('sha256', '-'))[:12]:>22} "
        f"{str((b.get('model') or {}).get('sha256', '-'))[:12]:>22}"
    )
    for key in ("rows_in", "rows_out", "rows_rejected", "shards_total", "shards_failed"):
        row(key, a.get(key), b.get(key))
    row("rows_per_s", a.get("rows_per_s"), b.get("rows_per_s"))
    row("duration_s", a.get("duration_s"), b.get("duration_s"), ",.1f")
    cols = sorted(set(a.get("outputs") or {}) | set(b.get("outputs") or {}))
    for col in cols:
        qa = ((a.get("outputs") or {}).get(col) or {}).get("quantiles") or {}
        qb = ((b.get("outputs") or {}).get(col) or {}).get("quantiles") or {}
        for q in ("p05", "p50", "p95"):
            row(f"{col} {q}", qa.get(q), qb.get(q), ".4f")
    d = drift_mod.compare(b, a, drift_mod.DriftThresholds())
    lines.append("")
    lines.append(f"  drift of this run against the other (default thresholds {d['thresholds']}):")
    for col, c in d["columns"].items():
        flag = "  ALERT" if c["alert"] else ""
        lines.append(
            f"    {col:<20} PSI {_num(c['psi'], '.4f'):>8}  KS {_num(c['ks'], '.4f'):>8}{flag}"
        )
    for reason in d["reasons"]:
        lines.append(f"    - {reason}")
    return "\n".join(lines)
