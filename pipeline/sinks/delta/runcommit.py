"""A run's commit checked against the run's report once it landed (:func:`check_committed`),
the run's new files as the log adds them (:func:`new_files`), and the summary line of the
report's ``output_format`` section (:func:`summary`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.core.errors import CommitRefused
from pipeline.sinks.delta import table as delta
from pipeline.sinks.delta.stats import NewFile
from pipeline.sinks.naming import partition_label


def check_committed(
    table: delta.TableRef,
    partition: Mapping[str, str],
    version: int,
    entries: Mapping[str, Mapping[str, Any]],
) -> None:
    """The committed version's partition must hold exactly the report's files and rows."""
    snap = delta.snapshot(table, dict(partition) or None, version=version)
    have = {f.path: f.rows for f in snap.files}
    want = {str(e["file"]): int(e.get("rows_scored") or 0) for e in entries.values()}
    problems = [f"{p} is missing" for p in sorted(set(want) - set(have))]
    problems += [f"{p} is not in the report" for p in sorted(set(have) - set(want))]
    problems += [
        f"{p} holds {have[p]} rows, the report says {n}"
        for p, n in sorted(want.items())
        if p in have and have[p] is not None and have[p] != n
    ]
    if problems:
        raise CommitRefused(
            f"version {version} of {table.uri} was committed, but its partition "
            f"{partition_label(partition) or '(the table)'} differs from the report: "
            + "; ".join(problems[:10]),
            uri=table.uri,
        )


def summary(d: Mapping[str, Any]) -> str:
    """The summary's ``table`` line: the version readers see, and whether this run made it."""
    where = f" partition {d['partition']}" if d.get("partition") else ""
    version = d.get("version")
    if d.get("committed"):
        what = f"committed version {version} (run version {d.get('run_version')})"
    elif (d.get("recovered") or {}).get("table_version") is not None:
        rec = d["recovered"]
        what = f"version {version}: committed by run {rec.get('run_id')} before it stopped"
    elif version is not None:
        what = f"version {version}, no new commit"
    else:
        what = "nothing committed"
    return f"{d.get('table')}{where}: {what}"


def _is_new(entry: Mapping[str, Any], in_table: set[str]) -> bool:
    return isinstance(entry.get("file"), str) and entry["file"] not in in_table


def _new_file(entry: Mapping[str, Any], partition: Mapping[str, str]) -> NewFile:
    return NewFile(
        path=str(entry["file"]),
        size=int(entry["size"]),
        partition_values=dict(partition),
        modification_time=int(entry.get("modification_time") or delta.now_ms()),
        stats=str(entry.get("stats") or ""),
        rows=int(entry.get("rows") or 0),
    )


def new_files(
    entries: Mapping[str, Mapping[str, Any]], partition: Mapping[str, str], in_table: set[str]
) -> list[NewFile]:
    """The files the manifest's entries name that the table does not hold yet: the run's."""
    return [_new_file(e, partition) for e in entries.values() if _is_new(e, in_table)]
