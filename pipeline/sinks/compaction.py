"""Small files rewritten into fewer, bigger ones, for a table format's ``optimize``: which files go
together (:func:`bins`), and one bin read and written as one new file (:func:`rewrite`), pyarrow
only. The format commits the result: removes of the old files and adds of the new ones, marked
as no change of data, in one version (Delta) or snapshot (Iceberg).

The formats' own compaction is not used: delta-rs's OPTIMIZE writes statistics of its own, which
deltalake itself reads wrong for a float column holding an infinity or a NaN (measured on
1.6.6: 0 rows for ``x = 1.0`` and ``x <= 2.0`` after compacting a partition where 1 and 2
match), and pyiceberg 0.12 has none. Here the new file's statistics are the ones the format's
workers write for every file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.io import storage
from pipeline.io.storage import Location

#: delta-rs's default target (100 MiB): files at least this big are left as they are.
DEFAULT_TARGET_SIZE = 100 * 1024 * 1024
#: Rows per row group of a compacted file (about what a run writes, so reads stream alike).
ROW_GROUP_ROWS = 65_536


@dataclass(frozen=True)
class Small:
    """A data file that may be compacted: its key (a path in the table), size and group (its
    partition: files of two partitions are never put together)."""

    key: str
    size: int
    group: str


def bins(files: Sequence[Small], target_size: int) -> list[list[Small]]:
    """The files to rewrite together, each list into one file of at most about ``target_size``
    bytes: per group, in order, files smaller than the target, packed greedily; a list of one
    file is no compaction and is left out."""
    out: list[list[Small]] = []
    by_group: dict[str, list[Small]] = {}
    for f in files:
        if f.size < target_size:
            by_group.setdefault(f.group, []).append(f)
    for group in sorted(by_group):
        current: list[Small] = []
        total = 0
        for f in by_group[group]:
            if current and total + f.size > target_size:
                out.append(current)
                current, total = [], 0
            current.append(f)
            total += f.size
        out.append(current)
    return [b for b in out if len(b) > 1]


def nan_columns(data: pa.Table | pa.RecordBatch) -> set[str]:
    """The floating-point columns of ``data`` that hold a NaN: footers leave NaN out of their
    min/max, so a format's statistics give those columns no bounds (a reader that orders NaN
    above every number must not skip the file on them). A writer collects them over its
    batches."""
    found = set()
    for name, column in zip(data.schema.names, data.columns, strict=True):
        if pa.types.is_floating(column.type) and pc.any(pc.is_nan(column)).as_py():
            found.add(name)
    return found


@dataclass(frozen=True)
class Rewritten:
    """The file one bin became: where, how big, its footer and the float columns it holds a
    NaN in (what the format's statistics need)."""

    location: Location
    size: int
    metadata: pq.FileMetaData
    nan_columns: frozenset[str]
    rows: int


def rewrite(
    sources: Sequence[Location],
    target: Location,
    schema: pa.Schema,
    align: Callable[[pa.Table], pa.Table],
    keep: Sequence[bytes] = (),
) -> Rewritten:
    """Read ``sources`` in order and write their rows to ``target`` (staged: visible whole or
    not at all) with ``schema``; ``align`` makes each source's table fit ``schema`` (a column
    it lacks as nulls, as readers read it). The footer keys ``keep`` that every source has, with
    one value, the new file has too (an incremental run's scorer: its rows stay a baseline)."""
    nan: set[str] = set()
    rows = 0
    metadata = _shared(sources, keep) if keep else {}
    with storage.staged_open(target) as fh:
        writer = pq.ParquetWriter(fh, schema.with_metadata(metadata), compression="zstd")
        for src in sources:
            with storage.open_input(src) as f:
                data = align(pq.read_table(f))
            nan |= nan_columns(data)
            rows += data.num_rows
            writer.write_table(data, row_group_size=ROW_GROUP_ROWS)
        writer.close()
    found: Any = writer.writer.metadata  # the footer as written
    size = storage.size_of(target)
    return Rewritten(target, int(size or 0), found, frozenset(nan), rows)


def _shared(sources: Sequence[Location], keep: Sequence[bytes]) -> dict[bytes, bytes]:
    """The footer keys of ``keep`` that every source has with one value (footers only)."""
    shared: dict[bytes, bytes] | None = None
    for src in sources:
        with storage.open_input(src) as f:
            meta = pq.ParquetFile(f).metadata.metadata or {}
        mine = {k: meta[k] for k in keep if k in meta}
        shared = mine if shared is None else {k: v for k, v in shared.items() if mine.get(k) == v}
    return shared or {}
