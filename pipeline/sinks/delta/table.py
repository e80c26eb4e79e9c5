"""A Delta table as the rest of this package uses it (and tests do): one import for its modules'
public names. Each lives in the module of its concern: :mod:`.client` (the reference, delta-rs
opened and its errors), :mod:`.options`, :mod:`.schema`, :mod:`.create`, :mod:`.snapshot`,
:mod:`.commit`, :mod:`.log`, :mod:`.history`, :mod:`.restore`, :mod:`.maintenance`, :mod:`.read`.
Only the driver's side imports it: never a Dask worker (see :mod:`.client`)."""

from pipeline.sinks.delta.client import (
    DEFAULT_DELETED_FILE_RETENTION_DAYS,
    DEFAULT_LOG_RETENTION_DAYS,
    WRITER_PROPERTY,
    WRITER_PROPERTY_VALUE,
    TableRef,
    now_ms,
    one_line,
    open_table,
    table_exists,
)
from pipeline.sinks.delta.commit import commit
from pipeline.sinks.delta.create import check_table, ensure_table
from pipeline.sinks.delta.history import history
from pipeline.sinks.delta.log import version_of
from pipeline.sinks.delta.maintenance import optimize, vacuum
from pipeline.sinks.delta.options import delta_storage_options
from pipeline.sinks.delta.read import read
from pipeline.sinks.delta.restore import (
    restore,
    restore_changes,
    restore_partition,
    restore_schema,
)
from pipeline.sinks.delta.snapshot import Snapshot, snapshot
from pipeline.sinks.tables import (
    INPUT_FINGERPRINT,
    JOB,
    METADATA_PREFIX,
    MODEL_SHA256,
    OUTPUTS,
    ROWS,
    RUN_ID,
    SETTINGS_HASH,
    PartitionChange,
    TableFile,
    VersionInfo,
)

__all__ = [
    "DEFAULT_DELETED_FILE_RETENTION_DAYS",
    "DEFAULT_LOG_RETENTION_DAYS",
    "INPUT_FINGERPRINT",
    "JOB",
    "METADATA_PREFIX",
    "MODEL_SHA256",
    "OUTPUTS",
    "ROWS",
    "RUN_ID",
    "SETTINGS_HASH",
    "WRITER_PROPERTY",
    "WRITER_PROPERTY_VALUE",
    "PartitionChange",
    "Snapshot",
    "TableFile",
    "TableRef",
    "VersionInfo",
    "check_table",
    "commit",
    "delta_storage_options",
    "ensure_table",
    "history",
    "now_ms",
    "one_line",
    "open_table",
    "optimize",
    "read",
    "restore",
    "restore_changes",
    "restore_partition",
    "restore_schema",
    "snapshot",
    "table_exists",
    "vacuum",
    "version_of",
]
