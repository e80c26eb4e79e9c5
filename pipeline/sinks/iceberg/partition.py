"""An Iceberg table's partition as a run finds it (:class:`IcebergBegun`): its files, which of
them storage lost, the token, whether a shard's manifest entry still names a good file; and
what became of the previous run's pending commit (:func:`settle_pending`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyiceberg.table import Table

from pipeline.core.errors import ConfigError
from pipeline.io import storage
from pipeline.io.manifest import Manifest
from pipeline.io.ownership import ForeignFiles
from pipeline.io.storage import Location
from pipeline.sinks.base import Expected, Removal
from pipeline.sinks.files import file_problems
from pipeline.sinks.iceberg.catalog import IcebergRef
from pipeline.sinks.iceberg.view import PartitionView, committed_run_version, landed_as
from pipeline.sinks.token import IndexPlace, Recovered, TokenState, settle_index


@dataclass(frozen=True)
class IcebergBegun:
    """The partition when the run took it (or, for ``plan``, now)."""

    table: IcebergRef
    root: Location  # the partition's folder
    snapshot: PartitionView | None  # None: no table yet
    #: Committed files storage no longer holds: their shards are scored again and the commit
    #: removes the dangling paths.
    missing: frozenset[str]
    run_version: int  # this run's token: the partition's committed run version plus one
    committed_run_version: int | None  # the table's, for this app
    token: TokenState  # as the manifest keeps it (settled, when begun under the lock)
    owners: Mapping[str, str]  # file -> shard, as the manifest listed them
    manifest_files: frozenset[str]
    recovered: Recovered | None = None
    schema: pa.Schema | None = None  # the run's output schema (None: nothing will be written)
    cleared: tuple[Removal, ...] = ()
    foreign: ForeignFiles = field(default_factory=ForeignFiles)

    @functools.cached_property
    def files(self) -> dict[str, int]:
        """The partition's files in the table: path -> size (read once: ``done`` asks per
        shard)."""
        return {f.path: f.size for f in self.snapshot.files} if self.snapshot is not None else {}

    @property
    def complete(self) -> bool:
        """The partition holds exactly the files the manifest's last commit left there, all
        of them in storage."""
        token = self.token
        if self.snapshot is None or token.pending is not None or token.committed is None:
            return False
        if self.committed_run_version != token.committed or self.missing:
            return False
        files = set(self.files)
        return bool(files) and files == set(self.manifest_files)

    def done(self, rel_path: str, entry: Mapping[str, Any], expected: Expected) -> list[str]:
        path = entry.get("file")
        if not isinstance(path, str):
            return ["its manifest entry names no file of the table"]
        if path in self.missing:
            return [
                f"its file {self.table.location.child(path).uri} is in the table but missing "
                "from storage (deleted by hand, or a lost object): it is scored again, and the "
                "run's commit removes the dangling file from the table"
            ]
        found = self.files
        if path in found:
            size = entry.get("size")
            if size is not None and found[path] != size:
                return [f"its file {path} in the table has another size than the manifest says"]
            return []
        if entry.get("committed") or entry.get("gone_from_table"):
            return [f"its file {path} is no longer in the table {self.table.uri}"]
        # Written by a run that did not commit: reused if its footer says it is this shard's.
        loc = self.table.location.child(path)
        problems = file_problems(loc, expected)
        if not problems and storage.size_of(loc) != entry.get("size"):
            problems = [f"{loc.uri} has another size than its worker reported"]
        return problems


def check_folder(ref: IcebergRef, output: Location, table: Table | None) -> None:
    """Refuse a table folder holding anything but this tool's Iceberg table (a Parquet folder
    output, a Delta table, other files) when the catalog has no table there: a table needs a
    folder of its own. A folder holding only ``metadata/`` (a creation that was cut short) is
    taken."""
    if table is not None:
        return
    try:
        names = sorted(e.name for e in storage.ls(ref.location))
    except FileNotFoundError:
        return
    except NotADirectoryError as e:
        raise ConfigError(f"output {ref.uri} is a file, not a folder for an Iceberg table") from e
    if not names or names == ["metadata"]:
        return
    raise ConfigError(
        f"output {output.uri}: {ref.uri} holds {', '.join(names[:10])}"
        f"{' ...' if len(names) > 10 else ''} but its catalog ({ref.catalog.text()}) has no table "
        f"{ref.identifier}: an Iceberg table needs a folder of its own. Nothing was written. "
        "Point the output at a new folder (or move the old output away)."
    )


def settle_pending(
    where: IndexPlace, table: Table | None, manifest: Manifest, view: PartitionView | None
) -> tuple[TokenState, Recovered | None]:
    """What became of the previous run's pending commit (:meth:`TokenState.settle`), recorded
    in the run index, with the manifest's entries brought in line with the table."""
    found = TokenState.read(manifest.format_state, where.app_id, "iceberg")
    done = committed_run_version(table.metadata, where.app_id) if table is not None else None
    pending = found.pending
    landed = None
    if (
        table is not None
        and pending is not None
        and done is not None
        and done >= pending.run_version
    ):
        at = landed_as(table.metadata, where.app_id, pending.run_version)
        landed = at[0] if at is not None else None
    token, recovered = found.settle(done, landed)
    if pending is not None:
        settle_index(where, pending, landed=recovered is not None, version=landed)
    files = {f.path for f in view.files} if view is not None else set()
    for entry in manifest.shards.values():
        if recovered is not None and entry.get("file") in files:
            entry["committed"] = True
        elif entry.get("committed") and entry.get("file") not in files:
            entry["committed"] = False
            entry["gone_from_table"] = True
    return token, recovered
