"""Writing data files into a Delta table's folder the way a worker does, for the Delta tests.

A "worker" here writes a real Parquet file (several row groups) through
``pipeline.io.storage.staged_open`` (a hidden temporary file renamed into place locally; an upload
that completes on close on S3), under a fresh unique name in its partition's folder, and
describes it with :func:`pipeline.sinks.delta.stats.new_file` from the writer's own footer.
"""

from __future__ import annotations

import multiprocessing
import uuid
from collections.abc import Sequence
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import DeltaTable

from pipeline.core.errors import PipelineError
from pipeline.io import storage
from pipeline.sinks.compaction import nan_columns
from pipeline.sinks.delta import table as delta
from pipeline.sinks.delta.stats import NewFile, data_file_path, new_file
from pipeline.sinks.delta.table import TableRef

SCHEMA = pa.schema([("id", pa.int64()), ("score", pa.float32()), ("model_version", pa.string())])
PARTITION = "run_date"


def rows(ids: Sequence[int], model: str, schema: pa.Schema = SCHEMA) -> pa.Table:
    """Scores for ``ids`` by ``model``: ``score = id / 1000``."""
    data = {
        "id": pa.array(list(ids), pa.int64()),
        "score": pa.array([i / 1000 for i in ids], pa.float32()),
        "model_version": pa.array([model] * len(ids), pa.string()),
    }
    return pa.table({f.name: data[f.name] for f in schema if f.name in data}, schema=schema)


def write_file(
    ref: TableRef,
    data: pa.Table,
    partition: dict[str, str] | None = None,
    *,
    row_group_rows: int = 10,
) -> NewFile:
    """Write ``data`` as one new file of ``partition`` (row groups of ``row_group_rows``)."""
    values = dict(partition or {})
    rel = data_file_path(values, f"part-00000-{uuid.uuid4().hex}.parquet")
    loc = ref.location.child(rel)
    with storage.staged_open(loc) as f:
        writer = pq.ParquetWriter(f, data.schema)
        for start in range(0, max(data.num_rows, 1), row_group_rows):
            writer.write_table(data.slice(start, row_group_rows))
        writer.close()
    nan_free = {f.name for f in data.schema if pa.types.is_floating(f.type)} - nan_columns(data)
    return new_file(
        rel,
        size=int(loc.fs.size(loc.path)),
        metadata=writer.writer.metadata,
        partition_values=values,
        nan_free=nan_free,
    )


def day(d: str) -> dict[str, str]:
    return {PARTITION: d}


def arrow_filesystem(ref: TableRef) -> pafs.FileSystem:
    """A pyarrow filesystem rooted at the table's folder (for deltalake's own reader)."""
    loc = ref.location
    if loc.is_local:
        return pafs.SubTreeFileSystem(loc.path, pafs.LocalFileSystem())
    o = ref.delta_options
    scheme, host = o["AWS_ENDPOINT_URL"].split("://", 1)
    s3 = pafs.S3FileSystem(
        access_key=o["AWS_ACCESS_KEY_ID"],
        secret_key=o["AWS_SECRET_ACCESS_KEY"],
        region=o.get("AWS_REGION", "us-east-1"),
        endpoint_override=host,
        scheme=scheme,
    )
    return pafs.SubTreeFileSystem(loc.path.rstrip("/"), s3)


def deltalake_rows(
    ref: TableRef, *, version: int | None = None, filters: list[tuple[str, str, Any]] | None = None
) -> list[tuple[Any, ...]]:
    """deltalake's ``to_pyarrow_table`` (its stats-pruning reader), rows sorted.

    Over a pyarrow filesystem of our own: through its default one (a pyarrow wrapper around
    delta-rs's object store) the process aborts at exit now and then (SIGABRT, delta-rs#2184),
    which would fail the whole pytest run after its tests passed.
    """
    table = DeltaTable(
        ref.table_uri, version=version, storage_options=dict(ref.delta_options) or None
    )
    return sorted_rows(table.to_pyarrow_table(filesystem=arrow_filesystem(ref), filters=filters))


def polars_rows(
    ref: TableRef, *, version: int | None = None, predicate: pl.Expr | None = None
) -> list[tuple[Any, ...]]:
    """Polars ``scan_delta`` (latest, or ``version``), filtered by ``predicate``, rows sorted."""
    frame = pl.scan_delta(
        ref.table_uri, version=version, storage_options=dict(ref.delta_options) or None
    )
    if predicate is not None:
        frame = frame.filter(predicate)
    return sorted_rows(frame.collect().to_arrow())


def sorted_rows(
    table: pa.Table, columns: Sequence[str] = ("id", "model_version", PARTITION)
) -> list[tuple[Any, ...]]:
    """(id, model_version, run_date) of every row, sorted (columns the table lacks left out)."""
    cols = [c for c in columns if c in table.column_names]
    data = table.select(cols).to_pylist()
    return sorted(tuple(r[c] for c in cols) for r in data)


def expected(parts: dict[str, tuple[Sequence[int], str]]) -> list[tuple[Any, ...]]:
    """The rows a table should hold: run_date -> (ids, model), sorted like :func:`sorted_rows`."""
    return sorted((i, model, d) for d, (ids, model) in parts.items() for i in ids)


# --------------------------------------------------------------------------- racing processes
# Spawned, never forked: a forked child that calls delta-rs after its parent did panics.


def race_create(uri: str, options: dict[str, Any], tag: int, barrier: Any, results: Any) -> None:
    """In a spawned process: create the table at ``uri`` once every racer is ready."""
    ref = TableRef.of(uri, options)
    barrier.wait()
    results.put((tag, delta.ensure_table(ref, SCHEMA, [PARTITION], allow_new_columns=False)))


def race_commit(
    uri: str,
    options: dict[str, Any],
    adds: list[NewFile],
    app_id: str,
    run_version: int,
    barrier: Any,
    results: Any,
) -> None:
    """In a spawned process: commit ``adds`` once every racer is ready; report the version, or
    the error's class and message."""
    ref = TableRef.of(uri, options)
    barrier.wait()
    try:
        version = delta.commit(
            ref,
            adds=adds,
            removes=[],
            app_id=app_id,
            run_version=run_version,
            metadata={"run_id": f"{app_id}-{run_version}"},
            expected_schema=SCHEMA,
        )
        results.put((app_id, "committed", version))
    except PipelineError as e:
        results.put((app_id, type(e).__name__, str(e)))


def race(target: Any, argsets: list[tuple[Any, ...]], timeout: float = 120) -> list[Any]:
    """Run ``target(*args, barrier, results)`` for each of ``argsets`` in spawned processes
    released together; their results."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(len(argsets)), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, barrier, results)) for a in argsets]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    codes = [p.exitcode for p in procs]
    assert codes == [0] * len(procs), f"racers exited with {codes}"
    return [results.get(timeout=10) for _ in procs]
