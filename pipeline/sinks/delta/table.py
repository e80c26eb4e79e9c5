"""The driver side of ``format = "delta"``: one Delta table, one commit per run.

Workers write data files into the table's folder as they write Parquet today (staged, atomic),
under names no other run uses, and send back a :class:`~pipeline.sinks.delta.stats.NewFile`
each. None of them is visible to a reader until the driver calls :func:`commit`, which adds them
all, and removes the files they replace, in ONE Delta version carrying the job's app id and run
version (a Delta ``txn``): a retried or resumed run that already committed is refused
(:class:`~pipeline.core.errors.AlreadyCommitted`) instead of applying twice. docs/delta.md describes
the protocol; this module is its only user of ``deltalake`` (delta-rs), and is imported by the
driver only: a forked Dask worker that calls delta-rs after the driver used it panics.

What delta-rs does not check, this module does (each found on deltalake 1.6.6):

- it commits an add whose file is missing, has another size or schema, or lies outside the
  table, and a remove of a file not in the table: :func:`commit` checks every add's footer,
  size and path, and builds removes only from the snapshot it commits on;
- it accepts a repeated or lower app version (delta-rs#2580, #3821): :func:`commit` reads
  ``transaction_version`` from the same table object it then commits from, so the check and
  the commit are one step (delta-rs fails the commit if a commit carrying the same app id
  landed in between); a ``DeltaTable`` object does not advance after its own commit, so every
  call here opens a fresh one;
- two processes creating a table at once both "succeed": :func:`ensure_table` writes version 0
  itself with an exclusive create (``pipeline.io.storage.exclusive_create``), exactly one wins;
- it ignores the schema and partition columns passed with a commit: :func:`ensure_table` and
  :func:`commit` compare them with the table's.
"""

# Over the ~600-line rule on purpose, for now: merged whole from issue 24 while that work goes on
# in another worktree; it splits along its sections (storage options, schema, create, snapshot,
# commit, history, maintenance, partition rollback) when issue 24 puts it behind
# pipeline.sinks.base.
from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import io
import json
import logging
import math
import posixpath
import re
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import fsspec.utils
import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable, Schema
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.transaction import (
    AddAction,
    CommitProperties,
    PostCommitHookProperties,
    RemoveAction,
    Transaction,
)

from pipeline.core import retries, storage_options
from pipeline.core.errors import (
    AlreadyCommitted,
    CommitConflict,
    CommitRefused,
    ConfigError,
    NotATableError,
    PipelineError,
    StorageError,
    TableSchemaError,
    UsageError,
)
from pipeline.core.faults import checkpoint
from pipeline.io import storage
from pipeline.io.storage import Location
from pipeline.sinks.delta.stats import (
    NewFile,
    check_partition_values,
    file_stats,
    stats_problem,
)

logger = logging.getLogger(__name__)

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

#: Prefix of every key this tool writes into a commit's ``commitInfo``.
METADATA_PREFIX = "score_catalog."
# Keys commit() writes itself; a caller's metadata may not use them.
APP_ID = "app_id"
APP_VERSION = "app_version"
PARTITION = "partition"
FILES_ADDED = "files_added"
FILES_REMOVED = "files_removed"
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
# Keys a run is expected to pass (docs/delta.md); history() shows them as fields.
RUN_ID = "run_id"
MODEL_SHA256 = "model_sha256"
SETTINGS_HASH = "settings_hash"
INPUT_FINGERPRINT = "input_fingerprint"
ROWS = "rows"
JOB = "job"
OUTPUTS = "outputs"  # the output columns, comma-separated (drift after a rollback reads them)
RESTORED_TO = "restored_to"
_TOKEN = "token"  # a unique value that lets a restore find its own version afterwards

_FIRST_COMMIT = "_delta_log/00000000000000000000.json"
_ENGINE = "score-catalog"
# Footers of the files a commit adds are read this many at a time: object stores take one
# round trip each; on local disk too (5,000 footers: 2.2 s with 16 threads, 2.9 s with 4, 3.0 s
# in one; medians of 4 alternating runs on a loaded 2-core machine: pyarrow and the file
# system calls release the GIL).
_FOOTER_THREADS = 16
_MAX_LISTED = 10  # problems named in one message
_MAX_SCAN = 200  # commit files read back looking for one commit


# --------------------------------------------------------------------------- where the table is

_S3 = frozenset({"s3", "s3a"})
# fsspec/s3fs options with no delta-rs counterpart that change nothing it does: this tool's
# retry bound, fsspec's caches, botocore's retry settings (delta-rs retries on its own).
_DROPPED = frozenset(
    {
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
    }
)
_DIRECT = {
    "key": "AWS_ACCESS_KEY_ID",
    "secret": "AWS_SECRET_ACCESS_KEY",
    "token": "AWS_SESSION_TOKEN",
    "profile": "AWS_PROFILE",
}
_SECRET_OPTIONS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


# Boolean options: (delta-rs option set to "true", the value of ours that sets it).
_FLAGS = {
    "anon": ("AWS_SKIP_SIGNATURE", True),
    "use_ssl": ("AWS_ALLOW_HTTP", False),
    "requester_pays": ("AWS_REQUEST_PAYER", True),
}


