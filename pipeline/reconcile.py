"""Make the visible output equal the run's report before ``_SUCCESS`` is written.

A reader of the output folder (pyarrow.dataset, pandas, Dask, DuckDB, Polars, Spark) sees every
Parquet file in it whose path has no component starting with ``_`` or ``.``. After a run that
set must be exactly one scored file per current input shard that was scored or skipped, all
written by this tool for the run's model and settings. Upstream events break that if nothing
mends it: an input shard deleted or compacted leaves its old output behind (stale or duplicated
rows), a shard that fails this run keeps last night's output, a schema-skipped shard keeps a
previous model's rows. :func:`reconcile` removes those, and :func:`verify` checks what is left
against the report from the files' own footers; ``_SUCCESS`` is written only when it finds
nothing wrong.

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
from typing import Any, Protocol

from pipeline import storage
from pipeline.errors import ConfigError, PipelineError, ShardError
from pipeline.reading import read_footer
from pipeline.statuses import FailureKind, ShardStatus
from pipeline.storage import Location

logger = logging.getLogger(__name__)

#: Key-value metadata every output file carries in its Parquet footer: who wrote it and with
#: which model, so that the final check needs nothing but the files themselves.
WRITER_KEY = b"score_catalog.writer"
MODEL_SHA_KEY = b"score_catalog.model_sha256"
SETTINGS_KEY = b"score_catalog.settings_hash"
#: The input shard an output (or rejects) file was scored from: its path relative to the input
#: root, and the hash of its fingerprint (``pipeline.manifest.fingerprint_hash``). A file copied
#: over another one, or left from an earlier version of its input, does not match.
INPUT_KEY = b"score_catalog.input"
INPUT_FINGERPRINT_KEY = b"score_catalog.input_fingerprint"
#: In a rejects file: the output it belongs to (its URI), so that a rejects folder two jobs
#: share by mistake is found before one deletes or replaces the other's files.
OUTPUT_KEY = b"score_catalog.output"
WRITER = b"score-catalog"
#: Names that readers globbing for Parquet (DuckDB, Polars, Spark '*.parquet') take for data.
DATA_SUFFIXES = (".parquet", ".parq", ".pq")
#: Where rejects lived inside the output before they moved beside it (config.default_rejects).
LEGACY_REJECTS = "_rejects"
#: The flag that lets a run delete foreign data files (config.JobConfig.on_foreign_output).
REPLACE_FLAG = "--on-foreign-output replace"


def footer_metadata(
    model_sha256: str, settings_hash: str, input_rel: str = "", input_fingerprint: str = ""
) -> dict[bytes, bytes]:
    """The footer metadata an output file is written with (see :data:`WRITER_KEY`): writer,
    model, settings and, when given, the input shard it was scored from."""
    meta = {
        WRITER_KEY: WRITER,
        MODEL_SHA_KEY: model_sha256.encode(),
        SETTINGS_KEY: settings_hash.encode(),
    }
    if input_rel:
        meta[INPUT_KEY] = input_rel.encode()
        meta[INPUT_FINGERPRINT_KEY] = input_fingerprint.encode()
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
    return loc.name.endswith(DATA_SUFFIXES) or _footer_meta(loc, options) is not None


# --------------------------------------------------------------------------- before the lock


def _entry_is_ours(loc: Location, options: Mapping[str, Any] | None) -> bool:
    """An entry at the output root: a file we wrote, or a folder holding only such files."""
    files = storage.list_files(loc)
    if not files:
        return written_by_us(loc, options)
    return all(not is_visible(rel) or written_by_us(loc.child(rel), options) for rel in files)


def output_state(root: Location, options: Mapping[str, Any] | None = None) -> storage.OutputState:
    """:func:`pipeline.storage.classify_output`, counting our footer-marked files as ours."""
    return storage.classify_output(root, is_ours=lambda loc: _entry_is_ours(loc, options))


def check_output_owner(
    root: Location, mode: str, options: Mapping[str, Any] | None = None
) -> storage.OutputState:
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
        raise storage.not_a_folder("rejects", rej_root, blocker)
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


def _remove_rejects(
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


# --------------------------------------------------------------------------- after scoring


@dataclass(frozen=True)
class Removal:
    """An output this run took out of the dataset, and why (listed in the report)."""

    rel_path: str  # relative to the output root (and the rejects root)
    output: str
    reason: str
    rejects: str | None = None

    def public(self) -> dict[str, Any]:
        """The report's entry (``removed_outputs``)."""
        return {"output": self.output, "reason": self.reason, "rejects": self.rejects}


