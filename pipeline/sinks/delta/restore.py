"""A Delta table, or one partition of it, back to an older version: what a rollback changes,
partition by partition (:func:`restore_changes`), the whole table's RESTORE (:func:`restore`,
delta-rs's), and one partition's, which no library offers (:func:`restore_partition`: one
commit that removes the partition's files the version did not hold and adds back, as the log
first had them, the ones it did)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.transaction import AddAction, CommitProperties, RemoveAction

from pipeline.core.errors import StorageError, UsageError
from pipeline.sinks.delta.checks import add_action, footer
from pipeline.sinks.delta.client import (
    RESTORED_TO,
    ROWS_ADDED,
    ROWS_REMOVED,
    TableRef,
    delta_errors,
    hooks,
    now_ms,
    open_table,
    partition_columns,
    prefixed,
)
from pipeline.sinks.delta.log import log_stats
from pipeline.sinks.delta.options import retention_text
from pipeline.sinks.delta.schema import delta_types, type_name
from pipeline.sinks.delta.snapshot import in_partition, snapshot, table_files
from pipeline.sinks.delta.stats import file_stats
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

_FOOTER_THREADS = 16  # footers read at a time (pipeline.sinks.delta.commit says why)
_MAX_LISTED = 10  # files named in one message


def _file_retention(table: DeltaTable) -> str:
    """How long the table keeps removed files, from its property (``interval 30 days``):
    ``30 days``."""
    found = table.metadata().configuration.get("delta.deletedFileRetentionDuration")
    return retention_text(found)


def restore(
    ref: TableRef,
    version: int,
    metadata: Mapping[str, str] | None = None,
    *,
    partitions: Sequence[str] = (),
) -> int:
    """Make ``version``'s content the latest again (Delta RESTORE: a new version that adds
    back its files and removes the later ones; the schema reverts too). App versions are not
    rolled back: a run that was rolled back is not committed again by a retry. ``partitions``
    (the labels the caller found it changes, :func:`restore_changes`) go into the commit info
    as ``score_catalog.partition``, as a run's commit names its own. Returns the new
    version."""
    table = open_table(ref)
    latest = table.version()
    _check_restorable(ref, version, latest)
    info = {**prefixed(metadata), METADATA_PREFIX + RESTORED_TO: str(version)}
    if partitions:
        info[METADATA_PREFIX + PARTITION] = ",".join(partitions)
    try:
        with delta_errors(ref, f"restoring version {version} of"):
            table.restore(
                version,
                # Lands as the next version or not at all (the table lock keeps runs out):
                # its version is known without reading the log back.
                commit_properties=CommitProperties(custom_metadata=info, max_commit_retries=0),
                post_commithook_properties=hooks(),
            )
    except StorageError as e:
        cause = str(e.__cause__ or e)
        if "missing file" in cause.lower():
            kept = _file_retention(table)
            raise UsageError(
                f"cannot restore {ref.uri} to version {version}: files of that version were "
                f"deleted by a VACUUM (it keeps removed files {kept}): "
                f"{ref._scrub(cause)}. Restore a later version"
            ) from e
        if "log" in cause.lower() and "segment" in cause.lower():
            raise UsageError(
                f"cannot restore {ref.uri} to version {version}: its log is past the table's "
                f"log retention and was cleaned up ({ref._scrub(cause)})"
            ) from e
        raise
    at = latest + 1
    logger.info("restored %s to version %d as version %d", ref.uri, version, at)
    return at


def _label_of(f: TableFile, columns: Sequence[str]) -> str:
    return "/".join(f"{c}={f.partition_values.get(c)}" for c in columns)


def _counted(ref: TableRef, files: Sequence[TableFile]) -> list[TableFile]:
    """``files``, a file without a row count in its stats (another writer's) with its footer's
    (unknown, None, if it is gone: a rollback that needs it says so)."""
    out = []
    for f in files:
        if f.rows is None:
            with contextlib.suppress(FileNotFoundError):
                f = dataclasses.replace(f, rows=footer(ref.location.child(f.path))[1].num_rows)
        out.append(f)
    return out


def _check_restorable(ref: TableRef, version: int, latest: int) -> None:
    if not 0 <= version < latest:
        raise UsageError(
            f"cannot restore {ref.uri} to version {version}: the table's versions run from 0 "
            f"to {latest} (the latest; restoring it changes nothing)"
        )


def restore_changes(
    ref: TableRef, version: int, partition: Mapping[str, str] | None = None
) -> tuple[int, list[PartitionChange]]:
    """(the latest version, what rolling the table, or ``partition`` of it, back to ``version``
    changes): every partition holding files now or then, by label, unchanged ones too
    (:attr:`PartitionChange.changed`). Reads the log (and the footer of a file without
    stats), changes nothing."""
    now = snapshot(ref, partition)
    _check_restorable(ref, version, now.version)
    then = snapshot(ref, partition, version=version)
    columns = now.partition_columns
    groups: dict[str, tuple[list[TableFile], list[TableFile]]] = {}
    for f in _counted(ref, now.files):
        groups.setdefault(_label_of(f, columns), ([], []))[0].append(f)
    for f in _counted(ref, then.files):
        groups.setdefault(_label_of(f, columns), ([], []))[1].append(f)
    if partition and not groups:
        _no_such_partition(ref, partition, version, columns)
    changes = [PartitionChange(k, tuple(a), tuple(b)) for k, (a, b) in sorted(groups.items())]
    # A file to add back that is gone fails the rollback: said by the plan, so that a dry run
    # says it too (issue 29 review: the dry run said nothing and the rollback then failed).
    table = None
    for change in changes:
        if change.changed and change.re_added:
            table = table or open_table(ref)
            _check_re_added(ref, change, table, version)
    return now.version, changes


def _no_such_partition(
    ref: TableRef, partition: Mapping[str, str], version: int, columns: Sequence[str]
) -> None:
    """Refuse a partition that holds no files now nor at ``version`` (a typo in its value
    would otherwise be "nothing to roll back", exit 0), naming the partitions there are."""
    label = "/".join(f"{k}={v}" for k, v in partition.items())
    labels = sorted({_label_of(f, columns) for f in snapshot(ref).files})
    shown = ", ".join(labels[:_MAX_LISTED]) + (
        f" (and {len(labels) - _MAX_LISTED} more)" if len(labels) > _MAX_LISTED else ""
    )
    raise UsageError(
        f"the Delta table {ref.uri} has no partition {label}, now or at version {version}: "
        f"check its name (partitions now: {shown or 'none'}; score-catalog history lists the "
        "versions)"
    )


def restore_schema(ref: TableRef, version: int) -> tuple[list[str], list[str]]:
    """(columns the table gained after ``version``, problems): how ``version``'s files fit the
    table's schema now (:func:`_schema_fit`). A whole-table RESTORE drops the gained columns
    again (the schema reverts); a partition's restored files read them as null."""
    return _schema_fit(open_table(ref), open_table(ref, version), version)


def _schema_fit(now: DeltaTable, then: DeltaTable, version: int) -> tuple[list[str], list[str]]:
    """A column of ``then`` the table no longer has, or has with another type, is a problem:
    the files restored from it would not be read as they were written (their values hidden,
    or unreadable), so a partition rollback to that version is refused."""
    have, had = delta_types(now.schema()), delta_types(then.schema())
    gained = [c for c in have if c not in had]
    problems = [
        f"column {c!r} is {type_name(t)} at version {version} and {type_name(have[c])} now"
        for c, t in had.items()
        if c in have and have[c] != t
    ]
    lost = [c for c in had if c not in have]
    if lost:
        problems.append(
            f"version {version} has column(s) {', '.join(map(repr, lost))}, which the table "
            "no longer has (a rollback of the whole table reverted its schema since)"
        )
    if partition_columns(now) != partition_columns(then):
        problems.append(
            f"the table was partitioned by {partition_columns(then)} at version {version}, "
            f"by {partition_columns(now)} now"
        )
    return gained, problems


def restore_partition(
    ref: TableRef,
    version: int,
    partition: Mapping[str, str],
    metadata: Mapping[str, str] | None = None,
) -> int | None:
    """Make ``partition``'s files those of ``version`` again in ONE new version, every other
    partition left as it is; returns that version, or None when they already are (nothing
    committed).

    The commit removes the partition's files that ``version`` did not hold and adds back the
    ones it held that the table no longer does, each with its original size, partition values,
    modification time and stats (from the add action that added it, read from the log), and
    carries no ``txn``: app versions are not rolled back, so a retry of a rolled-back run is
    still refused. Its commit info says what it was: ``score_catalog.restored_to``,
    ``.partition`` (each partition label it changed), file and row counts, and ``metadata``
    (reason, by, runs). Refused, nothing committed (:class:`UsageError`): a version whose
    schema the table cannot read its files with (:func:`_schema_fit`; a column the table
    gained since is fine: null in those rows), and a file to add back that is gone or changed
    (a VACUUM deleted it)."""
    if not partition:
        raise ValueError("restore_partition needs a partition; restore() rolls the table back")
    table = open_table(ref)
    latest = table.version()
    _check_restorable(ref, version, latest)
    label = "/".join(f"{k}={v}" for k, v in partition.items())
    _gained, problems = _schema_fit(table, open_table(ref, version), version)
    if problems:
        raise UsageError(
            f"cannot roll {label} of {ref.uri} back to version {version}: "
            f"{'; '.join(problems)}. Nothing was committed; roll the whole table back to that "
            "version instead (its schema reverts with it)"
        )
    with delta_errors(ref, "reading the log of"):
        columns = partition_columns(table)
        unknown = sorted(set(partition) - set(columns))
        if unknown:
            raise UsageError(
                f"the Delta table {ref.uri} has no partition column {', '.join(unknown)} "
                f"(its partition columns: {columns or 'none'})"
            )
        now = [f for f in table_files(table) if in_partition(f, partition)]
        then = [f for f in table_files(open_table(ref, version)) if in_partition(f, partition)]
    if not now and not then:
        _no_such_partition(ref, partition, version, columns)
    change = PartitionChange(label, tuple(now), tuple(then))
    if not change.changed:
        return None
    _check_re_added(ref, change, table, version)
    # A file another writer added without stats gets its footer's (no float bounds: NaN).
    stats = {
        path: found if found is not None else file_stats(footer(ref.location.child(path))[1])
        for path, found in log_stats(ref, version, [f.path for f in change.re_added]).items()
    }
    info = _partition_info(change, columns, version, metadata)
    with delta_errors(ref, f"rolling back {label} of"):
        table.create_write_transaction(
            _partition_actions(change, stats),
            mode="append",
            schema=table.schema(),
            partition_by=columns or None,
            commit_properties=CommitProperties(custom_metadata=info, max_commit_retries=0),
            post_commithook_properties=hooks(),
        )
    at = latest + 1  # the next version or none: max_commit_retries=0
    logger.info("restored %s of %s to version %d as version %d", label, ref.uri, version, at)
    return at


def _partition_info(
    change: PartitionChange,
    columns: Sequence[str],
    version: int,
    metadata: Mapping[str, str] | None,
) -> dict[str, str]:
    """The commit info of a partition's rollback (docs/delta.md: Commit info)."""
    touched = {_label_of(f, columns) for f in (*change.removed, *change.re_added)}
    info = prefixed(metadata)
    info.update(
        {
            METADATA_PREFIX + RESTORED_TO: str(version),
            METADATA_PREFIX + PARTITION: ",".join(sorted(touched)),
            METADATA_PREFIX + FILES_ADDED: str(len(change.re_added)),
            METADATA_PREFIX + FILES_REMOVED: str(len(change.removed)),
        }
    )
    for key, files in ((ROWS_ADDED, change.re_added), (ROWS_REMOVED, change.removed)):
        rows = rows_of(files)
        if rows is not None:
            info[METADATA_PREFIX + key] = str(rows)
    return info


def _partition_actions(
    change: PartitionChange, stats: Mapping[str, str]
) -> list[AddAction | RemoveAction]:
    """The removes of the files ``change`` takes out, then the adds of those it puts back, each
    as the log had it (``stats``: path -> its stats JSON)."""
    now = now_ms()
    removes: list[AddAction | RemoveAction] = [
        RemoveAction(
            path=f.path,
            data_change=True,
            deletion_timestamp=now,
            size=f.size,
            partition_values=dict(f.partition_values),
        )
        for f in change.removed
    ]
    adds = [add_action(f, stats[f.path]) for f in change.re_added]
    return removes + adds


def _check_re_added(
    ref: TableRef, change: PartitionChange, table: DeltaTable, version: int
) -> None:
    """Refuse (nothing committed) when a file to add back is gone or no longer the one the log
    lists: delta-rs would commit it anyway, and every reader would then fail on it."""

    def problem(f: TableFile) -> str | None:
        try:
            size = footer(ref.location.child(f.path))[0]
        except FileNotFoundError:
            return "missing"
        except (OSError, pa.ArrowException) as e:
            return f"unreadable: {ref._scrub(str(e))}"
        return None if size == f.size else f"{size} bytes, the log says {f.size}"

    files = change.re_added
    with ThreadPoolExecutor(max(1, min(_FOOTER_THREADS, len(files)))) as pool:
        problems = list(pool.map(problem, files))
    found = [f"{f.path} ({p})" for f, p in zip(files, problems, strict=True) if p]
    if not found:
        return
    kept = _file_retention(table)
    more = f" (and {len(found) - _MAX_LISTED} more)" if len(found) > _MAX_LISTED else ""
    raise UsageError(
        f"cannot roll {change.label} of {ref.uri} back to version {version}: {len(found)} of "
        f"the {len(files)} file(s) it would add back are gone or changed: "
        f"{'; '.join(found[:_MAX_LISTED])}{more}: deleted by hand, or by a VACUUM (it deletes "
        f"files {kept} after their removal). Nothing was committed. Roll the partition back "
        "to a later version (score-catalog history lists them)"
    )
