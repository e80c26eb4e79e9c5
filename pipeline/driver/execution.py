"""How the model will run, decided before anything is written: precision and compile, the parity
check against fp32 on real rows, and the batch size (``batch_size = "auto"`` measures the whole
worker path on a sample of the first shard). The :class:`Execution` is the report's
``execution`` section. A precision too far from fp32 fails the run up front (exit 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.core.config import JobConfig
from pipeline.core.errors import ModelError
from pipeline.core.statuses import ShardStatus
from pipeline.driver.cluster import Plan
from pipeline.driver.inspect import Inspection
from pipeline.driver.workers import model_spec, worker_spec
from pipeline.io.listing import ShardRef
from pipeline.io.parquet import open_parquet
from pipeline.model import tuning
from pipeline.model.bundle import Inputs, rows_of
from pipeline.model.precision import (
    DEFAULT_TOLERANCE,
    PARITY_ROWS,
    ExecutionOptions,
    check_parity,
    parity,
    prepare,
)
from pipeline.model.program import LoadedModel, check_batch_size, forward, load_model
from pipeline.worker.batching import ShardBatches
from pipeline.worker.shard import ShardResult, score_shard
from pipeline.worker.spec import ShardTask

logger = logging.getLogger(__name__)

SAMPLE_ROWS = 65_536  # real rows read up front for the parity check (and plan's calibration)


def sample_rows(config: JobConfig, model: LoadedModel, shard: ShardRef) -> Inputs:
    """Up to SAMPLE_ROWS valid rows of the model's inputs from the start of ``shard``."""
    data = ShardBatches(
        shard.uri,
        model.spec,
        widths=model.widths,
        meta_columns=(config.id_column,),
        batch_size=SAMPLE_ROWS,
        storage_options=config.storage,
    )
    for batch in data:
        valid = torch.from_numpy(batch.features.valid)
        return tuple(t[valid].clone() for t in batch.tensors)
    return model.example(0, device="cpu")


class Execution(NamedTuple):
    """How the model runs: the batch size, the rows per model call (None: one call per batch),
    and the ``execution`` section of the report."""

    batch_size: int
    report: dict[str, Any]
    call_rows: int | None = None
    warnings: tuple[str, ...] = ()  # said before scoring, kept for the report


def plan_execution(
    config: JobConfig,
    shards: list[ShardRef],
    failed: Mapping[str, ShardResult],
    found: Inspection,
    plan: Plan,
) -> Execution:
    """:func:`prepare_execution` with the options of ``config``, sampling real rows from the
    first shard that is neither failed nor empty."""
    opts = ExecutionOptions(config.precision, config.compile, config.strict_fp32, config.engine)
    sample_from = next(
        (s for s in shards if s.rel_path not in failed and found.infos[s.rel_path].num_rows),
        None,
    )
    rows = sum(found.infos[s.rel_path].num_rows for s in shards if s.rel_path not in failed)
    return prepare_execution(config, found.model, opts, sample_from, plan, job_rows=rows)


def prepare_execution(
    config: JobConfig,
    model: LoadedModel,
    opts: ExecutionOptions,
    sample_from: ShardRef | None,
    plan: Plan,
    *,
    job_rows: int = 0,
) -> Execution:
    """Set the model up as configured, check it against fp32 on real rows, pick the batch size.

    Runs in the driver before anything is written, so a precision that is too far from fp32
    fails the run up front (exit 3), never after hours of scoring. ``job_rows`` (the rows the
    run will score) sizes the ``batch_size = "auto"`` sweep.
    """
    prepared, compile_s = prepare(model, opts)
    execution: dict[str, Any] = {
        "precision": opts.precision,
        "engine": opts.engine,
        "compile": opts.compile,
        "compile_s": compile_s,
        "tf32": model.device.type == "cuda" and not opts.strict_fp32,
        "overlap": plan.overlap,
        "parity": None,
        "batch_size_auto": None,
        "call_rows": None,
    }
    needs_parity = (
        opts.precision != "fp32"
        or model.device.type != "cpu"
        or opts.compile
        or opts.engine != "torch"
    )
    if needs_parity:
        # (batch_size = "auto" reads its own sample: the raw rows, for the whole pipeline.)
        x = sample_rows(config, model, sample_from) if sample_from else None
        execution["parity"] = _parity(config, prepared, opts, x)
    if config.batch_size != "auto":
        batch = int(config.batch_size)
        check_batch_size(model, batch)
    else:
        batch = _default_batch(prepared)
    measured, calls, warned = _call_rows(config, prepared, opts, plan, batch, job_rows)
    if config.batch_size == "auto":
        batch, execution["batch_size_auto"] = _auto_batch_size(
            config, prepared, sample_from, plan, job_rows, measured
        )
    call_rows = measured if measured is not None and measured < batch else None
    if calls is not None:
        execution["call_rows"] = {**calls, "rows": call_rows or batch}
    return Execution(batch, execution, call_rows, warned)


