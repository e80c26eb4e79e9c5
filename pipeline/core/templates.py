"""Output templates as text: the fixed part (root) of a template, what lies beside it, and the
two folders the tool keeps beside every root (the control area and the default rejects).

Pure string functions, no storage: the job configuration validates a template with them
(``pipeline.core.config``: a root without a parent needs ``rejects``), and
:mod:`pipeline.io.layout` turns them into places on storage. Why the control files live beside
the root and not inside it is in :mod:`pipeline.io.layout`'s docstring.
"""

from __future__ import annotations

import re
import string

from pipeline.core.errors import ConfigError

#: The folder, beside a template's root, that holds its control files (the control area).
CONTROL_DIR = "_score_catalog"
#: The folder, beside a template's root, that holds its default rejects.
REJECTS_DIR = "_rejects"


def beside(uri: str, folder: str) -> str | None:
    """``<parent of uri>/<folder>/<uri's name>``, or None when ``uri`` has no parent.

    ``data/scored/x`` gives ``data/scored/<folder>/x`` and ``s3://b/scored/x`` gives
    ``s3://b/scored/<folder>/x``. A bucket root (``s3://b``), the filesystem root and ``.``
    have no parent.
    """
    proto, sep, rest = uri.rpartition("://")
    path = rest.rstrip("/")
    if not path or (sep and "/" not in path):
        return None  # "/" or "", or a bucket root
    parent, slash, name = path.rpartition("/")
    if name in (".", ".."):
        return None
    return f"{proto}{sep}{parent}{slash}{folder}/{name}"


def fixed_part(template: str) -> tuple[str, bool]:
    """The template's root, and whether it has a placeholder at all.

    The root is the text before the first placeholder, cut back to the last ``/``:
    ``data/scored/{date}`` gives ``data/scored``, ``s3://b/scored/dt={date}/x`` gives
    ``s3://b/scored``, ``{date}/scored`` gives ``.`` and ``/{date}`` gives ``/``. A template
    without placeholders is its own root. A placeholder in the bucket or host part of a URI
    leaves no fixed root: that is a :class:`ConfigError`.
    """
    literal: list[str] = []
    has_field = False
    try:
        for text, field_name, _spec, _conv in string.Formatter().parse(template):
            literal.append(text)
            if field_name is not None:
                has_field = True
                break
    except ValueError as e:
        raise ConfigError(f"output = {template!r} is not a valid template: {e}") from e
    prefix = "".join(literal)
    if not has_field:
        return prefix.rstrip("/") or prefix, False
    proto_end = prefix.find("://")
    cut = prefix.rfind("/")
    if proto_end >= 0 and cut <= proto_end + 2:
        raise ConfigError(
            f"output = {template!r}: a placeholder in the bucket or host leaves no fixed "
            "location for the run index; put placeholders in the path only"
        )
    if cut < 0:
        return ".", True  # "{date}/scored": relative to the working directory
    return prefix[:cut] or "/", True


def below(root: str, output: str) -> str:
    """``output``'s path below ``root`` (its template's fixed part): ``""`` for the root."""
    out = output.rstrip("/")
    if root == ".":
        return out.removeprefix("./").strip("/") if out not in ("", ".") else ""
    base = root.rstrip("/")
    if out == base:
        return ""
    if not out.startswith(base + "/"):
        raise ValueError(f"{output!r} is not below {root!r}")
    return out[len(base) + 1 :].strip("/")


def _join(base: str, rest: str) -> str:
    return f"{base.rstrip('/')}/{rest}" if rest else base


def control_area(root: str) -> str:
    """Where the control files of everything under ``root`` live: ``<parent>/_score_catalog/
    <name>``, or the root itself when it has no parent."""
    return beside(root, CONTROL_DIR) or root


def index_root(template: str) -> str:
    """The folder holding the run index (``_runs/``) and backfill summaries (``_backfills/``)
    of the jobs writing under ``template``: its root's control area."""
    return control_area(fixed_part(template)[0])


def control_uri(template: str, output: str) -> str:
    """The control folder of ``output`` (``template`` filled in)."""
    root, _ = fixed_part(template)
    rest = below(root, output)
    area = beside(root, CONTROL_DIR)
    if area is not None:
        return _join(area, rest)
    if not rest:
        return output  # the output is a root without a parent: its files stay inside it
    return _join(CONTROL_DIR if root == "." else _join(root, CONTROL_DIR), rest)


def default_rejects(template: str, output: str) -> str | None:
    """``<root's parent>/_rejects/<root's name>/<output below the root>``, or None when the
    root has no parent (then the job must set ``rejects``)."""
    root, _ = fixed_part(template)
    area = beside(root, REJECTS_DIR)
    return None if area is None else _join(area, below(root, output))


#: What a placeholder expands to, as a regex for one folder name: ``{date}`` is a YYYY-MM-DD
#: date (``JobConfig.date`` is checked to be one); ``{run_id}`` (and a placeholder with a
#: format spec) any text without a ``/``.
_VALUES = {"date": r"\d{4}-\d{2}-\d{2}"}


