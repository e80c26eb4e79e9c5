"""What a Delta table's columns must be for a run's output: types every reader reads the same,
partition columns as strings, and how a run's output differs from the table's schema."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
from deltalake import DeltaTable, Schema

from pipeline.core.errors import TableSchemaError
from pipeline.io.layout import MODEL_INPUT_HASH_COLUMN
from pipeline.sinks.delta.client import TableRef, partition_columns
from pipeline.sinks.tables import partition_clashes

logger = logging.getLogger(__name__)


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


def table_schema(ref: TableRef, schema: pa.Schema, partition_by: Sequence[str]) -> pa.Schema:
    """The table's Arrow schema for a run's ``schema``: its columns (none named like a partition
    column: the data files hold none) then the partition columns as strings; every column
    nullable (this tool never relies on NOT NULL)."""
    problems = [
        p for f in schema if f.name not in partition_by if (p := _type_problem(f.name, f.type))
    ]
    problems += partition_clashes(schema, partition_by)
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


def delta_types(schema: Schema | pa.Schema) -> dict[str, Any]:
    """column -> its Delta type as JSON (comparable; nullability left out)."""
    delta = Schema.from_arrow(schema) if isinstance(schema, pa.Schema) else schema
    return {f["name"]: f["type"] for f in json.loads(delta.to_json())["fields"]}


def schema_changes(
    ref: TableRef, table: DeltaTable, wanted: pa.Schema
) -> tuple[list[str], list[str]]:
    """(columns the run adds, problems: type changes and dropped columns) against the table."""
    have = delta_types(table.schema())
    want = delta_types(wanted)
    added = [c for c in want if c not in have]
    problems = []
    for col, typ in want.items():
        if col in have and have[col] != typ:
            problems.append(
                f"column {col!r} is {type_name(have[col])} in the table and "
                f"{type_name(typ)} in this run's output"
            )
    dropped = [c for c in have if c not in want]
    if dropped:
        problems.append(
            f"the table has column{'s' if len(dropped) > 1 else ''} "
            f"{', '.join(repr(c) for c in dropped)}, which this run's output lacks"
        )
    return added, problems


def type_name(typ: Any) -> str:
    return typ if isinstance(typ, str) else json.dumps(typ, separators=(",", ":"))


def fit(
    ref: TableRef,
    table: DeltaTable,
    table_schema: pa.Schema,
    partition_by: Sequence[str],
    *,
    allow_new_columns: bool,
) -> list[str]:
    """The columns a run's ``table_schema`` adds to ``table``; raises where it does not fit."""
    have = partition_columns(table)
    if have != list(partition_by):
        raise TableSchemaError(
            f"the Delta table {ref.uri} is partitioned by {have}, this run by "
            f"{list(partition_by)}: write to another table, or change the output template "
            "back",
            uri=ref.uri,
        )
    added, problems = schema_changes(ref, table, table_schema)
    if problems:
        raise TableSchemaError(
            f"the Delta table {ref.uri} cannot take this run's output: {'; '.join(problems)}. "
            "A Delta table keeps its columns and their types: score into another table (another "
            "output), or give the column its type back (an id or pass-through column's in the "
            "input, an output's in the model)",
            uri=ref.uri,
        )
    # The fingerprint column of an incremental run (docs/incremental.md) is the tool's own, and
    # asking for incremental nights is asking for it: added without allow_schema_evolution.
    refused = [c for c in added if c != MODEL_INPUT_HASH_COLUMN]
    if refused and not allow_new_columns:
        raise TableSchemaError(
            f"this run's output adds column{'s' if len(refused) > 1 else ''} "
            f"{', '.join(repr(c) for c in refused)} to the Delta table {ref.uri}: allow schema "
            "evolution to add them (allow_schema_evolution = true, --allow-schema-evolution; "
            "older rows read them as null), or score into another table",
            uri=ref.uri,
        )
    if refused:
        # delta-rs 1.x (deltalake) filters wrong on a column that older files lack: `is null`
        # pruned 12,000 of 18,000 null rows, `is not null` kept 12,000 nulls (issue 29 review;
        # tests/integration/test_delta_run.py pins it). Polars and DuckDB read it right.
        logger.warning(
            "the Delta table %s gains column(s) %s: files committed before this run predate "
            "them and read them as null; deltalake (delta-rs) filters on these columns return "
            "wrong rows for those files (filter them in Polars or DuckDB, or after reading), "
            "until the older partitions are rescored (backfill --force)",
            ref.uri,
            ", ".join(repr(c) for c in refused),
        )
    return added
