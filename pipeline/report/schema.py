"""The shape of ``_report.json``, in code (TypedDicts) and as a committed JSON Schema.

Two descriptions of one document, kept equal by ``tests/report/test_schema.py``:

* the TypedDicts below, which the code that writes and reads reports is typed with, so mypy
  catches a misspelt or missing key;
* ``pipeline/schemas/report.schema.json`` (JSON Schema draft 2020-12), which programs outside
  Python read, and which :func:`validate_report` checks a report against. It refuses unknown
  top-level keys: a new key must be added to the schema (and to :class:`ReportData` and the
  "Run report" table in docs/report.md) in the same change, with a ``schema_version`` bump
  when a reader could be broken by it.

Status and failure-kind values come from :mod:`pipeline.core.statuses`; the schema's ``enum`` lists
are checked against those enums by the tests.

TypedDicts that have keys present only sometimes are split in two: a base class with the keys
every report has (``total=True``) and a ``total=False`` subclass adding the optional ones, which
works on Python 3.10 without ``typing_extensions.NotRequired``.

Over 600 lines on purpose: one TypedDict per object of the schema, each beside its neighbours
as the schema nests them; split, the code's description of one document would be in pieces.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from functools import cache
from importlib import resources
from typing import Any, Literal, TypedDict

from pipeline.core.statuses import FailureKind, RunStatus, ShardStatus

#: The ``schema_version`` this module and the committed schema describe. 3 added the
#: ``interrupted`` status and made the report's shape a committed JSON Schema; 4 the ``verdict``;
#: 5 typed ``output_format`` (the ``delta`` format's table, partition, version and token).
SCHEMA_VERSION = 5
#: Where the schema ships inside the package (``pipeline/schemas/report.schema.json``).
SCHEMA_RESOURCE = "schemas/report.schema.json"


class ReportSchemaError(ValueError):
    """A report that does not match the schema; ``problems`` lists every mismatch found."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        shown = "\n".join(f"  - {p}" for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(
            f"the report does not match report.schema.json (schema_version {SCHEMA_VERSION}): "
            f"{len(problems)} problem(s):\n{shown}{more}"
        )


# ---------------------------------------------------------------- per shard and per error


class RemovedOutput(TypedDict):
    """One entry of ``removed_outputs``: an output this run took out of the dataset."""

    output: str  # the removed file's URI
    reason: str  # its input shard is gone, failed in this run, or was schema-skipped
    rejects: str | None  # its rejects file, removed with it (None: it had none)


class ErrorEntry(TypedDict):
    """One entry of ``errors``: a failed shard, or a shard whose rows did not add up."""

    shard: str  # the shard's input URI
    kind: FailureKind
    message: str


class LossyCastExample(TypedDict):
    """Where a lossy cast was first seen: the shard, the value, what float32 made of it."""

    shard: str  # relative path of the shard
    value: float
    as_float32: float | None  # None when the value overflowed float32 (infinite: not JSON)


class LossyCastEntry(TypedDict):
    """One entry of ``lossy_casts``: a feature column whose values changed as float32."""

    column: str
    from_type: str  # its Arrow type in those shards, e.g. "int64"
    shards: int  # shards of this run in which a value changed
    example: LossyCastExample


class IncrementalCounts(TypedDict):
    """What an incremental run did with one shard's valid rows (``shards[].incremental``)."""

    rows_carried: int
    rows_scored: int
    rows_new: int
    rows_changed: int


class ShardCore(TypedDict):
    """The keys every entry of ``shards`` has."""

    rel_path: str
    input: str
    status: ShardStatus
    output: str | None  # None for a failed shard
    rejects: str | None  # None when the shard rejected no rows
    rows_in: int | None  # None when the footer could not be read
    rows_out: int
    rows_rejected: int
    duration_s: float
    rows_per_s: float
    kind: FailureKind | None  # set for failed shards
    message: str | None
    oom_splits: int
    duplicate_ids: int
    null_ids: int
    rejects_by_reason: dict[str, int]
    started_s: float | None  # seconds since the run started; None when not scored now
    finished_s: float | None


class ShardEntry(ShardCore, total=False):
    """One entry of ``shards``, in input order."""

    incremental: IncrementalCounts  # an incremental run's, for a shard scored now


