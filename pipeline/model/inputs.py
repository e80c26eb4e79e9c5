"""A bundle's model inputs: what ``[inputs]`` declares, and how Arrow columns become tensors.

Two forms of ``[inputs]`` in ``model.toml``:

- the single-input form: ``columns = [...]`` (numeric columns stacked into one (batch, n)
  float32 tensor) or ``column = "x"`` (a list column as (batch, dim));
- named inputs, ``[inputs.<name>]`` tables, each one tensor passed to the program in declared
  order (or in the order of the program's own parameter names, when they name the inputs):
  ``columns = [...]`` gives (batch, n); ``column = "x"`` gives (batch, dim) for a list column
  and (batch,) for a one-value-per-row column; ``dtype`` (float32, float16, bfloat16, int64,
  int32, bool); ``null = "reject"`` (the default) or a fill value; ``vocabulary = "file.txt"``
  maps a string column to int64 ids (line i of the file, counting from 0, is id i) with
  ``oov = <id>`` or ``oov = "reject"`` (the default) for unseen values; ``num_embeddings = N``
  makes ids outside 0..N-1 rejects instead of a crash inside ``nn.Embedding``.

Everything here is vectorised over a record batch (Arrow compute and numpy); per-row Python runs
only to word the reason of a rejected row. Each input's values come back as a numpy array plus
the rows that cannot be scored, with their reasons built on demand.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

#: dtype names ``model.toml`` accepts, and the torch dtype each becomes.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16"})
#: The largest finite value of each float dtype: beyond it a cast gives infinity.
FLOAT_MAX = {
    "float32": float(np.finfo(np.float32).max),
    "float16": float(np.finfo(np.float16).max),
    "bfloat16": float(torch.finfo(torch.bfloat16).max),
}
INT_DTYPES = frozenset({"int64", "int32"})
#: The numpy dtype each input is built in (float16/bfloat16 are cast by torch afterwards).
#: The ranges of the integer dtypes.
INT32_RANGE = (-(2**31), 2**31 - 1)
INT64_RANGE = (-(2**63), 2**63 - 1)

NAMED_KEYS = ("columns", "column", "dim", "dtype", "null", "vocabulary", "oov", "num_embeddings")
LEGACY_KEYS = ("columns", "column", "dim")
#: The name of the one input of the single-input form.
LEGACY_NAME = "x"


@dataclass(frozen=True)
class InputSpec:
    """One model input, as ``model.toml`` declares it."""

    name: str
    columns: tuple[str, ...] | None = None  # numeric columns stacked into (batch, n)
    column: str | None = None  # one column: a list (batch, dim) or one value per row (batch,)
    dim: int | None = None  # a list column's width, when the data does not fix it
    dtype: str = "float32"
    fill: float | int | bool | None = None  # null = <value>; None: rows with a null are rejected
    vocabulary: str | None = None  # file in the bundle, one value per line: line i is id i
    oov: int | None = None  # id of a value not in the vocabulary; None: such rows are rejected
    num_embeddings: int | None = None  # ids must lie in 0..N-1
    legacy: bool = False  # the single-input ``[inputs]`` form (its column must be a list)
    # The vocabulary's values, read from ``vocabulary`` with the bundle (not in model.toml).
    vocab: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @property
    def source_columns(self) -> tuple[str, ...]:
        """The columns this input reads."""
        return self.columns if self.columns is not None else (self.column or "",)

    def fixed_width(self) -> int | None:
        """Values per row known from ``model.toml`` alone: n for (batch, n), 0 for a (batch,)
        input (a vocabulary lookup), None when the data decides (a ``column`` with no dim)."""
        if self.columns is not None:
            return len(self.columns)
        if self.dim is not None:
            return self.dim
        if self.vocabulary is not None:
            return 0
        return None

    def describe(self) -> str:
        """The input as ``model.toml`` says it, for messages."""
        if self.legacy:
            if self.columns is not None:
                return f"inputs.columns = {list(self.columns)}"
            return f"inputs.column = {self.column!r}" + (f" (dim {self.dim})" if self.dim else "")
        src = (
            f"columns {list(self.columns)}"
            if self.columns is not None
            else f"column {self.column!r}"
        )
        extra = f", vocabulary {self.vocabulary}" if self.vocabulary else ""
        return f"input {self.name!r} ({src}, {self.dtype}{extra})"

    def shape_text(self, width: int) -> str:
        """``(batch,)`` or ``(batch, width)``."""
        return "(batch,)" if width == 0 else f"(batch, {width})"

    @functools.cached_property
    def vocab_array(self) -> pa.Array:
        """The vocabulary as an Arrow string array, for ``index_in`` (built once)."""
        return pa.array(self.vocab, pa.string())


# --------------------------------------------------------------------------------------------
# Parsing


def parse_inputs(raw: Any, p: list[str]) -> tuple[InputSpec, ...]:
    """``[inputs]`` of ``model.toml`` in either form; problems are appended to ``p``."""
    if not isinstance(raw, Mapping):
        p.append(
            '[inputs] table is required: columns = [...] or column = "...", or one '
            "[inputs.<name>] table per model input"
        )
        return ()
    tables = [k for k, v in raw.items() if isinstance(v, Mapping)]
    if not tables:
        legacy = _parse_legacy(raw, p)
        return (legacy,) if legacy is not None else ()
    if len(tables) != len(raw):
        plain = sorted(k for k in raw if k not in tables)
        p.append(
            f"[inputs] mixes named inputs ({', '.join(tables)}) with plain keys "
            f"({', '.join(plain)}); with named inputs, put every key in an [inputs.<name>] table"
        )
        return ()
    specs = []
    for name in tables:
        spec = _parse_named(name, raw[name], p)
        if spec is not None:
            specs.append(spec)
    return tuple(specs)


def _parse_legacy(raw: Mapping[str, Any], p: list[str]) -> InputSpec | None:
    for key in sorted(set(raw) - set(LEGACY_KEYS)):
        p.append(
            f"unknown key inputs.{key}; known: {', '.join(LEGACY_KEYS)} (or named inputs: "
            "[inputs.<name>] tables, which also take dtype, null, vocabulary, oov and "
            "num_embeddings)"
        )
    n = len(p)
    source = _parse_source(raw, "inputs", p)
    if source is None or len(p) > n:
        return None
    columns, column, dim = source
    return InputSpec(LEGACY_NAME, columns=columns, column=column, dim=dim, legacy=True)


def _parse_source(
    t: Mapping[str, Any], where: str, p: list[str]
) -> tuple[tuple[str, ...] | None, str | None, int | None] | None:
    """``columns`` / ``column`` / ``dim`` of one input table."""
    if ("columns" in t) == ("column" in t):
        p.append(f'[{where}] needs exactly one of columns = [...] or column = "..."')
        return None
    if "columns" in t:
        cols = t["columns"]
        if not (isinstance(cols, list) and cols and all(isinstance(c, str) and c for c in cols)):
            p.append(f"{where}.columns must be a non-empty list of column names")
            return None
        if len(set(cols)) != len(cols):
            p.append(f"{where}.columns names a column twice")
            return None
        if "dim" in t:
            p.append(f'{where}.dim goes with column = "..." (a list column), not columns')
        return tuple(cols), None, None
    column = t["column"]
    if not isinstance(column, str) or not column:
        p.append(f"{where}.column must be a column name")
        return None
    dim = None
    if "dim" in t:
        dim = t["dim"]
        if not _is_int(dim) or dim < 1:
            p.append(f"{where}.dim must be an integer >= 1")
            return None
    return None, column, dim


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_named(name: str, t: Mapping[str, Any], p: list[str]) -> InputSpec | None:
    where = f"inputs.{name}"
    n = len(p)
    for key in sorted(set(t) - set(NAMED_KEYS)):
        p.append(f"unknown key {where}.{key}; known: {', '.join(NAMED_KEYS)}")
    source = _parse_source(t, where, p)
    vocabulary = t.get("vocabulary")
    dtype = t.get("dtype", "int64" if vocabulary is not None else "float32")
    if dtype not in DTYPES:
        p.append(f"{where}.dtype = {dtype!r} is not one of {', '.join(DTYPES)}")
        return None
    fill = _parse_null(t.get("null", "reject"), dtype, where, p)
    if vocabulary is not None:
        _check_vocabulary(t, vocabulary, dtype, where, p)
    if "oov" in t and vocabulary is None:
        p.append(f"{where}.oov needs a vocabulary (ids outside a range: num_embeddings = N)")
    oov = t.get("oov", "reject")
    if oov != "reject" and (not _is_int(oov) or oov < 0):
        p.append(f'{where}.oov must be an id >= 0 or "reject", not {oov!r}')
    n_emb = t.get("num_embeddings")
    if n_emb is not None:
        if not _is_int(n_emb) or n_emb < 1:
            p.append(f"{where}.num_embeddings must be an integer >= 1")
        elif dtype not in INT_DTYPES:
            p.append(f"{where}.num_embeddings needs an integer dtype (int64 or int32)")
        elif _is_int(oov) and oov >= n_emb:
            p.append(f"{where}.oov = {oov} is outside 0..{n_emb - 1} (num_embeddings = {n_emb})")
        elif fill is not None and not 0 <= fill < n_emb:
            p.append(f"{where}.null = {fill} is outside 0..{n_emb - 1} (num_embeddings = {n_emb})")
    if source is None or len(p) > n:
        return None
    columns, column, dim = source
    return InputSpec(
        name,
        columns=columns,
        column=column,
        dim=dim,
        dtype=dtype,
        fill=fill,
        vocabulary=vocabulary,
        oov=oov if _is_int(oov) else None,
        num_embeddings=n_emb,
    )


def _parse_null(raw: Any, dtype: str, where: str, p: list[str]) -> float | int | bool | None:
    """``null = "reject"`` (None) or a fill value of the input's kind."""
    if raw == "reject":
        return None
    ok = (
        isinstance(raw, bool)
        if dtype == "bool"
        else _is_int(raw)
        if dtype in INT_DTYPES
        else isinstance(raw, (int, float)) and not isinstance(raw, bool)
    )
    if ok and dtype in FLOAT_MAX and abs(raw) > FLOAT_MAX[dtype]:
        p.append(f"{where}.null = {raw!r} is beyond {dtype}'s range (±{FLOAT_MAX[dtype]:.6g})")
        return None
    if ok and dtype == "int32" and not INT32_RANGE[0] <= raw <= INT32_RANGE[1]:
        p.append(f"{where}.null = {raw!r} is outside int32's range")
        return None
    if not ok or (isinstance(raw, float) and not np.isfinite(raw)):
        kind = (
            "true or false"
            if dtype == "bool"
            else "an integer"
            if dtype in INT_DTYPES
            else "a finite number"
        )
        p.append(f'{where}.null must be "reject" or a fill value ({kind} for {dtype}), not {raw!r}')
        return None
    return raw  # type: ignore[no-any-return]


