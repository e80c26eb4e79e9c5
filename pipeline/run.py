"""Compose one scoring job: plan from footers, lock, skip what is done, schedule shards, report.

A :class:`ScoringRun` holds the run's state and goes through its phases in order: ``prepare``
(list, footers, schemas, the model's dry run, parity, batch size: nothing is written before it
passes), ``lock`` (take the output, clear what a crashed run left, find what is done), ``score``
(on the cluster, with retries) and ``finish`` (report, drift, HTML, run index, ``_SUCCESS``).

Order of commits on the output root: each shard's rejects, then its output, then its manifest
entry; ``_report.json``, ``_report.html`` and the run-index entry after every shard has finished;
``_SUCCESS`` last and only when the run succeeded within its error budget.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import time
from collections.abc import Callable

import pyarrow as pa

from pipeline import finish, runindex, storage
from pipeline.cluster import DaskSession, Plan, thread_plan
from pipeline.config import JobConfig
from pipeline.errors import ConfigError, PipelineError
from pipeline.execution import cancelled, execute
from pipeline.faults import checkpoint
from pipeline.locking import RunLock
from pipeline.manifest import Manifest, expectation, scored_entry
from pipeline.model import LoadedModel, read_bundle, resolve_device
from pipeline.precision import ExecutionOptions
from pipeline.preparation import (
    Execution,
    Inspection,
    Settings,
    apply_schema_policy,
    inspect_shards,
    new_run_id,
    prepare_execution,
    run_settings,
)
from pipeline.report import REPORT_NAME, RunFacts, RunReport, build_report, model_section
from pipeline.scoring import ShardResult, ShardTask, WorkerSpec
from pipeline.statuses import FATAL_KINDS, RunStatus, ShardStatus
from pipeline.storage import ShardRef

logger = logging.getLogger(__name__)

SUCCESS_NAME = "_SUCCESS"
OVERLAP_DEPTH = 2  # batches in flight on each side of the model: memory stays a few batches

OnShard = Callable[[ShardResult], None]
OnStart = Callable[[int, int], None]


class ScoringRun:
    """One run of a job, phase by phase; its state lives here instead of in long argument lists.

    Attributes are filled in as the phases go: ``prepare`` sets the shards, the model, the plan,
    the worker spec; ``lock`` the lock, the manifest, the tasks and the shards already done;
    ``score`` every shard's result.
    """

    def __init__(
        self, config: JobConfig, on_shard: OnShard | None = None, on_start: OnStart | None = None
    ) -> None:
        self.config = config
        self.on_shard = on_shard
        self.on_start = on_start
        self.started_at = dt.datetime.now(dt.timezone.utc)
        self.t0 = time.perf_counter()
        self.run_id = new_run_id()
        opts = config.storage
        self.out_root = storage.locate(config.output_uri(self.run_id), opts)
        self.rej_root = storage.locate(config.rejects_uri(self.run_id), opts)
        self.session: DaskSession | None = None
        self.lock_: RunLock | None = None
        self.manifest: Manifest | None = None
        self.results: dict[str, ShardResult] = {}
        self.tasks: list[ShardTask] = []
        self.fatal: ShardResult | None = None

    # -- the phases --------------------------------------------------------------------------

    def execute(self) -> RunReport:
        """All phases in order; the cluster and the lock are released whatever happens."""
        try:
            self.prepare()
            try:
                self.lock()
                self.score()
                return self.finish()
            finally:
                self._release()
        finally:
            if self.session is not None:
                self.session.close()

    def prepare(self) -> None:
        """Plan from footers and the model's dry run: nothing is written before this passes."""
        config, opts = self.config, self.config.storage
        input_uri = config.input_uri()
        self.shards: list[ShardRef] = storage.list_shards(input_uri, opts)
        storage.check_disjoint(
            input_uri, self.out_root, self.rej_root, options=opts, shards=self.shards
        )
        self._by_path = {s.rel_path: s for s in self.shards}
        self.device = resolve_device(config.device)
        bundle, _, self.sha = read_bundle(config.model, opts)
        self.plan: Plan = thread_plan(config, len(self.shards))
        if self.plan.scheduler != "sync":
            # Workers start (and load the model) while the driver reads footers below.
            width = len(bundle.columns) if bundle.columns is not None else bundle.dim
            batch = config.batch_size if isinstance(config.batch_size, int) else None
            self.session = DaskSession(self.plan, self._worker_spec(width, batch))
        self.found: Inspection = inspect_shards(
            config, self.shards, bundle, self.sha, self.device, opts
        )
        self.failed = apply_schema_policy(config, self.shards, self.found)
        exec_opts = ExecutionOptions(config.precision, config.compile, config.strict_fp32)
        infos = self.found.infos
        sample_from = next(
            (
                s
                for s in self.shards
                if s.rel_path not in self.failed and infos[s.rel_path].num_rows
            ),
            None,
        )
        self.execution: Execution = prepare_execution(
            config, self.model, exec_opts, sample_from, self.found.width, self.plan
        )
        self.settings: Settings = run_settings(config, bundle)
        self.spec = self._worker_spec(self.found.width, self.execution.batch_size)

    def lock(self) -> None:
        """Lock the output, clear what a crashed run left, and find what is already done."""
        self.lock_ = RunLock.acquire(
            self.out_root, self.run_id, stale_after_s=self.config.stale_lock_after_s
        )
        checkpoint("locked")
        for root in (self.out_root, self.rej_root):
            for path in storage.remove_stale_temporaries(root):
                logger.info("removed a temporary file left by an interrupted run: %s", path)
        storage.remove(self.out_root.child(SUCCESS_NAME))
        self.manifest = Manifest.load(self.out_root)
        self.results = dict(self.failed)
        for s in self.shards:
            if s.rel_path in self.failed:
                self.manifest.forget(s.rel_path)
            elif not self._skip_if_done(s):
                self.tasks.append(self._task(s))

    def score(self) -> None:
        """Score the tasks; each finished shard is recorded at once (a crash loses only those
        in flight), and a fatal failure stops the run, leaving the rest cancelled."""
        assert self.manifest is not None
        tasks = self.tasks
        if self.on_start is not None:
            self.on_start(sum(t.num_rows for t in tasks), len(tasks))
        errors = self.config.errors
        results = execute(
            self.spec,
            tasks,
            self.session,
            retries=errors.task_retries,
            task_rows=self.config.task_rows,
            resources=dict(self.config.resources) or None,
        )
        with contextlib.closing(results):
            for task, result in results:
                self._record(task, result)
                if self.on_shard is not None:
                    self.on_shard(result)
                if self.fatal is not None:
                    break
        if self.fatal is not None:
            for t in tasks:
                self.results.setdefault(t.rel_path, cancelled(t, self.fatal.input))
        self.manifest.flush()

    def finish(self) -> RunReport:
        """Account, judge against the error budget, report, and mark success last."""
        ordered = [self.results[s.rel_path] for s in self.shards]
        data = build_report(self._facts(), ordered, self.fatal, time.perf_counter() - self.t0)
        index_root = runindex.index_root(self.config.output)
        finish.add_drift(self.config, data, index_root)
        report = RunReport(data)
        storage.write_json(self.out_root.child(REPORT_NAME), data, point="report-rename")
        finish.write_html(self.out_root, data)
        finish.record_run(self.config, index_root, self.out_root, data)
        if report.status != RunStatus.FAILED:
            storage.write_bytes(self.out_root.child(SUCCESS_NAME), b"", point="success-rename")
        return report

    # -- helpers -----------------------------------------------------------------------------

    @property
    def model(self) -> LoadedModel:
        """The model as loaded in the driver (dry-run checked)."""
        return self.found.model

    def _worker_spec(self, width: int | None, batch_size: int | None) -> WorkerSpec:
        overlap = OVERLAP_DEPTH if self.config.overlap else 0
        torch_threads = self.plan.torch_threads
        return WorkerSpec.for_job(
            self.config,
            self.sha,
            str(self.device),
            width,
            batch_size,
            overlap_depth=overlap,
            torch_threads=torch_threads,
        )

    def _expect(self, s: ShardRef, num_rows: int) -> dict[str, object]:
        return expectation(s, num_rows, self.sha, self.settings.hash)

    def _skip_if_done(self, s: ShardRef) -> bool:
        """Record ``s`` as skipped if the manifest says this model and settings scored it."""
        assert self.manifest is not None
        info = self.found.infos[s.rel_path]
        out_loc = self.out_root.child(s.rel_path)
        expect = self._expect(s, info.num_rows)
        if self.config.force or not self.manifest.is_done(s.rel_path, expect, out_loc):
            return False
        done = self.manifest.shards[s.rel_path]
        self.results[s.rel_path] = ShardResult.skipped(s.rel_path, s.uri, done)
        return True

    def _task(self, s: ShardRef) -> ShardTask:
        info = self.found.infos[s.rel_path]
        meta = [info.schema.field(c) for c in (self.config.id_column, *self.config.passthrough)]
        return ShardTask(
            rel_path=s.rel_path,
            input_uri=s.uri,
            output_uri=self.out_root.child(s.rel_path).uri,
            rejects_uri=self.rej_root.child(s.rel_path).uri,
            num_rows=info.num_rows,
            meta_schema=pa.schema(meta).serialize().to_pybytes(),
        )

    def _record(self, task: ShardTask, result: ShardResult) -> None:
        assert self.manifest is not None
        self.results[task.rel_path] = result
        if result.status != ShardStatus.SCORED:
            self.manifest.forget(task.rel_path)
            if result.kind in FATAL_KINDS:
                self.fatal = result
            return
        s = self._by_path[task.rel_path]
        expect = self._expect(s, task.num_rows)
        self.manifest.record(task.rel_path, scored_entry(s.uri, expect, result, self.run_id))

    def _facts(self) -> RunFacts:
        config = self.config
        assert self.lock_ is not None
        return RunFacts(
            run_id=self.run_id,
            job=config.name,
            started_at=self.started_at,
            input=storage.locate(config.input_uri(), config.storage).uri,
            output=self.out_root.uri,
            rejects=self.rej_root.uri,
            id_column=config.id_column,
            error_budget=config.errors,
            model=model_section(config.model, self.model),
            device=str(self.device),
            threads=self.plan.public(),
            settings=self.settings.values,
            batch_size=self.execution.batch_size,
            execution=self.execution.report,
            lock_taken_over=self.lock_.took_over,
        )

    def _release(self) -> None:
        if self.manifest is not None:
            # After an unexpected error too: keep what was committed so the rerun skips it.
            with contextlib.suppress(Exception):
                self.manifest.flush()
        if self.lock_ is not None:
            self.lock_.release()


