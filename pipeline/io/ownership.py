"""What is ours, and where a run may write: which folders and files this tool wrote, told from
their names and from the key-value metadata in their Parquet footers (:mod:`pipeline.io.layout`
names both), and locations that cannot hold a folder (:func:`check_write_target`).

Before a run takes an output, :func:`check_output_owner` refuses a folder holding what this tool
did not write and :func:`check_rejects_location` a rejects folder holding another output's
rejects; with ``on_foreign_output = "replace"`` :func:`remove_foreign` deletes foreign data
files once the lock is held. The footer's writer mark says that this tool wrote a file, not that
this output did (a file copied in from another output carries it too): only the manifest says
what an output holds of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.core.errors import ConfigError, ShardError, StorageError
from pipeline.io import layout, storage
from pipeline.io.layout import OUTPUT_KEY, WRITER, WRITER_KEY, is_visible, owner_key, visible_files
from pipeline.io.parquet import read_footer
from pipeline.io.storage import Location

logger = logging.getLogger(__name__)

#: The flag that lets a run delete foreign data files (config.JobConfig.on_foreign_output).
REPLACE_FLAG = "--on-foreign-output replace"
#: Folders this tool writes at an output root in older layouts (``_rejects``; the run and
#: backfill indexes when the output root was also the template root).
_OWN_DIRS = (layout.REJECTS_DIR, layout.RUN_INDEX_DIR, layout.BACKFILL_DIR)
_MAX_FOREIGN = 10


@dataclass(frozen=True)
class OutputState:
    """What is at an output root before a run writes there (see :func:`classify_output`)."""

    # "absent": nothing there; "empty": an empty folder; "ours": a folder this tool wrote
    # (its manifest, or only its own control files); "foreign": anything else.
    kind: Literal["absent", "empty", "ours", "foreign"]
    # Up to 10 names of entries that are not ours (for the message), when kind is "foreign".
    foreign: tuple[str, ...] = ()
    # How many entries are not ours in all (foreign may show only the first 10).
    foreign_count: int = 0


#: Names this tool writes at an output root besides data files. The report, page and manifest
#: are inside the output only in the older layout, or for an output at a bucket root
#: (pipeline.io.layout); their names stay ours either way.
_OWN_NAMES = frozenset(
    {
        layout.MANIFEST_NAME,
        layout.REPORT_NAME,
        layout.HTML_NAME,
        layout.LOCK_NAME,
        layout.SUCCESS_NAME,
        layout.OUTPUT_MARK,
        layout.CONTROL_DIR,
        *_OWN_DIRS,
    }
)


def _is_own_entry(name: str) -> bool:
    if name in _OWN_NAMES or name.startswith(layout.LOCK_PREFIX):
        return True
    # A temporary file of an interrupted write (storage.tmp_name): hidden, removed at the next
    # run.
    return name.startswith(".") and storage.TMP_MARK in name


def classify_output(
    root: Location, is_ours: Callable[[Location], bool] | None = None
) -> OutputState:
    """Say whether ``root`` is absent, empty, written by this tool ("ours") or "foreign".

    A root holding our mark (``_SCORE_CATALOG``, written as soon as a run takes the lock) or,
    from older versions, our ``_manifest.json`` is ours whatever else is there (a run wrote its
    data files there); without either it is ours only if every entry is one of our files, so a
    folder of someone else's Parquet files is never taken for a resumable output. ``is_ours``
    may vouch for other entries (:func:`output_state` reads the writer mark in a file's
    footer: a run that crashed before its first manifest save left only such files).
    """
    try:
        entries = storage.ls(root)
    except FileNotFoundError:
        return OutputState("absent")
    except NotADirectoryError as e:
        raise not_a_folder("output", root, root.path) from e
    if not entries and root.is_local and storage.is_file(root):
        raise not_a_folder("output", root, root.path)
    if not entries:
        return OutputState("absent" if not storage.exists(root) else "empty")
    names = [e.name for e in entries]
    if layout.OUTPUT_MARK in names or layout.MANIFEST_NAME in names:
        return OutputState("ours")
    foreign = [
        e.name
        for e in entries
        if not _is_own_entry(e.name) and not (is_ours is not None and is_ours(e))
    ]
    if not foreign:
        return OutputState("ours")
    return OutputState("foreign", tuple(foreign[:_MAX_FOREIGN]), len(foreign))


def _footer_meta(loc: Location, options: Mapping[str, Any] | None) -> dict[bytes, bytes] | None:
    """The footer's key-value metadata, or None when ``loc`` is not a readable Parquet file."""
    try:
        return dict(read_footer(loc.uri, options).schema.metadata or {})
    except (ShardError, OSError):  # a folder, or a file that is not Parquet
        return None


