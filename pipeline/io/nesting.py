"""Outputs never nest: the checks before a run takes an output folder.

A run owns its output's whole tree: it removes what it does not vouch for and verifies every
visible file against its report. An output that contains another output of this tool would
take that output's files for its own (a forgotten ``{date}`` in ``--output``); one that lies
inside another would be removed by that output's next run, and readers of the outer folder
would count its rows twice. Both are refused (:class:`ConfigError`, exit 2) before anything is
written, as is an output that is the fixed part of a template another job writes under.

What is checked, and what it costs on object storage (every run does it):

* below: the output's own tree, listed once (reconcile lists it again at the end), for another
  output's mark (``_SCORE_CATALOG``), manifest, or a control folder (``_score_catalog/``), and
  for a table: a Delta table's ``_delta_log/``, an Iceberg table's ``metadata/`` holding a
  ``*.metadata.json``;
* above: each folder from the output's parent up to the bucket or filesystem root, for a mark,
  a manifest, a table (a Delta log, an Iceberg ``metadata/`` folder), or a control area beside
  it (the root of a template): four ``exists`` calls and one listing (of ``metadata/``, which
  normally does not exist) per level;
* as a template root: the run index a template rooted at the output would keep (in the
  output's control area, or inside it in the older layout): one listing of a folder that
  normally does not exist, and one small read per job found there (its newest entry).

That walk up finds the *roots* of other templates: a folder with a control area beside it
(``<parent>/_score_catalog/<name>``, written by the first run of any template rooted there). An
output inside another template's root (``--output data/scored/run_date=2026-11-02`` by hand,
when the nightly writes ``data/scored/run_date={date}``) would keep its rejects and control
files inside that root, where readers count them as scores: refused, as is an output or
rejects inside a control area or another job's default rejects area, and rejects inside any
dataset (this job's own root included). Where the control area and the default rejects go is
derived from the output's root, beside it: the folders above them are the output's, so
checking the output (and refusing outputs inside those areas) covers them.

An output belongs to one job (:func:`check_owner`): its manifest records the job's name, its
output template and the output's real path, and a run of another job, or of the same job
through another template or a symlink, is refused before anything is written. All checks look
at real paths (symlinks resolved, local disk).

A table is known by its files alone, listed (no table client here): a Delta table by its
``_delta_log/``, an Iceberg table by a ``metadata/`` folder holding a ``*.metadata.json`` (its
catalog may be anywhere; the folder is where its files are).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pipeline.core import templates
from pipeline.core.config import JobConfig
from pipeline.core.errors import ConfigError
from pipeline.io import layout, storage
from pipeline.io.layout import MANIFEST_NAME
from pipeline.io.outputowner import check_owner, flags_only_name, owner_record, template_key
from pipeline.io.storage import Location

__all__ = ["check", "check_owner", "check_root", "check_run", "owner_record", "template_key"]

#: Names whose presence in a folder says an output of this tool is (or was) there.
_SIGNS = (layout.OUTPUT_MARK, MANIFEST_NAME)
#: A Delta table's log: a table is an output too (``format = "delta"``), or another writer's.
_LOG = "_delta_log"
#: An Iceberg table's metadata folder (``format = "iceberg"``), a table when it holds a
#: ``*.metadata.json``.
_METADATA = "metadata"
_METADATA_JSON = ".metadata.json"
#: A sign's kind -> what it says the folder is, in messages; a table's kind is its format.
_KINDS = {
    "output": "an output of score-catalog",
    "delta": "a Delta table",
    "iceberg": "an Iceberg table",
}
_DATED = re.compile(r"^(?P<key>[^=/]+=)?\d{4}-\d{2}-\d{2}$")


def check(
    out: Location,
    root: Location | None = None,
    table: Location | None = None,
    table_names: tuple[str, ...] = (_LOG,),
) -> None:
    """Refuse ``out`` when it lies inside a control or default rejects area, contains an output
    of this tool or a table (Delta or Iceberg), lies inside one, lies inside the root of another
    template than its own (``root``: the real fixed part of the run's template; None: not
    checked), or is the fixed part of a template another job writes under (its run index says
    so).

    ``table``: the table ``out`` is a partition of (or is, unpartitioned); what it keeps in
    its root (``table_names``: a Delta table's ``_delta_log/``, an Iceberg table's
    ``metadata/``) is no sign of another output. None: a Parquet folder, which no table may be
    in, above or below."""
    out = storage.real_path(out)
    if table is not None:
        table = storage.real_path(table)
    _refuse_in_area("output", out)
    files = storage.list_files(out)
    if table is not None and _same(table, out):
        files = [f for f in files if f.split("/")[0] not in table_names]
    _refuse_outputs_below(out, files)
    _refuse_inside_another(out, root, table, table_names)
    _refuse_template_root(out, files)


def check_run(
    config: JobConfig, where: layout.Places, rejects: Location, *, table_names: tuple[str, ...] = ()
) -> None:
    """Everything a run checks about its places before it writes anything: its output is in
    no control area, is no other job's (:func:`check_owner`), does not nest
    (:func:`check`), and its rejects lie in no dataset (:func:`check_rejects`).
    ``table_names``: what the output's table keeps in its root besides its partitions (a Delta
    table's ``_delta_log``): a table's partition lies in its own table, the template's root."""
    root = own_root(config)
    _refuse_in_area("output", storage.real_path(where.output))
    check_owner(where, owner_record(config, where))
    check(where.output, root, root if table_names else None, table_names)
    check_rejects(rejects, root, config.output, explicit=config.rejects is not None)
    check_root(config, root, table_names)


