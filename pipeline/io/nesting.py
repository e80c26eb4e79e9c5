"""Outputs never nest: the checks before a run takes an output folder.

A run owns its output's whole tree: it removes what it does not vouch for and verifies every
visible file against its report. An output that contains another output of this tool would
take that output's files for its own (a forgotten ``{date}`` in ``--output``); one that lies
inside another would be removed by that output's next run, and readers of the outer folder
would count its rows twice. Both are refused (:class:`ConfigError`, exit 2) before anything is
written, as is an output that is the fixed part of a template another job writes under.

What is checked, and what it costs on object storage (every run does it):

* below: the output's own tree, listed once (reconcile lists it again at the end), for another
  output's mark (``_SCORE_CATALOG``), manifest, or a control folder (``_score_catalog/``);
* above: each folder from the output's parent up to the bucket or filesystem root, for a mark
  or a manifest: two ``exists`` calls per level, no listing;
* as a template root: the run index a template rooted at the output would keep (in the
  output's control area, or inside it in the older layout): one listing of a folder that
  normally does not exist, and one small read per job found there (its newest entry).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pipeline.core import templates
from pipeline.core.errors import ConfigError
from pipeline.io import layout, storage
from pipeline.io.layout import MANIFEST_NAME
from pipeline.io.storage import Location

#: Names whose presence in a folder says an output of this tool is (or was) there.
_SIGNS = (layout.OUTPUT_MARK, MANIFEST_NAME)
#: A Delta table's log: a table is an output too (``format = "delta"``), or another writer's.
_LOG = "_delta_log"
_DATED = re.compile(r"^(?P<key>[^=/]+=)?\d{4}-\d{2}-\d{2}$")


def check(out: Location, table: Location | None = None) -> None:
    """Refuse ``out`` when it contains an output of this tool or a Delta table, lies inside one,
    or is the fixed part of a template another job writes under (its run index says so).

    ``table``: the Delta table ``out`` is a partition of (or is, unpartitioned), for ``format
    = "delta"``; its own ``_delta_log/`` is no sign of another output. None: a Parquet folder,
    which no table log may be in, above or below."""
    files = storage.list_files(out)
    if table is not None and table == out:
        files = [f for f in files if not f.startswith(_LOG + "/")]
    _refuse_outputs_below(out, files)
    _refuse_inside_another(out, table)
    _refuse_template_root(out, files)


def _nested_in(rel: str) -> str | None:
    """The folder (relative to the output) of another output that ``rel`` is a sign of."""
    parts = rel.split("/")
    if _LOG in parts[:-1]:
        return "/".join(parts[: parts.index(_LOG)]) or "."  # a Delta table (or its log)
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


def _refuse_outputs_below(out: Location, files: list[str]) -> None:
    for rel in files:
        nested = _nested_in(rel)
        if nested is None:
            continue
        what = "a Delta table" if f"/{_LOG}/" in f"/{rel}" else "an output of score-catalog"
        raise ConfigError(
            f"output {out.uri} contains {out.child(nested).uri}, {what} "
            f"({out.child(rel).uri} is there): a run into {out.uri} would take its files for "
            f"its own and remove them. Nothing was written. Outputs never nest: "
            f"{_suggestion(out, nested)}."
        )


def _refuse_inside_another(out: Location, table: Location | None) -> None:
    for folder in layout.ancestors(out):
        signs = _SIGNS if folder == table else (*_SIGNS, _LOG)
        for name in signs:
            sign = folder.child(name)
            if storage.exists(sign):
                what = "a Delta table" if name == _LOG else "an output of score-catalog"
                raise ConfigError(
                    f"output {out.uri} lies inside {folder.uri}, {what} "
                    f"({sign.uri} is there): its next run would remove this run's files, and "
                    f"readers of {folder.uri} would count them as its scores. Nothing was "
                    f"written. Outputs never nest: choose an output outside {folder.uri}."
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