def written_by_us(loc: Location, options: Mapping[str, Any] | None = None) -> bool:
    """True when the file's footer says this tool wrote it (a crash can lose its manifest entry)."""
    meta = _footer_meta(loc, options)
    return meta is not None and meta.get(WRITER_KEY) == WRITER


def rejects_owner(loc: Location, options: Mapping[str, Any] | None = None) -> str | None:
    """The output file a rejects file says it belongs to (:data:`OUTPUT_KEY`); None when there
    is no readable Parquet file at ``loc`` or it names none (written by an older version)."""
    meta = _footer_meta(loc, options)
    owner = (meta or {}).get(OUTPUT_KEY)
    return owner.decode() if owner is not None else None


def is_data(loc: Location, options: Mapping[str, Any] | None = None) -> bool:
    """True for a file a reader may take for data: a Parquet name, or a Parquet footer."""
    return loc.name.endswith(layout.DATA_SUFFIXES) or _footer_meta(loc, options) is not None


# --------------------------------------------------------------------------- before the lock


def _entry_is_ours(loc: Location, options: Mapping[str, Any] | None) -> bool:
    """An entry at the output root: a file we wrote, or a folder holding only such files."""
    files = storage.list_files(loc)
    if not files:
        return written_by_us(loc, options)
    return all(not is_visible(rel) or written_by_us(loc.child(rel), options) for rel in files)


def output_state(root: Location, options: Mapping[str, Any] | None = None) -> OutputState:
    """:func:`classify_output`, counting our footer-marked files as ours."""
    return classify_output(root, is_ours=lambda loc: _entry_is_ours(loc, options))


def check_output_owner(
    root: Location, mode: str, options: Mapping[str, Any] | None = None
) -> OutputState:
    """Refuse (``ConfigError``, exit 2) an output folder holding what this tool did not write.

    Called before the lock is taken, so a refused folder is left exactly as it was. With
    ``mode == "replace"`` the state is returned and :func:`remove_foreign` deals with it once
    the lock is held.
    """
    state = output_state(root, options)
    if state.kind != "foreign" or mode == "replace":
        return state
    shown = ", ".join(state.foreign)
    more = (
        f" (the first {len(state.foreign)} of {state.foreign_count})"
        if state.foreign_count > len(state.foreign)
        else ""
    )
    raise ConfigError(
        f"output {root.uri} holds {state.foreign_count} entries that score-catalog did not "
        f"write{more}: {shown}. Nothing was written. Point --output at a new or empty folder, "
        f'or pass {REPLACE_FLAG} (on_foreign_output = "replace") to delete the Parquet files '
        "among them (other files are left alone)."
    )


def check_rejects_location(
    rej_root: Location,
    out_root: Location,
    options: Mapping[str, Any] | None = None,
    rel_paths: Iterable[str] | None = None,
) -> None:
    """Refuse, before anything is written, a rejects location this run could not or must not
    write: a file (or a folder under a file), or a folder holding rejects of another output.

    A rejects file names the output file it belongs to in its footer (:data:`OUTPUT_KEY`). Two
    jobs configured with the same ``rejects`` would otherwise replace or delete each other's
    files under the same names; the second one is refused (``ConfigError``, exit 2), naming
    the other output and the file. Rejects written before they carried the name cannot be told
    apart and are taken as this output's, as before. ``rel_paths`` (the run's shards) limits
    the footers read to the names this run would write: another output's files under other
    names are never touched (each deletion checks its file's name again).
    """
    blocker = storage.file_in_the_way(rej_root)
    if blocker is not None:
        raise not_a_folder("rejects", rej_root, blocker)
    names = visible_files(rej_root)
    if rel_paths is not None:
        names = sorted(set(names) & set(rel_paths))
    for rel in names:
        loc = rej_root.child(rel)
        owner = rejects_owner(loc, options)
        mine = owner_key(out_root.child(rel).uri)
        if owner is not None and owner != mine:
            raise ConfigError(
                f"rejects {rej_root.uri} holds {loc.uri}, rejected rows of another output "
                f"({_output_of(owner, rel)}): this run would replace or delete them. Nothing "
                f"was written. Give each output its own rejects location (leave rejects unset: "
                "<root's parent>/_rejects/<root's name>/<output below the root>), or move those "
                "files away."
            )


