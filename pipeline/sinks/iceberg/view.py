"""An Iceberg table's partition as a run reads it (:class:`PartitionView`): the snapshot readers
see, its sequence number (the table's "version" in reports), the partition's data files, and
the run token: the app's committed run version (a table property) and the snapshot that carries
it (its summary)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pyiceberg.expressions import AlwaysTrue, And, BooleanExpression, EqualTo
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import ancestors_of
from pyiceberg.typedef import Record

from pipeline.sinks.iceberg.catalog import TXN_PREFIX, IcebergRef
from pipeline.sinks.tables import APP_ID, APP_VERSION, METADATA_PREFIX, TableFile

#: Scan options of a file listing: every live data file, empty ones included. pyiceberg 0.12's
#: planning drops a file of 0 rows by default (its metrics say no row can match), so an empty
#: input shard's output file, which a run commits, would be missing from every listing: the
#: post-commit check then failed every night (found by a break-it review).
ALL_FILES = {"include_empty_files": "true"}


@dataclass(frozen=True)
class PartitionView:
    """One partition of the table at one snapshot."""

    version: int | None  # the snapshot's sequence number; None: the table has no snapshot yet
    snapshot_id: int | None
    files: tuple[TableFile, ...]  # paths relative to the table's root
    columns: tuple[str, ...]  # the table's columns


def partition_filter(partition: Mapping[str, str]) -> BooleanExpression:
    """``col = value`` for each partition column (the whole table: always true)."""
    # pyiceberg 0.12's expressions are pydantic models: mypy sees no positional __init__.
    terms: list[BooleanExpression] = [
        EqualTo(col, value)  # type: ignore[call-arg, arg-type]
        for col, value in partition.items()
    ]
    if not terms:
        return AlwaysTrue()
    return terms[0] if len(terms) == 1 else And(*terms)


def data_files(
    ref: IcebergRef, table: Table, partition: Mapping[str, str], snapshot_id: int | None = None
) -> dict[str, DataFile]:
    """The partition's live data files at ``snapshot_id`` (None: the current snapshot), by
    path relative to the table's root."""
    snap = (
        table.metadata.snapshot_by_id(snapshot_id)
        if snapshot_id is not None
        else table.metadata.current_snapshot()
    )
    if snap is None:
        return {}
    want = Record(*partition.values())
    scan = table.scan(
        row_filter=partition_filter(partition), snapshot_id=snap.snapshot_id, options=ALL_FILES
    )
    location = table.metadata.location
    found: dict[str, DataFile] = {}
    for task in scan.plan_files():
        f = task.file
        if not partition or f.partition == want:
            found[ref.rel(f.file_path, location)] = f
    return found


def table_file(rel: str, f: DataFile, partition: Mapping[str, str]) -> TableFile:
    return TableFile(
        path=rel,
        size=int(f.file_size_in_bytes),
        partition_values=dict(partition),
        rows=int(f.record_count),
        modification_time=0,
    )


def view(ref: IcebergRef, table: Table, partition: Mapping[str, str]) -> PartitionView:
    """The partition at the table's current snapshot."""
    snap = table.metadata.current_snapshot()
    files = data_files(ref, table, partition)
    return PartitionView(
        version=snap.sequence_number if snap is not None else None,
        snapshot_id=snap.snapshot_id if snap is not None else None,
        files=tuple(table_file(rel, f, partition) for rel, f in sorted(files.items())),
        columns=tuple(f.name for f in table.schema().fields),
    )


def committed_run_version(metadata: TableMetadata, app_id: str) -> int | None:
    """The app's highest committed run version: the table property its commits set."""
    found = metadata.properties.get(TXN_PREFIX + app_id)
    return int(found) if found is not None else None


def landed_as(metadata: TableMetadata, app_id: str, run_version: int) -> tuple[int, int] | None:
    """(sequence number, snapshot id) of the snapshot on the main branch that carries run
    version ``run_version`` of ``app_id``; None when none does (never committed, or expired)."""
    for snap in ancestors_of(metadata.current_snapshot(), metadata):
        summary = snap.summary
        if summary is None:
            continue
        if summary.get(METADATA_PREFIX + APP_ID) == app_id and summary.get(
            METADATA_PREFIX + APP_VERSION
        ) == str(run_version):
            return int(snap.sequence_number or 0), snap.snapshot_id
    return None
