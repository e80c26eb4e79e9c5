"""The one door to pyiceberg's catalog: a table reference, the embedded SQLite catalog that holds
its pointer, the table made once (namespace and table, retried where SQLite races), and the
names this tool writes into a table (its writer property, its snapshot summary keys).

With no catalog configured, the catalog is an embedded pyiceberg ``SqlCatalog`` on SQLite, kept
in the table's control area beside the table (``<area>/_iceberg/catalog.db``): nothing to start,
and it holds nothing but each table's current metadata pointer (the compare-and-swap every
commit goes through). The table's metadata and data stay in the table's folder.

Only the driver imports this module: Dask workers use :mod:`pipeline.sinks.iceberg.facts`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table, TableProperties
from pyiceberg.transforms import IdentityTransform
from sqlalchemy.exc import IntegrityError, OperationalError

from pipeline.core.errors import ConfigError, StorageError
from pipeline.io import storage
from pipeline.io.storage import Location

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The namespace of every table this tool makes in its embedded catalog.
NAMESPACE = "score_catalog"
#: The catalog's folder in the table's control area, and its SQLite file.
CATALOG_DIR = "_iceberg"
CATALOG_FILE = "catalog.db"
#: The catalog's name: pyiceberg's SQL catalog keys its rows by it, so a reader opens the file
#: with this name (SqlCatalog("score_catalog", uri=...)) or finds no table.
CATALOG_NAME = "score_catalog"

#: The table property that says this tool made the table: a run replaces whole partitions,
#: which are not its to replace in another writer's table.
WRITER_PROPERTY = "score_catalog.writer"
WRITER_PROPERTY_VALUE = "score-catalog"
#: Prefix of every key this tool writes into a snapshot's summary and the table's properties.
METADATA_PREFIX = "score_catalog."
#: The table property ``score_catalog.txn.<app_id>`` = the app's highest committed run version,
#: set in the same commit as the snapshot that carries the token (survives snapshot expiry).
TXN_PREFIX = METADATA_PREFIX + "txn."
# Snapshot summary keys (under METADATA_PREFIX).
APP_ID = "app_id"
APP_VERSION = "app_version"
PARTITION = "partition"
RUN_ID = "run_id"
MODEL_SHA256 = "model_sha256"
SETTINGS_HASH = "settings_hash"
INPUT_FINGERPRINT = "input_fingerprint"
ROWS = "rows"
JOB = "job"
OUTPUTS = "outputs"
FILES_ADDED = "files_added"
FILES_REMOVED = "files_removed"

#: Tries at making the catalog, namespace and table: runs of several partitions that start at
#: once race on a new SQLite file (pyiceberg 0.12 lets sqlalchemy's OperationalError "table
#: iceberg_tables already exists" and IntegrityError "UNIQUE constraint failed" through; measured
#: in 18 and 1 of 40 processes: docs/iceberg.md).
BOOTSTRAP_ATTEMPTS = 8


@dataclass(frozen=True)
class IcebergRef:
    """An Iceberg table this tool writes: its folder (the output template's fixed part), the
    SQLite file of its embedded catalog, and its identifier there."""

    uri: str  # the table's folder as the user wrote it (every message names it)
    location: Location
    catalog_path: str  # absolute local path of the catalog's SQLite file
    identifier: str  # namespace.table

    @classmethod
    def of(cls, root: Location, area: Location) -> IcebergRef:
        """The table at ``root`` with its embedded catalog in the control area ``area``."""
        if not root.is_local or not area.is_local:
            raise ConfigError(
                f"output {root.uri}: an Iceberg table is written to a local folder for now (its "
                "embedded SQLite catalog cannot live on object storage, and no other catalog can "
                'be configured yet); write it locally, or use format = "delta" on object storage'
            )
        name = root.name
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(
                f"output {root.uri}: the Iceberg table's name is its folder's, {name!r}, which "
                "must be letters, digits, '_' and '-' only"
            )
        db = area.child(CATALOG_DIR).child(CATALOG_FILE)
        return cls(root.uri, root, db.path, f"{NAMESPACE}.{name.replace('-', '_')}")

    @property
    def catalog_uri(self) -> str:
        """The catalog's SQLAlchemy URI (``sqlite:////abs/path/catalog.db``), as reports name it."""
        return f"sqlite:///{self.catalog_path}"

    @property
    def table_location(self) -> str:
        """The table's location as its metadata records it (a ``file://`` URI)."""
        return Path(self.location.path).absolute().as_uri()

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


#: The catalogs this process opened, by SQLite file: one engine each.
_OPEN: dict[str, SqlCatalog] = {}


def _catalog(path: str) -> SqlCatalog:
    """The catalog on the SQLite file ``path`` (made when missing), one per process and file."""
    found = _OPEN.get(path)
    if found is None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        found = SqlCatalog(
            CATALOG_NAME, uri=f"sqlite:///{path}", warehouse=Path(path).parent.as_uri()
        )
        _OPEN[path] = found
    return found


def _forget() -> None:
    """Drop the catalogs opened (their engines closed): the next use opens afresh."""
    for cat in _OPEN.values():
        cat.engine.dispose()
    _OPEN.clear()


def _forget_in_child() -> None:
    """A process forked from the driver (a Dask worker) never uses the driver's SQLite
    connections: SQLAlchemy's rule for a fork, ``dispose(close=False)`` (the parent keeps
    them), and the child opens its own if it ever needs one."""
    for cat in _OPEN.values():
        cat.engine.dispose(close=False)
    _OPEN.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _sqlite_retried(ref: IcebergRef, what: str, fn: Callable[[], T]) -> T:
    """``fn`` retried on the races of a new SQLite catalog (see :data:`BOOTSTRAP_ATTEMPTS`)."""
    last: Exception | None = None
    for attempt in range(BOOTSTRAP_ATTEMPTS):
        try:
            return fn()
        except (OperationalError, IntegrityError) as e:
            last = e
            logger.debug("%s %s: %s (again)", what, ref.identifier, e)
            time.sleep(0.05 * (attempt + 1))
            _forget()
    raise StorageError(
        f"{what} the Iceberg catalog {ref.catalog_uri} failed {BOOTSTRAP_ATTEMPTS} times: {last}",
        uri=ref.uri,
    ) from last


def catalog_exists(ref: IcebergRef) -> bool:
    return Path(ref.catalog_path).is_file()


def load(ref: IcebergRef) -> Table | None:
    """The table as its catalog points to it now; None when there is none (read only: no
    catalog file is made)."""
    if not catalog_exists(ref):
        return None

    def _load() -> Table | None:
        try:
            return _catalog(ref.catalog_path).load_table(ref.identifier)
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
        cat = _catalog(ref.catalog_path)
        cat.create_namespace_if_not_exists(NAMESPACE)
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
            f"output {ref.uri}: the catalog {ref.catalog_uri} has a table {ref.identifier} at "
            f"{found}, not at {ref.table_location}: write to another folder, or move the table "
            "back"
        )
