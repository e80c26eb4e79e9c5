"""The worker contract of a run, made here and nowhere else: :func:`worker_spec` builds the
:class:`~pipeline.worker.spec.WorkerSpec` every shard is scored with, once, from what the run
knows when it scores (its lock, its cluster, how it reports progress); nothing patches it after.
The cluster is warmed earlier, before the lock, with the model's record alone
(:func:`model_spec`)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from pipeline.core.config import JobConfig
from pipeline.model.precision import ExecutionOptions
from pipeline.model.registry import ModelSource
from pipeline.sinks.base import FileFacts
from pipeline.worker.shard import OVERLAP_DEPTH
from pipeline.worker.spec import (
    Fence,
    Incremental,
    ModelSpec,
    Scoring,
    ShardIO,
    StopSignals,
    Threads,
    WorkerSpec,
)


def model_spec(
    config: JobConfig,
    sha256: str,
    device: str,
    widths: tuple[int, ...] | None,
    source: ModelSource | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> ModelSpec:
    """The model of a run of ``config``: its bundle (a registry model's download, with the
    pinned version a worker elsewhere fetches itself), device, input widths and precision."""
    reg = source.registry if source is not None else None
    return ModelSpec(
        uri=config.model,
        sha256=sha256,
        device=device,
        widths=widths,
        execution=ExecutionOptions(
            config.precision, config.compile, config.strict_fp32, config.engine
        ),
        storage_options=dict(config.storage if storage_options is None else storage_options),
        registry_uri=reg.pinned if reg is not None else "",
        tracking_uri=reg.tracking_uri if reg is not None else "",
    )


def worker_spec(  # noqa: PLR0913  (keyword-only: each is one part of the contract)
    config: JobConfig,
    model: ModelSpec,
    *,
    batch_size: int,
    overlap: bool,
    torch_threads: int | None,
    threads_by_host: Mapping[str, int] | None = None,
    settings_hash: str = "",
    model_version: str = "",
    fence: Fence | None = None,
    signals: StopSignals | None = None,
    storage_options: Mapping[str, Any] | None = None,
    file_facts: FileFacts | None = None,
    call_rows: int | None = None,
    incremental: Incremental | None = None,
) -> WorkerSpec:
    """What every shard of a run of ``config`` is scored with."""
    return WorkerSpec(
        model=model,
        threads=Threads(torch_threads, dict(threads_by_host or {})),
        scoring=Scoring(
            batch_size=batch_size,
            overlap_depth=OVERLAP_DEPTH if overlap else 0,
            on_invalid_rows=config.errors.on_invalid_rows,
            call_rows=call_rows,
        ),
        io=ShardIO(
            id_column=config.id_column,
            passthrough=tuple(config.passthrough),
            settings_hash=settings_hash,
            model_version=model_version,
            storage_options=dict(config.storage if storage_options is None else storage_options),
            file_facts=file_facts,
        ),
        fence=fence if fence is not None else Fence(),
        signals=signals if signals is not None else StopSignals(),
        incremental=incremental if incremental is not None else Incremental(),
    )


def run_signals(*, on_cluster: bool, progress: bool) -> StopSignals:
    """Names for a run's stop flags (on a cluster) and progress topic (when someone listens),
    unique: an external cluster's workers outlive the run."""
    tag = uuid.uuid4().hex[:8]
    return StopSignals(
        stop=f"score-catalog-stop-{tag}" if on_cluster else "",
        abandon=f"score-catalog-abandon-{tag}" if on_cluster else "",
        progress=f"score-catalog-progress-{tag}" if progress else "",
    )