def _parity(
    config: JobConfig,
    prepared: LoadedModel,
    opts: ExecutionOptions,
    x: Inputs | None,
) -> dict[str, Any]:
    tol = config.parity_tolerance
    tol = DEFAULT_TOLERANCE[opts.precision] if tol is None else tol
    if x is None or not rows_of(x):
        return {"rows": 0, "tolerance": tol, "columns": {}, "note": "no rows"}
    reference = load_model(config.model, "cpu", widths=prepared.widths, options=config.storage)
    rows = tuple(t[:PARITY_ROWS] for t in x)
    cols = parity(reference, prepared, rows)
    found = {
        "rows": rows_of(rows),
        "tolerance": tol,
        "columns": cols,
        "reference": "fp32 on the CPU" if opts.engine == "torch" else "torch fp32 on the CPU",
    }
    check_parity(cols, opts.precision, tol, f"model bundle {config.model}", engine=opts.engine)
    return found


#: Rows of the first shard the ``batch_size = "auto"`` sweep scores at each size (sizes up to
#: it: 1,024 to 16,384), the time it may take on a cold cache (a round of every size takes
#: about 0.15 s here, so two or three rounds: under 10% of a 2M-row nightly job, 4.3 s), and
#: the size it keeps unless another is measurably faster.
AUTO_SAMPLE_ROWS = 16_384
AUTO_BUDGET_S = 0.3
#: A slow model's sweep may take this share of the job's estimated scoring time instead (the
#: estimate: one probe batch's seconds per row x the job's rows / workers). A sweep that cannot
#: fit a round of every size over twice the default's rows in its budget is not run: a
#: 2048-wide MLP at 10k rows/s took 8-12 s, a third of a 200k-row job, and chose no better.
AUTO_JOB_SHARE = 0.05
DEFAULT_BATCH_SIZE = 4096
#: For tests only: rows per sweep pass, fixed, instead of what the probe's speed fits in the
#: budget. Which sizes the sweep measures then does not depend on how busy the machine is
#: (docs/development.md); how many rounds it runs still does.
SWEEP_ROWS_ENV = "_SCORE_CATALOG_AUTO_SWEEP_ROWS"


def auto_cache_key(
    model: LoadedModel, precision: str, threads: int | None, engine: str = "torch"
) -> str:
    """The batch-size cache key of ``batch_size = "auto"``'s choice (``plan`` reads it too);
    another engine's best size is its own (torch's keys stay what they were)."""
    key = tuning.cache_key(model.sha256, model.device, precision, threads) + "|pipeline"
    return key if engine == "torch" else f"{key}|{engine}"


def _auto_batch_size(
    config: JobConfig,
    prepared: LoadedModel,
    sample_from: ShardRef | None,
    plan: Plan,
    job_rows: int,
    call_rows: int | None = None,
) -> tuple[int, dict[str, Any]]:
    """``batch_size = "auto"``: the size the whole pipeline scores fastest at, measured on
    real rows (:func:`pipeline.model.tuning.choose_by_rate` on :func:`pipeline_step`), cached per
    model, device, precision and thread count. The sweep's rows and time are sized by a probe
    batch so that it costs at most :data:`AUTO_BUDGET_S` or :data:`AUTO_JOB_SHARE` of the
    job's ``job_rows`` (:func:`_sweep_rows`)."""
    key = auto_cache_key(prepared, config.precision, plan.torch_threads, config.engine)
    # The choice is the CPU's as much as the model's (its caches, its instructions): an entry
    # measured on another CPU model or flags is measured again (tuning.cpu_identity).
    cache = tuning.BatchSizeCache(tuning.default_cache_path())
    cpu = tuning.cpu_summary(cache.cpu)
    limit = prepared.max_batch
    default = _default_batch(prepared)
    sizes = [b for b in tuning.PIPELINE_SIZES if limit is None or b <= limit]
    cached = cache.get(key, allowed={*sizes, default})
    if cached is not None:
        return cached, {"cached": True, "key": key, "batch_size": cached, "cpu": cpu}
    if sample_from is None:
        logger.info("batch size auto: no readable rows to measure; using %d", default)
        return default, {"cached": False, "key": key, "batch_size": default, "cpu": cpu}
    before = torch.get_num_threads()
    try:
        n, rows, chosen, sweep, facts = _sweep(
            config, prepared, sample_from, plan, job_rows, call_rows, sizes, default
        )
    finally:
        torch.set_num_threads(before)  # the sweep ran as the workers will (plan.torch_threads)
    if len(sweep) > 1:
        try:
            cache.put(key, chosen, sweep)
        except OSError as e:  # a cache must never stop a run: it measures again next time
            logger.warning("batch size auto: cannot write %s (%s)", cache.path, e)
    elif n is not None:
        # A first shard smaller than every other size: nothing was compared, and a later run
        # over bigger shards must measure instead of reusing this.
        logger.info(
            "batch size auto: the sample (%d rows) fits no size but %d; using it, not cached",
            rows,
            chosen,
        )
    return chosen, {
        "cached": False,
        "key": key,
        "batch_size": chosen,
        "cpu": cpu,
        "basis": "pipeline",
        **({"noise": facts["noise"]} if "noise" in facts else {}),
        "sweep_s": facts["sweep_s"],
        "sweep": [dataclasses.asdict(r) for r in sweep],
    }


