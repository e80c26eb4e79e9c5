"""A Delta table's rows, read the safe way: the file list from the log, the files with pyarrow."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.errors import UsageError
from pipeline.io import storage
from pipeline.sinks.delta.client import TableRef
from pipeline.sinks.delta.snapshot import snapshot


def read(
    ref: TableRef,
    *,
    version: int | None = None,
    partition: Mapping[str, str] | None = None,
    columns: Sequence[str] | None = None,
) -> pa.Table:
    """The table's rows (at ``version``; of ``partition``; ``columns`` only), for checks and
    drift: what any Delta reader sees, typed as the table's schema.

    Read with pyarrow, file by file, from the file list in the log (delta-rs reads only the
    log): none of delta-rs's scans runs in this process. ``to_pyarrow_table`` reads through a
    pyarrow filesystem wrapping delta-rs, and a process that used it aborts at exit
    ("terminate called without an active exception", SIGABRT, 3 to 5 runs in 6 here; delta-rs
    #2184, polars #24169), which would replace the exit code cron reads. Partition values come
    from the log, as every reader takes them; a column a file lacks (added by ``ADD COLUMN``
    after it was written) reads as null, as in every reader.
    """
    snap = snapshot(ref, partition, version=version)
    schema = pa.schema(snap._table.schema().to_arrow())
    wanted = list(columns) if columns is not None else schema.names
    unknown = [c for c in wanted if c not in schema.names]
    if unknown:
        raise UsageError(f"the Delta table {ref.uri} has no column {', '.join(map(repr, unknown))}")
    out_schema = pa.schema([schema.field(c) for c in wanted])
    parts = []
    for f in snap.files:
        with storage.open_input(ref.location.child(f.path)) as fh:
            data = pq.read_table(fh)
        cols = []
        for field_ in out_schema:
            if field_.name in snap.partition_columns:
                value = f.partition_values.get(field_.name)
                cols.append(pa.array([value] * data.num_rows, field_.type))
            elif field_.name in data.column_names:
                cols.append(data.column(field_.name).cast(field_.type))
            else:
                cols.append(pa.nulls(data.num_rows, field_.type))
        parts.append(pa.table(cols, schema=out_schema))
    return pa.concat_tables(parts) if parts else out_schema.empty_table()
