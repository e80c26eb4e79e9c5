"""Where a run keeps what is not scores: outside the template's fixed part, which is a dataset.

An output template's *fixed part* (its *root*) is the text before its first placeholder, cut
back to the last ``/`` (:func:`fixed_part`); a template without placeholders is its own root.
Readers query the root: every date below it at once. So the root holds only data, and what
is not data lives beside it, under its parent::

    data/scored/                                  root of data/scored/run_date={date}
      run_date=2026-11-29/                        an output: scored Parquet files, _SUCCESS and
                                                  _SCORE_CATALOG (both empty), _lock*.json while
                                                  a run holds it
    data/_score_catalog/scored/                   the root's control area
      run_date=2026-11-29/                        the output's control folder: _manifest.json,
                                                  _report.json, _report.html
      _runs/<job>/<run_id>.json                   the run index (pipeline.io.runindex)
      _backfills/<job>/<from>_<to>.json           backfill summaries (pipeline.driver.backfill)
    data/_rejects/scored/run_date=2026-11-29/     its rejects, unless the job sets ``rejects``

A template without placeholders (``data/scored``) is the same with nothing below the root: its
control folder is ``data/_score_catalog/scored`` (holding ``_runs/`` too), its rejects
``data/_rejects/scored``. A root without a parent folder (a bucket root ``s3://b``, ``/``, or
``.`` for ``{date}/scored``) has nowhere beside it: its control files stay inside it
(``<root>/_score_catalog/<rest>``, or the output itself when it is the root, and
``<root>/_runs``), and the job must set ``rejects`` (``pipeline.core.config``).

Why beside and not inside under a ``_`` name. Measured with Polars 1.x, DuckDB 1.4/2.0,
pyarrow 26, pandas 3.1 and Dask 2026.8 on two dated outputs under one root: the empty
``_SUCCESS`` and ``_SCORE_CATALOG`` in each date folder change nothing for any of them
(``scan_parquet(root)``, ``read_parquet('<root>/**/*.parquet', hive_partitioning=true)``,
``pyarrow.dataset.dataset(root, partitioning="hive")``, ``pandas.read_parquet(root)`` and
``dask.dataframe.read_parquet(root)`` all returned exactly the scored rows, plus ``run_date``).
But DuckDB's ``'**/*.parquet'`` and Dask read Parquet files below ``_`` folders (rejects there
count as scores), and Polars reads every non-empty file below the folder, ``_`` names
included, and refuses a folder whose files do not share one extension (``.json`` reports, the
run index): ``polars-io`` ``path_utils::expand_paths_hive`` skips only empty files.

Older versions kept these files in other places: inside the output (manifest, report, run
index in ``<output>/_runs``, rejects in ``<output>/_rejects``), then beside each output
(``<root>/_score_catalog/<name>``, ``<root>/_rejects/<name>``, ``<root>/_runs``,
``<root>/_backfills``). They are still read there (:func:`find`, :attr:`Places.old_controls`),
and :func:`claim` moves them to their place here when a run takes the output's lock.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# The two folder names beside a template's root are the configuration's too (which validates
# templates with them): defined there, named here with every other name the tool writes.
from pipeline.core.templates import CONTROL_DIR as CONTROL_DIR
from pipeline.core.templates import REJECTS_DIR as REJECTS_DIR
from pipeline.core.templates import (
    below,
    beside,
    control_area,
    control_uri,
    default_rejects,
    fixed_part,
    index_root,
    single_segment_pattern,
)
from pipeline.io import storage
from pipeline.io.storage import Location

if TYPE_CHECKING:
    from pipeline.core.config import JobConfig

logger = logging.getLogger(__name__)

#: The completion marker: an empty file written last, when the run succeeded and what readers
#: see of the output matched its report.
SUCCESS_NAME = "_SUCCESS"
#: The output's control files (in its control folder; inside the output in older layouts).
MANIFEST_NAME = "_manifest.json"
REPORT_NAME = "_report.json"
HTML_NAME = "_report.html"
#: The run lock at the output root (pipeline.io.locking); its heartbeats and takeover claims
#: are ``_lock.*`` files beside it.
LOCK_NAME = "_lock.json"
LOCK_PREFIX = "_lock."
HEARTBEAT_PREFIX = "_lock.heartbeat-"
TAKEOVER_PREFIX = "_lock.takeover-"
#: An empty file in every output this tool writes: cheap proof that the folder is ours (the
#: control folder lives outside it, so it could outlive the folder it describes).
OUTPUT_MARK = "_SCORE_CATALOG"
#: The run index's folder (``pipeline.io.runindex``) in the control area.
RUN_INDEX_DIR = "_runs"
#: The backfill summaries' folder (``pipeline.driver.backfill``) in the control area.
BACKFILL_DIR = "_backfills"
#: Drift acceptances in the run index (``pipeline.io.runindex``).
ACCEPTED_DIR = "_accepted"
#: Rollbacks of a Delta table in the run index (``pipeline.io.runindex``).
ROLLBACKS_DIR = "_rollbacks"

#: Key-value metadata every output file carries in its Parquet footer: who wrote it and with
#: which model, so that the final check needs nothing but the files themselves.
WRITER_KEY = b"score_catalog.writer"
MODEL_SHA_KEY = b"score_catalog.model_sha256"
SETTINGS_KEY = b"score_catalog.settings_hash"
#: The input shard an output (or rejects) file was scored from: its path relative to the input
#: root, and the hash of its fingerprint (``pipeline.io.manifest.fingerprint_hash``). A file copied
#: over another one, or left from an earlier version of its input, does not match.
INPUT_KEY = b"score_catalog.input"
INPUT_FINGERPRINT_KEY = b"score_catalog.input_fingerprint"
#: The scorer identity (``pipeline.driver.inspect.scorer_identity``) of an incremental run's
#: output file: every row in it was scored, or carried, by that scorer (docs/incremental.md).
SCORER_KEY = b"score_catalog.scorer"
#: The output column that holds a row's fingerprint (``pipeline.worker.fingerprint``) when the
#: run is incremental: a 64-bit hash of exactly what the model saw of the row.
MODEL_INPUT_HASH_COLUMN = "model_input_hash"
#: In a rejects file: the output it belongs to (its URI), so that a rejects folder two jobs
#: share by mistake is found before one deletes or replaces the other's files.
OUTPUT_KEY = b"score_catalog.output"
WRITER = b"score-catalog"
#: Names that readers globbing for Parquet (DuckDB, Polars, Spark '*.parquet') take for data.
DATA_SUFFIXES = (".parquet", ".parq", ".pq")
#: Where rejects lived inside the output before they moved beside it (see
#: pipeline.core.templates.default_rejects).
LEGACY_REJECTS = "_rejects"


def footer_metadata(
    model_sha256: str,
    settings_hash: str,
    input_rel: str = "",
    input_fingerprint: str = "",
    scorer: str = "",
) -> dict[bytes, bytes]:
    """The footer metadata an output file is written with (see :data:`WRITER_KEY`): writer,
    model, settings and, when given, the input shard it was scored from and the scorer
    identity of an incremental run."""
    meta = {
        WRITER_KEY: WRITER,
        MODEL_SHA_KEY: model_sha256.encode(),
        SETTINGS_KEY: settings_hash.encode(),
    }
    if input_rel:
        meta[INPUT_KEY] = input_rel.encode()
        meta[INPUT_FINGERPRINT_KEY] = input_fingerprint.encode()
    if scorer:
        meta[SCORER_KEY] = scorer.encode()
    return meta


def rejects_metadata(
    output_uri: str, input_rel: str = "", input_fingerprint: str = ""
) -> dict[bytes, bytes]:
    """The footer metadata of a rejects file: writer, the output it belongs to, its input."""
    meta = {WRITER_KEY: WRITER, OUTPUT_KEY: owner_key(output_uri).encode()}
    if input_rel:
        meta[INPUT_KEY] = input_rel.encode()
        meta[INPUT_FINGERPRINT_KEY] = input_fingerprint.encode()
    return meta


def owner_key(output_uri: str) -> str:
    """How a rejects file names its output: the URI without a trailing ``/``."""
    return output_uri.rstrip("/")


def is_visible(rel_path: str) -> bool:
    """True when dataset readers see this file: no path component starts with ``_`` or ``.``."""
    return not any(part.startswith(("_", ".")) for part in rel_path.split("/"))


def visible_files(root: Location) -> list[str]:
    """Paths, relative to ``root``, of every file a dataset reader would see there."""
    return [rel for rel in storage.list_files(root) if is_visible(rel)]


# --------------------------------------------------------------------------- one run's places


@dataclass(frozen=True)
class Places:
    """Where one run of a job keeps what it writes, and where older versions kept it."""

    output: Location
    control: Location  # _manifest.json, _report.json, _report.html
    index: Location  # holds _runs/ and _backfills/
    # This output's control folders in older layouts, newest first: read when ``control`` has
    # nothing, emptied by the run that takes the lock.
    old_controls: tuple[Location, ...] = ()
    # Older layouts' folders to move, as (from, to) pairs of folders.
    moves: tuple[tuple[Location, Location], ...] = ()
    # The template's other outputs right below its root (``run_date=...``): their old control
    # folders and default rejects move too, as (old parent, new parent, their names' pattern).
    sweeps: tuple[tuple[Location, Location, re.Pattern[str]], ...] = ()
    # This output's default rejects in older layouts, and now (rejects unset only): (old, new).
    rejects_moved: tuple[tuple[Location, Location], ...] = ()


def places(
    template: str,
    output: str,
    options: Mapping[str, Any] | None = None,
    *,
    rejects: str | None = None,
) -> Places:
    """The places of ``output`` (``template`` filled in); ``rejects`` is the job's setting
    (None: the default, whose older default location then moves too)."""
    root, templated = fixed_part(template)
    out = storage.locate(output, options)
    control = storage.locate(control_uri(template, output), options)
    index = storage.locate(index_root(template), options)
    beside_out = beside(output, CONTROL_DIR)
    olds = [storage.locate(beside_out, options)] if beside_out is not None else []
    old_controls = tuple(dict.fromkeys(o for o in (*olds, out) if o != control))
    moves = [(o, control) for o in old_controls if o != out]
    if out != index:
        moves.append((out.child(RUN_INDEX_DIR), index.child(RUN_INDEX_DIR)))  # oldest layout
    sweeps: list[tuple[Location, Location, re.Pattern[str]]] = []
    has_parent = beside(root, CONTROL_DIR) is not None
    root_loc = storage.locate(root, options) if templated and has_parent else None
    pattern = single_segment_pattern(template, root)
    if root_loc is not None:
        for name in (RUN_INDEX_DIR, BACKFILL_DIR):
            moves.append((root_loc.child(name), index.child(name)))
        if pattern is not None:
            area = storage.locate(control_area(root), options)
            sweeps.append((root_loc.child(CONTROL_DIR), area, pattern))
    rejects_moved: list[tuple[Location, Location]] = []
    new_rejects, old_rejects = default_rejects(template, output), beside(output, REJECTS_DIR)
    if rejects is None and new_rejects is not None:
        new_loc = storage.locate(new_rejects, options)
        # The previous layout kept them beside the output, the oldest inside it.
        olds = [storage.locate(old_rejects, options)] if old_rejects is not None else []
        rejects_moved = [(o, new_loc) for o in (*olds, out.child(REJECTS_DIR)) if o != new_loc]
        moves += rejects_moved
        rejects_area = beside(root, REJECTS_DIR)
        if root_loc is not None and pattern is not None and rejects_area is not None:
            new_parent = storage.locate(rejects_area, options)
            sweeps.append((root_loc.child(REJECTS_DIR), new_parent, pattern))
    return Places(
        out, control, index, old_controls, tuple(moves), tuple(sweeps), tuple(rejects_moved)
    )


def for_run(config: JobConfig, run_id: str) -> Places:
    """:func:`places` of a job's run (its output with ``{date}`` and ``{run_id}`` filled in)."""
    output = config.output_uri(run_id)
    return places(config.output, output, config.storage, rejects=config.rejects)


