"""Parquet shards: footers, the schema check against the model, and Arrow -> tensor conversion.

The schema rule, the same for every shard whatever order they come in: extra columns are
ignored; any integer or floating feature type is cast to float32 for the model (so float64 and
int64 features score correctly); a list feature column must hold numbers and have the bundle's
width; the id and pass-through columns keep the type they have in each shard.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.errors import ShardError
from pipeline.model import BundleSpec
from pipeline.stats import LossyCast


@dataclass(frozen=True)
class ShardInfo:
    """What a shard's footer says."""

    num_rows: int
    num_row_groups: int
    schema: pa.Schema
    # A hash of the row-group layout and column-chunk statistics (see :func:`footer_hash`): a
    # content signal for resume that costs no I/O beyond the footer already read.
    footer_hash: str = ""


@contextlib.contextmanager
def open_parquet(uri: str, options: Mapping[str, Any] | None = None) -> Iterator[pq.ParquetFile]:
    """Open a shard for streaming.

    ``pre_buffer=False``: pyarrow's default pre-buffering keeps every column chunk it has read,
    so memory would grow with the shard instead of staying at one row group.
    """
    loc = storage.locate(uri, options)
    with contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(storage.open_input(loc))
        except FileNotFoundError as e:
            raise ShardError(f"shard {uri} disappeared: {e}", shard=uri, kind="unreadable") from e
        try:
            pf = pq.ParquetFile(f, pre_buffer=False)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise ShardError(
                f"shard {uri} is unreadable (not a Parquet file, empty, truncated or a corrupt "
                f"footer): {e}",
                shard=uri,
                kind="unreadable",
            ) from e
        yield pf


def read_footer(uri: str, options: Mapping[str, Any] | None = None) -> ShardInfo:
    """Row count, row groups, Arrow schema and :func:`footer_hash` from the footer, without
    reading data."""
    with open_parquet(uri, options) as pf:
        return ShardInfo(
            num_rows=pf.metadata.num_rows,
            num_row_groups=pf.metadata.num_row_groups,
            schema=pf.schema_arrow,
            footer_hash=footer_hash(pf.metadata),
        )


def footer_hash(meta: pq.FileMetaData) -> str:
    """A hash of what a Parquet footer says about the data: per row group its rows and bytes,
    per column chunk its sizes and statistics (min, max, null count where written).

    Size + modification time + row count miss a shard rewritten in place with other values
    (same row count, same size, mtime restored by a copy tool). The statistics change with
    the values in practice, and they are in the footer that planning reads anyway. A rewrite
    with identical layout and identical statistics is still not detected.
    """
    h = hashlib.sha256()
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        h.update(f"rg {rg.num_rows} {rg.total_byte_size}\n".encode())
        for j in range(rg.num_columns):
            col = rg.column(j)
            h.update(
                f"{col.path_in_schema} {col.total_compressed_size} "
                f"{col.total_uncompressed_size} {_stats_text(col.statistics)}\n".encode()
            )
    return h.hexdigest()[:32]


def _stats_text(stats: pq.Statistics | None) -> str:
    if stats is None:
        return "-"
    minmax = f"{stats.min_raw!r} {stats.max_raw!r}" if stats.has_min_max else "-"
    nulls = str(stats.null_count) if stats.has_null_count else "-"
    return f"{minmax} {nulls}"


def _is_number(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t))


def feature_width(schema: pa.Schema, spec: BundleSpec) -> int | None:
    """The per-row width a list input column declares in ``schema`` (None if variable)."""
    if spec.column is None or schema.names.count(spec.column) != 1:
        return None
    t = schema.field(spec.column).type
    return t.list_size if pa.types.is_fixed_size_list(t) else None


