"""Run shard tasks: grouped into Dask tasks on a cluster, or one by one in this process.

The :class:`~pipeline.scoring.WorkerSpec` goes to the cluster once, as the result of one tiny
task that every scoring task depends on: each worker fetches it once and keeps it while the run
needs it. Unlike ``client.scatter`` data, a computed key is recomputed if every worker holding it
dies, so a crashed worker's tasks are still retried as before (scattered data would be lost and
fail them).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Generator, Iterator, Mapping
from dataclasses import replace
from typing import Any

from pipeline.cluster import DaskSession
from pipeline.faults import checkpoint
from pipeline.scoring import ShardResult, ShardTask, WorkerSpec, score_shard, score_shards
from pipeline.statuses import FailureKind, ShardStatus

logger = logging.getLogger(__name__)

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


def crashed(task: ShardTask, e: BaseException) -> ShardResult:
    """The result of a shard whose task raised on every try."""
    return ShardResult(
        task.rel_path,
        task.input_uri,
        ShardStatus.FAILED,
        rows_in=task.num_rows,
        kind=FailureKind.ERROR,
        message=f"shard {task.input_uri}: scoring crashed: {type(e).__name__}: {e}",
    )


def cancelled(task: ShardTask, stopped_at: str) -> ShardResult:
    """The result of a shard not scored because the run stopped at a fatal error."""
    return ShardResult(
        task.rel_path,
        task.input_uri,
        ShardStatus.FAILED,
        rows_in=task.num_rows,
        kind=FailureKind.CANCELLED,
        message=f"not scored: the run stopped at {stopped_at}",
    )


def execute(
    spec: WorkerSpec,
    tasks: list[ShardTask],
    session: DaskSession | None,
    *,
    retries: int,
    task_rows: int,
    resources: Mapping[str, float] | None = None,
) -> Generator[tuple[ShardTask, ShardResult], None, None]:
    """Score ``tasks`` (in this process when ``session`` is None), yielding results as they end.

    Closing the iterator early (after a fatal error) cancels what is still queued or running.
    """
    if not tasks:
        return
    if session is None:
        for t in tasks:
            yield t, _attempts(spec, t, retries)
            checkpoint("between-shards")
        return
    yield from _on_cluster(spec, tasks, session, retries, task_rows, resources)


def _attempts(spec: WorkerSpec, task: ShardTask, retries: int) -> ShardResult:
    for attempt in range(retries + 1):
        try:
            return score_shard(spec, task)
        except Exception as e:
            if attempt == retries:
                return crashed(task, e)
            logger.warning("shard %s crashed (%s); retrying", task.rel_path, e)
    raise AssertionError("unreachable")  # pragma: no cover


def worker_spec(spec: WorkerSpec) -> WorkerSpec:
    """The spec itself: the task whose result every scoring task depends on (see module doc)."""
    return spec


def _on_cluster(
    spec: WorkerSpec,
    tasks: list[ShardTask],
    session: DaskSession,
    retries: int,
    task_rows: int,
    resources: Mapping[str, float] | None,
) -> Iterator[tuple[ShardTask, ShardResult]]:
    from distributed import as_completed

    client = session.client()
    slots = sum(client.nthreads().values()) or 1
    if session.threads_by_host:
        spec = replace(spec, torch_threads_by_host=session.threads_by_host)
    tag = uuid.uuid4().hex[:8]
    spec_ref = client.submit(worker_spec, spec, key=f"worker-spec-{tag}", pure=False)
    by_key: dict[str, list[ShardTask]] = {}
    futures: list[Any] = []
    try:
        for group in group_tasks(tasks, task_rows, slots):
            fut = client.submit(
                score_shards,
                spec_ref,
                group,
                key=f"score-{group[0].rel_path}-{len(group)}-{uuid.uuid4().hex[:8]}",
                retries=retries,
                resources=dict(resources) if resources else None,
                pure=False,
            )
            by_key[fut.key] = group
            futures.append(fut)
        for fut in as_completed(futures):  # type: ignore[no-untyped-call]
            group = by_key[fut.key]
            try:
                results = fut.result()
            except Exception as e:  # the task crashed every retry (or its worker kept dying)
                results = [crashed(t, e) for t in group]
            for t, result in zip(group, results, strict=True):
                yield t, result
                checkpoint("between-shards")
    finally:
        # Stop what is still running (after a fatal error); the session is closed by the run.
        for fut in futures:
            fut.cancel()
        spec_ref.cancel()