def own_root(config: JobConfig) -> Location:
    """The real path of the fixed part of ``config``'s output template."""
    root = templates.fixed_part(config.output)[0]
    return storage.real_path(storage.locate(root, config.storage))


def _nested_in(rel: str) -> str | None:
    """The folder (relative to the output) of another output that ``rel`` is a sign of."""
    parts = rel.split("/")
    if _LOG in parts[:-1]:
        return "/".join(parts[: parts.index(_LOG)]) or "."  # a Delta table (or its log)
    if len(parts) >= 2 and parts[-2] == _METADATA and parts[-1].endswith(_METADATA_JSON):
        return "/".join(parts[:-2]) or "."  # an Iceberg table
    if layout.CONTROL_DIR in parts[:-1]:
        # A control folder of outputs below (an older layout kept it beside each output).
        i = parts.index(layout.CONTROL_DIR)
        return "/".join([*parts[:i], *parts[i + 1 : i + 2]]) or parts[0]
    if len(parts) >= 2 and parts[-1] in _SIGNS:
        return "/".join(parts[:-1])
    return None


def _suggestion(out: Location, nested: str) -> str:
    first = nested.split("/", 1)[0]
    m = _DATED.match(first)
    if m is None:
        return f"choose an output outside {out.uri}"
    template = f"{out.uri.rstrip('/')}/{m.group('key') or ''}{{date}}"
    return (
        f"put the placeholder back (--output '{template}'), or choose an output outside {out.uri}"
    )


def _kind_of(rel: str) -> str:
    """What the sign ``rel`` (found by :func:`_nested_in`) says its folder is: a table's format,
    or ``output``."""
    parts = rel.split("/")
    if _LOG in parts[:-1]:
        return "delta"
    if len(parts) >= 2 and parts[-2] == _METADATA and parts[-1].endswith(_METADATA_JSON):
        return "iceberg"
    return "output"


def _holds(out: Location, nested: str) -> str:
    """``contains <folder>`` (or ``is`` itself, when the sign is in the output's own root)."""
    return "is itself" if nested == "." else f"contains {out.child(nested).uri},"


def _refuse_outputs_below(out: Location, files: list[str]) -> None:
    signs = [(rel, nested) for rel in files if (nested := _nested_in(rel)) is not None]
    # A table is named before the control files beside it (its catalog, its runs' reports).
    for rel, nested in sorted(signs, key=lambda s: _kind_of(s[0]) == "output")[:1]:
        raise ConfigError(
            f"output {out.uri} {_holds(out, nested)} {_KINDS[_kind_of(rel)]} "
            f"({out.child(rel).uri} is there): a run into {out.uri} would take its files for "
            f"its own and remove them. Nothing was written. Outputs never nest: "
            f"{_suggestion(out, nested)}."
        )


