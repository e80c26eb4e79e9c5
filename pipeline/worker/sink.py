"""Incremental Parquet writers for one output shard and its rejects, committed atomically.

:class:`ShardSink` puts them together for one shard: write-behind, commit order, abort.

Rows are buffered up to ``row_group_rows`` and written as one row group, so memory stays bounded
whatever the shard size while the output does not end up with one tiny row group per batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.core.errors import ShardError
from pipeline.core.faults import checkpoint
from pipeline.core.statuses import FailureKind
from pipeline.io import storage
from pipeline.io.layout import MODEL_INPUT_HASH_COLUMN, OUTPUT_KEY
from pipeline.io.ownership import rejects_owner
from pipeline.io.storage import Location
from pipeline.worker.overlap import WriteBehind

MODEL_VERSION_COLUMN = "model_version"
REJECT_REASON_COLUMN = "reject_reason"
DEFAULT_ROW_GROUP_ROWS = 65_536


class StagedParquetWriter:
    """Write a Parquet file that appears under its final name only on :meth:`commit`.

    An error of the storage that no retry fixes (a full or read-only disk, a permission
    refused, a bucket gone) is raised as a :class:`~pipeline.core.errors.StorageError` naming the
    file: ``OSError: [Errno 28] No space left on device`` alone names no path.
    """

    def __init__(
        self,
        loc: Location,
        schema: pa.Schema,
        *,
        row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
        point: str = "",
        before_publish: Callable[[], None] | None = None,
        tag: str = "",
        watch_nan: bool = False,
    ) -> None:
        self.loc = loc
        self.schema = schema
        self.row_group_rows = row_group_rows
        self.rows = 0
        self._stack = contextlib.ExitStack()
        with storage.writing(loc):
            self._file: Any = self._stack.enter_context(
                storage.staged_open(loc, point=point, before_publish=before_publish, tag=tag)
            )
            self._writer = pq.ParquetWriter(
                self._file, schema, compression="zstd", use_dictionary=_dictionary(schema)
            )
        self._buffer: list[pa.RecordBatch] = []
        self._buffered = 0
        # Once committed: the file's size in bytes and its footer (for the output format's
        # facts about it, pipeline.sinks.base.WrittenFile).
        self.size = 0
        self.metadata: pq.FileMetaData | None = None
        # The floating-point columns that hold a NaN, when asked (``watch_nan``): footers leave
        # NaN out of their min/max, so a table format's stats need to know (file_facts).
        self._floats = [f.name for f in schema if pa.types.is_floating(f.type)]
        self._watch_nan = watch_nan and bool(self._floats)
        self.nan_columns: set[str] = set()

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        if self._watch_nan:
            self._see_nan(batch)
        self._buffer.append(batch)
        self._buffered += batch.num_rows
        self.rows += batch.num_rows
        if self._buffered >= self.row_group_rows:
            self._flush()

    def _see_nan(self, batch: pa.RecordBatch) -> None:
        for name in self._floats:
            if name not in self.nan_columns and pc.any(pc.is_nan(batch.column(name))).as_py():
                self.nan_columns.add(name)

    def _flush(self) -> None:
        if self._buffer:
            table = pa.Table.from_batches(self._buffer, schema=self.schema)
            with storage.writing(self.loc):
                self._writer.write_table(table, row_group_size=self.row_group_rows)
            self._buffer.clear()
            self._buffered = 0

    def commit(self) -> None:
        """Finish the file and publish it under its final name."""
        self._flush()
        with storage.writing(self.loc):
            self._writer.close()
            self.size = int(self._file.tell())
            self.metadata = self._writer.writer.metadata
            self._stack.close()

    def abort(self) -> None:
        """Drop everything written; the final name is left untouched.

        Never raises: closing the staged file can fail again (a full disk refuses the buffered
        bytes), and the error that made the caller abort is the one to report. The staged file
        is removed all the same (``storage.staged_open``'s ``finally``).
        """
        with contextlib.suppress(Exception):
            self._writer.close()
        with contextlib.suppress(Exception):
            self._stack.__exit__(RuntimeError, RuntimeError("aborted"), None)


def output_schema(
    meta: pa.Schema,
    outputs: list[tuple[str, pa.DataType]],
    metadata: Mapping[bytes, bytes] | None = None,
    *,
    fingerprint: bool = False,
) -> pa.Schema:
    """id + pass-through columns as read, then outputs in model.toml order, then model_version
    (and ``model_input_hash``, the row's fingerprint, when ``fingerprint``: docs/incremental.md).

    ``metadata`` goes into the Parquet footer as key-value metadata: the run's writer, model SHA-256
    and settings hash (``pipeline.io.layout.footer_metadata``), so that the check before
    ``_SUCCESS`` and a later run can tell this tool's files, and their model, from the files alone.
    Any metadata of the input schema is dropped: it described the input, not the scores.
    """
    fields = [meta.field(i) for i in range(len(meta))]
    fields += [pa.field(name, t) for name, t in outputs]
    fields.append(pa.field(MODEL_VERSION_COLUMN, pa.string()))
    if fingerprint:
        fields.append(pa.field(MODEL_INPUT_HASH_COLUMN, pa.int64()))
    return pa.schema(fields, metadata=dict(metadata) if metadata else None)


def rejects_schema(meta: pa.Schema, metadata: Mapping[bytes, bytes] | None = None) -> pa.Schema:
    """id + pass-through columns as read, then the reason; ``metadata`` (the output the rejects
    belong to, ``pipeline.io.layout.rejects_metadata``) goes into the footer."""
    fields = [meta.field(i) for i in range(len(meta))]
    fields.append(pa.field(REJECT_REASON_COLUMN, pa.string()))
    return pa.schema(fields, metadata=dict(metadata) if metadata else None)


@dataclass(frozen=True)
class SinkRun:
    """What a :class:`ShardSink` needs to know of the run it writes for."""

    # Footer metadata of the rejects file (pipeline.io.layout.rejects_metadata): the output
    # it belongs to. A rejects file there that names another output is never replaced or deleted.
    rejects_metadata: Mapping[bytes, bytes] | None = None
    # Storage options, to read the footer of a rejects file already there.
    options: Mapping[str, Any] | None = None
    # The run's id, in the names of the staged files: the run deletes what a killed worker left.
    tag: str = ""
    # Note which floating-point output columns hold a NaN (the output format's file_facts need
    # it: pipeline.sinks.base.FileFacts); off for the Parquet folder, which needs no stats.
    watch_nan: bool = False


class ShardSink:
    """Where one shard's rows go: its output, its rejects (opened on the first one), the commits.

    With ``depth`` > 0 the Parquet encoding runs in a write-behind thread. :meth:`commit`
    publishes the rejects first and the output last: a crash in between leaves no committed
    output, so the shard is rescored and both files are replaced. Leaving the ``with`` block
    by an exception drops everything staged and leaves the final names untouched.
    """

    def __init__(
        self,
        output: Location,
        rejects: Location,
        meta_schema: pa.Schema,
        out_schema: pa.Schema,
        *,
        depth: int = 0,
        fence: Callable[[], None] | None = None,
        run: SinkRun | None = None,
    ) -> None:
        # Called right before each commit; raises (LockLostError) once the run lost its lock,
        # so that a superseded run publishes nothing more (see pipeline.io.locking).
        self._fence = fence if fence is not None else _no_fence
        self._run = run if run is not None else SinkRun()
        # The rejects file names the output it belongs to; one naming another output is never
        # replaced or deleted (two jobs sharing a rejects folder by mistake).
        self._owner = (self._run.rejects_metadata or {}).get(OUTPUT_KEY)
        self.output = StagedParquetWriter(
            output,
            out_schema,
            point="output-rename",
            before_publish=self._fence,
            tag=self._run.tag,
            watch_nan=self._run.watch_nan,
        )
        self.rejects: StagedParquetWriter | None = None
        self.rejects_loc = rejects
        self.rejects_schema = rejects_schema(meta_schema, self._run.rejects_metadata)
        self.rows_rejected = 0
        self._behind = WriteBehind(_write_item, depth) if depth else None

    def __enter__(self) -> ShardSink:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is not None:
            self.abort()

    def _write(self, target: StagedParquetWriter, rb: pa.RecordBatch) -> None:
        if self._behind is None:
            target.write(rb)
        else:
            self._behind.submit((target, rb))

    def write_output(self, rb: pa.RecordBatch) -> None:
        """Queue one batch of scored rows (schema ``out_schema``)."""
        self._write(self.output, rb)

    def write_rejects(self, rb: pa.RecordBatch) -> None:
        """Queue one batch of rejected rows (schema :attr:`rejects_schema`)."""
        if self.rejects is None:
            self.rejects = StagedParquetWriter(
                self.rejects_loc,
                self.rejects_schema,
                point="rejects-rename",
                before_publish=self._fence,
                tag=self._run.tag,
            )
        self.rows_rejected += rb.num_rows
        self._write(self.rejects, rb)

    def commit(self) -> None:
        """Finish writing, then publish the rejects (or remove stale ones) and the output."""
        if self._behind is not None:
            self._behind.drain()
        # The fence runs as late as it can: right before each file is published (after its
        # last row group is encoded and synced), so a run that lost its lock while finishing
        # a shard publishes nothing more.
        self._check_rejects_owner()
        if self.rejects is not None:
            self.rejects.commit()
        else:
            self._fence()
            storage.remove(self.rejects_loc)  # a rescored shard may have had rejects before
        checkpoint("rejects-committed")
        self.output.commit()
        checkpoint("output-committed")

    def _check_rejects_owner(self) -> None:
        """Raise :class:`ShardError` if the rejects file there belongs to another output."""
        if self._owner is None:
            return
        owner = rejects_owner(self.rejects_loc, self._run.options)
        if owner is not None and owner.encode() != self._owner:
            raise ShardError(
                f"rejects file {self.rejects_loc.uri} holds rejected rows of {owner}, not of "
                f"{self._owner.decode()}: it is neither replaced nor deleted. Give each output "
                "its own rejects location.",
                shard=self.output.loc.uri,
                kind=FailureKind.ERROR,
            )

    def abort(self) -> None:
        """Drop everything staged; the final names are left as they were."""
        if self._behind is not None:
            with contextlib.suppress(BaseException):
                self._behind.drain()
        self.output.abort()
        if self.rejects is not None:
            self.rejects.abort()


def _no_fence() -> None:
    """The fence of a sink written outside any run lock (tests, tools)."""


def _write_item(item: tuple[StagedParquetWriter, pa.RecordBatch]) -> None:
    item[0].write(item[1])


def _dictionary(schema: pa.Schema) -> bool | list[str]:
    """Columns to try dictionary encoding on: every one but the fingerprint (64 random bits a
    row, never repeated: the attempt cost 0.08 s per 1.25M rows here, a third of writing the
    file, for nothing)."""
    names = [f.name for f in schema if f.name != MODEL_INPUT_HASH_COLUMN]
    return True if len(names) == len(schema) else names