# ---------------------------------------------------------------- how the run ran


class Parity(TypedDict):
    """``execution.parity``: this precision/device against fp32 on the CPU, on real rows."""

    rows: int
    tolerance: float
    columns: dict[str, dict[str, float]]  # column -> max_abs_diff/mean_abs_diff or mismatch


class ParityWithNote(Parity, total=False):
    reference: str  # "fp32 on the CPU", when rows were compared
    note: str  # why no rows were compared


class BenchRowEntry(TypedDict):
    """One batch size of an auto-batch-size sweep (``pipeline.model.tuning.BenchRow``)."""

    batch: int
    calls: int
    ms: float
    samples_per_s: float
    ms_per_sample: float


class BatchSizeAuto(TypedDict):
    """``execution.batch_size_auto``: how ``batch_size = "auto"`` was resolved."""

    cached: bool
    key: str
    batch_size: int


class BatchSizeAutoWithSweep(BatchSizeAuto, total=False):
    # The CPU the choice was measured on (model and vector extensions): a cached choice is
    # used only on the same CPU model and flags.
    cpu: str
    # Only when measured now (not cached): each size's median pass of the whole pipeline over
    # the sample, the noise between passes, and what the sweep cost.
    basis: Literal["pipeline"]
    noise: float  # written by versions before issue 31's revalidation
    sweep_s: float
    sweep: list[BenchRowEntry]
    note: str  # why nothing was compared, when nothing was
    # Only when cached: the cached size timed against its neighbours in this run.
    revalidation: RevalidationWithPairs


class CallRows(TypedDict):
    """``execution.call_rows``: the rows per model call on this CPU (a batch may run faster in
    slices: :func:`pipeline.model.tuning.choose_call_rows`)."""

    rows: int  # rows per model call; the batch size when batches are not split
    cached: bool
    key: str
    cpu: str


class CallRowsWithSweep(CallRows, total=False):
    # Only when measured now (not cached): each call size's fastest pass over one batch, the
    # noise between passes, what the measurement cost, or why it was not measured.
    noise: float
    note: str
    sweep_s: float
    sweep: list[BenchRowEntry]
    # Only when cached: the cached size timed against its neighbours in this run.
    revalidation: RevalidationWithPairs


class Revalidation(TypedDict):
    """``revalidation`` of ``execution.batch_size_auto`` and ``execution.call_rows``: a cached
    choice timed against its neighbours in this run (docs/tuning.md)."""

    outcome: Literal["kept", "replaced", "skipped"]
    cached: int  # the size the cache held
    chosen: int  # the size this run used (and the cache now holds)
    seconds: float  # what the revalidation cost


class RevalidationPair(TypedDict):
    size: int  # a neighbour of the cached size
    ratios: list[float]  # its pass's seconds / the cached size's, round by round


class Streak(TypedDict):
    size: int  # the neighbour that won the last pairs in a row
    wins: int  # how many in a row (two replace the cached size)


class RevalidationWithPairs(Revalidation, total=False):
    pairs: list[RevalidationPair]  # absent when skipped
    streak: Streak | None  # carried to the next run
    note: str  # why it was skipped


class ExecutionBase(TypedDict):
    precision: Literal["fp32", "bf16", "fp16", "int8"]
    compile: bool
    compile_s: float | None
    tf32: bool
    overlap: bool
    parity: ParityWithNote | None  # None when running fp32 torch on the CPU
    batch_size_auto: BatchSizeAutoWithSweep | None  # None for a fixed batch size


class Execution(ExecutionBase, total=False):
    # What ran the model: torch, or ONNX Runtime (engine = "onnx"); absent from reports of
    # versions before the engine key.
    engine: Literal["torch", "onnx"]
    # Rows per model call (None on CUDA, with --compile, or for a job of under 8 batches);
    # absent from reports of versions before it.
    call_rows: CallRowsWithSweep | None


class ThreadsInfo(TypedDict):
    scheduler: str  # local, threads, sync, or a scheduler address
    cores: int
    workers: int | None  # None on an existing cluster (its own size)
    threads_per_worker: int | None
    torch_threads: int | None  # None: each worker derives its own


class ModelInfo(TypedDict):
    uri: str
    name: str
    version: str
    format: Literal["exported_program", "torchscript"]
    sha256: str
    width: int
    out_width: int


