"""A run's table made once, or checked against the run's output, evolved and kept at the job's
retentions.

Version 0 is made by delta-rs (``DeltaTable.create``: its protocol, features and metadata) but
published by this tool, with an exclusive create (``pipeline.io.storage.exclusive_create``: a
link of a whole file locally, ``If-None-Match: *`` on S3): delta-rs 1.6.6 lets processes that
create one table at once all "succeed" (measured: of 4 processes released together, 2 or 3
returned, each leaving its own CREATE TABLE version with another table id), where exactly one
must. So delta-rs writes version 0 into a private local folder, and its bytes are published at
the table, by the one run whose create wins; the others find the table made and check it.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable, Schema
from deltalake.transaction import CommitProperties

from pipeline.io import storage
from pipeline.sinks.delta.client import (
    DEFAULT_DELETED_FILE_RETENTION_DAYS,
    DEFAULT_LOG_RETENTION_DAYS,
    WRITER_PROPERTY,
    WRITER_PROPERTY_VALUE,
    TableRef,
    delta_errors,
    hooks,
    open_table,
    prefixed,
    table_exists,
)
from pipeline.sinks.delta.schema import fit, table_schema
from pipeline.sinks.delta.stats import check_partition_values
from pipeline.sinks.tables import METADATA_PREFIX

logger = logging.getLogger(__name__)

_FIRST_COMMIT = "_delta_log/00000000000000000000.json"


def retention_properties(log_days: int, file_days: int) -> dict[str, str]:
    """The table properties of the job's ``[delta]`` retentions."""
    return {
        "delta.logRetentionDuration": f"interval {log_days} days",
        "delta.deletedFileRetentionDuration": f"interval {file_days} days",
    }


def _version_zero(
    ref: TableRef,
    schema: pa.Schema,
    partition_by: Sequence[str],
    configuration: Mapping[str, str],
    metadata: Mapping[str, str],
) -> bytes:
    """Version 0 of a new table as delta-rs writes it, made in a private local folder; its
    commit info names the table, not that folder."""
    with tempfile.TemporaryDirectory(prefix="score-catalog-create-") as tmp:
        DeltaTable.create(
            tmp,
            schema,
            partition_by=list(partition_by) or None,
            configuration=dict(configuration),
            commit_properties=CommitProperties(custom_metadata=prefixed(metadata)),
            # delta-rs checks property names against the ones it knows; ours is one of the
            # table's own (readers ignore names they do not know: deltalake, Polars, DuckDB).
            raise_if_key_not_exists=False,
        )
        lines = (Path(tmp) / _FIRST_COMMIT).read_bytes().splitlines()
    out = []
    for line in lines:
        action = json.loads(line)
        params = action.get("commitInfo", {}).get("operationParameters")
        if isinstance(params, dict) and "location" in params:
            params["location"] = ref.uri
        out.append(json.dumps(action, separators=(",", ":")))
    return ("\n".join(out) + "\n").encode()


def ensure_table(
    ref: TableRef,
    schema: pa.Schema,
    partition_by: Sequence[str],
    *,
    allow_new_columns: bool,
    log_retention_days: int = DEFAULT_LOG_RETENTION_DAYS,
    deleted_file_retention_days: int = DEFAULT_DELETED_FILE_RETENTION_DAYS,
    metadata: Mapping[str, str] | None = None,
) -> bool:
    """Make sure the table exists and fits ``schema`` and ``partition_by``; True if this call
    created it.

    ``schema`` is the run's output schema; partition columns may be in it (as strings) or not:
    the data files never hold them, the table has them last, as strings. A new table gets the
    retention properties and this tool's writer property (see the module doc for how exactly
    one of several creators makes it). On an existing table the partition columns must be the
    same, and so must every column's type; a column the table has and the output lacks is
    refused (its rows would read as null, silently); a new column is refused unless
    ``allow_new_columns``, then added with delta-rs's ADD COLUMN, its own commit before the
    run's (readers see the new column, null, in between). Retentions that differ from the
    table's are set on it (one SET TBLPROPERTIES version).
    """
    if deleted_file_retention_days < log_retention_days:
        raise ValueError(
            "deleted_file_retention_days must be >= log_retention_days: a version whose log "
            "is kept must keep its files, or a rollback to it fails"
        )
    wanted = table_schema(ref, schema, partition_by)
    for col in partition_by:
        check_partition_values({col: "x"})
    if not table_exists(ref):
        configuration = {
            **retention_properties(log_retention_days, deleted_file_retention_days),
            WRITER_PROPERTY: WRITER_PROPERTY_VALUE,
        }
        data = _version_zero(ref, wanted, partition_by, configuration, metadata or {})
        if storage.exclusive_create(ref.location.child(_FIRST_COMMIT), data):
            logger.info("created Delta table %s (partitioned by %s)", ref.uri, list(partition_by))
            return True
    table = open_table(ref)
    added = fit(ref, table, wanted, partition_by, allow_new_columns=allow_new_columns)
    if added:
        _add_columns(ref, table, wanted, added, metadata)
    _keep_retentions(ref, table, log_retention_days, deleted_file_retention_days, metadata)
    return False


def check_table(
    ref: TableRef, schema: pa.Schema, partition_by: Sequence[str], *, allow_new_columns: bool
) -> list[str]:
    """What :func:`ensure_table` would refuse, read only (before a run takes any lock): raises
    :class:`~pipeline.core.errors.TableSchemaError` where the run's output does not fit the
    existing table; returns the columns it would add (none when there is no table yet)."""
    wanted = table_schema(ref, schema, partition_by)
    if not table_exists(ref):
        return []
    return fit(ref, open_table(ref), wanted, partition_by, allow_new_columns=allow_new_columns)


def _keep_retentions(
    ref: TableRef,
    table: DeltaTable,
    log_days: int,
    file_days: int,
    metadata: Mapping[str, str] | None,
) -> None:
    """Set the job's retentions on a table whose properties say otherwise (the job's
    ``[delta]`` table changed since the table was made): one SET TBLPROPERTIES version."""
    want = retention_properties(log_days, file_days)
    have = table.metadata().configuration
    changed = {k: v for k, v in want.items() if have.get(k) != v}
    if not changed:
        return
    with delta_errors(ref, "setting the retention properties of"):
        table.alter.set_table_properties(
            changed, commit_properties=CommitProperties(custom_metadata=prefixed(metadata))
        )
    logger.info(
        "set %s on Delta table %s", ", ".join(f"{k}={v}" for k, v in changed.items()), ref.uri
    )


def _add_columns(
    ref: TableRef,
    table: DeltaTable,
    wanted: pa.Schema,
    added: list[str],
    metadata: Mapping[str, str] | None,
) -> None:
    fields = [f for f in Schema.from_arrow(wanted).fields if f.name in added]
    info = {**prefixed(metadata), METADATA_PREFIX + "added_columns": ",".join(added)}
    with delta_errors(ref, "adding columns to"):
        table.alter.add_columns(
            fields,
            commit_properties=CommitProperties(custom_metadata=info),
            post_commithook_properties=hooks(),
        )
    logger.info("added column(s) %s to Delta table %s", ", ".join(added), ref.uri)