def _sweep(
    config: JobConfig,
    prepared: LoadedModel,
    sample_from: ShardRef,
    plan: Plan,
    job_rows: int,
    call_rows: int | None,
    sizes: list[int],
    default: int,
) -> tuple[int | None, int, int, list[tuning.BenchRow], dict[str, Any]]:
    """The sweep of :func:`_auto_batch_size` on real rows: (rows per pass, or None when a sweep
    would not fit its budget; rows the sample has; the size chosen; the sweep; its facts)."""
    with pipeline_step(config, prepared, sample_from, plan, call_rows) as (step, rows):
        t0 = time.perf_counter()
        probe = min(rows, default)
        # The first pass is cold (allocations, first writes): timed alone it made the sweep
        # look 3-5x too slow to fit its budget, and the size was never measured.
        per_row = min(step(default, probe), step(default, probe)) / probe
        workers = plan.workers or 1
        budget = max(AUTO_BUDGET_S, AUTO_JOB_SHARE * per_row * job_rows / workers)
        fixed = os.environ.get(SWEEP_ROWS_ENV, "")
        n = (
            min(rows, int(fixed))
            if fixed.isdigit()
            else _sweep_rows(rows, per_row, budget, len(sizes), default)
        )
        if n is None:
            logger.info(
                "batch size auto: a sweep would take more than %.1fs (%.0f rows/s on a probe "
                "batch); using %d, not cached",
                budget,
                1 / per_row,
                default,
            )
            return None, rows, default, [], {"sweep_s": time.perf_counter() - t0}
        width = n
        chosen, sweep, facts = tuning.choose_by_rate(
            lambda b: step(b, width),
            [b for b in sizes if b <= n],
            rows=n,
            default=default,
            budget_s=budget - (time.perf_counter() - t0),
        )
        facts["sweep_s"] = time.perf_counter() - t0
        return n, rows, chosen, sweep, facts


def _default_batch(model: LoadedModel) -> int:
    """The default batch size, never past what the program was exported for
    (model.check_batch_size)."""
    limit = model.max_batch
    return DEFAULT_BATCH_SIZE if limit is None else min(DEFAULT_BATCH_SIZE, limit)


#: What measuring the rows per model call may cost on a cold cache: 0.2 s, or
#: :data:`AUTO_JOB_SHARE` of the job's estimated scoring time when that is more. The demo MLP
#: measures its five sizes four times in about 0.15 s here; a model whose two rounds do not fit
#: (a 64-1024-1024-8 MLP: 0.15 s per 4,096-row call) keeps one call per batch, and the
#: decision is cached all the same. A job of fewer than :data:`CALL_MIN_BATCHES` batches is
#: not worth measuring for.
CALL_BUDGET_S = 0.2
CALL_MIN_BATCHES = 8