# --------------------------------------------------------------------------- finding files


def ancestors(loc: Location) -> list[Location]:
    """The folders above ``loc``, nearest first, up to the filesystem root or the bucket."""
    found: list[Location] = []
    path, uri = loc.path.rstrip("/") or "/", loc.uri.rstrip("/") or "/"
    while True:
        stripped = path.strip("/")
        if not stripped or ("/" not in stripped and not loc.is_local):
            return found  # "/" on disk, or the bucket of an object store
        path = posixpath.dirname(path) or "/"
        uri = path if loc.is_local else uri.rsplit("/", 1)[0]
        found.append(Location(loc.fs, path, uri, loc.retry_deadline_s))


def candidates(out: Location) -> list[Location]:
    """Where the control files of ``out`` may be when its template is unknown (``report OUT``):
    for each folder from ``out`` up, the control folder ``out`` has if that folder is its
    template's root; then the output itself (oldest layout)."""
    found = []
    for top in [out, *ancestors(out)]:
        uri = beside(top.uri, CONTROL_DIR)
        if uri is None:
            continue
        rest = below(top.path, out.path)
        area = storage.sibling(top, uri)
        found.append(area.child(rest) if rest else area)
    return [*found, out]


def find(out: Location, name: str) -> Location | None:
    """The control file ``name`` of the output ``out`` where it exists, nearest first."""
    for root in candidates(out):
        loc = root.child(name)
        if storage.exists(loc):
            return loc
    return None


