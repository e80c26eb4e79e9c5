"""Score one shard end to end inside a worker: read -> batch -> model -> write -> commit.

:func:`score_shards` is the Dask task: a :class:`~pipeline.worker.spec.WorkerSpec` (the same for
every shard, sent to each worker once) and a few small :class:`~pipeline.worker.spec.ShardTask`
objects. It returns a :class:`ShardResult`
for every outcome it understands (a failed shard is a result, not an exception, so Dask does not
retry bad data); anything else propagates so that Dask retries the task, which the per-shard
commit makes idempotent.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from pipeline.core import retries
from pipeline.core.errors import ShardError
from pipeline.core.faults import checkpoint
from pipeline.core.statuses import FailureKind, ShardStatus
from pipeline.io import storage
from pipeline.io.layout import footer_metadata, rejects_metadata
from pipeline.io.locking import LOCK_LOST_KIND, LockLostError
from pipeline.model.bundle import Inputs
from pipeline.model.engine import (
    SMALL_BATCH,
    ModelFailedEverywhere,
    Scored,
    no_rows,
    output_columns,
    score,
)
from pipeline.sinks.base import WrittenFile
from pipeline.worker import events
from pipeline.worker.baseline import OutputLayout, open_index
from pipeline.worker.batching import Batch, ShardBatches, make_loader, to_device_ahead
from pipeline.worker.carry import Carry, CarryCounts, Split
from pipeline.worker.loading import load, set_threads
from pipeline.worker.overlap import read_ahead
from pipeline.worker.sink import ShardSink, SinkRun, output_schema
from pipeline.worker.spec import ShardTask, WorkerSpec
from pipeline.worker.stats import DuplicateIds, ShardStats

logger = logging.getLogger(__name__)

#: Rows of a shard a model that has scored none of them may fail on, every one, before the
#: shard is failed as a broken model (each is bisected out and rejected meanwhile; a broken
#: model costs at most this many single-row calls per shard, and the run stops at its first).
UNPROVEN_ROWS = 16_384

#: Batches in flight on each side of the model (read ahead, write behind) when overlap is on:
#: memory stays a few batches.
OVERLAP_DEPTH = 2


@dataclass
class ShardResult:
    """What happened to one shard; becomes a manifest entry and a line of the report."""

    rel_path: str
    input: str
    status: str  # a ShardStatus: scored, skipped, failed
    output: str | None = None
    rejects: str | None = None
    rows_in: int | None = None
    rows_out: int = 0
    rows_rejected: int = 0
    duration_s: float = 0.0
    rows_per_s: float = 0.0
    kind: str | None = None  # a FailureKind, for failures
    message: str | None = None
    oom_splits: int = 0
    duplicate_ids: int = 0  # rows whose id appeared earlier in the same shard
    null_ids: int = 0  # rows whose id is null
    # Score statistics, model latencies and reject reasons; empty unless the shard was scored.
    stats: ShardStats = field(default_factory=ShardStats)
    rejects_by_reason: dict[str, int] = field(default_factory=dict)
    started_at: float | None = None  # wall clock (epoch seconds) of the worker's start ...
    finished_at: float | None = None  # ... and finish on this shard; None when not scored
    # The data file the shard's output went to, with what the output format wanted to know of
    # it (pipeline.sinks); None unless scored now. Not in the report.
    written: WrittenFile | None = None
    # An incremental run's counts for the shard (carried, through the model, new, changed);
    # None when the run is not incremental or the shard was not scored now.
    incremental: CarryCounts | None = None
    # Every id of the shard was marked in this machine's baseline index (its seen.npy): the
    # driver's count of the ids the night removed need not read the shard again.
    ids_marked: bool = False

    @classmethod
    def failed(
        cls, rel_path: str, input_uri: str, rows_in: int | None, kind: str, message: str
    ) -> ShardResult:
        """A shard that failed, or was never scored, for ``kind``; ``message`` says why."""
        return cls(
            rel_path, input_uri, ShardStatus.FAILED, rows_in=rows_in, kind=kind, message=message
        )

    @classmethod
    def skipped(cls, rel_path: str, input_uri: str, entry: Mapping[str, Any]) -> ShardResult:
        """A shard an earlier run scored with this model and settings (its manifest ``entry``),
        with the score statistics and reject reasons that run kept there, so that the report
        describes the whole output (entries from before they were kept have none)."""
        return cls(
            rel_path,
            input_uri,
            ShardStatus.SKIPPED,
            output=entry["output"],
            rejects=entry.get("rejects"),
            rows_in=entry["rows_in"],
            rows_out=entry["rows_scored"],
            rows_rejected=entry["rows_rejected"],
            stats=ShardStats.from_summary(entry.get("outputs"), entry["rows_scored"]),
            rejects_by_reason=dict(entry.get("rejects_by_reason") or {}),
            # Entries written before these were kept count none.
            duplicate_ids=int(entry.get("duplicate_ids") or 0),
            null_ids=int(entry.get("null_ids") or 0),
        )

    def public(self) -> dict[str, Any]:
        """The per-shard entry of ``_report.json`` (timings are made relative by the report)."""
        hidden = ("stats", "written", "incremental", "ids_marked")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in hidden}
        if self.incremental is not None:
            out["incremental"] = self.incremental.public()
        return out


def score_shards(spec: WorkerSpec, tasks: list[ShardTask]) -> list[ShardResult]:
    """Score a group of small shards in one Dask task, one after another.

    Each shard still commits on its own; if one raises (a crash Dask should retry), the whole
    group is retried and its already committed shards are scored and replaced again, which the
    per-shard commit makes harmless. Once the run is stopping (``spec.signals.stop``), the shards
    not started yet are returned unscored, as ``interrupted``.
    """
    stopping = spec.signals.stop
    return [
        _not_started(t) if events.flag_raised(stopping) else score_shard(spec, t) for t in tasks
    ]


def _not_started(task: ShardTask) -> ShardResult:
    return ShardResult.failed(
        task.rel_path,
        task.input_uri,
        task.num_rows,
        FailureKind.INTERRUPTED,
        "not scored: the run was interrupted",
    )


def score_shard(spec: WorkerSpec, task: ShardTask) -> ShardResult:
    """Score one shard and commit its output (and rejects) atomically.

    A transient storage error (a connection reset, a 503 mid-upload) scores the shard again
    after a back-off, until the store has failed for ``retry_deadline_s`` in this process
    (:class:`~pipeline.core.retries.RetryClock`); the staged commit makes that harmless. A storage
    failure (:func:`~pipeline.core.retries.is_storage_failure`: a full or read-only disk, a
    permission refused, a store still gone at the deadline) is the result ``storage``, which
    stops the run: not an exception, so that Dask does not run the task again against the same
    disk. Any other exception propagates, and Dask retries the task (``task_retries``).
    """
    t0 = time.perf_counter()
    started = time.time()
    set_threads(spec.threads)
    retries.RETRY_CLOCK.working_for(spec.run_id)
    failing_since: float | None = None  # when the first try that failed on storage began
    for attempt in itertools.count(1):
        try:
            result = _score(spec, task, t0)
        except ShardError as e:
            rows = None if e.kind == FailureKind.UNREADABLE else task.num_rows
            return _failed(task, e.kind, str(e), t0, rows)
        except LockLostError as e:
            # A result, not an exception: Dask must not retry a task of a run that lost its
            # lock (each retry would fail the same way). The driver stops the run on this kind.
            return _failed(task, LOCK_LOST_KIND, str(e), t0)
        except Exception as e:
            failing_since = time.monotonic() if failing_since is None else failing_since
            failure = _storage_failure(spec, task, e, attempt, failing_since)
            if failure is None:
                raise
            if isinstance(failure, str):
                return _failed(task, FailureKind.STORAGE, failure, t0)
            time.sleep(failure)
            continue
        if failing_since is not None:  # the store answers again
            out = storage.locate(task.output_uri, spec.io.storage_options)
            retries.RETRY_CLOCK.succeeded(retries.store_key(out.fs))
        result.started_at, result.finished_at = started, time.time()
        return result
    raise AssertionError("unreachable")  # pragma: no cover


def _failed(
    task: ShardTask, kind: str, message: str, t0: float, rows_in: int | None = -1
) -> ShardResult:
    """The result of ``task`` failed for ``kind`` (``rows_in`` defaults to the footer's)."""
    return ShardResult(
        task.rel_path,
        task.input_uri,
        ShardStatus.FAILED,
        rows_in=task.num_rows if rows_in == -1 else rows_in,
        kind=kind,
        message=message,
        duration_s=time.perf_counter() - t0,
    )


def _storage_failure(
    spec: WorkerSpec, task: ShardTask, e: Exception, attempt: int, since: float
) -> str | float | None:
    """What to do about ``e``, raised scoring ``task`` on its ``attempt``-th try (the first
    failed try began at ``since``, monotonic): the message of a storage failure (the shard
    fails as ``storage``), seconds to wait before scoring it again (a transient storage error
    within the deadline), or None (not the storage's: raise it)."""
    if retries.is_storage_failure(e):
        return f"shard {task.input_uri}: {retries.cause_of(e)}"
    if not retries.is_transient(e) or type(e).__module__.split(".")[0] == "pyarrow":
        return None
    out = storage.locate(task.output_uri, spec.io.storage_options)
    delay, elapsed = retries.next_delay(
        store=retries.store_key(out.fs),
        start=since,
        attempt=attempt,
        deadline=out.retry_deadline_s,
    )
    if delay < 0:
        why = retries.gave_up(attempt, elapsed, out.retry_deadline_s)
        return f"shard {task.input_uri}: storage failed {why}: {retries.cause_of(e)}"
    logger.log(  # the first try that failed; the later ones at DEBUG, as retries.with_retries
        logging.WARNING if attempt == 1 else logging.DEBUG,
        "shard %s: storage error (%s); scoring it again in %.1fs",
        task.rel_path,
        retries.cause_of(e),
        delay,
    )
    return delay


class _Shard:
    """One shard being scored: its model, schemas and the statistics kept along the way."""

    def __init__(self, spec: WorkerSpec, task: ShardTask) -> None:
        if spec.model.widths is None:
            raise ValueError("a WorkerSpec for scoring needs the model's input widths")
        self.spec = spec
        self.task = task
        self.model = load(spec.model, spec.scoring.batch_size)
        outputs = self.model.spec.outputs
        self.out_fields = [(o.name, o.arrow_type(self.model.out_width)) for o in outputs]
        # Output and rejects schemas keep the id/pass-through types this shard's footer
        # declares; the driver read the footer already and sends those fields along.
        self.meta_schema = pa.ipc.read_schema(pa.py_buffer(task.meta_schema))
        inc = spec.incremental
        footer = footer_metadata(
            spec.model.sha256,
            spec.io.settings_hash,
            task.rel_path,
            task.input_fingerprint,
            scorer=inc.scorer if inc.fingerprint else "",
        )
        self.rejects_meta = rejects_metadata(
            task.output_name or task.output_uri, task.rel_path, task.input_fingerprint
        )
        self.out_schema = output_schema(
            self.meta_schema, self.out_fields, footer, fingerprint=inc.fingerprint
        )
        self.carry: Carry | None = None
        if inc.fingerprint:
            index = open_index(inc.index, spec.io.storage_options) if inc.index else None
            layouts = tuple(OutputLayout.of(n, t) for n, t in self.out_fields)
            start = index.ref.start_of(task.rel_path) if index is not None else -1
            self.carry = Carry(index, layouts, start)
        self.numeric = [
            i for i, (_, t) in enumerate(self.out_fields) if not pa.types.is_fixed_size_list(t)
        ]
        self.stats = ShardStats.for_outputs(
            [self.out_fields[i][0] for i in self.numeric], task.num_rows
        )
        self.ids = DuplicateIds()
        self.rows_in = 0
        self.dataset: ShardBatches | None = None
        # Whether the model has scored a row of this shard: from then on a batch it fails on
        # entirely is bad rows, not a broken model (engine.score's ``proven``). Before that,
        # the first UNPROVEN_ROWS rows may all fail and still be taken for bad rows: a shard
        # sorted so that its bad rows come first must not look like a broken model.
        self.proven = False
        self.failed_unproven = 0

    def batches(self) -> Iterator[Batch]:
        """The shard's batches, read ahead and moved to the model's device ahead of use."""
        spec, task = self.spec, self.task
        dataset = ShardBatches(
            task.input_uri,
            self.model.spec,
            widths=self.model.widths,
            meta_columns=(spec.io.id_column, *spec.io.passthrough),
            batch_size=spec.scoring.batch_size,
            storage_options=spec.io.storage_options,
        )
        local = storage.locate(task.input_uri, spec.io.storage_options).is_local
        self.dataset = dataset  # its lossy casts go into the result
        loader = make_loader(dataset, pin_memory=self.model.device.type == "cuda")
        batches = _guard_reads(iter(loader), task.input_uri, local)
        return to_device_ahead(read_ahead(batches, spec.scoring.overlap_depth), self.model.device)

    def score_batch(self, batch: Batch, sink: ShardSink) -> None:
        """Score one batch, write its rows and rejects, and keep its statistics.

        On an incremental night only the rows the baseline does not hold as they are now go
        through the model (:mod:`pipeline.worker.carry`); the others' output values are
        carried, and the rows are written in input order either way."""
        if batch.meta.schema != self.meta_schema:  # one type per column across the output
            batch.meta = batch.meta.cast(self.meta_schema)  # (pipeline.driver.inspect.meta_fields)
        self.rows_in += batch.num_rows
        self.ids.add(batch.meta.column(0))
        reasons = self._invalid_reasons(batch)
        valid = batch.features.valid
        part: Split | None = None
        if self.carry is not None:
            part = self.carry.split(batch.tensors, batch.meta.column(0), valid)
        send = valid if part is None else part.send
        scored = self._run_model(batch, self._inputs(batch, send))
        checkpoint("batch-scored")
        keep = send.copy()
        if scored.errors:
            send_idx = np.flatnonzero(send)
            for j, msg in scored.errors.items():
                reasons[int(send_idx[j])] = msg
            keep[send_idx[~scored.ok]] = False
        cols = output_columns(scored.outputs, self.model.spec.outputs)
        if part is not None:
            keep |= part.carry
            assert self.carry is not None
            cols = self.carry.merge(part, cols, keep)
        meta = batch.meta if keep.all() else batch.meta.filter(pa.array(keep))
        m = meta.num_rows
        version = self.spec.io.model_version or self.model.spec.version
        version_col = pa.repeat(pa.scalar(version, pa.string()), m)
        arrays = [*meta.columns, *cols, version_col]
        if part is not None:
            arrays.append(pa.array(part.fps[keep]))
        sink.write_output(pa.RecordBatch.from_arrays(arrays, schema=self.out_schema))
        checkpoint("batch-written")
        self.stats.add_scores({self.out_fields[i][0]: cols[i] for i in self.numeric}, m)
        if reasons:
            order = sorted(reasons)
            rmeta = batch.meta.take(pa.array(order))
            reason_col = pa.array([reasons[i] for i in order], pa.string())
            sink.write_rejects(
                pa.RecordBatch.from_arrays([*rmeta.columns, reason_col], schema=sink.rejects_schema)
            )
            self.stats.count_rejects(reasons)

    def _invalid_reasons(self, batch: Batch) -> dict[int, str]:
        """The reason for each invalid row of the batch (by row index); the first one fails
        the shard under ``errors.on_invalid_rows = "fail"``."""
        valid = batch.features.valid
        if valid.all():
            return {}
        invalid_idx = np.flatnonzero(~valid)
        if self.spec.scoring.on_invalid_rows == "fail":
            i = int(invalid_idx[0])
            reason = (batch.features.reasons or ["invalid value"])[0]
            raise ShardError(
                f"shard {self.task.input_uri}: row group {int(batch.row_groups[i])}, row "
                f"{batch.start + i}, {self.spec.io.id_column} = "
                f"{batch.meta.column(0)[i].as_py()!r}: {reason} "
                "(errors.on_invalid_rows = 'fail')",
                shard=self.task.input_uri,
                kind=FailureKind.INVALID_ROWS,
            )
        return dict(zip(invalid_idx.tolist(), batch.features.reasons or [], strict=True))

    def _inputs(self, batch: Batch, send: np.ndarray) -> Inputs:
        """The model inputs of the rows ``send`` marks, on the model's device."""
        xs = batch.tensors if batch.device_tensors is None else batch.device_tensors
        if send.all():
            return xs
        mask = torch.from_numpy(send)
        if batch.device_tensors is not None:
            mask = mask.to(self.model.device, non_blocking=True)
        return tuple(t[mask] for t in xs)

    def _run_model(self, batch: Batch, x: Inputs) -> Scored:
        if int(x[0].shape[0]) == 0:  # every row carried (or invalid): no call at all
            return no_rows(self.model)
        try:
            grace = self.failed_unproven < UNPROVEN_ROWS
            scored = score(
                self.model,
                x,
                proven=self.proven or grace,
                call_rows=self.spec.scoring.call_rows,
            )
        except ModelFailedEverywhere as e:
            raise ShardError(
                f"shard {self.task.input_uri}, rows {batch.start}-"
                f"{batch.start + batch.num_rows - 1}: {e}. "
                f"Check the model bundle {self.spec.model.uri} against this data.",
                shard=self.task.input_uri,
                kind=FailureKind.MODEL,
            ) from e
        self.stats.add_model_call(scored.seconds, scored.oom_splits)
        # Proven once the model ran on a row without raising (a non-finite output is that
        # row's reject, not a sign of a broken model: engine.py).
        self.proven = self.proven or scored.raised < len(scored.ok)
        if not self.proven:
            self.failed_unproven += scored.raised
        return scored

    def check_complete(self) -> None:
        """Every row the footer promised was read (else the file changed under the run), and
        the model scored at least one of them: a model that raised on every one of more than
        :data:`~pipeline.model.engine.SMALL_BATCH` rows is broken, whatever order they came in."""
        if not self.proven and self.failed_unproven > SMALL_BATCH:
            raise ShardError(
                f"shard {self.task.input_uri}: the model failed on every one of its "
                f"{self.failed_unproven:,} rows. Check the model bundle {self.spec.model.uri} "
                "against this data.",
                shard=self.task.input_uri,
                kind=FailureKind.MODEL,
            )
        if self.rows_in != self.task.num_rows:
            raise ShardError(
                f"shard {self.task.input_uri}: read {self.rows_in} rows but its footer says "
                f"{self.task.num_rows}; the file changed while it was being scored",
                shard=self.task.input_uri,
                kind=FailureKind.UNREADABLE,
            )

    def result(self, rows_rejected: int, duration: float) -> ShardResult:
        """The scored shard's result, statistics included."""
        task, stats = self.task, self.stats
        stats.finish()
        if self.carry is not None and self.carry.index is not None:
            self.carry.index.release()
        stats.lossy_casts = dict(self.dataset.lossy) if self.dataset is not None else {}
        return ShardResult(
            task.rel_path,
            task.input_uri,
            ShardStatus.SCORED,
            output=task.output_uri,
            rejects=task.rejects_uri if rows_rejected else None,
            rows_in=self.rows_in,
            rows_out=stats.rows_out,
            rows_rejected=rows_rejected,
            duration_s=duration,
            rows_per_s=self.rows_in / duration if duration > 0 else 0.0,
            oom_splits=stats.oom_splits,
            duplicate_ids=self.ids.count(),
            null_ids=self.ids.nulls,
            stats=stats,
            rejects_by_reason=stats.rejects_by_reason,
            incremental=self.carry.counts if self.carry and self.spec.incremental.counted else None,
            ids_marked=self.carry is not None and self.carry.marked,
        )


def _score(spec: WorkerSpec, task: ShardTask, t0: float) -> ShardResult:
    shard = _Shard(spec, task)
    progress = events.RowProgress(spec.signals.progress, task.rel_path)
    opts = spec.io.storage_options
    out_loc = storage.locate(task.output_uri, opts)
    rej_loc = storage.locate(task.rejects_uri, opts)
    depth = spec.scoring.overlap_depth
    with ShardSink(
        out_loc,
        rej_loc,
        shard.meta_schema,
        shard.out_schema,
        depth=depth,
        fence=spec.check_fence,
        run=SinkRun(shard.rejects_meta, opts, spec.run_id, spec.io.file_facts is not None),
    ) as sink:
        for batch in shard.batches():
            checkpoint("batch-read")
            shard.score_batch(batch, sink)
            progress.add(batch.num_rows)
        shard.check_complete()
        sink.commit()
    result = shard.result(sink.rows_rejected, time.perf_counter() - t0)
    result.written = _written(spec, task, sink)
    return result


def _written(spec: WorkerSpec, task: ShardTask, sink: ShardSink) -> WrittenFile:
    """The shard's data file as the output format wants to know it: where, how big, and the
    facts its ``file_facts`` computes from the footer (here, in the worker)."""
    facts = spec.io.file_facts
    meta = sink.output.metadata
    nan = frozenset(sink.output.nan_columns)
    found = facts(meta, nan) if facts is not None and meta is not None else {}
    return WrittenFile(task.output_uri, sink.output.size, found)


def _guard_reads(it: Iterator[Batch], uri: str, local: bool) -> Iterator[Batch]:
    """Turn decoding errors into an ``unreadable`` shard; write errors are not caught here.

    On object stores an I/O error mid-read is more likely a network fault than a corrupt file,
    so it propagates and the task is retried instead.
    """
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except OSError as e:
            if not local and not isinstance(e, pa.ArrowException):
                raise
            raise ShardError(
                f"shard {uri} could not be decoded (corrupt or truncated data): {e}",
                shard=uri,
                kind="unreadable",
            ) from e
        except (pa.ArrowException, EOFError) as e:
            raise ShardError(
                f"shard {uri} could not be decoded (corrupt or truncated data): {e}",
                shard=uri,
                kind="unreadable",
            ) from e
        yield batch
