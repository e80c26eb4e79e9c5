"""The run report: ``_report.json`` (schema in the README, versioned) and the CLI summary table."""

from __future__ import annotations

import platform
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.errors import EXIT_OK, EXIT_RUN_FAILED
from pipeline.scoring import ShardResult

REPORT_NAME = "_report.json"
SCHEMA_VERSION = 1
QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)


@dataclass
class RunReport:
    """The outcome of :func:`pipeline.run`; ``data`` is exactly what ``_report.json`` holds."""

    data: dict[str, Any]

    @property
    def status(self) -> str:
        return str(self.data["status"])

    @property
    def exit_code(self) -> int:
        return EXIT_RUN_FAILED if self.status == "failed" else EXIT_OK

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
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    cdf = (np.cumsum(w) - 0.5 * w) / w.sum()
    return {f"p{round(q * 100):02d}": float(np.interp(q, cdf, v)) for q in QUANTILES}


def output_summary(results: Iterable[ShardResult]) -> dict[str, dict[str, Any]]:
    """Per output column: count, mean, min, max (exact) and quantiles (from per-shard samples)."""
    merged: dict[str, dict[str, Any]] = {}
    for r in results:
        for col, (count, total, lo, hi) in r.stats.items():
            m = merged.setdefault(
                col,
                {
                    "count": 0,
                    "sum": 0.0,
                    "min": np.inf,
                    "max": -np.inf,
                    "values": [],
                    "weights": [],
                },
            )
            m["count"] += count
            m["sum"] += total
            m["min"] = min(m["min"], lo)
            m["max"] = max(m["max"], hi)
            vals = r.samples.get(col, [])
            m["values"].extend(vals)
            m["weights"].extend([r.sample_weight] * len(vals))
    out: dict[str, dict[str, Any]] = {}
    for col, m in merged.items():
        entry: dict[str, Any] = {"count": int(m["count"])}
        if m["count"]:
            entry.update(mean=m["sum"] / m["count"], min=float(m["min"]), max=float(m["max"]))
            entry["quantiles"] = _weighted_quantiles(
                np.asarray(m["values"], dtype=float), np.asarray(m["weights"], dtype=float)
            )
        out[col] = entry
    return out


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
