"""What every sink checks of files: an output file's footer against what the report says of it
(:func:`file_problems`), and files in the way of the shards a run writes (an input shard that
became a folder of the same name, or the reverse)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from pipeline.core.errors import ConfigError, ShardError
from pipeline.io import storage
from pipeline.io.layout import INPUT_FINGERPRINT_KEY, INPUT_KEY, MODEL_SHA_KEY, SETTINGS_KEY
from pipeline.io.manifest import Manifest
from pipeline.io.ownership import remove_rejects
from pipeline.io.parquet import read_footer
from pipeline.io.storage import Location
from pipeline.sinks.base import Expected

logger = logging.getLogger(__name__)


def in_the_way(files: set[str], wanted: Iterable[str]) -> dict[str, list[str]]:
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


def clear_rejects_way(
    out_root: Location, rej_root: Location, wanted: list[str], options: Mapping[str, Any] | None
) -> None:
    """The same in the rejects tree, for rejects whose output was already gone."""
    for obstacle, files in in_the_way(set(storage.list_files(rej_root)), wanted).items():
        for f in files:
            if remove_rejects(rej_root.child(f), out_root.child(f), options) is None:
                raise ConfigError(
                    f"rejects {rej_root.uri}: {rej_root.child(f).uri} is in the way of the "
                    "rejects of an input shard that changed shape, and holds rows of another "
                    "output. Nothing was removed; move it away and run again."
                )
        if files != [obstacle]:
            storage.remove_empty_folders(rej_root.child(obstacle))


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


def folder_of(partition: Mapping[str, str]) -> str:
    """The partition's folder relative to the table's root, with a trailing ``/`` ('' for an
    unpartitioned table)."""
    return "".join(f"{k}={v}/" for k, v in partition.items())


def forget_another_outputs(manifest: Manifest, name: str) -> None:
    """Entries a manifest kept for another output at this place (a Parquet folder moved away
    before the table was made here, as the README says to do) describe no file of this table:
    forgotten with one line, instead of a warning per shard that its entry names no file of
    the table."""
    state = manifest.format_state or {}
    if not manifest.shards or state.get("format") == name:
        return
    logger.info(
        "the manifest %s described a Parquet folder output that is no longer here: its %d "
        "entries are not this table's; every shard is scored",
        manifest.loc.uri,
        len(manifest.shards),
    )
    for rel in list(manifest.shards):
        manifest.forget(rel)


def uncommitted_names(
    root: Location, prefix: str, runs: tuple[str, ...], taken: set[str]
) -> tuple[str, ...]:
    """The names of files in a table partition's folder ``root`` (``prefix``: its path below
    the table's root, :func:`folder_of`) written by the runs ``runs`` that never committed
    (their names end in ``-<run>.parquet``), less the paths ``taken`` (relative to the table's
    root: in the table, or taken over by this run): no version of the table ever listed them."""
    if not runs:
        return ()
    suffixes = tuple(f"-{r}.parquet" for r in runs)
    return tuple(
        name
        for name in storage.list_files(root)
        if "/" not in name and name.endswith(suffixes) and prefix + name not in taken
    )


def foreign_files(
    dataset: Location, control_of: Callable[[str], Location], skip: Collection[str] = ()
) -> list[str]:
    """The files below the folder ``dataset`` of a table not made yet that are not this tool's
    own files of runs that never committed, relative to it, sorted (``control_of``: the control
    folder of a partition folder given relative to ``dataset``, '' for the folder itself;
    ``skip``: names at its top that a cut-short creation of the table leaves, Iceberg's
    ``metadata``).

    A run writes its files before its one commit, and a run that failed (beyond its error
    budget, killed) before any commit made the table leaves them in the partition's folder with
    no table around them. Its partition's manifest lists the run in its token's ``runs``
    (recorded before the run wrote a file) and the files' names end in ``-<run>.parquet`` (a
    killed writer's temporary file carries the run too): such files are the next run's to
    reuse or delete (:func:`uncommitted_names`), not another writer's data that makes the
    folder foreign. Everything else is."""
    runs: dict[str, tuple[str, ...]] = {}
    foreign = []
    for rel in storage.list_files(dataset):
        folder, _, name = rel.rpartition("/")
        if rel.partition("/")[0] in skip:
            continue
        if folder not in runs:
            runs[folder] = _uncommitted_runs(control_of(folder))
        if not any(_of_run(name, run) for run in runs[folder]):
            foreign.append(rel)
    return foreign


def _uncommitted_runs(control: Location) -> tuple[str, ...]:
    """The runs whose files may lie uncommitted in the partition whose control folder is
    ``control`` (its manifest's token state; none without a manifest)."""
    state = Manifest.load(control).format_state or {}
    return tuple(str(r) for r in state.get("runs") or ())


def _of_run(name: str, run: str) -> bool:
    """Whether ``name`` is a data file (or a killed writer's temporary file) run ``run`` wrote."""
    if name.startswith("."):
        return f"{storage.TMP_MARK}{run}-" in name
    return name.endswith(f"-{run}.parquet")


def delete_files(root: Location, names: tuple[str, ...]) -> None:
    """Delete files of runs that never committed (:func:`uncommitted_names`)."""
    for name in names:
        storage.remove(root.child(name))
        logger.info("deleted %s: written by a run that never committed", root.child(name).uri)


def missing_files(root: Location, prefix: str, paths: Iterable[str]) -> frozenset[str]:
    """Of a table partition's files ``paths`` (relative to the table's root; ``prefix``: the
    partition folder ``root``'s path below it), those storage does not hold: one listing of the
    partition's folder (every data file of a partition lies directly in it: ours, a
    compaction's and a rollback's), not a request per file."""
    paths = list(paths)
    if not paths:
        return frozenset()
    try:
        names = {e.name for e in storage.ls(root)}
    except FileNotFoundError:
        names = set()
    return frozenset(p for p in paths if not (p.startswith(prefix) and p[len(prefix) :] in names))
