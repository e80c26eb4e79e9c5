"""A run's snapshot checked against the run's report once it landed (:func:`check_committed`),
and the summary line of the report's ``output_format`` section (:func:`summary`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.core.errors import CommitRefused
from pipeline.sinks.iceberg import catalog
from pipeline.sinks.iceberg.catalog import IcebergRef
from pipeline.sinks.iceberg.view import data_files


def check_committed(
    ref: IcebergRef,
    partition: Mapping[str, str],
    snapshot_id: int,
    entries: Mapping[str, Mapping[str, Any]],
) -> None:
    """The committed snapshot's partition must hold exactly the report's files and rows."""
    table = catalog.load(ref)
    if table is None:
        raise CommitRefused(f"the Iceberg table {ref.uri} is gone from its catalog", uri=ref.uri)
    have = {
        p: int(f.record_count) for p, f in data_files(ref, table, partition, snapshot_id).items()
    }
    want = {str(e["file"]): int(e.get("rows_scored") or 0) for e in entries.values()}
    problems = [f"{p} is missing" for p in sorted(set(want) - set(have))]
    problems += [f"{p} is not in the report" for p in sorted(set(have) - set(want))]
    problems += [
        f"{p} holds {have[p]} rows, the report says {n}"
        for p, n in sorted(want.items())
        if p in have and have[p] != n
    ]
    if problems:
        label = "/".join(f"{k}={v}" for k, v in partition.items()) or "(the table)"
        raise CommitRefused(
            f"snapshot {snapshot_id} of {ref.uri} was committed, but its partition {label} "
            "differs from the report: " + "; ".join(problems[:10]),
            uri=ref.uri,
        )


def summary(d: Mapping[str, Any]) -> str:
    """The summary's ``table`` line: the snapshot readers see, and whether this run made it."""
    where = f" partition {d['partition']}" if d.get("partition") else ""
    version = d.get("version")
    if d.get("committed"):
        what = (
            f"committed snapshot {d.get('snapshot_id')} (sequence number {version}, run "
            f"version {d.get('run_version')})"
        )
    elif (d.get("recovered") or {}).get("table_version") is not None:
        rec = d["recovered"]
        what = f"sequence number {version}: committed by run {rec.get('run_id')} before it stopped"
    elif version is not None:
        what = f"sequence number {version}, no new snapshot"
    else:
        what = "nothing committed"
    return f"{d.get('table')} ({d.get('identifier')}){where}: {what}"