def _refuse_inside_another(
    out: Location,
    root: Location | None,
    table: Location | None = None,
    table_names: tuple[str, ...] = (),
) -> None:
    for folder in layout.ancestors(out):
        own_table = table is not None and _same(folder, table)
        found = _sign_in(folder, skip=table_names if own_table else ())
        if found is not None:
            sign, kind = found
            if kind != "output" and root is not None and _same(folder, root):
                raise ConfigError(
                    f"output {out.uri} lies inside {folder.uri}, {_KINDS[kind]} ({sign.uri} is "
                    "there), which is this template's own root: a table is written as one, "
                    f'with format = "{kind}" (--format {kind}, SCORE_CATALOG_FORMAT={kind}). '
                    f"Nothing was written. Set it, or choose an output outside {folder.uri}."
                )
            raise ConfigError(
                f"output {out.uri} lies inside {folder.uri}, {_KINDS[kind]} "
                f"({sign.uri} is there): its next run would remove this run's files, and "
                f"readers of {folder.uri} would count them as its scores. Nothing was "
                f"written. Outputs never nest: choose an output outside {folder.uri}."
            )
        if root is None or _same(folder, root):
            continue  # the run's own template root: its control area is this job's
        area = _control_area_of(folder)
        if area is not None and storage.exists(area):
            raise _inside_root(out, folder, area)


def _sign_in(folder: Location, *, skip: tuple[str, ...] = ()) -> tuple[Location, str] | None:
    """(the sign, its kind: ``output``, ``delta`` or ``iceberg``) in ``folder``: the mark or
    manifest that says it is an output of this tool, the ``_delta_log/`` of a Delta table, the
    ``metadata/*.metadata.json`` of an Iceberg table; None when it has none. ``skip``: what a
    table keeps in its root that is no sign here (the run's own table's)."""
    for name in _SIGNS:
        sign = folder.child(name)
        if storage.exists(sign):
            return sign, "output"
    if _LOG not in skip and storage.exists(folder.child(_LOG)):
        return folder.child(_LOG), "delta"
    if _METADATA not in skip:
        found = _iceberg_metadata(folder)
        if found is not None:
            return found, "iceberg"
    return None


def _iceberg_metadata(folder: Location) -> Location | None:
    """A ``*.metadata.json`` in ``folder``'s ``metadata/`` (a listing), or None."""
    try:
        entries = storage.ls(folder.child(_METADATA))
    except (FileNotFoundError, NotADirectoryError):
        return None
    return next((e for e in entries if e.name.endswith(_METADATA_JSON)), None)


def _same(a: Location, b: Location) -> bool:
    return a.path.rstrip("/") == b.path.rstrip("/")


def _inside(loc: Location, tree: Location) -> bool:
    """True when ``loc`` is ``tree`` or lies below it (paths as given: pass real paths)."""
    return (loc.path.rstrip("/") + "/").startswith(tree.path.rstrip("/") + "/")


def _at(loc: Location, path: str) -> Location:
    """A Location for ``path`` on ``loc``'s storage."""
    uri = path if loc.is_local else str(loc.fs.unstrip_protocol(path))
    return Location(loc.fs, path, uri, loc.retry_deadline_s)


def _control_area_of(folder: Location) -> Location | None:
    """Where a template rooted at ``folder`` keeps its control files (``<parent>/
    _score_catalog/<name>``), or None when ``folder`` has no parent."""
    uri = templates.beside(folder.uri, layout.CONTROL_DIR)
    return None if uri is None else storage.sibling(folder, uri)


def _jobs_in(area: Location) -> str:
    """``; its run index names job(s) 'a', 'b'``: the jobs with a run index in the control
    area ``area`` (empty when it has none)."""
    try:
        jobs = [e.name for e in storage.ls(area.child(layout.RUN_INDEX_DIR))]
    except (FileNotFoundError, NotADirectoryError):
        return ""
    return f"; its run index names job(s) {', '.join(repr(j) for j in jobs)}" if jobs else ""


