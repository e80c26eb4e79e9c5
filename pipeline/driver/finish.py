"""The finish phase: reconcile the output, decide the run's status once, then commit.

:func:`conclude` takes the phases' values (never the run object): it takes out of the output
what the run does not vouch for, drafts the report, checks what readers see against it, judges
the dataset's drift, and decides the status (:func:`pipeline.driver.status.decide`) into the
typed report. :func:`commit` writes what was decided: the manifest with the dataset's verdict,
the run-index entry, ``_report.html``, ``_report.json``, and ``_SUCCESS`` last. A failure while
committing turns the run into a failed one before the error goes up (:func:`retract`); an error
before the finish gets a failed report too, where one can be written (:func:`report_failure`).
So the report, the metrics and the exit code always agree.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from pipeline.core import retries
from pipeline.core.errors import (
    StorageError,
    describe,
    landed_of,
    log_cleanup_error,
    mark_landed,
)
from pipeline.core.faults import checkpoint
from pipeline.core.interrupt import StopRequest
from pipeline.core.statuses import SUCCESS_STATUSES, FailureKind, ShardStatus
from pipeline.driver import incremental
from pipeline.driver.dispatch import not_scored
from pipeline.driver.phases import Locked, Prepared, Scored
from pipeline.driver.reconcile import Wanted, gone_reasons, wanted
from pipeline.driver.status import Decision, Findings, decide, may_succeed
from pipeline.io import runindex, storage
from pipeline.io.layout import HTML_NAME, REPORT_NAME, SUCCESS_NAME
from pipeline.io.locking import LockLostError, RunLock
from pipeline.io.storage import Location
from pipeline.report import verdict as verdicts
from pipeline.report.build import Draft, RunReport, build_report, draft_report
from pipeline.report.html import render_html
from pipeline.report.schema import ErrorEntry, OutputFormatSection, RemovedOutput, ReportData
from pipeline.sinks.base import Committed, Outcome, Removal, WritePlan
from pipeline.worker.shard import ShardResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Concluded:
    """The run's report with its status decided, and what :func:`commit` writes with it."""

    draft: Draft
    findings: Findings
    report: ReportData
    record: dict[str, Any] | None  # the dataset's verdict, kept with the manifest (a success)
    plan: WritePlan  # what the commit takes out of the visible dataset (pipeline.sinks.base)


@dataclass(frozen=True)
class Failure:
    """A failed run's report, for the metrics, and whether ``_report.json`` holds it (the
    run's error line then points at it)."""

    report: ReportData | None
    written: bool = False


def conclude(prepared: Prepared, locked: Locked, scored: Scored, stop: StopRequest) -> Concluded:
    """Reconcile, account, check what readers see, judge drift, and decide the status once."""
    ordered = scored.ordered(prepared)
    want = wanted(ordered)
    locked.lock.assert_held()  # the fence: reconciling deletes from the output
    plan, deleted = _reconcile(prepared, locked, want)
    duration = time.perf_counter() - prepared.t0
    draft = draft_report(prepared.facts(locked.lock), ordered, scored.fatal, duration)
    foreign_kept = sorted(
        {*locked.foreign.kept, *(prepared.output.child(rel).uri for rel in plan.foreign)}
    )
    warnings = [_foreign_warning(uri) for uri in foreign_kept]
    findings = Findings(
        draft.budget,
        draft.budget_reasons,
        stopped=stop.requested,
        stop_reason=stop.reason,
        shards_interrupted=any(r.kind == FailureKind.INTERRUPTED for r in ordered),
    )
    if may_succeed(findings):  # else no _SUCCESS anyway: spare the footer reads
        mismatch = tuple(_mismatch(prepared, locked, plan, want))
        findings = dataclasses.replace(findings, mismatch=mismatch)
    judged = verdicts.Judgement()
    if may_succeed(findings):
        index_root = runindex.index_root(prepared.config.output)
        judged = verdicts.judge(
            prepared.config,
            draft.current(),
            locked.manifest,
            index_root,
            versioned=prepared.sink.places.table,
        )
        for warning in judged.warnings:
            logger.warning("%s", warning)
        findings = dataclasses.replace(findings, drift_alert=judged.alert_open)
    decision = decide(findings)
    night = _incremental(prepared, locked, ordered)
    # A table's removes take effect with its commit: a run that will not commit removed nothing.
    taken = plan.removed if decision.succeeded or not plan.at_commit else ()
    removed = [*locked.cleared, *deleted, *taken]
    report = build_report(
        draft,
        status=decision.status,
        failure_reasons=decision.reasons,
        drift=judged.drift,
        verdict=judged.verdict,
        warnings=[*warnings, *judged.warnings],
        removed_outputs=[_removed(r) for r in removed],
        foreign_removed=locked.foreign.removed,
        foreign_kept=foreign_kept,
        output_format=prepared.sink.section(locked.begun, None).public(),
        incremental=night,
    )
    checkpoint("judged")
    record = judged.record if decision.succeeded else None
    return Concluded(draft, findings, report, record, plan)


