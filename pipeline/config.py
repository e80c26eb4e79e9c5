"""The job configuration: one frozen object built from job file < environment < flags.

Every layer is merged into one plain mapping first and validated once, so that a user sees every
bad field in one message instead of fixing them one run at a time.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
import re
import string
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pipeline.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

ENV_PREFIX = "SCORE_CATALOG_"
SCHEDULER_NAMES = ("local", "threads", "sync")
PRECISIONS = ("fp32", "bf16", "fp16", "int8")
TEMPLATE_FIELDS = frozenset({"date", "run_id"})
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_SCHEDULER_URI_RE = re.compile(r"^(tcp|tls|inproc|ucx)://\S+$")


@dataclass(frozen=True, kw_only=True)
class ErrorPolicy:
    """How much can go wrong before a run counts as failed (the ``[errors]`` table)."""

    # Shards that may fail (unreadable, schema-skipped, crashed) while the run still succeeds.
    max_failed_shards: int = 0
    # Fraction of readable input rows that may be rejected (null/NaN/inf features, model errors).
    max_rejected_fraction: float = 0.01
    # "fail": a readable shard whose columns do not fit the model stops the run before scoring
    # (exit 3). "skip_shard": that shard is listed as failed and the others are scored.
    on_schema_error: str = "fail"
    # "reject": rows with null/NaN/inf features go to the rejects dataset. "fail": the first such
    # row fails its shard, naming shard, row group and id.
    on_invalid_rows: str = "reject"
    # How many times a crashed shard task is retried before it counts as failed.
    task_retries: int = 2


@dataclass(frozen=True, kw_only=True)
class Monitoring:
    """Drift of the score distributions against the previous successful run (``[monitoring]``).

    Crossing a threshold makes the run ``succeeded_with_warnings`` (exit code 4); the scores are
    still written and ``_SUCCESS`` still marks them complete.
    """

    # Compare with the previous successful run of the same job (found in the run index).
    drift: bool = True
    # Population stability index per output column, over the previous run's deciles.
    psi_threshold: float = 0.25
    # Kolmogorov-Smirnov statistic per output column (largest gap between the two CDFs).
    ks_threshold: float = 0.2
    # Largest allowed |rows scored now / rows scored then - 1|.
    rows_change_threshold: float = 0.5


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A validated scoring job. Build it with :func:`load_config` or directly with keywords."""

    # Input shards: a directory (every *.parquet below it, sorted, skipping _ and . names),
    # a glob, or a single file; local paths or fsspec URIs. May contain {date}.
    input: str
    # Output root for scored shards, _report.json, _manifest.json and _SUCCESS. May contain
    # {date} and {run_id}. Resume needs the same output on the rerun, so avoid {run_id} there.
    output: str
    # Model bundle directory (model.toml + weights).
    model: str
    # Name shown in reports and metrics; defaults to the job file's stem.
    name: str = "score-catalog"
    # Column that identifies a row; copied first into every output row.
    id_column: str = "item_id"
    # Columns copied unchanged to the output after the id, in this order.
    passthrough: tuple[str, ...] = ()
    # Rows per model call (the last batch of a shard may be shorter), or "auto": measured on
    # real rows (start at 32, double while throughput gains >= 5%), cached per model/device/
    # precision.
    batch_size: int | str = 4096
    # auto (cuda when available, else cpu), cpu, cuda or cuda:N.
    device: str = "auto"
    # local (embedded Dask cluster), threads, sync (in-process, for debugging) or tcp://HOST:PORT.
    scheduler: str = "local"
    # Dask worker processes for scheduler=local; None sizes it to the cores.
    workers: int | None = None
    # CPU cores the job may use (workers x threads x torch threads stay within it); None: all.
    cores: int | None = None
    # fp32, bf16 (autocast, CPU and CUDA), fp16 (CUDA) or int8 (dynamic, Linear layers, CPU).
    precision: str = "fp32"
    # torch.compile the model (compile time is reported).
    compile: bool = False
    # On CUDA, fp32 matmuls may use TF32 unless this is set.
    strict_fp32: bool = False
    # Max |difference| from the fp32 CPU reference on the parity sample (labels: share that
    # differ); None: the precision's default.
    parity_tolerance: float | None = None
    # Read the next batches and write finished ones in background threads, alongside the model.
    # On 2 CPU cores it cost 11% of W1's throughput but kept memory flat (10x rows: 1.18x peak
    # RSS with it, 1.68x without; BENCHMARKS.md), so it stays on by default.
    overlap: bool = True
    # Where rejected rows go (template like output); None means <output>/_rejects.
    rejects: str | None = None
    # The date that {date} expands to (YYYY-MM-DD); None means today (UTC).
    date: str | None = None
    # Rescore every shard even where the manifest says it is done.
    force: bool = False
    # A lock older than this many seconds is taken over even if its holder seems alive.
    stale_lock_after_s: float = 6 * 3600.0
    # Target rows per Dask task: shards smaller than this are grouped into one task so that
    # scheduling and commit overhead do not dominate; a bigger shard is its own task (streamed by
    # row group). The target shrinks so that every worker thread gets at least 4 tasks.
    task_rows: int = 262_144
    # Dask resources each task asks for on an existing cluster, e.g. {GPU = 1} for workers
    # started with --resources GPU=1 (one worker per GPU).
    resources: Mapping[str, float] = field(default_factory=dict)
    # Prometheus textfile (node_exporter textfile-collector convention) written after the run.
    metrics_file: str | None = None
    # Prometheus Pushgateway URL to push the same metrics to.
    pushgateway: str | None = None
    errors: ErrorPolicy = field(default_factory=ErrorPolicy)
    monitoring: Monitoring = field(default_factory=Monitoring)
    # Options passed unchanged to fsspec for every URI of the job (endpoint_url, key, ...).
    storage: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = _validate(self)
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
        """Where rejected rows go for this run."""
        if self.rejects is None:
            return self.output_uri(run_id).rstrip("/") + "/_rejects"
        return self.rejects.format(date=self.run_date, run_id=run_id)

    def redacted(self) -> dict[str, Any]:
        """A JSON-able view for logs and reports: storage option values are never shown."""
        d = dataclasses.asdict(self)
        d["passthrough"] = list(self.passthrough)
        d["storage"] = {k: "***" for k in self.storage}
        return d


