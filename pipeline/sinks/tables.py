"""What every table format says of itself, for history and maintenance: its versions, its files,
what a rollback changes, and the operations a table offers (:class:`TableOps`); and the table
lock maintenance takes, beside the table. No table client here: a format implements
:class:`TableOps` in its own package (:mod:`pipeline.sinks.delta.ops`,
:mod:`pipeline.sinks.iceberg.ops`)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa

from pipeline.io.manifest import fingerprint_hash
from pipeline.io.storage import Location

#: Prefix of every key this tool writes into a table's commits (Delta's commit info, an Iceberg
#: snapshot's summary) and its properties.
METADATA_PREFIX = "score_catalog."
# The keys of a run's commit, whatever the format (``history`` shows them; drift after a
# rollback reads the output columns), and of the token and a rollback's commit.
APP_ID = "app_id"
APP_VERSION = "app_version"
PARTITION = "partition"
FILES_ADDED = "files_added"
FILES_REMOVED = "files_removed"
RUN_ID = "run_id"
MODEL_SHA256 = "model_sha256"
SETTINGS_HASH = "settings_hash"
INPUT_FINGERPRINT = "input_fingerprint"
ROWS = "rows"
JOB = "job"
OUTPUTS = "outputs"  # the output columns, comma-separated

#: The folder, in a table's control area, of the table lock that maintenance takes.
TABLE_LOCK_DIR = "_table"


def partition_clashes(schema: pa.Schema, partition_by: Sequence[str]) -> list[str]:
    """Why the output ``schema`` cannot go into a table partitioned by ``partition_by``: a
    column of the output (the id, a pass-through column, a model output, ``model_version``)
    named like a partition column, case aside. The table's data files hold no partition column
    (a reader takes its value from the table's metadata), so such a file is refused at the
    commit: found here, before any row is scored (a break-it review met it only after scoring,
    every night). Case aside, because DuckDB and Spark match column names without it: a table
    holding ``RUN_DATE`` and ``run_date`` read the data column under the partition's name there,
    and a filter on the day returned no row (a second review)."""
    by_name: dict[str, list[str]] = {}
    for name in schema.names:
        by_name.setdefault(name.lower(), []).append(name)
    case = " (case aside: DuckDB and Spark read column names without it)"
    return [
        f"the output has a column {name!r} (of type {schema.field(name).type}), the name of "
        f"the output template's partition folder {col}=...{'' if name == col else case}: "
        "rename the column (a pass-through column is kept under its own name) or the "
        "template's key"
        for col in partition_by
        for name in by_name.get(col.lower(), [])
    ]


def run_metadata(
    run_id: str,
    job: str,
    entries: Mapping[str, Mapping[str, Any]],
    schema: pa.Schema,
    meta_columns: tuple[str, ...],
) -> dict[str, str]:
    """What a run's commit says of itself, whatever the format (under ``score_catalog.``, with
    the token the format's commit adds): run, model, settings, input, rows, job and output
    columns (``history`` shows them; drift after a rollback reads the output columns)."""
    first = next(iter(entries.values()), {})
    fingerprints = {rel: e.get("fingerprint") for rel, e in sorted(entries.items())}
    meta = {*meta_columns, "model_version"}
    return {
        RUN_ID: run_id,
        MODEL_SHA256: str(first.get("model_sha256", "")),
        SETTINGS_HASH: str(first.get("settings_hash", "")),
        INPUT_FINGERPRINT: fingerprint_hash(fingerprints),
        ROWS: str(sum(int(e.get("rows_scored") or 0) for e in entries.values())),
        JOB: job,
        OUTPUTS: ",".join(n for n in schema.names if n not in meta),
    }


def table_lock_root(area: Location) -> Location:
    """The table lock's folder in the table's control area ``area``."""
    return area.child(TABLE_LOCK_DIR)


@dataclass(frozen=True)
class TableFile:
    """A data file in the table at a snapshot."""

    path: str  # relative to the table's root, as in the log
    size: int
    partition_values: Mapping[str, str | None]
    rows: int | None  # numRecords from its stats; None when it has none
    modification_time: int  # ms since the epoch


@dataclass(frozen=True)
class VersionInfo:
    """One version of the table, as ``score-catalog history`` shows it."""

    version: int
    timestamp: dt.datetime  # UTC
    operation: str  # WRITE, CREATE TABLE, RESTORE, OPTIMIZE, VACUUM START/END, ADD COLUMN ...
    run_id: str | None
    model_sha256: str | None
    rows: int | None
    partition: str | None
    #: Every ``score_catalog.`` key of the commit, without the prefix.
    metadata: Mapping[str, str]
    #: What a version that is not a run did, in words ("restored version 3").
    detail: str
    engine: str | None


@dataclass(frozen=True)
class PartitionChange:
    """One partition's data files now and at the version a rollback restores: what
    a whole-table rollback or a partition's changes."""

    label: str  # run_date=2026-12-01 ('/'-joined for several columns; '' unpartitioned)
    now: tuple[TableFile, ...]
    then: tuple[TableFile, ...]

    @property
    def removed(self) -> tuple[TableFile, ...]:
        """The files it holds now that it did not hold then."""
        then = {f.path for f in self.then}
        return tuple(f for f in self.now if f.path not in then)

    @property
    def re_added(self) -> tuple[TableFile, ...]:
        """The files it held then that it no longer holds."""
        now = {f.path for f in self.now}
        return tuple(f for f in self.then if f.path not in now)

    @property
    def changed(self) -> bool:
        return bool(self.removed or self.re_added)

    @property
    def rows_now(self) -> int | None:
        return rows_of(self.now)

    @property
    def rows_then(self) -> int | None:
        return rows_of(self.then)


def rows_of(files: Sequence[TableFile]) -> int | None:
    counts = [f.rows for f in files]
    return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)


