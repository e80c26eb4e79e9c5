"""One run, one Iceberg snapshot: the run's new data files added and the partition's files it
replaces deleted, in ONE ``overwrite`` snapshot that carries the run's token, exactly once.

pyiceberg 0.12 has no token and no single-snapshot partition replace: its ``overwrite``,
``dynamic_partition_overwrite`` and ``delete`` + ``add_files`` write a delete snapshot and then
an append (the partition reads empty in between), and its commit retries re-apply a transaction
on a newer table, so a token checked before the transaction can land twice (measured:
docs/iceberg.md). So, each attempt on a freshly loaded table:

1. the token: the table property ``score_catalog.txn.<app_id>`` (set by the same commit) at
   ``run_version`` or more means the run committed already: :class:`AlreadyCommitted`;
2. the schema is still the run's; the removes are built from this snapshot (a path no longer
   in it: :class:`CommitConflict`);
3. the adds (checked once: a plain path in the partition's folder, a fresh name, present with
   the size and rows the worker reported, a footer pyiceberg reads as the table's columns)
   become ``DataFile`` objects with the partition given (not inferred from footers, which hold
   no partition column) and statistics from their footers;
4. one transaction: :class:`AssertTokenAbsent` (SQL catalog: checked against the table it
   swaps, on every attempt of pyiceberg's own retries), the txn property, and one
   :class:`LeanOverwrite` snapshot scoped to the partition with the run's summary. The
   producer checks the token again before each of pyiceberg's retries, on the table pyiceberg
   just reloaded to rebase the attempt on (:meth:`LeanOverwrite._validate_concurrency`).

Over a REST catalog the requirement cannot travel (pyiceberg's requirements are a closed union
of the protocol's kinds), so there the token is checked on the very table version each attempt
is built on (step 1, then the producer's check on every retry), and the attempt carries
pyiceberg's own ``assert-ref-snapshot-id`` on ``main``, which the server checks inside its
swap: every commit that sets a token adds a snapshot to ``main``, so a duplicate that lands
after the check moves ``main`` and the server refuses the stale attempt (HTTP 409); pyiceberg
reloads, and the producer finds the token. What is left is docs/iceberg.md's: a change of the
token property without a new snapshot on ``main`` (this tool makes none), or ``main`` moved back
to the same snapshot in between.

A failure whose outcome is unknown (not pyiceberg's "did not land" exceptions) reloads the
table: a token that reached ``run_version`` means it landed and its answer was lost.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import pyarrow.parquet as pq
from pydantic import Field
from pyiceberg.exceptions import CommitFailedException, ValidationException
from pyiceberg.expressions import BooleanExpression
from pyiceberg.io.pyarrow import (
    compute_statistics_plan,
    data_file_statistics_from_parquet_metadata,
    parquet_path_to_id_mapping,
)
from pyiceberg.manifest import DataFile, DataFileContent, FileFormat, ManifestFile
from pyiceberg.schema import Schema
from pyiceberg.table import Table, Transaction
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Operation
from pyiceberg.table.update import ValidatableTableRequirement
from pyiceberg.table.update.snapshot import _OverwriteFiles
from pyiceberg.typedef import Record

from pipeline.core.errors import AlreadyCommitted, CommitConflict, CommitRefused, TableSchemaError
from pipeline.core.faults import checkpoint
from pipeline.io import storage
from pipeline.sinks import tables
from pipeline.sinks.iceberg import catalog
from pipeline.sinks.iceberg.catalog import TXN_PREFIX, IcebergRef
from pipeline.sinks.iceberg.schema import changes, footer_problem
from pipeline.sinks.iceberg.view import (
    committed_run_version,
    data_files,
    landed_as,
    partition_filter,
)
from pipeline.sinks.tables import METADATA_PREFIX

logger = logging.getLogger(__name__)

#: Attempts before other writers' commits landing in between fail the run (each a fresh load).
COMMIT_ATTEMPTS = 10
FOOTER_THREADS = 16  # as for Delta: footers read this many at a time
_MAX_LISTED = 10


@dataclass(frozen=True)
class NewFile:
    """A data file a worker wrote into the partition's folder, not yet in the table."""

    path: str  # relative to the table's root: run_date=2026-12-01/part-0-<hash>-<run>.parquet
    size: int
    rows: int
    nan_columns: tuple[str, ...] = ()  # floating-point columns holding a NaN: no bounds


class TokenAlreadyCommitted(ValidationException):
    """The token is in the table already. A ``ValidationException`` on purpose: pyiceberg
    neither retries it nor deletes anything but the manifests of the attempt."""

    def __init__(self, app_id: str, run_version: int, done: int) -> None:
        super().__init__(f"run version {done} of {app_id!r} is in the table already")
        self.app_id, self.run_version, self.done = app_id, run_version, done


