"""score-catalog: offline batch scoring of Parquet shards with PyTorch models.

The library API the CLI is a thin layer over::

    from pipeline import JobConfig, run
    report = run(JobConfig(input="data/catalog", output="data/scored", model="data/models/m"))
    print(report.status, report["rows_out"])

and :func:`save_bundle`, which exports a ``torch.nn.Module`` as a bundle that run() can load.

Names are imported when first used (PEP 562), so that ``import pipeline`` and the command
line's ``--help`` do not pay for torch and Dask.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

# Each public name, and the module that defines it.
_EXPORTS = {
    "BackfillReport": "pipeline.backfill",
    "backfill": "pipeline.backfill",
    "ErrorPolicy": "pipeline.config",
    "JobConfig": "pipeline.config",
    "Monitoring": "pipeline.config",
    "build_config": "pipeline.config",
    "ConfigError": "pipeline.errors",
    "InputError": "pipeline.errors",
    "LockError": "pipeline.errors",
    "ModelError": "pipeline.errors",
    "PipelineError": "pipeline.errors",
    "RegistryError": "pipeline.errors",
    "SchemaError": "pipeline.errors",
    "StorageError": "pipeline.errors",
    "save_bundle": "pipeline.export",
    "plan_job": "pipeline.planning",
    "RunReport": "pipeline.report",
    "run": "pipeline.run",
}

__all__ = [
    "BackfillReport",
    "ConfigError",
    "ErrorPolicy",
    "InputError",
    "JobConfig",
    "LockError",
    "ModelError",
    "Monitoring",
    "PipelineError",
    "RegistryError",
    "RunReport",
    "SchemaError",
    "StorageError",
    "backfill",
    "build_config",
    "plan_job",
    "run",
    "save_bundle",
]

if TYPE_CHECKING:
    from pipeline.backfill import BackfillReport, backfill
    from pipeline.config import ErrorPolicy, JobConfig, Monitoring, build_config
    from pipeline.errors import (
        ConfigError,
        InputError,
        LockError,
        ModelError,
        PipelineError,
        RegistryError,
        SchemaError,
        StorageError,
    )
    from pipeline.export import save_bundle
    from pipeline.planning import plan_job
    from pipeline.report import RunReport
    from pipeline.run import run


class _Package(types.ModuleType):
    """This package, whose ``run`` and ``backfill`` are functions of submodules of the same
    names. Importing a submodule makes the import system set the package attribute of its
    name to the module (``pipeline.run`` = ``pipeline/run.py``), after which ``from pipeline
    import run`` would return the module, not the function; the function is kept instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            isinstance(value, types.ModuleType)
            and value.__name__ == f"{__name__}.{name}"
            and _EXPORTS.get(name) == value.__name__
        ):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
