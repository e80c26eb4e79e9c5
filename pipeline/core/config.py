"""The job configuration: one frozen object built from job file < environment < flags.

The dataclasses below are the only description of a job's keys. Each field's type hint gives
the key's type (``Literal[...]`` its allowed values), its default the default, and its metadata
the value rules and the command-line text; :data:`SETTINGS` is derived from them and read by
the job-file and environment loaders, by the validator and by ``pipeline.cli`` (its options,
choices and defaults). Adding a key means adding one field.

Every layer is merged into one plain mapping first and validated once, so that a user sees every
bad field in one message instead of fixing them one run at a time.

Over 600 lines on purpose: every job key is one commented field here, the one place a user's
key is described, and splitting the fields across modules would split that description.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_type_hints

from pipeline.core import storage_options
from pipeline.core.errors import ConfigError
from pipeline.core.settings import (
    TEMPLATE_FIELDS,
    Keyed,
    Setting,
    at_least,
    batch_size_rule,
    closest_names,
    date_rule,
    device_rule,
    distinct,
    fraction,
    meta,
    nonempty,
    positive_entries,
    scheduler_rule,
    settings_of,
    template,
    url,
)
from pipeline.core.tableformats import (
    CatalogSpec,
    catalog_problems,
    format_problems,
    table_problems,
)
from pipeline.core.tableformats import missing_packages as missing_packages  # ONNX's too
from pipeline.core.templates import default_rejects, fixed_part, index_root

Precision = Literal["fp32", "bf16", "fp16", "int8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
Engine = Literal["torch", "onnx"]
#: What ``engine = "onnx"`` imports: the runtime, and torch.onnx.export's dynamo exporter.
ONNX_PACKAGES = ("onnxruntime", "onnx", "onnxscript")
# --------------------------------------------------------------------------------------------
# The job


@dataclass(frozen=True, kw_only=True)
class DeltaSettings:
    """``format = "delta"``: the table's retentions (the ``[delta]`` table), set as its
    properties when a run creates it and brought back to these values by a run that finds them
    changed (docs/delta.md#retention-and-maintenance)."""

    # Commit JSONs older than this are deleted at the next checkpoint
    # (delta.logRetentionDuration): history, time travel and rollback reach back this far.
    log_retention_days: int = field(default=30, metadata=meta(checks=(at_least(1),), flag=None))
    # A file a commit removed is kept at least this long by VACUUM
    # (delta.deletedFileRetentionDuration; Delta's own default is 7). Never shorter than the log
    # retention: every version whose log is kept can still be read and restored.
    deleted_file_retention_days: int = field(
        default=30, metadata=meta(checks=(at_least(1),), flag=None)
    )


@dataclass(frozen=True, kw_only=True)
class ErrorPolicy:
    """How much can go wrong before a run counts as failed (the ``[errors]`` table)."""

    # Shards that may fail (unreadable, schema-skipped, crashed) while the run still succeeds.
    max_failed_shards: int = field(
        default=0, metadata=meta("Failed shards allowed.", checks=(at_least(0),))
    )
    # Fraction of readable input rows that may be rejected (null/NaN/inf features, model errors).
    max_rejected_fraction: float = field(
        default=0.01, metadata=meta("Rejected rows allowed.", checks=(fraction,))
    )
    # "fail": a readable shard whose columns do not fit the model stops the run before scoring
    # (exit 3). "skip_shard": that shard is listed as failed and the others are scored.
    on_schema_error: Literal["fail", "skip_shard"] = field(
        default="fail", metadata=meta("A shard whose columns do not fit the model.")
    )
    # "reject": rows with null/NaN/inf features go to the rejects dataset. "fail": the first such
    # row fails its shard, naming shard, row group and id.
    on_invalid_rows: Literal["reject", "fail"] = field(
        default="reject", metadata=meta("Rows with null/NaN/inf features.")
    )
    # How many times a crashed shard task is retried before it counts as failed.
    task_retries: int = field(default=2, metadata=meta(checks=(at_least(0),), flag=None))


_THRESHOLD = meta(checks=(at_least(0, "a number"),), flag=None)


@dataclass(frozen=True, kw_only=True)
class Monitoring:
    """Drift of the score distributions against the baseline (``[monitoring]``): an earlier
    dataset of the job whose verdict was clean or accepted (``pipeline.report.verdict``).

    Crossing a threshold makes the run ``succeeded_with_warnings`` (exit code 4); the scores are
    still written and ``_SUCCESS`` still marks them complete.
    """

    # Compare with an earlier dataset of the same job (found in the run index).
    drift: bool = field(default=True, metadata=meta(flag=None))
    # Population stability index per output column, over the previous run's deciles.
    psi_threshold: float = field(default=0.25, metadata=_THRESHOLD)
    # Kolmogorov-Smirnov statistic per output column (largest gap between the two CDFs).
    ks_threshold: float = field(default=0.2, metadata=_THRESHOLD)
    # Largest allowed |rows scored now / rows scored then - 1|.
    rows_change_threshold: float = field(default=0.5, metadata=_THRESHOLD)


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A validated scoring job. Build it with :func:`build_config` or directly with keywords."""

    # Input shards: a directory (every *.parquet below it, sorted, skipping _ and . names),
    # a glob, or a single file; local paths or fsspec URIs. May contain {date}.
    input: str = field(
        metadata=meta(
            "Input shards: directory, glob or file.",
            checks=(nonempty, template("date")),
            metavar="URI",
        )
    )
    # Output root for scored shards, _report.json, _manifest.json and _SUCCESS. May contain
    # {date} and {run_id}. Resume needs the same output on the rerun, so avoid {run_id} there.
    output: str = field(
        metadata=meta(
            "Output root; may contain {date} and {run_id}.",
            checks=(nonempty, template(*TEMPLATE_FIELDS)),
            metavar="URI",
        )
    )
    # Model bundle directory (model.toml + weights), or a registered version in an MLflow
    # registry: models:/NAME/VERSION or models:/NAME@ALIAS (pipeline.model.registry).
    model: str = field(
        metadata=meta(
            "Model bundle directory (model.toml + weights), or models:/NAME/VERSION or "
            "models:/NAME@ALIAS from the MLflow registry at MLFLOW_TRACKING_URI.",
            checks=(nonempty,),
            metavar="URI",
        )
    )
    # Name shown in reports and metrics; defaults to the job file's stem.
    name: str = field(default="score-catalog", metadata=meta(checks=(nonempty,), flag=None))
    # Column that identifies a row; copied first into every output row.
    id_column: str = field(
        default="item_id",
        metadata=meta("Row identifier column.", checks=(nonempty,), metavar="NAME"),
    )
    # Columns copied unchanged to the output after the id, in this order.
    passthrough: tuple[str, ...] = field(
        default=(),
        metadata=meta(
            "Column copied unchanged to the output (repeatable, kept in order).",
            checks=(distinct,),
            metavar="NAME",
        ),
    )
    # Rows per batch, read, scored and written together (the last batch of a shard may be
    # shorter; on the CPU the model may be called on slices of it: execution.call_rows), or
    # "auto": the size the
    # whole worker path scores fastest at, measured on real rows of the first shard (1,024 to
    # 32,768; the default 4,096 unless another is faster beyond the noise), cached per
    # model/device/precision/threads (pipeline.driver.autotune).
    batch_size: int | Literal["auto"] = field(
        default=4096,
        metadata=meta(
            "Rows per batch; auto: measured on real rows, cached.",
            checks=(batch_size_rule,),
            metavar="N|auto",
        ),
    )
    # auto (cuda when available, else cpu), cpu, cuda or cuda:N.
    device: str = field(
        default="auto",
        metadata=meta(
            "Where the model runs.", checks=(device_rule,), metavar="auto|cpu|cuda|cuda:N"
        ),
    )
    # local (embedded Dask cluster), threads, sync (in-process, for debugging) or tcp://HOST:PORT.
    scheduler: str = field(
        default="local",
        metadata=meta(
            "local: embedded Dask cluster; threads/sync: in-process, for debugging; "
            "tcp://...: an existing Dask scheduler.",
            checks=(scheduler_rule,),
            metavar="local|threads|sync|tcp://HOST:PORT",
        ),
    )
    # Dask worker processes for scheduler=local; None sizes it to the cores.
    workers: int | None = field(
        default=None,
        metadata=meta(
            "Worker processes for --scheduler local (default: cores).", checks=(at_least(1),)
        ),
    )
    # CPU cores the job may use (workers x threads x torch threads stay within it); None: all.
    cores: int | None = field(
        default=None,
        metadata=meta("CPU cores the job may use (default: all).", checks=(at_least(1),)),
    )
    # fp32, bf16 (autocast, CPU and CUDA), fp16 (CUDA) or int8 (dynamic, Linear layers, CPU).
    precision: Precision = field(
        default="fp32",
        metadata=meta(
            "bf16: autocast; fp16: CUDA; int8: dynamic, CPU; checked against fp32 on a sample "
            "of rows before scoring."
        ),
    )
    # torch (the default and the reference) or onnx: ONNX Runtime's CPU provider on the bundle's
    # program exported to ONNX, checked against torch on a sample of rows before scoring. Faster
    # only for some models on some CPUs (docs/tuning.md#onnx-runtime-engine): measure first.
    engine: Engine = field(
        default="torch",
        metadata=meta(
            "onnx: ONNX Runtime on the CPU (pip install 'score-catalog[onnx]'), checked against "
            "torch on a sample of rows before scoring."
        ),
    )
    # torch.compile the model (compile time is reported).
    compile: bool = field(
        default=False, metadata=meta("torch.compile the model (compile time is reported).")
    )
    # On CUDA, fp32 matmuls may use TF32 unless this is set.
    strict_fp32: bool = field(default=False, metadata=meta("On CUDA, do not let fp32 use TF32."))
    # Max |difference| from the fp32 CPU reference on the parity sample (labels: share that
    # differ); None: the precision's default.
    parity_tolerance: float | None = field(
        default=None,
        metadata=meta(
            "Max |diff| from fp32 allowed on the parity sample (default per precision).",
            checks=(at_least(0, "a number"),),
        ),
    )
    # Read the next batches and write finished ones in background threads, alongside the model.
    # "auto": on, except where every CPU core already runs a scoring loop of its own (there the
    # threads only compete with them: W1 on 2 cores scored 1.2x faster without; see
    # pipeline.driver.cluster.overlap_rule and docs/tuning.md).
    overlap: bool | Literal["auto"] = field(
        default="auto",
        metadata=meta(
            "Read ahead and write behind in background threads (default auto: off where every "
            "core already runs a scoring loop)."
        ),
    )
    # Where rejected rows go (template like output). None: outside the output template's fixed
    # part (data/scored/run_date=X -> data/_rejects/scored/run_date=X), so that no reader of
    # the whole dataset (DuckDB's '**/*.parquet', Dask) takes rejects for scores. A root
    # without a parent (a bucket root) has nowhere beside it: set it there.
    rejects: str | None = field(
        default=None,
        metadata=meta(
            "Where rejected rows go (default <root's parent>/_rejects/<root's name>/..., "
            "root: the output up to its first placeholder).",
            checks=(template(*TEMPLATE_FIELDS),),
            metavar="URI",
        ),
    )
    # The date that {date} expands to (YYYY-MM-DD); None means today (UTC).
    date: str | None = field(
        default=None,
        metadata=meta(
            "Date for {date} in templates (default today, UTC).",
            checks=(date_rule,),
            metavar="YYYY-MM-DD",
        ),
    )
    # What to do when the output folder holds files this tool did not write (no _manifest.json,
    # no score-catalog footer). "refuse": exit 2 before anything is written, naming them.
    # "replace": delete each such Parquet file (logged as a WARNING and listed in the report's
    # foreign_removed); other files are left alone and listed in foreign_kept.
    on_foreign_output: Literal["refuse", "replace"] = field(
        default="refuse",
        metadata=meta("An output folder holding files this tool did not write."),
    )
    # An output (or rejects) bucket that does not exist is an error unless this is set: a typo
    # in a bucket name must not quietly create a new bucket and fill it.
    create_output_bucket: bool = field(
        default=False,
        metadata=meta("Create the output and rejects buckets if they do not exist."),
    )
    # Where the scores go. "parquet": a folder of Parquet files, _SUCCESS when complete.
    # "delta": a Delta Lake table (docs/delta.md): the template's fixed part is the table, each
    # key={placeholder} folder below it a partition column; every run is one commit.
    # "iceberg": an Apache Iceberg table the same way (docs/iceberg.md; the iceberg extra), one
    # snapshot per run, its catalog an embedded SQLite file beside the table.
    format: Literal["parquet", "delta", "iceberg"] = field(
        default="parquet",
        metadata=meta(
            "parquet: a folder of Parquet files and _SUCCESS; delta: a Delta Lake table, one "
            "commit per run (the template's fixed part is the table, key={date} folders its "
            "partitions); iceberg: an Iceberg table the same way, one snapshot per run."
        ),
    )
    # format = "iceberg": the pyiceberg catalog that holds the table. A URI (sqlite:///PATH: a
    # SQL catalog in that SQLite file; http(s)://...: a REST catalog) or a [catalog] table of
    # pyiceberg catalog properties (name = its name, the others passed to load_catalog; secret
    # ones never shown). None: an embedded SQLite catalog in the table's control area (local
    # outputs only). docs/iceberg.md#catalog-and-table
    catalog: str | Mapping[str, Any] | None = field(
        default=None,
        metadata=meta(
            "iceberg: the catalog, sqlite:///PATH or http(s):// REST (default: an embedded "
            "SQLite catalog beside the table; a [catalog] table of pyiceberg properties in a "
            "job file).",
            checks=(catalog_problems,),
            metavar="URI",
        ),
    )
    # format = "iceberg": the table's identifier in its catalog, <namespace>.<table> or <table>
    # (namespace score_catalog). None: score_catalog.<the table folder's name>.
    table: str | None = field(
        default=None,
        metadata=meta(
            "iceberg: the table's identifier, NAMESPACE.TABLE or TABLE (default "
            "score_catalog.<the table folder's name>).",
            checks=(table_problems,),
            metavar="ID",
        ),
    )
    # format = "delta": a model that adds an output column adds it to the table (older rows
    # read it as null) instead of being refused. Type changes are refused either way.
    allow_schema_evolution: bool = field(
        default=False,
        metadata=meta("delta: let a model add output columns to the table (older rows read null)."),
    )
    # Rescore every shard even where the manifest says it is done (and, incremental, every
    # row: no score is carried).
    force: bool = field(default=False, metadata=meta("Rescore shards the manifest says are done."))
    # Send through the model only the rows that are new or whose model input changed since the
    # baseline (the newest earlier clean or accepted night of the job, scored by the same
    # model and settings); carry the other rows' scores from it. The output is still every
    # row of tonight's input, equal to a full rescore (docs/incremental.md).
    incremental: bool = field(
        default=False,
        metadata=meta(
            "Score only new and changed rows; carry the others' scores from the baseline night "
            "(the output still equals a full rescore, scores up to the last bit of float rounding)."
        ),
    )
    # backfill only: a day whose input folder does not exist is listed as missing and accepted
    # (an archive with gaps). Unset, such a day fails the backfill (exit 1, a WARNING per day),
    # so that a hole in the archive is never reported as a clean rescore. A range in which no
    # day has input fails either way (exit 3): that is a wrong input template, not a gap.
    allow_missing_partitions: bool = field(
        default=False,
        metadata=meta(
            "Accept days whose input folder does not exist (an archive with gaps); without it "
            "they fail the backfill.",
            commands=("backfill",),
        ),
    )
    # A lock older than this many seconds is taken over even if its holder seems alive.
    stale_lock_after_s: float = field(
        default=6 * 3600.0,
        metadata=meta(checks=(at_least(0, "a number", strictly=True),), flag=None),
    )
    # After SIGTERM or SIGINT, how long shards in flight may take to commit before the run
    # stops without them (Kubernetes' default terminationGracePeriodSeconds is 30 too).
    grace_period_s: float = field(
        default=30.0,
        metadata=meta(
            "Seconds shards in flight may take to commit after SIGTERM/SIGINT.",
            checks=(at_least(0, "a number"),),
        ),
    )
    # Target rows per Dask task: shards smaller than this are grouped into one task so that
    # scheduling and commit overhead do not dominate; a bigger shard is its own task (streamed by
    # row group). The target shrinks so that every worker thread gets at least 4 tasks.
    task_rows: int = field(
        default=262_144,
        metadata=meta(
            "Target rows per Dask task; smaller shards are grouped.", checks=(at_least(1),)
        ),
    )
    # Dask resources each task asks for on an existing cluster, e.g. {GPU = 1} for workers
    # started with --resources GPU=1 (one worker per GPU).
    resources: Mapping[str, float] = field(
        default_factory=dict,
        metadata=meta(
            "Dask resource each task needs on an existing cluster, e.g. GPU=1 (repeatable).",
            checks=(positive_entries,),
            flag="--resource",
            metavar="NAME=N",
        ),
    )
    # Prometheus textfile (node_exporter textfile-collector convention) written after the run.
    metrics_file: str | None = field(
        default=None,
        metadata=meta(
            "Write Prometheus metrics here (node_exporter textfile collector), atomically.",
            metavar="PATH",
        ),
    )
    # Prometheus Pushgateway URL to push the same metrics to.
    pushgateway: str | None = field(
        default=None,
        metadata=meta("Push the same metrics to a Pushgateway.", checks=(url,), metavar="URL"),
    )
    errors: ErrorPolicy = field(default_factory=ErrorPolicy)
    monitoring: Monitoring = field(default_factory=Monitoring)
    delta: DeltaSettings = field(default_factory=DeltaSettings)
    # Options passed unchanged to fsspec for every URI of the job (endpoint_url, key, ...).
    storage: Mapping[str, Any] = field(
        default_factory=dict,
        metadata=meta(
            "fsspec option for every URI of the job (repeatable); values never logged.",
            flag="--storage-option",
            metavar="KEY=VALUE",
        ),
    )

    def __post_init__(self) -> None:
        problems = _problems(_as_mapping(self), none_is_unset=False)
        if problems:
            raise ConfigError(problems)

    @property
    def run_date(self) -> str:
        return self.date or dt.datetime.now(dt.timezone.utc).date().isoformat()

    def input_uri(self) -> str:
        """The input with ``{date}`` filled in (for date-partitioned archives)."""
        return self.input.format(date=self.run_date)

    def output_uri(self, run_id: str) -> str:
        """The output root with ``{date}`` and ``{run_id}`` filled in."""
        return self.output.format(date=self.run_date, run_id=run_id)

    def rejects_uri(self, run_id: str) -> str:
        """Where rejected rows go for this run (see :func:`default_rejects`)."""
        if self.rejects is None:
            found = default_rejects(self.output, self.output_uri(run_id))
            if found is None:
                raise ConfigError(_no_parent_message(self.output))
            return found
        return self.rejects.format(date=self.run_date, run_id=run_id)

    def redacted(self) -> dict[str, Any]:
        """A JSON-able view for logs and reports: storage option values and the catalog's
        secrets are never shown."""
        d = dataclasses.asdict(self)
        d["passthrough"] = list(self.passthrough)
        d["storage"] = {k: "***" for k in self.storage}
        if self.catalog is not None:
            d["catalog"] = CatalogSpec.of(self.catalog).public()
        return d


def _no_parent_message(template: str) -> str:
    root = fixed_part(template)[0]
    return (
        f"output = {template!r}: its fixed part {root!r} has no parent folder to keep rejects "
        "beside it (the default is <root's parent>/_rejects/<root's name>/..., outside the "
        "dataset so that readers see only scores); set rejects (--rejects URI) to a location "
        "outside it, e.g. another bucket, or move the output under a prefix "
        "(s3://bucket/scored/{date})"
    )


# Every key of a job, in the order the dataclasses declare them.
SETTINGS: tuple[Setting, ...] = tuple(settings_of(JobConfig))
# The [tables] holding further keys: errors -> ErrorPolicy, monitoring -> Monitoring.
SECTIONS: dict[str, type[Any]] = {
    name: hint
    for name, hint in get_type_hints(JobConfig).items()
    if isinstance(hint, type) and dataclasses.is_dataclass(hint)
}
TOP_LEVEL = {s.name: s for s in SETTINGS if s.table is None}
BY_ENV = {s.env: s for s in SETTINGS if s.env is not None}
# Keys whose values are tables, merged key by key across the layers.
TABLE_KEYS = frozenset([*SECTIONS, *(s.name for s in SETTINGS if s.kind.name == "table")])


def setting(key: str) -> Setting:
    """The :class:`Setting` of ``key`` (``"batch_size"``, ``"errors.on_schema_error"``)."""
    for s in SETTINGS:
        if s.key == key:
            return s
    raise KeyError(key)


def from_flags(values: Mapping[str, Any]) -> dict[str, Any]:
    """Command-line values keyed by field name -> the job-file shape (``errors`` as a table).

    ``None`` means "not given" and is left out, so that the lower layers stay.
    """
    out: dict[str, Any] = {}
    for s in SETTINGS:
        value = values.get(s.name)
        if value is None:
            continue
        target = out.setdefault(s.table, {}) if s.table else out
        target[s.name] = value
    return out


# --------------------------------------------------------------------------------------------
# Validation: one plain mapping in, every problem out


def _as_mapping(config: JobConfig) -> dict[str, Any]:
    """A config's values in the job-file shape (tables as dicts), for :func:`_problems`."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in SECTIONS:
            value = {g.name: getattr(value, g.name) for g in dataclasses.fields(value)}
        out[f.name] = value
    return out


def _unknown(key: str, known: list[str]) -> str:
    close = closest_names(key, known)
    guess = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return f"unknown key {key!r}; {guess}known keys: {', '.join(known)}"


def _key_problems(data: Mapping[str, Any]) -> list[Keyed]:
    """Unknown keys, at the top level and inside the tables, and tables that are not tables."""
    top = [f.name for f in dataclasses.fields(JobConfig)]
    problems = [(k, _unknown(k, top)) for k in data if k not in top]
    for table in SECTIONS:
        values = data.get(table)
        if values is not None and not isinstance(values, Mapping):
            problems.append((table, f"[{table}] must be a table"))
        elif isinstance(values, Mapping):
            known = [s.key for s in SETTINGS if s.table == table]
            names = {s.name for s in SETTINGS if s.table == table}
            problems += [
                (f"{table}.{k}", _unknown(f"{table}.{k}", known)) for k in values if k not in names
            ]
    return problems


def _problems(data: Mapping[str, Any], *, none_is_unset: bool = True) -> list[str]:
    """Every problem of a job in the job-file shape: keys, types, values, and across keys.

    ``none_is_unset``: a None value means "not given" (the default applies), as in the layers
    :func:`build_config` merges; a constructed :class:`JobConfig` holds its values as they are,
    so there None is a problem wherever the key is not optional."""
    return [text for _, text in keyed_problems(data, none_is_unset=none_is_unset)]


def keyed_problems(data: Mapping[str, Any], *, none_is_unset: bool = True) -> list[Keyed]:
    """:func:`_problems`, each with the key it is about."""
    problems = _key_problems(data)
    good: dict[str, Any] = {}  # key -> value of the right type (given or default)
    bad: set[str] = set()
    for s in SETTINGS:
        scope = data.get(s.table) if s.table else data
        value = scope.get(s.name) if isinstance(scope, Mapping) else None
        if value is None and s.required:
            problems.append(
                (
                    s.key,
                    f"{s.key} is required (set it in the job file, as {s.env} or with {s.flag})",
                )
            )
            bad.add(s.key)
            continue
        if value is None and none_is_unset:
            value = s.default
        if not (s.kind.accepts(value) or (value is None and s.kind.optional)):
            if s.kind.name == "table":
                problems.append((s.key, f"[{s.key}] must be a table"))
            else:
                problems.append((s.key, f"{s.key} = {value!r} must be {s.kind.word}"))
            bad.add(s.key)
            continue
        good[s.key] = value
        found = value_problems(s, value)
        problems += [(s.key, p) for p in found]
        if found:
            bad.add(s.key)
    return problems + _cross_problems(good, bad)


def value_problems(s: Setting, value: Any) -> list[str]:
    if value is None:
        return []
    found: list[str] = []
    if s.kind.choices and s.kind.name == "str" and value not in s.kind.choices:
        shown = [repr(c) for c in s.kind.choices]
        found.append(f"{s.key} = {value!r} must be {', '.join(shown[:-1])} or {shown[-1]}")
    for check in s.checks:
        found += check(s.key, value)
    return found


def _cross_problems(good: Mapping[str, Any], bad: set[str]) -> list[Keyed]:
    """Rules that involve more than one key, judged on the keys that are fine on their own;
    each problem is keyed by the key a user would change."""
    problems: list[Keyed] = []
    id_column = good.get("id_column")
    if id_column is not None and id_column in good.get("passthrough", ()):
        problems.append(
            (
                "passthrough",
                f"passthrough names the id column {id_column!r}; it is always copied first",
            )
        )
    if "output" in good and "output" not in bad and good.get("rejects") is None:
        # Placeholders filled with a sample value: the shape of the path is what matters.
        sample = good["output"].format(date="2000-01-01", run_id="run")
        try:
            if default_rejects(good["output"], sample) is None:
                problems.append(("output", _no_parent_message(good["output"])))
        except ConfigError:
            pass  # a template with no fixed root: index_root below says so
    if good.get("storage"):
        problems += [("storage", p) for p in _storage_problems(good)]
    log_days, file_days = (good.get(f"delta.{k}_retention_days") for k in ("log", "deleted_file"))
    if isinstance(log_days, int) and isinstance(file_days, int) and file_days < log_days:
        problems.append(
            (
                "delta.deleted_file_retention_days",
                f"delta.deleted_file_retention_days = {file_days} is shorter than "
                f"delta.log_retention_days = {log_days}: a version whose log is kept must keep "
                "its files, or a rollback to it fails",
            )
        )
    problems += format_problems(good, bad)
    if good.get("engine") == "onnx":
        problems += [("engine", p) for p in _engine_problems(good)]
    if "output" in good and "output" not in bad:
        try:
            index_root(good["output"])  # where the run index lives: checked now, not after scoring
        except ConfigError as e:
            problems += [("output", p) for p in e.problems]
    return problems


def _engine_problems(good: Mapping[str, Any]) -> list[str]:
    """What ``engine = "onnx"`` cannot run with: a missing package, CUDA, another precision."""
    problems = []
    missing = missing_packages(ONNX_PACKAGES)
    if missing:
        problems.append(
            f"engine = 'onnx' needs {', '.join(missing)}, which is not installed here: "
            "pip install 'score-catalog[onnx]', or use engine 'torch' (the default)"
        )
    if str(good.get("device", "")).startswith("cuda"):
        problems.append("engine = 'onnx' runs on the CPU only: use device 'cpu' with it")
    if good.get("precision", "fp32") != "fp32":
        problems.append(
            f"engine = 'onnx' runs fp32 only, not precision {good['precision']!r}: use one or "
            "the other"
        )
    if good.get("compile"):
        problems.append("engine = 'onnx' and compile = true do not go together: use one")
    return problems


_WARNED: set[tuple[str, ...]] = set()


def _storage_problems(good: Mapping[str, Any]) -> list[str]:
    """Storage options that none of the job's object stores takes, each named."""
    uris = [good[k] for k in ("input", "output", "rejects", "model") if good.get(k)]
    unused = tuple(sorted(set(good["storage"]) - {storage_options.RETRY_DEADLINE_OPTION}))
    if unused and all(storage_options.is_local_uri(u) for u in uris) and unused not in _WARNED:
        # Not an error: one job file often serves a laptop (local paths) and production (s3://).
        _WARNED.add(unused)  # once per process: a config is validated at each layer
        logging.getLogger(__name__).warning(
            "storage option%s %s %s ignored: every location of this job is on local disk",
            "s" if len(unused) > 1 else "",
            ", ".join(repr(k) for k in unused),
            "are" if len(unused) > 1 else "is",
        )
    return storage_options.unknown_options(uris, good["storage"])
