"""A Delta table's versions as ``score-catalog history`` shows them: what each commit did, and,
for this tool's commits, the run, model, rows and partitions its commit info names."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from typing import Any

from deltalake import DeltaTable

from pipeline.core.errors import StorageError
from pipeline.sinks.delta.client import (
    OPERATION,
    RESTORED_TO,
    TOKEN,
    TableRef,
    delta_errors,
    open_table,
)
from pipeline.sinks.tables import (
    FILES_ADDED,
    FILES_REMOVED,
    METADATA_PREFIX,
    MODEL_SHA256,
    PARTITION,
    ROWS,
    RUN_ID,
    VersionInfo,
)


def _detail(entry: Mapping[str, Any]) -> str:
    op = str(entry.get("operation", ""))
    params = entry.get("operationParameters") or {}
    metrics = entry.get("operationMetrics") or {}
    if op == "RESTORE":
        return f"restored version {params.get('version', params.get('datetime', '?'))}"
    if op == "OPTIMIZE":
        return (
            f"compacted {metrics.get('numFilesRemoved', '?')} file(s) into "
            f"{metrics.get('numFilesAdded', '?')}"
        )
    if op == "VACUUM START":
        return f"deleting {metrics.get('numFilesToDelete', '?')} file(s) removed from the table"
    if op == "VACUUM END":
        return f"deleted {metrics.get('numDeletedFiles', '?')} file(s)"
    if op == "ADD COLUMN":
        try:
            names = [f["name"] for f in json.loads(params.get("fields", "[]"))]
        except (TypeError, ValueError, KeyError):
            names = []
        return f"added column(s) {', '.join(names) or '?'}"
    if op == "CREATE TABLE":
        return _created(params)
    return _our_detail(
        {k[len(METADATA_PREFIX) :]: v for k, v in entry.items() if k.startswith(METADATA_PREFIX)}
    )


def _created(params: Mapping[str, Any]) -> str:
    """CREATE TABLE's detail: delta-rs writes the partition columns inside the ``metadata``
    parameter (a JSON string), not as ``partitionBy``."""
    try:
        meta = json.loads(params.get("metadata") or "{}")
        columns = list(meta.get("partitionColumns") or json.loads(params.get("partitionBy", "[]")))
    except (TypeError, ValueError, AttributeError):
        return "created"
    return f"created, partitioned by {', '.join(columns)}" if columns else "created, unpartitioned"


def _our_detail(ours: Mapping[str, Any]) -> str:
    """:func:`_detail` of a commit of ours: a run's, or a partition's rollback."""
    if RESTORED_TO in ours:  # restore_partition: a WRITE that says what it restored
        return (
            f"restored {ours.get(PARTITION) or '?'} to version {ours[RESTORED_TO]}: "
            f"{ours.get(FILES_ADDED, '?')} file(s) added back, {ours.get(FILES_REMOVED, '?')} "
            "removed"
        )
    if "compacted" in ours:  # maintenance.optimize: "8 into 1"
        removed, _, added = str(ours["compacted"]).partition(" into ")
        return f"compacted {removed} file(s) into {added}"
    if FILES_ADDED in ours:
        return f"{ours[FILES_ADDED]} file(s) added, {ours.get(FILES_REMOVED, 0)} removed"
    return ""


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _history(ref: TableRef, table: DeltaTable, limit: int | None) -> list[dict[str, Any]]:
    """``table.history(limit)`` with true version numbers. delta-rs reads the newest commits in
    storage but numbers them from the object's version: a commit landing between the open and
    the read shifts every number. So read again until the object's version did not move."""
    for _ in range(5):
        with delta_errors(ref, "reading the history of"):
            before = table.version()
            entries = table.history(limit)
            table.update_incremental()
        if table.version() == before:
            return entries
    raise StorageError(
        f"reading the history of {ref.uri} failed: new versions kept landing while it was read; "
        "try again",
        uri=ref.uri,
    )


def history(ref: TableRef, limit: int | None = None) -> list[VersionInfo]:
    """The table's versions, newest first (``limit`` of them; all the log still has if None)."""
    entries = _history(ref, open_table(ref), limit)
    out = []
    for e in entries:
        ours = {
            k[len(METADATA_PREFIX) :]: str(v)
            for k, v in e.items()
            if k.startswith(METADATA_PREFIX) and k != METADATA_PREFIX + TOKEN
        }
        out.append(
            VersionInfo(
                version=int(e["version"]),
                timestamp=dt.datetime.fromtimestamp(
                    int(e.get("timestamp", 0)) / 1000, dt.timezone.utc
                ),
                operation=ours.get(OPERATION) or str(e.get("operation", "")),
                run_id=ours.get(RUN_ID),
                model_sha256=ours.get(MODEL_SHA256),
                rows=_int(ours.get(ROWS)),
                partition=ours.get(PARTITION),
                metadata=ours,
                detail=_detail(e),
                engine=e.get("engineInfo"),
            )
        )
    return out
