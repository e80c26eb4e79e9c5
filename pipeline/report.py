"""The run report: ``_report.json`` (schema in docs/report.md, versioned) and the CLI summary."""

from __future__ import annotations

import datetime as dt
import logging
import math
import platform
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline import drift as drift_mod
from pipeline import layout
from pipeline.errors import EXIT_DRIFT, EXIT_OK, EXIT_RUN_FAILED
from pipeline.interrupt import exit_code_of
from pipeline.statuses import FailureKind, RunStatus, ShardStatus

if TYPE_CHECKING:  # `score-catalog report` reads reports without importing torch
    from pipeline.config import ErrorPolicy
    from pipeline.model import LoadedModel
    from pipeline.scoring import ShardResult

logger = logging.getLogger(__name__)

REPORT_NAME = "_report.json"
HTML_NAME = "_report.html"
# 3: the report is described by a committed JSON Schema (pipeline/schemas); keys as in 2.
# 4: the dataset's drift verdict (``verdict``: pipeline.verdict).
SCHEMA_VERSION = 4
QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)
STATUSES = (
    RunStatus.SUCCEEDED,
    RunStatus.SUCCEEDED_WITH_ERRORS,
    RunStatus.SUCCEEDED_WITH_WARNINGS,
    RunStatus.FAILED,
)
# The driver keeps at most this many sampled scores per output column, however many shards the
# archive has; beyond it the sample is compressed to evenly weighted quantiles (memory stays flat).
MAX_SAMPLE = 200_000
COMPRESSED_SAMPLE = 20_000
HISTOGRAM_BINS = 20
# A column with at most this many distinct whole-number values gets rows per value as well.
DISCRETE_MAX_VALUES = 20


@dataclass
class RunReport:
    """The outcome of :func:`pipeline.run`; ``data`` is exactly what ``_report.json`` holds."""

    data: dict[str, Any]
    # The control folder its _report.json and _report.html were written to (pipeline.layout);
    # not part of the report itself. None: unknown (a report read back from storage).
    control: str | None = None

    @property
    def status(self) -> str:
        return str(self.data["status"])

    @property
    def exit_code(self) -> int:
        """The exit code of the run's status (:func:`exit_code_for`): one rule, the README's."""
        return exit_code_for(self.status, self.data.get("failure_reasons") or [])

    def __getitem__(self, key: str) -> Any:
        return self.data[key]


#: The exit code of each run status (the README's "Exit codes" table). An interrupted run's
#: code depends on its signal (:func:`pipeline.interrupt.exit_code_of`).
EXIT_CODE_BY_STATUS: dict[str, int] = {
    RunStatus.SUCCEEDED: EXIT_OK,
    RunStatus.SUCCEEDED_WITH_ERRORS: EXIT_OK,
    RunStatus.SUCCEEDED_WITH_WARNINGS: EXIT_DRIFT,
    RunStatus.FAILED: EXIT_RUN_FAILED,
}


def exit_code_for(status: str, failure_reasons: Iterable[str] = ()) -> int:
    """The exit code of a run that ended with ``status``: a function of the status alone, so
    that what cron sees and what ``_report.json`` says never disagree (an interrupted run's
    reasons name its signal: 143 for SIGTERM, 130 for SIGINT)."""
    if status == RunStatus.INTERRUPTED:
        return exit_code_of(list(failure_reasons))
    return EXIT_CODE_BY_STATUS[status]


def versions() -> dict[str, str]:
    import dask
    import pyarrow
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyarrow": pyarrow.__version__,
        "dask": dask.__version__,  # type: ignore[attr-defined]  # not in its stubs' exports
    }


def _weighted_quantiles(values: np.ndarray, weights: np.ndarray) -> dict[str, float]:
    qs = drift_mod.weighted_quantiles(values, weights, np.asarray(QUANTILES))
    return {f"p{round(q * 100):02d}": float(x) for q, x in zip(QUANTILES, qs, strict=True)}