def check_schema(
    schema: pa.Schema,
    spec: BundleSpec,
    *,
    width: int,
    id_column: str,
    passthrough: tuple[str, ...],
    shard: str,
) -> list[str]:
    """Every way ``schema`` does not fit the model and the job, as messages naming the column."""
    problems: list[str] = []
    counts: dict[str, int] = {}
    for name in schema.names:
        counts[name] = counts.get(name, 0) + 1
    needed = (id_column, *passthrough, *spec.input_columns)
    for col in dict.fromkeys(needed):
        if counts.get(col, 0) > 1:
            problems.append(
                f"shard {shard}: column {col!r} appears {counts[col]} times; which one to use "
                "is ambiguous"
            )
    # Ambiguous columns are reported above; check the rest by name.
    names = {n for n, k in counts.items() if k == 1}
    ambiguous = {n for n, k in counts.items() if k > 1}
    for col in (id_column, *passthrough):
        if col in ambiguous:
            continue
        if col not in names:
            role = "id column" if col == id_column else "pass-through column"
            problems.append(f"shard {shard}: {role} {col!r} is missing")
    if spec.columns is not None:
        problems += _columns_problems(schema, spec.columns, names, ambiguous, shard)
    elif (spec.column or "") not in ambiguous:
        problems += _list_column_problems(schema, spec.column or "", names, width, shard)
    return problems


def _columns_problems(
    schema: pa.Schema, columns: tuple[str, ...], names: set[str], ambiguous: set[str], shard: str
) -> list[str]:
    """Problems of the named numeric feature columns (ambiguous ones are reported already)."""
    problems = []
    for col in columns:
        if col in ambiguous:
            continue
        if col not in names:
            problems.append(f"shard {shard}: feature column {col!r} is missing")
        elif not _is_number(schema.field(col).type):
            problems.append(
                f"shard {shard}: feature column {col!r} has type {schema.field(col).type}, "
                "which is not numeric (integers and floats are cast to float32)"
            )
    return problems


def _list_column_problems(
    schema: pa.Schema, col: str, names: set[str], width: int, shard: str
) -> list[str]:
    """Problems of the one list feature column."""
    if col not in names:
        return [f"shard {shard}: feature column {col!r} is missing"]
    t = schema.field(col).type
    is_list = pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t)
    if not is_list or not _is_number(t.value_type):
        return [
            f"shard {shard}: feature column {col!r} has type {t}; expected a list of "
            f"{width} numbers"
        ]
    if pa.types.is_fixed_size_list(t) and t.list_size != width:
        return [
            f"shard {shard}: feature column {col!r} holds lists of {t.list_size} values; "
            f"the model takes {width}"
        ]
    return []


@dataclass
class Features:
    """A batch's feature matrix and which rows are usable."""

    x: np.ndarray  # (rows, width) float32, C-contiguous
    valid: np.ndarray  # (rows,) bool: no null, NaN or infinite value
    reasons: list[str] | None  # one per invalid row, in row order (None when all valid)


def _columns_features(rb: pa.RecordBatch, columns: tuple[str, ...]) -> Features:
    cast = [pc.cast(rb.column(c), pa.float32(), safe=False) for c in columns]
    # One copy into a writable row-major float32 matrix (torch refuses read-only Arrow memory);
    # float nulls become NaN, so one isfinite() finds every bad value.
    x = np.column_stack([c.to_numpy(zero_copy_only=False) for c in cast]).astype(
        np.float32, copy=False
    )
    finite = np.isfinite(x)
    valid = np.asarray(finite.all(axis=1))
    if valid.all():
        return Features(x, valid, None)
    # Reasons are built only for the (rare) invalid rows, so per-row Python is fine here.
    nulls = np.column_stack([c.is_null().to_numpy(zero_copy_only=False) for c in cast])
    reasons = []
    for i in np.flatnonzero(~valid):
        bad = []
        for j, name in enumerate(columns):
            if finite[i, j]:
                continue
            if nulls[i, j]:
                bad.append(f"null in {name}")
            elif np.isnan(x[i, j]):
                bad.append(f"NaN in {name}")
            else:
                bad.append(f"infinite value in {name}")
        reasons.append("; ".join(bad))
    return Features(x, valid, reasons)


