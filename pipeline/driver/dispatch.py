"""Run shard tasks: grouped into Dask tasks on a cluster, or one by one in this process.

The :class:`~pipeline.worker.shard.WorkerSpec` goes to the cluster once, as the result of one tiny
task that every scoring task depends on: each worker fetches it once and keeps it while the run
needs it. Unlike ``client.scatter`` data, a computed key is recomputed if every worker holding it
dies, so a crashed worker's tasks are still retried as before (scattered data would be lost and
fail them).

A :class:`~pipeline.core.interrupt.StopRequest` stops scheduling: the sync loop checks it between
shards. On a cluster the driver polls completions and, when a stop comes, raises a flag on every
worker that each task checks before starting a shard (so a shard either starts and is waited for, or
comes back unscored: no race between "is it running?" and a cancel). Shards in flight get
``grace_left()`` to commit; then a second flag makes every later commit refuse (the fence,
:meth:`~pipeline.worker.spec.WorkerSpec.check_fence`) and the tasks are cancelled. Shards not
yielded are the caller's to report as interrupted.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from pipeline.core.faults import checkpoint
from pipeline.core.interrupt import StopRequest
from pipeline.core.statuses import FailureKind
from pipeline.driver.cluster import DaskSession
from pipeline.worker import events
from pipeline.worker.events import listen_locally
from pipeline.worker.shard import ShardResult, score_shard, score_shards
from pipeline.worker.spec import ShardTask, WorkerSpec

logger = logging.getLogger(__name__)

MIN_TASKS_PER_SLOT = 4  # grouping never leaves a worker thread with fewer tasks than this
# How often the driver looks at a stop request while waiting for tasks: it sleeps on the stop's
# event, so a signal wakes it at once; a finished task waits at most this long to be recorded.
POLL_S = 0.05


class HasRows(Protocol):
    """What grouping reads of a task (``plan`` groups plain row counts the same way)."""

    @property
    def num_rows(self) -> int: ...


T = TypeVar("T", bound=HasRows)


def group_tasks(tasks: Sequence[T], target_rows: int, slots: int) -> list[list[T]]:
    """Pack consecutive small shards into groups of about ``target_rows`` rows.

    The target shrinks so that each of ``slots`` worker threads still gets several groups (a
    few big groups would leave workers idle at the end). A shard at or above the target is a
    group of its own: it is streamed by row group whatever its size.
    """
    total = sum(t.num_rows for t in tasks)
    limit = max(1, min(target_rows, -(-total // max(1, slots * MIN_TASKS_PER_SLOT))))
    groups: list[list[T]] = []
    current: list[T] = []
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
    return ShardResult.failed(
        task.rel_path,
        task.input_uri,
        task.num_rows,
        FailureKind.ERROR,
        f"shard {task.input_uri}: scoring crashed: {type(e).__name__}: {e}",
    )


def cancelled(task: ShardTask, stopped_at: str) -> ShardResult:
    """The result of a shard not scored because the run stopped at a fatal error."""
    return not_scored(
        task.rel_path, task.input_uri, task.num_rows, FailureKind.CANCELLED, stopped_at
    )


def interrupted(task: ShardTask, signal_name: str) -> ShardResult:
    """The result of a shard not scored (or not committed in time) because of a signal."""
    return ShardResult.failed(
        task.rel_path,
        task.input_uri,
        task.num_rows,
        FailureKind.INTERRUPTED,
        f"not scored: the run was interrupted by {signal_name}",
    )


def not_scored(
    rel_path: str, input_uri: str, num_rows: int | None, kind: FailureKind, stopped_at: str
) -> ShardResult:
    """The result of a shard the run never scored because it stopped at ``stopped_at``."""
    return ShardResult.failed(
        rel_path, input_uri, num_rows, kind, f"not scored: the run stopped at {stopped_at}"
    )


OnRows = Callable[[str, int], None]


def execute(
    spec: WorkerSpec,
    tasks: list[ShardTask],
    session: DaskSession | None,
    *,
    retries: int,
    task_rows: int,
    resources: Mapping[str, float] | None = None,
    stop: StopRequest | None = None,
    on_rows: OnRows | None = None,
) -> Generator[tuple[ShardTask, ShardResult], None, None]:
    """Score ``tasks`` (in this process when ``session`` is None), yielding results as they end.

    Closing the iterator early (after a fatal error) cancels what is still queued or running.
    Once ``stop`` is requested nothing new starts, and the iterator ends when the shards in
    flight have finished or its grace period is over (see the module doc). ``on_rows(rel_path,
    rows)`` hears, while a shard is being scored, how many of its rows are done (at most every
    :data:`~pipeline.worker.events.PROGRESS_INTERVAL_S` per worker; see :class:`RowFeed`).
    """
    stop = stop if stop is not None else StopRequest()
    if not tasks:
        return
    feed = RowFeed(on_rows)
    topic = spec.signals.progress
    listening = listen_locally(topic, feed.rows) if topic else contextlib.nullcontext()
    with listening:
        if session is None:
            try:
                for t in tasks:
                    if stop.requested:
                        return
                    result = _attempts(spec, t, retries)
                    feed.done(t.rel_path)
                    yield t, result
                    checkpoint("between-shards")
            finally:
                events.forget(spec.signals.names)  # this process scored the shards
            return
        yield from _on_cluster(spec, tasks, session, retries, task_rows, resources, stop, feed)


class RowFeed:
    """Rows reported from inside shards, passed on to ``on_rows`` until each shard's result is
    in: a report that arrives after its shard finished (events and results travel separately)
    is dropped, so a shard's rows are never counted twice."""

    def __init__(self, on_rows: OnRows | None) -> None:
        self.on_rows = on_rows
        self._finished: set[str] = set()
        self._lock = threading.Lock()

    def rows(self, rel_path: str, rows: int) -> None:
        """A worker's report: ``rows`` of ``rel_path`` scored so far."""
        if self.on_rows is None:
            return
        # Held during the call: done() waits for a report being passed on, so none of a
        # shard's reports reaches on_rows after its result did.
        with self._lock:
            if rel_path in self._finished:
                return
            try:
                self.on_rows(rel_path, rows)
            except Exception as e:  # a progress display must never stop the run
                logger.debug("progress callback failed: %s", e)

    def event(self, event: Any) -> None:
        """A Dask event ``(timestamp, [rel_path, rows])`` from ``subscribe_topic``."""
        _, msg = event
        self.rows(str(msg[0]), int(msg[1]))

    def done(self, rel_path: str) -> None:
        """``rel_path``'s result is in: later reports of it are stale."""
        with self._lock:
            self._finished.add(rel_path)


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
    stop: StopRequest,
    feed: RowFeed,
) -> Iterator[tuple[ShardTask, ShardResult]]:
    from distributed import as_completed

    client = session.client()
    slots = sum(client.nthreads().values()) or 1
    stopping, abandon = spec.signals.stop, spec.signals.abandon
    tag = uuid.uuid4().hex[:8]
    spec_ref = client.submit(worker_spec, spec, key=f"worker-spec-{tag}", pure=False)
    by_key: dict[str, list[ShardTask]] = {}
    futures: list[Any] = []
    _subscribe(client, spec.signals.progress, feed)
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
        done: Any = as_completed(futures)  # type: ignore[no-untyped-call]
        stopped = False
        while not done.is_empty():
            if stop.requested and not stopped:
                stopped = True
                _raise(client, stopping)  # shards not started yet come back unscored, at once
                checkpoint("stop-raised")  # every worker has the flag: none starts a shard now
            if stopped and stop.grace_left() <= 0:
                logger.warning(
                    "grace period over: %d task(s) still running are cancelled",
                    sum(not f.done() for f in futures),
                )
                return
            if not done.has_ready():
                if stopped:
                    time.sleep(POLL_S)
                else:
                    stop.wait(POLL_S)  # wakes at once on a stop request
                continue
            for fut in done.next_batch(block=False):
                if not fut.cancelled():
                    yield from _results(fut, by_key[fut.key], stop, feed)
    finally:
        _unsubscribe(client, spec.signals.progress)
        # Stop what is still running (after a fatal error, or the grace period); the session is
        # closed by the run. A task cancelled while running still runs on in its worker: the
        # abandon Event (and then the lock's release) keeps it from committing.
        if futures:
            _raise(client, abandon)
        for fut in futures:
            fut.cancel()
        spec_ref.cancel()
        _forget(client, spec.signals.names, futures)