class AssertTokenAbsent(ValidatableTableRequirement):
    """A commit requirement: the app's committed run version is below this run's. The SQL
    catalog (like Glue, Hive and DynamoDB) validates requirements against the table it is about
    to swap, on every attempt; a REST catalog would refuse the unknown type (not used there)."""

    type: Literal["score-catalog-assert-token-absent"] = Field(
        default="score-catalog-assert-token-absent"
    )
    app_id: str
    run_version: int

    # pyiceberg's own requirements override pydantic's deprecated classmethod the same way.
    def validate(self, base_metadata: TableMetadata | None) -> None:  # type: ignore[override]
        if base_metadata is None:
            raise CommitFailedException("the table's metadata is missing")
        done = committed_run_version(base_metadata, self.app_id)
        if done is not None and done >= self.run_version:
            raise TokenAlreadyCommitted(self.app_id, self.run_version, done)


class LeanOverwrite(_OverwriteFiles):
    """pyiceberg's overwrite producer, without the manifests that hold no live file (only the
    deleted entries of earlier overwrites): pyiceberg 0.12 keeps each one, so a table with a run
    per partition per day grew a manifest per run, and its scan planning with it (60 manifests
    after 60 runs; 4 with this). Java's ManifestFilterManager drops them too."""

    #: The run's (app_id, run version): checked before each of pyiceberg's retries.
    token: tuple[str, int] | None = None

    def _validate_concurrency(self) -> None:
        """pyiceberg calls this before each retry, on the table it has just reloaded and is
        about to rebase the attempt on: the token is checked on that very table version
        (``_table``: the transaction's base; its ``table_metadata`` holds this commit's own
        txn property already)."""
        if self.token is not None:
            app_id, run_version = self.token
            done = committed_run_version(self._transaction._table.metadata, app_id)
            if done is not None and done >= run_version:
                raise TokenAlreadyCommitted(app_id, run_version, done)
        super()._validate_concurrency()

    def _existing_manifests(self) -> list[ManifestFile]:
        return [
            m
            for m in super()._existing_manifests()
            if m.has_added_files()
            or m.has_existing_files()
            or m.added_snapshot_id == self._snapshot_id
        ]


def _footer(ref: IcebergRef, new: NewFile) -> tuple[int, pq.FileMetaData] | str:
    loc = ref.location.child(new.path)
    try:
        with storage.open_input(loc) as f:
            meta = pq.ParquetFile(f).metadata
        size = storage.size_of(loc)
    except FileNotFoundError:
        return "missing (deleted, or never written)"
    except OSError as e:
        return f"unreadable: {e}"
    return int(size or 0), meta


def data_file(
    table: Table,
    file_path: str,
    new: NewFile,
    partition: Mapping[str, str],
    meta: pq.FileMetaData,
) -> DataFile:
    """The ``DataFile`` of ``new`` (at ``file_path`` in the table): the partition given (in the
    spec's order), statistics from its footer ``meta`` by column name (the table's name
    mapping), no bounds for columns holding a NaN. A run's files and a compaction's are built
    here alike."""
    schema = table.schema()
    stats = data_file_statistics_from_parquet_metadata(
        parquet_metadata=meta,
        stats_columns=compute_statistics_plan(schema, table.metadata.properties),
        parquet_column_mapping=parquet_path_to_id_mapping(schema),
    )
    for col in new.nan_columns:
        field_id = schema._name_to_id.get(col)
        if field_id is not None:
            stats.column_aggregates.pop(field_id, None)
    return DataFile.from_args(
        content=DataFileContent.DATA,
        file_path=file_path,
        file_format=FileFormat.PARQUET,
        partition=Record(*partition.values()),
        file_size_in_bytes=new.size,
        sort_order_id=None,
        spec_id=table.metadata.default_spec_id,
        equality_ids=None,
        key_metadata=None,
        **stats.to_serialized_dict(),
    )


def _path_problem(path: str, partition: Mapping[str, str], taken: set[str]) -> str | None:
    parts = path.split("/")
    if (
        not path
        or path.startswith("/")
        or ":" in parts[0]
        or any(p in ("", ".", "..") for p in parts)
    ):
        return "not a plain relative path below the table's root"
    if parts[-1].startswith(("_", ".")) or not path.endswith(".parquet"):
        return "not a data file name"
    folder = "/".join(f"{c}={v}" for c, v in partition.items())
    if "/".join(parts[:-1]) != folder:
        return f"not in its partition's folder {folder or 'the table root'}/"
    if path in taken:
        return "already in the table or in this commit: every run writes new names"
    return None