def _s3_options(options: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    out: dict[str, str] = {}
    unknown: list[str] = []
    endpoints: set[str] = set()
    # delta-rs retries each request on its own (10 tries, then up to 180 s by default): bounded
    # by the job's retry deadline, as every fsspec call is (a dead endpoint ends the run about
    # retry_deadline_s after it died, not three minutes per delta-rs call).
    deadline = options.get(
        storage_options.RETRY_DEADLINE_OPTION, storage_options.DEFAULT_RETRY_DEADLINE_S
    )
    out["retry_timeout"] = f"{max(1, math.ceil(float(deadline)))}s"
    for key, value in options.items():
        if key in _DROPPED or key == storage_options.RETRY_DEADLINE_OPTION:
            continue
        if key in _DIRECT:
            if value not in (None, ""):
                out[_DIRECT[key]] = str(value)
        elif key in _FLAGS:
            option, when = _FLAGS[key]
            if _flag(value) == when:
                out[option] = "true"
        elif key == "endpoint_url":
            endpoints.add(str(value))
        elif key == "client_kwargs" and isinstance(value, Mapping):
            unknown += _client_kwargs(value, out, endpoints)
        elif key == "config_kwargs" and isinstance(value, Mapping):
            unknown += _config_kwargs(value, out)
        else:
            unknown.append(key)
    _endpoint(endpoints, out)
    return out, unknown


def _endpoint(endpoints: set[str], out: dict[str, str]) -> None:
    if len(endpoints) > 1:
        raise ConfigError(
            "storage options endpoint_url and client_kwargs.endpoint_url name different "
            "endpoints; keep one"
        )
    for endpoint in endpoints:
        out["AWS_ENDPOINT_URL"] = endpoint
        if endpoint.lower().startswith("http://"):
            out["AWS_ALLOW_HTTP"] = "true"  # delta-rs refuses plain HTTP otherwise


def _client_kwargs(value: Mapping[str, Any], out: dict[str, str], endpoints: set[str]) -> list[str]:
    unknown = []
    for sub, v in value.items():
        if sub == "endpoint_url":
            endpoints.add(str(v))
        elif sub == "region_name":
            out["AWS_REGION"] = str(v)
        else:
            unknown.append(f"client_kwargs.{sub}")
    return unknown


def _config_kwargs(value: Mapping[str, Any], out: dict[str, str]) -> list[str]:
    unknown = []
    for sub, v in value.items():
        if sub == "retries":
            continue  # botocore's retries; delta-rs retries on its own
        if sub == "s3" and isinstance(v, Mapping) and set(v) <= {"addressing_style"}:
            style = str(v.get("addressing_style", "auto"))
            if style in ("path", "virtual"):
                out["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] = "true" if style == "virtual" else "false"
            continue
        unknown.append(f"config_kwargs.{sub}")
    return unknown


def delta_storage_options(uri: str, options: Mapping[str, Any] | None) -> dict[str, str]:
    """The delta-rs ``storage_options`` for the job's fsspec/s3fs-style ``[storage]`` options.

    Local paths need none. For ``s3://``: key, secret, token, profile, endpoint_url (or
    client_kwargs.endpoint_url; an ``http://`` endpoint also sets ``AWS_ALLOW_HTTP``),
    client_kwargs.region_name, anon, use_ssl, requester_pays and config_kwargs.s3's
    addressing_style map to delta-rs's ``AWS_*`` options; ``retry_deadline_s``, fsspec's cache
    options and botocore's retries are dropped. Anything else is a :class:`ConfigError` naming
    the keys (never a value: they may be credentials). What is not given here, delta-rs takes
    from the ``AWS_*`` environment variables, as s3fs does.
    """
    opts = dict(options or {})
    if storage_options.is_local_uri(uri):
        return {}
    proto = fsspec.utils.get_protocol(uri)
    if proto not in _S3:
        raise ConfigError(
            f"output {uri}: a Delta table is written to a local path or s3:// here, not {proto}://"
        )
    out, unknown = _s3_options(opts)
    if unknown:
        raise ConfigError(
            f"storage option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(k) for k in sorted(unknown))} cannot be passed to a Delta table's "
            "object store (delta-rs) for "
            f"{uri}: it takes key, secret, token, profile, endpoint_url, "
            "client_kwargs.endpoint_url, client_kwargs.region_name, anon, use_ssl, "
            "requester_pays and config_kwargs.s3.addressing_style (other AWS_* settings: set "
            "them in the environment)"
        )
    return out


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
        secrets = [self.delta_options.get(k, "") for k in _SECRET_OPTIONS]
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


def _open(ref: TableRef, version: int | None = None) -> DeltaTable:
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


@contextlib.contextmanager
def _delta_errors(ref: TableRef, what: str) -> Iterator[None]:
    """delta-rs's exceptions as this tool's: each names the table, none shows a credential."""
    try:
        yield
    except PipelineError:
        raise
    except CommitFailedError as e:
        raise CommitConflict(
            f"another writer committed to {ref.uri} since this run read it: "
            f"{ref._scrub(str(e))}. Nothing was committed; rerun once the other writer is done",
            uri=ref.uri,
        ) from e
    except TableNotFoundError as e:
        raise NotATableError(
            f"no Delta table at {ref.uri}: {ref._scrub(str(e))}", uri=ref.uri
        ) from e
    except FileNotFoundError as e:
        raise StorageError(
            f"{what} {ref.uri} failed: a data file the table lists is gone ({ref._scrub(str(e))}): "
            "deleted by hand, or by a VACUUM with a retention shorter than the version read",
            uri=ref.uri,
        ) from e
    except (DeltaError, OSError) as e:
        raise StorageError(f"{what} {ref.uri} failed: {ref._scrub(str(e))}", uri=ref.uri) from e


def _hooks() -> PostCommitHookProperties:
    # A checkpoint every 100 commits keeps opening the table fast (without: 4 ms at v10, 66 ms
    # at v300, measured); expired commit JSONs are deleted at a checkpoint, which is what the
    # log retention promises and no more (the retention is >= every rollback window we offer).
    return PostCommitHookProperties(create_checkpoint=True, cleanup_expired_logs=True)


def _prefixed(metadata: Mapping[str, str] | None) -> dict[str, str]:
    out = {}
    for key, value in (metadata or {}).items():
        if not key or key in _OWN_KEYS:
            raise ValueError(f"commit metadata key {key!r} is empty or written by commit() itself")
        out[key if key.startswith(METADATA_PREFIX) else METADATA_PREFIX + key] = str(value)
    return out


def _now_ms() -> int:
    return int(time.time() * 1000)


# --------------------------------------------------------------------------- schema


def _type_problem(name: str, typ: pa.DataType) -> str | None:
    """Why ``typ`` cannot be a Delta column that every reader reads the same, or None."""
    if pa.types.is_dictionary(typ):
        return _type_problem(name, typ.value_type)
    if pa.types.is_nested(typ):
        return _nested_problem(name, typ)
    if pa.types.is_unsigned_integer(typ):
        return f"column {name!r} is {typ}: Delta has no unsigned integers; cast it to int64"
    if pa.types.is_timestamp(typ) and typ.unit != "us":
        tz = f", tz={typ.tz!r}" if typ.tz else ""
        return (
            f"column {name!r} is {typ}: Delta timestamps are microseconds; cast it to "
            f"timestamp('us'{tz})"
        )
    if pa.types.is_fixed_size_binary(typ):
        return f"column {name!r} is {typ}: cast it to binary"
    try:
        Schema.from_arrow(pa.schema([pa.field("x", typ)]))
    except Exception:  # delta-rs raises a bare Exception for a type it has no Delta name for
        return f"column {name!r} is {typ}, which a Delta table cannot hold"
    return None


def _nested_problem(name: str, typ: pa.DataType) -> str | None:
    """:func:`_type_problem` for the children of a struct, map or list."""
    if pa.types.is_struct(typ):
        children = [
            (f"{name}.{typ.field(i).name}", typ.field(i).type) for i in range(typ.num_fields)
        ]
    elif pa.types.is_map(typ):
        children = [(f"{name}.key", typ.key_type), (f"{name}.value", typ.item_type)]
    elif pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
        children = [(f"{name}.element", typ.value_type)]
    else:
        return f"column {name!r} is {typ}, which a Delta table cannot hold"
    for child, child_type in children:
        problem = _type_problem(child, child_type)
        if problem:
            return problem
    return None


def _table_schema(ref: TableRef, schema: pa.Schema, partition_by: Sequence[str]) -> pa.Schema:
    """The table's Arrow schema for a run's ``schema``: its columns (partition columns, which
    the data files do not hold, may be in it as strings or left out) then the partition columns
    as strings; every column nullable (this tool never relies on NOT NULL)."""
    problems = [
        p for f in schema if f.name not in partition_by if (p := _type_problem(f.name, f.type))
    ]
    for col in partition_by:
        i = schema.get_field_index(col)
        if i >= 0 and not pa.types.is_string(schema.field(i).type):
            problems.append(
                f"partition column {col!r} is {schema.field(i).type} in the output; partition "
                "values are strings"
            )
    if len(set(partition_by)) != len(partition_by):
        problems.append(f"partition columns {list(partition_by)} repeat a name")
    if problems:
        raise TableSchemaError(
            f"the Delta table {ref.uri} cannot hold this output: " + "; ".join(problems),
            uri=ref.uri,
        )
    fields = [f.with_nullable(True) for f in schema if f.name not in partition_by]
    fields += [pa.field(col, pa.string(), nullable=True) for col in partition_by]
    return pa.schema(fields)


def _delta_types(schema: Schema | pa.Schema) -> dict[str, Any]:
    """column -> its Delta type as JSON (comparable; nullability left out)."""
    delta = Schema.from_arrow(schema) if isinstance(schema, pa.Schema) else schema
    return {f["name"]: f["type"] for f in json.loads(delta.to_json())["fields"]}


def _schema_changes(
    ref: TableRef, table: DeltaTable, wanted: pa.Schema
) -> tuple[list[str], list[str]]:
    """(columns the run adds, problems: type changes and dropped columns) against the table."""
    have = _delta_types(table.schema())
    want = _delta_types(wanted)
    added = [c for c in want if c not in have]
    problems = []
    for col, typ in want.items():
        if col in have and have[col] != typ:
            problems.append(
                f"column {col!r} is {_type_name(have[col])} in the table and "
                f"{_type_name(typ)} in this run's output"
            )
    dropped = [c for c in have if c not in want]
    if dropped:
        problems.append(
            f"the table has column{'s' if len(dropped) > 1 else ''} "
            f"{', '.join(repr(c) for c in dropped)}, which this run's output lacks"
        )
    return added, problems


def _type_name(typ: Any) -> str:
    return typ if isinstance(typ, str) else json.dumps(typ, separators=(",", ":"))


def _partition_columns(table: DeltaTable) -> list[str]:
    return list(table.metadata().partition_columns)


# --------------------------------------------------------------------------- create once


def _has_ntz(typ: pa.DataType) -> bool:
    if pa.types.is_timestamp(typ):
        return typ.tz is None
    if pa.types.is_dictionary(typ):
        return _has_ntz(typ.value_type)
    if pa.types.is_struct(typ):
        return any(_has_ntz(typ.field(i).type) for i in range(typ.num_fields))
    if pa.types.is_map(typ):
        return _has_ntz(typ.key_type) or _has_ntz(typ.item_type)
    if pa.types.is_nested(typ):
        return _has_ntz(typ.value_type)
    return False


def _first_commit(
    table_schema: pa.Schema,
    partition_by: Sequence[str],
    configuration: Mapping[str, str],
    metadata: Mapping[str, str],
) -> bytes:
    """Version 0: commitInfo, protocol and metaData, no file. Protocol 1/2 (every reader),
    or 3/7 with the ``timestampNtz`` feature when a column is a timestamp without time zone
    (what delta-rs writes for such a table)."""
    now = _now_ms()
    protocol: dict[str, Any] = {"minReaderVersion": 1, "minWriterVersion": 2}
    if any(_has_ntz(f.type) for f in table_schema):
        protocol = {
            "minReaderVersion": 3,
            "minWriterVersion": 7,
            "readerFeatures": ["timestampNtz"],
            "writerFeatures": ["timestampNtz"],
        }
    actions = [
        {
            "commitInfo": {
                "timestamp": now,
                "operation": "CREATE TABLE",
                "operationParameters": {
                    "partitionBy": json.dumps(list(partition_by)),
                    "mode": "ErrorIfExists",
                },
                "engineInfo": _ENGINE,
                **_prefixed(metadata),
            }
        },
        {"protocol": protocol},
        {
            "metaData": {
                "id": str(uuid.uuid4()),
                "name": None,
                "description": None,
                "format": {"provider": "parquet", "options": {}},
                "schemaString": Schema.from_arrow(table_schema).to_json(),
                "partitionColumns": list(partition_by),
                "createdTime": now,
                "configuration": dict(configuration),
            }
        },
    ]
    return "".join(json.dumps(a, separators=(",", ":")) + "\n" for a in actions).encode()


_LOG_ENTRY = re.compile(r"(\d{20}\.(json|checkpoint\b.*)|_last_checkpoint)\Z")


def table_exists(ref: TableRef) -> bool:
    """Whether there is a Delta table at ``ref`` (see :func:`_table_exists`)."""
    return _table_exists(ref)


def _table_exists(ref: TableRef) -> bool:
    """Whether the table has a log: a commit, a checkpoint or ``_last_checkpoint`` in
    ``_delta_log/`` (a creator's leftover temporary file does not count). Not version 0's file
    alone: once commit JSONs past the log retention are cleaned up, it is gone while a
    checkpoint stands in for it, and writing version 0 again there would corrupt the table."""
    try:
        entries = storage.ls(ref.location.child("_delta_log"))
    except FileNotFoundError:
        return False
    return any(_LOG_ENTRY.match(e.name) for e in entries)


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
    the data files never hold them, the table has them last, as strings.

    A new table is created by writing version 0 (protocol, schema, partition columns and the
    retention properties, no file) with an exclusive create: of several runs creating the
    same table at once exactly one does, the others find it made. On an existing table the
    partition columns must be the same, and so must every column's type; a column the table
    has and the output lacks is refused (its rows would read as null, silently); a new column
    is refused unless ``allow_new_columns``, then added with delta-rs's ADD COLUMN, its own
    commit before the run's (readers see the new column, null, in between).
    """
    if deleted_file_retention_days < log_retention_days:
        raise ValueError(
            "deleted_file_retention_days must be >= log_retention_days: a version whose log "
            "is kept must keep its files, or a rollback to it fails"
        )
    table_schema = _table_schema(ref, schema, partition_by)
    for col in partition_by:
        check_partition_values({col: "x"})
    if not _table_exists(ref):
        configuration = {
            **_retention_properties(log_retention_days, deleted_file_retention_days),
            WRITER_PROPERTY: WRITER_PROPERTY_VALUE,
        }
        data = _first_commit(table_schema, partition_by, configuration, metadata or {})
        if storage.exclusive_create(ref.location.child(_FIRST_COMMIT), data):
            logger.info("created Delta table %s (partitioned by %s)", ref.uri, list(partition_by))
            return True
    table = _open(ref)
    added = _fit(ref, table, table_schema, partition_by, allow_new_columns=allow_new_columns)
    if added:
        _add_columns(ref, table, table_schema, added, metadata)
    _keep_retentions(ref, table, log_retention_days, deleted_file_retention_days, metadata)
    return False


def _retention_properties(log_days: int, file_days: int) -> dict[str, str]:
    return {
        "delta.logRetentionDuration": f"interval {log_days} days",
        "delta.deletedFileRetentionDuration": f"interval {file_days} days",
    }


def _keep_retentions(
    ref: TableRef,
    table: DeltaTable,
    log_days: int,
    file_days: int,
    metadata: Mapping[str, str] | None,
) -> None:
    """Set the job's retentions on a table whose properties say otherwise (the job's
    ``[delta]`` table changed since the table was made): one SET TBLPROPERTIES version."""
    want = _retention_properties(log_days, file_days)
    have = table.metadata().configuration
    changed = {k: v for k, v in want.items() if have.get(k) != v}
    if not changed:
        return
    with _delta_errors(ref, "setting the retention properties of"):
        table.alter.set_table_properties(
            changed,
            commit_properties=CommitProperties(custom_metadata=_prefixed(metadata)),
        )
    logger.info(
        "set %s on Delta table %s", ", ".join(f"{k}={v}" for k, v in changed.items()), ref.uri
    )


def check_table(
    ref: TableRef, schema: pa.Schema, partition_by: Sequence[str], *, allow_new_columns: bool
) -> list[str]:
    """What :func:`ensure_table` would refuse, read only (before a run takes any lock): raises
    :class:`TableSchemaError` where the run's output does not fit the existing table; returns
    the columns it would add (none when there is no table yet)."""
    table_schema = _table_schema(ref, schema, partition_by)
    if not _table_exists(ref):
        return []
    return _fit(ref, _open(ref), table_schema, partition_by, allow_new_columns=allow_new_columns)


def _fit(
    ref: TableRef,
    table: DeltaTable,
    table_schema: pa.Schema,
    partition_by: Sequence[str],
    *,
    allow_new_columns: bool,
) -> list[str]:
    """The columns a run's ``table_schema`` adds to ``table``; raises where it does not fit."""
    have = _partition_columns(table)
    if have != list(partition_by):
        raise TableSchemaError(
            f"the Delta table {ref.uri} is partitioned by {have}, this run by "
            f"{list(partition_by)}: write to another table, or change the output template "
            "back",
            uri=ref.uri,
        )
    added, problems = _schema_changes(ref, table, table_schema)
    if problems:
        raise TableSchemaError(
            f"the Delta table {ref.uri} cannot take this run's output: {'; '.join(problems)}. "
            "A Delta table keeps its columns and their types: score into another table (another "
            "output), or change the model's outputs back",
            uri=ref.uri,
        )
    if added and not allow_new_columns:
        raise TableSchemaError(
            f"this run's output adds column{'s' if len(added) > 1 else ''} "
            f"{', '.join(repr(c) for c in added)} to the Delta table {ref.uri}: allow schema "
            "evolution to add them (allow_schema_evolution = true, --allow-schema-evolution; "
            "older rows read them as null), or score into another table",
            uri=ref.uri,
        )
    return added


def _add_columns(
    ref: TableRef,
    table: DeltaTable,
    table_schema: pa.Schema,
    added: list[str],
    metadata: Mapping[str, str] | None,
) -> None:
    fields = [f for f in Schema.from_arrow(table_schema).fields if f.name in added]
    info = {**_prefixed(metadata), METADATA_PREFIX + "added_columns": ",".join(added)}
    with _delta_errors(ref, "adding columns to"):
        table.alter.add_columns(
            fields,
            commit_properties=CommitProperties(custom_metadata=info),
            post_commithook_properties=_hooks(),
        )
    logger.info("added column(s) %s to Delta table %s", ", ".join(added), ref.uri)


# --------------------------------------------------------------------------- snapshot


@dataclass(frozen=True)
class TableFile:
    """A data file in the table at a snapshot."""

    path: str  # relative to the table's root, as in the log
    size: int
    partition_values: Mapping[str, str | None]
    rows: int | None  # numRecords from its stats; None when it has none
    modification_time: int  # ms since the epoch


@dataclass(frozen=True, eq=False)
class Snapshot:
    """The table at one version: its files (of one partition, if asked) and app versions.

    Taken from one ``DeltaTable`` object, so every answer is of the same version.
    """

    uri: str
    version: int
    partition_columns: tuple[str, ...]
    files: tuple[TableFile, ...]
    properties: Mapping[str, str]
    _table: DeltaTable = field(repr=False)

    def transaction_version(self, app_id: str) -> int | None:
        """The app's latest committed run version at this snapshot; None if it never did."""
        return self._table.transaction_version(app_id)

    @property
    def rows(self) -> int | None:
        """Rows in :attr:`files`; None if a file has no row count in its stats."""
        counts = [f.rows for f in self.files]
        return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)