def _inside_root(out: Location, root: Location, area: Location) -> ConfigError:
    first = out.path[len(root.path.rstrip("/")) + 1 :].split("/", 1)[0]
    m = _DATED.match(first)
    if m is not None:
        date = first.rsplit("=", 1)[-1]
        fix = (
            f"If {out.uri} is that template's output for {date}, rerun its job with its own "
            f"job file and --date {date} instead of --output; otherwise choose an output "
            f"outside {root.uri}."
        )
    else:
        fix = f"Choose an output outside {root.uri}."
    return ConfigError(
        f"output {out.uri} lies inside {root.uri}, the fixed part of an output template that "
        f"another job writes under ({area.uri} holds its control files{_jobs_in(area)}): "
        f"this run would keep its rejects and control files inside {root.uri}, where readers "
        f"of that dataset count them as scores, and that job's runs would take this output "
        f"for one of theirs. Nothing was written. {fix}"
    )


#: The folders this tool keeps beside a template's root: never a place for scores or rejects.
_AREAS = {
    layout.CONTROL_DIR: "a control area of score-catalog (the manifests, reports and run index "
    "of the outputs beside it)",
    layout.REJECTS_DIR: "a default rejects area of score-catalog (the rejected rows of the "
    "outputs beside it)",
}


def _refuse_in_area(what: str, loc: Location, own_root: Location | None = None) -> None:
    """Refuse an output or rejects location (real path) inside a control area, or inside a
    default rejects area that is not ``own_root``'s; an output in any rejects area."""
    parts = loc.path.rstrip("/").split("/")
    for i, part in enumerate(parts):
        if part not in _AREAS:
            continue
        area = _at(loc, "/".join(parts[: i + 1]))
        if part == layout.REJECTS_DIR and what == "rejects" and i + 1 < len(parts):
            # <parent>/_rejects/<name>/...: the default rejects of the root <parent>/<name>.
            served = _at(loc, "/".join([*parts[:i], parts[i + 1]]))
            if (own_root is not None and _same(served, own_root)) or _dataset_at(served) is None:
                continue
        raise ConfigError(
            f"{what} {loc.uri} lies inside {area.uri}, {_AREAS[part]}: a run there would mix "
            f"its files with theirs, and take or remove them as its own. Nothing was written. "
            f"Choose {what} outside {area.uri}"
            + (" (leave rejects unset for the default)." if what == "rejects" else ".")
        )


def _dataset_at(folder: Location) -> str | None:
    """What makes ``folder`` a dataset, in words: an output of this tool (its mark or manifest
    is there), a table (Delta or Iceberg) or the root of a template (a control area beside it);
    None when none. Up to four ``exists`` calls and a listing."""
    found = _sign_in(folder)
    if found is not None:
        return f"{_KINDS[found[1]]} ({found[0].uri} is there)"
    area = _control_area_of(folder)
    if area is not None and storage.exists(area):
        return f"the fixed part of an output template ({area.uri} holds its control files)"
    return None


def check_rejects(rejects: Location, root: Location, template: str, *, explicit: bool) -> None:
    """Refuse (exit 2, before anything is written) a rejects location inside a dataset: this
    job's own template root ``root`` (real path), a control or another job's default rejects
    area, another output, or another template's root; or one that contains another output.

    The default (``<root's parent>/_rejects/<root's name>/...``) lies beside the root by
    construction, and its folders above are the output's, which :func:`check` walks: only
    the first two checks apply to it. An explicit one is walked up (up to four ``exists``
    calls and a listing per folder) and listed.
    """
    rej = storage.real_path(rejects)
    if storage.same_filesystem(rej, root) and _inside(rej, root):
        raise ConfigError(
            f"rejects {rej.uri} lies inside {root.uri}, the fixed part of the output template "
            f"{template}: readers of {root.uri} (DuckDB's '**/*.parquet', Dask, Polars) would "
            "count rejected rows as scores. Nothing was written. Leave rejects unset (beside "
            f"the root: <root's parent>/_rejects/<root's name>/...) or choose a folder outside "
            f"{root.uri}."
        )
    _refuse_in_area("rejects", rej, root)
    if not explicit:
        return
    for folder in [rej, *layout.ancestors(rej)]:
        what = _dataset_at(folder)
        if what is not None:
            raise ConfigError(
                f"rejects {rej.uri} lies inside {folder.uri}, {what}: readers of {folder.uri} "
                "would count rejected rows as scores, and its runs would find files they did "
                f"not write. Nothing was written. Leave rejects unset or choose a folder "
                f"outside {folder.uri}."
            )
    for rel in storage.list_files(rej):
        nested = _nested_in(rel)
        if nested is not None:
            raise ConfigError(
                f"rejects {rej.uri} {_holds(rej, nested)} {_KINDS[_kind_of(rel)]} "
                f"({rej.child(rel).uri} is there): this run would write and clean up rejects "
                "among its files. Nothing was written. Choose a rejects folder that holds no "
                "output."
            )


