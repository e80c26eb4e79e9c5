"""Compose one scoring job: plan from footers, lock, skip what is done, schedule shards, report.

Order of commits on the output root: each shard's rejects, then its output, then its manifest
entry; ``_report.json``, ``_report.html`` and the run-index entry after every shard has finished;
``_SUCCESS`` last and only when the run succeeded within its error budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import pyarrow as pa
import torch

from pipeline import drift as drift_mod
from pipeline import runindex, storage
from pipeline.batching import ShardBatches
from pipeline.config import JobConfig
from pipeline.errors import (
    ConfigError,
    ModelError,
    PipelineError,
    SchemaError,
    ShardError,
    StorageError,
)
from pipeline.faults import checkpoint
from pipeline.html_report import render_html
from pipeline.locking import RunLock
from pipeline.manifest import Manifest, settings_hash
from pipeline.model import forward, load_model, read_bundle, resolve_device
from pipeline.precision import (
    DEFAULT_TOLERANCE,
    PARITY_ROWS,
    ExecutionOptions,
    check_parity,
    parity,
    prepare,
)
from pipeline.reading import ShardInfo, check_schema, feature_width, read_footer
from pipeline.report import (
    HTML_NAME,
    REPORT_NAME,
    SCHEMA_VERSION,
    RunReport,
    latency_summary,
    output_summary,
    versions,
)
from pipeline.scoring import ShardResult, ShardTask, score_shard, score_shards, warm_worker
from pipeline.storage import Location, ShardRef

logger = logging.getLogger(__name__)

SUCCESS_NAME = "_SUCCESS"
START_METHOD = os.environ.get("_SCORE_CATALOG_START_METHOD", "fork")
OVERLAP_DEPTH = 2  # batches in flight on each side of the model: memory stays a few batches
SAMPLE_ROWS = 65_536  # real rows read up front for the parity check and batch-size tuning
MMAP_THRESHOLD = 64 * 1024 * 1024
FATAL_KINDS = frozenset({"invalid_rows", "model"})  # these stop the run whatever the budget


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Plan:
    """Where each worker's threads go: workers x threads per worker x torch threads <= cores."""

    scheduler: str
    workers: int | None  # None for an external cluster (its own size)
    threads_per_worker: int | None
    torch_threads: int | None  # None: each task derives it from its worker
    cores: int = 1

    def public(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler,
            "cores": self.cores,
            "workers": self.workers,
            "threads_per_worker": self.threads_per_worker,
            "torch_threads": self.torch_threads,
        }


