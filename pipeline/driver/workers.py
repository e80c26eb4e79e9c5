"""The worker contract of a run: the :class:`~pipeline.worker.shard.WorkerSpec` its shards are
scored with, made here and nowhere else."""

from __future__ import annotations

import dataclasses

from pipeline.core.config import JobConfig
from pipeline.driver.cluster import Plan
from pipeline.driver.phases import Prepared
from pipeline.io.locking import RunLock
from pipeline.model.bundle import BundleSpec
from pipeline.model.registry import ModelSource
from pipeline.worker.shard import OVERLAP_DEPTH, WorkerSpec


def _spec(
    config: JobConfig,
    plan: Plan,
    sha: str,
    device: str,
    source: ModelSource,
    widths: tuple[int, ...] | None,
    batch_size: int | None,
    settings_hash: str = "",
) -> WorkerSpec:
    spec = WorkerSpec.for_job(
        config,
        sha,
        device,
        widths,
        batch_size,
        overlap_depth=OVERLAP_DEPTH if plan.overlap else 0,
        torch_threads=plan.torch_threads,
        settings_hash=settings_hash,
    )
    reg = source.registry
    if reg is None:
        return spec
    return dataclasses.replace(
        spec, model_version=reg.pinned, registry_uri=reg.pinned, tracking_uri=reg.tracking_uri
    )


def warm_spec(
    config: JobConfig, plan: Plan, bundle: BundleSpec, sha: str, device: str, source: ModelSource
) -> WorkerSpec:
    """What the workers load the model with while the driver reads footers."""
    fixed = [i.fixed_width() for i in bundle.inputs]
    widths = None if None in fixed else tuple(w for w in fixed if w is not None)
    batch = config.batch_size if isinstance(config.batch_size, int) else None
    return _spec(config, plan, sha, device, source, widths, batch)


def worker_spec(prepared: Prepared, lock: RunLock) -> WorkerSpec:
    """What every shard of the run is scored with, fenced by the run's lock."""
    spec = _spec(
        prepared.config,
        prepared.plan,
        prepared.sha,
        str(prepared.device),
        prepared.source,
        prepared.found.widths,
        prepared.execution.batch_size,
        settings_hash=prepared.settings.hash,
    )
    # The fence: every shard commit checks this token.
    return dataclasses.replace(
        spec, lock_root=prepared.output.uri, lock_run_id=lock.run_id, lock_token=lock.token
    )
