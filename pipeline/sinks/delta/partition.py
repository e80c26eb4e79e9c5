"""A Delta table's partition as a run finds it (:class:`DeltaBegun`, the shared
:class:`~pipeline.sinks.partition.TableBegun` with Delta's stats check), and a folder that is
no Delta table (:func:`check_folder`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from pipeline.core.errors import ConfigError, ShardError
from pipeline.io import layout, storage
from pipeline.io.parquet import open_parquet
from pipeline.io.storage import Location
from pipeline.sinks.delta.stats import stats_problem
from pipeline.sinks.delta.table import TableRef
from pipeline.sinks.files import foreign_files
from pipeline.sinks.partition import TableBegun

logger = logging.getLogger(__name__)


class DeltaBegun(TableBegun):
    """The partition when the run took it (or, for ``plan``, now): :class:`TableBegun`, with
    Delta's own reason not to reuse an uncommitted file (its recorded stats)."""

    def reuse_problems(self, loc: Location, entry: Mapping[str, Any]) -> list[str]:
        return _stale_stats(loc, entry, self.options)


def _stale_stats(loc: Location, entry: Mapping[str, Any], options: Mapping[str, Any]) -> list[str]:
    """A file a run wrote but never committed is reused only if the stats its worker recorded
    are what its footer gives today: stats recorded under other rules (an older version of this
    tool, before a resume) would make every commit refuse it, so the shard is scored again."""
    try:
        with open_parquet(loc.uri, options) as pf:
            problem = stats_problem(str(entry.get("stats") or ""), pf.metadata)
    except ShardError as e:
        return [f"{loc.uri} cannot be read back: {e}"]
    return [f"{loc.uri}: {problem} (recorded by another version?)"] if problem else []


def check_folder(table: TableRef, output: Location, control_of: Callable[[str], Location]) -> None:
    """Refuse a table folder holding anything but a Delta table (a Parquet folder output of
    this tool, other files): a table needs a folder of its own. Files of this tool's runs that
    never committed, left before any commit made the table, are no reason
    (:func:`~pipeline.sinks.files.foreign_files`; ``control_of``: a partition folder's control
    folder): the next run reuses or deletes them."""
    try:
        entries = storage.ls(table.location)
    except FileNotFoundError:
        return
    except NotADirectoryError as e:
        raise ConfigError(f"output {table.uri} is a file, not a folder for a Delta table") from e
    names = sorted(e.name for e in entries)
    if "_delta_log" in names:
        return
    foreign = foreign_files(table.location, control_of)
    if not foreign:
        return
    names = sorted({f.partition("/")[0] for f in foreign})
    ours = layout.OUTPUT_MARK in names or any(
        storage.exists(e.child(layout.OUTPUT_MARK)) for e in entries[:10]
    )
    what = (
        'a Parquet folder output of score-catalog (format = "parquet")'
        if ours
        else "files that are not a Delta table"
    )
    raise ConfigError(
        f"output {output.uri}: {table.uri} holds {what} ({', '.join(names[:10])}"
        f"{' ...' if len(names) > 10 else ''}) but no _delta_log/: a Delta table needs a "
        "folder of its own. Nothing was written. Point the output at a new folder (or "
        "move the old output away)."
    )
