"""``format = "parquet"``: one scored Parquet file per input shard, ``_SUCCESS`` when complete.

The seam's first implementation (:class:`pipeline.sinks.base.Sink`): :class:`FolderSink`. A
worker writes each shard's file under a stable name (its input's relative path) that replaces
the previous run's file in one rename; the visible dataset is complete when ``_SUCCESS`` is
there, written last.

Making the visible output equal the run's report before ``_SUCCESS`` is written: a reader of the
output folder (pyarrow.dataset, pandas, Dask, DuckDB, Polars, Spark) sees every Parquet file in it
whose path has no component starting with ``_`` or ``.``. After a run that set must be exactly one
scored file per current input shard that was scored or skipped, all written by this tool for the
run's model and settings. Upstream events break that if nothing mends it: an input shard deleted
or compacted leaves its old output behind (stale or duplicated rows), a shard that fails this run
keeps last night's output, a schema-skipped shard keeps a previous model's rows.
:func:`plan_removals` decides which go (:func:`delete_stale` deletes them), and :func:`verify`
checks what is left against the report from the files' own footers; ``_SUCCESS`` is written only
when it finds nothing wrong.

What this output holds of its own is what its manifest lists: only those files are ever
deleted by a run. The key-value metadata in the footer of every output file says that this tool
wrote a file, not that this output did (a file copied in from another output carries it too): it
lets the owner check accept a folder a crashed run left before its first manifest save, and
:func:`verify` check what a reader sees, but a file the manifest does not list is never deleted
unless the job says ``on_foreign_output = "replace"``. A foreign output folder is refused before
anything is written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipeline.core.errors import ConfigError
from pipeline.io import layout, ownership, storage
from pipeline.io.layout import DATA_SUFFIXES, LEGACY_REJECTS, is_visible
from pipeline.io.manifest import Manifest
from pipeline.io.ownership import REPLACE_FLAG, ForeignFiles, is_data, remove_rejects
from pipeline.io.storage import Location
from pipeline.sinks.base import (
    Committed,
    Expected,
    Outcome,
    Removal,
    Section,
    SinkPlaces,
    Visible,
    WriterSpec,
    WrittenFile,
)
from pipeline.sinks.files import clear_rejects_way, file_problems, in_the_way

logger = logging.getLogger(__name__)

SHAPE_REASON = (
    "its input shard changed shape (a file became a folder of the same name, or the reverse)"
)
STALE_REASON = "its input shard no longer exists"


def clear_the_way(
    out_root: Location,
    rej_root: Location,
    wanted: Iterable[str],
    ours: set[str],
    options: Mapping[str, Any] | None = None,
) -> list[Removal]:
    """Take away outputs of ours (and their rejects) that the outputs of ``wanted`` cannot be
    written beside: an input shard replaced upstream by a folder of the same name, or a folder
    by a file. On local disk a file cannot become a folder in place (nor the reverse), so the
    new output would fail to commit every night. Their inputs are gone, so the final
    :func:`reconcile` would remove them anyway; this does it before scoring.

    ``ours``: relative paths the manifest lists. Anything in the way that it does not list is a
    :class:`ConfigError` naming it, and nothing is removed.
    """
    wanted = list(wanted)
    blocking = in_the_way(set(storage.list_files(out_root)), wanted)
    for files in blocking.values():
        for f in files:
            if f not in ours:
                raise ConfigError(
                    f"output {out_root.uri}: {out_root.child(f).uri} is in the way of the "
                    f"output of an input shard that changed shape, and this output's manifest "
                    "does not list it. Nothing was removed; move it away and run again."
                )
    removed = []
    for obstacle, files in sorted(blocking.items()):
        for f in files:
            loc = out_root.child(f)
            storage.remove(loc)
            rejects = remove_rejects(rej_root.child(f), loc, options)
            removed.append(Removal(f, loc.uri, SHAPE_REASON, rejects))
            logger.warning("removed %s from the output: %s", loc.uri, SHAPE_REASON)
        if files != [obstacle]:  # a folder: empty now, or holding another output's rejects
            storage.remove_empty_folders(out_root.child(obstacle))
            storage.remove_empty_folders(rej_root.child(obstacle))
    clear_rejects_way(out_root, rej_root, wanted, options)
    return removed


@dataclass(frozen=True)
class FolderPlan:
    """What the finish takes out of the folder (:func:`plan_removals`)."""

    out_root: Location
    rej_root: Location
    goes: tuple[tuple[str, str], ...]  # (relative path, why) of each output of ours that goes
    foreign: tuple[str, ...]  # visible files neither kept nor ours: never deleted, reported
    files: tuple[str, ...]  # every file below the output, as listed
    rejects_gone: tuple[str, ...]  # shards no longer in the dataset whose rejects may linger
    known: frozenset[str]  # every shard this run knows (their legacy rejects go)

    @property
    def removed(self) -> tuple[Removal, ...]:
        return ()  # what is removed is known once deleted (delete_stale's result)

    @property
    def at_commit(self) -> bool:
        return False


def plan_removals(out_root: Location, rej_root: Location, outcome: Outcome) -> FolderPlan:
    """Every visible output of ours that is not in ``outcome.keep`` goes, with its rejects.

    ``keep``: relative paths of shards scored or skipped in this run (their outputs stay), and
    those not attempted. ``ours``: relative paths this output's manifest lists (its entries as
    the run found them, before it forgot failed shards). ``reasons``: why a relative path is no
    longer wanted (failed this run, skipped by the schema policy); anything else in ``ours``
    lost its input shard. A visible file in neither set is never deleted, whatever its footer
    says (a scored file copied in from another output carries this tool's mark too): it is
    only listed, and :func:`verify` then refuses ``_SUCCESS`` if it is data.
    """
    files = storage.list_files(out_root)
    goes, foreign = [], []
    for rel in [r for r in files if is_visible(r) and r not in outcome.keep]:
        if rel in outcome.ours:
            goes.append((rel, outcome.reasons.get(rel, STALE_REASON)))
        else:
            foreign.append(rel)
    gone = (outcome.ours | set(outcome.reasons)) - outcome.keep
    return FolderPlan(
        out_root=out_root,
        rej_root=rej_root,
        goes=tuple(goes),
        foreign=tuple(foreign),
        files=tuple(files),
        rejects_gone=tuple(sorted(gone)),
        known=frozenset(outcome.ours | outcome.keep | set(outcome.reasons)),
    )


def delete_stale(plan: FolderPlan, options: Mapping[str, Any] | None) -> tuple[Removal, ...]:
    """Delete what ``plan`` says goes, each output with its rejects; a folder below the output
    that a removal leaves without visible files loses its ``_SUCCESS`` too (it no longer has the
    data it vouched for)."""
    out_root, rej_root = plan.out_root, plan.rej_root
    removed = []
    for rel, reason in plan.goes:
        loc = out_root.child(rel)
        storage.remove(loc)  # the output first: a crash in between leaves orphan rejects only
        rejects = remove_rejects(rej_root.child(rel), loc, options)
        removed.append(Removal(rel, loc.uri, reason, rejects))
        logger.warning("removed %s from the output: %s", loc.uri, reason)
    _withdraw_emptied_successes(out_root, list(plan.files), {r.rel_path for r in removed})
    # Rejects of shards that are no longer in the dataset, whose output was already missing.
    gone = set(plan.rejects_gone)
    for rel in storage.list_files(rej_root):
        if is_visible(rel) and rel in gone:
            remove_rejects(rej_root.child(rel), out_root.child(rel), options)
    _remove_legacy_rejects(out_root, rej_root, set(plan.known))
    return tuple(removed)


def _withdraw_emptied_successes(out_root: Location, files: list[str], removed: set[str]) -> None:
    """Delete ``_SUCCESS`` in each folder below ``out_root`` that held removed files and now
    holds no visible file."""
    left = [f for f in files if is_visible(f) and f not in removed]
    emptied: set[str] = set()
    for rel in removed:
        parts = rel.split("/")[:-1]
        emptied.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    for folder in sorted(emptied):
        marker = out_root.child(f"{folder}/{layout.SUCCESS_NAME}")
        if f"{folder}/{layout.SUCCESS_NAME}" in files and not any(
            f.startswith(folder + "/") for f in left
        ):
            storage.remove(marker)
            logger.warning("removed %s: the data it vouched for is gone", marker.uri)


def _remove_legacy_rejects(out_root: Location, rej_root: Location, known: set[str]) -> None:
    """Rejects an older version kept inside the output (``<output>/_rejects``), where DuckDB's
    ``'<output>/**/*.parquet'`` read them as scores. Each shard this run knows has its rejects
    at ``rej_root`` now (or none), so its old copy goes."""
    legacy = out_root.child(LEGACY_REJECTS)
    if legacy.path.rstrip("/") == rej_root.path.rstrip("/"):
        return  # the job chose <output>/_rejects explicitly
    for rel in storage.list_files(legacy):
        if rel in known:
            storage.remove(legacy.child(rel))
            logger.info("removed rejects kept inside the output by an older version: %s", rel)


def verify(
    out_root: Location,
    expected: Mapping[str, Expected],
    options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Problems that forbid ``_SUCCESS``: what a reader would see differs from the report.

    ``expected``: for each shard the report counts as output (scored or skipped), what its file
    must say. The check reads only footers: every visible data file must be one of those
    shards, have that many rows, carry this run's model SHA-256 and settings hash, and name
    its input shard and that shard's current fingerprint (files written before outputs named
    their input are checked without that). Visible files that are not data (``notes.txt``)
    are not counted: Parquet readers skip them by name or fail on them loudly, they do not
    read them as rows. A Parquet file under a hidden name (``<output>/_archive/x.parquet``)
    is a problem too: pyarrow and pandas skip it, but DuckDB's ``'<output>/**/*.parquet'``
    reads it as scores.
    """
    problems: list[str] = []
    files = storage.list_files(out_root)
    visible = [rel for rel in files if is_visible(rel)]
    for rel in [r for r in files if not is_visible(r) and r.lower().endswith(DATA_SUFFIXES)]:
        problems.append(
            f"{out_root.child(rel).uri} is a Parquet file inside the output: pyarrow and pandas "
            "skip its hidden name, but DuckDB's read_parquet('<output>/**/*.parquet') reads it "
            "as scores; move it out of the output"
        )
    seen = {rel for rel in visible if rel in expected or is_data(out_root.child(rel), options)}
    for rel in sorted(seen - set(expected)):
        problems.append(
            f"{out_root.child(rel).uri} is in the output but not in the report (a reader would "
            f"take its rows for scores; delete it, or rerun with {REPLACE_FLAG})"
        )
    for rel in sorted(set(expected) - seen):
        problems.append(f"{out_root.child(rel).uri} is in the report but missing from the output")
    for rel in sorted(seen & set(expected)):
        problems += file_problems(out_root.child(rel), expected[rel], options)
    return problems


@dataclass(frozen=True)
class FolderBegun:
    """What a folder held when the run took it: the files are the state (the checks read them)."""

    root: Location
    options: Mapping[str, Any]
    listed: frozenset[str] = frozenset()  # the shards the manifest lists
    cleared: tuple[Removal, ...] = ()
    foreign: ForeignFiles = field(default_factory=ForeignFiles)

    @property
    def complete(self) -> bool:
        """``_SUCCESS`` is there, and so is every file the manifest lists (one listing: a file
        lost since makes the day work to do, for a backfill as for a run)."""
        files = storage.list_files(self.root)
        return layout.SUCCESS_NAME in files and self.listed <= set(files)

    def done(self, rel_path: str, entry: Mapping[str, Any], expected: Expected) -> list[str]:
        return file_problems(self.root.child(rel_path), expected, self.options)


@dataclass(frozen=True)
class FolderSink:
    """A folder of scored Parquet files, ``_SUCCESS`` when complete (see the module doc)."""

    root: Location
    options: Mapping[str, Any] = field(default_factory=dict)  # storage options, for footers

    @property
    def name(self) -> str:
        return "parquet_folder"

    @property
    def places(self) -> SinkPlaces:
        return SinkPlaces(self.root, self.root, self.root, (), layout.OUTPUT_MARK)

    def check(self, mode: str, schema: pa.Schema | None) -> None:
        ownership.check_output_owner(self.root, mode, self.options)

    def state(self, manifest: Manifest) -> FolderBegun:
        return FolderBegun(self.root, self.options, frozenset(manifest.shards))

    def begin(
        self,
        manifest: Manifest,
        rejects: Location,
        wanted: tuple[str, ...],
        mode: str,
        schema: pa.Schema | None,
    ) -> FolderBegun:
        ours = set(manifest.shards)
        foreign = ForeignFiles()
        if mode == "replace":
            foreign = ownership.remove_foreign(self.root, ours, self.options)
        cleared = clear_the_way(self.root, rejects, wanted, ours, self.options)
        return FolderBegun(self.root, self.options, frozenset(ours), tuple(cleared), foreign)

    def visible(self, output: str) -> Visible:
        """Every Parquet file a reader of the folder ``output`` sees (any run may have written
        them: the baseline reads each file's footer before it trusts a row of it)."""
        loc = storage.locate(output, self.options)
        names = [rel for rel in layout.visible_files(loc) if rel.endswith(DATA_SUFFIXES)]
        return Visible(tuple(loc.child(rel).uri for rel in sorted(names)))

    def keeps_fingerprints(self) -> bool:
        return False  # each run's files replace the last one's: no column to keep

    def writer(self) -> WriterSpec:
        # The same name every run: a shard's new file replaces its last one.
        return WriterSpec(self.root.uri, "stable", None)

    def entry_of(self, written: WrittenFile | None) -> dict[str, Any]:
        return {}  # the file is published by its worker; its entry names it already

    def plan(
        self, begun: FolderBegun, manifest: Manifest, outcome: Outcome, rejects: Location
    ) -> FolderPlan:
        return plan_removals(self.root, rejects, outcome)

    def delete_stale(self, plan: FolderPlan) -> tuple[Removal, ...]:
        return delete_stale(plan, self.options)

    def verify(
        self,
        begun: FolderBegun,
        plan: FolderPlan,
        manifest: Manifest,
        expected: Mapping[str, Expected],
    ) -> list[str]:
        return verify(self.root, expected, self.options)

    def commit(
        self,
        begun: FolderBegun,
        plan: FolderPlan,
        manifest: Manifest,
        run_id: str,
        record: Callable[[], object] | None = None,
    ) -> Committed:
        if record is not None:
            record()
        return Committed()  # each shard's file was published as it finished

    def seal(self, begun: FolderBegun, manifest: Manifest, committed: Committed) -> None:
        success = self.root.child(layout.SUCCESS_NAME)
        storage.write_bytes(success, b"", point="success-rename")

    def abort(self) -> None:
        storage.remove(self.root.child(layout.SUCCESS_NAME))

    def section(self, begun: FolderBegun | None, committed: Committed | None) -> Section:
        return Section({"format": self.name})
