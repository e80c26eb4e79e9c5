"""After the last shard: drift against the previous success, the HTML page, the run index, metrics.

Each of these is a view or a record on top of ``_report.json``: a failure here is logged and
never fails a run whose shards are committed.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from pipeline import drift as drift_mod
from pipeline import runindex, storage
from pipeline.config import JobConfig
from pipeline.errors import ConfigError, PipelineError
from pipeline.execution import not_scored
from pipeline.html_report import render_html
from pipeline.locking import LockLostError
from pipeline.reconcile import Reconciliation, Wanted, reconcile, verify, wanted
from pipeline.report import HTML_NAME, REPORT_NAME, RunFacts, RunReport, build_report, model_section
from pipeline.reportschema import DriftComparison, ReportData
from pipeline.statuses import FailureKind, RunStatus
from pipeline.storage import SUCCESS_NAME, Location, ShardRef

if TYPE_CHECKING:
    from pipeline.run import ScoringRun
    from pipeline.scoring import ShardResult

logger = logging.getLogger(__name__)


def add_drift(config: JobConfig, data: dict[str, Any], index_root: str) -> None:
    """Compare with the previous success; a drift alert turns a success into a warning.

    It does so from ``succeeded_with_errors`` too (rejects or failed shards within the budget):
    the status alone gives the exit code (4 here), and scores that drifted need a look before
    anyone uses them, which a 0 would hide. The rejects and failed shards stay in the report
    (``errors``, ``rows_rejected``, ``shards_failed``).
    """
    if not config.monitoring.drift or data["status"] in (RunStatus.FAILED, RunStatus.INTERRUPTED):
        return
    data["drift"] = drift_section(config, data, index_root)
    if data["drift"].get("alert"):
        data["status"] = RunStatus.SUCCEEDED_WITH_WARNINGS
    for reason in data["drift"].get("reasons", []):
        data["warnings"].append(f"drift: {reason}")
        logger.warning("drift: %s", reason)


def drift_section(
    config: JobConfig, data: dict[str, Any], index_root: str
) -> DriftComparison | dict[str, Any]:
    """Compare this run's scores with the previous successful run of the same job."""
    if not data["rows_processed"]:
        # A resume that found every shard done scored nothing: no distribution to compare.
        return {"baseline": None, "note": "this run scored no rows (every shard was done)"}
    try:
        # The index entry carries the run's sketches: its _report.json may have been replaced
        # since by a later run into the same output (a resume, a rerun of that night).
        baseline = runindex.previous_success(
            index_root,
            config.storage,
            config.name,
            exclude_run_id=data["run_id"],
            scored_only=True,
        )
    except Exception as e:  # drift is a check on top of a finished run: never fail it
        logger.warning("could not read the run index at %s: %s", index_root, e)
        return {"baseline": None, "note": f"run index unreadable: {e}"}
    if baseline is None:
        return {
            "baseline": None,
            "note": f"no previous successful run of job {config.name!r} in {index_root}/_runs",
        }
    m = config.monitoring
    thresholds = drift_mod.DriftThresholds(
        psi=m.psi_threshold, ks=m.ks_threshold, rows_change=m.rows_change_threshold
    )
    return drift_mod.compare(baseline, data, thresholds)


def write_html(control: Location, data: dict[str, Any]) -> None:
    """``_report.html`` beside the JSON report (in the output's control folder); a rendering
    error is logged, not raised."""
    try:
        page = render_html(cast(ReportData, data))
    except Exception as e:  # the JSON report is the record; the page is a view of it
        logger.warning("could not render %s: %s", HTML_NAME, e)
        return
    storage.write_bytes(control.child(HTML_NAME), page.encode("utf-8"), point="html-rename")


_INDEX_KEYS = (
    "run_id",
    "job",
    "status",
    "started_at",
    "finished_at",
    "rows_out",
    "rows_processed",
    "output",
)


def record_run(config: JobConfig, index_root: str, control: Location, data: dict[str, Any]) -> None:
    """Add the run to the job's run index (with its score sketches, the next drift baseline)."""
    entry = {key: data[key] for key in _INDEX_KEYS}
    entry["report"] = control.child(REPORT_NAME).uri
    entry["outputs"] = {
        col: {"count": v.get("count"), "sketch": v.get("sketch")}
        for col, v in (data.get("outputs") or {}).items()
    }
    try:
        runindex.record(index_root, config.storage, config.name, entry)
    except Exception as e:
        logger.warning("could not record the run in the index at %s: %s", index_root, e)


