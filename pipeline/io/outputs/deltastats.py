"""The worker side of a Delta table commit: per-file statistics from the Parquet footer, and the
record of one written file that a worker sends to the driver.

pyarrow only, on purpose: this module is imported by Dask workers, which are forked from the
driver (``pipeline.driver.cluster``), and a forked process that calls ``deltalake`` after its parent
has used it dies with a Rust panic (its tokio runtime does not survive a fork). Only the driver
imports ``deltalake`` (:mod:`pipeline.io.outputs.deltatable`).

Statistics are what Delta readers skip files with: deltalake, Polars and DuckDB all return no row
from a file whose ``maxValues`` is below a filter, whatever the file holds. So a value written
here must be a true bound of every value in the file, or be left out (a reader then reads the
file). What is left out and why:

- a column where any row group lacks min/max (other than a row group that is all null);
- floating-point min/max unless the writer vouches that the column holds no NaN: Parquet
  writers leave NaN out of their min/max (a file holding 1.0 and NaN has max 1.0 in its
  footer), while Polars orders NaN above every number (its ``score > 2`` returns the NaN
  rows), so such a max is no bound; infinities are left out too (JSON cannot spell them);
- strings longer than :data:`MAX_STRING_STAT_CHARS` characters: Delta's reference writer
  keeps a 32-character prefix of such values (a max that is then below the value, patched
  with a tie-breaker character); leaving them out keeps every bound exact and the log small;
- timestamps without a time zone, binary, boolean, decimal, unsigned integer, and nested (list,
  struct, map) columns: their stats formats or orderings differ between readers, or Delta has
  no such type;
- timestamps with a time zone are kept, rounded outward to the millisecond that Delta stats
  hold (min down, max up), so the bound stays true for microsecond values.

``nullCount`` is exact (summed over row groups) for every top-level non-nested column whose row
groups all carry it; ``numRecords`` is always the footer's row count.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.core.errors import ConfigError

#: Longest string (in characters) whose min/max go into the stats, as Delta's reference writer's
#: 32-character prefix. Longer values are left out rather than truncated (see the module doc).
MAX_STRING_STAT_CHARS = 32

_PARTITION_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
_PARTITION_VALUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_NS_PER_UNIT = {"seconds": 1_000_000_000, "milliseconds": 1_000_000, "microseconds": 1_000}
_NS_PER_UNIT["nanoseconds"] = 1
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


@dataclass(frozen=True)
class NewFile:
    """One data file a worker wrote into the table's folder, not yet in the table.

    Small and picklable: workers return it to the driver, which commits every file of a run in
    one Delta version (:func:`pipeline.io.outputs.deltatable.commit`).
    """

    #: Relative to the table's root, '/'-separated:
    #: ``run_date=2026-12-01/part-00003-<run>.parquet``.
    path: str
    #: Bytes of the file as stored; the driver checks it before committing.
    size: int
    #: Partition column -> value (strings, as Delta stores them); empty for an unpartitioned table.
    partition_values: Mapping[str, str] = field(default_factory=dict)
    #: When it was written, ms since the epoch.
    modification_time: int = 0
    #: The Delta ``stats`` JSON (:func:`file_stats`).
    stats: str = ""
    #: Rows in the file (the footer's count).
    rows: int = 0


def new_file(
    path: str,
    *,
    size: int,
    metadata: pq.FileMetaData,
    partition_values: Mapping[str, str] | None = None,
    nan_free: Collection[str] = (),
    modification_time: int | None = None,
) -> NewFile:
    """The :class:`NewFile` for a file just written: stats and rows from its footer ``metadata``
    (``ParquetWriter.writer.metadata`` after ``close()``, or ``pq.read_metadata``)."""
    return NewFile(
        path=path,
        size=int(size),
        partition_values=dict(partition_values or {}),
        modification_time=int(time.time() * 1000)
        if modification_time is None
        else modification_time,
        stats=file_stats(metadata, nan_free=nan_free),
        rows=int(metadata.num_rows),
    )


def check_partition_values(values: Mapping[str, str]) -> None:
    """Refuse partition names and values that would need escaping in a folder name.

    Readers disagree on escaped partition folders (delta-rs writes ``a%20b`` and logs
    ``a%2520b``; others expect one encoding), and a name starting with ``_`` or ``.`` makes a
    folder that readers and VACUUM treat as not data. Dates and plain words pass.
    """
    for key, value in values.items():
        if not _PARTITION_KEY.match(key):
            raise ConfigError(
                f"partition column {key!r}: a Delta table's partition column names here must "
                "start with a letter and hold only letters, digits and '_'; rename the "
                "template's placeholder key"
            )
        if not isinstance(value, str) or not _PARTITION_VALUE.match(value):
            raise ConfigError(
                f"partition value {value!r} of {key!r}: a Delta table's partition values here "
                "must start with a letter or digit and hold only letters, digits, '.', '_' and "
                "'-' (the folder name then needs no escaping, which readers disagree on)"
            )


def data_file_path(partition_values: Mapping[str, str], name: str) -> str:
    """The path, relative to the table's root, of a data file ``name`` in the partition
    ``partition_values`` (in the table's partition column order): ``k1=v1/k2=v2/name``."""
    check_partition_values(partition_values)
    if "/" in name or name.startswith(("_", ".")) or not name.endswith(".parquet"):
        raise ValueError(f"data file name {name!r}: a plain name ending in .parquet")
    return "/".join([*(f"{k}={v}" for k, v in partition_values.items()), name])


def nan_columns(data: pa.Table | pa.RecordBatch) -> set[str]:
    """The floating-point columns of ``data`` that hold a NaN. A writer collects them over its
    batches and passes the others as ``nan_free`` to :func:`file_stats`."""
    found = set()
    for name, column in zip(data.schema.names, data.columns, strict=True):
        if pa.types.is_floating(column.type) and pc.any(pc.is_nan(column)).as_py():
            found.add(name)
    return found


def file_stats(metadata: pq.FileMetaData, *, nan_free: Collection[str] = ()) -> str:
    """The Delta ``stats`` JSON of a Parquet file, from its footer alone.

    ``nan_free`` names the floating-point columns the writer knows hold no NaN: only those get
    min/max (the footer cannot tell). Everything written is exact or a true bound (module doc).
    """
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for name, typ, leaf in _flat_columns(metadata):
        # Timestamps are folded as their stored integers: exact at any unit, no conversion.
        folded = _fold(metadata, leaf, raw=pa.types.is_timestamp(typ))
        if folded is None:
            continue
        null_count, lo, hi, logical = folded
        nulls[name] = null_count
        if lo is None:
            continue
        bounds = _bounds(typ, lo, hi, logical, nan_free=name in nan_free)
        if bounds is not None:
            mins[name], maxs[name] = bounds
    return json.dumps(
        {"numRecords": metadata.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls},
        separators=(",", ":"),
        allow_nan=False,
    )


def _leaves(typ: pa.DataType) -> int:
    """How many Parquet leaf columns an Arrow type is stored as."""
    if pa.types.is_struct(typ):
        return sum(_leaves(typ.field(i).type) for i in range(typ.num_fields))
    if pa.types.is_map(typ):
        return _leaves(typ.key_type) + _leaves(typ.item_type)
    if pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
        return _leaves(typ.value_type)
    if pa.types.is_list_view(typ) or pa.types.is_large_list_view(typ):
        return _leaves(typ.value_type)
    return 1


def _is_nested(typ: pa.DataType) -> bool:
    return bool(pa.types.is_nested(typ))


def _flat_columns(metadata: pq.FileMetaData) -> list[tuple[str, pa.DataType, int]]:
    """(name, Arrow type, leaf index) of each top-level non-nested column."""
    schema = metadata.schema.to_arrow_schema()
    out = []
    leaf = 0
    for f in schema:
        typ = f.type.value_type if pa.types.is_dictionary(f.type) else f.type
        if not _is_nested(typ):
            if metadata.schema.column(leaf).path != f.name:
                return []  # the leaves are not where the Arrow schema says: trust no column
            out.append((f.name, typ, leaf))
        leaf += _leaves(typ)
    return out


def _fold(metadata: pq.FileMetaData, leaf: int, *, raw: bool) -> tuple[int, Any, Any, Any] | None:
    """Null count, min, max and logical type of one column over all row groups; None when a row
    group lacks a null count. min/max are None when a row group with a non-null value lacks
    them (or no value is non-null). ``raw``: the stored values (``min_raw``), not pyarrow's
    conversion of them."""
    nulls = 0
    lo: Any = None
    hi: Any = None
    complete = True
    logical = None
    for rg in range(metadata.num_row_groups):
        chunk = metadata.row_group(rg).column(leaf)
        st = chunk.statistics
        if st is None or not st.has_null_count:
            return None
        nulls += st.null_count
        if chunk.physical_type == "INT96":
            complete = False  # legacy timestamps: their byte order is not their time order
        if not st.has_min_max:
            if st.null_count != metadata.row_group(rg).num_rows:
                complete = False  # values here, bounds unknown
            continue
        logical = st.logical_type
        a, b = (st.min_raw, st.max_raw) if raw else (st.min, st.max)
        try:
            lo = a if lo is None or a < lo else lo
            hi = b if hi is None or b > hi else hi
        except TypeError:
            complete = False
    if not complete:
        return nulls, None, None, None
    return nulls, lo, hi, logical


def _bounds(
    typ: pa.DataType, lo: Any, hi: Any, logical: Any, *, nan_free: bool
) -> tuple[Any, Any] | None:
    """(min, max) as Delta stats JSON values, or None when they cannot be written safely."""
    if pa.types.is_signed_integer(typ):
        return int(lo), int(hi)
    if pa.types.is_floating(typ):
        ok = nan_free and all(isinstance(v, float) and math.isfinite(v) for v in (lo, hi))
        return (float(lo), float(hi)) if ok else None
    if pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_string_view(typ):
        return _string_bounds(lo, hi)
    if pa.types.is_date(typ):
        ok = isinstance(lo, dt.date) and isinstance(hi, dt.date)
        return (lo.isoformat()[:10], hi.isoformat()[:10]) if ok else None
    if pa.types.is_timestamp(typ) and typ.tz is not None:
        return _timestamp_bounds(lo, hi, logical)
    return None


def _string_bounds(lo: Any, hi: Any) -> tuple[str, str] | None:
    try:
        a = lo.decode("utf-8") if isinstance(lo, bytes) else lo
        b = hi.decode("utf-8") if isinstance(hi, bytes) else hi
    except UnicodeDecodeError:
        return None
    if not (isinstance(a, str) and isinstance(b, str)):
        return None
    if max(len(a), len(b)) > MAX_STRING_STAT_CHARS:
        return None
    return a, b


def _timestamp_bounds(lo: Any, hi: Any, logical: Any) -> tuple[str, str] | None:
    """UTC timestamps as Delta writes them (``2026-12-01T01:02:03.456Z``), min rounded down and
    max rounded up to the millisecond. ``lo``/``hi`` are the stored integers, in the Parquet
    unit (an Arrow ``s`` column is stored in ms): integer arithmetic, no float rounding."""
    try:
        spec = json.loads(logical.to_json())
    except (AttributeError, TypeError, ValueError):
        return None
    per_ns = _NS_PER_UNIT.get(str(spec.get("timeUnit", "")))
    if spec.get("Type") != "Timestamp" or not spec.get("isAdjustedToUTC") or per_ns is None:
        return None
    if not (isinstance(lo, int) and isinstance(hi, int)):
        return None
    lo_ms = (lo * per_ns) // 1_000_000
    hi_ms = -((-hi * per_ns) // 1_000_000)
    try:
        return _iso_ms(lo_ms), _iso_ms(hi_ms)
    except OverflowError:
        return None


def _iso_ms(ms: int) -> str:
    t = _EPOCH + dt.timedelta(milliseconds=ms)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def delta_facts(metadata: pq.FileMetaData, nan_columns: frozenset[str]) -> dict[str, Any]:
    """What a worker sends back of a data file it wrote into a Delta table (the output format's
    ``file_facts``, :data:`pipeline.io.outputs.base.FileFacts`): its rows and its Delta stats,
    the floating-point columns it saw no NaN in vouched NaN-free (:func:`file_stats`)."""
    floats = {name for name, typ, _ in _flat_columns(metadata) if pa.types.is_floating(typ)}
    return {
        "rows": int(metadata.num_rows),
        "stats": file_stats(metadata, nan_free=floats - set(nan_columns)),
    }