class RegistryInfo(TypedDict):
    """``model.registry``: the registered version a ``models:/`` URI resolved to."""

    uri: str  # as configured: models:/NAME/VERSION or models:/NAME@ALIAS
    name: str
    version: str
    alias: str | None
    run_id: str | None  # the MLflow run whose artifacts hold the bundle
    path: str  # the local folder the bundle was downloaded to


class ModelInfoWithRegistry(ModelInfo, total=False):
    # Written by every run (null for a bundle given by its location); absent from reports of
    # versions before model registries.
    registry: RegistryInfo | None


class ScoringSettings(TypedDict):
    """``settings``: what is hashed into the manifest; a change rescores every shard."""

    inputs: list[str]
    outputs: list[list[str]]  # [name, transform description] per output column
    id_column: str
    passthrough: list[str]
    precision: Literal["fp32", "bf16", "fp16", "int8"]


class ScoringSettingsWithVersion(ScoringSettings, total=False):
    model_version: str  # a model from a registry: models:/NAME/VERSION, as every output row says
    engine: Literal["onnx"]  # engine = "onnx" (absent for torch, the default)
    fingerprint: Literal[True]  # rows carry model_input_hash (docs/incremental.md)


class ErrorBudget(TypedDict):
    max_failed_shards: int
    max_rejected_fraction: float


class LockHolder(TypedDict):
    """``lock_taken_over``: the stale lock's holder (its token left out) and why it was stale."""

    run_id: str
    reason: str


class LockHolderDetails(LockHolder, total=False):
    # Locks written by older versions carry fewer of these; other keys are allowed too.
    host: str
    boot_id: str | None
    pid_ns: str | None
    pid: int
    pid_start: str | None  # the process start time, clock ticks since boot
    started_at: str
    started_ts: float
    heartbeat_ts: float


class Versions(TypedDict):
    python: str
    torch: str
    pyarrow: str
    dask: str


class BatchLatency(TypedDict):
    """Model-call latency in milliseconds; all None when nothing was scored."""

    p50: float | None
    p95: float | None
    p99: float | None


# ---------------------------------------------------------------- scores


class Quantiles(TypedDict):
    p01: float
    p05: float
    p25: float
    p50: float
    p75: float
    p95: float
    p99: float


class Histogram(TypedDict):
    edges: list[float]  # bins + 1 edges; [v, v] for all-equal values; [] for none
    counts: list[int]


class ValueCounts(TypedDict):
    """Rows per value of a discrete column (all sampled values integers, at most 20 of them)."""

    values: list[float]  # ascending; whole numbers
    counts: list[int]


class OutputCount(TypedDict):
    count: int


class OutputStats(OutputCount, total=False):
    """``outputs[column]``: absent keys mean no rows (``count`` 0) or no sample."""

    mean: float | None
    min: float | None
    max: float | None
    quantiles: Quantiles
    sketch: list[float]  # SKETCH_POINTS (101) quantiles, or [] when no finite score was sampled
    histogram: Histogram
    value_counts: ValueCounts  # only for a discrete column: argmax labels, 0/1 outputs


class ThroughputPoint(TypedDict):
    t_s: float
    rows: int


# ---------------------------------------------------------------- drift


class DriftNote(TypedDict):
    """``drift`` when there was nothing to compare with (first run, nothing scored...)."""

    baseline: None
    note: str


class DriftBaseline(TypedDict):
    run_id: str | None
    output: str | None
    finished_at: str | None


class DriftRows(TypedDict):
    previous: int | None
    current: int | None
    change: float | None  # current / previous - 1


class DriftColumn(TypedDict):
    psi: float | None
    ks: float | None
    alert: bool


class DriftThresholdValues(TypedDict):
    psi: float
    ks: float
    rows_change: float


class DriftComparison(TypedDict):
    """``drift`` against the baseline (``pipeline.report.verdict``,
    ``pipeline.report.drift.compare``)."""

    baseline: DriftBaseline
    rows: DriftRows
    columns: dict[str, DriftColumn]
    thresholds: DriftThresholdValues
    alert: bool
    reasons: list[str]


class DriftAcceptance(TypedDict):
    """Who accepted a dataset's drift alert, when and why (``score-catalog accept-drift``)."""

    by: str
    at: str
    reason: str