def build_adds(
    ref: IcebergRef,
    table: Table,
    adds: Sequence[NewFile],
    partition: Mapping[str, str],
    current: set[str],
) -> list[DataFile]:
    """The ``DataFile`` of each add, every one checked; :class:`CommitRefused` naming them
    where any is not what its worker reported."""
    problems: list[str] = []
    taken = set(current)
    for new in adds:
        problem = _path_problem(new.path, partition, taken)
        taken.add(new.path)
        if problem:
            problems.append(f"{new.path!r}: {problem}")
    built: list[DataFile] = []
    if not problems and adds:
        with ThreadPoolExecutor(min(FOOTER_THREADS, len(adds))) as pool:
            footers = list(pool.map(lambda n: _footer(ref, n), adds))
        for new, found in zip(adds, footers, strict=True):
            problem = (
                found if isinstance(found, str) else _file_problem(table, new, partition, *found)
            )
            if problem:
                problems.append(f"{new.path}: {problem}")
            elif not isinstance(found, str):
                built.append(data_file(table, ref.file_path(new.path), new, partition, found[1]))
    if problems:
        shown = "; ".join(problems[:_MAX_LISTED])
        more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
        raise CommitRefused(
            f"refusing to commit to {ref.uri}: {len(problems)} of {len(adds)} file(s) are not "
            f"what the run reported: {shown}{more}. Nothing was committed; rerun the run",
            uri=ref.uri,
        )
    return built


def _file_problem(
    table: Table, new: NewFile, partition: Mapping[str, str], size: int, meta: pq.FileMetaData
) -> str | None:
    if size != new.size:
        return f"{size} bytes, the worker reported {new.size}"
    if meta.num_rows != new.rows:
        return f"{meta.num_rows} rows, the worker reported {new.rows}"
    return footer_problem(table.schema(), meta.schema.to_arrow_schema(), list(partition))


def _already(ref: IcebergRef, metadata: TableMetadata, app_id: str, run_version: int) -> None:
    done = committed_run_version(metadata, app_id)
    if done is None or done < run_version:
        return
    at = landed_as(metadata, app_id, done)
    raise AlreadyCommitted(
        f"{ref.uri} already holds run version {done} of {app_id!r}"
        + (f" (snapshot {at[1]}, sequence number {at[0]})" if at is not None else "")
        + f"; run version {run_version} is not committed again",
        uri=ref.uri,
        app_id=app_id,
        run_version=run_version,
        committed_version=done,
        table_version=at[0] if at is not None else None,
    )


@dataclass(frozen=True)
class RunCommit:
    """What one run commits: its files, the ones it replaces, its token and its summary."""

    partition: Mapping[str, str]
    adds: Sequence[NewFile]
    removes: Sequence[str]  # paths relative to the table's root
    app_id: str
    run_version: int
    summary: Mapping[str, str]  # score_catalog. keys (run id, model, rows ...), prefixed here


def _stage(
    table: Table,
    run: RunCommit,
    adds: list[DataFile],
    removes: list[DataFile],
    *,
    requirement: bool = True,
) -> Transaction:
    """The transaction of one attempt (see the module doc, step 4); ``requirement``: stage
    :class:`AssertTokenAbsent` (a catalog that validates requirements in this process)."""
    summary = {METADATA_PREFIX + k: v for k, v in run.summary.items()}
    summary[METADATA_PREFIX + tables.APP_ID] = run.app_id
    summary[METADATA_PREFIX + tables.APP_VERSION] = str(run.run_version)
    summary[METADATA_PREFIX + tables.FILES_ADDED] = str(len(adds))
    summary[METADATA_PREFIX + tables.FILES_REMOVED] = str(len(removes))
    tx = table.transaction()
    if requirement:
        # Staged before the property it guards: _stage validates a new requirement against
        # the metadata with the updates staged so far.
        # A requirement of our own: pyiceberg's union of requirements is closed (SQL only).
        token = AssertTokenAbsent(app_id=run.app_id, run_version=run.run_version)
        tx._stage((), (token,))  # type: ignore[arg-type]
    tx.set_properties({TXN_PREFIX + run.app_id: str(run.run_version)})
    scope = partition_filter(run.partition) if run.partition else None
    stage_snapshot(tx, table, scope, removes, adds, summary, (run.app_id, run.run_version))
    return tx


def stage_snapshot(
    tx: Transaction,
    table: Table,
    scope: BooleanExpression | None,
    removes: Sequence[DataFile],
    adds: Sequence[DataFile],
    summary: Mapping[str, str],
    token: tuple[str, int] | None = None,
) -> None:
    """Stage ONE snapshot in ``tx`` that deletes ``removes`` and adds ``adds`` (a run's, a
    rollback's), its summary ``summary``; ``scope`` (a partition's predicate) limits the
    manifests rewritten and pyiceberg's conflict checks to what it matches: only the files
    given are deleted either way."""
    has_snapshot = tx.table_metadata.snapshot_by_name("main") is not None
    op = Operation.OVERWRITE if has_snapshot else Operation.APPEND
    producer = LeanOverwrite(
        operation=op, transaction=tx, io=table.io, snapshot_properties=dict(summary)
    )
    # A run's token: checked again on the table each pyiceberg retry rebases onto (a rollback
    # carries none).
    producer.token = token
    with producer:
        if scope is not None:
            # Scopes the manifests rewritten and pyiceberg's conflict checks to the partition:
            # only the files given to delete_data_file are deleted.
            producer.delete_by_predicate(scope)
        for f in removes:
            producer.delete_data_file(f)
        for f in adds:
            producer.append_data_file(f)