def _list_features(rb: pa.RecordBatch, column: str, width: int) -> Features:
    arr = rb.column(column)
    n = len(arr)
    lengths = pc.fill_null(pc.list_value_length(arr), -1).to_numpy(zero_copy_only=False)
    right_len = lengths == width
    if pa.types.is_fixed_size_list(arr.type) and arr.null_count == 0:
        # flatten() honours slice offsets (.values does not): zero-copy for float32 lists.
        flat = pc.cast(arr.flatten(), pa.float32()).to_numpy(zero_copy_only=False)
        x = flat.reshape(n, width).copy()  # the single copy: Arrow memory is read-only
    else:
        x = np.full((n, width), np.nan, dtype=np.float32)
        if right_len.any():
            good = arr.filter(pa.array(right_len))
            vals = pc.cast(good.flatten(), pa.float32()).to_numpy(zero_copy_only=False)
            x[right_len] = vals.reshape(-1, width)
    finite = np.isfinite(x).all(axis=1)
    valid: np.ndarray = np.logical_and(finite, right_len)
    if valid.all():
        return Features(np.ascontiguousarray(x), valid, None)
    reasons = []
    for i in np.flatnonzero(~valid):
        if lengths[i] == -1:
            reasons.append(f"null in {column}")
        elif not right_len[i]:
            reasons.append(f"{column} has {lengths[i]} values, expected {width}")
        else:
            reasons.append(f"NaN, null or infinite value in {column}")
    return Features(np.ascontiguousarray(x), valid, reasons)


# --------------------------------------------------------------------------------------------
# Casts to float32 that change values

#: Every integer up to this magnitude is exactly a float32 (a 24-bit significand); above it,
#: float32 holds only every 2nd, 4th, ... integer.
FLOAT32_EXACT_INT = 2**24


def _may_lose(t: pa.DataType) -> bool:
    """Integers wider than 24 bits and doubles may hold values float32 cannot."""
    return bool((pa.types.is_integer(t) and t.bit_width > 24) or pa.types.is_float64(t))


def lossy_cast(arr: pa.Array) -> LossyCast | None:
    """How casting ``arr`` (a numeric column, or a list column's values) to float32 changes a
    value, or None when it changes none. Vectorised: a min/max test first for integers (the
    common case, all within 2**24, costs one pass); nulls are ignored."""
    t = arr.type
    if not _may_lose(t) or len(arr) == arr.null_count:
        return None
    if pa.types.is_integer(t):
        bounds = pc.min_max(arr)
        low, high = bounds["min"].as_py(), bounds["max"].as_py()
        if max(abs(low), abs(high)) <= FLOAT32_EXACT_INT:
            return None
    x = pc.drop_null(arr).to_numpy(zero_copy_only=False)
    with np.errstate(over="ignore"):  # beyond float32's range is a change like any other
        y = x.astype(np.float32)
    changed = y.astype(np.float64) != x.astype(np.float64)
    if pa.types.is_floating(t):
        changed &= ~np.isnan(x)
    if not changed.any():
        return None
    i = int(np.flatnonzero(changed)[0])
    return LossyCast(str(t), float(x[i]), float(y[i]))


def lossy_casts(rb: pa.RecordBatch, spec: BundleSpec, skip: Any = ()) -> dict[str, LossyCast]:
    """The feature columns of ``rb`` (not in ``skip``) whose cast to float32 changes a value."""
    found: dict[str, LossyCast] = {}
    for name in spec.input_columns:
        if name in skip:
            continue
        arr = rb.column(name)
        t = arr.type
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            arr = arr.flatten()
        change = lossy_cast(arr)
        if change is not None:
            found[name] = change
    return found


def to_features(rb: pa.RecordBatch, spec: BundleSpec, width: int) -> Features:
    """Build the (rows, width) float32 matrix for ``rb`` and flag rows the model must not see."""
    if spec.columns is not None:
        return _columns_features(rb, spec.columns)
    return _list_features(rb, spec.column or "", width)
