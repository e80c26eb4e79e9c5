"""The job configuration: one frozen object built from job file < environment < flags.

The dataclasses below are the only description of a job's keys. Each field's type hint gives
the key's type (``Literal[...]`` its allowed values), its default the default, and its metadata
the value rules and the command-line text; :data:`SETTINGS` is derived from them and read by
the job-file and environment loaders, by the validator and by ``pipeline.cli`` (its options,
choices and defaults). Adding a key means adding one field.

Every layer is merged into one plain mapping first and validated once, so that a user sees every
bad field in one message instead of fixing them one run at a time.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import difflib
import logging
import math
import os
import re
import string
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from pipeline.core import storage_options
from pipeline.core.errors import ConfigError
from pipeline.core.templates import default_rejects, fixed_part, index_root

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

ENV_PREFIX = "SCORE_CATALOG_"
SCHEDULER_NAMES = ("local", "threads", "sync")
TEMPLATE_FIELDS = frozenset({"date", "run_id"})
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_SCHEDULER_URI_RE = re.compile(r"^(tcp|tls|inproc|ucx)://\S+$")
_URL_RE = re.compile(r"^https?://\S+$")

Precision = Literal["fp32", "bf16", "fp16", "int8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)

# A value rule: (dotted key, a value of the right type) -> the problems, each naming key and value.
Check = Callable[[str, Any], list[str]]
# A problem and the dotted key (or environment variable) it is about, so that build_config
# can name where that key's value came from.
Keyed = tuple[str, str]


# --------------------------------------------------------------------------------------------
# Value rules, attached to fields through their metadata


def _nonempty(key: str, value: Any) -> list[str]:
    return [] if value else [f"{key} must not be empty"]


def _at_least(low: float, word: str = "an integer", *, strictly: bool = False) -> Check:
    """``value >= low`` (``> low`` if strictly); NaN and infinities fail too."""
    op = ">" if strictly else ">="

    def check(key: str, value: Any) -> list[str]:
        ok = math.isfinite(value) and (value > low if strictly else value >= low)
        return [] if ok else [f"{key} = {value!r} must be {word} {op} {low:g}"]

    return check


def _fraction(key: str, value: float) -> list[str]:
    if 0.0 <= value <= 1.0:  # also false for NaN
        return []
    return [f"{key} = {value!r} must be in [0, 1]"]


def _batch_size(key: str, value: int | str) -> list[str]:
    if value == "auto" or (isinstance(value, int) and value >= 1):
        return []
    return [f'{key} = {value!r} must be an integer >= 1 or "auto"']


def _template(*allowed: str) -> Check:
    names = frozenset(allowed)

    def check(key: str, value: str) -> list[str]:
        return _template_problems(key, value, names)

    return check


def _template_problems(key: str, template: str, allowed: frozenset[str]) -> list[str]:
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
    bad = {f for f, _, _ in parsed} - allowed
    if bad:
        names = ", ".join(f"{{{a}}}" for a in sorted(allowed))
        return [f"{key} = {template!r} uses unknown placeholder(s) {sorted(bad)}; allowed: {names}"]
    return []


def _device(key: str, value: str) -> list[str]:
    if _DEVICE_RE.match(value):
        return []
    return [f"{key} = {value!r} is not one of auto, cpu, cuda, cuda:N"]


def _scheduler(key: str, value: str) -> list[str]:
    if value in SCHEDULER_NAMES or _SCHEDULER_URI_RE.match(value):
        return []
    return [
        f"{key} = {value!r} is not one of {', '.join(SCHEDULER_NAMES)} or a scheduler address "
        "such as tcp://HOST:PORT"
    ]


def _date(key: str, value: str) -> list[str]:
    try:
        if not _DATE_RE.match(value):
            raise ValueError(value)
        dt.date.fromisoformat(value)
    except ValueError:
        return [f"{key} = {value!r} is not a date in YYYY-MM-DD form"]
    return []


def _distinct(key: str, value: tuple[str, ...] | list[str]) -> list[str]:
    if len(set(value)) == len(value):
        return []
    return [f"{key} = {list(value)} names a column twice"]


def _positive_entries(key: str, value: Mapping[str, Any]) -> list[str]:
    return [
        f"{key}.{name} = {v!r} must be a number > 0"
        for name, v in value.items()
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0
    ]


def _url(key: str, value: str) -> list[str]:
    return [] if _URL_RE.match(value) else [f"{key} = {value!r} must be an http:// or https:// URL"]


def _meta(
    help: str = "",
    *,
    checks: tuple[Check, ...] = (),
    flag: str | None = "",
    metavar: str | None = None,
    commands: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """A field's metadata: ``help`` (the --help text), value ``checks``, the command-line
    ``flag`` (default ``--field-name``; None: not a command-line option) and its ``metavar``,
    and the ``commands`` that take the flag (None: run, plan and backfill). The job key and its
    environment variable are read by every command; the others ignore them."""
    return {"help": help, "checks": checks, "flag": flag, "metavar": metavar, "commands": commands}


# --------------------------------------------------------------------------------------------
# The job


@dataclass(frozen=True, kw_only=True)
class ErrorPolicy:
    """How much can go wrong before a run counts as failed (the ``[errors]`` table)."""

    # Shards that may fail (unreadable, schema-skipped, crashed) while the run still succeeds.
    max_failed_shards: int = field(
        default=0, metadata=_meta("Failed shards allowed.", checks=(_at_least(0),))
    )
    # Fraction of readable input rows that may be rejected (null/NaN/inf features, model errors).
    max_rejected_fraction: float = field(
        default=0.01, metadata=_meta("Rejected rows allowed.", checks=(_fraction,))
    )
    # "fail": a readable shard whose columns do not fit the model stops the run before scoring
    # (exit 3). "skip_shard": that shard is listed as failed and the others are scored.
    on_schema_error: Literal["fail", "skip_shard"] = field(
        default="fail", metadata=_meta("A shard whose columns do not fit the model.")
    )
    # "reject": rows with null/NaN/inf features go to the rejects dataset. "fail": the first such
    # row fails its shard, naming shard, row group and id.
    on_invalid_rows: Literal["reject", "fail"] = field(
        default="reject", metadata=_meta("Rows with null/NaN/inf features.")
    )
    # How many times a crashed shard task is retried before it counts as failed.
    task_retries: int = field(default=2, metadata=_meta(checks=(_at_least(0),), flag=None))


_THRESHOLD = _meta(checks=(_at_least(0, "a number"),), flag=None)


@dataclass(frozen=True, kw_only=True)
class Monitoring:
    """Drift of the score distributions against the previous successful run (``[monitoring]``).

    Crossing a threshold makes the run ``succeeded_with_warnings`` (exit code 4); the scores are
    still written and ``_SUCCESS`` still marks them complete.
    """

    # Compare with the previous successful run of the same job (found in the run index).
    drift: bool = field(default=True, metadata=_meta(flag=None))
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
        metadata=_meta(
            "Input shards: directory, glob or file.",
            checks=(_nonempty, _template("date")),
            metavar="URI",
        )
    )
    # Output root for scored shards, _report.json, _manifest.json and _SUCCESS. May contain
    # {date} and {run_id}. Resume needs the same output on the rerun, so avoid {run_id} there.
    output: str = field(
        metadata=_meta(
            "Output root; may contain {date} and {run_id}.",
            checks=(_nonempty, _template(*TEMPLATE_FIELDS)),
            metavar="URI",
        )
    )
    # Model bundle directory (model.toml + weights), or a registered version in an MLflow
    # registry: models:/NAME/VERSION or models:/NAME@ALIAS (pipeline.model.registry).
    model: str = field(
        metadata=_meta(
            "Model bundle directory (model.toml + weights), or models:/NAME/VERSION or "
            "models:/NAME@ALIAS from the MLflow registry at MLFLOW_TRACKING_URI.",
            checks=(_nonempty,),
            metavar="URI",
        )
    )
    # Name shown in reports and metrics; defaults to the job file's stem.
    name: str = field(default="score-catalog", metadata=_meta(checks=(_nonempty,), flag=None))
    # Column that identifies a row; copied first into every output row.
    id_column: str = field(
        default="item_id",
        metadata=_meta("Row identifier column.", checks=(_nonempty,), metavar="NAME"),
    )
    # Columns copied unchanged to the output after the id, in this order.
    passthrough: tuple[str, ...] = field(
        default=(),
        metadata=_meta(
            "Column copied unchanged to the output (repeatable, kept in order).",
            checks=(_distinct,),
            metavar="NAME",
        ),
    )
    # Rows per model call (the last batch of a shard may be shorter), or "auto": measured on
    # real rows (start at 32, double while throughput gains >= 5%), cached per model/device/
    # precision.
    batch_size: int | Literal["auto"] = field(
        default=4096,
        metadata=_meta(
            "Rows per model call; auto: measured on real rows, cached.",
            checks=(_batch_size,),
            metavar="N|auto",
        ),
    )
    # auto (cuda when available, else cpu), cpu, cuda or cuda:N.
    device: str = field(
        default="auto",
        metadata=_meta("Where the model runs.", checks=(_device,), metavar="auto|cpu|cuda|cuda:N"),
    )
    # local (embedded Dask cluster), threads, sync (in-process, for debugging) or tcp://HOST:PORT.
    scheduler: str = field(
        default="local",
        metadata=_meta(
            "local: embedded Dask cluster; threads/sync: in-process, for debugging; "
            "tcp://...: an existing Dask scheduler.",
            checks=(_scheduler,),
            metavar="local|threads|sync|tcp://HOST:PORT",
        ),
    )
    # Dask worker processes for scheduler=local; None sizes it to the cores.
    workers: int | None = field(
        default=None,
        metadata=_meta(
            "Worker processes for --scheduler local (default: cores).", checks=(_at_least(1),)
        ),
    )
    # CPU cores the job may use (workers x threads x torch threads stay within it); None: all.
    cores: int | None = field(
        default=None,
        metadata=_meta("CPU cores the job may use (default: all).", checks=(_at_least(1),)),
    )
    # fp32, bf16 (autocast, CPU and CUDA), fp16 (CUDA) or int8 (dynamic, Linear layers, CPU).
    precision: Precision = field(
        default="fp32",
        metadata=_meta(
            "bf16: autocast; fp16: CUDA; int8: dynamic, CPU; checked against fp32 on a sample "
            "of rows before scoring."
        ),
    )
    # torch.compile the model (compile time is reported).
    compile: bool = field(
        default=False, metadata=_meta("torch.compile the model (compile time is reported).")
    )
    # On CUDA, fp32 matmuls may use TF32 unless this is set.
    strict_fp32: bool = field(default=False, metadata=_meta("On CUDA, do not let fp32 use TF32."))
    # Max |difference| from the fp32 CPU reference on the parity sample (labels: share that
    # differ); None: the precision's default.
    parity_tolerance: float | None = field(
        default=None,
        metadata=_meta(
            "Max |diff| from fp32 allowed on the parity sample (default per precision).",
            checks=(_at_least(0, "a number"),),
        ),
    )
    # Read the next batches and write finished ones in background threads, alongside the model.
    # "auto": on, except where every CPU core already runs a scoring loop of its own (there the
    # threads only compete with them: W1 on 2 cores scored 1.2x faster without; see
    # pipeline.driver.cluster.overlap_rule and docs/tuning.md).
    overlap: bool | Literal["auto"] = field(
        default="auto",
        metadata=_meta(
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
        metadata=_meta(
            "Where rejected rows go (default <root's parent>/_rejects/<root's name>/..., "
            "root: the output up to its first placeholder).",
            checks=(_template(*TEMPLATE_FIELDS),),
            metavar="URI",
        ),
    )
    # The date that {date} expands to (YYYY-MM-DD); None means today (UTC).
    date: str | None = field(
        default=None,
        metadata=_meta(
            "Date for {date} in templates (default today, UTC).",
            checks=(_date,),
            metavar="YYYY-MM-DD",
        ),
    )
    # What to do when the output folder holds files this tool did not write (no _manifest.json,
    # no score-catalog footer). "refuse": exit 2 before anything is written, naming them.
    # "replace": delete each such Parquet file (logged as a WARNING and listed in the report's
    # foreign_removed); other files are left alone and listed in foreign_kept.
    on_foreign_output: Literal["refuse", "replace"] = field(
        default="refuse",
        metadata=_meta("An output folder holding files this tool did not write."),
    )
    # An output (or rejects) bucket that does not exist is an error unless this is set: a typo
    # in a bucket name must not quietly create a new bucket and fill it.
    create_output_bucket: bool = field(
        default=False,
        metadata=_meta("Create the output and rejects buckets if they do not exist."),
    )
    # Rescore every shard even where the manifest says it is done.
    force: bool = field(default=False, metadata=_meta("Rescore shards the manifest says are done."))
    # backfill only: a day whose input folder does not exist is listed as missing and accepted
    # (an archive with gaps). Unset, such a day fails the backfill (exit 1, a WARNING per day),
    # so that a hole in the archive is never reported as a clean rescore. A range in which no
    # day has input fails either way (exit 3): that is a wrong input template, not a gap.
    allow_missing_partitions: bool = field(
        default=False,
        metadata=_meta(
            "Accept days whose input folder does not exist (an archive with gaps); without it "
            "they fail the backfill.",
            commands=("backfill",),
        ),
    )
    # A lock older than this many seconds is taken over even if its holder seems alive.
    stale_lock_after_s: float = field(
        default=6 * 3600.0,
        metadata=_meta(checks=(_at_least(0, "a number", strictly=True),), flag=None),
    )
    # After SIGTERM or SIGINT, how long shards in flight may take to commit before the run
    # stops without them (Kubernetes' default terminationGracePeriodSeconds is 30 too).
    grace_period_s: float = field(
        default=30.0,
        metadata=_meta(
            "Seconds shards in flight may take to commit after SIGTERM/SIGINT.",
            checks=(_at_least(0, "a number"),),
        ),
    )
    # Target rows per Dask task: shards smaller than this are grouped into one task so that
    # scheduling and commit overhead do not dominate; a bigger shard is its own task (streamed by
    # row group). The target shrinks so that every worker thread gets at least 4 tasks.
    task_rows: int = field(
        default=262_144,
        metadata=_meta(
            "Target rows per Dask task; smaller shards are grouped.", checks=(_at_least(1),)
        ),
    )
    # Dask resources each task asks for on an existing cluster, e.g. {GPU = 1} for workers
    # started with --resources GPU=1 (one worker per GPU).
    resources: Mapping[str, float] = field(
        default_factory=dict,
        metadata=_meta(
            "Dask resource each task needs on an existing cluster, e.g. GPU=1 (repeatable).",
            checks=(_positive_entries,),
            flag="--resource",
            metavar="NAME=N",
        ),
    )
    # Prometheus textfile (node_exporter textfile-collector convention) written after the run.
    metrics_file: str | None = field(
        default=None,
        metadata=_meta(
            "Write Prometheus metrics here (node_exporter textfile collector), atomically.",
            metavar="PATH",
        ),
    )
    # Prometheus Pushgateway URL to push the same metrics to.
    pushgateway: str | None = field(
        default=None,
        metadata=_meta("Push the same metrics to a Pushgateway.", checks=(_url,), metavar="URL"),
    )
    errors: ErrorPolicy = field(default_factory=ErrorPolicy)
    monitoring: Monitoring = field(default_factory=Monitoring)
    # Options passed unchanged to fsspec for every URI of the job (endpoint_url, key, ...).
    storage: Mapping[str, Any] = field(
        default_factory=dict,
        metadata=_meta(
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
        """A JSON-able view for logs and reports: storage option values are never shown."""
        d = dataclasses.asdict(self)
        d["passthrough"] = list(self.passthrough)
        d["storage"] = {k: "***" for k in self.storage}
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


# --------------------------------------------------------------------------------------------
# Settings derived from the dataclasses


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


def _given(raw: str) -> str:
    """``raw``, unless it is empty: a key that can be a word ("auto") has no empty value."""
    if not raw.strip():
        raise ValueError(raw)
    return raw


def _parse_list(raw: str) -> list[str]:
    return [p.strip() for p in raw.split(",") if p.strip()]


@dataclass(frozen=True)
class Kind:
    """A key's type, read from its type hint: how to check it, parse it from text, name it."""

    name: str  # str, int, float, bool, list, int_or_word, bool_or_word, table
    word: str  # for messages: "an integer"
    accepts: Callable[[Any], bool]
    # From the text of an environment variable or a flag; raises ValueError. None: no text form.
    parse: Callable[[str], Any] | None
    choices: tuple[str, ...] = ()  # Literal[...]: the allowed values
    optional: bool = False  # None allowed (meaning "not set")
    entry: Callable[[str], Any] | None = None  # a table's values from text (None: kept as text)


