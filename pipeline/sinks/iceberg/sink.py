"""``format = "iceberg"``: a run's scores as one snapshot of an Apache Iceberg table
(:class:`IcebergSink`), through pyiceberg.

The table is the output template's fixed part (its metadata in ``metadata/`` there); a run's
output is one partition of it (the template's ``key={placeholder}`` folders, identity partition
columns typed string), or the whole table when the template has no placeholder. Its catalog is
the job's ``catalog`` (by default an embedded SQLite ``SqlCatalog`` in the table's control area:
:mod:`.catalog`); its identifier the job's ``table`` (by default ``score_catalog.<the table
folder's name>``). Workers write each shard's data file exactly as
for a Delta table (a name no other run uses, directly in the partition's folder, no partition
column inside). Nothing is visible to a reader until :meth:`IcebergSink.commit`: ONE snapshot
that adds the run's new files and deletes every file of the partition it does not keep, with
the run's token (:mod:`.commit`). What every table format's run shares (the commit's removes,
the checks against the report, the token's states in the manifest) is
:mod:`pipeline.sinks.partition`'s; this module fills in its hooks. docs/iceberg.md describes it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pipeline.core.errors import ConfigError
from pipeline.core.templates import below, fixed_part, partition_columns
from pipeline.io import storage
from pipeline.io.layout import MODEL_INPUT_HASH_COLUMN, Places
from pipeline.io.manifest import Manifest
from pipeline.io.storage import Location
from pipeline.sinks.base import WriterSpec, WrittenFile
from pipeline.sinks.files import forget_another_outputs
from pipeline.sinks.iceberg import catalog, schema
from pipeline.sinks.iceberg.catalog import IcebergRef
from pipeline.sinks.iceberg.commit import NewFile, RunCommit, commit
from pipeline.sinks.iceberg.facts import iceberg_facts
from pipeline.sinks.iceberg.partition import check_folder
from pipeline.sinks.iceberg.runcommit import check_committed, summary
from pipeline.sinks.iceberg.view import PartitionView, committed_run_version, landed_as, view
from pipeline.sinks.partition import (
    TableBegun,
    TablePartitionSink,
    TablePlan,
    settle_pending,
)
from pipeline.sinks.tables import PARTITION, TableFile, run_metadata
from pipeline.sinks.token import Pending, Recovered, TokenState

if TYPE_CHECKING:
    from pyiceberg.table import Table

    from pipeline.core.config import JobConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IcebergSink(TablePartitionSink):
    """One run's output as an Iceberg table's partition (see the module doc)."""

    TABLE_NAMES = ("metadata",)
    KIND = "Iceberg table"

    table: IcebergRef
    root: Location  # the partition's folder (the table's root when unpartitioned)
    partition: Mapping[str, str]  # column -> value, in the template's order
    control: Location  # the partition's control folder: manifest, report, run lock
    area: Location  # the table's control area: run index, table lock, catalog
    job: str
    run_id: str
    meta_columns: tuple[str, ...]  # id and pass-through columns (the others are outputs)
    allow_new_columns: bool = False
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, config: JobConfig, places: Places, run_id: str) -> IcebergSink:
        """The partition a run of ``config`` writes (``places``: its places)."""
        opts = dict(config.storage)
        root = storage.locate(fixed_part(config.output)[0], opts)
        columns = [c for c, _ in partition_columns(config.output, fmt="iceberg")]
        rest = below(root.path, places.output.path)
        values = dict(s.partition("=")[::2] for s in rest.split("/") if s) if rest else {}
        if list(values) != columns:
            raise ConfigError(
                f"output {places.output.uri} is not a partition of the Iceberg table {root.uri} "
                f"(partition columns {columns})"
            )
        return cls(
            table=IcebergRef.of(root, places.index, config.catalog, config.table, opts),
            root=places.output,
            partition=values,
            control=places.control,
            area=places.index,
            job=config.name,
            run_id=run_id,
            meta_columns=(config.id_column, *config.passthrough),
            allow_new_columns=config.allow_schema_evolution,
            options=opts,
        )

    @property
    def name(self) -> str:
        return "iceberg"

    def check(self, mode: str, schema_: pa.Schema | None) -> None:
        """Refuse a table folder that is not this tool's Iceberg table, a table another writer
        made, and a run whose output does not fit the table's schema (read only)."""
        table = catalog.load(self.table)
        check_folder(self.table, self.root, table, self.control_of)
        if table is None:
            return
        catalog.check_location(self.table, table)
        if table.properties.get(catalog.WRITER_PROPERTY) != catalog.WRITER_PROPERTY_VALUE:
            raise ConfigError(
                f"output {self.root.uri}: the Iceberg table {self.table.identifier} was not "
                f"made by score-catalog (its table property {catalog.WRITER_PROPERTY} is not "
                "set): a run replaces whole partitions, which are not its to replace in another "
                "writer's table. Nothing was written. Point the output at a new folder."
            )
        if schema_ is not None:
            wanted = schema.iceberg_schema(self.table.uri, schema_, list(self.partition))
            schema.fit(
                self.table.uri,
                table,
                wanted,
                list(self.partition),
                allow_new=self.allow_new_columns,
            )

    def _view(self, table: Table | None) -> PartitionView | None:
        return view(self.table, table, self.partition) if table is not None else None

    def state(self, manifest: Manifest) -> TableBegun:
        """The partition as it is now (``plan``, a backfill): read only, no lock."""
        table = catalog.load(self.table)
        token = TokenState.read(manifest.format_state, self.app_id, self.name)
        return self._begun(table, token, manifest)

    def _begun(
        self, table: Table | None, token: TokenState, manifest: Manifest, **more: Any
    ) -> TableBegun:
        done = committed_run_version(table.metadata, self.app_id) if table is not None else None
        begun: TableBegun = self._begun_of(self._view(table), done, token, manifest, **more)
        return begun

    def _settle(
        self, manifest: Manifest, table: Table | None
    ) -> tuple[TokenState, Recovered | None]:
        done = committed_run_version(table.metadata, self.app_id) if table is not None else None

        def landed(pending: Pending) -> int | None:
            at = landed_as(table.metadata, self.app_id, pending.run_version) if table else None
            return at[0] if at is not None else None

        return settle_pending(
            self._index_place(), self.name, manifest, self._view(table), done, landed
        )

    def begin(
        self,
        manifest: Manifest,
        rejects: Location,
        wanted: tuple[str, ...],
        mode: str,
        schema_: pa.Schema | None,
    ) -> TableBegun:
        """Under the run lock: the table made (or its schema checked and evolved), its
        partition read, and the manifest brought up to date with it (the token settled)."""
        table = catalog.load(self.table)
        if schema_ is not None:
            table = self._ensure(table, schema_)
        forget_another_outputs(manifest, self.name)
        begun: TableBegun = self._take(
            manifest,
            rejects,
            wanted,
            self._settle(manifest, table),
            lambda token, **more: self._begun(table, token, manifest, schema=schema_, **more),
            catalog=self.table.catalog.public(),
            identifier=self.table.identifier,
        )
        return begun

    def _ensure(self, table: Table | None, output: pa.Schema) -> Table:
        """The table, made from the run's output schema, or checked against it (new columns
        added where the job allows)."""
        partition_by = list(self.partition)
        wanted = schema.iceberg_schema(self.table.uri, output, partition_by)
        if table is None:
            table = catalog.ensure_table(self.table, wanted, partition_by, {})
        catalog.check_location(self.table, table)
        added = schema.fit(
            self.table.uri, table, wanted, partition_by, allow_new=self.allow_new_columns
        )
        if added:
            table = schema.evolve(self.table.uri, table, output, partition_by)
        return table

    def writer(self) -> WriterSpec:
        return WriterSpec(self.root.uri, "per_run", iceberg_facts)

    def _partition_files(
        self, values: Mapping[str, str]
    ) -> tuple[tuple[TableFile, ...], int | None]:
        table = catalog.load(self.table)
        if table is None:
            raise ConfigError(f"no Iceberg table at {self.table.uri} ({self.table.catalog.text()})")
        snap = view(self.table, table, values)
        return snap.files, snap.version

    def keeps_fingerprints(self) -> bool:
        table = catalog.load(self.table)
        return table is not None and MODEL_INPUT_HASH_COLUMN in table.schema()._name_to_id

    def _entry_facts(self, written: WrittenFile) -> dict[str, Any]:
        return {"nan_columns": list(written.facts.get("nan_columns") or ())}

    def _new_files(
        self, entries: Mapping[str, Mapping[str, Any]], in_table: set[str]
    ) -> list[NewFile]:
        return [
            NewFile(
                str(e["file"]),
                int(e["size"]),
                int(e.get("rows") or 0),
                tuple(e.get("nan_columns") or ()),
            )
            for e in entries.values()
            if isinstance(e.get("file"), str) and e["file"] not in in_table
        ]

    def _land(
        self,
        begun: TableBegun,
        plan: TablePlan,
        manifest: Manifest,
        run_id: str,
        adds: list[NewFile],
    ) -> tuple[int, dict[str, Any]]:
        assert begun.schema is not None  # checked by the shared commit
        expected = schema.iceberg_schema(self.table.uri, begun.schema, list(self.partition))
        run = RunCommit(
            partition=self.partition,
            adds=adds,
            removes=plan.removes,
            app_id=self.app_id,
            run_version=begun.run_version,
            summary={
                **run_metadata(run_id, self.job, manifest.shards, begun.schema, self.meta_columns),
                PARTITION: self.label,
            },
        )
        version, snapshot_id = commit(self.table, run, expected)
        return version, {"snapshot_id": snapshot_id}

    def _check_landed(self, version: int, details: Mapping[str, Any], manifest: Manifest) -> None:
        check_committed(self.table, self.partition, details["snapshot_id"], manifest.shards)

    def _section_keys(self, begun: TableBegun | None) -> dict[str, Any]:
        snap = begun.snapshot if begun is not None else None
        return {
            "catalog": self.table.catalog.public(),
            "identifier": self.table.identifier,
            "snapshot_id": snap.snapshot_id if isinstance(snap, PartitionView) else None,
        }

    def _summary(self, section: Mapping[str, Any]) -> str:
        return summary(section)