class ScoreProfile:
    """Per output column: exact count, sum, min and max, and a bounded weighted sample of scores.

    Each scored shard sends every k-th score with weight k; a skipped shard brings the sketch
    its manifest entry kept (read as equally weighted values). The driver merges them here, so
    the summary covers every shard in the output. Quantiles, the drift sketch and the histogram
    come from the merged sample.
    """

    def __init__(self) -> None:
        self.cols: dict[str, dict[str, Any]] = {}

    def add(self, r: ShardResult) -> None:
        """Merge one shard's statistics (scored now, or skipped with its manifest's)."""
        weight = r.stats.sample_weight
        for col, c in r.stats.columns.items():
            m = self.cols.setdefault(
                col,
                {"count": 0, "sum": 0.0, "min": np.inf, "max": -np.inf, "v": [], "w": [], "n": 0},
            )
            m["count"] += c.count
            m["sum"] += c.total
            m["min"] = min(m["min"], c.min)
            m["max"] = max(m["max"], c.max)
            vals, wts = c.weighted_sample(weight)
            if len(vals):
                m["v"].append(vals)
                m["w"].append(wts)
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
                    if entry["sketch"]:  # a sample may miss the extremes; min and max are exact
                        entry["sketch"][0], entry["sketch"][-1] = entry["min"], entry["max"]
                    entry["histogram"] = drift_mod.histogram(v, w, bins=HISTOGRAM_BINS)
                    counts = drift_mod.value_counts(v, w, max_values=DISCRETE_MAX_VALUES)
                    if counts is not None:
                        entry["value_counts"] = counts
            out[col] = entry
        return out


def output_summary(results: Iterable[ShardResult]) -> dict[str, dict[str, Any]]:
    """Per output column: count, mean, min, max (exact); quantiles, sketch, histogram (sampled)."""
    profile = ScoreProfile()
    for r in results:
        profile.add(r)
    return profile.summary()