def _files(table: DeltaTable) -> list[TableFile]:
    actions = pa.table(table.get_add_actions(flatten=True))
    cols = set(actions.column_names)
    parts = [c for c in _partition_columns(table) if f"partition.{c}" in cols]
    data = actions.to_pydict()
    out = []
    for i, path in enumerate(data["path"]):
        out.append(
            TableFile(
                path=path,
                size=int(data["size_bytes"][i]),
                partition_values={c: data[f"partition.{c}"][i] for c in parts},
                rows=data["num_records"][i] if "num_records" in cols else None,
                modification_time=int(data["modification_time"][i]),
            )
        )
    return out


def _in_partition(f: TableFile, partition: Mapping[str, str] | None) -> bool:
    return not partition or all(f.partition_values.get(k) == v for k, v in partition.items())


def snapshot(
    ref: TableRef, partition: Mapping[str, str] | None = None, *, version: int | None = None
) -> Snapshot:
    """The table's latest version (or ``version``): its files (only ``partition``'s, if given:
    column -> value) and, through :meth:`Snapshot.transaction_version`, each app's last
    committed run."""
    table = _open(ref, version)
    with _delta_errors(ref, "reading the log of"):
        columns = _partition_columns(table)
        unknown = sorted(set(partition or {}) - set(columns))
        if unknown:
            raise UsageError(
                f"the Delta table {ref.uri} has no partition column {', '.join(unknown)} "
                f"(its partition columns: {columns or 'none'})"
            )
        files = tuple(f for f in _files(table) if _in_partition(f, partition))
        return Snapshot(
            uri=ref.uri,
            version=table.version(),
            partition_columns=tuple(columns),
            files=files,
            properties=dict(table.metadata().configuration),
            _table=table,
        )