def run(
    config: JobConfig,
    *,
    on_shard: OnShard | None = None,
    on_start: OnStart | None = None,
) -> RunReport:
    """Score every input shard of ``config`` and write outputs, manifest and ``_report.json``.

    Returns the report whatever the outcome within the run (check ``report.status``); raises a
    :class:`~pipeline.errors.PipelineError` for problems found before scoring (configuration,
    input listing, schema, model), which leave the output untouched. Either way the metrics
    file and Pushgateway, when configured, get the outcome. ``on_start(rows, shards)`` is called
    once scoring starts with what is left to score; ``on_shard`` after each shard.
    """
    started_at = dt.datetime.now(dt.timezone.utc)
    t0 = time.perf_counter()
    if config.metrics_file is not None:
        parent = os.path.dirname(os.path.abspath(config.metrics_file))
        if not os.path.isdir(parent):
            raise ConfigError(
                f"metrics_file = {config.metrics_file!r}: directory {parent} does not exist "
                "(point it at node_exporter's --collector.textfile.directory)"
            )
    try:
        report = ScoringRun(config, on_shard, on_start).execute()
    except PipelineError as e:
        summary = finish.failed_summary(config, started_at, time.perf_counter() - t0, e)
        finish.publish_metrics(config, summary)
        raise
    finish.publish_metrics(config, report.data)
    return report
