"""Compose one scoring job: plan from footers, lock, skip what is done, schedule shards, report.

A :class:`ScoringRun` holds the run's state and goes through its phases in order: ``prepare``
(list, footers, schemas, the model's dry run, parity, batch size: nothing is written before it
passes), ``lock`` (take the output, clear what a crashed run left, find what is done), ``score``
(on the cluster, with retries) and ``finish`` (report, drift, HTML, run index, ``_SUCCESS``).

Order of commits: once the lock is taken, the previous run's ``_SUCCESS`` and report are
withdrawn and what an older version kept elsewhere is moved (``pipeline.layout.claim``); then
each shard's rejects, its output, its manifest entry; after every shard has finished, the run's
status is decided once (``pipeline.finish.decide``), then the manifest with the dataset's drift
verdict, the run-index entry, ``_report.html`` and ``_report.json`` (in the output's control
folder, outside the template's root); ``_SUCCESS`` last and only when the run succeeded within
its error budget and what readers see of the output matched the report (``pipeline.reconcile``).
A failure among these rewrites what was written as failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from pipeline import finish, layout, logs, nesting, oov, registry, storage
from pipeline.cluster import DaskSession, Plan, thread_plan
from pipeline.config import JobConfig
from pipeline.errors import StorageError
from pipeline.execution import cancelled, execute, interrupted
from pipeline.faults import checkpoint
from pipeline.interrupt import StopRequest
from pipeline.launch import EarlyStop
from pipeline.locking import LOCK_LOST_KIND, LockLostError, RunLock
from pipeline.manifest import (
    FencedManifest,
    Manifest,
    expectation,
    fingerprint_hash,
    scored_entry,
)
from pipeline.model import LoadedModel, read_bundle, resolve_device
from pipeline.preparation import (
    Execution,
    Inspection,
    Settings,
    apply_schema_policy,
    check_job_columns,
    inspect_shards,
    list_input,
    meta_fields,
    new_run_id,
    plan_execution,
    run_settings,
)
from pipeline.reconcile import (
    Expected,
    ForeignFiles,
    Removal,
    check_output_owner,
    check_rejects_location,
    clear_the_way,
    file_problems,
    remove_foreign,
)
from pipeline.report import RunReport
from pipeline.scoring import OVERLAP_DEPTH, ShardResult, ShardTask, WorkerSpec
from pipeline.statuses import FATAL_KINDS, FailureKind, RunStatus, ShardStatus
from pipeline.storage import SUCCESS_NAME as SUCCESS_NAME  # public: pipeline.run.SUCCESS_NAME
from pipeline.storage import ShardRef

logger = logging.getLogger(__name__)


OnShard = Callable[[ShardResult], None]
OnStart = Callable[[int, int], None]
OnRows = Callable[[str, int], None]


class ScoringRun:
    """One run of a job, phase by phase; its state lives here instead of in long argument lists.

    Attributes are filled in as the phases go: ``prepare`` sets the shards, the model, the plan,
    the worker spec; ``lock`` the lock, the manifest, the tasks and the shards already done;
    ``score`` every shard's result.
    """

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
        # The failed report written for an unexpected error, for the metrics (see run()).
        self.failure_data: dict[str, Any] | None = None
        self.started_at = dt.datetime.now(dt.timezone.utc)
        self.t0 = time.perf_counter()
        self.run_id = run_id or new_run_id()
        logs.bind_run_id(self.run_id)  # every log line from here on, workers' included
        storage.RETRY_CLOCK.reset()  # one retry deadline per run (storage.RetryClock)
        storage.RETRY_CLOCK.working_for(self.run_id)
        opts = config.storage
        # Manifest, report, HTML page, run index and default rejects: outside the template's
        # fixed part, which readers query as one dataset (pipeline.layout).
        self.places = layout.for_run(config, self.run_id)
        self.out_root = self.places.output
        self.rej_root = storage.locate(config.rejects_uri(self.run_id), opts)
        self.control = self.places.control
        self.session: DaskSession | None = None
        self.lock_: RunLock | None = None
        self.manifest: Manifest | None = None
        self.results: dict[str, ShardResult] = {}
        self.tasks: list[ShardTask] = []
        self.fatal: ShardResult | None = None
        self.previous_outputs: set[str] = set()
        self.foreign = ForeignFiles()
        self.model_warnings: list[str] = []  # said before scoring, kept for the report
        # Where the model comes from; a registry URI is resolved at the start of prepare().
        self.source = registry.ModelSource(uri=config.model, bundle=config.model)
        self.cleared: list[Removal] = []  # outputs taken away before scoring (clear_the_way)
        self.buckets_to_create: list[storage.Location] = []

    # -- the phases --------------------------------------------------------------------------

    def execute(self) -> RunReport:
        """All phases in order; the cluster and the lock are released whatever happens.

        An error after planning gets a failed ``_report.json`` where the output is writable and
        this run still holds it. Clean-up errors are logged and never replace the error that
        stopped the run (or a second signal's :class:`~pipeline.interrupt.Aborted`).
        """
        with contextlib.ExitStack() as cleanup:
            cleanup.callback(self._close_session)
            self.prepare()
            cleanup.callback(self._release)
            try:
                self.lock()
                self.score()
                return self.finish()
            except Exception as e:
                first = self._storage_failure_before(e)
                if self.failure_data is None:  # else finish already rewrote its report as failed
                    self._report_failure(first or e)
                if first is not None:
                    raise first from e
                raise
        raise AssertionError("unreachable")  # pragma: no cover  (ExitStack never swallows)

    def prepare(self) -> None:
        """Plan from footers and the model's dry run: nothing is written before this passes."""
        # A models:/ URI: ask the registry once, here; from now on the run, its workers and its
        # manifest see the downloaded bundle folder (the report names both).
        self.source = registry.resolve_model(self.config.model)
        self.config = dataclasses.replace(self.config, model=self.source.bundle)
        config, opts = self.config, self.config.storage
        input_uri = config.input_uri()
        self.shards: list[ShardRef] = list_input(config)
        storage.check_disjoint(
            input_uri, self.out_root, self.rej_root, options=opts, shards=self.shards
        )
        self._stop_if_asked()
        self._by_path = {s.rel_path: s for s in self.shards}
        create = config.create_output_bucket
        self.buckets_to_create = [
            bucket
            for loc, what in ((self.out_root, "output"), (self.rej_root, "rejects"))
            if (bucket := storage.check_write_target(loc, what, create_bucket=create))
        ]
        # Outputs never nest, and no run takes another job's output: one that contains, lies
        # inside or is the template root of another output of this tool, lies inside another
        # template's root or a control area, or belongs to another job, and rejects inside any
        # dataset, are refused before the model is even loaded.
        nesting.check_run(config, self.places, self.rej_root)
        self.device = resolve_device(config.device)
        bundle, _, self.sha = read_bundle(config.model, opts)
        # Before any worker spec: each output file's footer carries the settings hash.
        self.settings: Settings = run_settings(
            config, bundle, model_version=self.source.model_version
        )
        self.plan: Plan = thread_plan(config, len(self.shards), self.device.type)
        if config.overlap == "auto" and not self.plan.overlap:
            logger.info(
                "overlap threads off (overlap = auto): each core already runs a scoring loop "
                "of its own (%d in all); --overlap turns them on",
                self.plan.cores,
            )
        if self.plan.scheduler != "sync":
            # Workers start (and load the model) while the driver reads footers below.
            fixed = [i.fixed_width() for i in bundle.inputs]
            widths = None if None in fixed else tuple(w for w in fixed if w is not None)
            batch = config.batch_size if isinstance(config.batch_size, int) else None
            self.session = DaskSession(self.plan, self._worker_spec(widths, batch))
            checkpoint("cluster-started")
            self._stop_if_asked()
        self.found: Inspection = inspect_shards(
            config, self.shards, bundle, self.sha, self.device, opts
        )
        # Unseen values that a vocabulary input maps to a real value's id: said once, now, and
        # in the report's warnings; ids beyond the model's embedding fail here (exit 3).
        self.model_warnings = oov.check(self.found.model)
        for warning in self.model_warnings:
            logger.warning("%s", warning)
        check_job_columns(config, self.found.infos)  # a typo is not a shard to skip
        checkpoint("model-loaded")  # loaded in this process, dry-run checked
        self._stop_if_asked()
        self.failed = apply_schema_policy(config, self.shards, self.found)
        self.execution: Execution = plan_execution(
            config, self.shards, self.failed, self.found, self.plan
        )
        self.spec = self._worker_spec(self.found.widths, self.execution.batch_size)
        self.meta_types = meta_fields(config, self.found.infos, self.failed)
        if self.session is not None and self.plan.scheduler not in ("local", "threads"):
            # An existing cluster must answer before the run takes the output: an unreachable
            # scheduler fails here, with nothing written.
            self.session.client()
        self._stop_if_asked()

    def lock(self) -> None:
        """Lock the output, clear what a crashed run left, and find what is already done."""
        # A folder holding files this tool did not write is refused before anything is written.
        opts = self.config.storage
        for bucket in {b.uri: b for b in self.buckets_to_create}.values():
            storage.create_bucket(bucket)
        check_output_owner(self.out_root, self.config.on_foreign_output, opts)
        shard_paths = [s.rel_path for s in self.shards]
        check_rejects_location(self.rej_root, self.out_root, opts, shard_paths)
        lock_ = RunLock.acquire(
            self.out_root, self.run_id, stale_after_s=self.config.stale_lock_after_s
        )
        owner = nesting.owner_record(self.config, self.places)
        try:
            # Again, now that no other run can change it: a run of another job may have taken
            # the output while this one planned. Refused, it writes nothing (no report either:
            # the report there is the other job's).
            nesting.check_owner(self.places, owner)
        except BaseException:
            finish.log_cleanup_error(lock_.release, "releasing the lock")
            raise
        self.lock_ = lock_
        # The fence: every shard commit checks this token (the spec was built before the lock).
        self.spec = dataclasses.replace(
            self.spec,
            lock_root=self.out_root.uri,
            lock_run_id=self.lock_.run_id,
            lock_token=self.lock_.token,
        )
        checkpoint("locked")
        self._stop_if_asked()  # the lock is released on the way out (execute)
        layout.claim(self.places, self.lock_.assert_held)
        for root in (self.out_root, self.rej_root):
            for path in storage.remove_stale_temporaries(root):
                logger.info("removed a temporary file left by an interrupted run: %s", path)
        loaded = Manifest.load(self.control, self.places.old_controls)
        self.manifest = FencedManifest(
            loaded.loc,
            loaded.shards,
            verdict=loaded.verdict,
            owner=loaded.owner,
            fence=self.lock_.assert_held,
        )
        moved = self._rejects_moved()
        # The output is this job's from now on: recorded before anything is scored, so that a
        # run of another job is refused even if this one stops before its first shard.
        owned = self.manifest.set_owner(owner)
        if loaded.read_from is not None or moved or owned:
            # Written by an older version elsewhere (inside the output), naming rejects where
            # it kept them, or without this owner: save it to the control folder first, then
            # drop the old copy (a crash in between leaves both; the new one wins).
            self.manifest.save()
        if loaded.read_from is not None:
            storage.remove(loaded.read_from)
        # What earlier runs wrote, before failed shards are forgotten: reconcile's "ours".
        self.previous_outputs = set(self.manifest.shards)
        if self.config.on_foreign_output == "replace":
            self.foreign = remove_foreign(self.out_root, self.previous_outputs, opts)
        # An input shard that became a folder of the same name (or the reverse): its old
        # output is in the way of the new one.
        wanted = [s.rel_path for s in self.shards if s.rel_path not in self.failed]
        self.lock_.assert_held()
        self.cleared = clear_the_way(
            self.out_root, self.rej_root, wanted, self.previous_outputs, opts
        )
        for removal in self.cleared:
            self.manifest.forget(removal.rel_path)
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
            stop=self.stop,
            on_rows=self.on_rows,
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
        elif self.stop.requested:
            for t in tasks:
                self.results.setdefault(t.rel_path, interrupted(t, self.stop.signal_name))
        self.manifest.flush()

    def finish(self) -> RunReport:
        """Reconcile the output, account, judge against the error budget, report, check what
        readers see against the report, and mark success last (:func:`finish.finish_run`)."""
        report = finish.finish_run(self)
        report.control = self.control.uri
        return report

    # -- helpers -----------------------------------------------------------------------------

    def _stop_if_asked(self) -> None:
        """Stop here, before the run has changed its output, if a signal asked it to: the
        previous run's ``_SUCCESS`` and report stay, and nothing of this run is written. (Once
        the output is claimed a stop ends the run ``interrupted``, with its report.)"""
        if self.stop.requested and self.stop.signum is not None:
            raise EarlyStop(self.stop.signum)

    @property
    def model(self) -> LoadedModel:
        """The model as loaded in the driver (dry-run checked)."""
        return self.found.model

    def _worker_spec(self, widths: tuple[int, ...] | None, batch_size: int | None) -> WorkerSpec:
        overlap = OVERLAP_DEPTH if self.plan.overlap else 0
        torch_threads = self.plan.torch_threads
        spec = WorkerSpec.for_job(
            self.config,
            self.sha,
            str(self.device),
            widths,
            batch_size,
            overlap_depth=overlap,
            torch_threads=torch_threads,
            settings_hash=self.settings.hash,
        )
        reg = self.source.registry
        if reg is None:
            return spec
        return dataclasses.replace(
            spec, model_version=reg.pinned, registry_uri=reg.pinned, tracking_uri=reg.tracking_uri
        )

    def _expect(self, s: ShardRef) -> dict[str, object]:
        # The footer read in prepare: row count and the hash of its layout and statistics.
        return expectation(s, self.found.infos[s.rel_path], self.sha, self.settings.hash)

    def expected(self, rel_path: str, rows: int) -> Expected:
        """What the output file of shard ``rel_path`` must say in its footer (``rows`` rows)."""
        fingerprint = self._expect(self._by_path[rel_path])["fingerprint"]
        assert isinstance(fingerprint, dict)
        return Expected(rows, self.sha, self.settings.hash, rel_path, fingerprint_hash(fingerprint))

    def _skip_if_done(self, s: ShardRef) -> bool:
        """Record ``s`` as skipped if the manifest says this model and settings scored it, and
        the output file's footer agrees (its rows, model, settings and input shard)."""
        assert self.manifest is not None
        if self.config.force or not self.manifest.matches(s.rel_path, self._expect(s)):
            return False
        done = self.manifest.shards[s.rel_path]
        out_loc = self.out_root.child(s.rel_path)
        problems = file_problems(
            out_loc, self.expected(s.rel_path, done["rows_scored"]), self.config.storage
        )
        if problems:
            # Deleted, replaced or copied over since: score it again instead of trusting it.
            logger.warning("scoring %s again: %s", s.rel_path, problems[0])
            return False
        if done.get("input") != s.uri:
            # The same shard at another place (the job's input moved): the entry names where
            # it is now, so that its removal, once it leaves the input, says why truthfully.
            self.manifest.record(s.rel_path, {**done, "input": s.uri})
        self.results[s.rel_path] = ShardResult.skipped(s.rel_path, s.uri, done)
        return True

    def _task(self, s: ShardRef) -> ShardTask:
        info = self.found.infos[s.rel_path]
        meta = [info.schema.field(c) for c in (self.config.id_column, *self.config.passthrough)]
        meta = [self.meta_types.get(f.name, f) for f in meta]
        fingerprint = self._expect(s)["fingerprint"]
        assert isinstance(fingerprint, dict)
        return ShardTask(
            rel_path=s.rel_path,
            input_uri=s.uri,
            output_uri=self.out_root.child(s.rel_path).uri,
            rejects_uri=self.rej_root.child(s.rel_path).uri,
            num_rows=info.num_rows,
            meta_schema=pa.schema(meta).serialize().to_pybytes(),
            input_fingerprint=fingerprint_hash(fingerprint),
        )

    def _record(self, task: ShardTask, result: ShardResult) -> None:
        assert self.manifest is not None
        if result.kind == LOCK_LOST_KIND:
            # Another run owns the output now: stop without writing anything more.
            raise LockLostError(result.message or f"run {self.run_id} lost its lock")
        self.results[task.rel_path] = result
        if result.status != ShardStatus.SCORED:
            self.manifest.forget(task.rel_path)
            if result.kind in FATAL_KINDS:
                self.fatal = result
            if result.kind == FailureKind.STORAGE:
                # The run stops here; what it still writes (manifest, report, lock) takes one
                # attempt each instead of waiting out another retry deadline on a dead store.
                storage.RETRY_CLOCK.expire()
            return
        s = self._by_path[task.rel_path]
        expect = self._expect(s)
        self.manifest.record(task.rel_path, scored_entry(s.uri, expect, result, self.run_id))

    def _rejects_moved(self) -> bool:
        """Point the manifest's entries at the rejects :func:`layout.claim` moved from an older
        version's default location; True if any entry changed."""
        assert self.manifest is not None
        changed = False
        for old_loc, new_loc in self.places.rejects_moved:
            old, new = (loc.uri.rstrip("/") + "/" for loc in (old_loc, new_loc))
            for entry in self.manifest.shards.values():
                rejects = entry.get("rejects")
                if isinstance(rejects, str) and rejects.startswith(old):
                    entry["rejects"] = new + rejects[len(old) :]
                    changed = True
        return changed

    def _release(self) -> None:
        """Save the manifest, delete this run's leftover temporary files and release the lock;
        errors are logged, never raised."""
        if self.manifest is not None:
            # After an unexpected error too: keep what was committed so the rerun skips it.
            finish.log_cleanup_error(self.manifest.flush, "saving the manifest")
        if self.lock_ is not None:
            finish.log_cleanup_error(self._remove_temporaries, "removing temporary files")
            finish.log_cleanup_error(self.lock_.release, "releasing the lock")

    def _remove_temporaries(self) -> None:
        """Staged files of this run that no writer will finish: a worker killed mid-write
        (SIGKILL, out of memory) left them; its shard was scored again elsewhere."""
        for root in (self.out_root, self.rej_root):
            for path in storage.remove_temporaries(root, self.run_id):
                logger.info("removed a temporary file a killed worker left: %s", path)

    def _close_session(self) -> None:
        if self.session is not None:
            finish.log_cleanup_error(self.session.close, "closing the Dask cluster")

    def _storage_failure_before(self, e: Exception) -> StorageError | None:
        """When a shard's storage failure stopped the run and finishing it then failed on
        storage too (the store is dead: the report cannot be written either), one error that
        names the first failure, the cause, before the one that ended the run."""
        fatal = self.fatal
        if fatal is None or fatal.kind != FailureKind.STORAGE:
            return None
        if not storage.is_storage_failure(e):
            return None
        return StorageError(
            f"storage failure: {fatal.message} (finishing the run failed too: "
            f"{finish.describe(e)})",
            uri=getattr(e, "uri", None),
        )

    def _report_failure(self, e: Exception) -> None:
        self.failure_data = finish.report_failure(self, e)


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
    :class:`~pipeline.errors.PipelineError` for problems found before scoring (configuration,
    input listing, schema, model), which leave the output untouched. Either way the metrics
    file and Pushgateway, when configured, get the outcome. ``on_start(rows, shards)`` is called
    once scoring starts with what is left to score; ``on_shard`` after each shard; and
    ``on_rows(rel_path, rows)`` while a shard is scored, with its rows done so far (from the
    workers, at most every half second each; a shard's last report comes before its
    ``on_shard``, and never after it).

    Any other error after planning is raised too, after a failed ``_report.json`` (where the
    output is writable) and the metrics. ``stop``, once requested (the CLI routes SIGTERM and
    SIGINT to it), ends the run early with status ``interrupted`` (see
    :mod:`pipeline.interrupt`); requested before the run has taken its output (while it plans,
    starts its cluster or loads the model), it raises :class:`~pipeline.launch.EarlyStop`
    instead, with nothing written but the metrics (status ``interrupted``). ``run_id`` names
    the run (default: a new :func:`~pipeline.preparation.new_run_id`); every log line of the
    run carries it.
    """
    started_at = dt.datetime.now(dt.timezone.utc)
    t0 = time.perf_counter()
    finish.check_metrics_file(config)
    scoring: ScoringRun | None = None
    outer_run_id = logs.current_run_id()  # the caller's lines go back to it afterwards
    try:
        scoring = ScoringRun(config, on_shard, on_start, stop, run_id, on_rows)
        report = scoring.execute()
    except BaseException as e:  # Aborted (a second signal) too: the metrics say how it ended
        summary = scoring.failure_data if scoring is not None else None
        if summary is None:
            status = RunStatus.FAILED if isinstance(e, Exception) else RunStatus.INTERRUPTED
            duration = time.perf_counter() - t0
            summary = finish.failed_summary(config.name, started_at, duration, e, status)
        finish.publish_metrics(config, summary)
        logs.bind_run_id(outer_run_id)
        storage.RETRY_CLOCK.reset()  # the caller's own storage calls are retried as before
        raise
    finish.publish_metrics(config, report.data)
    logs.bind_run_id(outer_run_id)
    storage.RETRY_CLOCK.reset()
    return report
