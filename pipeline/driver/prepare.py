"""The prepare phase: everything a run learns before it writes anything, as one :class:`Prepared`.

List the input, refuse an output it overlaps or cannot hold, read every footer, load the model
and dry-run it, check each schema, decide the settings, the thread plan and how the model runs
(precision, parity, batch size). The Dask cluster starts meanwhile, so that its workers load the
model while the driver reads footers. A problem found here fails the run up front (exit 2 or 3)
with nothing written; a signal stops it with :class:`~pipeline.core.signals.EarlyStop`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipeline.core.config import JobConfig
from pipeline.core.errors import TableSchemaError
from pipeline.core.faults import checkpoint
from pipeline.core.interrupt import StopRequest
from pipeline.core.signals import EarlyStop
from pipeline.driver.cluster import DaskSession, Plan, thread_plan
from pipeline.driver.execution import plan_execution
from pipeline.driver.inspect import (
    Inspection,
    apply_schema_policy,
    check_job_columns,
    inspect_shards,
    list_input,
    meta_fields,
    run_identity,
)
from pipeline.driver.phases import Prepared
from pipeline.driver.workers import model_spec
from pipeline.io import layout, listing, nesting, ownership, storage
from pipeline.io.listing import ShardRef
from pipeline.io.locking import refuse_if_held
from pipeline.io.storage import Location
from pipeline.model import oov, registry
from pipeline.model.bundle import BundleSpec, read_bundle
from pipeline.model.program import resolve_device
from pipeline.sinks import sink_for
from pipeline.sinks.base import Sink
from pipeline.worker.shard import ShardResult
from pipeline.worker.sink import output_schema

logger = logging.getLogger(__name__)


def stop_if_asked(stop: StopRequest) -> None:
    """Stop here, before the run has changed its output, if a signal asked it to: the previous
    run's ``_SUCCESS`` and report stay, and nothing of this run is written. (Once the output is
    claimed a stop ends the run ``interrupted``, with its report.)"""
    if stop.requested and stop.signum is not None:
        raise EarlyStop(stop.signum)


def prepare(
    config: JobConfig, run_id: str, stop: StopRequest, cleanup: contextlib.ExitStack
) -> Prepared:
    """Plan from footers and the model's dry run: nothing is written before this passes.

    The Dask cluster it starts is closed by ``cleanup``, whatever happens next.
    """
    started_at = dt.datetime.now(dt.timezone.utc)
    t0 = time.perf_counter()
    where = _where(config, run_id, stop)  # before the model: a held lock is refused at once
    # A models:/ URI: ask the registry once, here; from now on the run, its workers and its
    # manifest see the downloaded bundle folder (the report names both).
    source = registry.resolve_model(config.model)
    config = dataclasses.replace(config, model=source.bundle)
    opts = config.storage
    places, sink, rejects, shards = where.places, where.sink, where.rejects, where.shards
    device = resolve_device(config.device)
    bundle, _, sha = read_bundle(config.model, opts)
    # Before any worker spec: each output file's footer carries the settings hash.
    settings, scorer = run_identity(
        config, bundle, sha, str(device), source.model_version, sink.keeps_fingerprints()
    )
    fingerprint = scorer is not None
    plan = thread_plan(config, len(shards), device.type)
    if config.overlap == "auto" and not plan.overlap:
        logger.info(
            "overlap threads off (overlap = auto): each core already runs a scoring loop of its "
            "own (%d in all); --overlap turns them on",
            plan.cores,
        )
    session = _start_cluster(config, plan, bundle, sha, str(device), source, cleanup)
    stop_if_asked(stop)
    found = inspect_shards(config, shards, bundle, sha, device, opts)
    # Unseen values that a vocabulary input maps to a real value's id: said once, now, and in
    # the report's warnings; ids beyond the model's embedding fail here (exit 3).
    model_warnings = tuple(oov.check(found.model))
    for warning in model_warnings:
        logger.warning("%s", warning)
    check_job_columns(config, found.infos)  # a typo is not a shard to skip
    checkpoint("model-loaded")  # loaded in this process, dry-run checked
    stop_if_asked(stop)
    failed = apply_schema_policy(config, shards, found)
    execution = plan_execution(config, shards, failed, found, plan)
    model_warnings += execution.warnings  # logged when found
    meta_types = meta_fields(config, found.infos, failed)
    schema = _output_schema(
        config, found, meta_types, failed, one_type=sink.places.table, fingerprint=fingerprint
    )
    if session is not None and plan.scheduler not in ("local", "threads"):
        # An existing cluster must answer before the run takes the output: an unreachable
        # scheduler fails here, with nothing written.
        session.client()
    stop_if_asked(stop)
    return Prepared(
        config=config,
        run_id=run_id,
        input=storage.locate(config.input_uri(), opts).uri,
        started_at=started_at,
        t0=t0,
        places=places,
        sink=sink,
        schema=schema,
        rejects=rejects,
        source=source,
        shards=tuple(shards),
        buckets_to_create=where.buckets,
        device=device,
        sha=sha,
        settings=settings,
        scorer=scorer,
        plan=plan,
        session=session,
        found=found,
        failed=failed,
        execution=execution,
        meta_types=meta_types,
        model_warnings=model_warnings,
    )


@dataclass(frozen=True)
class _Where:
    """Where a run reads and writes, checked before anything is loaded."""

    places: layout.Places
    sink: Sink[Any, Any]
    rejects: Location
    shards: list[ShardRef]
    buckets: tuple[Location, ...]  # create_output_bucket: made once the run writes


def _where(config: JobConfig, run_id: str, stop: StopRequest) -> _Where:
    """The run's places, its sink and its input, refused before the model is even loaded
    where the run may not write: an output a live run holds, one that overlaps the input, a
    missing bucket, outputs that nest or belong to another job, rejects inside a dataset."""
    # Manifest, report, HTML page, run index and default rejects: outside the template's fixed
    # part, which readers query as one dataset (pipeline.io.layout).
    places = layout.for_run(config, run_id)
    sink = sink_for(config, places, run_id)
    refuse_if_held(sink.places.lock_root, config.stale_lock_after_s, f"output {places.output.uri}")
    rejects = storage.locate(config.rejects_uri(run_id), config.storage)
    shards = list_input(config)
    out = places.output
    listing.check_disjoint(config.input_uri(), out, rejects, options=config.storage, shards=shards)
    stop_if_asked(stop)
    create = config.create_output_bucket
    buckets = tuple(
        bucket
        for loc, what in ((out, "output"), (rejects, "rejects"))
        if (bucket := ownership.check_write_target(loc, what, create_bucket=create))
    )
    # Outputs never nest, and no run takes another job's output: one that contains, lies
    # inside or is the template root of another output of this tool, lies inside another
    # template's root or a control area, or belongs to another job, and rejects inside any
    # dataset, are refused before the model is even loaded.
    nesting.check_run(config, places, rejects, table_names=sink.places.table_names)
    return _Where(places, sink, rejects, shards, buckets)


def _output_schema(
    config: JobConfig,
    found: Inspection,
    meta_types: Mapping[str, pa.Field],
    failed: Mapping[str, ShardResult],
    *,
    one_type: bool,
    fingerprint: bool = False,
) -> pa.Schema | None:
    """The columns every output file of the run has: id, pass-through, outputs, model_version
    (a table's schema is made from it); None when no shard is left to score. An id or
    pass-through column whose types no promotion joins across shards keeps each shard's own
    type in a folder (with a warning); a table holds one type per column (``one_type``), so
    there it is refused before anything is written."""
    names = (config.id_column, *config.passthrough)
    missing = [n for n in names if n not in meta_types]
    # ``failed`` holds the shards whose footer could not be read too, which ``infos`` lacks:
    # left to score is a readable shard that did not fail (counting the two against each
    # other took one footer-less shard among two for "nothing left", and a table night within
    # its error budget then had no schema to commit with).
    if all(rel in failed for rel in found.infos):
        return None
    if missing:
        if one_type:
            raise TableSchemaError(
                f"input column(s) {', '.join(map(repr, missing))}: the shards' types cannot be "
                "joined (see the warning above), and a table holds one type per column. "
                'Cast them to one type upstream, or write a Parquet folder (format = "parquet")',
                uri=config.output,
            )
        return None
    model = found.model
    outputs = [(o.name, o.arrow_type(model.out_width)) for o in model.spec.outputs]
    meta = pa.schema([meta_types[n] for n in names])
    return output_schema(meta, outputs, fingerprint=fingerprint)


def _start_cluster(
    config: JobConfig,
    plan: Plan,
    bundle: BundleSpec,
    sha: str,
    device: str,
    source: registry.ModelSource,
    cleanup: contextlib.ExitStack,
) -> DaskSession | None:
    """The run's Dask session (None for ``scheduler = "sync"``), starting in the background
    and warming every worker with the model; ``cleanup`` closes it."""
    if plan.scheduler == "sync":
        return None
    # The model's record alone: the workers load it while the driver reads footers (an input
    # width that model.toml leaves open is not known yet: the worker takes it from the program).
    fixed = [i.fixed_width() for i in bundle.inputs]
    widths = None if None in fixed else tuple(w for w in fixed if w is not None)
    warm_rows = config.batch_size if isinstance(config.batch_size, int) else 2
    model = model_spec(config, sha, device, widths, source)
    session = DaskSession(plan, model, warm_rows)
    cleanup.callback(_close, session)
    checkpoint("cluster-started")
    return session


def _close(session: DaskSession) -> None:
    """Close the session; an error is logged, never raised (it would hide the run's)."""
    try:
        session.close()
    except Exception as e:
        logger.warning("error while closing the Dask cluster: %s", e)