class Verdict(TypedDict):
    """``verdict``: the drift verdict on the dataset the output holds
    (``pipeline.report.verdict``)."""

    dataset: str  # a hash of the output's content: shards, input versions, model, settings
    judged_by: str  # the run that compared this dataset with the previous one
    judged_at: str
    reused: bool  # this run left the dataset unchanged and kept that run's verdict
    accepted: DriftAcceptance | None


# ---------------------------------------------------------------- the report


class RecoveredCommit(TypedDict):
    """``output_format.recovered``: an earlier run's commit that landed before it stopped."""

    run_id: str | None
    table_version: int | None


class OutputFormatCore(TypedDict):
    """The key every ``output_format`` has."""

    format: str  # "parquet_folder", "delta" or "iceberg"


class OutputFormatSection(OutputFormatCore, total=False):
    """``output_format``: where the scores went (pipeline.sinks): the format, and, for a
    table, what it says of the run's commit, with the heading and summary line the report
    renders without knowing the format."""

    title: str
    summary: str
    table: str
    catalog: str | dict[str, str]  # iceberg: the catalog's URI, or its properties (no secret)
    identifier: str  # iceberg: namespace.table
    partition: str | None
    app_id: str
    run_version: int | None
    version: int | None
    snapshot_id: int | None  # iceberg
    committed: bool
    files_added: int
    files_removed: int
    recovered: RecoveredCommit
    commit_s: float  # the sink's commit, after the report's duration_s was taken


class IncrementalBaseline(TypedDict):
    """``incremental.baseline``: the dataset an incremental night carried scores from."""

    run_id: str | None
    output: str | None
    date: str | None
    version: int | None
    files: int
    files_skipped: int
    rows: int


class IncrementalSection(IncrementalCounts):
    """``incremental``: an incremental night (pipeline.driver.incremental)."""

    rows_kept: int
    rows_removed: int | None
    baseline: IncrementalBaseline | None
    full_reason: str | None


class ReportCore(TypedDict):
    """The keys every ``_report.json`` of ``schema_version`` 5 has."""

    schema_version: int
    run_id: str
    job: str
    status: RunStatus
    failure_reasons: list[str]
    started_at: str
    finished_at: str
    duration_s: float
    input: str
    output: str
    rejects: str
    rows_in: int
    rows_out: int
    rows_rejected: int
    rows_processed: int
    rows_per_s: float
    rejected_fraction: float
    accounting_ok: bool
    shards_total: int
    shards_scored: int
    shards_skipped: int
    shards_failed: int
    shards_not_scored: int
    batch_size: int
    execution: Execution
    device: str
    threads: ThreadsInfo
    model: ModelInfoWithRegistry
    settings: ScoringSettingsWithVersion
    error_budget: ErrorBudget
    lock_taken_over: LockHolderDetails | None
    oom_splits: int
    duplicate_ids: int
    null_ids: int
    versions: Versions
    batch_latency_ms: BatchLatency
    outputs: dict[str, OutputStats]
    rejects_by_reason: dict[str, int]
    throughput: list[ThroughputPoint]
    drift: DriftComparison | DriftNote | None  # None when [monitoring] drift is off or failed
    verdict: Verdict | None  # None where drift is
    errors: list[ErrorEntry]
    warnings: list[str]
    lossy_casts: list[LossyCastEntry]  # feature columns that lost precision as float32
    removed_outputs: list[RemovedOutput]  # taken out of the dataset by this run (reconcile)
    foreign_removed: list[str]  # files this tool did not write, deleted (on_foreign_output)
    foreign_kept: list[str]  # visible files this tool did not write, left alone
    shards: list[ShardEntry]


class ReportData(ReportCore, total=False):
    """Every key of ``_report.json`` (``schema_version`` 5): the core ones, always present, and
    those added since (absent from older reports)."""

    output_format: OutputFormatSection
    incremental: IncrementalSection | None