_SCALARS = {
    str: Kind("str", "a string", lambda v: isinstance(v, str), str),
    int: Kind("int", "an integer", _is_int, int),
    float: Kind("float", "a number", _is_number, float),
    bool: Kind("bool", "true or false", lambda v: isinstance(v, bool), _parse_bool),
}


def _kind(hint: Any) -> Kind:
    """The :class:`Kind` of a field's type hint (the hints this module uses, nothing more)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        rest = tuple(a for a in args if a is not type(None))
        if len(rest) == 1:
            return dataclasses.replace(_kind(rest[0]), optional=len(rest) < len(args))
        if len(rest) == 2 and rest[0] in (bool, int) and get_origin(rest[1]) is Literal:
            # bool | Literal["auto"], int | Literal["auto"]: a value, or one of a few words.
            scalar, words = _SCALARS[rest[0]], get_args(rest[1])
            shown = " or ".join(f'"{w}"' for w in words)
            what = "true, false" if rest[0] is bool else scalar.word
            parse = scalar.parse
            assert parse is not None
            return Kind(
                f"{scalar.name}_or_word",
                f"{what} or {shown}",
                lambda v: v in words or scalar.accepts(v),
                lambda raw: w if (w := raw.strip().lower()) in words else parse(_given(raw)),
                choices=words,
            )
    elif origin is Literal:
        return dataclasses.replace(_SCALARS[str], choices=tuple(args))
    elif origin is tuple and args[1:] == (Ellipsis,) and args[0] is str:
        return Kind(
            "list",
            "a list of strings",
            lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
            _parse_list,
        )
    elif origin is Mapping:
        entry = _SCALARS[args[1]].parse if args[1] in _SCALARS else None
        return Kind("table", "a table", lambda v: isinstance(v, Mapping), None, entry=entry)
    elif hint in _SCALARS:
        return _SCALARS[hint]
    raise TypeError(f"config field type {hint!r} has no Kind; add it to config._kind")


@dataclass(frozen=True)
class Setting:
    """One job key as the dataclasses declare it, for the loaders, the validator and the CLI."""

    key: str  # as written in messages: "batch_size", "errors.max_failed_shards"
    name: str  # the field's name
    table: str | None  # the [table] of the job file it sits in, or None (top level)
    kind: Kind
    default: Any  # dataclasses.MISSING for a required key
    help: str  # the --help text, without the default
    flag: str | None  # the command-line option, e.g. "--batch-size"; None: none
    metavar: str | None
    checks: tuple[Check, ...]
    commands: tuple[str, ...] | None = None  # the commands whose flags include it; None: all

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    @property
    def env(self) -> str | None:
        """``SCORE_CATALOG_<NAME>``; None for free tables (storage, resources)."""
        return None if self.kind.parse is None else ENV_PREFIX + self.name.upper()


def _settings_of(cls: type, table: str | None = None) -> Iterator[Setting]:
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            yield from _settings_of(hint, f.name)
            continue
        factory = f.default_factory
        default = f.default if factory is dataclasses.MISSING else factory()
        meta = f.metadata
        flag = meta.get("flag", "")
        yield Setting(
            key=f"{table}.{f.name}" if table else f.name,
            name=f.name,
            table=table,
            kind=_kind(hint),
            default=default,
            help=meta.get("help", ""),
            flag="--" + f.name.replace("_", "-") if flag == "" else flag,
            metavar=meta.get("metavar"),
            checks=meta.get("checks", ()),
            commands=meta.get("commands"),
        )


# Every key of a job, in the order the dataclasses declare them.
SETTINGS: tuple[Setting, ...] = tuple(_settings_of(JobConfig))
# The [tables] holding further keys: errors -> ErrorPolicy, monitoring -> Monitoring.
SECTIONS: dict[str, type[Any]] = {
    name: hint
    for name, hint in get_type_hints(JobConfig).items()
    if isinstance(hint, type) and dataclasses.is_dataclass(hint)
}
_TOP_LEVEL = {s.name: s for s in SETTINGS if s.table is None}
_BY_ENV = {s.env: s for s in SETTINGS if s.env is not None}
# Keys whose values are tables, merged key by key across the layers.
_TABLE_KEYS = frozenset([*SECTIONS, *(s.name for s in SETTINGS if s.kind.name == "table")])


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
# Loading


def _env_layer(env: Mapping[str, str]) -> tuple[dict[str, Any], list[Keyed]]:
    """The ``SCORE_CATALOG_*`` variables as a layer, and their problems keyed by variable."""
    layer: dict[str, Any] = {}
    problems: list[Keyed] = []
    for var, raw in sorted(env.items()):
        if not var.startswith(ENV_PREFIX):
            continue
        s = _BY_ENV.get(var)
        parse = s.kind.parse if s is not None else None
        if s is None or parse is None:
            problems.append((var, _unknown_env(var)))
            continue
        try:
            value = parse(raw)
        except ValueError:
            problems.append((var, f"{var}={raw!r} is not {s.kind.word}"))
            continue
        target = layer.setdefault(s.table, {}) if s.table else layer
        target[s.name] = value
    return layer, problems


def _closest_names(name: str, known: list[str], prefix: str = "") -> list[str]:
    """Up to two of ``known`` that look like a typo of ``name``, compared without the
    ``prefix`` they all share (which would make every SCORE_CATALOG_* name look alike)."""
    bare = {k.removeprefix(prefix).lower(): k for k in known}
    close = difflib.get_close_matches(name.removeprefix(prefix).lower(), list(bare), n=2)
    return [bare[c] for c in close]


def _unknown_env(var: str) -> str:
    """An unknown SCORE_CATALOG_* variable: the closest names, or every name if none is."""
    close = _closest_names(var, list(_BY_ENV), ENV_PREFIX)
    if close:
        return f"unknown environment variable {var}; did you mean {' or '.join(close)}?"
    return f"unknown environment variable {var}; known ones: {', '.join(_BY_ENV)}"


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
            if k in _TABLE_KEYS and isinstance(v, Mapping):
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
    origins: dict[str, str] = {}  # dotted key -> where its value came from, for messages
    if job_file is not None:
        data = read_job_file(job_file)
        _note_origins(origins, data, lambda _key: str(job_file))
        data.setdefault("name", Path(job_file).stem)
        layers.append(data)
    env_top, env_problems = _env_layer(os.environ if env is None else env)
    _note_origins(origins, env_top, _env_of)
    layers.append(env_top)
    if overrides:
        _note_origins(origins, overrides, _flag_of)
        layers.append(overrides)
    merged = _merge(layers)
    # The environment's own problems, keyed by their variable (which their text names).
    sourced: list[tuple[str | None, str]] = list(env_problems)
    sourced += [(_origin(origins, key), p) for key, p in _keyed_problems(merged)]
    if sourced:
        raise _sourced_error(sourced, source)
    kwargs: dict[str, Any] = {}
    for name, value in merged.items():
        if name in SECTIONS:
            kwargs[name] = SECTIONS[name](**value)
        elif _TOP_LEVEL[name].kind.name == "list":
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = value
    return JobConfig(**kwargs)  # validated again, by __post_init__: the same rules, cheap


@dataclass(frozen=True)
class MetricsDestination:
    """Where a job's metrics go, and the job's name on them."""

    name: str
    metrics_file: str | None
    pushgateway: str | None


def metrics_destination(
    job_file: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> MetricsDestination | None:
    """The metrics file and Pushgateway of a job whose configuration could not be built.

    Read from the same layers as :func:`build_config` (job file < environment < flags), taking
    from each what is readable: a bad key elsewhere, an unknown environment variable or a job
    file that is not TOML at all (then only the environment and the flags) does not hide where
    the metrics go, so that the failed status of a bad deploy reaches the alert. A value that
    is itself wrong (a Pushgateway that is not a URL) is left out. None when neither is set.
    """
    layers: list[Mapping[str, Any]] = []
    if job_file is not None:
        try:
            data = dict(read_job_file(job_file))
        except ConfigError:
            data = {}
        data.setdefault("name", Path(job_file).stem)
        layers.append(data)
    layers.append(_env_layer(os.environ if env is None else env)[0])
    if overrides:
        layers.append(overrides)
    merged = _merge(layers)
    found: dict[str, Any] = {}
    for key in ("name", "metrics_file", "pushgateway"):
        s = setting(key)
        value = merged.get(key)
        ok = value is not None and s.kind.accepts(value) and not _value_problems(s, value)
        found[key] = value if ok else s.default
    if found["metrics_file"] is None and found["pushgateway"] is None:
        return None
    return MetricsDestination(str(found["name"]), found["metrics_file"], found["pushgateway"])


def _note_origins(
    origins: dict[str, str], layer: Mapping[str, Any], label: Callable[[str], str]
) -> None:
    """Record ``label(key)`` as the origin of every key ``layer`` sets (a later layer wins,
    as in :func:`_merge`); a table's entries each, and the table itself."""
    for k, v in layer.items():
        if v is None:
            continue
        if k in _TABLE_KEYS and isinstance(v, Mapping):
            for entry, ev in v.items():
                if ev is not None:
                    origins[f"{k}.{entry}"] = label(f"{k}.{entry}")
        origins[k] = label(k)


