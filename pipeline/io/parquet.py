"""Parquet in: a shard's footer (rows, row groups, schema, a hash of its layout and statistics)
and streaming reads that keep one row group in memory. Only bytes and Parquet; what the
columns mean to the model is :mod:`pipeline.model.features`'s.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.errors import ShardError
from pipeline.io import storage


@dataclass(frozen=True)
class ShardInfo:
    """What a shard's footer says."""

    num_rows: int
    num_row_groups: int
    schema: pa.Schema
    # A hash of the row-group layout and column-chunk statistics (see :func:`footer_hash`): a
    # content signal for resume that costs no I/O beyond the footer already read.
    footer_hash: str = ""


@contextlib.contextmanager
def open_parquet(uri: str, options: Mapping[str, Any] | None = None) -> Iterator[pq.ParquetFile]:
    """Open a shard for streaming.

    ``pre_buffer=False``: pyarrow's default pre-buffering keeps every column chunk it has read,
    so memory would grow with the shard instead of staying at one row group.
    """
    loc = storage.locate(uri, options)
    with contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(storage.open_input(loc))
        except FileNotFoundError as e:
            raise ShardError(f"shard {uri} disappeared: {e}", shard=uri, kind="unreadable") from e
        try:
            pf = pq.ParquetFile(f, pre_buffer=False)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise ShardError(
                f"shard {uri} is unreadable (not a Parquet file, empty, truncated or a corrupt "
                f"footer): {e}",
                shard=uri,
                kind="unreadable",
            ) from e
        yield pf


def read_footer(uri: str, options: Mapping[str, Any] | None = None) -> ShardInfo:
    """Row count, row groups, Arrow schema and :func:`footer_hash` from the footer, without
    reading data."""
    with open_parquet(uri, options) as pf:
        return ShardInfo(
            num_rows=pf.metadata.num_rows,
            num_row_groups=pf.metadata.num_row_groups,
            schema=pf.schema_arrow,
            footer_hash=footer_hash(pf.metadata),
        )


def footer_hash(meta: pq.FileMetaData) -> str:
    """A hash of what a Parquet footer says about the data: per row group its rows and bytes,
    per column chunk its sizes and statistics (min, max, null count where written).

    Size + modification time + row count miss a shard rewritten in place with other values
    (same row count, same size, mtime restored by a copy tool). The statistics change with
    the values in practice, and they are in the footer that planning reads anyway. A rewrite
    with identical layout and identical statistics is still not detected.
    """
    h = hashlib.sha256()
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        h.update(f"rg {rg.num_rows} {rg.total_byte_size}\n".encode())
        for j in range(rg.num_columns):
            col = rg.column(j)
            h.update(
                f"{col.path_in_schema} {col.total_compressed_size} "
                f"{col.total_uncompressed_size} {_stats_text(col.statistics)}\n".encode()
            )
    return h.hexdigest()[:32]


def _stats_text(stats: pq.Statistics | None) -> str:
    if stats is None:
        return "-"
    minmax = f"{stats.min_raw!r} {stats.max_raw!r}" if stats.has_min_max else "-"
    nulls = str(stats.null_count) if stats.has_null_count else "-"
    return f"{minmax} {nulls}"
