"""score-catalog: offline batch scoring of Parquet shards with PyTorch models.

The library API the CLI is a thin layer over::

    from pipeline import JobConfig, run
    report = run(JobConfig(input="data/catalog", output="data/scored", model="data/models/m"))
    print(report.status, report["rows_out"])

and :func:`save_bundle`, which exports a ``torch.nn.Module`` as a bundle that run() can load.
"""

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
