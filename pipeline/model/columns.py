"""A model input's values from Arrow columns, vectorised: one array per input for a record
batch, the rows that cannot be scored (null, NaN, infinite, unknown or out of range) with the
reason for each, and the tensors the model takes. What an input is, and how ``model.toml``
declares it, is :mod:`pipeline.model.inputs`'s.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from pipeline.model.inputs import (
    DTYPES,
    FLOAT_DTYPES,
    FLOAT_MAX,
    INT32_RANGE,
    INT64_RANGE,
    InputSpec,
)

_NUMPY = {"int64": np.int64, "int32": np.int32, "bool": np.bool_}

Why = Callable[[int], str]


@dataclass
class Part:
    """One input's values for a record batch: ``x`` (rows first), the rows that cannot be
    scored (None: every row can), and the reason for such a row, built on demand."""

    x: np.ndarray
    bad: np.ndarray | None
    why: Why


def _merge_bad(*masks: np.ndarray | None) -> np.ndarray | None:
    out: np.ndarray | None = None
    for m in masks:
        if m is not None and m.any():
            out = m if out is None else out | m
    return out


def _nulls(arr: pa.Array) -> np.ndarray | None:
    """Per row: whether the value is null (None when none is)."""
    if not arr.null_count:
        return None
    return np.asarray(arr.is_null().to_numpy(zero_copy_only=False))


def build(rb: pa.RecordBatch, inp: InputSpec, width: int) -> Part:
    """``inp``'s values for ``rb``, of shape (rows, width) or (rows,) when ``width`` is 0."""
    if inp.columns is not None:
        if inp.dtype in FLOAT_DTYPES:
            return _float_columns(rb, inp)
        return _exact_columns(rb, inp)
    arr = rb.column(inp.column or "")
    if inp.vocabulary is not None:
        return _vocabulary(arr, inp)
    if width == 0:
        return _scalar(arr, inp)
    return _list(arr, inp, width)


def _float_columns(rb: pa.RecordBatch, inp: InputSpec) -> Part:
    columns = inp.columns or ()
    cast = [pc.cast(rb.column(c), pa.float32(), safe=False) for c in columns]
    # One copy into a writable row-major float32 matrix (torch refuses read-only Arrow memory);
    # float nulls become NaN, so one isfinite() finds every bad value.
    x = np.column_stack([c.to_numpy(zero_copy_only=False) for c in cast]).astype(
        np.float32, copy=False
    )
    over = _beyond(x, inp)
    finite = np.isfinite(x) if over is None else np.isfinite(x) & ~over
    if finite.all():
        return Part(x, None, _never)
    nulls = np.column_stack([c.is_null().to_numpy(zero_copy_only=False) for c in cast])
    if inp.fill is not None:
        missing = np.isnan(x)
        x[missing] = inp.fill
        finite |= missing
    bad = ~finite.all(axis=1)

    def why(i: int) -> str:
        out = []
        for j, name in enumerate(columns):
            if finite[i, j]:
                continue
            if nulls[i, j]:
                out.append(f"null in {name}")
            elif np.isnan(x[i, j]):
                out.append(f"NaN in {name}")
            elif over is not None and over[i, j]:
                out.append(f"{name} = {float(x[i, j])!r} is beyond {inp.dtype}'s range")
            else:
                out.append(f"infinite value in {name}")
        return "; ".join(out)

    return Part(x, bad if bool(bad.any()) else None, why)  # type: ignore[arg-type]


def _beyond(x: np.ndarray, inp: InputSpec) -> np.ndarray | None:
    """Finite values a float16 or bfloat16 input cannot hold (they would become infinite when
    cast), or None for float32 and when there are none. A cast from float32 to bfloat16 keeps
    its range, so in practice this is float16's ±65,504."""
    if inp.dtype not in ("float16", "bfloat16"):
        return None
    with np.errstate(invalid="ignore"):
        over: np.ndarray = np.abs(x) > FLOAT_MAX[inp.dtype]
    over &= np.isfinite(x)
    return over if over.any() else None


def _never(i: int) -> str:  # pragma: no cover - only called for rows marked bad
    raise AssertionError(f"row {i} was not marked bad")