def thread_plan(config: JobConfig, pending: int) -> Plan:
    """Split the cores: workers x threads per worker x torch threads <= cores (see README)."""
    cores = config.cores or available_cores()
    if config.scheduler == "sync":
        return Plan("sync", 1, 1, cores, cores)
    if config.scheduler == "threads":
        w = max(1, min(config.workers or cores, cores, max(pending, 1)))
        return Plan("threads", 1, w, max(1, cores // w), cores)
    if config.scheduler == "local":
        w = max(1, min(config.workers or cores, max(pending, 1)))
        return Plan("local", w, 1, max(1, cores // w), cores)
    return Plan(config.scheduler, None, None, None, cores)


def new_run_id() -> str:
    return f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"


def _check_not_overlapping(inp: Location, out: Location, rej: Location) -> None:
    if inp.fs.protocol != out.fs.protocol:
        return
    a = inp.path.rstrip("/") + "/"
    for loc, what in ((out, "output"), (rej, "rejects")):
        b = loc.path.rstrip("/") + "/"
        if b.startswith(a) or a.startswith(b):
            raise ConfigError(
                f"{what} {loc.uri} overlaps the input {inp.uri}: the input is never written to, "
                f"and the next run would read the scores as input. Choose a separate {what}."
            )


def torch_threads_by_host(client: Any) -> dict[str, int]:
    """Torch threads per worker thread on each host of an existing cluster.

    Several workers often share a machine (``dask worker --nworkers 4``); each then gets the
    host's cores divided by all the worker threads on that host, never more than one busy
    thread per core (oversubscribed torch threads were 10-40x slower here).
    """
    workers = client.scheduler_info(n_workers=-1)["workers"]
    cores = client.run(available_cores)
    threads: dict[str, int] = {}
    host_cores: dict[str, int] = {}
    for address, w in workers.items():
        host = w.get("host") or urlsplit(address).hostname or ""
        threads[host] = threads.get(host, 0) + int(w.get("nthreads") or 1)
        host_cores[host] = int(cores.get(address, 1))
    return {h: max(1, host_cores[h] // max(1, n)) for h, n in threads.items()}


class DaskSession:
    """A Dask client for the run, started in a background thread as soon as the run begins.

    Worker processes take seconds to start and import torch; starting them while the driver
    lists shards, reads footers and dry-runs the model hides most of that. Each worker also
    loads the model bundle once, before the first task arrives (``warm``).
    """

    def __init__(self, plan: Plan, warm: tuple[Any, ...] | None) -> None:
        self.plan = plan
        self._warm = warm
        self._cluster: Any = None
        self._client: Any = None
        self.threads_by_host: dict[str, int] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, name="dask-start", daemon=True)
        # Worker processes are forked from this one once planning is over: they inherit the
        # imported torch and the loaded model, so they start in a fraction of a second instead
        # of importing everything again (several CPU-seconds each). Forking while another
        # thread imports modules can deadlock the child, so nothing starts before then.
        if plan.scheduler != "local" or START_METHOD != "fork":
            self._thread.start()

    def _start(self) -> None:
        try:
            import dask
            from distributed import Client, LocalCluster

            # distributed sets its loggers to INFO when imported; its cluster chatter is noise
            # in a nightly log unless debugging.
            if not logger.isEnabledFor(logging.DEBUG):
                logging.getLogger("distributed").setLevel(logging.WARNING)
            plan = self.plan
            if plan.scheduler == "local":
                # Dask's nanny sets MALLOC_TRIM_THRESHOLD_=65536 in its workers, which pins
                # glibc's mmap threshold at 128 KiB: every MLP activation (4 MiB at batch 4096)
                # is then mmapped and page-faulted afresh, making the forward pass 2.4x slower
                # (15.2 vs 6.5 ms measured). A fixed 64 MiB mmap threshold keeps the trimming
                # and restores the speed (6.8 ms).
                dask.config.set(
                    {
                        "distributed.nanny.pre-spawn-environ.MALLOC_MMAP_THRESHOLD_": str(
                            MMAP_THRESHOLD
                        ),
                        "distributed.worker.multiprocessing-method": START_METHOD,
                    }
                )
                self._cluster = LocalCluster(
                    n_workers=plan.workers,
                    threads_per_worker=1,
                    processes=True,
                    dashboard_address=None,
                    silence_logs=logging.ERROR,
                )
                self._client = Client(self._cluster)
            elif plan.scheduler == "threads":
                self._cluster = LocalCluster(
                    n_workers=1,
                    threads_per_worker=plan.threads_per_worker,
                    processes=False,
                    dashboard_address=None,
                    silence_logs=logging.ERROR,
                )
                self._client = Client(self._cluster)
            else:
                self._client = Client(plan.scheduler, timeout="30s")
                self.threads_by_host = torch_threads_by_host(self._client)
            if self._warm is not None and plan.scheduler != "threads":
                try:
                    self._client.run(warm_worker, *self._warm, self.threads_by_host)
                except Exception as e:  # the tasks will load (and report) it themselves
                    logger.debug("preloading the model on the workers failed: %s", e)
        except BaseException as e:
            self._error = e

    def client(self) -> Any:
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()
        self._thread.join()
        if self._error is not None:
            raise StorageError(
                f"could not start or reach the Dask scheduler {self.plan.scheduler}: {self._error}"
            ) from self._error
        return self._client

    def close(self) -> None:
        if self._thread.ident is not None:
            self._thread.join()
        if self._client is not None:
            self._client.close()
        if self._cluster is not None:
            self._cluster.close()


MIN_TASKS_PER_SLOT = 4  # grouping never leaves a worker thread with fewer tasks than this


def group_tasks(tasks: list[ShardTask], target_rows: int, slots: int) -> list[list[ShardTask]]:
    """Pack consecutive small shards into groups of about ``target_rows`` rows.

    The target shrinks so that each of ``slots`` worker threads still gets several groups (a
    few big groups would leave workers idle at the end). A shard at or above the target is a
    group of its own: it is streamed by row group whatever its size.
    """
    total = sum(t.num_rows for t in tasks)
    limit = max(1, min(target_rows, -(-total // max(1, slots * MIN_TASKS_PER_SLOT))))
    groups: list[list[ShardTask]] = []
    current: list[ShardTask] = []
    rows = 0
    for t in tasks:
        if current and rows + t.num_rows > limit:
            groups.append(current)
            current, rows = [], 0
        current.append(t)
        rows += t.num_rows
    if current:
        groups.append(current)
    return groups


def _execute(
    tasks: list[ShardTask],
    plan: Plan,
    config: JobConfig,
    session: DaskSession | None,
) -> Iterator[tuple[ShardTask, ShardResult]]:
    """Run shard tasks on the chosen scheduler, yielding results as they complete."""
    retries = config.errors.task_retries
    if not tasks:
        return
    if plan.scheduler == "sync":
        for t in tasks:
            yield t, _attempts(t, retries)
            checkpoint("between-shards")
        return
    from distributed import as_completed

    assert session is not None
    client = session.client()
    slots = sum(client.nthreads().values()) or 1
    if session.threads_by_host:
        tasks = [
            dataclasses.replace(t, torch_threads_by_host=session.threads_by_host) for t in tasks
        ]
    groups = group_tasks(tasks, config.task_rows, slots)
    resources = dict(config.resources) or None
    by_key: dict[str, list[ShardTask]] = {}
    futures: list[Any] = []
    try:
        for group in groups:
            fut = client.submit(
                score_shards,
                group,
                key=f"score-{group[0].rel_path}-{len(group)}-{uuid.uuid4().hex[:8]}",
                retries=retries,
                resources=resources,
                pure=False,
            )
            by_key[fut.key] = group
            futures.append(fut)
        for fut in as_completed(futures):
            group = by_key[fut.key]
            try:
                results = fut.result()
            except Exception as e:  # the task crashed every retry (or its worker kept dying)
                results = [_crashed(t, e) for t in group]
            for t, result in zip(group, results, strict=True):
                yield t, result
                checkpoint("between-shards")
    finally:
        # Stop what is still running (after a fatal error); the session is closed by run().
        for fut in futures:
            fut.cancel()


def _attempts(task: ShardTask, retries: int) -> ShardResult:
    for attempt in range(retries + 1):
        try:
            return score_shard(task)
        except Exception as e:
            if attempt == retries:
                return _crashed(task, e)
            logger.warning("shard %s crashed (%s); retrying", task.rel_path, e)
    raise AssertionError("unreachable")  # pragma: no cover


def _crashed(task: ShardTask, e: BaseException) -> ShardResult:
    return ShardResult(
        task.rel_path,
        task.input_uri,
        "failed",
        rows_in=task.num_rows,
        kind="error",
        message=f"shard {task.input_uri}: scoring crashed: {type(e).__name__}: {e}",
    )


def run(
    config: JobConfig,
    *,
    on_shard: Callable[[ShardResult], None] | None = None,
    on_start: Callable[[int, int], None] | None = None,
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
        report = _run(config, on_shard, on_start, started_at, t0)
    except PipelineError as e:
        _publish_metrics(config, _failed_summary(config, started_at, time.perf_counter() - t0, e))
        raise
    _publish_metrics(config, report.data)
    return report


def _failed_summary(
    config: JobConfig, started_at: dt.datetime, duration: float, e: PipelineError
) -> dict[str, Any]:
    """What the metrics say about a run that stopped before scoring (exit 2 or 3)."""
    return {
        "job": config.name,
        "status": "failed",
        "started_at": started_at.isoformat(),
        "finished_at": (started_at + dt.timedelta(seconds=duration)).isoformat(),
        "duration_s": duration,
        "rows_out": 0,
        "rows_rejected": 0,
        "shards_failed": 0,
        "rows_per_s": 0.0,
        "drift": None,
        "error": str(e),
    }


def _publish_metrics(config: JobConfig, data: dict[str, Any]) -> None:
    if config.metrics_file is None and config.pushgateway is None:
        return
    from pipeline import metrics

    previous = None
    if config.metrics_file is not None:
        previous = metrics.previous_success_timestamp(config.metrics_file, config.name)
        try:
            metrics.write_metrics_file(config.metrics_file, data, previous_success_ts=previous)
        except PipelineError as e:
            logger.error("%s", e)
    if config.pushgateway is not None:
        if previous is None and data.get("status") == "failed":
            previous = _last_success_from_index(config)
        try:
            metrics.push_metrics(config.pushgateway, data, previous_success_ts=previous)
        except PipelineError as e:
            logger.error("%s", e)


def _last_success_from_index(config: JobConfig) -> float | None:
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


def _run(
    config: JobConfig,
    on_shard: Callable[[ShardResult], None] | None,
    on_start: Callable[[int, int], None] | None,
    started_at: dt.datetime,
    t0: float,
) -> RunReport:
    run_id = new_run_id()
    opts = config.storage
    out_root = storage.locate(config.output_uri(run_id), opts)
    rej_root = storage.locate(config.rejects_uri(run_id), opts)
    input_uri = config.input_uri()
    _check_not_overlapping(storage.locate(input_uri, opts), out_root, rej_root)

    # 1. Plan from footers and the model's dry run: nothing is written before this passes.
    shards = storage.list_shards(input_uri, opts)
    device = resolve_device(config.device)
    spec, _, sha = read_bundle(config.model, opts)
    plan = thread_plan(config, len(shards))
    session = None
    if plan.scheduler != "sync":
        width_hint = len(spec.columns) if spec.columns is not None else spec.dim
        bs_hint = config.batch_size if isinstance(config.batch_size, int) else None
        warm = (
            config.model,
            str(device),
            width_hint,
            dict(opts),
            sha,
            config.precision,
            config.compile,
            config.strict_fp32,
            bs_hint,
            plan.torch_threads,
        )
        session = DaskSession(plan, warm)
    try:
        return _run_planned(
            config,
            run_id,
            started_at,
            t0,
            opts,
            out_root,
            rej_root,
            shards,
            device,
            spec,
            sha,
            plan,
            session,
            on_shard,
            on_start,
        )
    finally:
        if session is not None:
            session.close()


@dataclass(frozen=True)
class Settings:
    """The settings that change output rows; a change rescores every shard on resume."""

    values: dict[str, Any]
    hash: str


def _settings(config: JobConfig, spec: Any) -> Settings:
    values = {
        "inputs": list(spec.input_columns),
        "outputs": [[o.name, o.describe()] for o in spec.outputs],
        "id_column": config.id_column,
        "passthrough": list(config.passthrough),
        "precision": config.precision,
    }
    return Settings(values, settings_hash(values))


class Inspection(NamedTuple):
    """What the footers and the model's dry run say, before anything is scored or written."""

    infos: dict[str, ShardInfo]
    failed: dict[str, ShardResult]  # unreadable shards
    schema_problems: dict[str, list[str]]
    width: int
    model: Any


def inspect_shards(
    config: JobConfig,
    shards: list[ShardRef],
    spec: Any,
    sha: str,
    device: torch.device,
    opts: Any,
) -> Inspection:
    """Read every footer, find the feature width, load the model and check each schema."""
    uris = {s.rel_path: s.uri for s in shards}
    infos: dict[str, ShardInfo] = {}
    failed: dict[str, ShardResult] = {}
    for s in shards:
        try:
            infos[s.rel_path] = read_footer(s.uri, opts)
        except ShardError as e:
            failed[s.rel_path] = ShardResult(
                s.rel_path, s.uri, "failed", rows_in=None, kind="unreadable", message=str(e)
            )
    width = len(spec.columns) if spec.columns is not None else spec.dim
    if width is None:
        widths = {w for i in infos.values() if (w := feature_width(i.schema, spec)) is not None}
        if len(widths) != 1:
            raise ModelError(
                f"model bundle {config.model}: {spec.describe_inputs()} has no inputs.dim and "
                f"the data does not give one fixed list size (found {sorted(widths)}); set "
                "inputs.dim in model.toml"
            )
        width = widths.pop()
    model = load_model(config.model, device, width=width, options=opts, expected_sha256=sha)
    schema_problems: dict[str, list[str]] = {}
    for rel, info in infos.items():
        probs = check_schema(
            info.schema,
            spec,
            width=width,
            id_column=config.id_column,
            passthrough=config.passthrough,
            shard=uris[rel],
        )
        if probs:
            schema_problems[rel] = probs
    return Inspection(infos, failed, schema_problems, width, model)


def _run_planned(
    config: JobConfig,
    run_id: str,
    started_at: dt.datetime,
    t0: float,
    opts: Any,
    out_root: Location,
    rej_root: Location,
    shards: list[ShardRef],
    device: torch.device,
    spec: Any,
    sha: str,
    plan: Plan,
    session: DaskSession | None,
    on_shard: Callable[[ShardResult], None] | None,
    on_start: Callable[[int, int], None] | None = None,
) -> RunReport:
    uris = {s.rel_path: s.uri for s in shards}
    infos, failed, schema_problems, width, model = inspect_shards(
        config, shards, spec, sha, device, opts
    )
    if schema_problems and config.errors.on_schema_error == "fail":
        lines = [p for probs in schema_problems.values() for p in probs]
        raise SchemaError(
            f"{len(schema_problems)} of {len(shards)} shards do not fit model "
            f"{spec.name} v{spec.version} ({spec.describe_inputs()}); nothing was scored. "
            "Fix the input, or set errors.on_schema_error = 'skip_shard' to score the rest:\n"
            + "\n".join(f"  - {p}" for p in lines)
        )
    for rel, probs in schema_problems.items():
        uri = uris[rel]
        failed[rel] = ShardResult(
            rel,
            uri,
            "failed",
            rows_in=infos[rel].num_rows,
            kind="schema",
            message="; ".join(probs),
        )

    # How the model runs: precision, compile, the parity check against fp32, the batch size.
    exec_opts = ExecutionOptions(config.precision, config.compile, config.strict_fp32)
    sample_from = next(
        (s for s in shards if s.rel_path not in failed and infos[s.rel_path].num_rows), None
    )
    batch_size, execution = _prepare_execution(config, model, exec_opts, sample_from, width, plan)

    settings_obj = _settings(config, spec)
    settings, shash = settings_obj.values, settings_obj.hash

    # 2. Lock the output, clear what a crashed run left, and find what is already done.
    lock = RunLock.acquire(out_root, run_id, stale_after_s=config.stale_lock_after_s)
    manifest: Manifest | None = None
    try:
        checkpoint("locked")
        for root in (out_root, rej_root):
            for path in storage.remove_stale_temporaries(root):
                logger.info("removed a temporary file left by an interrupted run: %s", path)
        storage.remove(out_root.child(SUCCESS_NAME))
        manifest = Manifest.load(out_root)
        results: dict[str, ShardResult] = dict(failed)
        tasks: list[ShardTask] = []
        for s in shards:
            if s.rel_path in failed:
                manifest.forget(s.rel_path)
                continue
            info = infos[s.rel_path]
            expect = {
                "fingerprint": {**s.fingerprint(), "num_rows": info.num_rows},
                "model_sha256": sha,
                "settings_hash": shash,
            }
            out_loc = out_root.child(s.rel_path)
            if not config.force and manifest.is_done(s.rel_path, expect, out_loc):
                done = manifest.shards[s.rel_path]
                results[s.rel_path] = ShardResult(
                    s.rel_path,
                    s.uri,
                    "skipped",
                    output=done["output"],
                    rejects=done.get("rejects"),
                    rows_in=done["rows_in"],
                    rows_out=done["rows_scored"],
                    rows_rejected=done["rows_rejected"],
                )
                continue
            tasks.append(
                ShardTask(
                    rel_path=s.rel_path,
                    input_uri=s.uri,
                    output_uri=out_loc.uri,
                    rejects_uri=rej_root.child(s.rel_path).uri,
                    num_rows=info.num_rows,
                    meta_schema=pa.schema(
                        [info.schema.field(c) for c in (config.id_column, *config.passthrough)]
                    )
                    .serialize()
                    .to_pybytes(),
                    model_uri=config.model,
                    model_sha256=sha,
                    device=str(device),
                    width=width,
                    id_column=config.id_column,
                    passthrough=config.passthrough,
                    batch_size=batch_size,
                    precision=config.precision,
                    compile=config.compile,
                    strict_fp32=config.strict_fp32,
                    overlap_depth=OVERLAP_DEPTH if config.overlap else 0,
                    on_invalid_rows=config.errors.on_invalid_rows,
                    torch_threads=plan.torch_threads,
                    storage_options=dict(opts),
                )
            )
        fingerprints = {s.rel_path: s for s in shards}

        # 3. Score. Each finished shard is recorded at once, so a crash loses only shards in flight.
        fatal = None
        if on_start is not None:
            on_start(sum(t.num_rows for t in tasks), len(tasks))
        for task, result in _execute(tasks, plan, config, session):
            results[task.rel_path] = result
            if result.status == "scored":
                s = fingerprints[task.rel_path]
                manifest.record(
                    task.rel_path,
                    {
                        "input": s.uri,
                        "fingerprint": {**s.fingerprint(), "num_rows": task.num_rows},
                        "model_sha256": sha,
                        "settings_hash": shash,
                        "output": result.output,
                        "rejects": result.rejects,
                        "rows_in": result.rows_in,
                        "rows_scored": result.rows_out,
                        "rows_rejected": result.rows_rejected,
                        "run_id": run_id,
                        "scored_at": dt.datetime.now(dt.timezone.utc).isoformat(),
                    },
                )
            else:
                manifest.forget(task.rel_path)
                if result.kind in FATAL_KINDS:
                    fatal = result
            if on_shard is not None:
                on_shard(result)
            if fatal is not None:
                break
        if fatal is not None:
            for t in tasks:
                results.setdefault(
                    t.rel_path,
                    ShardResult(
                        t.rel_path,
                        t.input_uri,
                        "failed",
                        rows_in=t.num_rows,
                        kind="cancelled",
                        message=f"not scored: the run stopped at {fatal.input}",
                    ),
                )

        manifest.flush()

        # 4. Account, judge against the error budget, report, and mark success last.
        ordered = [results[s.rel_path] for s in shards]
        data = _build_report(
            config,
            run_id,
            started_at,
            time.perf_counter() - t0,
            out_root,
            rej_root,
            ordered,
            model,
            device,
            plan,
            settings,
            lock,
            fatal,
            batch_size,
            execution,
        )
        index_root = runindex.index_root(config.output)
        if config.monitoring.drift and data["status"] != "failed":
            data["drift"] = _drift(config, data, index_root)
            if data["drift"].get("alert") and data["status"] == "succeeded":
                data["status"] = "succeeded_with_warnings"
            for reason in data["drift"].get("reasons", []):
                data["warnings"].append(f"drift: {reason}")
                logger.warning("drift: %s", reason)
        report = RunReport(data)
        storage.write_json(out_root.child(REPORT_NAME), data, point="report-rename")
        _write_html(out_root, data)
        _record_run(config, index_root, out_root, data)
        if report.status != "failed":
            storage.write_bytes(out_root.child(SUCCESS_NAME), b"", point="success-rename")
        return report
    finally:
        if manifest is not None:
            # After an unexpected error too: keep what was committed so the rerun skips it.
            with contextlib.suppress(Exception):
                manifest.flush()
        lock.release()


def _drift(config: JobConfig, data: dict[str, Any], index_root: str) -> dict[str, Any]:
    """Compare this run's scores with the previous successful run of the same job."""
    if not data["rows_processed"]:
        # A resume that found every shard done scored nothing: no distribution to compare.
        return {"baseline": None, "note": "this run scored no rows (every shard was done)"}
    try:
        previous = runindex.previous_success(
            index_root,
            config.storage,
            config.name,
            exclude_run_id=data["run_id"],
            scored_only=True,
        )
        # The index entry carries the run's sketches: its _report.json may have been replaced
        # since by a later run into the same output (a resume, a rerun of that night).
        baseline = previous
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


def _write_html(out_root: Location, data: dict[str, Any]) -> None:
    try:
        page = render_html(data)
    except Exception as e:  # the JSON report is the record; the page is a view of it
        logger.warning("could not render %s: %s", HTML_NAME, e)
        return
    storage.write_bytes(out_root.child(HTML_NAME), page.encode("utf-8"), point="html-rename")


def _record_run(
    config: JobConfig, index_root: str, out_root: Location, data: dict[str, Any]
) -> None:
    entry = {
        key: data[key]
        for key in (
            "run_id",
            "job",
            "status",
            "started_at",
            "finished_at",
            "rows_out",
            "rows_processed",
            "output",
        )
    }
    entry["report"] = out_root.child(REPORT_NAME).uri
    entry["outputs"] = {
        col: {"count": v.get("count"), "sketch": v.get("sketch")}
        for col, v in (data.get("outputs") or {}).items()
    }
    try:
        runindex.record(index_root, config.storage, config.name, entry)
    except Exception as e:
        logger.warning("could not record the run in the index at %s: %s", index_root, e)


def _sample_rows(config: JobConfig, model: Any, shard: ShardRef, width: int) -> torch.Tensor:
    """Up to SAMPLE_ROWS valid feature rows from the start of ``shard``."""
    data = ShardBatches(
        shard.uri,
        model.spec,
        width=width,
        meta_columns=(config.id_column,),
        batch_size=SAMPLE_ROWS,
        storage_options=config.storage,
    )
    for batch in data:
        return batch.tensor[torch.from_numpy(batch.features.valid)].clone()
    return torch.zeros(0, width)


def _prepare_execution(
    config: JobConfig,
    model: Any,
    opts: ExecutionOptions,
    sample_from: ShardRef | None,
    width: int,
    plan: Plan,
) -> tuple[int, dict[str, Any]]:
    """Set the model up as configured, check it against fp32 on real rows, pick the batch size.

    Runs in the driver before anything is written, so a precision that is too far from fp32
    fails the run up front (exit 3), never after hours of scoring.
    """
    prepared, compile_s = prepare(model, opts)
    execution: dict[str, Any] = {
        "precision": opts.precision,
        "compile": opts.compile,
        "compile_s": compile_s,
        "tf32": model.device.type == "cuda" and not opts.strict_fp32,
        "overlap": config.overlap,
        "parity": None,
        "batch_size_auto": None,
    }
    needs_parity = opts.precision != "fp32" or model.device.type != "cpu" or opts.compile
    need_sample = needs_parity or config.batch_size == "auto"
    x = _sample_rows(config, model, sample_from, width) if need_sample and sample_from else None
    if needs_parity:
        tol = config.parity_tolerance
        tol = DEFAULT_TOLERANCE[opts.precision] if tol is None else tol
        if x is None or not len(x):
            execution["parity"] = {"rows": 0, "tolerance": tol, "columns": {}, "note": "no rows"}
        else:
            reference = load_model(config.model, "cpu", width=width, options=config.storage)
            rows = x[:PARITY_ROWS]
            cols = parity(reference, prepared, rows)
            execution["parity"] = {
                "rows": len(rows),
                "tolerance": tol,
                "columns": cols,
                "reference": "fp32 on the CPU",
            }
            check_parity(cols, opts.precision, tol, f"model bundle {config.model}")
    if config.batch_size != "auto":
        return int(config.batch_size), execution
    from pipeline import tuning

    key = tuning.cache_key(model.sha256, model.device, opts.precision, plan.torch_threads)
    cache = tuning.BatchSizeCache(tuning.default_cache_path())
    cached = cache.get(key)
    if cached is not None:
        execution["batch_size_auto"] = {"cached": True, "key": key, "batch_size": cached}
        return cached, execution
    if x is None or not len(x):
        x = torch.randn(SAMPLE_ROWS, width)
    before = torch.get_num_threads()
    torch.set_num_threads(plan.torch_threads or before)  # measure as the workers will run
    try:
        chosen, sweep = tuning.auto_batch_size(lambda t: forward(prepared, t), x, model.device)
    finally:
        torch.set_num_threads(before)
    cache.put(key, chosen, sweep)
    execution["batch_size_auto"] = {
        "cached": False,
        "key": key,
        "batch_size": chosen,
        "sweep": [dataclasses.asdict(r) for r in sweep],
    }
    logger.info("batch size auto: %d (sweep of %d sizes)", chosen, len(sweep))
    return chosen, execution


def _build_report(
    config: JobConfig,
    run_id: str,
    started_at: dt.datetime,
    duration: float,
    out_root: Location,
    rej_root: Location,
    shards: list[ShardResult],
    model: Any,
    device: Any,
    plan: Plan,
    settings: dict[str, Any],
    lock: RunLock,
    fatal: ShardResult | None,
    batch_size: int,
    execution: dict[str, Any],
) -> dict[str, Any]:
    errors = [
        {"shard": r.input, "kind": r.kind, "message": r.message}
        for r in shards
        if r.status == "failed"
    ]
    warnings: list[str] = []
    dups = sum(r.duplicate_ids for r in shards if r.status == "scored")
    if dups:
        warnings.append(
            f"{dups} rows have a {config.id_column} that appeared earlier in the same shard ("
            + ", ".join(f"{r.rel_path}: {r.duplicate_ids}" for r in shards if r.duplicate_ids)
            + "); they were scored, each once"
        )
    if lock.took_over:
        warnings.append(f"took over a stale lock: {lock.took_over['reason']}")
    for w in warnings:
        logger.warning("%s", w)
    for r in shards:
        if r.status != "failed" and r.rows_in != r.rows_out + r.rows_rejected:
            errors.append(
                {
                    "shard": r.input,
                    "kind": "accounting",
                    "message": f"shard {r.input}: rows in ({r.rows_in}) != rows scored "
                    f"({r.rows_out}) + rows rejected ({r.rows_rejected})",
                }
            )
    readable = [r for r in shards if r.rows_in is not None and r.status != "failed"]
    rows_in = sum(r.rows_in or 0 for r in shards if r.rows_in is not None)
    rows_out = sum(r.rows_out for r in readable)
    rows_rej = sum(r.rows_rejected for r in readable)
    scored = [r for r in shards if r.status == "scored"]
    n_failed = sum(r.status == "failed" for r in shards)
    processed = sum(r.rows_in or 0 for r in scored)
    budget = config.errors
    denom = sum(r.rows_in or 0 for r in readable)
    rejected_fraction = rows_rej / denom if denom else 0.0
    accounting_ok = not any(e["kind"] == "accounting" for e in errors)
    reasons = []
    if fatal is not None:
        reasons.append(f"fatal error in {fatal.input} ({fatal.kind})")
    if n_failed > budget.max_failed_shards:
        reasons.append(
            f"{n_failed} failed shards > errors.max_failed_shards = {budget.max_failed_shards}"
        )
    if rejected_fraction > budget.max_rejected_fraction:
        reasons.append(
            f"rejected fraction {rejected_fraction:.4g} > "
            f"errors.max_rejected_fraction = {budget.max_rejected_fraction}"
        )
    if not accounting_ok:
        reasons.append("rows in != rows scored + rows rejected for some shard")
    if reasons:
        status = "failed"
    elif n_failed or rows_rej:
        status = "succeeded_with_errors"
    else:
        status = "succeeded"
    finished = started_at + dt.timedelta(seconds=duration)
    spec = model.spec
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "job": config.name,
        "status": status,
        "failure_reasons": reasons,
        "started_at": started_at.isoformat(),
        "finished_at": finished.isoformat(),
        "duration_s": duration,
        "input": storage.locate(config.input_uri(), config.storage).uri,
        "output": out_root.uri,
        "rejects": rej_root.uri,
        "rows_in": rows_in,
        "rows_out": rows_out,
        "rows_rejected": rows_rej,
        "rows_processed": processed,
        "rows_per_s": processed / duration if duration > 0 else 0.0,
        "rejected_fraction": rejected_fraction,
        "accounting_ok": accounting_ok,
        "shards_total": len(shards),
        "shards_scored": len(scored),
        "shards_skipped": sum(r.status == "skipped" for r in shards),
        "shards_failed": n_failed,
        "batch_size": batch_size,
        "execution": execution,
        "device": str(device),
        "threads": plan.public(),
        "model": {
            "uri": config.model,
            "name": spec.name,
            "version": spec.version,
            "format": spec.format,
            "sha256": model.sha256,
            "width": model.width,
            "out_width": model.out_width,
        },
        "settings": settings,
        "error_budget": {
            "max_failed_shards": budget.max_failed_shards,
            "max_rejected_fraction": budget.max_rejected_fraction,
        },
        "lock_taken_over": lock.took_over,
        "oom_splits": sum(r.oom_splits for r in scored),
        "duplicate_ids": sum(r.duplicate_ids for r in scored),
        "versions": versions(),
        "batch_latency_ms": latency_summary(scored),
        "outputs": output_summary(scored),
        "rejects_by_reason": _rejects_by_reason(shards),
        "throughput": _throughput(scored, started_at.timestamp()),
        "drift": None,
        "errors": errors,
        "warnings": warnings,
        "shards": [_shard_entry(r, started_at.timestamp()) for r in shards],
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
    points = [{"t_s": 0.0, "rows": 0}]
    rows = 0
    for r in sorted(
        (r for r in scored if r.finished_at is not None), key=lambda r: r.finished_at or 0.0
    ):
        rows += r.rows_in or 0
        points.append({"t_s": max(0.0, (r.finished_at or t0) - t0), "rows": rows})
    return points
