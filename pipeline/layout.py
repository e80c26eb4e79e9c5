"""Where a run keeps what is not scores: beside the output, so that the output holds only data.

For an output ``<parent>/<name>`` (``data/scored/run_date=2026-11-29``)::

    <parent>/<name>/                    the output: scored Parquet files, _SUCCESS and
                                        _SCORE_CATALOG (both empty), _lock*.json while a run
                                        holds it
    <parent>/_score_catalog/<name>/     its control folder: _manifest.json, _report.json,
                                        _report.html (and _runs/<job>/ for an output whose
                                        template has no placeholder: see runindex.index_root)
    <parent>/_rejects/<name>/           its rejects, unless the job sets ``rejects``

Why beside and not inside under a ``_`` name: Polars' ``scan_parquet('<output>')`` (2.1, default
settings) reads every file below the folder, hidden names included, and refuses a folder whose
files do not all share one extension; it skips only empty files. A ``_report.json``, a
``.report.json``, an extensionless ``_report`` or a ``_score_catalog/`` subfolder all break it,
while an empty ``_SUCCESS`` does not (``polars-io`` ``path_utils::expand_paths_hive`` lists files
with ``len() > 0`` and compares their extensions). pyarrow.dataset, pandas, Dask, Spark and
DuckDB's ``'<output>/*.parquet'`` skip ``_`` names either way, so for them nothing changes.

Outputs written before the control folder existed kept these files inside the output: they are
read from there when the control folder has none (:func:`find`), and moved out by the next run
that takes the output's lock (``pipeline.run``). An output at a bucket root has no parent: its
control files stay inside it, as before (Polars then needs ``hidden_file_prefix=['_', '.']``).
"""

from __future__ import annotations

from collections.abc import Callable

from pipeline import storage
from pipeline.storage import Location

#: The folder, beside each output, that holds its control files.
CONTROL_DIR = "_score_catalog"
#: An empty file in every output this tool writes: cheap proof that the folder is ours (the
#: control folder lives outside it, so it could outlive the folder it describes).
OUTPUT_MARK = "_SCORE_CATALOG"
#: The run index's folder (``pipeline.runindex``) below its root.
RUN_INDEX_DIR = "_runs"


def beside(uri: str, folder: str) -> str | None:
    """``<parent of uri>/<folder>/<uri's name>``, or None when ``uri`` has no parent.

    ``data/scored/x`` gives ``data/scored/<folder>/x`` and ``s3://b/scored/x`` gives
    ``s3://b/scored/<folder>/x``. A bucket root (``s3://b``) or the filesystem root has no parent.
    """
    proto, sep, rest = uri.rpartition("://")
    path = rest.rstrip("/")
    if not path or (sep and "/" not in path):
        return None  # "/" or "", or a bucket root
    parent, slash, name = path.rpartition("/")
    if name in (".", ".."):
        return None
    return f"{proto}{sep}{parent}{slash}{folder}/{name}"


def control_root(out_root: Location) -> Location:
    """The control folder of ``out_root``; the output itself when it has no parent."""
    uri = beside(out_root.uri, CONTROL_DIR)
    parent, slash, name = out_root.path.rstrip("/").rpartition("/")
    if uri is None or not slash or name in ("", ".", ".."):
        return out_root
    path = f"{parent}/{CONTROL_DIR}/{name}"
    return Location(out_root.fs, path, uri, out_root.retry_deadline_s)


def candidates(out_root: Location) -> list[Location]:
    """Where ``out_root``'s control files may be: its control folder, then (older layout, or a
    bucket root) the output itself."""
    control = control_root(out_root)
    return [control] if control == out_root else [control, out_root]


def find(out_root: Location, name: str) -> Location | None:
    """The control file ``name`` of ``out_root`` where it exists (control folder first)."""
    for root in candidates(out_root):
        loc = root.child(name)
        if storage.exists(loc):
            return loc
    return None


def claim(out_root: Location, index: Location, fence: Callable[[], None]) -> None:
    """What a run does first once it holds the output's lock, before anything is scored.

    Marks the folder as ours (:data:`OUTPUT_MARK`); withdraws the previous run's ``_SUCCESS``
    and report, which describe the output as it was and would be taken for this run's while it
    changes it (the run index keeps every run's record); and moves the run index an older
    version kept inside the output (``<output>/_runs``) to ``index``. The manifest moves on its
    own (``Manifest.load`` reads the old place, the run saves to the new one).
    """
    from pipeline.report import HTML_NAME, REPORT_NAME

    fence()
    mark = out_root.child(OUTPUT_MARK)
    if not storage.exists(mark):
        storage.write_bytes(mark, b"")
    storage.remove(out_root.child(storage.SUCCESS_NAME))
    for root in candidates(out_root):
        for name in (REPORT_NAME, HTML_NAME):
            storage.remove(root.child(name))
    old_index = out_root.child(RUN_INDEX_DIR)
    if index == out_root:
        return
    moved = storage.list_files(old_index)
    for rel in moved:
        src = old_index.child(rel)
        storage.write_bytes(index.child(f"{RUN_INDEX_DIR}/{rel}"), storage.read_bytes(src))
        storage.remove(src)
    if moved:
        storage.remove_tree(old_index)  # its folders, empty now