# --------------------------------------------------------------------------- commit


def _path_problem(path: str, values: Mapping[str, str], partition_by: Sequence[str]) -> str | None:
    """Why ``path`` cannot be a new data file's path in the table, or None."""
    parts = path.split("/")
    if (
        not path
        or "\\" in path
        or path.startswith("/")
        or ":" in parts[0]
        or any(p in ("", ".", "..") for p in parts)
    ):
        return "not a plain relative path below the table's root"
    if any(p.startswith(("_", ".")) for p in parts) or not path.endswith(".parquet"):
        return "not a data file name (a name starting with '_' or '.', or not ending in .parquet)"
    if set(values) != set(partition_by):
        return (
            f"partition values for {sorted(values)}, the table is partitioned by "
            f"{list(partition_by)}"
        )
    try:
        check_partition_values(values)
    except ConfigError as e:
        return str(e)
    folder = "/".join(f"{c}={values[c]}" for c in partition_by)
    if posixpath.dirname(path) != folder:
        return f"not in its partition's folder {folder or 'the table root'}/"
    return None


def _footer(loc: Location) -> tuple[int, pq.FileMetaData]:
    """(size in bytes, footer) of the file at ``loc``, through pipeline.io.storage."""
    with storage.open_input(loc) as f:
        size = f.seek(0, io.SEEK_END)
        f.seek(0)
        return int(size), pq.ParquetFile(f).metadata


