"""The one door to pyiceberg's catalogs: a table reference (the catalog that holds the table,
its identifier there, where its files are), the catalog opened once per process, the table made
once (namespace and table, retried where SQLite races), and the names this tool writes into a
table (its writer property, its snapshot summary keys).

The catalog is the job's ``catalog`` key (:class:`~pipeline.core.tableformats.CatalogSpec`): a
SQL catalog in a SQLite file, a REST catalog, or pyiceberg catalog properties. With none given,
it is an embedded pyiceberg ``SqlCatalog`` on SQLite in the table's control area
(``<area>/_iceberg/catalog.db``): nothing to start, and it holds nothing but each table's current
metadata pointer (the compare-and-swap every commit goes through). The table's metadata and data
stay in the table's folder, on local disk or object storage (the job's ``[storage]`` options as
pyiceberg's FileIO properties: :mod:`.options`). Nothing here logs or raises a catalog's secret.

Only the driver imports this module: Dask workers use :mod:`pipeline.sinks.iceberg.facts`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import (
    NoSuchNamespaceError,
    NoSuchTableError,
    NotInstalledError,
    RESTError,
)
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table, TableProperties
from pyiceberg.transforms import IdentityTransform
from sqlalchemy.exc import IntegrityError, OperationalError

from pipeline.core.errors import ConfigError, StorageError
from pipeline.core.tableformats import CATALOG_NAME, CatalogSpec, table_identifier
from pipeline.io import storage
from pipeline.io.storage import Location
from pipeline.sinks.iceberg.options import fileio_properties
from pipeline.sinks.tables import METADATA_PREFIX

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The catalog's folder in the table's control area, and its SQLite file.
CATALOG_DIR = "_iceberg"
CATALOG_FILE = "catalog.db"

#: The table property that says this tool made the table: a run replaces whole partitions,
#: which are not its to replace in another writer's table.
WRITER_PROPERTY = "score_catalog.writer"
WRITER_PROPERTY_VALUE = "score-catalog"
#: The table property ``score_catalog.txn.<app_id>`` = the app's highest committed run version,
#: set in the same commit as the snapshot that carries the token (survives snapshot expiry).
TXN_PREFIX = METADATA_PREFIX + "txn."

#: Tries at making the catalog, namespace and table: runs of several partitions that start at
#: once race on a new SQLite file (pyiceberg 0.12 lets sqlalchemy's OperationalError "table
#: iceberg_tables already exists" and IntegrityError "UNIQUE constraint failed" through; measured
#: in 18 and 1 of 40 processes: docs/iceberg.md).
BOOTSTRAP_ATTEMPTS = 8


@dataclass(frozen=True)
class IcebergRef:
    """An Iceberg table this tool writes: its folder (the output template's fixed part), the
    catalog that holds it and its identifier there."""

    uri: str  # the table's folder as the user wrote it (every message names it)
    location: Location
    identifier: str  # namespace.table
    catalog: CatalogSpec  # secrets included: shown only as catalog.public() / .text()
    embedded: bool = True  # the default catalog in the control area (None given)
    #: pyiceberg FileIO properties from the job's [storage] options (s3.endpoint, ...): under
    #: the catalog's own properties, which win. Secrets: never shown.
    io_properties: Mapping[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def of(
        cls,
        root: Location,
        area: Location,
        catalog: str | Mapping[str, Any] | None = None,
        table: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> IcebergRef:
        """The table at ``root`` in ``catalog`` (None: the embedded one, in the control area
        ``area``) as ``table`` (None: ``score_catalog.<root's folder name>``); ``options``: the
        job's [storage] options, for the table's files on object storage."""
        name = root.name
        if table is None and (not name or not name.replace("_", "").replace("-", "").isalnum()):
            raise ConfigError(
                f"output {root.uri}: the Iceberg table's name is its folder's, {name!r}, which "
                "must be letters, digits, '_' and '-' only; or set table (--table "
                "NAMESPACE.TABLE)"
            )
        identifier = table_identifier(table, name)
        if catalog is not None:
            io = fileio_properties(root.uri, options)
            return cls(root.uri, root, identifier, CatalogSpec.of(catalog), False, io)
        if not root.is_local or not area.is_local:
            raise ConfigError(
                f"output {root.uri}: an Iceberg table on object storage needs a catalog that "
                "every run reaches (the embedded one is a SQLite file beside the table, on local "
                "disk only): set catalog (--catalog sqlite:///PATH on this machine's disk, an "
                "http(s):// REST catalog, or a [catalog] table of pyiceberg properties)"
            )
        db = area.child(CATALOG_DIR).child(CATALOG_FILE)
        spec = CatalogSpec("sql", CATALOG_NAME, {"type": "sql", "uri": f"sqlite:///{db.path}"})
        return cls(root.uri, root, identifier, spec, True, {})

    @property
    def catalog_path(self) -> str | None:
        """The catalog's SQLite file (the embedded one, or a sqlite:/// catalog); None for
        any other catalog."""
        return self.catalog.sqlite_path

    @property
    def namespace(self) -> str:
        return self.identifier.rsplit(".", 1)[0]

    @property
    def table_location(self) -> str:
        """The table's location as its metadata records it (a ``file://`` URI on local disk)."""
        if self.location.is_local:
            return Path(self.location.path).absolute().as_uri()
        return self.location.uri.rstrip("/")

    def rel(self, file_path: str, location: str | None = None) -> str:
        """A data file's path relative to the table's root (its ``file_path`` unchanged when
        it lies outside the table)."""
        for base in (location, self.table_location, self.location.path):
            if base and file_path.startswith(base.rstrip("/") + "/"):
                return file_path[len(base.rstrip("/")) + 1 :]
        return file_path

    def file_path(self, rel: str) -> str:
        """The ``file_path`` a data file at ``rel`` below the table's root has in the table."""
        return f"{self.table_location}/{rel}"


#: The catalogs this process opened, by what opens them: one each (one SQLite engine each).
_OPEN: dict[tuple[Any, ...], Catalog] = {}


def _key(ref: IcebergRef) -> tuple[Any, ...]:
    return (
        ref.catalog.name,
        tuple(sorted(ref.catalog.properties.items())),
        tuple(sorted(ref.io_properties.items())),
    )


def _catalog(ref: IcebergRef) -> Catalog:
    """The catalog of ``ref``, opened once per process (a SQLite file made when missing)."""
    key = _key(ref)
    found = _OPEN.get(key)
    if found is not None:
        return found
    path = ref.catalog_path
    props = {**ref.io_properties, **ref.catalog.properties}
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        props.pop("type", None)
        if ref.embedded:
            props["warehouse"] = Path(path).parent.as_uri()
        found = SqlCatalog(ref.catalog.name, **props)
    else:
        try:
            found = load_catalog(ref.catalog.name, **props)
        except (ValueError, ImportError, NotInstalledError, ValidationError) as e:
            raise ConfigError(
                f"catalog {ref.catalog.text()}: pyiceberg cannot open it: "
                f"{ref.catalog.scrub(str(e))}. Fix the catalog key (--catalog, [catalog])"
            ) from None
        except (OSError, RESTError) as e:
            raise _unreachable(ref, "opening", e) from None
    _OPEN[key] = found
    return found


def _unreachable(ref: IcebergRef, what: str, e: Exception) -> StorageError:
    """A catalog that did not answer or refused, or a table file it points to that could not be
    read: the message names them, never a secret."""
    return StorageError(
        f"{what} the Iceberg catalog {ref.catalog.text()} failed for {ref.identifier} "
        f"({type(e).__name__}: {ref.catalog.scrub(str(e))}): check that the catalog runs, that "
        "its address and credentials (the catalog key) are right, and that the table's files "
        f"are in {ref.uri}",
        uri=ref.uri,
    )


def is_sql(ref: IcebergRef) -> bool:
    """Whether ``ref``'s catalog validates a commit's requirements in this process, against
    the table it is about to swap (pyiceberg's SQL catalog): a requirement of this tool's own
    (the run token) can ride along. A REST catalog sends them over the wire, where only
    pyiceberg's own kinds exist."""
    return isinstance(_catalog(ref), SqlCatalog)


def _forget() -> None:
    """Drop the catalogs opened (their engines closed): the next use opens afresh."""
    for cat in _OPEN.values():
        if isinstance(cat, SqlCatalog):
            cat.engine.dispose()
    _OPEN.clear()


def _forget_in_child() -> None:
    """A process forked from the driver (a Dask worker) never uses the driver's SQLite
    connections: SQLAlchemy's rule for a fork, ``dispose(close=False)`` (the parent keeps
    them), and the child opens its own if it ever needs one."""
    for cat in _OPEN.values():
        if isinstance(cat, SqlCatalog):
            cat.engine.dispose(close=False)
    _OPEN.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _sqlite_retried(ref: IcebergRef, what: str, fn: Callable[[], T]) -> T:
    """``fn`` retried on the races of a new SQLite catalog (see :data:`BOOTSTRAP_ATTEMPTS`); a
    catalog that does not answer is a :class:`StorageError` naming it."""
    last: Exception | None = None
    for attempt in range(BOOTSTRAP_ATTEMPTS):
        try:
            return fn()
        except (OperationalError, IntegrityError) as e:
            last = e
            logger.debug("%s %s: %s (again)", what, ref.identifier, e)
            time.sleep(0.05 * (attempt + 1))
            _forget()
        except (OSError, RESTError) as e:
            raise _unreachable(ref, what, e) from e
    raise StorageError(
        f"{what} the Iceberg catalog {ref.catalog.text()} failed {BOOTSTRAP_ATTEMPTS} times: "
        f"{last}",
        uri=ref.uri,
    ) from last


def catalog_exists(ref: IcebergRef) -> bool:
    """Whether the catalog is there to ask: its SQLite file exists (any other catalog: yes)."""
    path = ref.catalog_path
    return path is None or Path(path).is_file()


def load(ref: IcebergRef) -> Table | None:
    """The table as its catalog points to it now; None when there is none (read only: no
    catalog file is made)."""
    if not catalog_exists(ref):
        return None

    def _load() -> Table | None:
        try:
            return _catalog(ref).load_table(ref.identifier)
        except (NoSuchTableError, NoSuchNamespaceError):
            return None

    return _sqlite_retried(ref, "reading", _load)


def partition_spec(schema: Schema, partition_by: list[str]) -> PartitionSpec:
    """Identity partitions on ``partition_by`` (string columns of ``schema``)."""
    fields = [
        PartitionField(
            source_id=schema.find_field(col).field_id,
            field_id=1000 + i,
            transform=IdentityTransform(),
            name=col,
        )
        for i, col in enumerate(partition_by)
    ]
    return PartitionSpec(*fields)


def ensure_table(
    ref: IcebergRef, schema: Schema, partition_by: list[str], properties: Mapping[str, str]
) -> Table:
    """The table, made when its catalog has none (namespace and table, each if absent): the
    schema ``schema`` with fresh ids, identity partitions on ``partition_by``, its location the
    table's folder, a name mapping (data files carry no field ids: they are matched by name),
    ``properties`` and this tool's writer property. A table that was there is returned as it
    is (the caller checks it fits)."""
    props: dict[str, Any] = {
        TableProperties.DEFAULT_NAME_MAPPING: schema.name_mapping.model_dump_json(),
        WRITER_PROPERTY: WRITER_PROPERTY_VALUE,
        **properties,
    }

    def _make() -> Table:
        cat = _catalog(ref)
        cat.create_namespace_if_not_exists(ref.namespace)
        return cat.create_table_if_not_exists(
            ref.identifier,
            schema=schema,
            location=ref.table_location,
            partition_spec=partition_spec(schema, partition_by),
            properties=props,
        )

    storage.makedirs(ref.location)
    return _sqlite_retried(ref, "making the table in", _make)


def check_location(ref: IcebergRef, table: Table) -> None:
    """Refuse a table its catalog places somewhere else than ``ref``'s folder (moved, or another
    table of that name): its data files would not be where this tool writes them."""
    found = table.metadata.location.rstrip("/")
    if found != ref.table_location.rstrip("/"):
        raise ConfigError(
            f"output {ref.uri}: the catalog {ref.catalog.text()} has a table {ref.identifier} at "
            f"{found}, not at {ref.table_location}: an Iceberg table is the output template's "
            "fixed part, so write to that table's folder, name another table (table, --table), "
            "or move the table back"
        )