def find_in(where: Places, name: str) -> Location | None:
    """The control file ``name`` of a run's output: its control folder, else an older one."""
    for root in (where.control, *where.old_controls):
        loc = root.child(name)
        if storage.exists(loc):
            return loc
    return None


# --------------------------------------------------------------------------- taking an output


def claim(
    where: Places,
    fence: Callable[[], None],
    withdraw: Callable[[], None],
    *,
    mark: str | None = OUTPUT_MARK,
) -> None:
    """What a run does first once it holds the output's lock, before anything is scored.

    Marks the folder as ours (``mark``, :data:`OUTPUT_MARK`; None for an output inside which
    nothing but data may be written, a Delta table's partition); withdraws what says the
    previous run's output is complete (``withdraw``: the output format's, the folder's
    ``_SUCCESS``) and its report, which describe the output as it was and would be taken for
    this run's while it changes it (the run index keeps every run's record); and moves what
    older versions kept in other places (:func:`migrate`). The manifest in the output itself
    (the oldest layout) moves on its own (``Manifest.load`` reads it, the run saves to the
    new place).
    """
    fence()
    out = where.output
    # Only what belongs to this output moves or goes: an older layout's place whose files
    # describe another output (pipeline.nesting refuses such an output before this) is left.
    olds = tuple(o for o in where.old_controls if not _describes_another(o, out))
    if olds != where.old_controls:
        kept = set(where.old_controls) - set(olds)
        where = dataclasses.replace(
            where, old_controls=olds, moves=tuple(m for m in where.moves if m[0] not in kept)
        )
    if mark is not None:
        marker = out.child(mark)
        if not storage.exists(marker):
            storage.write_bytes(marker, b"")
    withdraw()
    for root in (where.control, *where.old_controls):
        for name in (REPORT_NAME, HTML_NAME):
            storage.remove(root.child(name))
    migrate(where, fence)


