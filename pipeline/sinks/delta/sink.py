"""``format = "delta"``: a run's scores as one commit to a Delta Lake table (:class:`DeltaSink`).

The table is the output template's fixed part; a run's output is one partition of it (the
template's ``key={placeholder}`` folders filled in), or the whole table when the template has
no placeholder. Workers write each shard's data file exactly as for a folder (staged, atomic,
footer marks), but under a name no other run uses, directly in the partition's folder, and send
back its size, rows and Delta stats (:func:`~pipeline.sinks.delta.stats.delta_facts`). The
manifest, in the partition's control folder beside the table, records each shard's file and
whether it is committed. Nothing is visible to a reader until :meth:`DeltaSink.commit`: ONE
Delta version that adds the run's new files and removes every file of the partition it does not
keep (rescored shards' old files, shards whose input vanished, failed or was skipped), carrying
the run's token (:mod:`pipeline.sinks.token`). What every table format's run shares is
:mod:`pipeline.sinks.partition`'s; this module fills in its hooks.

The run lock lives in the partition's control folder: inside a table nothing but data may live
(a ``VACUUM ... FULL`` deletes unlisted files, ``_``-names in partition folders included).
Maintenance (``rollback``, ``optimize``, ``vacuum``) takes the table lock in the table's control
area (:func:`~pipeline.sinks.tables.table_lock_root`), which a run checks right after taking
its own. docs/delta.md describes it all.
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
from pipeline.sinks.delta import table as delta
from pipeline.sinks.delta.partition import DeltaBegun, check_folder
from pipeline.sinks.delta.runcommit import (
    check_committed,
    new_files,
    summary,
)
from pipeline.sinks.delta.stats import NewFile, check_partition_values, delta_facts
from pipeline.sinks.files import forget_another_outputs
from pipeline.sinks.partition import (
    TablePartitionSink,
    TablePlan,
    settle_pending,
)
from pipeline.sinks.tables import TableFile, run_metadata
from pipeline.sinks.token import Pending, TokenState

if TYPE_CHECKING:
    from pipeline.core.config import JobConfig

logger = logging.getLogger(__name__)


def table_root(template: str, options: Mapping[str, Any] | None = None) -> Location:
    """The table an output template writes to: its fixed part."""
    return storage.locate(fixed_part(template)[0], options)


@dataclass(frozen=True)
class DeltaSink(TablePartitionSink):
    """One run's output as a Delta table's partition (see the module doc)."""

    TABLE_NAMES = ("_delta_log",)
    KIND = "Delta table"

    table: delta.TableRef
    root: Location  # the partition's folder (the table's root when unpartitioned)
    partition: Mapping[str, str]  # column -> value, in the table's partition column order
    control: Location  # the partition's control folder: manifest, report, run lock
    area: Location  # the table's control area: run index, table lock
    job: str
    run_id: str
    meta_columns: tuple[str, ...]  # id and pass-through columns (the others are outputs)
    allow_new_columns: bool = False
    log_retention_days: int = delta.DEFAULT_LOG_RETENTION_DAYS
    deleted_file_retention_days: int = delta.DEFAULT_DELETED_FILE_RETENTION_DAYS
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, config: JobConfig, places: Places, run_id: str) -> DeltaSink:
        """The partition a run of ``config`` writes (``places``: its places)."""
        opts = dict(config.storage)
        root = table_root(config.output, opts)
        columns = [c for c, _ in partition_columns(config.output)]
        rest = below(root.path, places.output.path)
        segments = [s for s in rest.split("/") if s] if rest else []
        values = dict(s.partition("=")[::2] for s in segments)
        if list(values) != columns:
            raise ConfigError(
                f"output {places.output.uri} is not a partition of the Delta table {root.uri} "
                f"(partition columns {columns})"
            )
        check_partition_values(values)
        return cls(
            table=delta.TableRef.of(root.uri, opts),
            root=places.output,
            partition=values,
            control=places.control,
            area=places.index,
            job=config.name,
            run_id=run_id,
            meta_columns=(config.id_column, *config.passthrough),
            allow_new_columns=config.allow_schema_evolution,
            log_retention_days=config.delta.log_retention_days,
            deleted_file_retention_days=config.delta.deleted_file_retention_days,
            options=opts,
        )

    @property
    def name(self) -> str:
        return "delta"

    def check(self, mode: str, schema: pa.Schema | None) -> None:
        """Refuse a table folder that is not a Delta table, a table this tool did not create,
        and a run whose output does not fit the table's schema (read only: no lock yet)."""
        check_folder(self.table, self.root, self.control_of)
        if not delta.table_exists(self.table):
            return
        snap = delta.snapshot(self.table, self.partition or None)
        if snap.properties.get(delta.WRITER_PROPERTY) != delta.WRITER_PROPERTY_VALUE:
            raise ConfigError(
                f"output {self.root.uri}: the Delta table {self.table.uri} was not created by "
                "score-catalog (its table property "
                f"{delta.WRITER_PROPERTY} is not set): a run replaces whole partitions, which "
                "are not its to replace in another writer's table. Nothing was written. Point "
                "the output at a new folder."
            )
        if schema is not None:
            delta.check_table(
                self.table, schema, list(self.partition), allow_new_columns=self.allow_new_columns
            )

    def state(self, manifest: Manifest) -> DeltaBegun:
        """The partition as it is now (``plan``, a backfill): read only, no lock."""
        snap = (
            delta.snapshot(self.table, self.partition or None)
            if delta.table_exists(self.table)
            else None
        )
        token = TokenState.read(manifest.format_state, self.app_id, self.name)
        return self._begun(snap, token, manifest)

    def _begun(
        self, snap: delta.Snapshot | None, token: TokenState, manifest: Manifest, **more: Any
    ) -> DeltaBegun:
        done = snap.transaction_version(self.app_id) if snap is not None else None
        begun: DeltaBegun = self._begun_of(snap, done, token, manifest, DeltaBegun, **more)
        return begun

    def begin(
        self,
        manifest: Manifest,
        rejects: Location,
        wanted: tuple[str, ...],
        mode: str,
        schema: pa.Schema | None,
    ) -> DeltaBegun:
        """Under the run lock: the table made (or its schema checked and evolved), its
        partition read, and the manifest brought up to date with it (the token settled)."""
        if schema is not None:
            delta.ensure_table(
                self.table,
                schema,
                list(self.partition),
                allow_new_columns=self.allow_new_columns,
                log_retention_days=self.log_retention_days,
                deleted_file_retention_days=self.deleted_file_retention_days,
                metadata={"run_id": self.run_id},
            )
        snap = (
            delta.snapshot(self.table, self.partition or None)
            if delta.table_exists(self.table)
            else None
        )
        forget_another_outputs(manifest, self.name)
        settled = self._settle(manifest, snap)
        begun: DeltaBegun = self._take(
            manifest,
            rejects,
            wanted,
            settled,
            lambda token, **more: self._begun(snap, token, manifest, schema=schema, **more),
        )
        return begun

    def writer(self) -> WriterSpec:
        return WriterSpec(self.root.uri, "per_run", delta_facts)

    def _settle(self, manifest: Manifest, snap: delta.Snapshot | None) -> tuple[TokenState, Any]:
        done = snap.transaction_version(self.app_id) if snap is not None else None

        def landed_as(pending: Pending) -> int | None:
            after = pending.after if pending.after is not None else -1
            return delta.version_of(self.table, self.app_id, pending.run_version, after)

        return settle_pending(self._index_place(), self.name, manifest, snap, done, landed_as)

    def _partition_files(
        self, values: Mapping[str, str]
    ) -> tuple[tuple[TableFile, ...], int | None]:
        snap = delta.snapshot(self.table, values or None)
        return snap.files, snap.version

    def keeps_fingerprints(self) -> bool:
        if not delta.table_exists(self.table):
            return False
        return MODEL_INPUT_HASH_COLUMN in delta.snapshot(self.table).columns

    def _entry_facts(self, written: WrittenFile) -> dict[str, Any]:
        return {
            "stats": str(written.facts.get("stats", "")),
            "modification_time": delta.now_ms(),
        }

    def _new_files(
        self, entries: Mapping[str, Mapping[str, Any]], in_table: set[str]
    ) -> list[NewFile]:
        return new_files(entries, self.partition, in_table)

    def _land(
        self,
        begun: DeltaBegun,
        plan: TablePlan,
        manifest: Manifest,
        run_id: str,
        adds: list[NewFile],
    ) -> tuple[int, dict[str, Any]]:
        assert begun.schema is not None  # checked by the shared commit
        version = delta.commit(
            self.table,
            adds=adds,
            removes=list(plan.removes),
            app_id=self.app_id,
            run_version=begun.run_version,
            metadata=run_metadata(
                run_id, self.job, manifest.shards, begun.schema, self.meta_columns
            ),
            expected_schema=begun.schema,
        )
        return version, {}

    def _check_landed(self, version: int, details: Mapping[str, Any], manifest: Manifest) -> None:
        check_committed(self.table, self.partition, version, manifest.shards)

    def _summary(self, section: Mapping[str, Any]) -> str:
        return summary(section)
