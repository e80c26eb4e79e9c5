"""The one door to delta-rs: a table reference, a fresh ``DeltaTable`` (retried within the run's
deadline), delta-rs's errors as this tool's (one line, no credential), and the names this tool
writes into a table (its writer property, its commit-info keys).

Only the driver imports this package's delta-rs modules: a Dask worker forked from a process
that used delta-rs panics when it calls delta-rs itself (its tokio runtime does not survive a
fork). Workers use :mod:`pipeline.sinks.delta.stats` (pyarrow only).
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.transaction import PostCommitHookProperties

from pipeline.core import retries
from pipeline.core.errors import (
    CommitConflict,
    NotATableError,
    PipelineError,
    StorageError,
    UsageError,
)
from pipeline.io import storage
from pipeline.io.storage import Location
from pipeline.sinks.delta.options import SECRET_OPTIONS, delta_storage_options
from pipeline.sinks.tables import (
    APP_ID,
    APP_VERSION,
    FILES_ADDED,
    FILES_REMOVED,
    METADATA_PREFIX,
    PARTITION,
)

#: How long commit JSONs are kept (``delta.logRetentionDuration``): history, time travel and
#: rollback reach back this far. Delta's own default.
DEFAULT_LOG_RETENTION_DAYS = 30
#: How long a file removed from the table is kept before VACUUM may delete it
#: (``delta.deletedFileRetentionDuration``; Delta's default is 7 days). Equal to the log
#: retention, so that every version whose log is kept can still be restored and read: a
#: rollback window of 30 days, not 7.
DEFAULT_DELETED_FILE_RETENTION_DAYS = 30
_DELTA_DEFAULT_DELETED_FILE_HOURS = 168

#: The table property (in version 0's ``metaData.configuration``) that says this tool created
#: the table: a run writes only into tables it created (another writer's table is not its to
#: replace partitions of). Readers ignore properties they do not know (deltalake, Polars and
#: DuckDB checked); RESTORE keeps it (every version's metadata has it).
WRITER_PROPERTY = "score_catalog.writer"
WRITER_PROPERTY_VALUE = "score-catalog"

# Keys commit() writes itself (APP_ID ... FILES_REMOVED: sinks/tables.py, every format's); a
# caller's metadata may not use them.
ROWS_ADDED = "rows_added"
ROWS_REMOVED = "rows_removed"
_OWN_KEYS = frozenset(
    {
        APP_ID,
        APP_VERSION,
        PARTITION,
        FILES_ADDED,
        FILES_REMOVED,
        ROWS_ADDED,
        ROWS_REMOVED,
        "token",
        "restored_to",
    }
)
RESTORED_TO = "restored_to"
OPERATION = "operation"  # what a commit of ours that is not a run's did ("OPTIMIZE")
TOKEN = "token"  # a unique value that lets a restore find its own version afterwards


@dataclass(frozen=True)
class TableRef:
    """A Delta table: ``uri`` as the user wrote it (every message names it), the job's
    fsspec options (for :mod:`pipeline.io.storage`) and their delta-rs translation. The options
    are left out of ``repr``: they may hold credentials."""

    uri: str
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    delta_options: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, uri: str, options: Mapping[str, Any] | None = None) -> TableRef:
        """The table at ``uri`` with the job's ``[storage]`` options (checked here)."""
        opts = dict(options or {})
        return cls(uri, opts, delta_storage_options(uri, opts))

    @functools.cached_property
    def location(self) -> Location:
        """The table's root folder, for :mod:`pipeline.io.storage`."""
        return storage.locate(self.uri, self.storage_options)

    @property
    def table_uri(self) -> str:
        """What delta-rs is given: an absolute path on local disk, else the URI."""
        loc = self.location
        return loc.path if loc.is_local else self.uri.rstrip("/")

    def _scrub(self, text: str) -> str:
        """``text`` (a delta-rs message: :func:`one_line`) with every credential of this
        table's options blanked."""
        text = one_line(text)
        secrets = [self.delta_options.get(k, "") for k in SECRET_OPTIONS]
        secrets += [str(self.storage_options.get(k) or "") for k in ("key", "secret", "token")]
        for s in sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True):
            text = text.replace(s, "***")
        return text


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def one_line(text: str) -> str:
    """A delta-rs error as one plain line, its innermost cause first.

    delta-rs chains its causes over several lines with ANSI colour codes ("Generic
    LocalFileSystem error", then "↳ Unable to copy data to file", then "↳ No space left on
    device (os error 28)"): under ``-q`` that was three lines of cron mail with the cause last,
    and the escape codes went into ``_report.json``. Here: ``No space left on device (os error
    28) (Generic LocalFileSystem error: Unable to copy data to file)``.
    """
    parts = [p.strip().lstrip("↳").strip() for p in _ANSI.sub("", text).splitlines()]
    parts = [p for p in parts if p]
    if len(parts) <= 1:
        return parts[0] if parts else ""
    return f"{parts[-1]} ({': '.join(parts[:-1])})"


