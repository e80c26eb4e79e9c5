"""A Delta table's history and maintenance behind :class:`pipeline.sinks.tables.TableOps`, and
how a path names one (its folder, a partition folder in it: the nearest ``_delta_log/``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipeline.io import layout, storage
from pipeline.io.storage import Location
from pipeline.sinks.delta import table as delta
from pipeline.sinks.tables import PartitionChange, VersionInfo

LOG_NAME = "_delta_log"
_MAX_UP = 64  # folders walked up from a path looking for the table's _delta_log/


@dataclass(frozen=True)
class DeltaTableOps:
    """:class:`~pipeline.sinks.tables.TableOps` of the Delta table ``ref``."""

    ref: delta.TableRef

    @property
    def uri(self) -> str:
        return self.ref.uri

    @property
    def location(self) -> Location:
        return self.ref.location

    @property
    def storage_options(self) -> Mapping[str, Any]:
        return self.ref.storage_options

    @property
    def kind(self) -> str:
        return "Delta table"

    @property
    def schema_reverts(self) -> bool:
        return True  # RESTORE brings back the version's metaData

    def history(self, limit: int | None = None) -> list[VersionInfo]:
        return delta.history(self.ref, limit)

    def restore_changes(
        self, version: int, partition: Mapping[str, str] | None
    ) -> tuple[int, list[PartitionChange]]:
        return delta.restore_changes(self.ref, version, partition)

    def restore_schema(self, version: int) -> tuple[list[str], list[str]]:
        return delta.restore_schema(self.ref, version)

    def restore(self, version: int, metadata: Mapping[str, str], partitions: Sequence[str]) -> int:
        return delta.restore(self.ref, version, metadata, partitions=partitions)

    def restore_partition(
        self, version: int, partition: Mapping[str, str], metadata: Mapping[str, str]
    ) -> int | None:
        return delta.restore_partition(self.ref, version, partition, metadata)

    def optimize(
        self,
        partition: Mapping[str, str] | None,
        target_size: int | None,
        metadata: Mapping[str, str],
    ) -> dict[str, Any]:
        return delta.optimize(self.ref, partition, target_size, metadata=metadata)

    def vacuum(
        self, retention_hours: int | None, dry_run: bool, force: bool, metadata: Mapping[str, str]
    ) -> list[str]:
        return delta.vacuum(self.ref, retention_hours, dry_run, force=force, metadata=metadata)

    def read(
        self,
        version: int | None,
        partition: Mapping[str, str] | None,
        columns: Sequence[str] | None,
    ) -> pa.Table:
        return delta.read(self.ref, version=version, partition=partition, columns=columns)


def table_above(loc: Location, options: Mapping[str, Any]) -> tuple[DeltaTableOps, Location] | None:
    """The Delta table at ``loc`` or the nearest folder above it holding a ``_delta_log/``, and
    its root; None when there is none."""
    for folder in [loc, *layout.ancestors(loc)][:_MAX_UP]:
        if storage.exists(folder.child(LOG_NAME)):
            return DeltaTableOps(delta.TableRef.of(folder.uri, dict(options))), folder
    return None
