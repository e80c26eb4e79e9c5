"""One run, one Delta version: the run's new files added and the files it replaces removed, with
the run's token (``Transaction(app_id, run_version)``), exactly once.

What delta-rs does not check, :func:`commit` does (each found on deltalake 1.6.6):

- it commits an add whose file is missing, has another size, schema or stats, or lies outside
  the table, and a remove of a file not in the table: every add's footer, size, path and stats
  are checked, and the removes are built from the snapshot the commit is made on;
- it accepts a repeated or lower app version (delta-rs#2580, #3821): the token is read from the
  table object the commit is then made from, and the commit is made with
  ``max_commit_retries=0``, so delta-rs never rebases it onto a commit it did not see: it lands
  as exactly the next version, or fails and this module reads the table again (the token
  checked again) and commits on the new version. So a run knows its version without reading the
  log back, and a retry never lands twice;
- it ignores the schema and partition columns passed with a commit: they are compared with the
  table's first.

A commit call that fails on storage is not taken for "not committed": the table is read again,
within the run's retry deadline, and a token that reached the run's version means the commit
landed and its answer was lost.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.transaction import AddAction, CommitProperties, RemoveAction, Transaction

from pipeline.core.errors import (
    AlreadyCommitted,
    CommitConflict,
    PipelineError,
    StorageError,
    TableSchemaError,
)
from pipeline.core.faults import checkpoint
from pipeline.sinks.delta.checks import add_actions_of
from pipeline.sinks.delta.client import (
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
from pipeline.sinks.delta.log import version_of
from pipeline.sinks.delta.schema import schema_changes, table_schema
from pipeline.sinks.delta.snapshot import table_files
from pipeline.sinks.delta.stats import NewFile
from pipeline.sinks.tables import (
    APP_ID,
    APP_VERSION,
    FILES_ADDED,
    FILES_REMOVED,
    METADATA_PREFIX,
    PARTITION,
    TableFile,
)

logger = logging.getLogger(__name__)

# Footers of the files a commit adds are read this many at a time: object stores take one
# round trip each; on local disk too (5,000 footers: 2.2 s with 16 threads, 2.9 s with 4, 3.0 s
# in one; medians of 4 alternating runs on a loaded 2-core machine: pyarrow and the file
# system calls release the GIL).
_FOOTER_THREADS = 16
_MAX_LISTED = 10  # problems named in one message
#: Commits tried before another writer's commits landing in between fail the run: each retry
#: is a fresh read of the table (runs of other partitions commit at the same moment).
COMMIT_ATTEMPTS = 10


def commit(
    ref: TableRef,
    *,
    adds: Sequence[NewFile],
    removes: Sequence[str],
    app_id: str,
    run_version: int,
    metadata: Mapping[str, str],
    expected_schema: pa.Schema,
) -> int:
    """Commit a run: add ``adds``, remove ``removes`` (paths of files in the table), in ONE
    Delta version that carries ``Transaction(app_id, run_version)``; return that version.

    Each attempt, on a fresh table object: refuse with :class:`AlreadyCommitted` when the app's
    committed run version is ``run_version`` or later; check the table's schema is still
    ``expected_schema`` (the run's output; partition columns may be left out); build the
    removes from that snapshot (a path not in it means another writer changed the partition:
    :class:`CommitConflict`); check each add once (a plain relative path in its partition's
    folder, present with the stated size and row count, its footer's schema the table's minus
    the partition columns, its stats those of its footer); commit (see the module doc).
    ``metadata`` (run id, model SHA-256, settings hash, input fingerprint, rows ...) goes into
    the commit info under ``score_catalog.``, with the token, the partitions touched and file
    counts. Nothing is committed when any check fails.
    """
    if not app_id or run_version < 0:
        raise ValueError("commit needs an app id and a run version >= 0")
    checked = False
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        table = open_table(ref)
        read_version = table.version()
        actions, info = _prepare(
            ref, table, adds, removes, app_id, run_version, expected_schema, check=not checked
        )
        checked = True
        info.update(prefixed(metadata))
        try:
            _write(ref, table, actions, info, app_id, run_version)
        except CommitConflict:
            if attempt == COMMIT_ATTEMPTS:
                raise
            logger.info(
                "another commit landed on %s since version %d: again", ref.uri, read_version
            )
            time.sleep(random.uniform(0.05, 0.2) * attempt)  # runs of other partitions
            continue
        except StorageError as e:
            _landed_all_the_same(ref, app_id, run_version, e)
        checkpoint("delta-committed")  # landed; nothing after it yet
        version = read_version + 1  # max_commit_retries=0: the next version, or no commit
        logger.info(
            "committed %s version %d: %d file(s) added, %d removed (app %s, run version %d)",
            ref.uri,
            version,
            len(adds),
            len(removes),
            app_id,
            run_version,
        )
        return version
    raise AssertionError("unreachable")  # pragma: no cover


def _prepare(
    ref: TableRef,
    table: DeltaTable,
    adds: Sequence[NewFile],
    removes: Sequence[str],
    app_id: str,
    run_version: int,
    expected_schema: pa.Schema,
    *,
    check: bool,
) -> tuple[list[AddAction | RemoveAction], dict[str, str]]:
    """The actions of one attempt, and the commit info they make; raises where the table
    refuses them (see :func:`commit`)."""
    read_version = table.version()
    done = table.transaction_version(app_id)
    if done is not None and done >= run_version:
        at = version_of(ref, app_id, done)
        raise AlreadyCommitted(
            f"{ref.uri} already holds run version {done} of {app_id!r}"
            + (f" (table version {at})" if at is not None else "")
            + f"; run version {run_version} is not committed again",
            uri=ref.uri,
            app_id=app_id,
            run_version=run_version,
            committed_version=done,
            table_version=at,
        )
    partition_by = partition_columns(table)
    wanted = table_schema(ref, expected_schema, partition_by)
    added, problems = schema_changes(ref, table, wanted)
    if added or problems:
        changes = "; ".join(problems + [f"new column {c!r}" for c in added])
        raise TableSchemaError(
            f"the schema of the Delta table {ref.uri} changed since this run started (a "
            f"rollback or another writer): {changes}. Nothing was committed; rerun",
            uri=ref.uri,
        )
    with delta_errors(ref, "reading the log of"):
        current = {f.path: f for f in table_files(table)}
    remove_actions, rows_removed = _remove_actions(ref, current, removes, read_version)
    data_schema = pa.schema([f for f in wanted if f.name not in partition_by])
    add_actions = add_actions_of(ref, adds, current, removes, partition_by, data_schema, check)
    info = {
        METADATA_PREFIX + APP_ID: app_id,
        METADATA_PREFIX + APP_VERSION: str(run_version),
        METADATA_PREFIX + PARTITION: _partition_label(
            adds, [current[p] for p in removes], partition_by
        ),
        METADATA_PREFIX + FILES_ADDED: str(len(adds)),
        METADATA_PREFIX + FILES_REMOVED: str(len(remove_actions)),
        METADATA_PREFIX + ROWS_ADDED: str(sum(n.rows for n in adds)),
    }
    if rows_removed is not None:
        info[METADATA_PREFIX + ROWS_REMOVED] = str(rows_removed)
    return [*remove_actions, *add_actions], info


def _write(
    ref: TableRef,
    table: DeltaTable,
    actions: list[AddAction | RemoveAction],
    info: dict[str, str],
    app_id: str,
    run_version: int,
) -> None:
    properties = CommitProperties(
        custom_metadata=info,
        max_commit_retries=0,
        app_transactions=[Transaction(app_id, run_version, last_updated=now_ms())],
    )
    with delta_errors(ref, "committing to"):
        table.create_write_transaction(
            actions,
            mode="append",
            schema=table.schema(),
            partition_by=partition_columns(table) or None,
            commit_properties=properties,
            post_commithook_properties=hooks(),
        )


def _remove_actions(
    ref: TableRef, current: Mapping[str, TableFile], removes: Sequence[str], version: int
) -> tuple[list[RemoveAction], int | None]:
    """RemoveActions for ``removes``, from the snapshot's own records; the rows they held."""
    gone = sorted({p for p in removes if p not in current})
    if gone:
        raise CommitConflict(
            f"{len(gone)} file(s) this run replaces are no longer in {ref.uri} at version "
            f"{version} ({', '.join(gone[:_MAX_LISTED])}): another writer changed the table "
            "since this run read it. Nothing was committed; rerun",
            uri=ref.uri,
        )
    now = now_ms()
    out = []
    rows: int | None = 0
    for path in dict.fromkeys(removes):
        f = current[path]
        rows = None if rows is None or f.rows is None else rows + f.rows
        out.append(
            RemoveAction(
                path=path,
                data_change=True,
                deletion_timestamp=now,
                size=f.size,
                partition_values=dict(f.partition_values),
            )
        )
    return out, rows


def _partition_label(
    adds: Sequence[NewFile], removed: Sequence[TableFile], partition_by: Sequence[str]
) -> str:
    """The partitions a commit touches, ``run_date=2026-12-01`` (comma-separated)."""
    if not partition_by:
        return ""
    values = [dict(n.partition_values) for n in adds] + [dict(f.partition_values) for f in removed]
    labels = {"/".join(f"{c}={v.get(c)}" for c in partition_by) for v in values}
    return ",".join(sorted(labels))


def _landed_all_the_same(ref: TableRef, app_id: str, run_version: int, failure: Exception) -> None:
    """The commit call failed on storage: return if the commit landed all the same (the
    request reached the store, its answer was lost), raise saying what is known otherwise.

    The table is read again (retried within the run's retry deadline) for the app's run
    version, which only this commit can have set: the run holds the partition's lock.
    """
    try:
        done = open_table(ref).transaction_version(app_id)
    except PipelineError as again:
        raise StorageError(
            f"{failure}; whether the commit landed is unknown: the table could not be read "
            f"again ({again}). It is recorded as pending: the next run reads the table, records "
            "the commit if it landed and commits the run otherwise",
            uri=ref.uri,
        ) from failure
    if done is None or done < run_version:
        raise StorageError(
            f"{failure}. Nothing was committed: the table does not hold run version "
            f"{run_version} of {app_id!r}",
            uri=ref.uri,
        ) from failure
    logger.warning(
        "committing to %s failed (%s), but the table holds run version %d of %s: the commit "
        "landed and its answer was lost",
        ref.uri,
        failure,
        run_version,
        app_id,
    )