def _describes_another(folder: Location, out: Location) -> bool:
    """Whether the control files in ``folder``, an older layout's place for ``out``'s, are
    another output's: its report names another output, or its manifest another owner's."""
    real = storage.real_path(out)
    names = {loc.uri.rstrip("/") for loc in (out, real)}
    for name, path in ((REPORT_NAME, ("output",)), (MANIFEST_NAME, ("owner", "output"))):
        try:
            doc = storage.read_json(folder.child(name))
        except (ValueError, IsADirectoryError, NotADirectoryError):
            continue
        for key in path:
            doc = doc.get(key) if isinstance(doc, dict) else None
        if not isinstance(doc, str) or doc.rstrip("/") in names:
            continue
        if not (out.is_local and os.path.realpath(doc) == real.path.rstrip("/")):
            logger.warning(
                "left %s alone: its %s describes another output, %s", folder.uri, name, doc
            )
            return True
    return False


def _ours(root: Location, name: str, area: Location) -> bool:
    """Whether ``<root>/<name>`` is an output whose older-layout folders may move: a control
    folder of it (``<root>/_score_catalog/<name>`` or ``<area>/<name>``) holds a manifest or
    report, and none describes another output."""
    out = root.child(name)
    found = False
    for folder in (root.child(CONTROL_DIR).child(name), area.child(name)):
        if not any(storage.exists(folder.child(n)) for n in (MANIFEST_NAME, REPORT_NAME)):
            continue
        if _describes_another(folder, out):
            return False
        found = True
    return found