def _check_vocabulary(
    t: Mapping[str, Any], vocabulary: Any, dtype: str, where: str, p: list[str]
) -> None:
    if not isinstance(vocabulary, str) or not vocabulary:
        p.append(f"{where}.vocabulary must be a file name")
    elif vocabulary.startswith("/") or ".." in vocabulary.split("/") or "://" in vocabulary:
        p.append(f"{where}.vocabulary = {vocabulary!r} must be a file inside the bundle directory")
    if "column" not in t:
        p.append(f'{where}.vocabulary maps one string column: use column = "...", not columns')
    if "dim" in t:
        p.append(f"{where}.vocabulary maps one value per row: it takes no dim")
    if dtype not in INT_DTYPES:
        p.append(f"{where}.vocabulary gives integer ids: dtype must be int64 or int32, not {dtype}")


def parse_vocabulary(raw: bytes, inp: InputSpec, where: str) -> tuple[tuple[str, ...], list[str]]:
    """A vocabulary file's values (line i is id i) and its problems (duplicates, size)."""
    try:
        # utf-8-sig: a byte-order mark (files saved by Excel or Notepad) is not part of the
        # first value, which would otherwise never match and map to oov without a word.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return (), [f"{where} is not UTF-8 text: {e}"]
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    values = [line.removesuffix("\r") for line in lines]
    problems = []
    if not values:
        problems.append(f"{where} is empty: a vocabulary needs at least one value")
    first: dict[str, int] = {}
    for i, v in enumerate(values):
        if v in first:
            problems.append(f"{where}: {v!r} is on line {first[v] + 1} and again on line {i + 1}")
            if len(problems) >= 5:
                break
        first.setdefault(v, i)
    n = inp.num_embeddings
    if n is not None and len(values) > n:
        problems.append(f"{where} holds {len(values)} values but num_embeddings = {n}")
    return tuple(values), problems