def _index_dirs(out: Location, files: list[str]) -> list[Location]:
    """Where a template rooted at ``out`` keeps its run index: its control area, or (older
    layout) inside it."""
    dirs = []
    area = templates.beside(out.uri, layout.CONTROL_DIR)
    if area is not None:
        dirs.append(storage.sibling(out, area).child(layout.RUN_INDEX_DIR))
    if any(rel.startswith(layout.RUN_INDEX_DIR + "/") for rel in files):
        dirs.append(out.child(layout.RUN_INDEX_DIR))
    return dirs


def _newest_entry(job_dir: Location) -> tuple[Location, dict[str, Any]] | None:
    try:
        names = [e for e in storage.ls(job_dir) if e.name.endswith(".json")]
    except (FileNotFoundError, NotADirectoryError):
        return None
    for entry in sorted(names, key=lambda e: e.name, reverse=True)[:1]:
        try:
            doc = json.loads(storage.read_bytes(entry))
        except (OSError, ValueError):
            return None  # unreadable: the run index skips it too
        return (entry, doc) if isinstance(doc, dict) else None
    return None


def _refuse_template_root(out: Location, files: list[str]) -> None:
    base = out.uri.rstrip("/") + "/"
    for index in _index_dirs(out, files):
        try:
            jobs = storage.ls(index)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for job_dir in jobs:
            found = _newest_entry(job_dir)
            if found is None:
                continue
            entry, doc = found
            wrote = str(doc.get("output") or "").rstrip("/")
            if not wrote.startswith(base):
                continue  # the output itself (a template without placeholders), or elsewhere
            raise ConfigError(
                f"output {out.uri} is the fixed part of the template job "
                f"{doc.get('job', job_dir.name)!r} writes under: its run {doc.get('run_id')} "
                f"wrote {wrote} (run index entry {entry.uri}). A run into {out.uri} would take "
                f"that job's outputs for its own. Nothing was written. Outputs never nest: "
                f"choose an output outside {out.uri}; if that job no longer writes there, "
                f"delete its run index folder {job_dir.uri} first."
            )


# --------------------------------------------------------------------------- the template root

#: What this tool keeps inside a template's root: its control files when the root has no
#: parent (a bucket root), and older layouts' control folders, run index and rejects, which
#: the run's migration moves beside the root (pipeline.io.layout).
_OWN_IN_ROOT = frozenset(
    {layout.CONTROL_DIR, layout.REJECTS_DIR, layout.RUN_INDEX_DIR, layout.BACKFILL_DIR}
)
#: How many offending names a refusal lists before it counts the rest.
_SHOWN = 5


