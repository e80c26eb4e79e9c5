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
from typing import TYPE_CHECKING, Any

# Each public name, and the module that defines it.
_EXPORTS = {
    "BackfillReport": "pipeline.driver.backfill",
    "backfill": "pipeline.driver.backfill",
    "ErrorPolicy": "pipeline.core.config",
    "JobConfig": "pipeline.core.config",
    "Monitoring": "pipeline.core.config",
    "build_config": "pipeline.core.jobfile",
    "ConfigError": "pipeline.core.errors",
    "InputError": "pipeline.core.errors",
    "LockError": "pipeline.core.errors",
    "ModelError": "pipeline.core.errors",
    "PipelineError": "pipeline.core.errors",
    "RegistryError": "pipeline.core.errors",
    "SchemaError": "pipeline.core.errors",
    "StorageError": "pipeline.core.errors",
    "save_bundle": "pipeline.model.export",
    "plan_job": "pipeline.driver.planning",
    "RunReport": "pipeline.report.build",
    "run": "pipeline.driver.run",
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
    from pipeline.core.config import ErrorPolicy, JobConfig, Monitoring
    from pipeline.core.errors import (
        ConfigError,
        InputError,
        LockError,
        ModelError,
        PipelineError,
        RegistryError,
        SchemaError,
        StorageError,
    )
    from pipeline.core.jobfile import build_config
    from pipeline.driver.backfill import BackfillReport, backfill
    from pipeline.driver.planning import plan_job
    from pipeline.driver.run import run
    from pipeline.model.export import save_bundle
    from pipeline.report.build import RunReport


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
