"""An output belongs to one job: the owner record its manifest keeps, and the check of it.

Its manifest records the job's name, its output template (:func:`template_key`) and the
output's real path; a run of another job, or of the same job through another template or a
symlink, is refused (:func:`check_owner`) before anything is written. Checked by
:mod:`pipeline.io.nesting` with the rest of what a run may write.
"""

from __future__ import annotations

import dataclasses
import os
import re
import string
from collections.abc import Mapping
from typing import Any

from pipeline.core import templates
from pipeline.core.config import JobConfig
from pipeline.core.errors import ConfigError
from pipeline.io import layout, storage
from pipeline.io.layout import MANIFEST_NAME
from pipeline.io.storage import Location


def _same(a: Location, b: Location) -> bool:
    return a.path.rstrip("/") == b.path.rstrip("/")


def template_key(template: str, options: Mapping[str, Any] | None = None) -> str:
    """``template`` as an owner record names it: its fixed part as a real absolute path (local
    disk: symlinks resolved, so a relative template and its absolute spelling are one), the
    rest as written. ``data/scored/run_date={date}`` gives ``/srv/x/data/scored/run_date={date}``.
    """
    root, _ = templates.fixed_part(template)
    rest = template if root == "." else template[len(root) :] if template.startswith(root) else ""
    real = storage.real_path(storage.locate(root, options)).uri.rstrip("/")
    rest = rest.strip("/")
    return f"{real}/{rest}" if rest else real or "/"


def owner_record(config: JobConfig, where: layout.Places) -> dict[str, str]:
    """What a run records in its output's manifest as the output's owner: the job's name, its
    output template (:func:`template_key`) and the output's real path."""
    return {
        "job": config.name,
        "template": template_key(config.output, config.storage),
        "output": storage.real_path(where.output).uri,
    }


def check_owner(where: layout.Places, owner: Mapping[str, str]) -> None:
    """Refuse (:class:`ConfigError`, exit 2) an output that another job owns.

    The manifest in this run's own control folder (or an older layout's place for it) must
    name ``owner``'s job and template; one without an owner (written before owners were
    recorded) is adopted when its entries are files of this output. And no other control
    folder may describe the output's real path: a manifest found where another template's
    layout keeps it (the output reached through a symlink or a template rooted elsewhere) is
    another job's, or this job's under another template. Cost: one read of this run's manifest
    (its other places until one is found) and one ``exists`` per folder above the output.
    """
    out = where.output
    seen: set[str] = set()
    judged = False
    for place in (where.control, *where.old_controls):
        loc = place.child(MANIFEST_NAME)
        seen.add(storage.real_path(loc).path)
        doc = None if judged else _manifest_doc(loc)
        if doc is not None:
            judged = True
            _judge_own(out, loc, doc, owner)
    for place in layout.candidates(storage.real_path(out)):
        loc = place.child(MANIFEST_NAME)
        if storage.real_path(loc).path in seen:
            continue
        doc = _manifest_doc(loc)
        if doc is not None:
            raise _taken(out, loc, doc, owner, elsewhere=True)


def _manifest_doc(loc: Location) -> dict[str, Any] | None:
    """The manifest at ``loc`` as a JSON object; None when there is none or it is unreadable
    (the run's own load then says what is wrong with it)."""
    try:
        doc = storage.read_json(loc)
    except (ValueError, IsADirectoryError, NotADirectoryError):
        return None
    return doc if isinstance(doc, dict) else None


def _judge_own(
    out: Location, loc: Location, doc: Mapping[str, Any], owner: Mapping[str, str]
) -> None:
    recorded = doc.get("owner")
    if isinstance(recorded, dict):
        if (recorded.get("job"), recorded.get("template")) != (owner["job"], owner["template"]):
            raise _taken(out, loc, doc, owner)
        return
    # Written before owners were recorded: adopted when what it lists is in this output.
    real = storage.real_path(out)
    for entry in (doc.get("shards") or {}).values():
        written = entry.get("output") if isinstance(entry, dict) else None
        if isinstance(written, str) and not _lists_file_of(written, out, real):
            raise _taken(out, loc, doc, owner, example=written)


