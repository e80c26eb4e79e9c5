"""One scoring run: :func:`run`, and the :class:`ScoringRun` that calls its phases in order.

``prepare`` (list, footers, schemas, the model's dry run, parity, batch size: nothing is written
before it passes), ``lock`` (take the output, clear what a crashed run left, find what is done),
``score`` (on the cluster, with retries) and ``finish`` (reconcile, decide the status, report,
``_SUCCESS``). Each phase is a function of the frozen values the earlier ones returned
(:mod:`pipeline.driver.phases`); the run object holds only those values, the callbacks and the
stop request, and releases what the phases took (the lock, the cluster) whatever happens.

Order of commits: once the lock is taken, the previous run's ``_SUCCESS`` and report are withdrawn
and what an older version kept elsewhere is moved (``pipeline.io.layout.claim``); then each shard's
rejects, its output, its manifest entry; after every shard has finished, the run's status is
decided once (``pipeline.driver.status.decide``), then the manifest with the dataset's drift
verdict, the run-index entry, ``_report.html`` and ``_report.json`` (in the output's control
folder, outside the template's root); ``_SUCCESS`` last and only when the run succeeded within its
error budget and what readers see of the output matched the report. A failure among these rewrites
what was written as failed.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from typing import Any

from pipeline.core import retries, runcontext
from pipeline.core.config import JobConfig
from pipeline.core.errors import StorageError, describe
from pipeline.core.interrupt import StopRequest
from pipeline.core.statuses import FailureKind, RunStatus
from pipeline.driver import finish, lock, prepare, score
from pipeline.driver.phases import Locked, Prepared, Scored
from pipeline.driver.score import OnRows, OnShard, OnStart
from pipeline.io.layout import REPORT_NAME
from pipeline.io.locking import RunLock
from pipeline.report import metrics
from pipeline.report.build import RunReport
from pipeline.worker.shard import ShardResult

logger = logging.getLogger(__name__)


class ScoringRun:
    """One run of a job: its phases in order, and what they took released at the end."""

    def __init__(
        self,
        config: JobConfig,
        on_shard: OnShard | None = None,
        on_start: OnStart | None = None,
        stop: StopRequest | None = None,
        run_id: str | None = None,
        on_rows: OnRows | None = None,
    ) -> None:
        self.config = config
        self.on_shard = on_shard
        self.on_start = on_start
        self.on_rows = on_rows
        # Never requested unless the caller routes signals to it (the CLI does).
        self.stop = stop if stop is not None else StopRequest(config.grace_period_s)
        self.run_id = run_id or runcontext.new_run_id()
        runcontext.bind_run_id(self.run_id)  # every log line from here on, workers' included
        retries.RETRY_CLOCK.reset()  # one retry deadline per run (retries.RetryClock)
        retries.RETRY_CLOCK.working_for(self.run_id)
        # The phases' values, as they come: a failure report reads what is known.
        self.prepared: Prepared | None = None
        self.lock: RunLock | None = None
        self.locked: Locked | None = None
        self.scored: Scored | None = None
        # Every shard's result as soon as it is known (the score phase adds to it).
        self.results: dict[str, ShardResult] = {}
        # The failed report built for an error after planning, for the metrics (see run()).
        self.failure: finish.Failure | None = None

    def execute(self) -> RunReport:
        """All phases in order; the cluster and the lock are released whatever happens.

        An error after planning gets a failed ``_report.json`` where the output is writable and
        this run still holds it. Clean-up errors are logged and never replace the error that
        stopped the run (or a second signal's :class:`~pipeline.core.interrupt.Aborted`).
        """
        with contextlib.ExitStack() as cleanup:
            prepared = self.prepared = prepare.prepare(self.config, self.run_id, self.stop, cleanup)
            try:
                self.lock = lock.take(prepared, self.stop, cleanup)
                locked = self.locked = lock.claim(prepared, self.lock, cleanup)
                scored = self.scored = score.score(
                    prepared,
                    locked,
                    self.stop,
                    self.results,
                    on_start=self.on_start,
                    on_shard=self.on_shard,
                    on_rows=self.on_rows,
                )
                return self._finish(prepared, locked, scored)
            except Exception as e:
                fatal = self.scored.fatal if self.scored is not None else _fatal(self.results)
                first = finish.storage_failure_before(fatal, e)
                if self.failure is None:  # else finish already rewrote its report as failed
                    self._report_failure(prepared, first or e)
                if first is not None or retries.is_storage_failure(e):
                    raise self._storage_failure(first or e) from e
                raise
        raise AssertionError("unreachable")  # pragma: no cover  (ExitStack never swallows)

    def _finish(self, prepared: Prepared, locked: Locked, scored: Scored) -> RunReport:
        """Decide and commit; a commit that fails rewrites what it wrote as failed first."""
        concluded = finish.conclude(prepared, locked, scored, self.stop)
        try:
            return finish.commit(prepared, locked, concluded, self.stop)
        except Exception as e:
            self.failure = finish.retract(prepared, locked, concluded, self.stop, e)
            raise

    def _storage_failure(self, e: Exception) -> StorageError:
        """The one line a storage failure after the run took its output ends with: the run,
        ``storage failure``, what could not be read or written and why (the disk filling
        while the run commits raises an OSError that names no file: finish names it)."""
        why = describe(e)
        if not why.startswith("storage failure: "):
            why = f"storage failure: {why}"
        where = getattr(e, "uri", None) or getattr(e, "filename", None)
        report = ""
        if self.failure is not None and self.failure.written and self.prepared is not None:
            report = f" (report: {self.prepared.control.child(REPORT_NAME).uri})"
        landed = finish.landed_commit(e)  # a run that failed after its table commit landed
        note = f"; {landed}" if landed else ""
        return StorageError(f"run {self.run_id} failed: {why}{note}{report}", uri=where)

    def _report_failure(self, prepared: Prepared, e: Exception) -> None:
        cleared = self.locked.cleared if self.locked is not None else ()
        self.failure = finish.report_failure(prepared, self.lock, cleared, self.results, e)


def _fatal(results: dict[str, ShardResult]) -> ShardResult | None:
    """The storage failure that stopped a score phase which then raised, if one did."""
    return next((r for r in results.values() if r.kind == FailureKind.STORAGE), None)


def run(
    config: JobConfig,
    *,
    on_shard: OnShard | None = None,
    on_start: OnStart | None = None,
    stop: StopRequest | None = None,
    run_id: str | None = None,
    on_rows: OnRows | None = None,
) -> RunReport:
    """Score every input shard of ``config`` and write outputs, manifest and ``_report.json``.

    Returns the report whatever the outcome within the run (check ``report.status``); raises a
    :class:`~pipeline.core.errors.PipelineError` for problems found before scoring
    (configuration, input listing, schema, model), which leave the output untouched. Either way
    the metrics file and Pushgateway, when configured, get the outcome. ``on_start(rows,
    shards)`` is called once scoring starts with what is left to score; ``on_shard`` after each
    shard; and ``on_rows(rel_path, rows)`` while a shard is scored, with its rows done so far
    (from the workers, at most every half second each; a shard's last report comes before its
    ``on_shard``, and never after it).

    Any other error after planning is raised too, after a failed ``_report.json`` (where the
    output is writable) and the metrics. ``stop``, once requested (the CLI routes SIGTERM and
    SIGINT to it), ends the run early with status ``interrupted`` (see
    :mod:`pipeline.core.interrupt`); requested before the run has taken its output (while it
    plans, starts its cluster or loads the model), it raises
    :class:`~pipeline.core.signals.EarlyStop` instead, with nothing written but the metrics
    (status ``interrupted``). ``run_id`` names the run (default: a new
    :func:`~pipeline.core.runcontext.new_run_id`); every log line of the run carries it.
    """
    started_at = dt.datetime.now(dt.timezone.utc)
    t0 = time.perf_counter()
    metrics.check_metrics_file(config)
    scoring: ScoringRun | None = None
    outer_run_id = runcontext.current_run_id()  # the caller's lines go back to it afterwards
    try:
        scoring = ScoringRun(config, on_shard, on_start, stop, run_id, on_rows)
        report = scoring.execute()
    except BaseException as e:  # Aborted (a second signal) too: the metrics say how it ended
        failure = scoring.failure if scoring is not None else None
        summary: Any = dict(failure.report) if failure and failure.report is not None else None
        if summary is None:
            status = RunStatus.FAILED if isinstance(e, Exception) else RunStatus.INTERRUPTED
            duration = time.perf_counter() - t0
            summary = metrics.failure_summary(
                config.name, started_at, duration, describe(e), status
            )
        metrics.publish_outcome(config, summary)
        runcontext.bind_run_id(outer_run_id)
        retries.RETRY_CLOCK.reset()  # the caller's own storage calls are retried as before
        raise
    metrics.publish_outcome(config, report.data)
    runcontext.bind_run_id(outer_run_id)
    retries.RETRY_CLOCK.reset()
    return report
