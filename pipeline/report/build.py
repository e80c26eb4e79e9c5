"""The run report: ``_report.json`` (schema in docs/report.md, versioned) and the CLI summary."""

from __future__ import annotations

import datetime as dt
import functools
import logging
import platform
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from pipeline.core.errors import EXIT_DRIFT, EXIT_OK, EXIT_RUN_FAILED
from pipeline.core.interrupt import exit_code_of
from pipeline.core.statuses import FailureKind, RunStatus, ShardStatus
from pipeline.report.schema import (
    BatchLatency,
    DriftComparison,
    DriftNote,
    ErrorEntry,
    Execution,
    IncrementalSection,
    LockHolderDetails,
    LossyCastEntry,
    ModelInfoWithRegistry,
    OutputFormatSection,
    OutputStats,
    RemovedOutput,
    ReportData,
    ScoringSettingsWithVersion,
    ShardEntry,
    ThreadsInfo,
    ThroughputPoint,
    Verdict,
    Versions,
)
from pipeline.worker import sketch as sketches

if TYPE_CHECKING:  # `score-catalog report` reads reports without importing torch
    from pipeline.core.config import ErrorPolicy
    from pipeline.model.program import LoadedModel
    from pipeline.worker.shard import ShardResult

logger = logging.getLogger(__name__)