def _subscribe(client: Any, topic: str, feed: RowFeed) -> None:
    """The workers' row reports on ``topic`` (Dask events) go to ``feed`` from now on."""
    if topic:
        client.subscribe_topic(topic, feed.event)


def _unsubscribe(client: Any, topic: str) -> None:
    if topic:
        with contextlib.suppress(Exception):  # the client may be closing already
            client.unsubscribe_topic(topic)


def _results(
    fut: Any, group: list[ShardTask], stop: StopRequest, feed: RowFeed
) -> Iterator[tuple[ShardTask, ShardResult]]:
    for t in group:
        feed.done(t.rel_path)
    try:
        results = fut.result()
    except Exception as e:  # the task crashed every retry (or its worker kept dying)
        results = [crashed(t, e) for t in group]
    for t, result in zip(group, results, strict=True):
        if result.kind == FailureKind.INTERRUPTED:  # the worker does not know which signal
            result = interrupted(t, stop.signal_name or "a signal")
        yield t, result
        checkpoint("between-shards")


def _forget(client: Any, names: tuple[str, ...], futures: list[Any]) -> None:
    """Have every worker forget the run's flags and progress topic (best effort): a worker of
    an existing cluster outlives the run, and would otherwise keep an entry per run. Only when
    every task ended on its own: a task cancelled while running runs on in its worker and
    checks the abandon flag before it commits, so a run stopped early leaves its two flag
    names there (a few bytes per interrupted run)."""
    if not names or any(f.status not in ("finished", "error") for f in futures):
        return
    try:
        client.run(events.forget, names)
    except Exception as e:  # a worker gone: it forgot everything anyway
        logger.debug("could not have the workers forget the run: %s", e)


def _raise(client: Any, flag: str) -> None:
    """Raise ``flag`` on every worker (see :func:`pipeline.worker.events.raise_flag`); best
    effort."""
    try:
        client.run(events.raise_flag, flag)
    except Exception as e:  # a worker gone: its tasks are lost anyway
        logger.warning("could not tell every worker that the run is stopping: %s", e)