# Keys accepted at the top level of a job file / as SCORE_CATALOG_<KEY>, with their parsers.
_TOP_KEYS: dict[str, str] = {
    "name": "str",
    "input": "str",
    "output": "str",
    "model": "str",
    "id_column": "str",
    "passthrough": "list",
    "batch_size": "int_or_auto",
    "cores": "int",
    "precision": "str",
    "compile": "bool",
    "strict_fp32": "bool",
    "parity_tolerance": "float",
    "overlap": "bool",
    "device": "str",
    "scheduler": "str",
    "workers": "int",
    "rejects": "str",
    "date": "str",
    "force": "bool",
    "stale_lock_after_s": "float",
    "task_rows": "int",
    "metrics_file": "str",
    "pushgateway": "str",
}
_MONITORING_KEYS: dict[str, str] = {
    "drift": "bool",
    "psi_threshold": "float",
    "ks_threshold": "float",
    "rows_change_threshold": "float",
}
_ERROR_KEYS: dict[str, str] = {
    "max_failed_shards": "int",
    "max_rejected_fraction": "float",
    "on_schema_error": "str",
    "on_invalid_rows": "str",
    "task_retries": "int",
}
# Sub-tables whose keys are also SCORE_CATALOG_<KEY> variables.
_TABLES: dict[str, dict[str, str]] = {"errors": _ERROR_KEYS, "monitoring": _MONITORING_KEYS}
_FREE_TABLES = ("storage", "resources")  # passed on unchanged
_TYPE_CHECK = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "list": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
    "int_or_auto": lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool)),
}
_TYPE_WORDS = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "list": "a list of strings",
    "int_or_auto": 'an integer or "auto"',
}


