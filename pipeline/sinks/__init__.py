"""Where a run's scores go: one seam (:mod:`pipeline.sinks.base`), one package per format
(:mod:`~pipeline.sinks.folder`, :mod:`~pipeline.sinks.delta`, :mod:`~pipeline.sinks.iceberg`),
and :func:`sink_for`, the only place a format is named. Dask workers import the seam's values
only (pyarrow, no table client); a format's package is imported here, by the driver, downward."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core import jobfile
from pipeline.core.errors import ConfigError, NotATableError
from pipeline.core.templates import below, control_area, fixed_part
from pipeline.io import layout, storage
from pipeline.io.layout import Places
from pipeline.io.storage import Location
from pipeline.sinks.base import Sink
from pipeline.sinks.naming import partition_label
from pipeline.sinks.tables import TableOps

if TYPE_CHECKING:
    from pipeline.core.config import JobConfig


def sink_for(config: JobConfig, places: Places, run_id: str) -> Sink[Any, Any]:
    """The sink of a run of ``config`` whose output is at ``places`` (``config.format``)."""
    if config.format == "delta":
        # Downward and only here: a forked Dask worker that calls delta-rs after its parent
        # did panics, so no worker module may import it.
        from pipeline.sinks.delta.sink import DeltaSink

        return DeltaSink.of(config, places, run_id)
    if config.format == "iceberg":
        return _iceberg_sink(config, places, run_id)
    from pipeline.sinks.folder.sink import FolderSink

    return FolderSink(places.output, dict(config.storage))


def _iceberg_sink(config: JobConfig, places: Places, run_id: str) -> Sink[Any, Any]:
    """The Iceberg sink (downward and only here, as Delta's), or what to install for it."""
    try:
        from pipeline.sinks.iceberg.sink import IcebergSink
    except ImportError as e:
        raise ConfigError(
            f"format = 'iceberg' needs pyiceberg ({e.name or e}), which is not installed here: "
            "pip install 'score-catalog[iceberg]', or use format 'delta' or 'parquet'"
        ) from e
    return IcebergSink.of(config, places, run_id)


@dataclass(frozen=True)
class TableTarget:
    """The table a maintenance command works on, and the partition it was pointed at."""

    table: TableOps
    partition: dict[str, str] | None  # None: the whole table
    area: Location  # the table's control area: run index, table lock, partitions' locks

    @property
    def label(self) -> str | None:
        return partition_label(self.partition) if self.partition else None


def locate_table(output: str, options: Mapping[str, Any] | None = None) -> TableTarget:
    """The table ``output`` names: a job file (``*.toml``: its output template's table, its
    ``[storage]`` options), or a path or URI of the table's root or of a partition folder (a
    Delta table's ``_delta_log/`` looked for first, then an Iceberg table's ``metadata/``)."""
    opts = dict(options or {})
    job: JobConfig | None = None
    if output.endswith(".toml") and Path(output).is_file():
        job = jobfile.build_config(output)
        opts = {**dict(job.storage), **opts}
        loc = storage.locate(fixed_part(job.output)[0], opts)
    else:
        loc = storage.locate(output, opts)
    found: tuple[TableOps, Location] | None
    if job is not None and job.format == "iceberg":
        found = _iceberg_ops(loc, opts, job)  # what the job says: its table, not a search
    else:
        from pipeline.sinks.delta.ops import table_above  # downward, as sink_for

        found = table_above(loc, opts) or _iceberg_above(loc, opts)
    if found is None:
        raise NotATableError(
            f"no table at {loc.uri} or above it (no _delta_log/ nor an Iceberg metadata/): give "
            "the table's folder, a partition folder in it, or the job file of a job with "
            'format = "delta" or "iceberg"',
            uri=loc.uri,
        )
    table, root = found
    rest = below(root.path, loc.path)
    partition = dict(s.partition("=")[::2] for s in rest.split("/") if s) if rest else None
    return TableTarget(table, partition, storage.sibling(root, control_area(root.uri)))


def _iceberg_ops(
    loc: Location, options: Mapping[str, Any], job: JobConfig
) -> tuple[TableOps, Location]:
    """The Iceberg table of ``job`` (its output template's fixed part is ``loc``)."""
    try:
        from pipeline.sinks.iceberg.ops import ops_at
    except ImportError as e:
        raise _no_pyiceberg(loc, e) from e
    return ops_at(loc, options, job), loc


def _iceberg_above(loc: Location, options: Mapping[str, Any]) -> tuple[TableOps, Location] | None:
    """The Iceberg table at ``loc`` or above it, if pyiceberg is here to read it."""
    try:
        from pipeline.sinks.iceberg.ops import table_above
    except ImportError as e:
        if _iceberg_metadata_above(loc):
            raise _no_pyiceberg(loc, e) from e
        return None
    return table_above(loc, options)


def _no_pyiceberg(loc: Location, e: ImportError) -> ConfigError:
    return ConfigError(
        f"{loc.uri} is an Iceberg table; reading it needs pyiceberg ({e.name or e}), which is "
        "not installed here: pip install 'score-catalog[iceberg]'"
    )


def _iceberg_metadata_above(loc: Location) -> bool:
    """Whether ``loc`` or a folder above it holds an Iceberg table's ``metadata/`` folder with a
    ``*.metadata.json`` (a listing per folder; no table client)."""
    for folder in (loc, *layout.ancestors(loc)):
        try:
            names = [e.name for e in storage.ls(folder.child("metadata"))]
        except (FileNotFoundError, NotADirectoryError):
            continue
        if any(n.endswith(".metadata.json") for n in names):
            return True
    return False