# --------------------------------------------------------------------------------------------
# The schema check and the widths the data gives


def is_number(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t))


def is_list(t: pa.DataType) -> bool:
    return bool(pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t))


def is_string(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


def data_width(schema: pa.Schema, inp: InputSpec) -> int | None:
    """The width ``schema`` gives an input that ``model.toml`` leaves open: a fixed-size list's
    size, 0 for a one-value column (named inputs only), None when it says nothing."""
    if inp.fixed_width() is not None:
        return inp.fixed_width()
    col = inp.column or ""
    if schema.names.count(col) != 1:
        return None
    t = schema.field(col).type
    if pa.types.is_fixed_size_list(t):
        return int(t.list_size)
    if is_list(t) or inp.legacy:
        return None
    return 0


def _value_problem(inp: InputSpec, col: str, t: pa.DataType) -> str | None:
    """Why values of type ``t`` cannot feed ``inp`` (None when they can)."""
    if inp.dtype in FLOAT_DTYPES:
        if is_number(t):
            return None
        if inp.legacy:
            return "which is not numeric (integers and floats are cast to float32)"
        return (
            f"which is not numeric (input {inp.name!r} is {inp.dtype}: integer and float "
            "columns are cast to it)"
        )
    if inp.dtype in INT_DTYPES:
        if pa.types.is_integer(t):
            return None
        return f"which is not an integer type (input {inp.name!r} is {inp.dtype})"
    if pa.types.is_boolean(t) or pa.types.is_integer(t):
        return None
    return f"which is neither boolean nor integer (input {inp.name!r} is bool)"


def schema_problems(
    schema: pa.Schema, inp: InputSpec, width: int, names: set[str], ambiguous: set[str], shard: str
) -> list[str]:
    """How ``schema`` does not fit one input (ambiguous columns are reported by the caller)."""
    problems = []
    if inp.columns is not None:
        for col in inp.columns:
            if col in ambiguous:
                continue
            if col not in names:
                problems.append(f"shard {shard}: feature column {col!r} is missing")
            elif (why := _value_problem(inp, col, t := schema.field(col).type)) is not None:
                problems.append(f"shard {shard}: feature column {col!r} has type {t}, {why}")
        return problems
    col = inp.column or ""
    if col in ambiguous:
        return []
    if col not in names:
        return [f"shard {shard}: feature column {col!r} is missing"]
    return _column_problems(inp, col, schema.field(col).type, width, shard)


def _column_problems(inp: InputSpec, col: str, t: pa.DataType, width: int, shard: str) -> list[str]:
    where = f"shard {shard}: feature column {col!r}"
    if inp.vocabulary is not None:
        if is_string(t):
            return []
        return [
            f"{where} has type {t}; input {inp.name!r} maps strings to ids through "
            f"{inp.vocabulary}, so it needs a string (or dictionary of strings) column"
        ]
    if width == 0:
        if is_list(t):
            return [f"{where} holds lists ({t}); input {inp.name!r} takes one value per row"]
        why = _value_problem(inp, col, t)
        return [] if why is None else [f"{where} has type {t}, {why}"]
    expected = (
        "numbers"
        if inp.dtype in FLOAT_DTYPES
        else "integers"
        if inp.dtype in INT_DTYPES
        else "booleans"
    )
    if not is_list(t) or _value_problem(inp, col, t.value_type) is not None:
        return [f"{where} has type {t}; expected a list of {width} {expected}"]
    if pa.types.is_fixed_size_list(t) and t.list_size != width:
        return [f"{where} holds lists of {t.list_size} values; the model takes {width}"]
    return []
