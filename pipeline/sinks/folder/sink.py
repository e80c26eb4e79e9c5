"""The Parquet folder: today's output format, one scored Parquet file per input shard.

The first implementation of the seam (:class:`pipeline.sinks.base.OutputFormat`):
:class:`ParquetFolder`. A worker writes each shard's file under a stable name (its input's
relative path) that replaces the previous run's file in one rename; the visible dataset is
complete when ``_SUCCESS`` is there, written last.

Making the visible output equal the run's report before ``_SUCCESS`` is written: a reader of the
output folder (pyarrow.dataset, pandas, Dask, DuckDB, Polars, Spark) sees every Parquet file in it
whose path has no component starting with ``_`` or ``.``. After a run that set must be exactly one
scored file per current input shard that was scored or skipped, all written by this tool for the
run's model and settings. Upstream events break that if nothing mends it: an input shard deleted or
compacted leaves its old output behind (stale or duplicated rows), a shard that fails this run keeps
last night's output, a schema-skipped shard keeps a previous model's rows. :func:`reconcile` removes
those, and :func:`verify` checks what is left against the report from the files' own footers;
``_SUCCESS`` is written only when it finds nothing wrong.

What this output holds of its own is what its manifest lists: only those files are ever
deleted by a run. The key-value metadata in the footer of every output file
(:func:`footer_metadata`) says that this tool wrote a file, not that this output did (a file
copied in from another output carries it too): it lets :func:`check_output_owner` accept a
folder a crashed run left before its first manifest save, and :func:`verify` check what a
reader sees, but a file the manifest does not list is never deleted unless the job says
``on_foreign_output = "replace"`` (:func:`remove_foreign`). :func:`check_output_owner` refuses
a foreign output folder before anything is written.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.errors import ConfigError, ShardError
from pipeline.io import layout, ownership, storage
from pipeline.io.layout import (
    DATA_SUFFIXES,
    INPUT_FINGERPRINT_KEY,
    INPUT_KEY,
    LEGACY_REJECTS,
    MODEL_SHA_KEY,
    SETTINGS_KEY,
    is_visible,
)
from pipeline.io.manifest import Manifest
from pipeline.io.ownership import REPLACE_FLAG, ForeignFiles, is_data, remove_rejects
from pipeline.io.parquet import read_footer
from pipeline.io.storage import Location
from pipeline.sinks.base import (
    Committed,
    Expected,
    FileFacts,
    Reconciliation,
    Removal,
    WrittenFile,
)

logger = logging.getLogger(__name__)

SHAPE_REASON = (
    "its input shard changed shape (a file became a folder of the same name, or the reverse)"
)


def _in_the_way(files: set[str], wanted: Iterable[str]) -> dict[str, list[str]]:
    """Files below a root that keep the paths ``wanted`` from being written: for each wanted
    path, an existing file where one of its folders must go, or the files below a folder of
    its very name. Returns obstacle -> the files to take away (itself, or its contents)."""
    below: dict[str, list[str]] = {}
    for f in sorted(files):
        parts = f.split("/")
        for i in range(1, len(parts)):
            below.setdefault("/".join(parts[:i]), []).append(f)
    found: dict[str, list[str]] = {}
    for rel in wanted:
        parts = rel.split("/")
        for i in range(1, len(parts)):
            folder = "/".join(parts[:i])
            if folder in files:
                found[folder] = [folder]
        if rel in below:
            found[rel] = below[rel]
    return found


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
    blocking = _in_the_way(set(storage.list_files(out_root)), wanted)
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
    _clear_rejects_way(out_root, rej_root, wanted, options)
    return removed


def _clear_rejects_way(
    out_root: Location, rej_root: Location, wanted: list[str], options: Mapping[str, Any] | None
) -> None:
    """The same in the rejects tree, for rejects whose output was already gone."""
    for obstacle, files in _in_the_way(set(storage.list_files(rej_root)), wanted).items():
        for f in files:
            if remove_rejects(rej_root.child(f), out_root.child(f), options) is None:
                raise ConfigError(
                    f"rejects {rej_root.uri}: {rej_root.child(f).uri} is in the way of the "
                    "rejects of an input shard that changed shape, and holds rows of another "
                    "output. Nothing was removed; move it away and run again."
                )
        if files != [obstacle]:
            storage.remove_empty_folders(rej_root.child(obstacle))


def reconcile(
    out_root: Location,
    rej_root: Location,
    keep: set[str],
    ours: set[str],
    reasons: Mapping[str, str],
    options: Mapping[str, Any] | None = None,
) -> Reconciliation:
    """Remove every visible output of ours that is not in ``keep``, with its rejects.

    ``keep``: relative paths of shards scored or skipped in this run (their outputs stay).
    ``ours``: relative paths this output's manifest lists (its entries as the run found them,
    before it forgot failed shards). ``reasons``: why a relative path is no longer wanted
    (failed this run, skipped by the schema policy); anything else in ``ours`` lost its input
    shard. A visible file in neither set is never deleted, whatever its footer says (a scored
    file copied in from another output carries this tool's mark too): it is only listed, and
    :func:`verify` then refuses ``_SUCCESS`` if it is data. A folder below the output that a
    removal leaves without visible files loses its ``_SUCCESS`` too: it no longer has the data
    that ``_SUCCESS`` vouched for.
    """
    result = Reconciliation()
    files = storage.list_files(out_root)
    for rel in [r for r in files if is_visible(r)]:
        if rel in keep:
            continue
        loc = out_root.child(rel)
        if rel not in ours:
            result.foreign.append(rel)
            continue
        reason = reasons.get(rel, "its input shard no longer exists")
        storage.remove(loc)  # the output first: a crash in between leaves orphan rejects only
        rejects = remove_rejects(rej_root.child(rel), loc, options)
        removal = Removal(rel, loc.uri, reason, rejects)
        logger.warning("removed %s from the output: %s", removal.output, reason)
        result.removed.append(removal)
    _withdraw_emptied_successes(out_root, files, {r.rel_path for r in result.removed})
    gone = (ours | set(reasons)) - keep
    # Rejects of shards that are no longer in the dataset, whose output was already missing.
    for rel in storage.list_files(rej_root):
        if is_visible(rel) and rel in gone:
            remove_rejects(rej_root.child(rel), out_root.child(rel), options)
    _remove_legacy_rejects(out_root, rej_root, ours | keep | set(reasons))
    return result


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


def file_problems(
    loc: Location, expected: Expected, options: Mapping[str, Any] | None = None
) -> list[str]:
    """How one output file differs from what it should be, from its footer alone (a missing or
    unreadable file is one problem)."""
    try:
        info = read_footer(loc.uri, options)
    except ShardError as e:
        return [f"{loc.uri} cannot be read back: {e}"]
    problems = []
    if info.num_rows != expected.rows:
        problems.append(f"{loc.uri} holds {info.num_rows} rows, the report says {expected.rows}")
    meta = info.schema.metadata or {}
    sha = meta.get(MODEL_SHA_KEY, b"").decode()
    if sha != expected.model_sha256:
        problems.append(
            f"{loc.uri} was scored by model {sha[:12] or 'unknown'}, not this run's "
            f"{expected.model_sha256[:12]}"
        )
    found = meta.get(SETTINGS_KEY, b"").decode()
    if expected.settings_hash is not None and found != expected.settings_hash:
        problems.append(
            f"{loc.uri} was scored with settings {found or 'unknown'}, not this run's "
            f"{expected.settings_hash}"
        )
    return problems + _input_problems(loc, meta, expected)


def _input_problems(loc: Location, meta: Mapping[bytes, bytes], expected: Expected) -> list[str]:
    """Whether the file names the input shard, and the version of it, it should come from."""
    if expected.input_rel is None or INPUT_KEY not in meta:
        return []  # not checked, or written before outputs named their input
    source = meta[INPUT_KEY].decode()
    if source != expected.input_rel:
        return [
            f"{loc.uri} was scored from input shard {source}, not {expected.input_rel} (copied "
            "or renamed by hand?)"
        ]
    found = meta.get(INPUT_FINGERPRINT_KEY, b"").decode()
    if expected.input_fingerprint is not None and found != expected.input_fingerprint:
        return [
            f"{loc.uri} was scored from another version of {source} (fingerprint "
            f"{found or 'unknown'}, now {expected.input_fingerprint})"
        ]
    return []


# --------------------------------------------------------------------------- the format


@dataclass(frozen=True)
class ParquetFolder:
    """A folder of scored Parquet files, ``_SUCCESS`` when complete (see the module doc)."""

    root: Location
    options: Mapping[str, Any] = field(default_factory=dict)  # storage options, for footers

    @property
    def name(self) -> str:
        return "parquet_folder"

    @property
    def file_facts(self) -> FileFacts | None:
        return None  # a file's size is all the folder keeps of it

    @property
    def dataset(self) -> Location:
        return self.root

    @property
    def lock_root(self) -> Location:
        return self.root

    @property
    def exclusive_with(self) -> tuple[Location, ...]:
        return ()

    @property
    def mark(self) -> str | None:
        return layout.OUTPUT_MARK

    def check_owner(self, mode: str) -> None:
        ownership.check_output_owner(self.root, mode, self.options)

    def begin(self, manifest: Manifest) -> None:
        return None  # the files themselves are the state: reconcile and verify read them

    def withdraw(self) -> None:
        storage.remove(self.root.child(layout.SUCCESS_NAME))

    def replace_foreign(self, ours: set[str]) -> ForeignFiles:
        return ownership.remove_foreign(self.root, ours, self.options)

    def clear(self, rejects: Location, wanted: Iterable[str], ours: set[str]) -> list[Removal]:
        return clear_the_way(self.root, rejects, wanted, ours, self.options)

    def target(self, rel_path: str, run_id: str) -> str:
        return self.root.child(rel_path).uri  # the same name every run: it replaces the last

    def is_done(self, rel_path: str, entry: Mapping[str, Any], expected: Expected) -> list[str]:
        return file_problems(self.root.child(rel_path), expected, self.options)

    def commit_shard(self, written: WrittenFile | None) -> dict[str, Any]:
        return {}  # the file is published by its worker; its entry names it already

    def settle(
        self,
        rejects: Location,
        keep: set[str],
        ours: set[str],
        reasons: Mapping[str, str],
    ) -> Reconciliation:
        return reconcile(self.root, rejects, keep, ours, reasons, self.options)

    def verify(self, expected: Mapping[str, Expected]) -> list[str]:
        return verify(self.root, expected, self.options)

    def commit_run(self, run_id: str, entries: Mapping[str, Mapping[str, Any]]) -> Committed:
        return Committed()  # each shard's file was published as it finished

    def seal(self) -> None:
        success = self.root.child(layout.SUCCESS_NAME)
        storage.write_bytes(success, b"", point="success-rename")

    def describe(self, committed: Committed | None) -> dict[str, Any]:
        return {"format": self.name, **(committed.details if committed is not None else {})}

    def sealed(self) -> bool:
        return storage.exists(self.root.child(layout.SUCCESS_NAME))