def _segment_regex(segment: str) -> str:
    """A regex for the folder names one template segment (``run_date={date}``) expands to."""
    out = []
    for text, field_name, spec, conv in string.Formatter().parse(segment):
        out.append(re.escape(text))
        if field_name is not None:
            plain = not spec and not conv
            out.append(_VALUES.get(field_name, "[^/]+") if plain else "[^/]+")
    return "".join(out)


def below_root(template: str) -> list[str]:
    """The segments of ``template`` below its fixed part (``["run_date={date}", "v2"]`` for
    ``data/scored/run_date={date}/v2``); empty for a template without placeholders."""
    root, templated = fixed_part(template)
    if not templated:
        return []
    return [s for s in below(root, template.rstrip("/")).split("/") if s]


def segment_pattern(template: str, depth: int = 1) -> re.Pattern[str] | None:
    """A regex for the relative paths of the first ``depth`` folders below the template's root
    (``run_date=\\d{4}-\\d{2}-\\d{2}`` for ``data/scored/run_date={date}``, depth 1); all of
    them when ``depth`` is 0 (the paths of its outputs below the root). None without
    placeholders."""
    segments = below_root(template)
    if not segments:
        return None
    chosen = segments if depth == 0 else segments[:depth]
    return re.compile("/".join(_segment_regex(s) for s in chosen))


def single_segment_pattern(template: str, root: str) -> re.Pattern[str] | None:
    """A regex for the names of the outputs of ``template`` when they are single folders right
    below its root (``run_date=[^/]+`` for ``data/scored/run_date={date}``); None otherwise.
    Loose on purpose (the older-layout migration it serves judges each folder by its manifest
    or report); :func:`segment_pattern` is the strict one."""
    literal: list[str] = []
    fields = 0
    for text, field_name, _spec, _conv in string.Formatter().parse(template.rstrip("/")):
        literal.append(text)
        if field_name is not None:
            literal.append("\x00")  # a placeholder: no "/" in what it expands to
            fields += 1
    skip = 0 if root == "." else len(root.rstrip("/")) + 1
    rest = "".join(literal)[skip:]
    if not fields or "/" in rest:
        return None
    return re.compile("[^/]+".join(re.escape(part) for part in rest.split("\x00")))


# --------------------------------------------------------------------------- Delta partitions

_PARTITION_SEGMENT = re.compile(r"(?P<key>[A-Za-z][A-Za-z0-9_]*)=\{(?P<field>[A-Za-z_]+)\}\Z")


def partition_columns(template: str, fmt: str = "delta") -> list[tuple[str, str]]:
    """The partition columns of the table an output template writes (``format = "delta"`` or
    ``"iceberg"``: ``fmt``, which messages name): for each folder below the template's root,
    ``(column, placeholder)``.

    The table is the root (``data/scored`` for ``data/scored/run_date={date}``); each folder
    below it must be ``key={placeholder}``, which becomes the string column ``key``. A template
    without placeholders is an unpartitioned table (no columns). A bare ``{date}`` folder has no
    column name, and a plain folder or text around the placeholder is not a partition: both are
    a :class:`ConfigError` saying what to write instead.
    """
    root, templated = fixed_part(template)
    if not templated:
        return []
    if root in (".", "/"):
        raise ConfigError(
            f'output = {template!r} with format = "{fmt}": the table would be {root!r} '
            "itself; put the partitions under a table folder (data/scored/run_date={date})"
        )
    rest = below(root, template)
    columns: list[tuple[str, str]] = []
    for segment in rest.split("/"):
        m = _PARTITION_SEGMENT.match(segment)
        if m is None:
            bare = re.fullmatch(r"\{(\w+)\}", segment)
            hint = (
                f"name its column: run_{bare.group(1)}={{{bare.group(1)}}} "
                f"(output = {template.replace(segment, f'run_{bare.group(1)}={segment}', 1)!r})"
                if bare
                else "every folder below the table must be key={placeholder}, e.g. run_date={date}"
            )
            raise ConfigError(
                f'output = {template!r} with format = "{fmt}": the table is {root!r} and '
                f"{segment!r} below it is not a partition folder; {hint}"
            )
        if m.group("key") in {c for c, _ in columns}:
            raise ConfigError(
                f"output = {template!r}: partition column {m.group('key')!r} appears twice"
            )
        columns.append((m.group("key"), m.group("field")))
    return columns


def partition_values(template: str, output: str) -> dict[str, str]:
    """Column -> value of the partition ``output`` (``template`` filled in) is, in the order
    of the template's folders; empty for an unpartitioned table."""
    columns = partition_columns(template)
    if not columns:
        return {}
    root, _ = fixed_part(template)
    parts = below(root, output).split("/")
    values = {}
    for (column, _), segment in zip(columns, parts, strict=True):
        key, _, value = segment.partition("=")
        if key != column:
            raise ValueError(f"{output!r} does not follow {template!r}")
        values[column] = value
    return values
