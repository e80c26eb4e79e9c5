"""A run's snapshot as the table records it (:func:`commit_summary`), checked against the run's
report once it landed (:func:`check_committed`), and the report's ``output_format`` section."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from pipeline.core.errors import CommitRefused
from pipeline.io.manifest import fingerprint_hash
from pipeline.sinks.iceberg import catalog
from pipeline.sinks.iceberg.catalog import IcebergRef
from pipeline.sinks.iceberg.view import data_files


def commit_summary(
    run_id: str,
    job: str,
    label: str,
    entries: Mapping[str, Mapping[str, Any]],
    schema: pa.Schema,
    meta_columns: tuple[str, ...],
) -> dict[str, str]:
    """What a run's snapshot says of itself in its summary (under ``score_catalog.``, with the
    token that :mod:`.commit` adds): run, model, settings, input, rows, job, partition and
    output columns."""
    first = next(iter(entries.values()), {})
    fingerprints = {rel: e.get("fingerprint") for rel, e in sorted(entries.items())}
    meta = {*meta_columns, "model_version"}
    return {
        catalog.RUN_ID: run_id,
        catalog.MODEL_SHA256: str(first.get("model_sha256", "")),
        catalog.SETTINGS_HASH: str(first.get("settings_hash", "")),
        catalog.INPUT_FINGERPRINT: fingerprint_hash(fingerprints),
        catalog.ROWS: str(sum(int(e.get("rows_scored") or 0) for e in entries.values())),
        catalog.JOB: job,
        catalog.PARTITION: label,
        catalog.OUTPUTS: ",".join(n for n in schema.names if n not in meta),
    }


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
