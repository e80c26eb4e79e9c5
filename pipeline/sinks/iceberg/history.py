"""An Iceberg table's versions as ``score-catalog history`` shows them: one per snapshot on its
main branch, newest first, numbered by the snapshot's sequence number (what a run's report calls
``version``: a snapshot id is a random 64-bit number), with what this tool's snapshots say of
themselves in their summaries (``score_catalog.*``: the run, model, rows and partition; a
rollback's ``restored_to``); and the snapshot a version number names (:func:`snapshot_at`)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping

from pyiceberg.table import Table
from pyiceberg.table.snapshots import Snapshot, ancestors_of

from pipeline.core.errors import UsageError
from pipeline.sinks.iceberg.catalog import IcebergRef
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

#: Summary keys (under ``score_catalog.``) of this tool's snapshots that are not runs'.
OPERATION = "operation"  # what a snapshot of ours that is not a run's did: RESTORE, OPTIMIZE
RESTORED_TO = "restored_to"  # a rollback's: the version it restored
ROWS_ADDED = "rows_added"
ROWS_REMOVED = "rows_removed"

#: The operation of a snapshot of ours that names none: a run's, or a partition's rollback
#: (as Delta's: a write that says what it restored; only a whole-table rollback is a RESTORE,
#: which ``pipeline.driver.tables.rolled_back`` tells apart).
WRITE = "WRITE"


def snapshots(table: Table) -> list[Snapshot]:
    """The snapshots of the table's main branch, newest first (what readers saw, in order:
    this tool never moves the branch back, so these are every snapshot it made that a vacuum
    has not expired)."""
    return list(ancestors_of(table.metadata.current_snapshot(), table.metadata))


def ours(snap: Snapshot) -> dict[str, str]:
    """Every ``score_catalog.`` key of the snapshot's summary, without the prefix."""
    summary = snap.summary.additional_properties if snap.summary is not None else {}
    return {
        k[len(METADATA_PREFIX) :]: str(v)
        for k, v in summary.items()
        if k.startswith(METADATA_PREFIX)
    }


def latest_version(table: Table) -> int | None:
    snap = table.metadata.current_snapshot()
    return snap.sequence_number if snap is not None else None


def snapshot_at(ref: IcebergRef, table: Table, version: int) -> Snapshot:
    """The snapshot whose sequence number is ``version``, on the main branch; a
    :class:`UsageError` naming the versions there are when there is none."""
    found = snapshots(table)
    for snap in found:
        if snap.sequence_number == version:
            return snap
    numbers = sorted(int(s.sequence_number or 0) for s in found)
    have = f"{numbers[0]} to {numbers[-1]}" if numbers else "none: no run has committed yet"
    raise UsageError(
        f"the Iceberg table {ref.uri} has no version {version} (a version is a snapshot's "
        f"sequence number; its versions now: {have}; older snapshots are expired by a vacuum): "
        "score-catalog history lists them"
    )


def _int(value: object) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


def _operation(snap: Snapshot, mine: Mapping[str, str]) -> str:
    if OPERATION in mine:
        return mine[OPERATION]
    if mine:
        return WRITE
    # Another writer's snapshot: Iceberg's own operation (APPEND, OVERWRITE, DELETE, REPLACE).
    return snap.summary.operation.value.upper() if snap.summary is not None else "?"


def _detail(snap: Snapshot, operation: str, mine: Mapping[str, str]) -> str:
    """What a snapshot did, in words (as Delta's history says it)."""
    if RESTORED_TO in mine:
        if operation == "RESTORE":
            return f"restored version {mine[RESTORED_TO]}"
        return (
            f"restored {mine.get(PARTITION) or '?'} to version {mine[RESTORED_TO]}: "
            f"{mine.get(FILES_ADDED, '?')} file(s) added back, {mine.get(FILES_REMOVED, '?')} "
            "removed"
        )
    if "compacted" in mine:  # "8 into 1", as a Delta OPTIMIZE of ours says it
        removed, _, added = str(mine["compacted"]).partition(" into ")
        return f"compacted {removed} file(s) into {added}"
    if FILES_ADDED in mine:
        return f"{mine[FILES_ADDED]} file(s) added, {mine.get(FILES_REMOVED, 0)} removed"
    summary = snap.summary.additional_properties if snap.summary is not None else {}
    return (
        f"{summary.get('added-data-files', 0)} file(s) added, "
        f"{summary.get('deleted-data-files', 0)} removed"
    )


def history(table: Table, limit: int | None = None) -> list[VersionInfo]:
    """The table's versions, newest first (``limit`` of them; every snapshot not expired if
    None)."""
    found = snapshots(table)
    out = []
    for snap in found[:limit] if limit else found:
        mine = ours(snap)
        operation = _operation(snap, mine)
        summary = snap.summary.additional_properties if snap.summary is not None else {}
        engine = summary.get("engine-name")
        out.append(
            VersionInfo(
                version=int(snap.sequence_number or 0),
                timestamp=dt.datetime.fromtimestamp(snap.timestamp_ms / 1000, dt.timezone.utc),
                operation=operation,
                run_id=mine.get(RUN_ID),
                model_sha256=mine.get(MODEL_SHA256),
                rows=_int(mine.get(ROWS)),
                partition=mine.get(PARTITION),
                metadata=mine,
                detail=_detail(snap, operation, mine),
                engine=f"{engine} {summary.get('engine-version', '')}".strip() if engine else None,
            )
        )
    return out
