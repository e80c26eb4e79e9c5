"""Output formats: where a run's scores go, behind one small protocol
(:mod:`pipeline.io.outputs.base`), so that the driver is the same whatever the format. The
Parquet folder is the first (:mod:`pipeline.io.outputs.folder`). A Delta table's two sides,
:mod:`~pipeline.io.outputs.deltastats` (the worker's: stats from a file's footer, pyarrow only)
and :mod:`~pipeline.io.outputs.deltatable` (the driver's: the one commit per run, snapshot,
history, maintenance), are here for the second; nothing imports them yet (issue 24)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.io.outputs.base import OutputFormat
from pipeline.io.outputs.folder import ParquetFolder
from pipeline.io.storage import Location


def output_format(root: Location, options: Mapping[str, Any] | None = None) -> OutputFormat:
    """The format of an output at ``root`` (today always a Parquet folder)."""
    return ParquetFolder(root, dict(options or {}))