def failed_summary(
    config: JobConfig,
    started_at: dt.datetime,
    duration: float,
    e: BaseException,
    status: RunStatus = RunStatus.FAILED,
) -> dict[str, Any]:
    """What the metrics say about a run that ended without a report: stopped before scoring
    (exit 2 or 3), an error where no report could be written, or a second signal (aborted)."""
    return {
        "job": config.name,
        "status": status,
        "started_at": started_at.isoformat(),
        "finished_at": (started_at + dt.timedelta(seconds=duration)).isoformat(),
        "duration_s": duration,
        "rows_out": 0,
        "rows_rejected": 0,
        "shards_failed": 0,
        "shards_not_scored": 0,
        "rows_processed": 0,
        "rows_per_s": None,  # nothing was scored: no throughput
        "drift": None,
        "error": describe(e),
    }


def describe(e: BaseException) -> str:
    """One line naming what went wrong and where: our errors say it; others get their type
    (``NotADirectoryError: [Errno 20] Not a directory: '/data/out/x.parquet'``)."""
    if isinstance(e, PipelineError):
        return str(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def publish_metrics(config: JobConfig, data: dict[str, Any]) -> None:
    """The run's outcome to the metrics file and the Pushgateway, when configured.

    Never raises: the run is over, and an error here must not hide how it ended.
    """
    if config.metrics_file is None and config.pushgateway is None:
        return
    try:
        _publish(config, data)
    except Exception as e:
        logger.error("could not publish the run's metrics: %s", describe(e))


def _publish(config: JobConfig, data: dict[str, Any]) -> None:
    from pipeline import metrics

    previous = None
    if config.metrics_file is not None:
        previous = metrics.previous_success_timestamp(config.metrics_file, config.name)
        try:
            metrics.write_metrics_file(config.metrics_file, data, previous_success_ts=previous)
        except PipelineError as e:
            logger.error("%s", e)
    if config.pushgateway is not None:
        if previous is None and data.get("status") == RunStatus.FAILED:
            previous = last_success_from_index(config)
        try:
            metrics.push_metrics(config.pushgateway, data, previous_success_ts=previous)
        except PipelineError as e:
            logger.error("%s", e)


def last_success_from_index(config: JobConfig) -> float | None:
    """When the last success finished, from the run index (a push replaces the whole group)."""
    try:
        entry = runindex.previous_success(
            runindex.index_root(config.output), config.storage, config.name
        )
        if entry is None:
            return None
        return dt.datetime.fromisoformat(str(entry["finished_at"])).timestamp()
    except Exception as e:  # metrics are best effort once the run is over
        logger.warning("could not read the last success from the run index: %s", e)
        return None


# -- the finish phase of a ScoringRun ------------------------------------------------------------


def finish_run(run: ScoringRun) -> RunReport:
    """Reconcile the output, account, judge against the error budget, report, check what
    readers see against the report, and mark success last."""
    ordered = [run.results[s.rel_path] for s in run.shards]
    want = wanted(ordered)
    lock = run.lock_
    assert lock is not None
    lock.assert_held()  # the fence: reconciling deletes from the output
    settled = _reconcile(run, want)
    data = build_report(run_facts(run), ordered, run.fatal, time.perf_counter() - run.t0)
    if any(r.kind == FailureKind.INTERRUPTED for r in ordered):
        data["status"] = RunStatus.INTERRUPTED
        data["failure_reasons"] = [run.stop.reason, *data["failure_reasons"]]
    data["removed_outputs"] = [r.public() for r in (*run.cleared, *settled.removed)]
    data["foreign_removed"] = list(run.foreign.removed)
    data["foreign_kept"] = sorted(
        {*run.foreign.kept, *(run.out_root.child(rel).uri for rel in settled.foreign)}
    )
    for uri in data["foreign_kept"]:
        # Not scores, so _SUCCESS still holds; but readers of the folder trip over it.
        warning = (
            f"{uri} is in the output and score-catalog did not write it: it is left alone, but "
            "pyarrow.dataset and pandas.read_parquet on the output folder read every visible "
            "file and fail on it; move it out, or give it a name starting with _ or ."
        )
        logger.warning("%s", warning)
        data["warnings"].append(warning)
    _verify(run, data, want)
    index_root = runindex.index_root(run.config.output)
    add_drift(run.config, data, index_root)
    report = RunReport(data)
    lock.assert_held()  # the fence, before each commit
    storage.write_json(run.control.child(REPORT_NAME), data, point="report-rename")
    lock.assert_held()
    write_html(run.control, data)
    record_run(run.config, index_root, run.control, data)
    if report.status not in (RunStatus.FAILED, RunStatus.INTERRUPTED):
        lock.assert_held()
        storage.write_bytes(run.out_root.child(SUCCESS_NAME), b"", point="success-rename")
    return report


def _reconcile(run: ScoringRun, want: Wanted) -> Reconciliation:
    """Take out of the output what this run does not vouch for (gone inputs, failed and
    schema-skipped shards), with their rejects and manifest entries."""
    manifest = run.manifest
    assert manifest is not None
    ours = run.previous_outputs | set(manifest.shards)
    settled = reconcile(
        run.out_root, run.rej_root, want.keep, ours, want.reasons, run.config.storage
    )
    for rel in set(manifest.shards) - want.keep:
        manifest.forget(rel)
    manifest.flush()
    return settled


def _verify(run: ScoringRun, data: dict[str, Any], want: Wanted) -> None:
    """Fail a run whose visible output differs from its report: no ``_SUCCESS`` then."""
    if data["status"] in (RunStatus.FAILED, RunStatus.INTERRUPTED):
        return  # no _SUCCESS anyway; spare a failing or stopping run the footer reads
    expected = {rel: run.expected(rel, rows) for rel, rows in want.rows.items()}
    problems = verify(run.out_root, expected, run.config.storage)
    if problems:
        for p in problems:
            logger.error("%s", p)
        data["status"] = RunStatus.FAILED
        data["failure_reasons"] = [*data["failure_reasons"], *problems]


def report_failure(run: ScoringRun, e: Exception) -> dict[str, Any] | None:
    """A failed ``_report.json`` for an error after planning, where it can be written.

    Only while the run holds the output's lock (a run refused the lock, or one that lost it,
    writes nothing there). Best effort: a failure to write it is logged. Returns the report
    (for the metrics), or None when none was built.
    """
    if run.lock_ is None or isinstance(e, LockLostError):
        return None
    on_storage = storage.is_storage_failure(e)
    why = describe(e) if on_storage else f"unexpected error: {describe(e)}"
    if on_storage and not why.startswith("storage failure: "):
        why = f"storage failure: {why}"
    data: dict[str, Any] | None = None
    try:
        ordered = [_unfinished(run, s, why) for s in run.shards]
        data = build_report(run_facts(run), ordered, None, time.perf_counter() - run.t0)
        data["status"] = RunStatus.FAILED
        data["failure_reasons"] = [why, *data["failure_reasons"]]
        if on_storage:
            # The failure kind `storage` for programs, where no shard's result carries it
            # (writing the manifest, the report, the lock): `shard` names the location.
            where = getattr(e, "uri", None) or getattr(e, "filename", None) or run.out_root.uri
            entry = {"shard": str(where), "kind": FailureKind.STORAGE, "message": describe(e)}
            data["errors"] = [entry, *data["errors"]]
        # Nothing was reconciled (the run stopped before); what was cleared before scoring is.
        data["removed_outputs"] = [r.public() for r in run.cleared]
        for key in ("foreign_removed", "foreign_kept"):
            data.setdefault(key, [])
        run.lock_.assert_held()
        storage.write_json(run.control.child(REPORT_NAME), data, point="report-rename")
        write_html(run.control, data)
    except Exception as report_error:
        logger.error("could not write the report: %s", describe(report_error))
    return data


def log_cleanup_error(step: Callable[[], None], what: str) -> None:
    """Run a clean-up ``step``; its error is logged, never raised (it would hide the run's)."""
    try:
        step()
    except Exception as e:
        logger.warning("error while %s: %s", what, describe(e))


def run_facts(run: ScoringRun) -> RunFacts:
    """What the report says about the run itself (identity, locations, model, settings)."""
    config = run.config
    assert run.lock_ is not None
    return RunFacts(
        run_id=run.run_id,
        job=config.name,
        started_at=run.started_at,
        input=storage.locate(config.input_uri(), config.storage).uri,
        output=run.out_root.uri,
        rejects=run.rej_root.uri,
        id_column=config.id_column,
        error_budget=config.errors,
        model=model_section(run.source.uri, run.model, run.source.report()),
        device=str(run.device),
        threads=run.plan.public(),
        settings=run.settings.values,
        batch_size=run.execution.batch_size,
        execution=run.execution.report,
        lock_taken_over=run.lock_.took_over,
    )


def _unfinished(run: ScoringRun, s: ShardRef, why: str) -> ShardResult:
    """``s``'s result so far, or one saying it was not scored because of ``why``."""
    if s.rel_path in run.results:
        return run.results[s.rel_path]
    info = run.found.infos.get(s.rel_path)
    rows = info.num_rows if info is not None else None
    return not_scored(s.rel_path, s.uri, rows, FailureKind.CANCELLED, why)


def check_metrics_file(config: JobConfig) -> None:
    """Refuse a metrics file that is a folder, or whose folder does not exist, before the run
    starts."""
    if config.metrics_file is None:
        return
    if os.path.isdir(config.metrics_file):
        raise ConfigError(
            f"metrics_file = {config.metrics_file!r} is a folder; give a file in it, e.g. "
            f"{os.path.join(config.metrics_file, 'score_catalog.prom')}"
        )
    parent = os.path.dirname(os.path.abspath(config.metrics_file))
    if not os.path.isdir(parent):
        raise ConfigError(
            f"metrics_file = {config.metrics_file!r}: directory {parent} does not exist "
            "(point it at node_exporter's --collector.textfile.directory)"
        )