# 3: the report is described by a committed JSON Schema (pipeline/schemas); keys as in 2.
# 4: the dataset's drift verdict (``verdict``: pipeline.report.verdict).
SCHEMA_VERSION = 5
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
    # The control folder its _report.json and _report.html were written to (pipeline.io.layout);
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
#: code depends on its signal (:func:`pipeline.core.interrupt.exit_code_of`).
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
    qs = sketches.weighted_quantiles(values, weights, np.asarray(QUANTILES))
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
                m["v"] = [sketches.weighted_quantiles(v, w, levels)]
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
                    entry["sketch"] = sketches.sketch(v, w)
                    if entry["sketch"]:  # a sample may miss the extremes; min and max are exact
                        entry["sketch"][0], entry["sketch"][-1] = entry["min"], entry["max"]
                    entry["histogram"] = sketches.histogram(v, w, bins=HISTOGRAM_BINS)
                    counts = sketches.value_counts(v, w, max_values=DISCRETE_MAX_VALUES)
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
    # Found before scoring and logged then (pipeline.model.oov: unseen values sharing a real id).
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
        for column, lossy in r.stats.lossy_casts.items():
            entry = found.setdefault(
                (column, lossy.from_type),
                {
                    "column": column,
                    "from_type": lossy.from_type,
                    "shards": 0,
                    "example": {
                        "shard": r.rel_path,
                        "value": lossy.value,
                        "as_float32": lossy.as_float32,
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
    """What the error budget says of the shards: succeeded, succeeded with errors (within the
    budget) or failed, and the reasons when failed. One input of the run's status
    (:func:`pipeline.driver.status.decide`), not the status itself."""
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


@dataclass(frozen=True)
class Draft:
    """A run's report before its status is decided: everything the shards and the run's facts
    say, and what the error budget says of them (one input of the decision)."""

    facts: RunFacts
    shards: tuple[ShardResult, ...]
    duration: float
    counts: dict[str, Any]
    errors: tuple[dict[str, Any], ...]
    warnings: tuple[str, ...]
    accounting_ok: bool
    budget: RunStatus  # succeeded, succeeded_with_errors or failed, by the error budget alone
    budget_reasons: tuple[str, ...]

    @property
    def finished_at(self) -> str:
        return (self.facts.started_at + dt.timedelta(seconds=self.duration)).isoformat()

    @functools.cached_property
    def scored(self) -> list[ShardResult]:
        return [r for r in self.shards if r.status == ShardStatus.SCORED]

    @functools.cached_property
    def outputs(self) -> dict[str, dict[str, Any]]:
        """The ``outputs`` section: score statistics over every shard in the output."""
        return output_summary(r for r in self.shards if r.status != ShardStatus.FAILED)

    def current(self) -> dict[str, Any]:
        """The keys of the report the drift judge reads (``pipeline.report.verdict.judge``),
        before the report exists."""
        return {
            "run_id": self.facts.run_id,
            "output": self.facts.output,
            "finished_at": self.finished_at,
            "rows_out": self.counts["rows_out"],
            "rows_processed": self.counts["rows_processed"],
            "outputs": self.outputs,
        }


def draft_report(
    facts: RunFacts, shards: list[ShardResult], fatal: ShardResult | None, duration: float
) -> Draft:
    """The report of a finished run up to its status (see :class:`Draft`)."""
    errors, warnings = _problems(facts, shards)
    counts = _counts(shards)
    accounting_ok = not any(e["kind"] == FailureKind.ACCOUNTING for e in errors)
    budget, reasons = _judge(facts.error_budget, counts, accounting_ok, fatal)
    return Draft(
        facts,
        tuple(shards),
        duration,
        counts,
        tuple(errors),
        tuple(warnings),
        accounting_ok,
        budget,
        tuple(reasons),
    )


def build_report(  # noqa: PLR0913  (keyword-only: the parts of a report the run decides)
    draft: Draft,
    *,
    status: RunStatus,
    failure_reasons: Iterable[str] = (),
    drift: dict[str, Any] | None = None,
    verdict: dict[str, Any] | None = None,
    warnings: Iterable[str] = (),
    removed_outputs: Iterable[RemovedOutput] = (),
    foreign_removed: Iterable[str] = (),
    foreign_kept: Iterable[str] = (),
    output_format: Mapping[str, Any] | None = None,
    incremental: Mapping[str, Any] | None = None,
) -> ReportData:
    """The ``_report.json`` of a finished run: the ``draft`` with the run's ``status`` and
    ``failure_reasons`` (``pipeline.driver.status.decide``), the dataset's ``drift`` and
    ``verdict`` (``pipeline.report.verdict``), further ``warnings`` (after the draft's own),
    what the run took out of the dataset (``removed_outputs``) and the files it did not write
    (``foreign_removed``, ``foreign_kept``), the output format's section, and an incremental
    night's ``incremental`` section (pipeline.driver.incremental; None: not incremental)."""
    facts, shards = draft.facts, list(draft.shards)
    scored = draft.scored
    t0 = facts.started_at.timestamp()
    budget = facts.error_budget
    report: ReportData = {
        "schema_version": SCHEMA_VERSION,
        "run_id": facts.run_id,
        "job": facts.job,
        "status": status,
        "failure_reasons": list(failure_reasons),
        "started_at": facts.started_at.isoformat(),
        "finished_at": draft.finished_at,
        "duration_s": draft.duration,
        "input": facts.input,
        "output": facts.output,
        "rejects": facts.rejects,
        **_count_keys(draft),  # type: ignore[typeddict-item]
        "batch_size": facts.batch_size,
        "execution": cast(Execution, facts.execution),
        "device": facts.device,
        "threads": cast(ThreadsInfo, facts.threads),
        "model": cast(ModelInfoWithRegistry, facts.model),
        "settings": cast(ScoringSettingsWithVersion, facts.settings),
        "error_budget": {
            "max_failed_shards": budget.max_failed_shards,
            "max_rejected_fraction": budget.max_rejected_fraction,
        },
        "lock_taken_over": cast("LockHolderDetails | None", facts.lock_taken_over),
        "oom_splits": sum(r.oom_splits for r in scored),
        # Over the whole output, as rows_out: shards skipped carry their manifest's counts.
        "duplicate_ids": sum(r.duplicate_ids for r in shards if r.status in _IN_OUTPUT),
        "null_ids": sum(r.null_ids for r in shards if r.status in _IN_OUTPUT),
        "versions": cast(Versions, versions()),
        "batch_latency_ms": cast(BatchLatency, latency_summary(scored)),
        "outputs": cast(dict[str, OutputStats], draft.outputs),
        "rejects_by_reason": _rejects_by_reason(shards),
        "throughput": cast(list[ThroughputPoint], _throughput(scored, t0)),
        "drift": cast("DriftComparison | DriftNote | None", drift),
        # The drift verdict on the dataset (pipeline.report.verdict).
        "verdict": cast("Verdict | None", verdict),
        "errors": cast(list[ErrorEntry], list(draft.errors)),
        "warnings": [*draft.warnings, *warnings],
        "lossy_casts": cast(list[LossyCastEntry], lossy_cast_entries(scored)),
        "removed_outputs": list(removed_outputs),
        "foreign_removed": list(foreign_removed),
        "foreign_kept": list(foreign_kept),
        "shards": cast(list[ShardEntry], [_shard_entry(r, t0) for r in shards]),
    }
    if output_format is not None:
        report["output_format"] = cast(OutputFormatSection, dict(output_format))
    report["incremental"] = cast(
        "IncrementalSection | None", dict(incremental) if incremental is not None else None
    )
    return report


def _count_keys(draft: Draft) -> dict[str, Any]:
    """The report's row and shard counts, and the run's speed over the rows it scored."""
    counts, duration = draft.counts, draft.duration
    processed = counts["rows_processed"]
    return {
        "rows_in": counts["rows_in"],
        "rows_out": counts["rows_out"],
        "rows_rejected": counts["rows_rejected"],
        "rows_processed": processed,
        "rows_per_s": processed / duration if duration > 0 else 0.0,
        "rejected_fraction": counts["rejected_fraction"],
        "accounting_ok": draft.accounting_ok,
        **{
            k: counts[k]
            for k in ("shards_total", "shards_scored", "shards_skipped", "shards_failed")
        },
        "shards_not_scored": counts["shards_not_scored"],
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
