"""Output formats: where a run's scores go, behind one small protocol
(:mod:`pipeline.sinks.base`), so that the driver is the same whatever the format. The
Parquet folder is the first (:mod:`pipeline.sinks.folder.sink`); a Delta table's partition the
second (:mod:`pipeline.sinks.delta.sink`), on its two lower sides,
:mod:`~pipeline.sinks.delta.stats` (the worker's: stats from a file's footer, pyarrow only)
and :mod:`~pipeline.sinks.delta.table` (the driver's: the one commit per run, snapshot,
history, maintenance)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.io.layout import Places
from pipeline.sinks.base import OutputFormat
from pipeline.sinks.folder.sink import ParquetFolder

if TYPE_CHECKING:
    import pyarrow as pa

    from pipeline.core.config import JobConfig


def output_format(
    config: JobConfig, places: Places, run_id: str, schema: pa.Schema | None = None
) -> OutputFormat:
    """The format of a run's output (``config.format``) at ``places``; ``schema`` is the run's
    output schema, which a table checks (and creates) its own against."""
    if config.format == "delta":
        # Downward and only here: Dask workers import this package (the seam's base) and must
        # never load deltalake (a forked worker that calls delta-rs after its parent did panics).
        from pipeline.sinks.delta.sink import DeltaOutput

        return DeltaOutput.of(config, places, run_id, schema)
    return ParquetFolder(places.output, dict(config.storage))