def _incremental(
    prepared: Prepared, locked: Locked, ordered: list[ShardResult]
) -> dict[str, Any] | None:
    """The report's ``incremental`` section: what the night carried and scored, and the ids of
    the baseline tonight's input no longer has (counted here, from the input's id columns)."""
    baseline = locked.baseline
    if not baseline.enabled:
        return None
    marked = {r.rel_path for r in ordered if r.status == ShardStatus.SCORED and r.ids_marked}
    unread = [
        s.uri
        for s in prepared.shards
        if s.rel_path not in prepared.failed and s.rel_path not in marked
    ]
    removed = incremental.removed_rows(prepared.config, baseline, unread)
    return incremental.section(baseline, ordered, removed)


def commit(
    prepared: Prepared, locked: Locked, concluded: Concluded, stop: StopRequest
) -> RunReport:
    """Write what the run decided: the manifest (with the verdict), the run-index entry, the
    sink's commit of the run's data, the page, the report, and the sink's seal (``_SUCCESS``)
    last."""
    lock, manifest, report = locked.lock, locked.manifest, concluded.report
    sink = prepared.sink
    if concluded.record is not None:
        manifest.set_verdict(concluded.record)
    manifest.flush()  # fenced; an error names the file
    succeeded = report["status"] in SUCCESS_STATUSES
    if not succeeded or stop.requested:
        _index(prepared, report, warn=True)
        return _not_committed(prepared, locked, concluded, stop, report)
    lock.assert_held()
    # The entry is written inside the commit, once the sink recorded its intent where the next
    # run settles it (a SIGKILL between the entry and a Delta run's pending token left a
    # "succeeded" entry for a commit that never landed: issue 29 review).
    t_commit = time.perf_counter()
    committed = sink.commit(
        locked.begun,
        concluded.plan,
        manifest,
        prepared.run_id,
        record=lambda: _index(prepared, report, warn=True),
    )
    # The commit comes after the report's duration was taken (conclude): its own time, so that
    # a table's cost per night (it grows with the table's history) is on record.
    commit_s = round(time.perf_counter() - t_commit, 4)
    section = {**sink.section(locked.begun, committed).public(), "commit_s": commit_s}
    try:
        report = report.copy()
        report["output_format"] = cast(OutputFormatSection, section)
        _write_report(prepared.control, report, lock)
        if stop.requested and committed.visible:
            # A signal after the commit made the data visible (a table's version): the run
            # stands as committed, and its report says the signal came too late to change it.
            report = report.copy()
            report["warnings"] = [*report["warnings"], _too_late(stop, committed)]
            _write_report(prepared.control, report, lock)
        elif stop.requested:
            return _stopped_before_seal(prepared, concluded, stop, report, lock)
        lock.assert_held()
        _naming(
            prepared.output.child(SUCCESS_NAME),
            lambda: sink.seal(locked.begun, manifest, committed),
        )
    except BaseException as e:
        if committed.made and committed.version is not None:
            mark_landed(e, committed.version, str(section.get("table") or prepared.output.uri))
        raise
    return _run_report(prepared, report)


def _not_committed(
    prepared: Prepared,
    locked: Locked,
    concluded: Concluded,
    stop: StopRequest,
    report: ReportData,
) -> RunReport:
    """A run that failed, or was stopped before its commit: its report, and nothing more."""
    _write_report(prepared.control, report, locked.lock)
    if report["status"] not in SUCCESS_STATUSES:
        return _run_report(prepared, report)
    return _stopped_before_seal(prepared, concluded, stop, report, locked.lock)