def _output_of(owner: str, rel: str) -> str:
    """The output root a rejects file's owner (an output file URI) belongs to."""
    suffix = "/" + rel
    return owner[: -len(suffix)] if owner.endswith(suffix) else owner


def remove_rejects(
    loc: Location, output: Location, options: Mapping[str, Any] | None
) -> str | None:
    """Delete the rejects file ``loc`` of ``output`` unless another output's name is in its
    footer; returns its URI if it was there and deleted."""
    if not storage.exists(loc):
        return None
    owner = rejects_owner(loc, options)
    if owner is not None and owner != owner_key(output.uri):
        logger.warning("kept %s: it holds rejected rows of %s, not of this output", loc.uri, owner)
        return None
    storage.remove(loc)
    return loc.uri


@dataclass
class ForeignFiles:
    """Visible files this tool did not write: deleted (data) and left alone (anything else)."""

    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def remove_foreign(
    out_root: Location, ours: set[str], options: Mapping[str, Any] | None = None
) -> ForeignFiles:
    """With ``on_foreign_output = "replace"``: delete every visible foreign data file.

    ``ours``: relative paths the manifest lists. A file not listed there is foreign, even if
    its footer says this tool wrote it (copied in from another output, or left by a crash
    before its manifest entry was saved; a shard still in the input is scored again): a data
    file (a Parquet name or footer) is deleted with a WARNING naming it; any other file
    (``notes.txt``) is left alone and listed. Nothing is overwritten without a word: a later
    commit to the same name finds it already gone and logged.
    """
    found = ForeignFiles()
    for rel in visible_files(out_root):
        loc = out_root.child(rel)
        if rel in ours:
            continue
        if is_data(loc, options):
            storage.remove(loc)
            logger.warning("removed %s from the output: score-catalog did not write it", loc.uri)
            found.removed.append(loc.uri)
        else:
            found.kept.append(loc.uri)
    return found


# --------------------------------------------------------------------------- where a run may write


def not_a_folder(what: str, loc: Location, blocker: str) -> StorageError:
    """The error for a ``what`` (output, rejects) location that a file keeps from being a folder."""
    return StorageError(
        f"{what} {loc.uri} is a file or lies under one ({blocker}), not a folder: nothing was "
        f"written. Point {what} at a folder (it is created if absent)."
    )


def check_write_target(loc: Location, what: str, *, create_bucket: bool) -> Location | None:
    """Refuse, before anything is written, a ``what`` (``output``, ``rejects``) location that
    cannot hold a folder: a local path that is a file or lies under one, or an object-store
    path whose bucket does not exist (unless ``create_bucket``: then that bucket is returned,
    for the caller to create with :func:`pipeline.io.storage.create_bucket` once it writes)."""
    if loc.is_local:
        blocker = storage.file_in_the_way(loc)
        if blocker is not None:
            raise not_a_folder(what, loc, blocker)
        return None
    bucket = storage.bucket_of(loc)
    if bucket is None or storage.bucket_exists(bucket):
        return None
    if create_bucket:
        return bucket
    raise ConfigError(
        f"{what} {loc.uri}: bucket {bucket.path!r} does not exist at {bucket.uri}. Check the "
        "name (and the endpoint in [storage]), create the bucket, or set "
        "create_output_bucket = true (--create-output-bucket) to let the run create it"
    )