@dataclass
class Reconciliation:
    """What :func:`reconcile` did: outputs removed, and visible files it would not touch."""

    removed: list[Removal] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)


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
            rejects = _remove_rejects(rej_root.child(f), loc, options)
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
            if _remove_rejects(rej_root.child(f), out_root.child(f), options) is None:
                raise ConfigError(
                    f"rejects {rej_root.uri}: {rej_root.child(f).uri} is in the way of the "
                    "rejects of an input shard that changed shape, and holds rows of another "
                    "output. Nothing was removed; move it away and run again."
                )
        if files != [obstacle]:
            storage.remove_empty_folders(rej_root.child(obstacle))


class Outcome(Protocol):
    """What :func:`wanted` reads of a shard's result (``pipeline.scoring.ShardResult``)."""

    rel_path: str
    status: str
    kind: str | None
    rows_out: int


#: Failure kinds of shards this run did not get to (a fatal error or a signal stopped it): their
#: previous output is left as it was, with its manifest entry, for the next run to judge.
NOT_ATTEMPTED = frozenset({FailureKind.CANCELLED, FailureKind.INTERRUPTED})


@dataclass(frozen=True)
class Wanted:
    """What the output should hold after a run, from its shards' results."""

    rows: dict[str, int]  # shards in the output (scored or skipped): their row counts
    untouched: set[str]  # shards not attempted: their outputs are left alone
    reasons: dict[str, str]  # shards whose previous output must go, and why

    @property
    def keep(self) -> set[str]:
        """Relative paths :func:`reconcile` leaves in place."""
        return set(self.rows) | self.untouched


def wanted(results: Iterable[Outcome]) -> Wanted:
    """Sort a run's shard results into outputs to keep, to leave alone and to remove."""
    rows: dict[str, int] = {}
    untouched: set[str] = set()
    reasons: dict[str, str] = {}
    for r in results:
        if r.status in (ShardStatus.SCORED, ShardStatus.SKIPPED):
            rows[r.rel_path] = r.rows_out
        elif r.kind in NOT_ATTEMPTED:
            untouched.add(r.rel_path)
        elif r.kind == FailureKind.SCHEMA:
            reasons[r.rel_path] = (
                "its shard does not fit the model and was skipped (errors.on_schema_error)"
            )
        else:
            reasons[r.rel_path] = f"its shard failed in this run ({r.kind})"
    return Wanted(rows, untouched, reasons)


#: Why an output whose input shard is gone is removed (said only when it is gone).
GONE_REASON = "its input shard no longer exists"


def gone_reasons(
    entries: Mapping[str, Mapping[str, Any]],
    rels: Iterable[str],
    input_uri: str,
    options: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Why the outputs at ``rels`` go when their shard is not in this run's input although
    the input file their manifest entry names still exists (the job's input changed: another
    folder, glob or ``{date}``). :func:`reconcile` says :data:`GONE_REASON` only of the others,
    whose input really is gone. One ``exists`` per such output: only shards that left the
    input are asked about."""
    reasons = {}
    for rel in rels:
        source = (entries.get(rel) or {}).get("input")
        if not isinstance(source, str):
            continue
        try:
            there = storage.exists(storage.locate(source, options))
        except (OSError, PipelineError):
            continue  # cannot tell: the usual reason stands
        if there:
            reasons[rel] = (
                f"its input shard {source} still exists but is no longer in this job's input "
                f"({input_uri})"
            )
    return reasons


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
        reason = reasons.get(rel, GONE_REASON)
        storage.remove(loc)  # the output first: a crash in between leaves orphan rejects only
        rejects = _remove_rejects(rej_root.child(rel), loc, options)
        removal = Removal(rel, loc.uri, reason, rejects)
        logger.warning("removed %s from the output: %s", removal.output, reason)
        result.removed.append(removal)
    _withdraw_emptied_successes(out_root, files, {r.rel_path for r in result.removed})
    gone = (ours | set(reasons)) - keep
    # Rejects of shards that are no longer in the dataset, whose output was already missing.
    for rel in storage.list_files(rej_root):
        if is_visible(rel) and rel in gone:
            _remove_rejects(rej_root.child(rel), out_root.child(rel), options)
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
        marker = out_root.child(f"{folder}/{storage.SUCCESS_NAME}")
        if f"{folder}/{storage.SUCCESS_NAME}" in files and not any(
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


@dataclass(frozen=True)
class Expected:
    """What an output file's footer must say to be the output the report (or manifest) lists."""

    rows: int
    model_sha256: str
    settings_hash: str | None = None  # None: not checked
    input_rel: str | None = None  # None: not checked
    input_fingerprint: str | None = None


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