#: Each TypedDict and the JSON pointer of the schema object it describes (checked by the tests).
SCHEMA_OBJECTS: dict[str, type] = {
    "#": ReportData,
    "#/$defs/shard": ShardEntry,
    "#/$defs/output_format": OutputFormatSection,
    "#/$defs/incremental": IncrementalSection,
    "#/$defs/incremental_counts": IncrementalCounts,
    "#/$defs/incremental_baseline": IncrementalBaseline,
    "#/$defs/recovered_commit": RecoveredCommit,
    "#/$defs/error": ErrorEntry,
    "#/$defs/lossy_cast": LossyCastEntry,
    "#/$defs/lossy_cast_example": LossyCastExample,
    "#/$defs/removed_output": RemovedOutput,
    "#/$defs/execution": Execution,
    "#/$defs/parity": ParityWithNote,
    "#/$defs/batch_size_auto": BatchSizeAutoWithSweep,
    "#/$defs/call_rows": CallRowsWithSweep,
    "#/$defs/revalidation": RevalidationWithPairs,
    "#/$defs/revalidation_pair": RevalidationPair,
    "#/$defs/streak": Streak,
    "#/$defs/bench_row": BenchRowEntry,
    "#/$defs/threads": ThreadsInfo,
    "#/$defs/model": ModelInfoWithRegistry,
    "#/$defs/registry": RegistryInfo,
    "#/$defs/settings": ScoringSettingsWithVersion,
    "#/$defs/error_budget": ErrorBudget,
    "#/$defs/lock_holder": LockHolderDetails,
    "#/$defs/versions": Versions,
    "#/$defs/batch_latency": BatchLatency,
    "#/$defs/output_stats": OutputStats,
    "#/$defs/quantiles": Quantiles,
    "#/$defs/histogram": Histogram,
    "#/$defs/value_counts": ValueCounts,
    "#/$defs/throughput_point": ThroughputPoint,
    "#/$defs/drift_note": DriftNote,
    "#/$defs/drift_comparison": DriftComparison,
    "#/$defs/drift_baseline": DriftBaseline,
    "#/$defs/drift_rows": DriftRows,
    "#/$defs/drift_column": DriftColumn,
    "#/$defs/drift_thresholds": DriftThresholdValues,
    "#/$defs/verdict": Verdict,
    "#/$defs/drift_acceptance": DriftAcceptance,
}


@cache
def _schema_text() -> str:
    return resources.files("pipeline").joinpath(SCHEMA_RESOURCE).read_text(encoding="utf-8")


def report_schema() -> dict[str, Any]:
    """The committed JSON Schema of ``_report.json`` (a fresh copy each call)."""
    schema: dict[str, Any] = json.loads(_schema_text())
    return schema


def _non_finite(value: Any, path: str = "$") -> Iterator[str]:
    """Where NaN and infinities are: Python's ``json`` reads and writes them; JSON has none."""
    if isinstance(value, float) and not math.isfinite(value):
        yield f"{path}: {value!r} is not a JSON number (NaN and Infinity are not JSON)"
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _non_finite(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _non_finite(v, f"{path}[{i}]")


def validate_report(data: Any) -> None:
    """Raise :class:`ReportSchemaError` listing every way ``data`` differs from the schema.

    ``data`` is a parsed ``_report.json`` of ``schema_version`` 5 (older reports are not
    checked against it). Beyond the schema, NaN and infinite numbers are refused: Python's
    ``json`` writes them as ``NaN``/``Infinity`` tokens, which are not JSON and which strict
    parsers (``jq``, browsers, Go, Java) reject.

    This needs ``jsonschema``, a development dependency (the ``dev`` extra): validation is a
    test-time facility, and a runtime without ``jsonschema`` gets an ``ImportError`` naming
    the extra rather than an unchecked pass.
    """
    try:
        import jsonschema
    except ImportError as e:  # pragma: no cover - the dev extra installs it
        raise ImportError(
            "validate_report needs jsonschema: pip install 'score-catalog[dev]' "
            "(or pip install jsonschema)"
        ) from e
    validator = jsonschema.Draft202012Validator(report_schema())
    problems = []
    for err in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.path))):
        message = err.message
        # anyOf: say why the closest alternative failed; "is not null" says nothing useful.
        context = [c for c in err.context or () if c.validator_value != "null"]
        if context:
            best = jsonschema.exceptions.best_match(context)
            if best is not None:
                message += f" (closest: {best.json_path}: {best.message})"
        problems.append(f"{err.json_path}: {message}")
    problems += list(_non_finite(data))
    if problems:
        raise ReportSchemaError(problems)