def _exact_values(arr: pa.Array, inp: InputSpec, name: str) -> Part:
    """An integer or boolean column (or a list column's values) as ``inp``'s dtype, exactly:
    nulls are filled or rejected; a value the dtype cannot hold (beyond int32 or int64, a
    uint64 above 2**63 - 1, an integer other than 0 or 1 for bool) or an id outside
    ``num_embeddings`` is rejected, named, never wrapped or truncated."""
    nulls = _nulls(arr)
    fill = inp.fill if inp.fill is not None else 0
    # The column's own values (any integer width, signed or not, or bool), compared before any
    # cast, so that nothing wraps around on the way.
    zero = False if pa.types.is_boolean(arr.type) else 0
    values = np.asarray(pc.fill_null(arr, zero).to_numpy(zero_copy_only=False))
    low, high = _id_range(inp)
    outside: np.ndarray | None = None
    if values.size and values.dtype != np.bool_:
        outside = (values < low) | (values > high)
        if nulls is not None:
            outside &= ~nulls
        outside = outside if outside.any() else None
    target = _NUMPY[inp.dtype]
    x = np.where(outside, 0, values) if outside is not None else values
    x = np.array(x, dtype=target)  # a writable copy in the input's dtype
    if nulls is not None:
        x[nulls] = fill
    bad_null = nulls if inp.fill is None else None

    def why(i: int) -> str:
        if bad_null is not None and bad_null[i]:
            return f"null in {name}"
        if inp.dtype == "bool":
            return f"{name} = {values[i]} is not 0 or 1 (input {inp.name!r} is bool)"
        return f"{name} = {values[i]} is outside {low}..{high}{_range_note(inp)}"

    return Part(x, _merge_bad(bad_null, outside), why)


def _id_range(inp: InputSpec) -> tuple[int, int]:
    """The values an integer or bool input takes: num_embeddings, else its dtype's range."""
    if inp.dtype == "bool":
        return 0, 1
    if inp.num_embeddings is not None:
        return 0, inp.num_embeddings - 1
    if inp.dtype == "int32":
        return INT32_RANGE
    return INT64_RANGE


def _range_note(inp: InputSpec) -> str:
    if inp.num_embeddings is not None:
        return f" (num_embeddings = {inp.num_embeddings})"
    return f" (the range of {inp.dtype})"


def _exact_columns(rb: pa.RecordBatch, inp: InputSpec) -> Part:
    parts = [_exact_values(rb.column(c), inp, c) for c in inp.columns or ()]
    x = np.ascontiguousarray(np.column_stack([p.x for p in parts]))
    bad = _merge_bad(*(p.bad for p in parts))

    def why(i: int) -> str:
        return "; ".join(p.why(i) for p in parts if p.bad is not None and p.bad[i])

    return Part(x, bad, why)


def _scalar(arr: pa.Array, inp: InputSpec) -> Part:
    """One value per row: a (rows,) array."""
    name = inp.column or ""
    if inp.dtype not in FLOAT_DTYPES:
        return _exact_values(arr, inp, name)
    cast = pc.cast(arr, pa.float32(), safe=False)
    x = np.array(cast.to_numpy(zero_copy_only=False), dtype=np.float32)
    over = _beyond(x, inp)
    finite = np.isfinite(x) if over is None else np.isfinite(x) & ~over
    if finite.all():
        return Part(x, None, _never)
    nulls = _nulls(cast)
    if inp.fill is not None:
        missing = np.isnan(x)
        x[missing] = inp.fill
        finite |= missing

    def why(i: int) -> str:
        if nulls is not None and nulls[i]:
            return f"null in {name}"
        if over is not None and over[i]:
            return f"{name} = {float(x[i])!r} is beyond {inp.dtype}'s range"
        return f"{'NaN' if np.isnan(x[i]) else 'infinite value'} in {name}"

    bad = ~finite
    return Part(x, bad if bad.any() else None, why)