def _stopped_before_seal(
    prepared: Prepared,
    concluded: Concluded,
    stop: StopRequest,
    report: ReportData,
    lock: RunLock,
) -> RunReport:
    """A signal while the report was being written: the run was asked to stop before its
    output was committed, so it is not."""
    logger.warning("%s arrived before _SUCCESS was written", stop.signal_name)
    findings = dataclasses.replace(concluded.findings, stopped=True, stop_reason=stop.reason)
    report = _decided(report, decide(findings))
    _index(prepared, report)
    _write_report(prepared.control, report, lock)
    return _run_report(prepared, report)


def _too_late(stop: StopRequest, committed: Committed) -> str:
    """The warning of a run a signal reached after its commit made its data visible: the run
    stands as committed (a table's version cannot be taken back by a stop)."""
    where = f" as version {committed.version}" if committed.version is not None else ""
    warning = (
        f"{stop.signal_name} arrived once the run's commit had begun (it committed{where}): "
        "readers see it, and the run stands as committed"
    )
    logger.warning("%s", warning)
    return warning


def landed_commit(e: BaseException | None) -> str | None:
    """What a run whose table commit landed must say when it fails afterwards (its store died
    before the run recorded it, :func:`~pipeline.core.errors.mark_landed`): readers see its
    scores, and the next run records the commit (its token is still pending). None when the
    run made no such commit."""
    found = landed_of(e)
    if found is None:
        return None
    version, table = found
    return (
        f"its commit landed as version {version} of {table} (readers see this run's scores; "
        "the next run records the commit as recovered and scores nothing again)"
    )


def retract(
    prepared: Prepared,
    locked: Locked,
    concluded: Concluded,
    stop: StopRequest,
    e: Exception,
) -> Failure:
    """The run failed while committing: say so wherever it already said otherwise.

    Returns the failed report (the metrics publish it). Where the run-index entry, the report
    or the page were written they are rewritten as failed, or removed when that fails too (a
    full disk still lets a file be deleted), and ``_SUCCESS`` is withdrawn. A run that lost its
    lock touches nothing: the output is another run's now.
    """
    findings = concluded.findings
    if stop.requested:
        findings = dataclasses.replace(findings, stopped=True, stop_reason=stop.reason)
    landed = landed_commit(e)
    error = (
        f"{landed}, but recording the run failed: {describe(e)}"
        if landed
        else f"could not commit the run: {describe(e)}"
    )
    report = _decided(concluded.report, decide(dataclasses.replace(findings, error=error)))
    section = prepared.sink.section(locked.begun, None).public()
    report["output_format"] = cast(OutputFormatSection, section)
    if isinstance(e, LockLostError):
        return Failure(report)
    log_cleanup_error(prepared.sink.abort, "withdrawing the output's completion")
    if not _index(prepared, report):
        config = prepared.config
        root = runindex.index_root(config.output)
        log_cleanup_error(
            lambda: runindex.remove(root, config.storage, config.name, prepared.run_id),
            "removing the run's entry from the run index",
        )
    writers: list[tuple[str, Callable[[Location, ReportData], None]]] = [
        (REPORT_NAME, write_report),
        (HTML_NAME, write_html),
    ]
    written = []
    for name, write in writers:
        try:
            locked.lock.assert_held()
            write(prepared.control, report)
            written.append(name)
        except Exception as again:
            # A warning: the run's own error line says what failed (one line under -q).
            logger.warning(
                "no %s is left: it could not be written as failed (%s)", name, describe(again)
            )
            _remove(prepared.control.child(name))
    return Failure(report, REPORT_NAME in written)


