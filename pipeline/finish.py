"""After the last shard: the run's status, decided once; the dataset's drift verdict, the HTML
page, the report, ``_SUCCESS``, the run index and the metrics.

The status in ``_report.json``, the metrics and the exit code always agree: the status is set in
one place (:func:`decide`); the report is written after everything that could still change it
(``_SUCCESS`` alone comes after); a failure while committing rewrites what was already written
as failed (:func:`_retract`).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from pipeline import runindex, storage
from pipeline import verdict as verdict_mod
from pipeline.config import JobConfig
from pipeline.errors import ConfigError, PipelineError, StorageError
from pipeline.execution import not_scored
from pipeline.faults import checkpoint
from pipeline.html_report import render_html
from pipeline.locking import LockLostError
from pipeline.reconcile import Reconciliation, Wanted, gone_reasons, reconcile, verify, wanted
from pipeline.report import HTML_NAME, REPORT_NAME, RunFacts, RunReport, build_report, model_section
from pipeline.reportschema import ReportData
from pipeline.statuses import SUCCESS_STATUSES, FailureKind, RunStatus
from pipeline.storage import SUCCESS_NAME, Location, ShardRef

if TYPE_CHECKING:
    from pipeline.run import ScoringRun
    from pipeline.scoring import ShardResult

logger = logging.getLogger(__name__)


def write_html(control: Location, data: dict[str, Any]) -> None:
    """``_report.html`` beside the JSON report (in the output's control folder); a rendering
    error is logged, not raised."""
    try:
        page = render_html(cast(ReportData, data))
    except Exception as e:  # the JSON report is the record; the page is a view of it
        logger.warning("could not render %s: %s", HTML_NAME, e)
        return
    loc = control.child(HTML_NAME)
    naming(loc, lambda: storage.write_bytes(loc, page.encode("utf-8"), point="html-rename"))


def write_report(control: Location, data: dict[str, Any]) -> None:
    """``_report.json`` in the output's control folder."""
    loc = control.child(REPORT_NAME)
    naming(loc, lambda: storage.write_json(loc, data, point="report-rename"))


def naming(loc: Location, write: Callable[[], None]) -> None:
    """Run ``write``; an OS error that does not name its file (``[Errno 28] No space left on
    device`` from a write or an fsync) becomes a :class:`StorageError` naming ``loc``."""
    try:
        write()
    except OSError as e:
        if e.filename:
            raise
        raise StorageError(f"could not write {loc.uri}: {describe(e)}") from e


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


def record_run(
    config: JobConfig, index_root: str, control: Location, data: dict[str, Any]
) -> str | None:
    """Add the run to the job's run index (with its score sketches, the next drift baseline).

    Returns a warning when it could not (the index is a record on top of the run: a failure
    to write it does not fail the run), else None. Recording the same run again replaces its
    entry.
    """
    entry = {key: data[key] for key in _INDEX_KEYS}
    entry["report"] = control.child(REPORT_NAME).uri
    verdict = data.get("verdict")
    if verdict:
        # The drift baseline of later runs skips this dataset (pipeline.verdict).
        entry["dataset"] = verdict["dataset"]
        entry["verdict"] = verdict
    entry["outputs"] = {
        col: {"count": v.get("count"), "sketch": v.get("sketch")}
        for col, v in (data.get("outputs") or {}).items()
    }
    try:
        runindex.record(index_root, config.storage, config.name, entry)
    except Exception as e:
        warning = f"could not record the run in the index at {index_root}: {describe(e)}"
        logger.warning("%s", warning)
        return warning
    return None


def failed_summary(
    job: str,
    started_at: dt.datetime,
    duration: float,
    e: BaseException,
    status: RunStatus = RunStatus.FAILED,
) -> dict[str, Any]:
    """What the metrics say about a run that ended without a report: stopped before scoring
    (exit 2 or 3), an error where no report could be written, or a second signal (aborted)."""
    from pipeline import metrics

    return metrics.failure_summary(job, started_at, duration, describe(e), status)


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
    publish(config.metrics_file, config.pushgateway, data, lambda: last_success_from_index(config))


def publish(
    metrics_file: str | None,
    pushgateway: str | None,
    data: dict[str, Any],
    last_success: Callable[[], float | None] | None = None,
) -> None:
    """:func:`pipeline.metrics.publish` (never raises)."""
    if metrics_file is None and pushgateway is None:
        return
    from pipeline import metrics

    metrics.publish(metrics_file, pushgateway, data, last_success)


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
    """Reconcile the output, account, decide the run's status once (:func:`decide`), then
    commit: the manifest with the dataset's verdict, the run-index entry, ``_report.html``,
    ``_report.json`` and ``_SUCCESS`` last.

    A failure while committing (a full disk, a read-only control folder) turns the run into a
    failed one before the error goes up: the report, if written, is rewritten as failed, or
    removed where that fails too (:func:`_retract`), so that the report, the metrics (from
    ``run.failure_data``) and the exit code agree.
    """
    ordered = [run.results[s.rel_path] for s in run.shards]
    want = wanted(ordered)
    lock = run.lock_
    assert lock is not None
    lock.assert_held()  # the fence: reconciling deletes from the output
    settled = _reconcile(run, want)
    data = build_report(run_facts(run), ordered, run.fatal, time.perf_counter() - run.t0)
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
    record = decide(run, data, want, ordered)
    checkpoint("judged")
    try:
        _commit(run, data, record)
    except Exception as e:
        _retract(run, data, e)
        raise
    return RunReport(data)


def decide(
    run: ScoringRun, data: dict[str, Any], want: Wanted, ordered: list[ShardResult]
) -> dict[str, Any] | None:
    """Set the run's ``status`` (and its reasons, drift, verdict and warnings), once.

    In order: a requested stop (SIGTERM, SIGINT) makes it ``interrupted``, even when every
    shard in flight finished (the run was asked to stop; a rerun commits what is left); the
    error budget (:func:`pipeline.report.build_report`) or an output that does not match the
    report (:func:`_verify`) makes it ``failed``; an open drift alert on the dataset makes a
    success ``succeeded_with_warnings`` (:func:`pipeline.verdict.judge`). Returns the verdict
    record to keep with the manifest (None for a run that did not succeed).
    """
    if run.stop.requested or any(r.kind == FailureKind.INTERRUPTED for r in ordered):
        data["status"] = RunStatus.INTERRUPTED
        reasons = [run.stop.reason]
        if not any(r.kind == FailureKind.INTERRUPTED for r in ordered):
            reasons.append(
                "every shard in flight finished before the run stopped, but the output is not "
                "committed (no _SUCCESS); a rerun commits it without scoring them again"
            )
        data["failure_reasons"] = [*reasons, *data["failure_reasons"]]
        return None
    if data["status"] == RunStatus.FAILED:
        return None
    _verify(run, data, want)
    if data["status"] == RunStatus.FAILED:
        return None
    assert run.manifest is not None
    index_root = runindex.index_root(run.config.output)
    found = verdict_mod.judge(run.config, data, run.manifest, index_root)
    data["drift"], data["verdict"] = found.drift, found.verdict
    for warning in found.warnings:
        logger.warning("%s", warning)
    data["warnings"].extend(found.warnings)
    if found.alert_open:
        # From succeeded_with_errors too (rejects or failed shards within the budget): the
        # status alone gives the exit code (4 here), and scores that drifted need a look
        # before anyone uses them, which a 0 would hide. The rejects and failed shards stay in
        # the report (errors, rows_rejected, shards_failed).
        data["status"] = RunStatus.SUCCEEDED_WITH_WARNINGS
    return found.record


def _commit(run: ScoringRun, data: dict[str, Any], record: dict[str, Any] | None) -> None:
    """Write what the run decided: the manifest (with the verdict), the run-index entry, the
    page, the report, and ``_SUCCESS`` last."""
    lock, manifest = run.lock_, run.manifest
    assert lock is not None and manifest is not None
    if record is not None:
        manifest.set_verdict(record)
    manifest.flush()  # fenced; an error names the file
    _record(run, data, warn=True)
    lock.assert_held()
    write_html(run.control, data)
    lock.assert_held()
    write_report(run.control, data)
    if data["status"] not in SUCCESS_STATUSES:
        return
    if run.stop.requested:
        # A signal while the report was being written: the run was asked to stop before its
        # output was committed, so it is not (decide() explains why).
        logger.warning("%s arrived before _SUCCESS was written", run.stop.signal_name)
        data["status"] = RunStatus.INTERRUPTED
        data["failure_reasons"] = [run.stop.reason, *data["failure_reasons"]]
        _record(run, data)
        lock.assert_held()
        write_html(run.control, data)
        write_report(run.control, data)
        return
    lock.assert_held()
    success = run.out_root.child(SUCCESS_NAME)
    naming(success, lambda: storage.write_bytes(success, b"", point="success-rename"))


def _record(run: ScoringRun, data: dict[str, Any], *, warn: bool = False) -> bool:
    """The run's entry in the run index (``warn``: a failure becomes a warning of the report);
    whether it was written."""
    index_root = runindex.index_root(run.config.output)
    problem = record_run(run.config, index_root, run.control, data)
    if problem is not None and warn:
        data["warnings"].append(problem)
    return problem is None


def _retract(run: ScoringRun, data: dict[str, Any], e: Exception) -> None:
    """The run failed while committing: say so wherever it already said otherwise.

    ``data`` becomes a failed report (the metrics publish it); where the run-index entry, the
    report or the page were written they are rewritten as failed, or removed when that fails
    too (a full disk still lets a file be deleted), and ``_SUCCESS`` is withdrawn. A run that
    lost its lock touches nothing: the output is another run's now.
    """
    data["status"] = RunStatus.FAILED
    data["failure_reasons"] = [f"could not commit the run: {describe(e)}", *data["failure_reasons"]]
    run.failure_data = data
    if run.lock_ is None or isinstance(e, LockLostError):
        return
    _remove(run.out_root.child(SUCCESS_NAME))
    if not _record(run, data):
        config = run.config
        root = runindex.index_root(config.output)
        log_cleanup_error(
            lambda: runindex.remove(root, config.storage, config.name, run.run_id),
            "removing the run's entry from the run index",
        )
    writers: list[tuple[str, Callable[[Location, dict[str, Any]], None]]] = [
        (REPORT_NAME, write_report),
        (HTML_NAME, write_html),
    ]
    for name, write in writers:
        try:
            run.lock_.assert_held()
            write(run.control, data)
        except Exception as again:
            logger.error(
                "no %s is left: it could not be written as failed (%s)", name, describe(again)
            )
            _remove(run.control.child(name))


def _remove(loc: Location) -> None:
    """Delete ``loc``; an error is logged (a retraction must not hide the run's error)."""
    log_cleanup_error(lambda: storage.remove(loc), f"removing {loc.uri}")


def _reconcile(run: ScoringRun, want: Wanted) -> Reconciliation:
    """Take out of the output what this run does not vouch for (gone inputs, failed and
    schema-skipped shards), with their rejects and manifest entries."""
    manifest = run.manifest
    assert manifest is not None
    ours = run.previous_outputs | set(manifest.shards)
    opts = run.config.storage
    left = ours - want.keep - set(want.reasons)
    input_uri = storage.locate(run.config.input_uri(), opts).uri
    reasons = {**gone_reasons(manifest.shards, left, input_uri, opts), **want.reasons}
    settled = reconcile(run.out_root, run.rej_root, want.keep, ours, reasons, opts)
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
        write_report(run.control, data)
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
        model_warnings=tuple(run.model_warnings),
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