def _lists_file_of(uri: str, out: Location, real: Location) -> bool:
    """Whether ``uri`` (a manifest entry's output file) lies in the output ``out``."""
    if any(uri.startswith(o.uri.rstrip("/") + "/") for o in (out, real)):
        return True
    return out.is_local and os.path.realpath(uri).startswith(real.path.rstrip("/") + "/")


def flags_only_name() -> str:
    """The job name of a run without a job file (``JobConfig.name``'s default)."""
    return str(next(f.default for f in dataclasses.fields(JobConfig) if f.name == "name"))


def _date_in(template: str, output: str) -> str | None:
    """The ``{date}`` that fills ``template`` in to ``output``, or None."""
    pattern, named = [], False
    for text, field_name, _spec, _conv in string.Formatter().parse(template):
        pattern.append(re.escape(text))
        if field_name == "date":
            pattern.append(r"(?P=date)" if named else r"(?P<date>\d{4}-\d{2}-\d{2})")
            named = True
        elif field_name is not None:
            pattern.append("[^/]+")
    m = re.fullmatch("".join(pattern), output.rstrip("/")) if named else None
    return m.group("date") if m else None


def _taken(
    out: Location,
    loc: Location,
    doc: Mapping[str, Any],
    owner: Mapping[str, str],
    *,
    elsewhere: bool = False,
    example: str | None = None,
) -> ConfigError:
    """The refusal of an output that ``doc`` (the manifest at ``loc``) says is not ours."""
    real = storage.real_path(out)
    where = out.uri if _same(out, real) else f"{out.uri} (real path {real.uri})"
    mine = f"this run is job {owner['job']!r} with output template {owner['template']}"
    recorded = doc.get("owner")
    if not isinstance(recorded, dict):
        listed = example or next(
            (e.get("output") for e in (doc.get("shards") or {}).values() if isinstance(e, dict)),
            None,
        )
        return ConfigError(
            f"output {where} is described by the manifest {loc.uri}, written by an older "
            f"version for another output or template (it lists {listed}); {mine}. A run would "
            "take that output's files for its own and remove or replace them. Nothing was "
            "written. Run the job that wrote it with its own job file and output template, or "
            "choose another output."
        )
    job, template = recorded.get("job"), recorded.get("template")
    head = (
        f"output {where} belongs to job {job!r} (output template {template}; its manifest "
        f"{loc.uri}); {mine}."
    )
    if job != owner["job"]:
        run_theirs = (
            f"run it with flags only, as it was written (a run without a job file is job {job!r})"
            if job == flags_only_name()
            else f"run job {job!r} from its own job file"
        )
        return ConfigError(
            f"{head} A run would replace or remove that job's scores. Nothing was written. Two "
            f"jobs never share an output: give job {owner['job']!r} an output of its own, or "
            f"{run_theirs}. If {owner['job']!r} is {job!r} renamed (a job is named after its "
            f'job file unless the file sets name), put name = "{job}" in its job file: a job '
            "keeps its outputs, run index and drift history by its name."
        )
    date = _date_in(str(template), str(recorded.get("output") or real.uri))
    fix = (
        f"this is the output of template {template} of job {job!r} for {date}: rerun it with "
        f"--date {date} and the job's own output template (no --output)"
        if date is not None
        else f"run it with the job's own output template {template}"
    )
    why = "reached through another template or a symlink" if elsewhere else "under another template"
    return ConfigError(
        f"{head} A run {why} keeps its manifest, report and rejects in other places (inside "
        f"the dataset readers query) and would take that output's files for its own. Nothing "
        f"was written. {fix[0].upper()}{fix[1:]}."
    )