def report_failure(
    prepared: Prepared,
    lock: RunLock | None,
    cleared: Iterable[Removal],
    results: Mapping[str, ShardResult],
    e: Exception,
) -> Failure:
    """A failed ``_report.json`` for an error after planning, where it can be written.

    Only while the run holds the output's lock (a run refused the lock, or one that lost it,
    writes nothing there). Best effort: a failure to write it is logged. Returns the report
    (for the metrics; None when none was built) and whether it was written.
    """
    if lock is None or isinstance(e, LockLostError):
        return Failure(None)
    on_storage = retries.is_storage_failure(e)
    why = describe(e) if on_storage else f"unexpected error: {describe(e)}"
    if on_storage and not why.startswith("storage failure: "):
        why = f"storage failure: {why}"
    report: ReportData | None = None
    try:
        ordered = [_unfinished(prepared, results, rel, why) for rel in prepared.by_path]
        duration = time.perf_counter() - prepared.t0
        draft = draft_report(prepared.facts(lock), ordered, None, duration)
        decision = decide(Findings(draft.budget, draft.budget_reasons, error=why))
        # Nothing was reconciled (the run stopped before); what was cleared before scoring is.
        report = build_report(
            draft,
            status=decision.status,
            failure_reasons=decision.reasons,
            removed_outputs=[_removed(r) for r in cleared],
        )
        if on_storage:
            # The failure kind `storage` for programs, where no shard's result carries it
            # (writing the manifest, the report, the lock): `shard` names the location.
            where = getattr(e, "uri", None) or getattr(e, "filename", None) or prepared.output.uri
            entry: ErrorEntry = {
                "shard": str(where),
                "kind": FailureKind.STORAGE,
                "message": describe(e),
            }
            report["errors"] = [entry, *report["errors"]]
        lock.assert_held()
        write_report(prepared.control, report)
    except Exception as report_error:
        logger.error("could not write the report: %s", describe(report_error))
        return Failure(report)
    write_html(prepared.control, report)  # logs, never raises
    return Failure(report, written=True)


def storage_failure_before(scored_fatal: ShardResult | None, e: Exception) -> StorageError | None:
    """When a shard's storage failure stopped the run and finishing it then failed on storage
    too (the store is dead: the report cannot be written either), one error that names the
    first failure, the cause, before the one that ended the run."""
    if scored_fatal is None or scored_fatal.kind != FailureKind.STORAGE:
        return None
    if not retries.is_storage_failure(e):
        return None
    return StorageError(
        f"storage failure: {scored_fatal.message} (finishing the run failed too: {describe(e)})",
        uri=getattr(e, "uri", None),
    )


# -- what the finish writes ------------------------------------------------------------------


def write_html(control: Location, data: ReportData) -> None:
    """``_report.html`` beside the JSON report (in the output's control folder); a rendering
    error is logged, not raised."""
    try:
        page = render_html(data)
    except Exception as e:  # the JSON report is the record; the page is a view of it
        logger.warning("could not render %s: %s", HTML_NAME, e)
        return
    loc = control.child(HTML_NAME)
    _naming(loc, lambda: storage.write_bytes(loc, page.encode("utf-8"), point="html-rename"))


def write_report(control: Location, data: ReportData) -> None:
    """``_report.json`` in the output's control folder."""
    loc = control.child(REPORT_NAME)
    _naming(loc, lambda: storage.write_json(loc, data, point="report-rename"))


def _write_report(control: Location, report: ReportData, lock: RunLock) -> None:
    """The page, then the report, each fenced."""
    lock.assert_held()
    write_html(control, report)
    lock.assert_held()
    write_report(control, report)


def _naming(loc: Location, write: Callable[[], None]) -> None:
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


def _index(prepared: Prepared, report: ReportData, *, warn: bool = False) -> bool:
    """Add the run to the job's run index (with its score sketches, the next drift baseline);
    whether it was written. The index is a record on top of the run: a failure to write it does
    not fail the run (``warn``: it becomes a warning of the report). Recording the same run
    again replaces its entry."""
    config = prepared.config
    index_root = runindex.index_root(config.output)
    entry: dict[str, Any] = {key: report[key] for key in _INDEX_KEYS}  # type: ignore[literal-required]
    entry["report"] = prepared.control.child(REPORT_NAME).uri
    day = verdicts.run_day(config)
    if day is not None:
        entry["date"] = day  # a drift baseline is an earlier day (pipeline.report.verdict)
    found = report["verdict"]
    if found:
        # The drift baseline of later runs skips this dataset, and skips it while its drift
        # alert is open: not accepted then (verdict.accepted) nor since (the index's
        # _accepted/ entries for this dataset and baseline).
        drift: Mapping[str, Any] = report["drift"] or {}
        baseline: Mapping[str, Any] = drift.get("baseline") or {}
        entry["dataset"] = found["dataset"]
        entry["verdict"] = found
        entry["drift_alert"] = bool(drift.get("alert"))
        entry["drift_baseline"] = baseline.get("run_id")
    entry["outputs"] = {
        col: {"count": v.get("count"), "sketch": v.get("sketch")}
        for col, v in (report["outputs"] or {}).items()
    }
    if prepared.scorer is not None:
        # Whose scores the output holds: an incremental night carries from a baseline whose
        # scorer is its own (pipeline.driver.incremental).
        entry["scorer"] = {"hash": prepared.scorer.hash, "values": prepared.scorer.values}
    try:
        runindex.record(index_root, config.storage, config.name, entry)
    except Exception as e:
        warning = f"could not record the run in the index at {index_root}: {describe(e)}"
        logger.warning("%s", warning)
        if warn:
            report["warnings"].append(warning)
        return False
    return True


