"""A folder that is not this tool's Iceberg table (:func:`check_folder`). A partition as a run
finds it is the shared :class:`~pipeline.sinks.partition.TableBegun`."""

from __future__ import annotations

from collections.abc import Callable

from pyiceberg.table import Table

from pipeline.core.errors import ConfigError
from pipeline.io import storage
from pipeline.io.storage import Location
from pipeline.sinks.files import foreign_files
from pipeline.sinks.iceberg.catalog import IcebergRef


def check_folder(
    ref: IcebergRef,
    output: Location,
    table: Table | None,
    control_of: Callable[[str], Location],
) -> None:
    """Refuse a table folder holding anything but this tool's Iceberg table (a Parquet folder
    output, a Delta table, other files) when the catalog has no table there: a table needs a
    folder of its own. A folder holding only ``metadata/`` (a creation that was cut short) and
    files of this tool's runs that never committed (:func:`~pipeline.sinks.files.foreign_files`;
    ``control_of``: a partition folder's control folder) is taken."""
    if table is not None:
        return
    try:
        storage.ls(ref.location)
    except FileNotFoundError:
        return
    except NotADirectoryError as e:
        raise ConfigError(f"output {ref.uri} is a file, not a folder for an Iceberg table") from e
    foreign = foreign_files(ref.location, control_of, skip=("metadata",))
    if not foreign:
        return
    names = sorted({f.partition("/")[0] for f in foreign})
    raise ConfigError(
        f"output {output.uri}: {ref.uri} holds {', '.join(names[:10])}"
        f"{' ...' if len(names) > 10 else ''} but its catalog ({ref.catalog.text()}) has no table "
        f"{ref.identifier}: an Iceberg table needs a folder of its own. Nothing was written. "
        "Point the output at a new folder (or move the old output away)."
    )