def _call_rows(
    config: JobConfig,
    prepared: LoadedModel,
    opts: ExecutionOptions,
    plan: Plan,
    batch: int,
    job_rows: int,
) -> tuple[int | None, dict[str, Any] | None, tuple[str, ...]]:
    """Rows per model call on this CPU (:func:`pipeline.model.tuning.choose_call_rows`), cached
    per model, precision, engine, torch threads and CPU like the batch size, with the report's
    ``call_rows`` and any warning for the report; (None, None, ()) where it is not measured: a
    CUDA device (big calls are what a GPU wants), ``--compile`` (every call size would be a
    graph to compile) or a job of fewer than CALL_MIN_BATCHES batches."""
    n = min(batch, tuning.CALL_SAMPLE_ROWS)
    small = job_rows < CALL_MIN_BATCHES * n or n <= min(tuning.CALL_SIZES)
    if prepared.device.type != "cpu" or opts.compile or small:
        return None, None, ()
    key = auto_cache_key(prepared, config.precision, plan.torch_threads, config.engine)
    key += f"|calls{n}"
    cache = tuning.BatchSizeCache(tuning.default_cache_path())
    found: dict[str, Any] = {"key": key, "cpu": tuning.cpu_summary(cache.cpu)}
    before = torch.get_num_threads()
    try:
        if plan.torch_threads:  # measured as the workers will run (plan.torch_threads)
            torch.set_num_threads(plan.torch_threads)
        # In every run, cached or not, before anything is split: 2 calls of 256 rows.
        check = prepared.example(CHECK_ROWS, random=True, device="cpu")
        gap = _slicing_gap(prepared, check, CHECK_ROWS // 4)
        if gap > SLICE_TOLERANCE:
            warning = (
                f"model bundle {config.model}: a row's output depends on the other rows in its "
                f"call (max difference {gap:.3g} between one call of {CHECK_ROWS} rows and "
                f"calls of {CHECK_ROWS // 4}), so its scores change with the batch size and "
                "with where a row sits in its shard; batches are not split. Export the model "
                "after model.eval() (BatchNorm, dropout) so that each row is scored on its own."
            )
            logger.warning("%s", warning)
            note = f"not split: outputs depend on the call's other rows ({gap:.3g})"
            return None, {**found, "cached": False, "note": note}, (warning,)
        sizes = [c for c in tuning.CALL_SIZES if c < n] + [n]
        cached = cache.get(key, allowed=sizes)
        if cached is not None:
            return (cached if cached < n else None), {**found, "cached": True}, ()
        x = prepared.example(n, random=True, device="cpu")
        chosen, sweep, facts = _measure_call_rows(prepared, plan, x, job_rows)
    finally:
        torch.set_num_threads(before)
    logger.info(
        "rows per model call: %s (%s)",
        f"{chosen:,} of every {n:,}-row batch" if chosen < n else "one call per batch",
        facts.get("note") or f"measured in {facts['sweep_s']:.2f}s",
    )
    try:
        cache.put(key, chosen, sweep)
    except OSError as e:  # a read-only cache folder costs a new measurement next time, no more
        logger.warning("rows per model call: cannot write %s (%s)", cache.path, e)
    return (
        (chosen if chosen < n else None),
        {
            **found,
            "cached": False,
            **{k: facts[k] for k in ("noise", "note") if k in facts},
            "sweep_s": facts["sweep_s"],
            "sweep": [dataclasses.asdict(r) for r in sweep],
        },
        (),
    )


def _measure_call_rows(
    prepared: LoadedModel, plan: Plan, x: Inputs, job_rows: int
) -> tuple[int, list[tuning.BenchRow], dict[str, Any]]:
    """The measurement behind :func:`_call_rows`, within its budget (CALL_BUDGET_S)."""
    n = rows_of(x)
    t0 = time.perf_counter()
    with torch.inference_mode():
        forward(prepared, x)  # first call at this shape: allocations, kernel choice
        t1 = time.perf_counter()
        forward(prepared, x)
    probe = time.perf_counter() - t1
    budget = max(CALL_BUDGET_S, AUTO_JOB_SHARE * probe / n * job_rows / (plan.workers or 1))
    sizes = 1 + sum(1 for c in tuning.CALL_SIZES if c < n)
    if 2 * sizes * probe > budget:
        note = f"not measured: one {n}-row call takes {probe:.3f}s"
        return n, [], {"note": note, "sweep_s": time.perf_counter() - t0}
    chosen, sweep, facts = tuning.choose_call_rows(
        lambda xs: forward(prepared, xs),
        x,
        prepared.device,
        batch=n,
        budget_s=budget - (time.perf_counter() - t0),
    )
    facts["sweep_s"] = time.perf_counter() - t0
    return chosen, sweep, facts


#: Rows of the check that a model scores each row on its own (one call, then four calls).
CHECK_ROWS = 256
#: The largest difference between a batch's outputs called whole and in slices that is still
#: rounding: on the bench's MLPs the two were the same bits; a model that normalises over its
#: batch differs by far more.
SLICE_TOLERANCE = 1e-5


def _slicing_gap(model: LoadedModel, x: Inputs, call_rows: int) -> float:
    """Max |difference| between ``x``'s outputs in one call and in calls of ``call_rows``."""
    n = rows_of(x)
    with torch.inference_mode():
        whole = forward(model, x).float()
        parts = [
            forward(model, tuple(t[i : i + call_rows] for t in x)) for i in range(0, n, call_rows)
        ]
        sliced = torch.cat(parts).float()
    if whole.shape != sliced.shape:
        return math.inf
    return float((whole - sliced).abs().nan_to_num(nan=0.0).max()) if n else 0.0


def row_dependence(model: LoadedModel) -> float | None:
    """The largest difference between the outputs of :data:`CHECK_ROWS` random rows in one
    call and in four, where it is more than rounding (:data:`SLICE_TOLERANCE`): a model whose
    output for a row depends on the other rows of its call (BatchNorm in training mode). None
    for a model that scores each row on its own."""
    rows = min(CHECK_ROWS, model.max_batch or CHECK_ROWS)
    gap = _slicing_gap(model, model.example(rows, random=True), max(1, rows // 4))
    return gap if gap > SLICE_TOLERANCE else None


def _sweep_rows(
    rows: int, per_row: float, budget_s: float, n_sizes: int, default: int
) -> int | None:
    """Rows per pass such that a round of all ``n_sizes`` sizes fits ``budget_s`` at
    ``per_row`` seconds a row (at most the sample's ``rows``); None when that leaves fewer
    than twice the default's rows, too few to tell sizes apart."""
    n = min(rows, int(budget_s / (max(n_sizes, 1) * max(per_row, 1e-12))))
    return n if n >= min(rows, 2 * default) else None


@contextlib.contextmanager
def pipeline_step(
    config: JobConfig,
    model: LoadedModel,
    shard: ShardRef,
    plan: Plan,
    call_rows: int | None = None,
) -> Iterator[tuple[Callable[[int, int], float], int]]:
    """``step(batch, rows)``: score a local copy of the first ``rows`` (up to
    :data:`AUTO_SAMPLE_ROWS`) rows of ``shard`` through the workers' own code
    (:func:`pipeline.worker.shard.score_shard`: read, features, model, output columns, statistics,
    write, commit, with the run's precision, overlap and thread count) into a scratch folder,
    and return its seconds; and the sample's rows."""
    meta_cols = (config.id_column, *config.passthrough)
    columns = list(dict.fromkeys([*meta_cols, *model.spec.input_columns]))
    with open_parquet(shard.uri, config.storage) as pf:
        pieces, have = [], 0
        for rb in pf.iter_batches(batch_size=8192, columns=columns, use_threads=False):
            pieces.append(rb)
            have += rb.num_rows
            if have >= AUTO_SAMPLE_ROWS:
                break
    table = pa.Table.from_batches(pieces).slice(0, AUTO_SAMPLE_ROWS)
    with tempfile.TemporaryDirectory(prefix="score-catalog-auto-") as tmp:
        samples: dict[int, str] = {}

        def sample_of(rows: int) -> str:
            if rows not in samples:
                samples[rows] = os.path.join(tmp, f"sample-{rows}.parquet")
                pq.write_table(table.slice(0, rows), samples[rows], row_group_size=8192)
            return samples[rows]

        # The sample is a local file: no storage options (the model is this process's already).
        local: dict[str, object] = {}
        device = str(model.device)
        spec_model = model_spec(config, model.sha256, device, model.widths, storage_options=local)
        meta = pa.schema([table.schema.field(c) for c in meta_cols]).serialize().to_pybytes()

        def step(batch: int, rows: int) -> float:
            rows = min(rows, table.num_rows)
            task = ShardTask(
                "sample.parquet",
                sample_of(rows),
                os.path.join(tmp, f"out-{batch}.parquet"),
                os.path.join(tmp, f"rejects-{batch}.parquet"),
                rows,
                meta,
            )
            spec = worker_spec(
                config,
                spec_model,
                batch_size=batch,
                overlap=plan.overlap,
                torch_threads=plan.torch_threads,
                storage_options=local,
                call_rows=call_rows if call_rows is not None and call_rows < batch else None,
            )
            t0 = time.perf_counter()
            result = score_shard(spec, task)
            seconds = time.perf_counter() - t0
            if result.status != ShardStatus.SCORED:
                raise ModelError(
                    f"batch size auto: the sample could not be scored: {result.message}"
                )
            return seconds

        yield step, table.num_rows
