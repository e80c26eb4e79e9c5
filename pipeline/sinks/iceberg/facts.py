"""The worker side of an Iceberg commit: what a worker sends back of a data file it wrote.

pyarrow only (imported by Dask workers, which never import pyiceberg). An Iceberg data file's
statistics are computed by the driver from the file's footer when it commits (pyiceberg's own
``data_file_statistics_from_parquet_metadata``, as its ``add_files`` does): a worker sends the
row count, which the driver checks against the footer, and the floating-point columns it saw a
NaN in. Footers leave NaN out of min/max and pyiceberg counts no NaN from a footer, so the driver
drops those columns' bounds: a reader that orders NaN above every number (Spark, DuckDB) must
not skip the file on them.
"""

from __future__ import annotations

from typing import Any


def iceberg_facts(metadata: Any, nan_columns: frozenset[str]) -> dict[str, Any]:
    """What the manifest keeps of a data file (``metadata``: its
    ``pyarrow.parquet.FileMetaData``): its row count and the columns holding a NaN."""
    return {"rows": int(metadata.num_rows), "nan_columns": sorted(nan_columns)}
