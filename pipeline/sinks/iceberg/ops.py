"""An Iceberg table's history and maintenance behind :class:`pipeline.sinks.tables.TableOps`
(:class:`IcebergTableOps`), and how a path names one (:func:`table_above`: its folder, or a
partition folder in it; the nearest folder holding ``metadata/*.metadata.json``).

A version is a snapshot's sequence number (:mod:`.history`); a rollback is one new snapshot
(:mod:`.restore`); ``optimize`` and ``vacuum`` are :mod:`.maintenance`'s. The table is always
loaded through its catalog (:mod:`.catalog`, the one door to it): the embedded SQLite catalog
in the table's control area.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyiceberg.table import Table

from pipeline.core.errors import ConfigError, NotATableError, UsageError
from pipeline.core.templates import control_area
from pipeline.io import layout, storage
from pipeline.io.storage import Location
from pipeline.sinks.iceberg import catalog, maintenance
from pipeline.sinks.iceberg import restore as rs
from pipeline.sinks.iceberg.catalog import IcebergRef
from pipeline.sinks.iceberg.history import history, snapshot_at
from pipeline.sinks.iceberg.view import partition_filter
from pipeline.sinks.tables import PartitionChange, VersionInfo

if TYPE_CHECKING:
    from pipeline.core.config import JobConfig

METADATA_DIR = "metadata"
_MAX_UP = 64  # folders walked up from a path looking for the table's metadata/


@dataclass(frozen=True)
class IcebergTableOps:
    """:class:`~pipeline.sinks.tables.TableOps` of the Iceberg table ``ref``."""

    ref: IcebergRef
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def uri(self) -> str:
        return self.ref.uri

    @property
    def location(self) -> Location:
        return self.ref.location

    @property
    def storage_options(self) -> Mapping[str, Any]:
        return self.options

    @property
    def kind(self) -> str:
        return "Iceberg table"

    @property
    def schema_reverts(self) -> bool:
        return False  # a snapshot carries no schema: a rollback keeps the table's (.restore)

    def table(self) -> Table:
        """The table as its catalog points to it now."""
        found = catalog.load(self.ref)
        if found is None:
            raise NotATableError(
                f"the catalog {self.ref.catalog.text()} has no table {self.ref.identifier} (for "
                f"{self.ref.uri}): no run has committed to it, or its control area moved",
                uri=self.ref.uri,
            )
        return found

    def history(self, limit: int | None = None) -> list[VersionInfo]:
        return history(self.table(), limit)

    def restore_changes(
        self, version: int, partition: Mapping[str, str] | None
    ) -> tuple[int, list[PartitionChange]]:
        return rs.restore_changes(self.ref, self.table(), version, partition)

    def restore_schema(self, version: int) -> tuple[list[str], list[str]]:
        return rs.restore_schema(self.ref, self.table(), version)

    def restore(self, version: int, metadata: Mapping[str, str], partitions: Sequence[str]) -> int:
        return rs.restore(self.ref, self.table(), version, metadata, partitions=partitions)

    def restore_partition(
        self, version: int, partition: Mapping[str, str], metadata: Mapping[str, str]
    ) -> int | None:
        return rs.restore_partition(self.ref, self.table(), version, partition, metadata)

    def optimize(
        self,
        partition: Mapping[str, str] | None,
        target_size: int | None,
        metadata: Mapping[str, str],
    ) -> dict[str, Any]:
        return maintenance.optimize(self.table(), partition, target_size, metadata)

    def vacuum(
        self, retention_hours: int | None, dry_run: bool, force: bool, metadata: Mapping[str, str]
    ) -> list[str]:
        return maintenance.vacuum(
            self.table(), self.location, self.options, retention_hours, dry_run, force, metadata
        )

    def read(
        self,
        version: int | None,
        partition: Mapping[str, str] | None,
        columns: Sequence[str] | None,
    ) -> pa.Table:
        """The rows of ``version`` (None: the latest), of ``partition``, ``columns`` only: a
        pyiceberg scan of that snapshot, its schema as of then, filtered by partition."""
        table = self.table()
        rs.check_partition(self.ref, table, partition)
        snap = (
            snapshot_at(self.ref, table, version)
            if version is not None
            else table.metadata.current_snapshot()
        )
        schema = table.schema()
        if snap is not None and snap.schema_id is not None:
            schema = table.schemas().get(snap.schema_id, schema)
        names = [f.name for f in schema.fields]
        wanted = list(columns) if columns is not None else names
        unknown = [c for c in wanted if c not in names]
        if unknown:
            at = f" at version {version}" if version is not None else ""
            raise UsageError(
                f"the Iceberg table {self.uri} has no column {', '.join(map(repr, unknown))}{at}"
            )
        if snap is None:
            return schema.as_arrow().empty_table().select(wanted)
        # The filtered columns are selected too: pyiceberg 0.12 returns no row of a scan whose
        # row filter names a partition column it does not select (measured: 0 rows of 40).
        scan = table.scan(
            row_filter=partition_filter(partition or {}),
            snapshot_id=snap.snapshot_id,
            selected_fields=tuple(dict.fromkeys([*wanted, *(partition or {})])),
        )
        return scan.to_arrow().select(wanted)


def _has_metadata(folder: Location) -> bool:
    """Whether ``folder`` holds an Iceberg table's ``metadata/`` (a ``*.metadata.json`` in it:
    one listing, no table client)."""
    try:
        names = [e.name for e in storage.ls(folder.child(METADATA_DIR))]
    except (FileNotFoundError, NotADirectoryError):
        return False
    return any(n.endswith(".metadata.json") for n in names)


# A table path alone names the embedded catalog beside the table: a job that names its own
# catalog (``catalog``, ``table``) is found through its job file, which says where and how.
_GIVE_THE_JOB = (
    "if the job that writes it names its catalog (catalog = ... in its job file, or "
    "--catalog), give that job file instead of the folder (score-catalog history JOB.toml; "
    "a partition: rollback JOB.toml --partition ...)"
)


def ops_at(
    root: Location, options: Mapping[str, Any], job: JobConfig | None = None
) -> IcebergTableOps:
    """The Iceberg table whose folder is ``root``, as this tool made it: its catalog in the
    control area beside it, its identifier from its folder's name. ``job``: the job file a
    command was given (where the job names the table's catalog and identifier, they come from
    it: :mod:`.catalog`); a :class:`NotATableError` when its catalog has no such table."""
    area = storage.sibling(root, control_area(root.uri))
    try:
        # The one place a command's table reference is made: a job file's catalog, identifier
        # and [storage] options; a bare path, the embedded catalog beside the table.
        if job is not None:
            ref = IcebergRef.of(root, area, job.catalog, job.table, {**job.storage, **options})
        else:
            ref = IcebergRef.of(root, area, options=options)
    except ConfigError as e:
        raise NotATableError(
            f"{root.uri} holds an Iceberg table that score-catalog cannot open: {e}. "
            + ("" if job is not None else _GIVE_THE_JOB),
            uri=root.uri,
        ) from e
    ops = IcebergTableOps(ref, dict(options))
    table = catalog.load(ref)
    if table is None:
        raise NotATableError(
            f"{root.uri} holds an Iceberg table's metadata/, but its catalog {ref.catalog.text()} "
            f"has no table {ref.identifier}: "
            + (
                "not the table the job names"
                if job is not None
                else 'not a table score-catalog made (format = "iceberg"), or its control area '
                "moved; or " + _GIVE_THE_JOB
            ),
            uri=root.uri,
        )
    try:
        catalog.check_location(ref, table)
    except ConfigError as e:
        raise NotATableError(str(e), uri=root.uri) from e
    return ops


def table_above(
    loc: Location, options: Mapping[str, Any], job: JobConfig | None = None
) -> tuple[IcebergTableOps, Location] | None:
    """The Iceberg table at ``loc`` or the nearest folder above it holding its ``metadata/``,
    and its root; None when there is none."""
    for folder in [loc, *layout.ancestors(loc)][:_MAX_UP]:
        if _has_metadata(folder):
            return ops_at(folder, options, job), folder
    return None