def _env_of(key: str) -> str:
    """The environment variable that sets ``key`` (a table: the environment as a whole)."""
    found = next((s.env for s in SETTINGS if s.key == key and s.env), None)
    return found or f"the {ENV_PREFIX}* variables"


def _flag_of(key: str) -> str:
    """The command-line flag that sets ``key`` (``--batch-size``, ``--storage-option``)."""
    for s in SETTINGS:
        if s.key == key or (s.kind.name == "table" and key.startswith(f"{s.key}.")):
            return s.flag or f"--{key}"
    table = key.split(".", 1)[0]
    return next((s.flag for s in SETTINGS if s.table == table and s.flag), None) or key


def _origin(origins: Mapping[str, str], key: str) -> str | None:
    """Where ``key``'s value came from: its own entry, else its table's (None: no layer set
    it, e.g. a required key that is missing everywhere)."""
    return origins.get(key) or origins.get(key.split(".", 1)[0])


def _sourced_error(sourced: list[tuple[str | None, str]], job_file: str | None) -> ConfigError:
    """One :class:`ConfigError` for problems from several layers. The header names the job
    file only when every problem is in it; otherwise each problem says where it came from
    ("(from SCORE_CATALOG_BATCH_SIZE)", "(from --workers)", "(in jobs/my_job.toml)"), unless
    its text names that already."""
    if all(where in (None, job_file) for where, _ in sourced):
        return ConfigError([p for _, p in sourced], job_file)
    if job_file is None and not any((w or "").startswith(ENV_PREFIX) for w, _ in sourced):
        # Flags only (or a Python caller's overrides): nothing to tell apart.
        return ConfigError([p for _, p in sourced])
    named = []
    for where, p in sourced:
        if where is None or where in p:
            named.append(p)
        else:
            named.append(f"{p} ({'in' if where == job_file else 'from'} {where})")
    return ConfigError(named)


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
    close = _closest_names(key, known)
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
    return [text for _, text in _keyed_problems(data, none_is_unset=none_is_unset)]


def _keyed_problems(data: Mapping[str, Any], *, none_is_unset: bool = True) -> list[Keyed]:
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
        found = _value_problems(s, value)
        problems += [(s.key, p) for p in found]
        if found:
            bad.add(s.key)
    return problems + _cross_problems(good, bad)


def _value_problems(s: Setting, value: Any) -> list[str]:
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
    if "output" in good and "output" not in bad:
        try:
            index_root(good["output"])  # where the run index lives: checked now, not after scoring
        except ConfigError as e:
            problems += [("output", p) for p in e.problems]
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