def latency_summary(results: Iterable[ShardResult]) -> dict[str, float | None]:
    """Model time per batch over every scored shard: p50, p95, p99 in milliseconds."""
    lat = np.asarray([x for r in results for x in r.stats.latencies_ms], dtype=float)
    if not len(lat):
        return {"p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(lat, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}


def model_section(
    uri: str, model: LoadedModel, registry: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ``model`` section of the report: the bundle, its content hash and its widths, and
    for a model from a registry the version it resolved to (``registry``)."""
    spec = model.spec
    return {
        "uri": uri,
        "name": spec.name,
        "version": spec.version,
        "format": spec.format,
        "sha256": model.sha256,
        "width": model.width,
        "out_width": model.out_width,
        "registry": registry,
    }


@dataclass(frozen=True)
class RunFacts:
    """What the report says about a run besides its shards: who, where, and with what."""

    run_id: str
    job: str
    started_at: dt.datetime
    input: str
    output: str
    rejects: str
    id_column: str
    error_budget: ErrorPolicy
    model: dict[str, Any]  # the ``model`` section: uri, name, version, format, sha256, widths
    device: str
    threads: dict[str, Any]
    settings: dict[str, Any]
    batch_size: int
    execution: dict[str, Any]
    lock_taken_over: dict[str, Any] | None
    # Found before scoring and logged then (pipeline.oov: unseen values sharing a real id).
    model_warnings: tuple[str, ...] = ()


_IN_OUTPUT = (ShardStatus.SCORED, ShardStatus.SKIPPED)


def _problems(facts: RunFacts, shards: list[ShardResult]) -> tuple[list[dict[str, Any]], list[str]]:
    """The ``errors`` and ``warnings`` of the report, warnings logged as they are found."""
    errors: list[dict[str, Any]] = [
        {"shard": r.input, "kind": r.kind, "message": r.message}
        for r in shards
        if r.status == ShardStatus.FAILED
    ]
    warnings: list[str] = []
    col = facts.id_column
    for attr, what, after in (
        ("duplicate_ids", f"repeat a {col} value seen earlier in the same shard", "each once"),
        ("null_ids", f"have a null {col}", "but cannot be joined back by id"),
    ):
        counts = [
            (r.rel_path, n)
            for r in shards
            if (n := getattr(r, attr)) and r.status == ShardStatus.SCORED
        ]
        if counts:
            per_shard = ", ".join(f"{rel}: {n}" for rel, n in counts)
            total = sum(n for _, n in counts)
            warnings.append(f"{total} rows {what} ({per_shard}); they were scored, {after}")
    if facts.lock_taken_over:
        warnings.append(f"took over a stale lock: {facts.lock_taken_over['reason']}")
    bare = [
        r.rel_path for r in shards if r.status == ShardStatus.SKIPPED and not r.stats.summarised
    ]
    if bare:
        warnings.append(
            f"outputs and drift leave out {len(bare)} skipped shards whose manifest entries hold "
            f"no score statistics (written by an older version; e.g. {bare[0]}); "
            "rerun with --force to rescore them"
        )
    for w in warnings:
        logger.warning("%s", w)
    warnings.extend(facts.model_warnings)  # logged when the run found them, before scoring
    for r in shards:
        if r.status != ShardStatus.FAILED and r.rows_in != r.rows_out + r.rows_rejected:
            errors.append(
                {
                    "shard": r.input,
                    "kind": FailureKind.ACCOUNTING,
                    "message": f"shard {r.input}: rows in ({r.rows_in}) != rows scored "
                    f"({r.rows_out}) + rows rejected ({r.rows_rejected})",
                }
            )
    return errors, warnings


def lossy_cast_entries(shards: Iterable[ShardResult]) -> list[dict[str, Any]]:
    """The ``lossy_casts`` of the report: per feature column (and source type), in how many
    shards casting it to float32 changed a value, with the first example; each logged once."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for r in shards:
        for column, cast in r.stats.lossy_casts.items():
            entry = found.setdefault(
                (column, cast.from_type),
                {
                    "column": column,
                    "from_type": cast.from_type,
                    "shards": 0,
                    "example": {
                        "shard": r.rel_path,
                        "value": cast.value,
                        "as_float32": cast.as_float32,
                    },
                },
            )
            entry["shards"] += 1
    for e in found.values():
        x = e["example"]
        logger.warning(
            "feature %s: %s values change when cast to float32 for the model, in %d shard(s) "
            "(e.g. %r -> %r in %s); scale or convert the column upstream if that matters",
            e["column"],
            e["from_type"],
            e["shards"],
            x["value"],
            x["as_float32"],
            x["shard"],
            extra={"event": "lossy_cast"},
        )
    return list(found.values())


#: Failure kinds of shards that were never scored because the run stopped: counted, not listed.
NOT_SCORED_KINDS = frozenset({FailureKind.INTERRUPTED, FailureKind.CANCELLED})


def _counts(shards: list[ShardResult]) -> dict[str, Any]:
    """Row and shard totals; rows of failed shards count in ``rows_in`` only."""
    readable = [r for r in shards if r.rows_in is not None and r.status != ShardStatus.FAILED]
    scored = [r for r in shards if r.status == ShardStatus.SCORED]
    rows_rej = sum(r.rows_rejected for r in readable)
    denom = sum(r.rows_in or 0 for r in readable)
    return {
        "rows_in": sum(r.rows_in or 0 for r in shards if r.rows_in is not None),
        "rows_out": sum(r.rows_out for r in readable),
        "rows_rejected": rows_rej,
        "rows_processed": sum(r.rows_in or 0 for r in scored),
        "rejected_fraction": rows_rej / denom if denom else 0.0,
        "shards_total": len(shards),
        "shards_scored": len(scored),
        "shards_skipped": sum(r.status == ShardStatus.SKIPPED for r in shards),
        # Failures of the data or the model; shards the run never got to (it was stopped, or
        # a fatal error cancelled them) are counted apart: a cron timeout is not N failures.
        "shards_failed": sum(
            r.status == ShardStatus.FAILED and r.kind not in NOT_SCORED_KINDS for r in shards
        ),
        "shards_not_scored": sum(
            r.status == ShardStatus.FAILED and r.kind in NOT_SCORED_KINDS for r in shards
        ),
        # Not a report key: failed shards whose storage failed, not their data (not budgeted).
        "storage_failures": sum(
            r.status == ShardStatus.FAILED and r.kind == FailureKind.STORAGE for r in shards
        ),
    }


def _judge(
    budget: ErrorPolicy, counts: dict[str, Any], accounting_ok: bool, fatal: ShardResult | None
) -> tuple[RunStatus, list[str]]:
    """The run's status against its error budget, and the reasons when it failed."""
    # Shards the run never got to, and shards whose storage failed (which stops the run), are
    # not failures of the data: the budget ignores them.
    n_failed = counts["shards_failed"] - counts["storage_failures"]
    fraction = counts["rejected_fraction"]
    reasons = []
    if fatal is not None and fatal.kind == FailureKind.STORAGE:
        # The shard, the path and the cause, in the one line cron mails.
        reasons.append(f"storage failure: {fatal.message}")
    elif fatal is not None:
        reasons.append(f"fatal error in {fatal.input} ({fatal.kind})")
    if n_failed > budget.max_failed_shards:
        reasons.append(
            f"{n_failed} failed shards > errors.max_failed_shards = {budget.max_failed_shards}"
        )
    if fraction > budget.max_rejected_fraction:
        reasons.append(
            f"rejected fraction {fraction:.4g} > "
            f"errors.max_rejected_fraction = {budget.max_rejected_fraction}"
        )
    if not accounting_ok:
        reasons.append("rows in != rows scored + rows rejected for some shard")
    if reasons:
        return RunStatus.FAILED, reasons
    if n_failed or counts["rows_rejected"]:
        return RunStatus.SUCCEEDED_WITH_ERRORS, reasons
    return RunStatus.SUCCEEDED, reasons


def build_report(
    facts: RunFacts, shards: list[ShardResult], fatal: ShardResult | None, duration: float
) -> dict[str, Any]:
    """The ``_report.json`` of a finished run (drift is added later, by the finish phase)."""
    errors, warnings = _problems(facts, shards)
    counts = _counts(shards)
    accounting_ok = not any(e["kind"] == FailureKind.ACCOUNTING for e in errors)
    status, reasons = _judge(facts.error_budget, counts, accounting_ok, fatal)
    scored = [r for r in shards if r.status == ShardStatus.SCORED]
    t0 = facts.started_at.timestamp()
    processed = counts["rows_processed"]
    budget = facts.error_budget
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": facts.run_id,
        "job": facts.job,
        "status": status,
        "failure_reasons": reasons,
        "started_at": facts.started_at.isoformat(),
        "finished_at": (facts.started_at + dt.timedelta(seconds=duration)).isoformat(),
        "duration_s": duration,
        "input": facts.input,
        "output": facts.output,
        "rejects": facts.rejects,
        "rows_in": counts["rows_in"],
        "rows_out": counts["rows_out"],
        "rows_rejected": counts["rows_rejected"],
        "rows_processed": processed,
        "rows_per_s": processed / duration if duration > 0 else 0.0,
        "rejected_fraction": counts["rejected_fraction"],
        "accounting_ok": accounting_ok,
        "shards_total": counts["shards_total"],
        "shards_scored": counts["shards_scored"],
        "shards_skipped": counts["shards_skipped"],
        "shards_failed": counts["shards_failed"],
        "shards_not_scored": counts["shards_not_scored"],
        "batch_size": facts.batch_size,
        "execution": facts.execution,
        "device": facts.device,
        "threads": facts.threads,
        "model": facts.model,
        "settings": facts.settings,
        "error_budget": {
            "max_failed_shards": budget.max_failed_shards,
            "max_rejected_fraction": budget.max_rejected_fraction,
        },
        "lock_taken_over": facts.lock_taken_over,
        "oom_splits": sum(r.oom_splits for r in scored),
        # Over the whole output, as rows_out: shards skipped carry their manifest's counts.
        "duplicate_ids": sum(r.duplicate_ids for r in shards if r.status in _IN_OUTPUT),
        "null_ids": sum(r.null_ids for r in shards if r.status in _IN_OUTPUT),
        "versions": versions(),
        "batch_latency_ms": latency_summary(scored),
        "outputs": output_summary(r for r in shards if r.status != ShardStatus.FAILED),
        "rejects_by_reason": _rejects_by_reason(shards),
        "throughput": _throughput(scored, t0),
        "drift": None,
        # The drift verdict on the dataset (pipeline.verdict), filled in by the finish phase.
        "verdict": None,
        "errors": errors,
        "warnings": warnings,
        "lossy_casts": lossy_cast_entries(scored),
        # Filled in by the run's finish phase (pipeline.reconcile), which knows what it removed.
        "removed_outputs": [],
        "foreign_removed": [],
        "foreign_kept": [],
        "shards": [_shard_entry(r, t0) for r in shards],
    }


def _shard_entry(r: ShardResult, t0: float) -> dict[str, Any]:
    d = r.public()
    start, end = d.pop("started_at"), d.pop("finished_at")
    d["started_s"] = None if start is None else max(0.0, start - t0)
    d["finished_s"] = None if end is None else max(0.0, end - t0)
    return d


def _rejects_by_reason(shards: list[ShardResult]) -> dict[str, int]:
    total: dict[str, int] = {}
    for r in shards:
        for reason, n in r.rejects_by_reason.items():
            total[reason] = total.get(reason, 0) + n
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def _throughput(scored: list[ShardResult], t0: float) -> list[dict[str, float]]:
    """Cumulative rows scored against seconds since the run started, one point per shard."""
    points: list[dict[str, float]] = [{"t_s": 0.0, "rows": 0}]
    rows = 0
    for r in sorted(
        (r for r in scored if r.finished_at is not None), key=lambda r: r.finished_at or 0.0
    ):
        rows += r.rows_in or 0
        points.append({"t_s": max(0.0, (r.finished_at or t0) - t0), "rows": rows})
    return points


def _fmt_int(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


MAX_LISTED = 10  # failed shards, removals and warnings shown before "... N more"


def why_lines(d: Mapping[str, Any], *, max_listed: int = MAX_LISTED) -> list[str]:
    """Why a run did not simply succeed, for the top of its summary: the failure reasons, the
    failed shards with their kind and message (shards never scored because the run stopped are
    counted by kind, not listed) and the other errors (accounting). Empty for a clean run."""
    lines = [f"  reason    {r}" for r in d.get("failure_reasons") or []]
    errors = list(d.get("errors") or [])
    listed = _grouped_errors(d, [e for e in errors if e.get("kind") not in NOT_SCORED_KINDS])
    for i, text in enumerate(listed[:max_listed]):
        head = "  failed   " if i == 0 else "           "
        lines.append(f"{head} {text}")
    if len(listed) > max_listed:
        lines.append(f"            ... {len(listed) - max_listed} more in {REPORT_NAME}")
    for kind in (FailureKind.INTERRUPTED, FailureKind.CANCELLED):
        n = sum(1 for e in errors if e.get("kind") == kind)
        if n:
            lines.append(
                f"  {kind:<9} {n} shard{'s' if n != 1 else ''} not scored"
                + (" (a rerun resumes them)" if kind == FailureKind.INTERRUPTED else "")
            )
    return lines


def problem_line(d: Mapping[str, Any], control: str | None = None) -> str:
    """A run that did not succeed cleanly, in one line (what ``-q`` prints instead of the
    summary): its status, why, and where its report is (``control``: its folder, as
    :attr:`RunReport.control`; by default where an output without placeholders keeps it)."""
    why = list(d.get("failure_reasons") or []) or list(d.get("warnings") or [])
    text = f"run {d.get('run_id')} {d.get('status')}"
    if why:
        text += ": " + "; ".join(why[:3]) + (f" (and {len(why) - 3} more)" if len(why) > 3 else "")
    return f"{text} (report: {control_uri(d, control)}/{REPORT_NAME})"


def control_uri(d: Mapping[str, Any], control: str | None = None) -> str:
    """The folder of a run's ``_report.json``, ``_report.html`` and manifest: ``control`` (as
    :attr:`RunReport.control`) when known, else where an output without placeholders keeps it
    (:func:`pipeline.layout.beside`; the output itself at a bucket root)."""
    if control is None:
        out = str(d.get("output"))
        control = layout.beside(out, layout.CONTROL_DIR) or out
    return control.rstrip("/")


def _grouped_errors(d: Mapping[str, Any], errors: list[dict[str, Any]]) -> list[str]:
    """``[kind] message`` per error; shards failing with the same message (once its shard is
    taken out) are one line naming a few of them, not one line each."""
    rel = {s.get("input"): s.get("rel_path") for s in d.get("shards") or []}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for e in errors:
        shard, message = str(e.get("shard")), str(e.get("message"))
        general = message.replace(f"shard {shard}: ", "").replace(shard, "<shard>")
        groups.setdefault((str(e.get("kind")), general), []).append(e)
    out = []
    for (kind, general), group in groups.items():
        if len(group) == 1:
            out.append(f"[{kind}] {group[0].get('message')}")
            continue
        names = [str(rel.get(e.get("shard")) or e.get("shard")) for e in group]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        out.append(f"[{kind}] {len(group)} shards ({', '.join(names[:3])}{more}): {general}")
    return out


def summary_table(report: RunReport, *, max_shards: int = 20) -> str:
    """A short human summary of the run for the terminal (and cron's mail).

    For a run that failed, was interrupted or lost shards or rows within its budget, why comes
    first (:func:`why_lines`), right under the status line: cron's mail is read from the top.
    """
    d = report.data
    lines = [f"score-catalog run {d['run_id']}: {str(d['status']).upper()}", *why_lines(d)]
    lines += [
        f"  job       {d['job']}",
        f"  model     {d['model']['name']} v{d['model']['version']} ({d['model']['sha256'][:12]}) "
        f"on {d['device']}, batch {d['batch_size']}",
        f"  output    {d['output']}",
        f"  report    {control_uri(d, report.control)}/{HTML_NAME}",
        f"  shards    {d['shards_total']} total: {d['shards_scored']} scored, "
        f"{d['shards_skipped']} skipped (already done), {d['shards_failed']} failed"
        + (f", {d['shards_not_scored']} not scored" if d.get("shards_not_scored") else ""),
        f"  rows      {_fmt_int(d['rows_in'])} in, {_fmt_int(d['rows_out'])} scored, "
        f"{_fmt_int(d['rows_rejected'])} rejected",
    ]
    if d.get("rows_rejected") and d.get("rejects"):
        # Only where there are some: rejects are written for the shards that had any, so a
        # clean night's folder does not exist, and its summary stays as short as before.
        lines.append(f"  rejects   {d['rejects']}")
    lines += [
        f"  speed     {d['rows_per_s']:,.0f} rows/s over {d['rows_processed']:,} rows scored in "
        f"{d['duration_s']:.1f}s",
    ]
    reg = d["model"].get("registry")
    if reg:
        alias = f" (alias {reg['alias']})" if reg["alias"] else ""
        lines.insert(3, f"  registry  models:/{reg['name']}/{reg['version']}{alias}")
    lat = d["batch_latency_ms"]
    if lat["p50"] is not None:
        lines.append(
            f"  batch ms  p50 {lat['p50']:.2f}  p95 {lat['p95']:.2f}  p99 {lat['p99']:.2f}"
        )
    verdict = d.get("verdict") or {}
    if verdict.get("reused") and (d.get("drift") or {}).get("alert"):
        lines.append(
            f"  drift     the verdict of run {verdict['judged_by']}: the data is unchanged since"
        )
    lines += _shard_lines(d["shards"], max_shards)
    for warning in d.get("warnings", []):
        lines.append(f"  WARNING {warning}")
    removed = d.get("removed_outputs", [])
    for r in removed[:MAX_LISTED]:
        lines.append(f"  REMOVED {r['output']}: {r['reason']}")
    if len(removed) > MAX_LISTED:
        lines.append(f"  ... {len(removed) - MAX_LISTED} more removals in {REPORT_NAME}")
    return "\n".join(lines)


def _shard_lines(shards: list[dict[str, Any]], max_shards: int) -> list[str]:
    """The per-shard table (the first ``max_shards`` shards)."""
    if not shards:
        return []
    w = max(len("shard"), *(len(s["rel_path"]) for s in shards[:max_shards]))
    lines = [
        "",
        f"  {'shard':<{w}}  {'status':<8} {'rows in':>10} {'scored':>10} "
        f"{'rejected':>9} {'rows/s':>11}",
    ]
    for s in shards[:max_shards]:
        rate = f"{s['rows_per_s']:,.0f}" if s["status"] == "scored" else "-"
        # A shard the run never got to is not a failure of its data (shards_not_scored).
        status = "not scored" if s.get("kind") in NOT_SCORED_KINDS else s["status"]
        lines.append(
            f"  {s['rel_path']:<{w}}  {status:<8} {_fmt_int(s['rows_in']):>10} "
            f"{_fmt_int(s['rows_out']):>10} {_fmt_int(s['rows_rejected']):>9} {rate:>11}"
        )
    if len(shards) > max_shards:
        lines.append(f"  ... {len(shards) - max_shards} more shards in {REPORT_NAME}")
    return lines


def load_report(uri: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``_report.json`` of a run: ``uri`` is its output root, its control folder or the
    report file itself.

    Nothing there, or something that is not a run report, is a :class:`UsageError` (exit 2)
    saying what to give instead.
    """
    return find_report(uri, options).data


def find_report(uri: str, options: Mapping[str, Any] | None = None) -> RunReport:
    """:func:`load_report`, with the folder it was found in as the report's ``control`` (where
    its ``_report.html`` is too), so that what is printed names the real place."""
    import json

    from pipeline import layout, storage
    from pipeline.errors import UsageError

    given = storage.locate(uri, options)
    hint = (
        f"give a run's output root (its {REPORT_NAME} is in the control folder beside the "
        "output template's fixed part, e.g. data/_score_catalog/scored/run_date=X/ for "
        "data/scored/run_date=X, written when a run ends) or the report file"
    )
    where = ""
    try:
        loc = given
        if not given.path.endswith(".json"):
            # The output's control folder (pipeline.layout: beside its template's root, which
            # is the output itself or a folder above it), an older layout's, or the control
            # folder given directly.
            loc = layout.find(given, REPORT_NAME) or given.child(REPORT_NAME)
        data = storage.read_json(loc)
    except NotADirectoryError:
        loc, data, where = given, None, "is a file, not a run's output folder"
    except IsADirectoryError:
        loc, data, where = given, None, "is a folder, not a report file"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{loc.uri} is not a run report (not JSON: {e}); {hint}") from e
    if data is None:
        if not where:
            where = "does not exist" if not storage.exists(given) else f"has no {REPORT_NAME}"
        raise UsageError(f"no run report at {given.uri}: it {where}; {hint}")
    if not isinstance(data, dict) or "run_id" not in data:
        raise UsageError(f"{loc.uri} is not a run report (no run_id); {hint}")
    return RunReport(data, control=loc.uri.rsplit("/", 1)[0])


def _num(v: Any, fmt: str = ",.0f") -> str:
    return "-" if v is None else format(v, fmt)


#: Beyond this many times the other run's value, ``report --vs`` prints a capped ratio.
MAX_RATIO = 1_000_000


def change(now: Any, then: Any, fmt: str = ",.0f", *, relative: bool = True) -> str:
    """How ``now`` differs from ``then`` in the ``change`` column of ``report --vs``.

    ``relative`` (counts, rates, durations, which are never negative): a percentage of ``then``
    up to +999.9%, then a ratio (``12x``, at most ``>1,000,000x``); where ``then`` is 0 (no rows
    rejected in the other run) the plain difference (``+250``): no percentage of nothing means
    anything. Otherwise (score quantiles) the difference on the score's own scale
    (``+0.0123``): a score's relative change is noise near 0, where a p05 of 2e-16 against 0.08
    printed ``+402501073323306.0%``. ``-`` when either side is missing or not finite.
    """
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (now, then)):
        return "-"
    if not relative or then <= 0 or now < 0:
        return format(now - then, "+" + fmt)
    ratio = now / then
    if ratio > MAX_RATIO:
        return f">{MAX_RATIO:,}x"
    if ratio - 1 >= 10:  # +1000% and more reads better as "11x"
        return f"{ratio:,.0f}x"
    return f"{(ratio - 1) * 100:+.1f}%"


def diff_table(current: dict[str, Any], other: dict[str, Any]) -> str:
    """Two runs side by side: counts, throughput, score quantiles and drift of ``current``."""
    a, b = current, other
    lines = [
        f"score-catalog report: {a['run_id']} vs {b['run_id']}",
        f"  {'':<22} {'this run':>22} {'other run':>22} {'change':>10}",
    ]

    def row(label: str, x: Any, y: Any, fmt: str = ",.0f", *, relative: bool = True) -> None:
        diff = change(x, y, fmt, relative=relative)
        lines.append(f"  {label:<22} {_num(x, fmt):>22} {_num(y, fmt):>22} {diff:>10}")

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
            row(f"{col} {q}", qa.get(q), qb.get(q), ".4f", relative=False)
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