def _open_once(ref: TableRef, version: int | None) -> DeltaTable:
    try:
        return DeltaTable(
            ref.table_uri, version=version, storage_options=dict(ref.delta_options) or None
        )
    except TableNotFoundError as e:
        raise NotATableError(
            f"no Delta table at {ref.uri} (no _delta_log/ there): check the path, or write the "
            'table first with format = "delta"',
            uri=ref.uri,
        ) from e
    except DeltaError as e:
        if version is not None and "version" in str(e).lower():
            raise UsageError(
                f"version {version} of the Delta table {ref.uri} cannot be read: "
                f"{ref._scrub(str(e))} (not yet written, or its log is past the log retention)"
            ) from e
        raise StorageError(
            f"opening the Delta table {ref.uri} failed: {ref._scrub(str(e))}", uri=ref.uri
        ) from e
    except OSError as e:  # the object store's (errno None: transient, retried by _open)
        raise OSError(ref._scrub(str(e))) from e


def open_table(ref: TableRef, version: int | None = None) -> DeltaTable:
    """A fresh ``DeltaTable`` at the latest (or the given) version.

    A store that does not answer is retried within the run's retry deadline
    (:mod:`pipeline.core.retries`, one clock per store, shared with every fsspec call on it):
    delta-rs's own object store gives up on a refused connection after 10 quick retries (2-4 s
    measured against a closed port), so without this a blip of a few seconds failed a read that
    every fsspec call around it survived.
    """
    loc = ref.location
    return retries.with_retries(
        lambda: _open_once(ref, version),
        what=f"opening the Delta table {ref.uri}",
        deadline_s=loc.retry_deadline_s,
        store=retries.store_key(loc.fs),
        uri=ref.uri,
    )


def as_pipeline_error(ref: TableRef, what: str, e: Exception) -> Exception:
    """A delta-rs exception as this tool's: it names the table, and shows no credential."""
    if isinstance(e, PipelineError):
        return e
    if isinstance(e, CommitFailedError):
        return CommitConflict(
            f"another writer committed to {ref.uri} since this run read it: "
            f"{ref._scrub(str(e))}. Nothing was committed; rerun once the other writer is done",
            uri=ref.uri,
        )
    if isinstance(e, TableNotFoundError):
        return NotATableError(f"no Delta table at {ref.uri}: {ref._scrub(str(e))}", uri=ref.uri)
    if isinstance(e, FileNotFoundError):
        return StorageError(
            f"{what} {ref.uri} failed: a data file the table lists is gone ({ref._scrub(str(e))}): "
            "deleted by hand, or by a VACUUM with a retention shorter than the version read",
            uri=ref.uri,
        )
    if isinstance(e, (DeltaError, OSError)):
        return StorageError(f"{what} {ref.uri} failed: {ref._scrub(str(e))}", uri=ref.uri)
    return e


@contextlib.contextmanager
def delta_errors(ref: TableRef, what: str) -> Iterator[None]:
    """Raise delta-rs's exceptions inside as this tool's (:func:`as_pipeline_error`)."""
    try:
        yield
    except Exception as e:
        found = as_pipeline_error(ref, what, e)
        if found is e:
            raise
        raise found from e


def hooks() -> PostCommitHookProperties:
    # A checkpoint every 100 commits keeps opening the table fast (without: 4 ms at v10, 66 ms
    # at v300, measured); expired commit JSONs are deleted at a checkpoint, which is what the
    # log retention promises and no more (the retention is >= every rollback window we offer).
    return PostCommitHookProperties(create_checkpoint=True, cleanup_expired_logs=True)


def prefixed(metadata: Mapping[str, str] | None) -> dict[str, str]:
    out = {}
    for key, value in (metadata or {}).items():
        if not key or key in _OWN_KEYS:
            raise ValueError(f"commit metadata key {key!r} is empty or written by commit() itself")
        out[key if key.startswith(METADATA_PREFIX) else METADATA_PREFIX + key] = str(value)
    return out


def now_ms() -> int:
    return int(time.time() * 1000)


def table_exists(ref: TableRef) -> bool:
    """Whether there is a Delta table at ``ref``: delta-rs's own test (a commit, a checkpoint or
    ``_last_checkpoint`` in ``_delta_log/``; a creator's leftover temporary file is not one, nor
    is a log whose old commits a checkpoint replaced missing: both measured on 1.6.6)."""
    opts = dict(ref.delta_options) or None
    with delta_errors(ref, "looking for"):
        return bool(DeltaTable.is_deltatable(ref.table_uri, storage_options=opts))


def partition_columns(table: DeltaTable) -> list[str]:
    return list(table.metadata().partition_columns)
