"""What an Iceberg table's columns are for a run's output: the output's columns (all optional)
then the partition columns as strings; how a run's output differs from the table's schema; a
new column added (schema evolution) when the job allows it; a data file's footer checked against
the table."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.io.pyarrow import _check_pyarrow_schema_compatible
from pyiceberg.schema import Schema, assign_fresh_schema_ids
from pyiceberg.table import Table
from pyiceberg.types import IcebergType, ListType, MapType, StructType

from pipeline.core.errors import TableSchemaError
from pipeline.io.layout import MODEL_INPUT_HASH_COLUMN
from pipeline.sinks.tables import partition_clashes

logger = logging.getLogger(__name__)

#: Tries at adding columns while runs of other partitions change the table's metadata.
EVOLVE_ATTEMPTS = 5


def arrow_schema(schema: pa.Schema, partition_by: Sequence[str]) -> pa.Schema:
    """The table's columns as Arrow: the output's (partition columns left out, every column
    nullable: this tool never relies on NOT NULL), then the partition columns as strings."""
    fields = [f.with_nullable(True) for f in schema if f.name not in partition_by]
    fields += [pa.field(col, pa.string(), nullable=True) for col in partition_by]
    return pa.schema(fields)


def iceberg_schema(uri: str, schema: pa.Schema, partition_by: Sequence[str]) -> Schema:
    """The Iceberg schema of a run's output ``schema`` (:func:`arrow_schema`), with fresh ids
    (1, 2, ... in column order); a type Iceberg has no name for is a :class:`TableSchemaError`."""
    clashes = partition_clashes(schema, partition_by)
    if clashes:
        raise TableSchemaError(
            f"the Iceberg table {uri} cannot hold this output: " + "; ".join(clashes), uri=uri
        )
    try:
        converted = Catalog._convert_schema_if_needed(arrow_schema(schema, partition_by))
    except (ValueError, TypeError) as e:
        raise TableSchemaError(
            f"the Iceberg table {uri} cannot hold this output: {e}", uri=uri
        ) from e
    return assign_fresh_schema_ids(converted)


def type_key(typ: IcebergType) -> str:
    """``typ`` as text without field ids or nullability (two schemas' columns compared)."""
    if isinstance(typ, StructType):
        return "struct<" + ",".join(f"{f.name}:{type_key(f.field_type)}" for f in typ.fields) + ">"
    if isinstance(typ, ListType):
        return f"list<{type_key(typ.element_type)}>"
    if isinstance(typ, MapType):
        return f"map<{type_key(typ.key_type)},{type_key(typ.value_type)}>"
    return str(typ)


def changes(table: Schema, wanted: Schema) -> tuple[list[str], list[str]]:
    """(columns ``wanted`` adds, problems: type changes and dropped columns) against ``table``."""
    have = {f.name: type_key(f.field_type) for f in table.fields}
    want = {f.name: type_key(f.field_type) for f in wanted.fields}
    added = [c for c in want if c not in have]
    problems = [
        f"column {c!r} is {have[c]} in the table and {t} in this run's output"
        for c, t in want.items()
        if c in have and have[c] != t
    ]
    dropped = [c for c in have if c not in want]
    if dropped:
        problems.append(
            f"the table has column{'s' if len(dropped) > 1 else ''} "
            f"{', '.join(repr(c) for c in dropped)}, which this run's output lacks"
        )
    return added, problems


def fit(
    uri: str, table: Table, wanted: Schema, partition_by: Sequence[str], *, allow_new: bool
) -> list[str]:
    """The columns a run's ``wanted`` schema adds to ``table``; raises where it does not fit
    (other partition columns, a type changed, a column dropped, a column added without
    ``allow_new``: the fingerprint column of incremental runs is always let in, as for Delta)."""
    have = [f.name for f in table.spec().fields]
    if have != list(partition_by):
        raise TableSchemaError(
            f"the Iceberg table {uri} is partitioned by {have}, this run by {list(partition_by)}: "
            "write to another table, or change the output template back",
            uri=uri,
        )
    added, problems = changes(table.schema(), wanted)
    if problems:
        raise TableSchemaError(
            f"the Iceberg table {uri} cannot take this run's output: {'; '.join(problems)}. "
            "Score into another table (another output), or give the column its type back (an id "
            "or pass-through column's in the input, an output's in the model); a changed type is "
            "refused even with schema evolution",
            uri=uri,
        )
    refused = [c for c in added if c != MODEL_INPUT_HASH_COLUMN]
    if refused and not allow_new:
        raise TableSchemaError(
            f"this run's output adds column{'s' if len(refused) > 1 else ''} "
            f"{', '.join(repr(c) for c in refused)} to the Iceberg table {uri}: allow schema "
            "evolution to add them (allow_schema_evolution = true, --allow-schema-evolution; "
            "older rows read them as null), or score into another table",
            uri=uri,
        )
    return added


def evolve(uri: str, table: Table, output: pa.Schema, partition_by: Sequence[str]) -> Table:
    """The output's new columns added to ``table`` (one metadata commit, no snapshot; the name
    mapping follows), retried while other partitions' runs commit; returns the table after."""
    new = arrow_schema(output, partition_by)
    for attempt in range(1, EVOLVE_ATTEMPTS + 1):
        table = table.refresh()
        missing = [f.name for f in new if f.name not in table.schema()._name_to_id]
        if not missing:
            return table
        try:
            with table.update_schema() as update:
                update.union_by_name(new)
        except CommitFailedException:
            if attempt == EVOLVE_ATTEMPTS:
                raise
            continue
        logger.info("the Iceberg table %s gains column(s) %s", uri, ", ".join(map(repr, missing)))
    return table.refresh()


def footer_problem(
    table_schema: Schema, footer: pa.Schema, partition_by: Sequence[str]
) -> str | None:
    """Why a data file whose footer has the Arrow schema ``footer`` cannot be read as the
    table's rows, or None (pyiceberg's own check, as its ``add_files`` makes it; the partition
    columns are the table's metadata, never in the file)."""
    inside = [c for c in footer.names if c in partition_by]
    if inside:
        return f"holds the partition column(s) {inside}: the table's metadata holds their values"
    try:
        _check_pyarrow_schema_compatible(table_schema, footer.remove_metadata())
    except ValueError as e:
        return "another schema: " + " ".join(str(e).split())
    return None