def _file_problem(ref: TableRef, new: NewFile, data_schema: pa.Schema) -> str | None:
    """Why the file ``new`` describes is not what the table may take, or None."""
    try:
        size, footer = _footer(ref.location.child(new.path))
    except FileNotFoundError:
        return "missing (deleted, or never written)"
    except (OSError, pa.ArrowException) as e:
        return f"unreadable: {ref._scrub(str(e))}"
    if size != new.size:
        return f"{size} bytes, the worker reported {new.size}"
    if footer.num_rows != new.rows:
        return f"{footer.num_rows} rows, the worker reported {new.rows}"
    got = footer.schema.to_arrow_schema()
    inside = [c for c in got.names if c in new.partition_values]
    if inside:
        return f"holds the partition column(s) {inside}: the table's log holds their values"
    want = {f.name: f.type for f in data_schema}
    have = {f.name: f.type for f in got}
    diff = [
        f"{c}: {have.get(c, 'missing')} (expected {want.get(c, 'no such column')})"
        for c in sorted(set(want) | set(have))
        if want.get(c) != have.get(c)
    ]
    if diff:
        return "another schema: " + ", ".join(diff)
    return stats_problem(new.stats, footer)


def _add_actions(
    ref: TableRef,
    adds: Sequence[NewFile],
    current: Mapping[str, TableFile],
    removes: Sequence[str],
    partition_by: Sequence[str],
    data_schema: pa.Schema,
) -> list[AddAction]:
    problems: list[str] = []
    seen: set[str] = set()
    replaced = set(removes)
    for new in adds:
        problem = _path_problem(new.path, new.partition_values, partition_by)
        if problem is None and (new.path in current or new.path in seen or new.path in replaced):
            problem = "already in the table or in this commit: every run writes new names"
        seen.add(new.path)
        if problem:
            problems.append(f"{new.path!r}: {problem}")
    if not problems and adds:
        with ThreadPoolExecutor(min(_FOOTER_THREADS, len(adds))) as pool:
            found = pool.map(lambda n: _file_problem(ref, n, data_schema), adds)
            problems = [f"{n.path}: {p}" for n, p in zip(adds, found, strict=True) if p]
    if problems:
        shown = "; ".join(problems[:_MAX_LISTED])
        more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
        raise CommitRefused(
            f"refusing to commit to {ref.uri}: {len(problems)} of {len(adds)} file(s) are not "
            f"what the run reported: {shown}{more}. Nothing was committed; rerun the run",
            uri=ref.uri,
        )
    return [
        AddAction(
            path=n.path,
            size=n.size,
            partition_values=dict(n.partition_values),
            modification_time=n.modification_time,
            data_change=True,
            stats=n.stats,
        )
        for n in adds
    ]


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
    now = _now_ms()
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

    On a fresh table object, in this order: refuse with :class:`AlreadyCommitted` when the
    app's committed run version is ``run_version`` or later; check the table's schema is still
    ``expected_schema`` (the run's output; partition columns may be left out); check each add
    (a plain relative path in its partition's folder, present with the stated size and row
    count, its footer's schema the table's minus the partition columns, its stats those of its
    footer); build the removes from that same snapshot (a path not in it means another writer
    changed the table: :class:`CommitConflict`); commit from that same object, so that delta-rs
    fails the commit if another commit with this app id landed since. ``metadata`` (run id,
    model SHA-256, settings hash, input fingerprint, rows ...) goes into the commit info under
    ``score_catalog.``, with the app id and version, the partitions touched and file counts.
    Nothing is committed when any check fails.
    """
    if not app_id or run_version < 0:
        raise ValueError("commit needs an app id and a run version >= 0")
    info = _prefixed(metadata)
    table = _open(ref)
    read_version = table.version()
    done = table.transaction_version(app_id)
    if done is not None and done >= run_version:
        at = _find_version(ref, read_version, 0, _holds_txn(app_id, done))
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
    partition_by = _partition_columns(table)
    table_schema = _table_schema(ref, expected_schema, partition_by)
    added, problems = _schema_changes(ref, table, table_schema)
    if added or problems:
        changes = "; ".join(problems + [f"new column {c!r}" for c in added])
        raise TableSchemaError(
            f"the schema of the Delta table {ref.uri} changed since this run started (a "
            f"rollback or another writer): {changes}. Nothing was committed; rerun",
            uri=ref.uri,
        )
    with _delta_errors(ref, "reading the log of"):
        current = {f.path: f for f in _files(table)}
    remove_actions, rows_removed = _remove_actions(ref, current, removes, read_version)
    data_schema = pa.schema([f for f in table_schema if f.name not in partition_by])
    add_actions = _add_actions(ref, adds, current, removes, partition_by, data_schema)
    info.update(
        {
            METADATA_PREFIX + APP_ID: app_id,
            METADATA_PREFIX + APP_VERSION: str(run_version),
            METADATA_PREFIX + PARTITION: _partition_label(
                adds, [current[p] for p in removes], partition_by
            ),
            METADATA_PREFIX + FILES_ADDED: str(len(adds)),
            METADATA_PREFIX + FILES_REMOVED: str(len(remove_actions)),
            METADATA_PREFIX + ROWS_ADDED: str(sum(n.rows for n in adds)),
        }
    )
    if rows_removed is not None:
        info[METADATA_PREFIX + ROWS_REMOVED] = str(rows_removed)
    properties = CommitProperties(
        custom_metadata=info,
        app_transactions=[Transaction(app_id, run_version, last_updated=_now_ms())],
    )
    try:
        with _delta_errors(ref, "committing to"):
            table.create_write_transaction(
                [*remove_actions, *add_actions],
                mode="append",
                schema=table.schema(),
                partition_by=partition_by or None,
                commit_properties=properties,
                post_commithook_properties=_hooks(),
            )
    except StorageError as e:
        _landed_all_the_same(ref, app_id, run_version, e)
    checkpoint("delta-committed")  # landed; not yet read back
    try:
        return _landed(ref, app_id, run_version, read_version, len(adds), len(remove_actions))
    except StorageError as e:
        raise StorageError(
            f"run version {run_version} of {app_id!r} was committed to {ref.uri}, but reading "
            f"the table back failed: {e}. Readers see this run's scores; the next run records "
            "the commit (it is pending in the manifest) and commits nothing again",
            uri=ref.uri,
        ) from e


def _landed_all_the_same(ref: TableRef, app_id: str, run_version: int, failure: Exception) -> None:
    """The commit call failed on storage: return if the commit landed all the same (the
    request reached the store, its answer was lost), raise saying what is known otherwise.

    The table is read again (:func:`_open`: retried within the run's retry deadline) for the
    app's run version, which only our commit can have set: the run holds the partition's lock.
    """
    try:
        done = _open(ref).transaction_version(app_id)
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


def _landed(
    ref: TableRef, app_id: str, run_version: int, read_version: int, n_add: int, n_rm: int
) -> int:
    """The version our commit landed as: the one after ``read_version`` whose log holds our
    transaction (read back from storage, after a fresh open told how far the log goes)."""
    latest = _open(ref).version()
    at = _find_version(ref, latest, read_version + 1, _holds_txn(app_id, run_version))
    if at is None:
        raise CommitConflict(
            f"committed to {ref.uri}, but no version from {read_version + 1} to {latest} holds "
            f"run version {run_version} of {app_id!r} reading it back",
            uri=ref.uri,
        )
    logger.info(
        "committed %s version %d: %d file(s) added, %d removed (app %s, run version %d)",
        ref.uri,
        at,
        n_add,
        n_rm,
        app_id,
        run_version,
    )
    return at


def version_of(ref: TableRef, app_id: str, run_version: int) -> int | None:
    """The table version holding run version ``run_version`` of ``app_id``; None when the log
    no longer has it (past the log retention) or it never landed."""
    return _find_version(ref, _open(ref).version(), 0, _holds_txn(app_id, run_version))


def _holds_txn(app_id: str, run_version: int) -> Callable[[list[dict[str, Any]]], bool]:
    def match(actions: list[dict[str, Any]]) -> bool:
        return any(
            a.get("txn", {}).get("appId") == app_id and a["txn"].get("version") == run_version
            for a in actions
        )

    return match


def _holds_info(key: str, value: str) -> Callable[[list[dict[str, Any]]], bool]:
    def match(actions: list[dict[str, Any]]) -> bool:
        return any(a.get("commitInfo", {}).get(METADATA_PREFIX + key) == value for a in actions)

    return match


def _find_version(
    ref: TableRef, newest: int, oldest: int, match: Callable[[list[dict[str, Any]]], bool]
) -> int | None:
    """The newest version from ``newest`` down to ``oldest`` (at most :data:`_MAX_SCAN` of
    them) whose commit file ``match``es; None if none does or the log no longer has them.

    Read from the commit files themselves, not ``DeltaTable.history``: delta-rs reads history
    from the newest commit in storage but numbers it from the table object's own version, so
    one commit landing in between shifts every number (seen on S3: version 1 reported as 0).
    """
    for version in range(newest, max(oldest, newest - _MAX_SCAN + 1) - 1, -1):
        try:
            raw = storage.read_bytes(ref.location.child(f"_delta_log/{version:020d}.json"))
        except FileNotFoundError:
            return None  # cleaned up past the log retention, as are all older ones
        if match([json.loads(line) for line in raw.splitlines() if line.strip()]):
            return version
    return None


# --------------------------------------------------------------------------- history


@dataclass(frozen=True)
class VersionInfo:
    """One version of the table, as ``score-catalog history`` shows it."""

    version: int
    timestamp: dt.datetime  # UTC
    operation: str  # WRITE, CREATE TABLE, RESTORE, OPTIMIZE, VACUUM START/END, ADD COLUMN ...
    run_id: str | None
    model_sha256: str | None
    rows: int | None
    partition: str | None
    #: Every ``score_catalog.`` key of the commit, without the prefix.
    metadata: Mapping[str, str]
    #: What a version that is not a run did, in words ("restored version 3").
    detail: str
    engine: str | None


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
        return f"created, partitioned by {params.get('partitionBy', '[]')}"
    return _our_detail(
        {k[len(METADATA_PREFIX) :]: v for k, v in entry.items() if k.startswith(METADATA_PREFIX)}
    )


def _our_detail(ours: Mapping[str, Any]) -> str:
    """:func:`_detail` of a commit of ours: a run's, or a partition's rollback."""
    if RESTORED_TO in ours:  # restore_partition: a WRITE that says what it restored
        return (
            f"restored {ours.get(PARTITION) or '?'} to version {ours[RESTORED_TO]}: "
            f"{ours.get(FILES_ADDED, '?')} file(s) added back, {ours.get(FILES_REMOVED, '?')} "
            "removed"
        )
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
        with _delta_errors(ref, "reading the history of"):
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
    entries = _history(ref, _open(ref), limit)
    out = []
    for e in entries:
        ours = {
            k[len(METADATA_PREFIX) :]: str(v)
            for k, v in e.items()
            if k.startswith(METADATA_PREFIX) and k != METADATA_PREFIX + _TOKEN
        }
        out.append(
            VersionInfo(
                version=int(e["version"]),
                timestamp=dt.datetime.fromtimestamp(
                    int(e.get("timestamp", 0)) / 1000, dt.timezone.utc
                ),
                operation=str(e.get("operation", "")),
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


# --------------------------------------------------------------------------- maintenance

_INTERVAL_PART = re.compile(r"(\d+)\s*(week|day|hour|minute|second)s?", re.IGNORECASE)
_HOURS_PER = {"week": 168.0, "day": 24.0, "hour": 1.0, "minute": 1 / 60, "second": 1 / 3600}


def _interval_hours(text: str | None) -> float | None:
    """Hours of a Delta interval property (``interval 30 days``); None if it is not one."""
    parts = _INTERVAL_PART.findall(text or "")
    if not parts:
        return None
    return sum(int(n) * _HOURS_PER[unit.lower()] for n, unit in parts)


def deleted_file_retention_hours(table_properties: Mapping[str, str]) -> float:
    """The table's ``delta.deletedFileRetentionDuration`` in hours (Delta's default: 168)."""
    hours = _interval_hours(table_properties.get("delta.deletedFileRetentionDuration"))
    return _DELTA_DEFAULT_DELETED_FILE_HOURS if hours is None else hours


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
    table = _open(ref)
    latest = table.version()
    _check_restorable(ref, version, latest)
    token = uuid.uuid4().hex
    info = {**_prefixed(metadata), METADATA_PREFIX + RESTORED_TO: str(version)}
    info[METADATA_PREFIX + _TOKEN] = token
    if partitions:
        info[METADATA_PREFIX + PARTITION] = ",".join(partitions)
    try:
        with _delta_errors(ref, f"restoring version {version} of"):
            table.restore(
                version,
                commit_properties=CommitProperties(custom_metadata=info),
                post_commithook_properties=_hooks(),
            )
    except StorageError as e:
        cause = str(e.__cause__ or e)
        if "missing file" in cause.lower():
            kept = deleted_file_retention_hours(table.metadata().configuration)
            raise UsageError(
                f"cannot restore {ref.uri} to version {version}: files of that version were "
                f"deleted by a VACUUM (kept {kept:g} h after their removal): "
                f"{ref._scrub(cause)}. Restore a later version"
            ) from e
        if "log" in cause.lower() and "segment" in cause.lower():
            raise UsageError(
                f"cannot restore {ref.uri} to version {version}: its log is past the table's "
                f"log retention and was cleaned up ({ref._scrub(cause)})"
            ) from e
        raise
    at = _find_version(ref, _open(ref).version(), latest + 1, _holds_info(_TOKEN, token))
    if at is None:
        raise StorageError(
            f"restored {ref.uri} to version {version}, but cannot find the "
            "RESTORE commit reading it back",
            uri=ref.uri,
        )
    logger.info("restored %s to version %d as version %d", ref.uri, version, at)
    return at


# ------------------------------------------------------------------ rollback of one partition


@dataclass(frozen=True)
class PartitionChange:
    """One partition's data files now and at the version a rollback restores: what
    :func:`restore` (the whole table) or :func:`restore_partition` (this partition) changes."""

    label: str  # run_date=2026-12-01 ('/'-joined for several columns; '' unpartitioned)
    now: tuple[TableFile, ...]
    then: tuple[TableFile, ...]

    @property
    def removed(self) -> tuple[TableFile, ...]:
        """The files it holds now that it did not hold then."""
        then = {f.path for f in self.then}
        return tuple(f for f in self.now if f.path not in then)

    @property
    def re_added(self) -> tuple[TableFile, ...]:
        """The files it held then that it no longer holds."""
        now = {f.path for f in self.now}
        return tuple(f for f in self.then if f.path not in now)

    @property
    def changed(self) -> bool:
        return bool(self.removed or self.re_added)

    @property
    def rows_now(self) -> int | None:
        return _rows_of(self.now)

    @property
    def rows_then(self) -> int | None:
        return _rows_of(self.then)


def _rows_of(files: Sequence[TableFile]) -> int | None:
    counts = [f.rows for f in files]
    return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)


def _label_of(f: TableFile, columns: Sequence[str]) -> str:
    return "/".join(f"{c}={f.partition_values.get(c)}" for c in columns)


def _counted(ref: TableRef, files: Sequence[TableFile]) -> list[TableFile]:
    """``files``, a file without a row count in its stats (another writer's) with its footer's
    (unknown, None, if it is gone: a rollback that needs it says so)."""
    out = []
    for f in files:
        if f.rows is None:
            with contextlib.suppress(FileNotFoundError):
                f = dataclasses.replace(f, rows=_footer(ref.location.child(f.path))[1].num_rows)
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
    changes = [PartitionChange(k, tuple(a), tuple(b)) for k, (a, b) in sorted(groups.items())]
    return now.version, changes


def restore_schema(ref: TableRef, version: int) -> tuple[list[str], list[str]]:
    """(columns the table gained after ``version``, problems): how ``version``'s files fit the
    table's schema now (:func:`_schema_fit`). A whole-table RESTORE drops the gained columns
    again (the schema reverts); a partition's restored files read them as null."""
    return _schema_fit(_open(ref), _open(ref, version), version)


def _schema_fit(now: DeltaTable, then: DeltaTable, version: int) -> tuple[list[str], list[str]]:
    """A column of ``then`` the table no longer has, or has with another type, is a problem:
    the files restored from it would not be read as they were written (their values hidden,
    or unreadable), so a partition rollback to that version is refused."""
    have, had = _delta_types(now.schema()), _delta_types(then.schema())
    gained = [c for c in have if c not in had]
    problems = [
        f"column {c!r} is {_type_name(t)} at version {version} and {_type_name(have[c])} now"
        for c, t in had.items()
        if c in have and have[c] != t
    ]
    lost = [c for c in had if c not in have]
    if lost:
        problems.append(
            f"version {version} has column(s) {', '.join(map(repr, lost))}, which the table "
            "no longer has (a rollback of the whole table reverted its schema since)"
        )
    if _partition_columns(now) != _partition_columns(then):
        problems.append(
            f"the table was partitioned by {_partition_columns(then)} at version {version}, "
            f"by {_partition_columns(now)} now"
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
    table = _open(ref)
    latest = table.version()
    _check_restorable(ref, version, latest)
    label = "/".join(f"{k}={v}" for k, v in partition.items())
    _gained, problems = _schema_fit(table, _open(ref, version), version)
    if problems:
        raise UsageError(
            f"cannot roll {label} of {ref.uri} back to version {version}: "
            f"{'; '.join(problems)}. Nothing was committed; roll the whole table back to that "
            "version instead (its schema reverts with it)"
        )
    with _delta_errors(ref, "reading the log of"):
        columns = _partition_columns(table)
        unknown = sorted(set(partition) - set(columns))
        if unknown:
            raise UsageError(
                f"the Delta table {ref.uri} has no partition column {', '.join(unknown)} "
                f"(its partition columns: {columns or 'none'})"
            )
        now = [f for f in _files(table) if _in_partition(f, partition)]
        then = [f for f in _files(_open(ref, version)) if _in_partition(f, partition)]
    change = PartitionChange(label, tuple(now), tuple(then))
    if not change.changed:
        return None
    _check_re_added(ref, change, table, version)
    # A file another writer added without stats gets its footer's (no float bounds: NaN).
    stats = {
        path: found if found is not None else file_stats(_footer(ref.location.child(path))[1])
        for path, found in _log_stats(ref, version, [f.path for f in change.re_added]).items()
    }
    token = uuid.uuid4().hex
    info = _partition_info(change, columns, version, metadata, token)
    with _delta_errors(ref, f"rolling back {label} of"):
        table.create_write_transaction(
            _partition_actions(change, stats),
            mode="append",
            schema=table.schema(),
            partition_by=columns or None,
            commit_properties=CommitProperties(custom_metadata=info),
            post_commithook_properties=_hooks(),
        )
    at = _find_version(ref, _open(ref).version(), latest + 1, _holds_info(_TOKEN, token))
    if at is None:
        raise StorageError(
            f"rolled {label} of {ref.uri} back to version {version}, but cannot find the "
            "commit reading it back",
            uri=ref.uri,
        )
    logger.info("restored %s of %s to version %d as version %d", label, ref.uri, version, at)
    return at


def _partition_info(
    change: PartitionChange,
    columns: Sequence[str],
    version: int,
    metadata: Mapping[str, str] | None,
    token: str,
) -> dict[str, str]:
    """The commit info of a partition's rollback (docs/delta.md: Commit info)."""
    touched = {_label_of(f, columns) for f in (*change.removed, *change.re_added)}
    info = _prefixed(metadata)
    info.update(
        {
            METADATA_PREFIX + RESTORED_TO: str(version),
            METADATA_PREFIX + PARTITION: ",".join(sorted(touched)),
            METADATA_PREFIX + FILES_ADDED: str(len(change.re_added)),
            METADATA_PREFIX + FILES_REMOVED: str(len(change.removed)),
            METADATA_PREFIX + _TOKEN: token,
        }
    )
    for key, files in ((ROWS_ADDED, change.re_added), (ROWS_REMOVED, change.removed)):
        rows = _rows_of(files)
        if rows is not None:
            info[METADATA_PREFIX + key] = str(rows)
    return info


def _partition_actions(
    change: PartitionChange, stats: Mapping[str, str]
) -> list[AddAction | RemoveAction]:
    """The removes of the files ``change`` takes out, then the adds of those it puts back, each
    as the log had it (``stats``: path -> its stats JSON)."""
    now = _now_ms()
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
    adds = [
        AddAction(
            path=f.path,
            size=f.size,
            partition_values=dict(f.partition_values),
            modification_time=f.modification_time,
            data_change=True,
            stats=stats[f.path],
        )
        for f in change.re_added
    ]
    return removes + adds


def _check_re_added(
    ref: TableRef, change: PartitionChange, table: DeltaTable, version: int
) -> None:
    """Refuse (nothing committed) when a file to add back is gone or no longer the one the log
    lists: delta-rs would commit it anyway, and every reader would then fail on it."""

    def problem(f: TableFile) -> str | None:
        try:
            size = _footer(ref.location.child(f.path))[0]
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
    kept = deleted_file_retention_hours(table.metadata().configuration)
    more = f" (and {len(found) - _MAX_LISTED} more)" if len(found) > _MAX_LISTED else ""
    raise UsageError(
        f"cannot roll {change.label} of {ref.uri} back to version {version}: {len(found)} of "
        f"the {len(files)} file(s) it would add back are gone or changed: "
        f"{'; '.join(found[:_MAX_LISTED])}{more}. A VACUUM deletes removed files "
        f"{kept:g} h after their removal; nothing was committed. Roll the partition back to a "
        "later version (score-catalog history lists them)"
    )


_CHECKPOINT = re.compile(r"(\d{20})\.checkpoint(\.\d{10}\.\d{10})?\.parquet\Z")


def _log_stats(ref: TableRef, version: int, paths: Sequence[str]) -> dict[str, str | None]:
    """path -> the ``stats`` of the add action that put it in the table, for files live at
    ``version``: from the commit files after the newest checkpoint at or before ``version``
    (newest first), then that checkpoint (its add actions are every file live at it). delta-rs
    hands stats back only parsed to the table's types, not as the JSON the log holds."""
    wanted = set(paths)
    found: dict[str, str | None] = {}
    if not wanted:
        return found
    checkpoint, parts = _checkpoint_parts(ref, version)
    oldest = 0 if checkpoint is None else checkpoint + 1
    log = ref.location.child("_delta_log")
    commits = [log.child(f"{v:020d}.json") for v in range(version, oldest - 1, -1)]
    blobs = storage.read_many(commits)
    for loc in commits:
        raw = blobs[loc.uri]
        if isinstance(raw, BaseException):
            raise StorageError(f"reading {loc.uri} failed: {ref._scrub(str(raw))}", uri=ref.uri)
        for line in raw.splitlines():
            add = json.loads(line).get("add") if line.strip() else None
            if add and unquote(add["path"]) in wanted:
                found.setdefault(unquote(add["path"]), add.get("stats"))
    for part in parts:
        if len(found) < len(wanted):
            with storage.open_input(part) as fh:
                adds = pq.read_table(fh, columns=["add"]).column("add").drop_null().to_pylist()
            for add in adds:
                if unquote(add["path"]) in wanted:
                    found.setdefault(unquote(add["path"]), add.get("stats"))
    missing = sorted(wanted - set(found))
    if missing:
        raise StorageError(
            f"the log of {ref.uri} has no add action for {len(missing)} file(s) of version "
            f"{version} ({', '.join(missing[:_MAX_LISTED])}): nothing was committed",
            uri=ref.uri,
        )
    return found


def _checkpoint_parts(ref: TableRef, version: int) -> tuple[int | None, list[Location]]:
    """The newest checkpoint at or before ``version`` (classic or multi-part), and its files."""
    try:
        entries = storage.ls(ref.location.child("_delta_log"))
    except FileNotFoundError:
        return None, []
    found: dict[int, list[Location]] = {}
    for e in entries:
        m = _CHECKPOINT.match(e.name)
        if m and int(m.group(1)) <= version:
            found.setdefault(int(m.group(1)), []).append(e)
    if not found:
        return None, []
    best = max(found)
    return best, found[best]


def vacuum(
    ref: TableRef,
    retention_hours: int | None = None,
    dry_run: bool = True,
    *,
    force: bool = False,
    metadata: Mapping[str, str] | None = None,
) -> list[str]:
    """Delete (or with ``dry_run`` list) the files removed from the table more than
    ``retention_hours`` ago (default: the table's deleted-file retention). Returns their paths.

    A retention shorter than the table's is refused unless ``force``: a rollback to a version
    in that window, or a reader still on one, would find its files gone. Only files the log
    removed are deleted ("lite" vacuum): files no commit ever listed (a run's uncommitted
    output, this tool's control files) are left alone, since an in-flight run's may be among
    them.
    """
    table = _open(ref)
    minimum = deleted_file_retention_hours(table.metadata().configuration)
    hours = math.ceil(minimum) if retention_hours is None else retention_hours
    if hours < 0:
        raise UsageError(f"vacuum of {ref.uri}: a retention of {hours} h is negative")
    if hours < minimum and not force:
        raise UsageError(
            f"vacuum of {ref.uri} with a retention of {hours} h refused: the table keeps removed "
            f"files {minimum:g} h (delta.deletedFileRetentionDuration), the window in which a "
            "rollback, time travel or a long-running reader may still need them. Use the "
            "default, or pass --force to shorten that window (a rollback to, or a reader on, a "
            "version older than the retention then fails)"
        )
    with _delta_errors(ref, "vacuuming"):
        files = table.vacuum(
            retention_hours=hours,
            dry_run=dry_run,
            enforce_retention_duration=hours >= minimum,
            commit_properties=CommitProperties(custom_metadata=_prefixed(metadata)),
            post_commithook_properties=_hooks(),
            full=False,
        )
    return sorted(set(files))


def optimize(
    ref: TableRef,
    partition: Mapping[str, str] | None = None,
    target_size: int | None = None,
    *,
    metadata: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Compact small files (of one partition, if given) into files of about ``target_size``
    bytes (delta-rs's default: 100 MiB): one OPTIMIZE version, no data change for readers.
    Returns delta-rs's metrics (``numFilesAdded``, ``numFilesRemoved`` ...)."""
    table = _open(ref)
    columns = _partition_columns(table)
    unknown = sorted(set(partition or {}) - set(columns))
    if unknown:
        raise UsageError(
            f"the Delta table {ref.uri} has no partition column {', '.join(unknown)} "
            f"(its partition columns: {columns or 'none'})"
        )
    filters = [(k, "=", v) for k, v in (partition or {}).items()] or None
    with _delta_errors(ref, "optimizing"):
        return dict(
            table.optimize.compact(
                partition_filters=filters,
                target_size=target_size,
                commit_properties=CommitProperties(custom_metadata=_prefixed(metadata)),
                post_commithook_properties=_hooks(),
            )
        )


def read(
    ref: TableRef,
    *,
    version: int | None = None,
    partition: Mapping[str, str] | None = None,
    columns: Sequence[str] | None = None,
) -> pa.Table:
    """The table's rows (at ``version``; of ``partition``; ``columns`` only), for checks and
    drift: what any Delta reader sees, typed as the table's schema.

    Read with pyarrow, file by file, from the file list in the log (delta-rs reads only the
    log): none of delta-rs's scans runs in this process. ``to_pyarrow_table`` reads through a
    pyarrow filesystem wrapping delta-rs, and a process that used it aborts at exit
    ("terminate called without an active exception", SIGABRT, 3 to 5 runs in 6 here; delta-rs
    #2184, polars #24169), which would replace the exit code cron reads. Partition values come
    from the log, as every reader takes them; a column a file lacks (added by ``ADD COLUMN``
    after it was written) reads as null, as in every reader.
    """
    snap = snapshot(ref, partition, version=version)
    schema = pa.schema(snap._table.schema().to_arrow())
    wanted = list(columns) if columns is not None else schema.names
    unknown = [c for c in wanted if c not in schema.names]
    if unknown:
        raise UsageError(f"the Delta table {ref.uri} has no column {', '.join(map(repr, unknown))}")
    out_schema = pa.schema([schema.field(c) for c in wanted])
    parts = []
    for f in snap.files:
        with storage.open_input(ref.location.child(f.path)) as fh:
            data = pq.read_table(fh)
        cols = []
        for field_ in out_schema:
            if field_.name in snap.partition_columns:
                value = f.partition_values.get(field_.name)
                cols.append(pa.array([value] * data.num_rows, field_.type))
            elif field_.name in data.column_names:
                cols.append(data.column(field_.name).cast(field_.type))
            else:
                cols.append(pa.nulls(data.num_rows, field_.type))
        parts.append(pa.table(cols, schema=out_schema))
    return pa.concat_tables(parts) if parts else out_schema.empty_table()