def migrate(where: Places, fence: Callable[[], None]) -> None:
    """Move what older versions kept under the template's root (or inside the output) to its
    place now: this output's control folder and default rejects, the run index and backfill
    summaries, and the control folders and default rejects of the template's other outputs
    (those right below the root, such as ``run_date=...``).

    Crash-safe and safe against concurrent runs of other dates: each file is copied with an
    exclusive create (an existing copy wins: it is a copy of the same file, or newer) and only
    then deleted from its old place, so a crash leaves it in one place or both, and the next
    run finishes the move. A file leaves its old place only once its new place holds it.
    """
    pairs = list(where.moves)
    for old_parent, new_parent, pattern in where.sweeps:
        try:
            entries = storage.ls(old_parent)
        except (FileNotFoundError, NotADirectoryError):
            continue
        # The control folder or default rejects of <root>/<name>: moved only when a control
        # folder of that output (the older one, or the one it moved to) has a manifest or
        # report describing it; a folder without one may be another template's (data/{date}
        # must not take data/_score_catalog/scored, the control area of data/scored).
        outputs = ancestors(old_parent)[0]
        pairs += [
            (e, new_parent.child(e.name))
            for e in entries
            if pattern.fullmatch(e.name) and _ours(outputs, e.name, where.index)
        ]
    # The JSON files that move (manifests, reports, run index entries) name rejects and
    # reports by their old places: they name the new ones once moved.
    renames = [(old, new) for old, new, _ in where.sweeps] + list(where.moves)
    rewrite = [(_quoted(old), _quoted(new)) for old, new in renames if old != new]
    total = 0
    for src, dst in pairs:
        if src == dst:
            continue
        fence()
        moved = move_tree(src, dst, rewrite)
        if moved:
            logger.debug("moved %d file(s) from %s to %s", moved, src.uri, dst.uri)
        total += moved
    if total:
        logger.info(
            "moved %d file(s) an older version kept in the output or under its template's root "
            "to their places outside it (control area %s)",
            total,
            where.index.uri,
        )
    for old_parent, _, _ in where.sweeps:
        storage.remove_empty_folders(old_parent)  # what is left is not ours to move


def _quoted(loc: Location) -> tuple[bytes, bytes]:
    """How a JSON document names a place below ``loc``: a string starting with its URI."""
    return f'"{loc.uri.rstrip("/")}/'.encode(), f'"{loc.uri.rstrip("/")}"'.encode()


def move_tree(
    src: Location,
    dst: Location,
    rewrite: list[tuple[tuple[bytes, bytes], tuple[bytes, bytes]]] | None = None,
) -> int:
    """Move every file below ``src`` to the same place below ``dst``; returns how many.

    A file already at ``dst`` is kept (it was copied by a run that crashed before deleting
    the original, or written since by this version); the original is deleted either way.
    Temporary files of interrupted writes are dropped. In ``.json`` files, each URI that
    starts with an old place of ``rewrite`` is changed to start with its new place.
    """
    moved = 0
    for rel in storage.list_files(src):
        old = src.child(rel)
        if storage.TMP_MARK in posixpath.basename(rel):
            storage.remove(old)
            continue
        try:
            data = storage.read_bytes(old)
        except FileNotFoundError:
            continue  # moved meanwhile by another run
        if rel.endswith(".json"):
            for (old_below, old_self), (new_below, new_self) in rewrite or []:
                data = data.replace(old_below, new_below).replace(old_self, new_self)
        new = dst.child(rel)
        if data:
            storage.exclusive_create(new, data)
        elif not storage.exists(new):
            storage.write_bytes(new, b"")
        storage.remove(old)
        moved += 1
    storage.remove_empty_folders(src)
    return moved
