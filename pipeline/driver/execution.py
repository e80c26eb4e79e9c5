"""How the model will run, decided before anything is written: precision and compile, the parity
check against fp32 on real rows, and the batch size (``batch_size = "auto"`` measures the whole
worker path on a sample of the first shard). The :class:`Execution` is the report's
``execution`` section. A precision too far from fp32 fails the run up front (exit 3).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from pipeline.core.config import JobConfig
from pipeline.driver import autotune
from pipeline.driver.cluster import Plan
from pipeline.driver.inspect import Inspection
from pipeline.io.listing import ShardRef
from pipeline.model.bundle import Inputs, rows_of
from pipeline.model.precision import (
    DEFAULT_TOLERANCE,
    PARITY_ROWS,
    ExecutionOptions,
    check_parity,
    parity,
    prepare,
)
from pipeline.model.program import LoadedModel, check_batch_size, load_model
from pipeline.worker.batching import ShardBatches
from pipeline.worker.shard import ShardResult

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
        batch = autotune.default_batch(prepared)
    measured, calls, warned = autotune.call_rows(config, prepared, opts, plan, batch, job_rows)
    if config.batch_size == "auto":
        batch, execution["batch_size_auto"] = autotune.auto_batch_size(
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
