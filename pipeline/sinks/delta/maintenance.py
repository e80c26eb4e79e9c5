"""A Delta table's upkeep: VACUUM (delta-rs's, its retention enforced by delta-rs) and OPTIMIZE
(small files compacted by :mod:`pipeline.sinks.compaction`, with this tool's statistics: see
there why not delta-rs's)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
from deltalake.exceptions import DeltaError
from deltalake.transaction import AddAction, CommitProperties, RemoveAction

from pipeline.core.errors import UsageError
from pipeline.io.layout import SCORER_KEY, WRITER_KEY
from pipeline.sinks import compaction
from pipeline.sinks.delta.client import (
    OPERATION,
    TableRef,
    as_pipeline_error,
    delta_errors,
    hooks,
    now_ms,
    open_table,
    partition_columns,
    prefixed,
)
from pipeline.sinks.delta.options import retention_text
from pipeline.sinks.delta.snapshot import in_partition, table_files
from pipeline.sinks.delta.stats import file_stats
from pipeline.sinks.tables import METADATA_PREFIX, TableFile

logger = logging.getLogger(__name__)


def vacuum(
    ref: TableRef,
    retention_hours: int | None = None,
    dry_run: bool = True,
    *,
    force: bool = False,
    metadata: Mapping[str, str] | None = None,
) -> list[str]:
    """Delete (or with ``dry_run`` list) the files removed from the table more than
    ``retention_hours`` ago (default: the table's ``delta.deletedFileRetentionDuration``).
    Returns their paths.

    A retention shorter than the table's is refused unless ``force`` (delta-rs's own check,
    ``enforce_retention_duration``): a rollback to a version in that window, or a reader still
    on one, would find its files gone. Only files the log removed are deleted ("lite" vacuum):
    files no commit ever listed (a run's uncommitted output) are left alone, since an in-flight
    run's may be among them.
    """
    if retention_hours is not None and retention_hours < 0:
        raise UsageError(f"vacuum of {ref.uri}: a retention of {retention_hours} h is negative")
    table = open_table(ref)
    try:
        files = table.vacuum(
            retention_hours=retention_hours,
            dry_run=dry_run,
            enforce_retention_duration=not force,
            commit_properties=CommitProperties(custom_metadata=prefixed(metadata)),
            post_commithook_properties=hooks(),
            full=False,
        )
    except DeltaError as e:
        if "retention" not in str(e).lower():
            raise as_pipeline_error(ref, "vacuuming", e) from e
        kept = table.metadata().configuration.get("delta.deletedFileRetentionDuration")
        raise UsageError(
            f"vacuum of {ref.uri} with a retention of {retention_hours} h refused: the table "
            f"keeps removed files {retention_text(kept)} (delta.deletedFileRetention"
            "Duration), the window in which a rollback, time travel or a long-running reader "
            "may still need them. Use the default, or pass --force to shorten that window (a "
            "rollback to, or a reader on, a version older than the retention then fails)"
        ) from e
    # delta-rs lists a path once relative and once absolute when the log removed it twice (a
    # partition rollback added it back, a later run removed it again): 9 "deleted" for 6 files
    # (issue 29 review). One path per file, relative to the table.
    roots = [r.rstrip("/") + "/" for r in {ref.table_uri, ref.uri, ref.location.path} if r]
    relative = set()
    for path in files:
        relative.add(next((path[len(r) :] for r in roots if path.startswith(r)), path))
    return sorted(relative)


def optimize(
    ref: TableRef,
    partition: Mapping[str, str] | None = None,
    target_size: int | None = None,
    *,
    metadata: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Compact the small files (of one partition, if given) into files of about
    ``target_size`` bytes (default 100 MiB, delta-rs's): one version that removes them and adds
    the new ones, both marked as no change of data (readers see the same rows). Returns
    ``numFilesRemoved`` and ``numFilesAdded`` (delta-rs's names); no version when nothing is
    small enough to compact together."""
    table = open_table(ref)
    columns = partition_columns(table)
    unknown = sorted(set(partition or {}) - set(columns))
    if unknown:
        raise UsageError(
            f"the Delta table {ref.uri} has no partition column {', '.join(unknown)} "
            f"(its partition columns: {columns or 'none'})"
        )
    with delta_errors(ref, "reading the log of"):
        live = {f.path: f for f in table_files(table) if in_partition(f, partition)}
        schema = pa.schema(table.schema().to_arrow())
    target = target_size or compaction.DEFAULT_TARGET_SIZE
    small = [compaction.Small(f.path, f.size, _folder(f.path)) for f in live.values()]
    plan = compaction.bins(small, target)
    if not plan:
        return {"numFilesRemoved": 0, "numFilesAdded": 0}
    data_schema = pa.schema([f for f in schema if f.name not in columns])
    actions: list[AddAction | RemoveAction] = []
    for group in plan:
        old = [live[s.key] for s in group]
        actions += _compacted(ref, old, data_schema)
    removed = sum(isinstance(a, RemoveAction) for a in actions)
    info = {
        **prefixed(metadata),
        METADATA_PREFIX + OPERATION: "OPTIMIZE",
        METADATA_PREFIX + "compacted": f"{removed} into {len(plan)}",
    }
    with delta_errors(ref, "optimizing"):
        table.create_write_transaction(
            actions,
            mode="append",
            schema=table.schema(),
            partition_by=columns or None,
            commit_properties=CommitProperties(custom_metadata=info, max_commit_retries=0),
            post_commithook_properties=hooks(),
        )
    logger.info("compacted %d file(s) of %s into %d", removed, ref.uri, len(plan))
    return {"numFilesRemoved": removed, "numFilesAdded": len(plan)}


def _folder(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def _compacted(
    ref: TableRef, old: list[TableFile], data_schema: pa.Schema
) -> list[AddAction | RemoveAction]:
    """The actions that replace ``old`` (one partition's) by one file of their rows."""
    folder = _folder(old[0].path)
    name = f"compacted-{uuid.uuid4().hex}.parquet"
    path = f"{folder}/{name}" if folder else name

    def align(t: pa.Table) -> pa.Table:
        cols = [
            t.column(f.name).cast(f.type) if f.name in t.column_names else pa.nulls(len(t), f.type)
            for f in data_schema
        ]
        return pa.table(cols, schema=data_schema)

    done = compaction.rewrite(
        [ref.location.child(f.path) for f in old],
        ref.location.child(path),
        data_schema,
        align,
        # Rows of one incremental scorer stay a baseline once compacted (docs/incremental.md).
        keep=(WRITER_KEY, SCORER_KEY),
    )
    floats = {f.name for f in data_schema if pa.types.is_floating(f.type)}
    now = now_ms()
    removes: list[AddAction | RemoveAction] = [
        RemoveAction(
            path=f.path,
            data_change=False,
            deletion_timestamp=now,
            size=f.size,
            partition_values=dict(f.partition_values),
        )
        for f in old
    ]
    add = AddAction(
        path=path,
        size=done.size,
        partition_values=dict(old[0].partition_values),
        modification_time=now,
        data_change=False,
        stats=file_stats(done.metadata, nan_free=floats - done.nan_columns),
    )
    return [*removes, add]
