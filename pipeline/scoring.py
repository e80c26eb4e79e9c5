"""Score one shard end to end inside a worker: read -> batch -> model -> write -> commit.

This is the Dask task. It returns a :class:`ShardResult` for every outcome it understands (a
failed shard is a result, not an exception, so Dask does not retry bad data); anything else
propagates so that Dask retries the task, which the per-shard commit makes idempotent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from pipeline import storage
from pipeline.batching import Batch, ShardBatches, make_loader, to_device_ahead
from pipeline.engine import ModelFailedEverywhere, output_columns, score
from pipeline.errors import ShardError
from pipeline.faults import checkpoint
from pipeline.model import load_model
from pipeline.overlap import WriteBehind, read_ahead
from pipeline.precision import ExecutionOptions, prepare
from pipeline.writing import (
    StagedParquetWriter,
    output_schema,
    rejects_schema,
)

logger = logging.getLogger(__name__)

SAMPLE_ROWS = 10_000  # per shard, for output quantiles in the report
LATENCY_SAMPLES = 10_000  # per shard


@dataclass(frozen=True)
class ShardTask:
    """Everything a worker needs to score one shard; small and picklable."""

    rel_path: str
    input_uri: str
    output_uri: str
    rejects_uri: str
    num_rows: int
    meta_schema: bytes  # Arrow IPC schema of the id + pass-through columns, from the footer
    model_uri: str
    model_sha256: str
    device: str
    width: int
    id_column: str
    passthrough: tuple[str, ...]
    batch_size: int
    on_invalid_rows: str
    torch_threads: int | None  # None: derive from the Dask worker's thread count
    precision: str = "fp32"
    compile: bool = False
    strict_fp32: bool = False
    overlap_depth: int = 0  # batches read ahead / written behind in background threads
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    # On an existing cluster: torch threads for a worker on each host, so that all the worker
    # threads of one machine together use its cores once (see run.torch_threads_by_host).
    torch_threads_by_host: Mapping[str, int] = field(default_factory=dict)


@dataclass
class ShardResult:
    """What happened to one shard; becomes a manifest entry and a line of the report."""

    rel_path: str
    input: str
    status: str  # scored, skipped, failed
    output: str | None = None
    rejects: str | None = None
    rows_in: int | None = None
    rows_out: int = 0
    rows_rejected: int = 0
    duration_s: float = 0.0
    rows_per_s: float = 0.0
    kind: str | None = None  # for failures: unreadable, schema, invalid_rows, model, error
    message: str | None = None
    oom_splits: int = 0
    duplicate_ids: int = 0  # rows whose id appeared earlier in the same shard
    latencies_ms: list[float] = field(default_factory=list)
    samples: dict[str, list[float]] = field(default_factory=dict)
    sample_weight: float = 1.0
    stats: dict[str, list[float]] = field(default_factory=dict)  # col -> [count, sum, min, max]
    rejects_by_reason: dict[str, int] = field(default_factory=dict)
    started_at: float | None = None  # wall clock (epoch seconds) of the worker's start ...
    finished_at: float | None = None  # ... and finish on this shard; None when not scored

    def public(self) -> dict[str, Any]:
        """The per-shard entry of ``_report.json`` (timings are made relative by the report)."""
        d = asdict(self)
        for key in ("latencies_ms", "samples", "sample_weight", "stats"):
            d.pop(key)
        return d


MAX_REASONS = 50  # distinct reject reasons kept per shard; the rest are counted as "other"


def _count_reasons(counts: dict[str, int], reasons: Mapping[int, str]) -> None:
    for reason in reasons.values():
        key = reason if reason in counts or len(counts) < MAX_REASONS else "other"
        counts[key] = counts.get(key, 0) + 1


def _set_threads(requested: int | None, by_host: Mapping[str, int] | None = None) -> int:
    n = requested
    if n is None:
        try:
            from distributed import get_worker

            worker = get_worker()
            worker_threads = worker.state.nthreads
            host = urlsplit(worker.address).hostname
            n = (by_host or {}).get(host or "")
        except (ImportError, ValueError):
            worker_threads = 1
    if n is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - macOS
            cores = os.cpu_count() or 1
        n = max(1, cores // max(1, worker_threads))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def pin_device(device: str, worker_name: object, device_count: int) -> str:
    """The CUDA device for this worker: one worker per GPU.

    An unindexed ``cuda`` on a worker that sees several GPUs (an embedded cluster on a multi-GPU
    machine, whose workers are named 0, 1, ...) maps worker i to ``cuda:i % count``. Workers
    started one per GPU (dask-cuda, or CUDA_VISIBLE_DEVICES per worker) see one device, so
    ``cuda`` is theirs already.
    """
    if device != "cuda" or device_count <= 1:
        return device
    try:
        index = int(str(worker_name))
    except ValueError:
        return device
    return f"cuda:{index % device_count}"


def _worker_device(device: str) -> str:
    if device != "cuda":
        return device
    try:
        from distributed import get_worker

        name: object = get_worker().name
    except (ImportError, ValueError):
        return device
    return pin_device(device, name, torch.cuda.device_count())


def warm_worker(
    model_uri: str,
    device: str,
    width: int | None,
    storage_options: Mapping[str, Any],
    sha256: str,
    precision: str,
    compile: bool,
    strict_fp32: bool,
    batch_size: int | None,
    torch_threads: int | None,
    torch_threads_by_host: Mapping[str, int] | None = None,
) -> None:
    """Load (and prepare) the model in this worker before its first task: once per process."""
    _set_threads(torch_threads, torch_threads_by_host)
    model = load_model(
        model_uri,
        _worker_device(device),
        width=width,
        options=storage_options,
        expected_sha256=sha256,
    )
    prepare(model, ExecutionOptions(precision, compile, strict_fp32), warm_rows=batch_size or 2)


def score_shards(tasks: list[ShardTask]) -> list[ShardResult]:
    """Score a group of small shards in one Dask task, one after another.

    Each shard still commits on its own; if one raises (a crash Dask should retry), the whole
    group is retried and its already committed shards are scored and replaced again, which the
    per-shard commit makes harmless.
    """
    return [score_shard(t) for t in tasks]


def score_shard(task: ShardTask) -> ShardResult:
    """Score one shard and commit its output (and rejects) atomically."""
    t0 = time.perf_counter()
    started = time.time()
    _set_threads(task.torch_threads, task.torch_threads_by_host)
    try:
        result = _score(task, t0)
        result.started_at, result.finished_at = started, time.time()
        return result
    except ShardError as e:
        return ShardResult(
            task.rel_path,
            task.input_uri,
            "failed",
            rows_in=None if e.kind == "unreadable" else task.num_rows,
            kind=e.kind,
            message=str(e),
            duration_s=time.perf_counter() - t0,
        )


def _score(task: ShardTask, t0: float) -> ShardResult:
    model = load_model(
        task.model_uri,
        _worker_device(task.device),
        width=task.width,
        options=task.storage_options,
        expected_sha256=task.model_sha256,
    )
    model, _ = prepare(
        model,
        ExecutionOptions(task.precision, task.compile, task.strict_fp32),
        warm_rows=task.batch_size,
    )
    spec = model.spec
    meta_cols = (task.id_column, *task.passthrough)
    dataset = ShardBatches(
        task.input_uri,
        spec,
        width=model.width,
        meta_columns=meta_cols,
        batch_size=task.batch_size,
        storage_options=task.storage_options,
    )
    opts = task.storage_options
    in_loc = storage.locate(task.input_uri, opts)
    out_loc = storage.locate(task.output_uri, opts)
    rej_loc = storage.locate(task.rejects_uri, opts)
    out_fields = [(o.name, o.arrow_type(model.out_width)) for o in spec.outputs]

    # Output and rejects schemas keep the id/pass-through types this shard's footer declares;
    # the driver read the footer already and sends those fields along.
    meta_schema = pa.ipc.read_schema(pa.py_buffer(task.meta_schema))
    out_schema = output_schema(meta_schema, out_fields)
    writer = StagedParquetWriter(out_loc, out_schema, point="output-rename")
    rejects: StagedParquetWriter | None = None
    version = spec.version
    step = max(1, task.num_rows // SAMPLE_ROWS)
    numeric = [i for i, (_, t) in enumerate(out_fields) if not pa.types.is_fixed_size_list(t)]
    samples: dict[str, list[float]] = {out_fields[i][0]: [] for i in numeric}
    stats: dict[str, list[float]] = {
        out_fields[i][0]: [0, 0.0, float("inf"), float("-inf")] for i in numeric
    }
    latencies: list[float] = []
    rows_in = rows_out = rows_rej = oom = 0
    reason_counts: dict[str, int] = {}
    behind: WriteBehind | None = None
    id_hashes: list[np.ndarray] = []  # 8 bytes per row of this shard, to count duplicate ids
    try:
        loader = make_loader(dataset, pin_memory=model.device.type == "cuda")
        batches = _guard_reads(iter(loader), task.input_uri, in_loc.is_local)
        batches = read_ahead(batches, task.overlap_depth)
        behind = WriteBehind(_write_item, task.overlap_depth) if task.overlap_depth else None

        def write(target: StagedParquetWriter, rb: pa.RecordBatch) -> None:
            if behind is None:
                target.write(rb)
            else:
                behind.submit((target, rb))

        for batch in to_device_ahead(batches, model.device):
            checkpoint("batch-read")
            n = batch.num_rows
            rows_in += n
            id_hashes.append(_hash_ids(batch.meta.column(0)))
            valid = batch.features.valid
            reasons: dict[int, str] = {}
            if not valid.all():
                invalid_idx = np.flatnonzero(~valid)
                if task.on_invalid_rows == "fail":
                    i = int(invalid_idx[0])
                    reason = (batch.features.reasons or ["invalid value"])[0]
                    raise ShardError(
                        f"shard {task.input_uri}: row group {int(batch.row_groups[i])}, row "
                        f"{batch.start + i}, {task.id_column} = "
                        f"{batch.meta.column(0)[i].as_py()!r}: {reason} "
                        "(errors.on_invalid_rows = 'fail')",
                        shard=task.input_uri,
                        kind="invalid_rows",
                    )
                reasons = dict(zip(invalid_idx.tolist(), batch.features.reasons or [], strict=True))
                mask = torch.from_numpy(valid)
                if batch.device_tensor is not None:
                    x = batch.device_tensor[mask.to(model.device, non_blocking=True)]
                else:
                    x = batch.tensor[mask]
            else:
                x = batch.tensor if batch.device_tensor is None else batch.device_tensor
            try:
                scored = score(model, x)
            except ModelFailedEverywhere as e:
                raise ShardError(
                    f"shard {task.input_uri}, rows {batch.start}-{batch.start + n - 1}: {e}. "
                    f"Check the model bundle {task.model_uri} against this data.",
                    shard=task.input_uri,
                    kind="model",
                ) from e
            checkpoint("batch-scored")
            latencies.append(scored.seconds * 1000.0)
            oom += scored.oom_splits
            keep = valid.copy()
            if scored.errors:
                valid_idx = np.flatnonzero(valid)
                for j, msg in scored.errors.items():
                    reasons[int(valid_idx[j])] = msg
                keep[valid_idx[~scored.ok]] = False
            cols = output_columns(scored.outputs, spec.outputs)
            meta = batch.meta if keep.all() else batch.meta.filter(pa.array(keep))
            m = meta.num_rows
            version_col = pa.repeat(pa.scalar(version, pa.string()), m)
            arrays = [*meta.columns, *cols, version_col]
            write(writer, pa.RecordBatch.from_arrays(arrays, schema=out_schema))
            checkpoint("batch-written")
            first = (-rows_out) % step  # systematic sample: every step-th scored row
            rows_out += m
            for i in numeric:
                name = out_fields[i][0]
                vals = cols[i].to_numpy(zero_copy_only=False)
                if len(vals):
                    st = stats[name]
                    st[0] += len(vals)
                    st[1] += float(vals.sum())
                    st[2] = min(st[2], float(vals.min()))
                    st[3] = max(st[3], float(vals.max()))
                    samples[name].extend(vals[first::step].astype(float).tolist())
            if reasons:
                order = sorted(reasons)
                if rejects is None:
                    rejects = StagedParquetWriter(
                        rej_loc, rejects_schema(meta_schema), point="rejects-rename"
                    )
                rmeta = batch.meta.take(pa.array(order))
                write(
                    rejects,
                    pa.RecordBatch.from_arrays(
                        [*rmeta.columns, pa.array([reasons[i] for i in order], pa.string())],
                        schema=rejects.schema,
                    ),
                )
                rows_rej += len(order)
                _count_reasons(reason_counts, reasons)
        if rows_in != task.num_rows:
            raise ShardError(
                f"shard {task.input_uri}: read {rows_in} rows but its footer says "
                f"{task.num_rows}; the file changed while it was being scored",
                shard=task.input_uri,
                kind="unreadable",
            )
        if behind is not None:
            behind.drain()
        # Rejects first, output last: a crash in between leaves no committed output, so the
        # shard is rescored and both files are replaced.
        if rejects is not None:
            rejects.commit()
        else:
            storage.remove(rej_loc)  # a rescored shard may have had rejects before
        checkpoint("rejects-committed")
        writer.commit()
        checkpoint("output-committed")
    except BaseException:
        if behind is not None:
            with contextlib.suppress(BaseException):
                behind.drain()
        writer.abort()
        if rejects is not None:
            rejects.abort()
        raise
    duration = time.perf_counter() - t0
    if len(latencies) > LATENCY_SAMPLES:
        latencies = latencies[:: len(latencies) // LATENCY_SAMPLES + 1]
    return ShardResult(
        task.rel_path,
        task.input_uri,
        "scored",
        output=task.output_uri,
        rejects=task.rejects_uri if rows_rej else None,
        rows_in=rows_in,
        rows_out=rows_out,
        rows_rejected=rows_rej,
        duration_s=duration,
        rows_per_s=rows_in / duration if duration > 0 else 0.0,
        oom_splits=oom,
        duplicate_ids=_count_duplicates(id_hashes),
        latencies_ms=latencies,
        samples=samples,
        sample_weight=float(step),
        stats=stats,
        rejects_by_reason=reason_counts,
    )


def _write_item(item: tuple[StagedParquetWriter, pa.RecordBatch]) -> None:
    item[0].write(item[1])


def _hash_ids(ids: pa.Array) -> np.ndarray:
    if pa.types.is_integer(ids.type) and ids.null_count == 0:
        return ids.to_numpy().astype(np.int64, copy=False).view(np.uint64)
    return pd.util.hash_array(np.asarray(ids.to_pylist(), dtype=object))


def _count_duplicates(hashes: list[np.ndarray]) -> int:
    """Rows whose id (by 64-bit value or hash) already appeared in the shard."""
    if not hashes:
        return 0
    allh = np.concatenate(hashes)
    return int(len(allh) - len(np.unique(allh)))


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