def _vocabulary(arr: pa.Array, inp: InputSpec) -> Part:
    """Strings to ids through the vocabulary, in Arrow: a dictionary column looks up each
    distinct value once."""
    name = inp.column or ""
    if pa.types.is_large_string(arr.type):
        arr = arr.cast(pa.string())
    elif pa.types.is_dictionary(arr.type) and pa.types.is_large_string(arr.type.value_type):
        arr = arr.cast(pa.dictionary(arr.type.index_type, pa.string()))
    if isinstance(arr, pa.DictionaryArray):
        ids = pc.index_in(arr.dictionary, value_set=inp.vocab_array).take(arr.indices)
    else:
        ids = pc.index_in(arr, value_set=inp.vocab_array)
    nulls = _nulls(arr)
    unseen = np.asarray(ids.is_null().to_numpy(zero_copy_only=False))
    if nulls is not None:
        unseen &= ~nulls
    fill = inp.fill if inp.fill is not None else 0
    oov = inp.oov if inp.oov is not None else 0
    x = np.array(pc.fill_null(ids, -1).to_numpy(zero_copy_only=False), dtype=np.int64)
    if nulls is not None:
        x[nulls] = fill
    if unseen.any():
        x[unseen] = oov
    x = x.astype(_NUMPY[inp.dtype], copy=False)
    bad = _merge_bad(
        nulls if inp.fill is None else None, unseen if inp.oov is None and unseen.any() else None
    )

    def why(i: int) -> str:
        if nulls is not None and nulls[i]:
            return f"null in {name}"
        value = arr[i].as_py()
        return f"{name} = {value!r} is not in the vocabulary {inp.vocabulary} (oov = 'reject')"

    return Part(x, bad, why)


def _list(arr: pa.Array, inp: InputSpec, width: int) -> Part:
    """A list column as (rows, width). With a fill value, null elements and null lists (a row
    with no list at all) are filled; a list of another length is always rejected."""
    name = inp.column or ""
    n = len(arr)
    lengths = pc.fill_null(pc.list_value_length(arr), -1).to_numpy(zero_copy_only=False)
    right_len = lengths == width
    filled_rows = (lengths == -1) if inp.fill is not None else np.zeros(n, dtype=bool)
    rows = np.flatnonzero(right_len)  # the rows whose values are read
    good = arr.filter(pa.array(right_len)).flatten() if rows.size else None
    read = _exact_list if inp.dtype not in FLOAT_DTYPES else _float_list
    x, bad_values, element_why = read(good, rows, inp, (n, width), right_len | filled_rows)
    if filled_rows.any():
        x[filled_rows] = inp.fill
    bad = (~right_len & ~filled_rows) | bad_values

    def why(i: int) -> str:
        if lengths[i] == -1:
            return f"null in {name}"
        if not right_len[i]:
            return f"{name} has {lengths[i]} values, expected {width}"
        return element_why(i)

    return Part(np.ascontiguousarray(x), bad if bad.any() else None, why)


ListValues = tuple[np.ndarray, np.ndarray, Why]


def _exact_list(
    good: pa.Array | None, rows: np.ndarray, inp: InputSpec, shape: tuple[int, int], _: np.ndarray
) -> ListValues:
    """Integer or bool list values of the ``rows`` that have the right length; a bad row's
    reason names its first bad value (``ids holds 1000 is outside 0..999 ...``)."""
    name, width = inp.column or "", shape[1]
    x: np.ndarray = np.zeros(shape, dtype=_NUMPY[inp.dtype])
    bad_values = np.zeros(shape[0], dtype=bool)
    if good is None:
        return x, bad_values, _never
    values = _exact_values(good, inp, name)
    x[rows] = values.x.reshape(-1, width)
    if values.bad is None:
        return x, bad_values, _never
    per_row = values.bad.reshape(-1, width)
    bad_values[rows] = per_row.any(axis=1)
    first = dict(zip(rows.tolist(), per_row.argmax(axis=1).tolist(), strict=True))

    def why(i: int) -> str:
        k = int(np.searchsorted(rows, i)) * width + first[i]
        return values.why(k).replace(f"{name} = ", f"{name} holds ", 1)

    return x, bad_values, why