def check_root(config: JobConfig, root: Location, table_names: tuple[str, ...] = ()) -> None:
    """Refuse (exit 2, before anything is written or moved) a template whose fixed part ``root``
    (real path) holds anything but this template's outputs.

    Readers query the root as one dataset (every date below it at once), so the root holds one
    template's outputs and nothing else. Two checks, one listing each:

    * the root's direct children: each must be a folder named as the template's first segment
      below the root expands (``run_date=<YYYY-MM-DD>`` for ``data/scored/run_date={date}``);
      names starting with ``.`` (readers skip them), this tool's own folders (a root without a
      parent keeps its control files there; older layouts are moved out by the run) and what a
      table keeps in its root (``table_names``: a Delta table's ``_delta_log``) are allowed. A
      file is foreign.
    * the run index in the root's control area: the newest entry of each job must have written
      an output this template names (another template with the same first segment,
      ``run_date={date}/v2``, passes the first check).

    A template without placeholders is its own output: the output checks cover it.
    """
    first = templates.segment_pattern(config.output)
    if first is None:
        return
    try:
        entries = storage.ls_typed(root)
    except (FileNotFoundError, NotADirectoryError):
        return  # the first run: nothing there yet
    foreign = [
        loc.name + ("" if is_dir else " (a file)")
        for loc, is_dir in entries
        if not _root_child_ok(loc.name, is_dir, first, table_names)
    ]
    if foreign:
        shown = ", ".join(foreign[:_SHOWN])
        more = f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN else ""
        raise ConfigError(
            f"output template {config.output}: its fixed part {root.uri} holds "
            f"{len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} that this template did "
            f"not write ({shown}{more}); below it there must be only folders named like "
            f"{_example(config)}. {_ROOT_WHY.format(root=root.uri)} {_root_fix(config)}, or "
            f"move {'it' if len(foreign) == 1 else 'them'} out of {root.uri}."
        )
    _refuse_other_templates(config, root)


_ROOT_WHY = (
    "Readers of {root} (DuckDB, Polars, pyarrow, pandas, Dask) read everything below it as one "
    "dataset and would count that with this job's scores, or fail on it. Nothing was written. "
    "A template's fixed part holds that template's outputs and nothing else:"
)


def _root_child_ok(
    name: str, is_dir: bool, first: re.Pattern[str], table_names: tuple[str, ...]
) -> bool:
    if name.startswith("."):
        return True  # hidden: every reader skips it
    if not is_dir:
        return False
    if name in _OWN_IN_ROOT or name in table_names:
        return True
    return first.fullmatch(name) is not None


def _example(config: JobConfig) -> str:
    """The template's first segment below its root, for this run (``run_date=2026-11-02``)."""
    segment = templates.below_root(config.output)[0]
    return segment.format(date=config.run_date, run_id="<run_id>")


def _root_fix(config: JobConfig) -> str:
    rest = "/".join(templates.below_root(config.output))
    named = config.name != flags_only_name() and re.fullmatch(r"[A-Za-z0-9_-]+", config.name)
    name = config.name if named else "v2"
    fixed = templates.fixed_part(config.output)[0]
    suggested = (
        f"{fixed.rstrip('/')}_{name}/{rest}"
        if templates.beside(fixed, layout.CONTROL_DIR) is not None
        else f"<a folder of its own>/{rest}"
    )
    return (
        "choose an output template whose fixed part holds only this job's outputs (e.g. "
        f"--output '{suggested}')"
    )


def _refuse_other_templates(config: JobConfig, root: Location) -> None:
    """Refuse when the newest run index entry of a job (this one included) under the root's
    control area wrote an output that this template does not name."""
    index = storage.locate(templates.index_root(config.output), config.storage)
    index = index.child(layout.RUN_INDEX_DIR)
    try:
        jobs = storage.ls(index)
    except (FileNotFoundError, NotADirectoryError):
        return
    full = templates.segment_pattern(config.output, depth=0)
    assert full is not None  # a template with placeholders
    fixed = templates.fixed_part(config.output)[0]
    bases = {b.rstrip("/") + "/" for b in (root.uri, storage.locate(fixed, config.storage).uri)}
    for job_dir in jobs:
        found = _newest_entry(job_dir)
        if found is None:
            continue
        entry, doc = found
        wrote = str(doc.get("output") or "").rstrip("/")
        rel = next((wrote[len(b) :] for b in bases if wrote.startswith(b)), None)
        if rel is None or full.fullmatch(rel):
            continue  # elsewhere (another check's business), or an output of this template
        job = doc.get("job", job_dir.name)
        raise ConfigError(
            f"output template {config.output}: its fixed part {root.uri} holds outputs of "
            f"another template: job {job!r} (run {doc.get('run_id')}) wrote {wrote} (run index "
            f"entry {entry.uri}), which {config.output} does not name. "
            f"{_ROOT_WHY.format(root=root.uri)} {_root_fix(config)}, or run job "
            f"{job!r} with its own output template; if that template no longer writes there, "
            f"move its outputs out of {root.uri} and delete its run index folder {job_dir.uri}."
        )
