"""The table at one version, as a run reads it: its files (of one partition) and its apps' last
committed run versions, all from one ``DeltaTable`` object (so every answer is of one version)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow as pa
from deltalake import DeltaTable

from pipeline.core.errors import UsageError
from pipeline.sinks.delta.client import TableRef, delta_errors, open_table, partition_columns
from pipeline.sinks.tables import TableFile


@dataclass(frozen=True, eq=False)
class Snapshot:
    """The table at one version: its files (of one partition, if asked) and app versions.

    Taken from one ``DeltaTable`` object, so every answer is of the same version.
    """

    uri: str
    version: int
    partition_columns: tuple[str, ...]
    files: tuple[TableFile, ...]
    properties: Mapping[str, str]
    _table: DeltaTable = field(repr=False)

    def transaction_version(self, app_id: str) -> int | None:
        """The app's latest committed run version at this snapshot; None if it never did."""
        return self._table.transaction_version(app_id)

    @property
    def columns(self) -> tuple[str, ...]:
        """The table's columns at this version (partition columns included)."""
        return tuple(f.name for f in self._table.schema().fields)

    @property
    def rows(self) -> int | None:
        """Rows in :attr:`files`; None if a file has no row count in its stats."""
        counts = [f.rows for f in self.files]
        return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)


def table_files(table: DeltaTable) -> list[TableFile]:
    actions = pa.table(table.get_add_actions(flatten=True))
    cols = set(actions.column_names)
    parts = [c for c in partition_columns(table) if f"partition.{c}" in cols]
    data = actions.to_pydict()
    out = []
    for i, path in enumerate(data["path"]):
        out.append(
            TableFile(
                path=path,
                size=int(data["size_bytes"][i]),
                partition_values={c: data[f"partition.{c}"][i] for c in parts},
                rows=data["num_records"][i] if "num_records" in cols else None,
                modification_time=int(data["modification_time"][i]),
            )
        )
    return out


def in_partition(f: TableFile, partition: Mapping[str, str] | None) -> bool:
    return not partition or all(f.partition_values.get(k) == v for k, v in partition.items())


def snapshot(
    ref: TableRef, partition: Mapping[str, str] | None = None, *, version: int | None = None
) -> Snapshot:
    """The table's latest version (or ``version``): its files (only ``partition``'s, if given:
    column -> value) and, through :meth:`Snapshot.transaction_version`, each app's last
    committed run."""
    table = open_table(ref, version)
    with delta_errors(ref, "reading the log of"):
        columns = partition_columns(table)
        unknown = sorted(set(partition or {}) - set(columns))
        if unknown:
            raise UsageError(
                f"the Delta table {ref.uri} has no partition column {', '.join(unknown)} "
                f"(its partition columns: {columns or 'none'})"
            )
        files = tuple(f for f in table_files(table) if in_partition(f, partition))
        return Snapshot(
            uri=ref.uri,
            version=table.version(),
            partition_columns=tuple(columns),
            files=files,
            properties=dict(table.metadata().configuration),
            _table=table,
        )
