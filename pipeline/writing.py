"""Incremental Parquet writers for one output shard and its rejects, committed atomically.

Rows are buffered up to ``row_group_rows`` and written as one row group, so memory stays bounded
whatever the shard size while the output does not end up with one tiny row group per batch.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.storage import Location

MODEL_VERSION_COLUMN = "model_version"
REJECT_REASON_COLUMN = "reject_reason"
DEFAULT_ROW_GROUP_ROWS = 65_536


class StagedParquetWriter:
    """Write a Parquet file that appears under its final name only on :meth:`commit`."""

    def __init__(
        self,
        loc: Location,
        schema: pa.Schema,
        *,
        row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
        point: str = "",
    ) -> None:
        self.loc = loc
        self.schema = schema
        self.row_group_rows = row_group_rows
        self.rows = 0
        self._stack = contextlib.ExitStack()
        self._file: Any = self._stack.enter_context(storage.staged_open(loc, point=point))
        self._writer = pq.ParquetWriter(self._file, schema, compression="zstd")
        self._buffer: list[pa.RecordBatch] = []
        self._buffered = 0

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        self._buffer.append(batch)
        self._buffered += batch.num_rows
        self.rows += batch.num_rows
        if self._buffered >= self.row_group_rows:
            self._flush()

    def _flush(self) -> None:
        if self._buffer:
            table = pa.Table.from_batches(self._buffer, schema=self.schema)
            self._writer.write_table(table, row_group_size=self.row_group_rows)
            self._buffer.clear()
            self._buffered = 0

    def commit(self) -> None:
        """Finish the file and publish it under its final name."""
        self._flush()
        self._writer.close()
        self._stack.close()

    def abort(self) -> None:
        """Drop everything written; the final name is left untouched."""
        with contextlib.suppress(Exception):
            self._writer.close()
        self._stack.__exit__(RuntimeError, RuntimeError("aborted"), None)


def output_schema(meta: pa.Schema, outputs: list[tuple[str, pa.DataType]]) -> pa.Schema:
    """id + pass-through columns as read, then outputs in model.toml order, then model_version."""
    fields = [meta.field(i) for i in range(len(meta))]
    fields += [pa.field(name, t) for name, t in outputs]
    fields.append(pa.field(MODEL_VERSION_COLUMN, pa.string()))
    return pa.schema(fields)


def rejects_schema(meta: pa.Schema) -> pa.Schema:
    fields = [meta.field(i) for i in range(len(meta))]
    fields.append(pa.field(REJECT_REASON_COLUMN, pa.string()))
    return pa.schema(fields)