def _parse_env_value(kind: str, raw: str) -> Any:
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    if kind == "bool":
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(raw)
    if kind == "list":
        return [p.strip() for p in raw.split(",") if p.strip()]
    if kind == "int_or_auto":
        return "auto" if raw.strip().lower() == "auto" else int(raw)
    return raw


def _env_layer(env: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    top: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {t: {} for t in _TABLES}
    problems: list[str] = []
    for var, raw in sorted(env.items()):
        if not var.startswith(ENV_PREFIX):
            continue
        key = var[len(ENV_PREFIX) :].lower()
        if key in _TOP_KEYS:
            target, kind = top, _TOP_KEYS[key]
        else:
            table = next((t for t, keys in _TABLES.items() if key in keys), None)
            if table is None:
                names = [*_TOP_KEYS, *(k for keys in _TABLES.values() for k in keys)]
                known = ", ".join(ENV_PREFIX + k.upper() for k in names)
                problems.append(f"unknown environment variable {var}; known ones: {known}")
                continue
            target, kind = tables[table], _TABLES[table][key]
        try:
            target[key] = _parse_env_value(kind, raw)
        except ValueError:
            problems.append(f"{var}={raw!r} is not {_TYPE_WORDS[kind]}")
    top.update({t: values for t, values in tables.items() if values})
    return top, problems


def read_job_file(path: str | Path) -> dict[str, Any]:
    """Parse a TOML job file into a plain mapping (no validation yet)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"job file {p} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"job file {p} is not valid TOML: {e}") from e


def _merge(layers: list[Mapping[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for layer in layers:
        for k, v in layer.items():
            if v is None:
                continue
            if k in (*_TABLES, *_FREE_TABLES) and isinstance(v, Mapping):
                base = dict(merged.get(k) or {})
                base.update({ek: ev for ek, ev in v.items() if ev is not None})
                merged[k] = base
            else:
                merged[k] = v
    return merged


def build_config(
    job_file: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> JobConfig:
    """Build a :class:`JobConfig` from a job file, then ``SCORE_CATALOG_*`` variables, then flags.

    Later layers win. ``overrides`` uses job-file key names; ``None`` values mean "not given".
    Every problem in every layer is reported in one :class:`ConfigError`.
    """
    source = str(job_file) if job_file else None
    layers: list[Mapping[str, Any]] = []
    problems: list[str] = []
    if job_file is not None:
        data = read_job_file(job_file)
        data.setdefault("name", Path(job_file).stem)
        layers.append(data)
    env_top, env_problems = _env_layer(os.environ if env is None else env)
    problems += env_problems
    layers.append(env_top)
    if overrides:
        layers.append(overrides)
    merged = _merge(layers)
    raw_problems = _check_raw(merged)
    if problems or raw_problems:
        # Still check the values of the well-typed keys, so that one message lists everything.
        raise ConfigError(problems + raw_problems + _value_problems(merged), source)
    errors_raw = dict(merged.pop("errors", {}) or {})
    monitoring_raw = dict(merged.pop("monitoring", {}) or {})
    storage = dict(merged.pop("storage", {}) or {})
    resources = dict(merged.pop("resources", {}) or {})
    if "passthrough" in merged:
        merged["passthrough"] = tuple(merged["passthrough"])
    try:
        return JobConfig(
            **merged,
            errors=ErrorPolicy(**errors_raw),
            monitoring=Monitoring(**monitoring_raw),
            storage=storage,
            resources=resources,
        )
    except ConfigError as e:
        raise ConfigError(e.problems, source) from None


def _check_raw(merged: Mapping[str, Any]) -> list[str]:
    """Key names and types; value rules live in :func:`_validate`."""
    problems: list[str] = []
    for key, value in merged.items():
        if key in (*_TABLES, *_FREE_TABLES):
            if not isinstance(value, Mapping):
                problems.append(f"[{key}] must be a table")
            continue
        if key not in _TOP_KEYS:
            problems.append(_unknown(key, [*_TOP_KEYS, *_TABLES, *_FREE_TABLES]))
        elif not _TYPE_CHECK[_TOP_KEYS[key]](value):
            problems.append(f"{key} = {value!r} must be {_TYPE_WORDS[_TOP_KEYS[key]]}")
    for table, keys in _TABLES.items():
        values = merged.get(table)
        if not isinstance(values, Mapping):
            continue
        for key, value in values.items():
            if key not in keys:
                problems.append(_unknown(f"{table}.{key}", [f"{table}.{k}" for k in keys]))
            elif not _TYPE_CHECK[keys[key]](value):
                problems.append(f"{table}.{key} = {value!r} must be {_TYPE_WORDS[keys[key]]}")
    resources = merged.get("resources")
    if isinstance(resources, Mapping):
        for key, value in resources.items():
            if not _TYPE_CHECK["float"](value) or value <= 0:
                problems.append(f"resources.{key} = {value!r} must be a number > 0")
    for required in ("input", "output", "model"):
        if not merged.get(required):
            problems.append(
                f"{required} is required (set it in the job file, as "
                f"{ENV_PREFIX}{required.upper()} or with --{required})"
            )
    return problems


def _value_problems(merged: Mapping[str, Any]) -> list[str]:
    """Value rules for the keys that have the right type, on top of the defaults."""
    good = {k: v for k, v in merged.items() if k in _TOP_KEYS and _TYPE_CHECK[_TOP_KEYS[k]](v)}
    good_tables = {}
    for table, keys in _TABLES.items():
        raw = merged.get(table) if isinstance(merged.get(table), Mapping) else {}
        good_tables[table] = {
            k: v for k, v in (raw or {}).items() if k in keys and _TYPE_CHECK[keys[k]](v)
        }
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(JobConfig)
        if f.default is not dataclasses.MISSING
    }
    candidate = SimpleNamespace(
        **{
            **defaults,
            "input": "-",
            "output": "-",
            "model": "-",
            **good,
            "passthrough": tuple(good.get("passthrough", ())),
            "errors": ErrorPolicy.__new__(ErrorPolicy),
            "monitoring": Monitoring.__new__(Monitoring),
        },
    )
    for table, cls in (("errors", ErrorPolicy), ("monitoring", Monitoring)):
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            value = good_tables[table].get(f.name, f.default)
            object.__setattr__(getattr(candidate, table), f.name, value)
    return _validate(candidate)  # type: ignore[arg-type]


def _unknown(key: str, known: list[str]) -> str:
    return f"unknown key {key!r}; known keys: {', '.join(known)}"


def _template_problems(
    key: str, template: str, allowed: frozenset[str] = TEMPLATE_FIELDS
) -> list[str]:
    try:
        parsed = [
            (f, spec, conv)
            for _, f, spec, conv in string.Formatter().parse(template)
            if f is not None
        ]
    except ValueError as e:
        return [f"{key} = {template!r} is not a valid template: {e}"]
    if any(spec or conv for _, spec, conv in parsed):
        return [f"{key} = {template!r}: placeholders take no format spec; write {{date}}"]
    fields = {f for f, _, _ in parsed}
    bad = fields - allowed
    if bad:
        names = ", ".join(f"{{{a}}}" for a in sorted(allowed))
        return [f"{key} = {template!r} uses unknown placeholder(s) {sorted(bad)}; allowed: {names}"]
    return []


def _validate(c: JobConfig) -> list[str]:
    p: list[str] = []
    for key in ("input", "output", "model", "id_column", "name"):
        if not getattr(c, key):
            p.append(f"{key} must not be empty")
    p += _template_problems("input", c.input, frozenset({"date"}))
    p += _template_problems("output", c.output)
    if c.rejects is not None:
        p += _template_problems("rejects", c.rejects)
    if c.batch_size != "auto" and (
        isinstance(c.batch_size, bool) or not isinstance(c.batch_size, int) or c.batch_size < 1
    ):
        p.append(f'batch_size = {c.batch_size!r} must be an integer >= 1 or "auto"')
    if c.cores is not None and (not isinstance(c.cores, int) or c.cores < 1):
        p.append(f"cores = {c.cores!r} must be an integer >= 1")
    if c.precision not in PRECISIONS:
        p.append(f"precision = {c.precision!r} is not one of {', '.join(PRECISIONS)}")
    if c.parity_tolerance is not None and not (
        math.isfinite(c.parity_tolerance) and c.parity_tolerance >= 0
    ):
        p.append(f"parity_tolerance = {c.parity_tolerance!r} must be a number >= 0")
    if not _DEVICE_RE.match(str(c.device)):
        p.append(f"device = {c.device!r} is not one of auto, cpu, cuda, cuda:N")
    if c.scheduler not in SCHEDULER_NAMES and not _SCHEDULER_URI_RE.match(str(c.scheduler)):
        p.append(
            f"scheduler = {c.scheduler!r} is not one of local, threads, sync or a scheduler "
            "address such as tcp://HOST:PORT"
        )
    if c.workers is not None and (not isinstance(c.workers, int) or c.workers < 1):
        p.append(f"workers = {c.workers!r} must be an integer >= 1")
    if len(set(c.passthrough)) != len(c.passthrough):
        p.append(f"passthrough = {list(c.passthrough)} names a column twice")
    if c.id_column in c.passthrough:
        p.append(f"passthrough names the id column {c.id_column!r}; it is always copied first")
    if c.date is not None:
        try:
            if not _DATE_RE.match(c.date):
                raise ValueError(c.date)
            dt.date.fromisoformat(c.date)
        except ValueError:
            p.append(f"date = {c.date!r} is not a date in YYYY-MM-DD form")
    if not (math.isfinite(c.stale_lock_after_s) and c.stale_lock_after_s > 0):
        p.append(f"stale_lock_after_s = {c.stale_lock_after_s!r} must be > 0")
    e = c.errors
    if e.max_failed_shards < 0:
        p.append(f"errors.max_failed_shards = {e.max_failed_shards} must be >= 0")
    if not 0.0 <= e.max_rejected_fraction <= 1.0:  # also false for NaN
        p.append(f"errors.max_rejected_fraction = {e.max_rejected_fraction} must be in [0, 1]")
    if e.on_schema_error not in ("fail", "skip_shard"):
        p.append(f"errors.on_schema_error = {e.on_schema_error!r} must be 'fail' or 'skip_shard'")
    if e.on_invalid_rows not in ("reject", "fail"):
        p.append(f"errors.on_invalid_rows = {e.on_invalid_rows!r} must be 'reject' or 'fail'")
    if e.task_retries < 0:
        p.append(f"errors.task_retries = {e.task_retries} must be >= 0")
    if not isinstance(c.task_rows, int) or c.task_rows < 1:
        p.append(f"task_rows = {c.task_rows!r} must be an integer >= 1")
    if not any("output" in problem for problem in p):
        from pipeline.runindex import index_root

        try:
            index_root(c.output)  # where the run index lives: checked now, not after scoring
        except ConfigError as e:
            p += e.problems
    m = c.monitoring
    for key in ("psi_threshold", "ks_threshold", "rows_change_threshold"):
        value = getattr(m, key)
        if not (math.isfinite(value) and value >= 0):
            p.append(f"monitoring.{key} = {value!r} must be a number >= 0")
    if c.pushgateway is not None and not re.match(r"^https?://\S+$", c.pushgateway):
        p.append(f"pushgateway = {c.pushgateway!r} must be an http:// or https:// URL")
    return p
