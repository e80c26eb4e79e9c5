"""A Delta table's partition as a run finds it (:class:`DeltaBegun`): its files, which of them
storage lost, the token, and whether a shard's manifest entry still names a good file; and the
housekeeping around it (a folder that is no table, a manifest left by a folder output, files of
runs that never committed, the run index entry of a recovered run)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipeline.core.errors import ConfigError, ShardError
from pipeline.io import layout, storage
from pipeline.io.manifest import Manifest
from pipeline.io.ownership import ForeignFiles
from pipeline.io.parquet import open_parquet
from pipeline.io.storage import Location
from pipeline.sinks.base import Expected, Removal
from pipeline.sinks.delta.stats import stats_problem
from pipeline.sinks.delta.table import Snapshot, TableRef, version_of
from pipeline.sinks.files import file_problems, folder_of, missing_files, uncommitted_names
from pipeline.sinks.token import IndexPlace, Recovered, TokenState, settle_index

logger = logging.getLogger(__name__)

# Why a file of the partition that this run does not keep goes, when no shard names it.
UNKNOWN_REASON = (
    "replaced: no shard in this output's manifest lists it (an earlier run's file whose record "
    "was replaced, one a rollback restored, or one OPTIMIZE compacted)"
)
STALE_REASON = "its input shard no longer exists"  # as the folder says it


@dataclass(frozen=True)
class DeltaBegun:
    """The partition when the run took it (or, for ``plan``, now)."""

    table: TableRef
    root: Location  # the partition's folder
    snapshot: Snapshot | None  # None: no table yet
    #: Committed files storage no longer holds (a lost object, a hand cleanup): their shards
    #: are scored again and the commit removes the dangling paths.
    missing: frozenset[str]
    run_version: int  # this run's token: the partition's committed run version plus one
    committed_run_version: int | None  # the table's, for this app
    token: TokenState  # as the manifest keeps it (settled, when begun under the lock)
    owners: Mapping[str, str]  # file -> shard, as the manifest listed them
    manifest_files: frozenset[str]  # the files the manifest's entries name
    recovered: Recovered | None = None  # the previous run's commit, found landed
    schema: pa.Schema | None = None  # the run's output schema (None: nothing will be written)
    cleared: tuple[Removal, ...] = ()
    foreign: ForeignFiles = field(default_factory=ForeignFiles)

    @property
    def complete(self) -> bool:
        """The partition holds exactly the files the manifest's last commit left there, all
        of them in storage (a backfill runs a day whose file was lost)."""
        token, snap = self.token, self.snapshot
        if snap is None or token.pending is not None or token.committed is None:
            return False
        if self.committed_run_version != token.committed or self.missing:
            return False
        files = {f.path for f in snap.files}
        return bool(files) and files == set(self.manifest_files)

    def done(self, rel_path: str, entry: Mapping[str, Any], expected: Expected) -> list[str]:
        path = entry.get("file")
        if not isinstance(path, str):
            return ["its manifest entry names no file of the table"]
        found = {f.path: f for f in self.snapshot.files} if self.snapshot is not None else {}
        if path in self.missing:
            return [
                f"its file {self.table.location.child(path).uri} is in the table but missing "
                "from storage (deleted by hand, or a lost object): it is scored again, and the "
                "run's commit removes the dangling file from the table"
            ]
        if path in found:
            size = entry.get("size")
            if size is not None and found[path].size != size:
                return [f"its file {path} in the table has another size than the manifest says"]
            return []
        if entry.get("committed") or entry.get("gone_from_table"):
            return [
                f"its file {path} is no longer in the table {self.table.uri} (rolled back, "
                "compacted by OPTIMIZE, or removed by another writer)"
            ]
        # Written by a run that did not commit: reused if its footer says it is this shard's.
        loc = self.table.location.child(path)
        options = dict(self.table.storage_options)
        problems = file_problems(loc, expected, options)
        if not problems and storage.size_of(loc) != entry.get("size"):
            problems = [f"{loc.uri} has another size than its worker reported"]
        return problems or _stale_stats(loc, entry, options)


def _stale_stats(loc: Location, entry: Mapping[str, Any], options: Mapping[str, Any]) -> list[str]:
    """A file a run wrote but never committed is reused only if the stats its worker recorded
    are what its footer gives today: stats recorded under other rules (an older version of this
    tool, before a resume) would make every commit refuse it, so the shard is scored again."""
    try:
        with open_parquet(loc.uri, options) as pf:
            problem = stats_problem(str(entry.get("stats") or ""), pf.metadata)
    except ShardError as e:
        return [f"{loc.uri} cannot be read back: {e}"]
    return [f"{loc.uri}: {problem} (recorded by another version?)"] if problem else []


def not_in_storage(
    root: Location, partition: Mapping[str, str], snap: Snapshot | None
) -> frozenset[str]:
    """The files ``snap`` lists in this partition that storage does not hold
    (:func:`pipeline.sinks.files.missing_files`)."""
    if snap is None:
        return frozenset()
    return missing_files(root, folder_of(partition), [f.path for f in snap.files])


def check_folder(table: TableRef, output: Location) -> None:
    """Refuse a table folder holding anything but a Delta table (a Parquet folder output of
    this tool, other files): a table needs a folder of its own."""
    try:
        entries = storage.ls(table.location)
    except FileNotFoundError:
        return
    except NotADirectoryError as e:
        raise ConfigError(f"output {table.uri} is a file, not a folder for a Delta table") from e
    names = sorted(e.name for e in entries)
    if not names or "_delta_log" in names:
        return
    ours = layout.OUTPUT_MARK in names or any(
        storage.exists(e.child(layout.OUTPUT_MARK)) for e in entries[:10]
    )
    what = (
        'a Parquet folder output of score-catalog (format = "parquet")'
        if ours
        else "files that are not a Delta table"
    )
    raise ConfigError(
        f"output {output.uri}: {table.uri} holds {what} ({', '.join(names[:10])}"
        f"{' ...' if len(names) > 10 else ''}) but no _delta_log/: a Delta table needs a "
        "folder of its own. Nothing was written. Point the output at a new folder (or "
        "move the old output away)."
    )


def uncommitted_files(
    root: Location, partition: Mapping[str, str], begun: DeltaBegun, kept: set[str]
) -> tuple[str, ...]:
    """The names of files in the partition's folder written by runs that never committed
    which this run does not take over (:func:`pipeline.sinks.files.uncommitted_names`)."""
    in_table = {f.path for f in begun.snapshot.files} if begun.snapshot is not None else set()
    return uncommitted_names(root, folder_of(partition), begun.token.runs, in_table | kept)


def settle_pending(
    where: IndexPlace, table: TableRef, manifest: Manifest, snap: Snapshot | None
) -> tuple[TokenState, Recovered | None]:
    """What became of the previous run's pending commit (:meth:`TokenState.settle`), recorded
    in the run index, with the manifest's entries brought in line with the table: a recovered
    commit's files are committed; a committed file the table no longer holds (rolled back,
    compacted or removed since) is scored again (:meth:`DeltaBegun.done` says why)."""
    found = TokenState.read(manifest.format_state, where.app_id, "delta")
    done = snap.transaction_version(where.app_id) if snap is not None else None
    pending = found.pending
    landed_as = None
    if pending is not None and done is not None and done >= pending.run_version:
        after = pending.after if pending.after is not None else -1
        landed_as = version_of(table, where.app_id, pending.run_version, after)
    token, recovered = found.settle(done, landed_as)
    if pending is not None:
        settle_index(where, pending, landed=recovered is not None, version=landed_as)
    files = {f.path for f in snap.files} if snap is not None else set()
    for entry in manifest.shards.values():
        if recovered is not None and entry.get("file") in files:
            entry["committed"] = True
        elif entry.get("committed") and entry.get("file") not in files:
            entry["committed"] = False
            entry["gone_from_table"] = True
    return token, recovered