class TableOps(Protocol):
    """A table's history and maintenance, whatever its format."""

    @property
    def uri(self) -> str: ...

    @property
    def location(self) -> Location: ...

    @property
    def storage_options(self) -> Mapping[str, Any]: ...

    @property
    def kind(self) -> str:
        """The format's name, for messages: "Delta table", "Iceberg table"."""
        ...

    @property
    def schema_reverts(self) -> bool:
        """Whether a rollback of the whole table reverts its schema to the version's (Delta's
        RESTORE does; an Iceberg snapshot carries no schema, so there a column gained since
        stays, null in the rows restored)."""
        ...

    def history(self, limit: int | None = None) -> list[VersionInfo]:
        """The table's versions, newest first."""
        ...

    def restore_changes(
        self, version: int, partition: Mapping[str, str] | None
    ) -> tuple[int, list[PartitionChange]]:
        """(the latest version, what rolling the table or ``partition`` back to ``version``
        changes, partition by partition); changes nothing."""
        ...

    def restore_schema(self, version: int) -> tuple[list[str], list[str]]:
        """(columns gained since ``version``, problems restoring its files now)."""
        ...

    def restore(self, version: int, metadata: Mapping[str, str], partitions: Sequence[str]) -> int:
        """The whole table back to ``version``, as a new version; returns it."""
        ...

    def restore_partition(
        self, version: int, partition: Mapping[str, str], metadata: Mapping[str, str]
    ) -> int | None:
        """One partition back to ``version``, as a new version (None: nothing to change)."""
        ...

    def optimize(
        self,
        partition: Mapping[str, str] | None,
        target_size: int | None,
        metadata: Mapping[str, str],
    ) -> dict[str, Any]:
        """Compact small files: ``numFilesRemoved``, ``numFilesAdded``."""
        ...

    def vacuum(
        self, retention_hours: int | None, dry_run: bool, force: bool, metadata: Mapping[str, str]
    ) -> list[str]:
        """Delete (or list) files removed longer ago than the retention."""
        ...

    def read(
        self,
        version: int | None,
        partition: Mapping[str, str] | None,
        columns: Sequence[str] | None,
    ) -> pa.Table:
        """The rows of a version (of one partition, some columns)."""
        ...