def _attempt(
    ref: IcebergRef, run: RunCommit, expected: Schema, built: list[DataFile] | None
) -> tuple[Table, list[DataFile], list[DataFile]]:
    """Steps 1-3 on a fresh table: (the table, the adds' DataFiles, the removes')."""
    table = catalog.load(ref)
    if table is None:
        raise CommitConflict(f"the Iceberg table {ref.uri} is gone from its catalog", uri=ref.uri)
    _already(ref, table.metadata, run.app_id, run.run_version)
    gone_columns, problems = changes(table.schema(), expected)
    if gone_columns or problems:
        raise TableSchemaError(
            f"the schema of the Iceberg table {ref.uri} changed since this run started: "
            + "; ".join(problems + [f"column {c!r} is gone" for c in gone_columns])
            + ". Nothing was committed; rerun",
            uri=ref.uri,
        )
    current = data_files(ref, table, run.partition)
    gone = sorted(p for p in run.removes if p not in current)
    if gone:
        raise CommitConflict(
            f"{len(gone)} file(s) this run replaces are no longer in {ref.uri} "
            f"({', '.join(gone[:_MAX_LISTED])}): another writer changed the table since this "
            "run read it. Nothing was committed; rerun",
            uri=ref.uri,
        )
    if built is None:
        built = build_adds(ref, table, run.adds, run.partition, set(current))
    return table, built, [current[p] for p in dict.fromkeys(run.removes)]


def commit(ref: IcebergRef, run: RunCommit, expected: Schema) -> tuple[int, int]:
    """Commit ``run`` as ONE snapshot (see the module doc); returns its (sequence number,
    snapshot id). ``expected``: the table's schema as the run began (a column dropped or
    changed since, by another writer: :class:`TableSchemaError`)."""
    built: list[DataFile] | None = None
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        table, built, removes = _attempt(ref, run, expected, built)
        try:
            tx = _stage(table, run, built, removes, requirement=catalog.is_sql(ref))
            checkpoint("iceberg-before-commit")
            tx.commit_transaction()
        except TokenAlreadyCommitted as e:
            landed = catalog.load(ref)
            if landed is not None:
                _already(ref, landed.metadata, run.app_id, run.run_version)
            raise CommitConflict(str(e), uri=ref.uri) from e
        except (CommitFailedException, ValidationException) as e:
            if attempt == COMMIT_ATTEMPTS:
                raise CommitConflict(
                    f"committing to {ref.uri} failed {attempt} times: {e}", uri=ref.uri
                ) from e
            logger.info("committing to %s: %s; again", ref.uri, e)
            time.sleep(random.uniform(0.05, 0.2) * attempt)
            continue
        except Exception as e:  # the outcome is unknown: the table says
            return _landed_all_the_same(ref, run, e)
        checkpoint("iceberg-committed")
        at = landed_as(tx._table.metadata, run.app_id, run.run_version)
        if at is None:  # pragma: no cover - pyiceberg returned without our snapshot
            raise CommitConflict(f"the commit to {ref.uri} is not in the table", uri=ref.uri)
        logger.info(
            "committed %s snapshot %d (sequence number %d): %d file(s) added, %d removed "
            "(app %s, run version %d)",
            ref.uri,
            at[1],
            at[0],
            len(built),
            len(removes),
            run.app_id,
            run.run_version,
        )
        return at
    raise AssertionError("unreachable")  # pragma: no cover


def _landed_all_the_same(ref: IcebergRef, run: RunCommit, failure: Exception) -> tuple[int, int]:
    """A commit call failed with an unknown outcome: (sequence number, snapshot id) when it
    landed all the same (its answer was lost), the failure raised otherwise."""
    table = catalog.load(ref)
    done = committed_run_version(table.metadata, run.app_id) if table is not None else None
    at = landed_as(table.metadata, run.app_id, run.run_version) if table is not None else None
    if done is None or done < run.run_version or at is None:
        raise failure
    logger.warning(
        "committing to %s failed (%s), but the table holds run version %d of %s: the commit "
        "landed and its answer was lost",
        ref.uri,
        failure,
        run.run_version,
        run.app_id,
    )
    return at
