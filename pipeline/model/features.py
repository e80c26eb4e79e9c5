"""A shard's columns against the model: the schema check, Arrow -> model inputs, lossy casts.

The schema rule, the same for every shard whatever order they come in: extra columns are
ignored; any integer or floating feature type is cast to a float input's dtype (float32 by
default, so float64 and int64 features score correctly); integer inputs take integer columns,
vocabulary inputs string columns (:mod:`pipeline.model.inputs`); a list feature column must hold
numbers and have the input's width; the id and pass-through columns keep the type they have in
each shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.model import columns, inputs
from pipeline.model.bundle import BundleSpec
from pipeline.model.columns import Part


def data_widths(schema: pa.Schema, spec: BundleSpec) -> tuple[int | None, ...]:
    """Per input, the width ``schema`` gives it where ``model.toml`` leaves it open (see
    :func:`pipeline.model.inputs.data_width`)."""
    return tuple(inputs.data_width(schema, i) for i in spec.inputs)


def check_schema(
    schema: pa.Schema,
    spec: BundleSpec,
    *,
    widths: tuple[int, ...],
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
    seen: set[str] = set()
    for inp, width in zip(spec.inputs, widths, strict=True):
        for p in inputs.schema_problems(schema, inp, width, names, ambiguous, shard):
            if p not in seen:  # a column two inputs read is reported once
                seen.add(p)
                problems.append(p)
    return problems


@dataclass(frozen=True)
class LossyCast:
    """A feature column whose values change when cast to float32 for the model."""

    from_type: str  # the column's Arrow type in the shard, e.g. "int64"
    value: float  # the first value in the shard that changed ...
    as_float32: float  # ... and what the model saw instead


@dataclass
class Features:
    """A batch's model inputs (one array per declared input) and which rows are usable."""

    xs: list[np.ndarray]  # per input: (rows, width) or (rows,), C-contiguous, its dtype
    valid: np.ndarray  # (rows,) bool: no null, NaN, infinite, unknown or out-of-range value
    reasons: list[str] | None  # one per invalid row, in row order (None when all valid)


def _combine(parts: list[Part], rows: int) -> Features:
    """One :class:`Features` from each input's part: a row is valid when every input is."""
    xs = [p.x for p in parts]
    bad = [p for p in parts if p.bad is not None]
    if not bad:
        return Features(xs, np.ones(rows, dtype=bool), None)
    invalid = np.zeros(rows, dtype=bool)
    for p in bad:
        invalid |= p.bad
    # Reasons are built only for the (rare) invalid rows, so per-row Python is fine here.
    reasons = [
        "; ".join(p.why(int(i)) for p in bad if p.bad[i])  # type: ignore[index]
        for i in np.flatnonzero(invalid)
    ]
    return Features(xs, ~invalid, reasons)


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
    value beyond float32's exact range, or None when it changes none: an integer above 2**24
    that float32 cannot hold, or a double outside float32's range (overflow to infinity, or a
    nonzero value that becomes 0). A double rounded to float32's 24-bit precision within its
    range is not reported: that is what a float32 model input is, and every double column
    would warn. Vectorised: a min/max test first for integers (the common case, all within
    2**24, costs one pass); nulls are ignored."""
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
    if pa.types.is_floating(t):
        changed = (np.isinf(y) & np.isfinite(x)) | ((y == 0) & (x != 0))
    else:
        changed = y.astype(np.float64) != x.astype(np.float64)
    if not changed.any():
        return None
    i = int(np.flatnonzero(changed)[0])
    return LossyCast(str(t), float(x[i]), float(y[i]))


def lossy_casts(rb: pa.RecordBatch, spec: BundleSpec, skip: Any = ()) -> dict[str, LossyCast]:
    """The columns of ``rb`` (not in ``skip``) feeding a float32 input whose cast to float32
    changes a value (float16 and bfloat16 inputs are declared lossy on purpose)."""
    found: dict[str, LossyCast] = {}
    for inp in spec.inputs:
        if inp.dtype != "float32":
            continue
        for name in inp.source_columns:
            if name in skip or name in found:
                continue
            arr = rb.column(name)
            t = arr.type
            if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
                arr = arr.flatten()
            change = lossy_cast(arr)
            if change is not None:
                found[name] = change
    return found


def to_features(rb: pa.RecordBatch, spec: BundleSpec, widths: tuple[int, ...]) -> Features:
    """Build each input's array for ``rb`` and flag rows the model must not see."""
    parts = [columns.build(rb, i, w) for i, w in zip(spec.inputs, widths, strict=True)]
    return _combine(parts, rb.num_rows)