def _remove(loc: Location) -> None:
    """Delete ``loc``; an error is logged (a retraction must not hide the run's error)."""
    log_cleanup_error(lambda: storage.remove(loc), f"removing {loc.uri}")


def _decided(report: ReportData, decision: Decision) -> ReportData:
    """``report`` with the status and reasons of a later decision (see :mod:`.status`)."""
    changed = report.copy()
    changed["status"] = decision.status
    changed["failure_reasons"] = list(decision.reasons)
    return changed


def _run_report(prepared: Prepared, report: ReportData) -> RunReport:
    return RunReport(dict(report), control=prepared.control.uri)


# -- reconciling and checking the output -------------------------------------------------------


def _reconcile(
    prepared: Prepared, locked: Locked, want: Wanted
) -> tuple[WritePlan, tuple[Removal, ...]]:
    """What the run takes out of the output (gone inputs, failed and schema-skipped shards,
    with their rejects and manifest entries): the sink's plan, and what it deleted now."""
    manifest = locked.manifest
    ours = set(locked.previous_outputs) | set(manifest.shards)
    opts = prepared.config.storage
    left = ours - want.keep - set(want.reasons)
    input_uri = storage.locate(prepared.config.input_uri(), opts).uri
    reasons = {**gone_reasons(manifest.shards, left, input_uri, opts), **want.reasons}
    outcome = Outcome(frozenset(want.keep), frozenset(ours), reasons)
    plan = prepared.sink.plan(locked.begun, manifest, outcome, prepared.rejects)
    deleted = prepared.sink.delete_stale(plan)
    for rel in set(manifest.shards) - want.keep:
        manifest.forget(rel)
    manifest.flush()
    return plan, deleted


def _mismatch(prepared: Prepared, locked: Locked, plan: WritePlan, want: Wanted) -> list[str]:
    """How the visible output differs from the report (then no ``_SUCCESS``)."""
    expected = {rel: prepared.expected(rel, rows) for rel, rows in want.rows.items()}
    problems = prepared.sink.verify(locked.begun, plan, locked.manifest, expected)
    for p in problems:
        # Warnings: the report lists them and the run's error line names them (one line under
        # -q, however many files); without -q, and in the log file, each is a line.
        logger.warning("%s", p)
    return problems


def _foreign_warning(uri: str) -> str:
    """A visible file the tool did not write, left in the output: not scores, so ``_SUCCESS``
    still holds; but readers of the folder trip over it."""
    warning = (
        f"{uri} is in the output and score-catalog did not write it: it is left alone, but "
        "pyarrow.dataset and pandas.read_parquet on the output folder read every visible file "
        "and fail on it; move it out, or give it a name starting with _ or ."
    )
    logger.warning("%s", warning)
    return warning


def _removed(r: Removal) -> RemovedOutput:
    """A removal's entry in ``removed_outputs``."""
    return {"output": r.output, "reason": r.reason, "rejects": r.rejects}


def _unfinished(
    prepared: Prepared, results: Mapping[str, ShardResult], rel: str, why: str
) -> ShardResult:
    """Shard ``rel``'s result so far, or one saying it was not scored because of ``why``."""
    if rel in results:
        return results[rel]
    s = prepared.by_path[rel]
    info = prepared.found.infos.get(rel)
    rows = info.num_rows if info is not None else None
    return not_scored(rel, s.uri, rows, FailureKind.CANCELLED, why)
