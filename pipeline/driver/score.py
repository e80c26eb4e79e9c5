"""The score phase: run the tasks on the cluster (or in this process) and record each shard as
it finishes, so that a crash loses only the shards in flight.

A fatal failure (invalid rows with ``on_invalid_rows = "fail"``, a broken model, a failed
storage) stops the run and leaves the shards not scored yet ``cancelled``; a stop request leaves
them ``interrupted``. A shard whose commit found the lock lost stops the run at once, writing
nothing more: the output belongs to another run now.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

from pipeline.core import retries
from pipeline.core.interrupt import StopRequest
from pipeline.core.statuses import FATAL_KINDS, FailureKind, ShardStatus
from pipeline.driver.dispatch import cancelled, execute, interrupted
from pipeline.driver.phases import Locked, Prepared, Scored
from pipeline.driver.workers import model_spec, run_signals, worker_spec
from pipeline.io.locking import LOCK_LOST_KIND, LockLostError
from pipeline.worker.shard import ShardResult
from pipeline.worker.spec import Fence, WorkerSpec

logger = logging.getLogger(__name__)

OnShard = Callable[[ShardResult], None]
OnStart = Callable[[int, int], None]
OnRows = Callable[[str, int], None]


def score(
    prepared: Prepared,
    locked: Locked,
    stop: StopRequest,
    results: dict[str, ShardResult],
    *,
    on_start: OnStart | None = None,
    on_shard: OnShard | None = None,
    on_rows: OnRows | None = None,
) -> Scored:
    """Score ``locked.tasks``; every shard's result goes into ``results`` as it is known (the
    run's record, which a failure report reads if this phase raises), and the value returned
    holds them all."""
    config, tasks = prepared.config, locked.tasks
    results.update(locked.done)
    if on_start is not None:
        on_start(sum(t.num_rows for t in tasks), len(tasks))
    fatal: ShardResult | None = None
    running = execute(
        _spec(prepared, locked, progress=on_rows is not None),
        list(tasks),
        prepared.session,
        retries=config.errors.task_retries,
        task_rows=config.task_rows,
        resources=dict(config.resources) or None,
        stop=stop,
        on_rows=on_rows,
    )
    with contextlib.closing(running):
        for task, result in running:
            if result.kind == LOCK_LOST_KIND:
                # Another run owns the output now: stop without writing anything more.
                raise LockLostError(result.message or f"run {prepared.run_id} lost its lock")
            results[task.rel_path] = result
            _record(prepared, locked, result)
            if on_shard is not None:
                on_shard(result)
            if result.status != ShardStatus.SCORED and result.kind in FATAL_KINDS:
                fatal = result
                break
    if fatal is not None:
        for t in tasks:
            results.setdefault(t.rel_path, cancelled(t, fatal.input))
    elif stop.requested:
        for t in tasks:
            results.setdefault(t.rel_path, interrupted(t, stop.signal_name))
    locked.manifest.flush()
    return Scored(dict(results), fatal)


def _spec(prepared: Prepared, locked: Locked, *, progress: bool) -> WorkerSpec:
    """The run's worker contract: this model and these settings, fenced by the run's lock."""
    config, session, reg = prepared.config, prepared.session, prepared.source.registry
    widths = prepared.found.widths
    model = model_spec(config, prepared.sha, str(prepared.device), widths, prepared.source)
    lock = locked.lock
    return worker_spec(
        config,
        model,
        batch_size=prepared.execution.batch_size,
        call_rows=prepared.execution.call_rows,
        overlap=prepared.plan.overlap,
        torch_threads=prepared.plan.torch_threads,
        # An existing cluster's hosts, known since it answered (the prepare phase asked).
        threads_by_host=session.threads_by_host if session is not None else None,
        settings_hash=prepared.settings.hash,
        model_version=reg.pinned if reg is not None else "",
        fence=Fence(lock.root.uri, lock.run_id, lock.token),
        signals=run_signals(on_cluster=session is not None, progress=progress),
        file_facts=prepared.sink.writer().file_facts,
        incremental=locked.baseline.spec(),
    )


def _record(prepared: Prepared, locked: Locked, result: ShardResult) -> None:
    """Keep ``result`` in the manifest: a scored shard's entry, or forget a failed one."""
    if result.status != ShardStatus.SCORED:
        locked.manifest.forget(result.rel_path)
        if result.kind == FailureKind.STORAGE:
            # The run stops here; what it still writes (manifest, report, lock) takes one
            # attempt each instead of waiting out another retry deadline on a dead store.
            retries.RETRY_CLOCK.expire()
        return
    s = prepared.by_path[result.rel_path]
    entry = scored_entry(s.uri, prepared.expectation(s), result, prepared.run_id)
    entry.update(prepared.sink.entry_of(result.written))
    locked.manifest.record(result.rel_path, entry)


def scored_entry(
    input_uri: str, expect: dict[str, Any], result: ShardResult, run_id: str
) -> dict[str, Any]:
    """The manifest entry of a shard this run scored: what it was scored from (``expect``, the
    fingerprint, model and settings) and what it wrote."""
    return {
        "input": input_uri,
        **expect,
        "output": result.output,
        "rejects": result.rejects,
        "rows_in": result.rows_in,
        "rows_scored": result.rows_out,
        "rows_rejected": result.rows_rejected,
        # Kept so that a run which skips this shard still reports on the whole output.
        "outputs": result.stats.summary(),  # per column: count, sum, min, max, 101-point sketch
        "rejects_by_reason": result.rejects_by_reason,
        "duplicate_ids": result.duplicate_ids,
        "null_ids": result.null_ids,
        "run_id": run_id,
        "scored_at": dt.datetime.now(dt.timezone.utc).isoformat(),
    }