def _float_list(
    good: pa.Array | None,
    rows: np.ndarray,
    inp: InputSpec,
    shape: tuple[int, int],
    fill_rows: np.ndarray,
) -> ListValues:
    """Float list values of the ``rows`` that have the right length (nulls and NaN filled in
    ``fill_rows`` when the input has a fill value)."""
    name = inp.column or ""
    x = np.full(shape, np.nan, dtype=np.float32)
    if good is not None:
        x[rows] = pc.cast(good, pa.float32()).to_numpy(zero_copy_only=False).reshape(-1, shape[1])
    if inp.fill is not None:
        x[np.isnan(x) & fill_rows[:, None]] = inp.fill
    over = _beyond(x, inp)
    finite = np.isfinite(x) if over is None else np.isfinite(x) & ~over
    right = np.zeros(shape[0], dtype=bool)
    right[rows] = True
    bad_values = ~finite.all(axis=1) & right

    def why(i: int) -> str:
        j = int(np.argmin(finite[i]))
        if over is not None and over[i, j]:
            return f"{name} holds {float(x[i, j])!r}, beyond {inp.dtype}'s range"
        return f"NaN, null or infinite value in {name}"

    return x, bad_values, why


# Reasons that quote the row's value, and the same reason without it (see cause_of).
_VALUED = [
    (re.compile(r"^(?P<col>.+?) = .+ (?P<rest>is not in the vocabulary .*)$"), "{col} {rest}"),
    (
        re.compile(r"^(?P<col>.+?) = \S+ (?P<rest>is (?:outside|not 0 or 1|beyond) .*)$"),
        "{col} {rest}",
    ),
    (re.compile(r"^(?P<col>.+?) holds \S+ is (?P<rest>outside .*)$"), "{col} holds a value {rest}"),
    (re.compile(r"^(?P<col>.+?) holds \S+, (?P<rest>beyond .*)$"), "{col} holds a value {rest}"),
]


def cause_of(reason: str) -> str:
    """A reject reason without the row's own value, for counting rows by cause: ``brand =
    'xyz' is not in the vocabulary v.txt`` counts as ``brand is not in the vocabulary v.txt``
    (the rejects file keeps each row's full reason)."""
    parts = []
    for part in reason.split("; "):
        for pattern, template in _VALUED:
            m = pattern.match(part)
            if m:
                part = template.format(**m.groupdict())
                break
        parts.append(part)
    return "; ".join(parts)


def to_tensor(x: np.ndarray, inp: InputSpec) -> torch.Tensor:
    """The tensor the model gets for ``x``: shares ``x``'s memory where the dtypes agree
    (float32, int64, int32, bool); float16 and bfloat16 are cast by torch."""
    if not x.flags.writeable:  # a zero-copy view of Arrow memory: torch wants its own
        x = x.copy()
    t = torch.from_numpy(x)
    want = DTYPES[inp.dtype]
    return t if t.dtype == want else t.to(want)


def example_tensor(
    inp: InputSpec, width: int, rows: int, *, random: bool, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Inputs for a dry run or a benchmark: zeros, or random values the input can hold (ids
    within the vocabulary or num_embeddings)."""
    shape: Sequence[int] = (rows,) if width == 0 else (rows, width)
    dtype = DTYPES[inp.dtype]
    if inp.dtype in FLOAT_DTYPES:
        t = torch.randn(*shape) if random else torch.zeros(*shape)
        return t.to(device=device, dtype=dtype)
    if inp.dtype == "bool":
        t = torch.randint(0, 2, tuple(shape)) if random else torch.zeros(*shape, dtype=torch.long)
        return t.to(device=device, dtype=dtype)
    high = id_limit(inp) or 1
    t = torch.randint(0, high, tuple(shape)) if random else torch.zeros(*shape, dtype=torch.long)
    if random and rows >= 2:
        t[0], t[1] = 0, high - 1  # the extremes a run will feed, always among them
    return t.to(device=device, dtype=dtype)


def id_limit(inp: InputSpec) -> int | None:
    """One past the largest id an integer input can be given: num_embeddings, or the
    vocabulary's size plus room for an oov id beyond it; None when nothing bounds it."""
    if inp.num_embeddings is not None:
        return inp.num_embeddings
    if inp.vocab:
        return max(len(inp.vocab), (inp.oov or 0) + 1, (int(inp.fill) + 1) if inp.fill else 0)
    return None
