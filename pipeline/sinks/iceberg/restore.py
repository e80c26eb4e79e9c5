"""An Iceberg table, or one partition of it, back to an older version (a snapshot's sequence
number), as ONE new snapshot: what a rollback changes, partition by partition
(:func:`restore_changes`), and the rollback itself (:func:`restore`, :func:`restore_partition`).

pyiceberg's ``manage_snapshots().rollback_to_snapshot`` is not used: it moves the main branch
back and makes no snapshot, so the snapshots it undoes leave the history (readers of the branch
never see them again) and the rollback itself is in no snapshot to be undone. Here a rollback is
the sink's own one-snapshot producer (:func:`pipeline.sinks.iceberg.commit.stage_snapshot`): the
files of the partition (or the table) that the version did not hold deleted, the ones it held
that the table no longer does added back as that version's manifests list them (their
statistics from there: no footer read, no copy). Those files are still in storage unless
something deleted them since: a rollback that needs a file that is gone is refused, nothing
committed. The snapshot's summary says what it was (``score_catalog.restored_to``,
``.partition``, file and row counts, and the caller's metadata: reason, by, runs).

The schema stays the table's, as in every Iceberg rollback (a snapshot does not carry the
schema; Delta's RESTORE reverts it): a column gained since the version reads as null in the
rows restored, and a version whose columns the table can no longer read its files with
(:func:`restore_schema`) is refused. Run tokens (the ``score_catalog.txn.*`` table properties)
are left as they are: a retry of an undone run is still refused, and the next run of a
partition commits the run version after the undone run's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
from pyiceberg.exceptions import CommitFailedException, ValidationException
from pyiceberg.expressions import AlwaysTrue, BooleanExpression
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table

from pipeline.core.errors import CommitConflict, UsageError
from pipeline.io import storage
from pipeline.io.storage import Location
from pipeline.sinks.iceberg.catalog import IcebergRef
from pipeline.sinks.iceberg.commit import FOOTER_THREADS, stage_snapshot
from pipeline.sinks.iceberg.history import (
    OPERATION,
    RESTORED_TO,
    ROWS_ADDED,
    ROWS_REMOVED,
    latest_version,
    snapshot_at,
)
from pipeline.sinks.iceberg.schema import type_key
from pipeline.sinks.iceberg.view import ALL_FILES, partition_filter
from pipeline.sinks.naming import partition_label
from pipeline.sinks.tables import (
    FILES_ADDED,
    FILES_REMOVED,
    METADATA_PREFIX,
    PARTITION,
    PartitionChange,
    TableFile,
    rows_of,
)

logger = logging.getLogger(__name__)

_MAX_LISTED = 10  # files or partitions named in one message


@dataclass(frozen=True)
class Files:
    """Data files of the table (or a partition) at one snapshot, by path relative to the
    table's root: pyiceberg's ``DataFile`` (what a commit deletes or adds back) and the
    format-neutral :class:`TableFile`."""

    data: Mapping[str, DataFile]
    files: Mapping[str, TableFile]


def partition_columns(table: Table) -> list[str]:
    return [f.name for f in table.spec().fields]


def check_partition(ref: IcebergRef, table: Table, partition: Mapping[str, str] | None) -> None:
    """Refuse a partition that names a column the table is not partitioned by."""
    columns = partition_columns(table)
    unknown = sorted(set(partition or {}) - set(columns))
    if unknown:
        raise UsageError(
            f"the Iceberg table {ref.uri} has no partition column {', '.join(unknown)} "
            f"(its partition columns: {columns or 'none'})"
        )


def files_at(
    ref: IcebergRef, table: Table, snapshot_id: int, partition: Mapping[str, str] | None
) -> Files:
    """The live data files at ``snapshot_id`` of the table, or of ``partition`` (some or all of
    its partition columns), each with its partition values (from its manifest: the files hold
    no partition column)."""
    names = {sid: [f.name for f in spec.fields] for sid, spec in table.specs().items()}
    scan = table.scan(
        row_filter=partition_filter(partition or {}), snapshot_id=snapshot_id, options=ALL_FILES
    )
    location = table.metadata.location
    data: dict[str, DataFile] = {}
    files: dict[str, TableFile] = {}
    for task in scan.plan_files():
        f = task.file
        cols = names.get(f.spec_id, [])
        values = {c: _text(f.partition[i]) for i, c in enumerate(cols)}
        if any(values.get(k) != v for k, v in (partition or {}).items()):
            continue  # the scan prunes by statistics: only a partition's own files count
        rel = ref.rel(f.file_path, location)
        data[rel] = f
        files[rel] = TableFile(
            path=rel,
            size=int(f.file_size_in_bytes),
            partition_values=values,
            rows=int(f.record_count),
            modification_time=0,  # a manifest records none
        )
    return Files(data, files)


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def _check_restorable(ref: IcebergRef, table: Table, version: int) -> tuple[int, int]:
    """(the latest version, the snapshot id of ``version``), or a :class:`UsageError`."""
    latest = latest_version(table)
    snap = snapshot_at(ref, table, version)
    if latest is None or version >= latest:
        raise UsageError(
            f"cannot restore {ref.uri} to version {version}: it is the latest version "
            "(restoring it changes nothing)"
        )
    return latest, snap.snapshot_id


def _label(f: TableFile) -> str:
    return partition_label({k: str(v) for k, v in f.partition_values.items()})


def _changes(
    ref: IcebergRef, table: Table, version: int, partition: Mapping[str, str] | None
) -> tuple[int, list[PartitionChange], Files, Files]:
    """(the latest version, every partition's change, the files now, the files then)."""
    check_partition(ref, table, partition)
    latest, then_id = _check_restorable(ref, table, version)
    current = table.metadata.current_snapshot()
    assert current is not None  # _check_restorable: a latest version exists
    now = files_at(ref, table, current.snapshot_id, partition)
    then = files_at(ref, table, then_id, partition)
    groups: dict[str, tuple[list[TableFile], list[TableFile]]] = {}
    for f in now.files.values():
        groups.setdefault(_label(f), ([], []))[0].append(f)
    for f in then.files.values():
        groups.setdefault(_label(f), ([], []))[1].append(f)
    if partition and not groups:
        _no_such_partition(ref, table, partition, version)
    changes = [
        PartitionChange(k, tuple(sorted(a, key=_path)), tuple(sorted(b, key=_path)))
        for k, (a, b) in sorted(groups.items())
    ]
    return latest, changes, now, then


def _path(f: TableFile) -> str:
    return f.path


def restore_changes(
    ref: IcebergRef, table: Table, version: int, partition: Mapping[str, str] | None = None
) -> tuple[int, list[PartitionChange]]:
    """(the latest version, what rolling the table, or ``partition`` of it, back to ``version``
    changes): every partition holding files now or then, by label, unchanged ones too. Reads
    the manifests and checks that each file to add back is still in storage (a dry run says
    so too); changes nothing."""
    latest, changes, _now, _then = _changes(ref, table, version, partition)
    _check_re_added(ref, [c for c in changes if c.changed], version)
    return latest, changes


def _no_such_partition(
    ref: IcebergRef, table: Table, partition: Mapping[str, str], version: int
) -> None:
    """Refuse a partition that holds no files now nor at ``version`` (a typo in its value would
    otherwise be "nothing to roll back", exit 0), naming the partitions there are."""
    current = table.metadata.current_snapshot()
    found = files_at(ref, table, current.snapshot_id, None).files if current else {}
    labels = sorted({_label(f) for f in found.values()})
    shown = ", ".join(labels[:_MAX_LISTED]) + (
        f" (and {len(labels) - _MAX_LISTED} more)" if len(labels) > _MAX_LISTED else ""
    )
    raise UsageError(
        f"the Iceberg table {ref.uri} has no partition {partition_label(partition)}, now or at "
        f"version {version}: check its name (partitions now: {shown or 'none'}; "
        "score-catalog history lists the versions)"
    )


def restore_schema(ref: IcebergRef, table: Table, version: int) -> tuple[list[str], list[str]]:
    """(columns the table gained after ``version``, problems): how ``version``'s files fit the
    table's schema now, column by field id (a renamed column is the same column). A column the
    version had that the table lost, or whose type changed, is a problem: its files would not
    be read as they were written, so a rollback to that version is refused."""
    snap = snapshot_at(ref, table, version)
    then = table.schemas().get(snap.schema_id) if snap.schema_id is not None else None
    now = table.schema()
    if then is None:  # a snapshot that names no schema was written with the table's first
        then = table.schemas().get(0, now)
    have = {f.field_id: f for f in now.fields}
    had = {f.field_id: f for f in then.fields}
    gained = [f.name for i, f in have.items() if i not in had]
    problems = [
        f"column {f.name!r} is {type_key(f.field_type)} at version {version} and "
        f"{type_key(have[i].field_type)} now"
        for i, f in had.items()
        if i in have and type_key(have[i].field_type) != type_key(f.field_type)
    ]
    lost = [f.name for i, f in had.items() if i not in have]
    if lost:
        problems.append(
            f"version {version} has column(s) {', '.join(map(repr, lost))}, which the table "
            "no longer has"
        )
    return gained, problems


def _loc(ref: IcebergRef, rel: str) -> Location:
    """Where a data file is: below the table's root, or (another writer's) its own URI."""
    return storage.locate(rel) if "://" in rel else ref.location.child(rel)


def _check_re_added(ref: IcebergRef, changes: Sequence[PartitionChange], version: int) -> None:
    """Refuse (nothing committed) when a file to add back is gone or no longer the one the
    version's manifest lists: pyiceberg would commit it anyway, and every reader would then
    fail on it."""
    files = [f for c in changes for f in c.re_added]
    if not files:
        return

    def problem(f: TableFile) -> str | None:
        loc = _loc(ref, f.path)
        try:
            with storage.open_input(loc) as fh:
                pq.ParquetFile(fh)  # the footer: a truncated file is no data file
            size = storage.size_of(loc)
        except FileNotFoundError:
            return "missing"
        except (OSError, pa.ArrowException) as e:
            return f"unreadable: {e}"
        return None if size == f.size else f"{size} bytes, the table's manifest says {f.size}"

    with ThreadPoolExecutor(max(1, min(FOOTER_THREADS, len(files)))) as pool:
        problems = list(pool.map(problem, files))
    found = [f"{f.path} ({p})" for f, p in zip(files, problems, strict=True) if p]
    if not found:
        return
    what = changes[0].label if len(changes) == 1 and changes[0].label else "the table"
    more = f" (and {len(found) - _MAX_LISTED} more)" if len(found) > _MAX_LISTED else ""
    raise UsageError(
        f"cannot roll {what} of {ref.uri} back to version {version}: {len(found)} of the "
        f"{len(files)} file(s) it would add back are gone or changed: "
        f"{'; '.join(found[:_MAX_LISTED])}{more}: deleted by hand, or by a vacuum. Nothing was "
        "committed. Roll back to a later version (score-catalog history lists them)"
    )


def _summary(
    changes: Sequence[PartitionChange],
    version: int,
    metadata: Mapping[str, str] | None,
    more: Mapping[str, str],
) -> dict[str, str]:
    """The rollback snapshot's summary (docs/iceberg.md: History and rollback)."""
    removed = [f for c in changes for f in c.removed]
    added = [f for c in changes for f in c.re_added]
    info = {METADATA_PREFIX + k: str(v) for k, v in (metadata or {}).items()}
    info[METADATA_PREFIX + RESTORED_TO] = str(version)
    info[METADATA_PREFIX + FILES_ADDED] = str(len(added))
    info[METADATA_PREFIX + FILES_REMOVED] = str(len(removed))
    for key, files in ((ROWS_ADDED, added), (ROWS_REMOVED, removed)):
        rows = rows_of(files)
        if rows is not None:
            info[METADATA_PREFIX + key] = str(rows)
    info.update({METADATA_PREFIX + k: v for k, v in more.items()})
    return info


def _commit(
    ref: IcebergRef,
    table: Table,
    scope: BooleanExpression,
    changes: Sequence[PartitionChange],
    now: Files,
    then: Files,
    summary: Mapping[str, str],
) -> int:
    """ONE snapshot: each change's removed files deleted, its files of then added back;
    returns its sequence number."""
    removes = [now.data[f.path] for c in changes for f in c.removed]
    adds = [then.data[f.path] for c in changes for f in c.re_added]
    spec = table.metadata.default_spec_id
    other = sorted(f.file_path for f in adds if f.spec_id != spec)
    if other:
        raise UsageError(
            f"cannot roll {ref.uri} back: {len(other)} file(s) to add back were written with "
            f"another partition spec than the table's now ({', '.join(other[:_MAX_LISTED])}). "
            "Nothing was committed"
        )
    tx = table.transaction()
    stage_snapshot(tx, table, scope, removes, adds, summary)
    try:
        done = tx.commit_transaction()
    except (CommitFailedException, ValidationException) as e:
        raise CommitConflict(
            f"rolling back {ref.uri} failed: another writer changed the table meanwhile ({e}). "
            "Nothing was committed; run the rollback again",
            uri=ref.uri,
        ) from e
    snap = done.metadata.current_snapshot()
    summary_now = snap.summary.additional_properties if snap and snap.summary else {}
    if snap is None or METADATA_PREFIX + RESTORED_TO not in summary_now:
        raise CommitConflict(f"the rollback of {ref.uri} is not in the table", uri=ref.uri)
    return int(snap.sequence_number or 0)


def _refuse_problems(ref: IcebergRef, table: Table, version: int, what: str) -> None:
    _gained, problems = restore_schema(ref, table, version)
    if problems:
        raise UsageError(
            f"cannot roll {what} of {ref.uri} back to version {version}: {'; '.join(problems)}. "
            "Nothing was committed; roll back to a later version"
        )


def restore(
    ref: IcebergRef,
    table: Table,
    version: int,
    metadata: Mapping[str, str] | None = None,
    *,
    partitions: Sequence[str] = (),
) -> int:
    """Make ``version``'s files the table's again, every partition, as ONE new snapshot (a
    RESTORE in the history; the schema stays: see the module doc). ``partitions``: the labels
    the caller found it changes (its summary's ``score_catalog.partition``). Returns the new
    version."""
    _refuse_problems(ref, table, version, "the whole table")
    _latest, changes, now, then = _changes(ref, table, version, None)
    changed = [c for c in changes if c.changed]
    _check_re_added(ref, changed, version)
    more = {OPERATION: "RESTORE"}
    if partitions:
        more[PARTITION] = ",".join(partitions)
    summary = _summary(changed, version, metadata, more)
    at = _commit(ref, table, AlwaysTrue(), changed, now, then, summary)
    logger.info("restored %s to version %d as version %d", ref.uri, version, at)
    return at


def restore_partition(
    ref: IcebergRef,
    table: Table,
    version: int,
    partition: Mapping[str, str],
    metadata: Mapping[str, str] | None = None,
) -> int | None:
    """Make ``partition``'s files those of ``version`` again in ONE new snapshot, every other
    partition left as it is; returns its version, or None when they already are (nothing
    committed). Refused, nothing committed (:class:`UsageError`): a version whose columns the
    table can no longer read its files with, and a file to add back that is gone or changed."""
    if not partition:
        raise ValueError("restore_partition needs a partition; restore() rolls the table back")
    label = partition_label(partition)
    _refuse_problems(ref, table, version, label)
    _latest, changes, now, then = _changes(ref, table, version, partition)
    changed = [c for c in changes if c.changed]
    if not changed:
        return None
    _check_re_added(ref, changed, version)
    touched = ",".join(c.label for c in changed)
    summary = _summary(changed, version, metadata, {PARTITION: touched})
    at = _commit(ref, table, partition_filter(partition), changed, now, then, summary)
    logger.info("restored %s of %s to version %d as version %d", label, ref.uri, version, at)
    return at
