"""What a run (and ``score-catalog plan``) learns from the input before anything is written.

The input shards, every footer and schema against the model's dry run, the job's id and
pass-through columns, the settings that decide resume, and one type per output column across
the shards. A problem found here fails the run up front (exit 2 or 3), never after hours of
scoring. How the model will run (precision, parity, batch size) is
:mod:`pipeline.driver.execution`'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import pyarrow as pa
import torch

from pipeline.core.config import JobConfig, setting
from pipeline.core.errors import ConfigError, MissingInputError, ModelError, SchemaError, ShardError
from pipeline.core.statuses import FailureKind, ShardStatus
from pipeline.io import listing, storage
from pipeline.io.layout import MODEL_INPUT_HASH_COLUMN
from pipeline.io.listing import ShardRef
from pipeline.io.manifest import settings_hash
from pipeline.io.parquet import ShardInfo, read_footer
from pipeline.model.bundle import BundleSpec
from pipeline.model.features import check_schema, data_widths
from pipeline.model.program import LoadedModel, load_model
from pipeline.worker.shard import ShardResult
from pipeline.worker.sink import MODEL_VERSION_COLUMN

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The settings that change output rows; a change rescores every shard on resume."""

    values: dict[str, Any]
    hash: str


def run_settings(
    config: JobConfig,
    spec: BundleSpec,
    *,
    model_version: str | None = None,
    fingerprint: bool = False,
) -> Settings:
    """The settings of ``config`` with model ``spec`` that decide what a row's output is.

    ``model_version`` is the output's ``model_version`` value for a model from a registry
    (``models:/NAME/VERSION``): moving an alias to another version rescores every shard even
    when the new version's bundle has the same bytes. Absent otherwise, so that the hash of a
    plain bundle's settings stays what earlier versions of this tool wrote.

    Refuses (:class:`ConfigError`) output columns that would share a name: a Parquet file with
    two ``score`` columns is refused by pyarrow and Polars and read as the wrong one by DuckDB.
    """
    check_output_columns(config, spec, fingerprint=fingerprint)
    values = {
        "inputs": list(spec.input_columns),
        "outputs": [[o.name, o.describe()] for o in spec.outputs],
        "id_column": config.id_column,
        "passthrough": list(config.passthrough),
        "precision": config.precision,
    }
    if model_version is not None:
        values["model_version"] = model_version
    if config.engine != "torch":
        # Another engine's scores differ from torch's in the last bits: a shard scored by one
        # is not kept by a run with the other. Absent for torch, so the hash of every earlier
        # run's settings stays what it was.
        values["engine"] = config.engine
    if fingerprint:
        # The output has a model_input_hash column (docs/incremental.md); absent otherwise.
        values["fingerprint"] = True
    return Settings(values, settings_hash(values))


def run_identity(
    config: JobConfig,
    spec: BundleSpec,
    sha256: str,
    device: str,
    model_version: str | None,
    table_has_fingerprints: bool = False,
) -> tuple[Settings, Settings | None]:
    """The run's settings, and its scorer identity where output rows carry fingerprints: on an
    incremental night, and in a table that has the column already (a table keeps its columns:
    docs/incremental.md); None there otherwise."""
    fingerprint = config.incremental or table_has_fingerprints
    settings = run_settings(config, spec, model_version=model_version, fingerprint=fingerprint)
    scorer = scorer_identity(config, spec, sha256, device) if fingerprint else None
    return settings, scorer


#: The version of the row fingerprint (pipeline.worker.fingerprint) in the scorer identity: a
#: change to how rows are hashed makes every baseline another scorer's.
FINGERPRINT_VERSION = 1


def scorer_identity(config: JobConfig, spec: BundleSpec, sha256: str, device: str) -> Settings:
    """What decides a row's scores besides the row itself: the bundle's content, the inputs it
    reads, its outputs, and every setting that changes a score (precision, engine, the device
    type, torch.compile, TF32 on CUDA). An incremental night carries scores only from a
    baseline scored with the same identity (docs/incremental.md). Pass-through columns and the
    model_version text are not in it: they never change a score (and are always tonight's)."""
    device_type = device.split(":", 1)[0]
    values: dict[str, Any] = {
        "model_sha256": sha256,
        "inputs": list(spec.input_columns),
        "outputs": [[o.name, o.describe()] for o in spec.outputs],
        "id_column": config.id_column,
        "precision": config.precision,
        "engine": config.engine,
        "device": device_type,
        "compile": config.compile,
        "tf32": device_type == "cuda" and not config.strict_fp32,
        "fingerprint_version": FINGERPRINT_VERSION,
    }
    return Settings(values, settings_hash(values))


def check_output_columns(config: JobConfig, spec: BundleSpec, *, fingerprint: bool = False) -> None:
    """Every output column (id, pass-through, model outputs, model_version, and an incremental
    run's model_input_hash) named once."""
    sources = [("id_column", config.id_column)]
    sources += [("passthrough", c) for c in config.passthrough]
    sources += [(f"outputs in {spec.uri}/model.toml", o.name) for o in spec.outputs]
    sources.append(("the column score-catalog adds", MODEL_VERSION_COLUMN))
    if fingerprint:
        sources.append(("the column incremental runs add", MODEL_INPUT_HASH_COLUMN))
    seen: dict[str, str] = {}
    problems = []
    for where, name in sources:
        if name in seen:
            problems.append(
                f"output column {name!r} comes twice ({seen[name]}, and {where}): rename the "
                "output in model.toml or drop the pass-through column"
            )
        else:
            seen[name] = where
    if problems:
        raise ConfigError(problems)


def list_input(config: JobConfig) -> list[ShardRef]:
    """The input shards of ``config`` (:func:`pipeline.io.listing.list_shards`). A templated input
    whose day does not exist says which day, and where that day came from, and lists the
    partitions that do exist instead of guessing another date."""
    try:
        return listing.list_shards(config.input_uri(), config.storage)
    except MissingInputError as e:
        if "{date}" not in config.input:
            raise
        raise MissingInputError(missing_partition_message(config), uri=e.uri) from None


def missing_partition_message(config: JobConfig) -> str:
    """``input X does not exist``, for an input templated with ``{date}``: the template, the
    date and its source, and what the nearest existing folder holds."""
    uri = config.input_uri()
    day = config.run_date
    source = "from --date" if config.date else "today in UTC: no --date was given"
    loc = storage.locate(uri, config.storage)
    return (
        f"input {uri} does not exist: no partition for {day} ({source}; input = "
        f"{config.input!r}){listing.missing_hint(loc, literal=day)}"
    )


class Inspection(NamedTuple):
    """What the footers and the model's dry run say, before anything is scored or written."""

    infos: dict[str, ShardInfo]
    failed: dict[str, ShardResult]  # unreadable shards
    schema_problems: dict[str, list[str]]
    widths: tuple[int, ...]  # values per row of each model input
    model: LoadedModel


def _input_widths(
    spec: BundleSpec, infos: dict[str, ShardInfo]
) -> tuple[tuple[int | None, ...], dict[str, list[int]]]:
    """What the footers give each input ``model.toml`` leaves open: the one width every shard
    that says anything agrees on, else None; and, by input name, the widths shards disagree
    on (for the message when the program does not record one either)."""
    found = [data_widths(info.schema, spec) for info in infos.values()]
    widths: list[int | None] = []
    conflicts: dict[str, list[int]] = {}
    for k, inp in enumerate(spec.inputs):
        seen = sorted({v for w in found if (v := w[k]) is not None})
        widths.append(seen[0] if len(seen) == 1 else None)
        if len(seen) > 1:
            conflicts[inp.name] = seen
    return tuple(widths), conflicts


def _load_for_data(
    config: JobConfig, spec: BundleSpec, infos: dict[str, ShardInfo], device: torch.device, sha: str
) -> LoadedModel:
    """The model, with the widths model.toml leaves open taken from the program or the data."""
    given, conflicts = _input_widths(spec, infos)
    try:
        return load_model(
            config.model, device, widths=given, options=config.storage, expected_sha256=sha
        )
    except ModelError as e:
        if not conflicts:
            raise
        name, seen = next(iter(conflicts.items()))
        inp = next(i for i in spec.inputs if i.name == name)
        key = "inputs.dim" if inp.legacy else f"inputs.{name}.dim"
        raise ModelError(
            f"model bundle {config.model}: {inp.describe()} has no {key} and the data does not "
            f"give one fixed list size (found {seen}); set {key} in model.toml"
        ) from e


def inspect_shards(
    config: JobConfig,
    shards: list[ShardRef],
    spec: BundleSpec,
    sha: str,
    device: torch.device,
    opts: Any,
) -> Inspection:
    """Read every footer, find the feature width, load the model and check each schema."""
    uris = {s.rel_path: s.uri for s in shards}
    infos: dict[str, ShardInfo] = {}
    failed: dict[str, ShardResult] = {}
    for s in shards:
        try:
            infos[s.rel_path] = read_footer(s.uri, opts)
        except ShardError as e:
            failed[s.rel_path] = ShardResult(
                s.rel_path,
                s.uri,
                ShardStatus.FAILED,
                rows_in=None,
                kind=FailureKind.UNREADABLE,
                message=str(e),
            )
    model = _load_for_data(config, spec, infos, device, sha)
    widths = model.widths
    schema_problems: dict[str, list[str]] = {}
    for rel, info in infos.items():
        probs = check_schema(
            info.schema,
            spec,
            widths=widths,
            id_column=config.id_column,
            passthrough=config.passthrough,
            shard=uris[rel],
        )
        if probs:
            schema_problems[rel] = probs
    return Inspection(infos, failed, schema_problems, widths, model)


def meta_fields(
    config: JobConfig, infos: Mapping[str, ShardInfo], failed: Mapping[str, ShardResult]
) -> dict[str, pa.Field]:
    """One type per id and pass-through column across the run's output files.

    Readers of a whole output (Polars, Dask, Spark) refuse a dataset whose files disagree on a
    column's type, and input shards often do: one dictionary-encoded, the next plain, or int32
    here and int64 there. So dictionary columns are written decoded, and types that still differ
    are promoted to one that holds them all (Arrow's permissive unification: int32 + int64 ->
    int64, string + large_string -> large_string). Types no promotion joins (an id that is an
    integer in one shard and a string in another) keep each shard's own, with a warning.
    """
    out: dict[str, pa.Field] = {}
    names = list(dict.fromkeys((config.id_column, *config.passthrough)))
    usable = {rel: i for rel, i in infos.items() if rel not in failed}
    for name in names:
        found = {
            rel: i.schema.field(name)
            for rel, i in usable.items()
            if i.schema.names.count(name) == 1
        }
        if not found:
            continue
        plain = [
            f.with_type(f.type.value_type) if pa.types.is_dictionary(f.type) else f
            for f in found.values()
        ]
        plain = _common_time_zone(name, dict(zip(found, plain, strict=True)), config.input_uri())
        try:
            unified = pa.unify_schemas(
                [pa.schema([f]) for f in plain], promote_options="permissive"
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            logger.warning(
                "column %s has types that cannot be joined across shards (%s): each output "
                "file keeps its shard's own; readers of the whole output may refuse it",
                name,
                ", ".join(sorted({str(f.type) for f in plain})),
            )
            logger.debug("unify_schemas: %s", e)
            continue
        out[name] = unified.field(name)
    return out


def _common_time_zone(name: str, fields: dict[str, pa.Field], input_uri: str) -> list[pa.Field]:
    """Timestamp fields of one column, ready to be unified: time zones that differ between
    shards become UTC (a zoned timestamp is an instant, stored as UTC whatever its zone, so
    this changes no value), which Arrow's unification would refuse. A column with a time zone
    in one shard and none in another is a :class:`SchemaError` naming both: a timestamp
    without one is a wall-clock time, and which instant it means is not in the data."""
    stamps = {rel: f for rel, f in fields.items() if pa.types.is_timestamp(f.type)}
    if len(stamps) < len(fields):  # not all timestamps: unification decides (and warns)
        return list(fields.values())
    zoned = {rel: f for rel, f in stamps.items() if f.type.tz is not None}
    naive = {rel: f for rel, f in stamps.items() if f.type.tz is None}
    if zoned and naive:
        (a, fa), (b, fb) = next(iter(zoned.items())), next(iter(naive.items()))
        raise SchemaError(
            f"column {name!r} of input {input_uri} is a timestamp with time zone "
            f"{fa.type.tz} ({fa.type}) in shard {a} but a timestamp without a time zone "
            f"({fb.type}) in shard {b} ({len(zoned)} shard(s) with a zone, {len(naive)} "
            "without): which "
            "instant a timestamp without a zone means is not in the data, so the output could "
            "not give the column one type. Rewrite the shards with one kind (pyarrow: "
            "pc.assume_timezone), or leave the column out of passthrough"
        )
    if len({f.type.tz for f in zoned.values()}) > 1:
        return [f.with_type(pa.timestamp(f.type.unit, "UTC")) for f in fields.values()]
    return list(fields.values())


MAX_NAMED_SHARDS = 3  # shards named in a grouped schema problem before "and N more"
MAX_NAMED_COLUMNS = 40  # a shard's columns listed in a message before "... (N in all)"
_MISSING = re.compile(r"column '(?P<col>[^']+)' is missing$")


def schema_problem_lines(
    shards: list[ShardRef], problems: Mapping[str, list[str]], infos: Mapping[str, ShardInfo]
) -> list[str]:
    """Schema problems, each said once however many shards share it: "id column 'item_id' is
    missing in 300 of 300 shards (part-00000.parquet, ... and 297 more)". A missing column
    also names the columns the first such shard does have (and the closest one, if any)."""
    uris = {s.rel_path: s.uri for s in shards}
    grouped: dict[str, list[str]] = {}
    for rel, probs in problems.items():
        for p in probs:
            grouped.setdefault(p.removeprefix(f"shard {uris[rel]}: "), []).append(rel)
    lines = []
    for text, rels in grouped.items():
        named = ", ".join(rels[:MAX_NAMED_SHARDS])
        more = f" and {len(rels) - MAX_NAMED_SHARDS} more" if len(rels) > MAX_NAMED_SHARDS else ""
        where = (
            f"{uris[rels[0]]}"
            if len(shards) == 1
            else (f"{len(rels)} of {len(shards)} shards ({named}{more})")
        )
        line = f"{text} in {where}"
        m = _MISSING.search(text)
        if m and rels[0] in infos:
            names = infos[rels[0]].schema.names
            close = _closest(m.group("col"), names)
            line += f"; the columns there: {', '.join(names)}"
            line += f" (did you mean {close[0]!r}?)" if close else ""
        lines.append(line)
    return lines


def _closest(column: str, names: list[str]) -> list[str]:
    """The name most like ``column`` (a typo, or one containing the other: id / item_id)."""
    found = difflib.get_close_matches(column, names, n=1)
    low = column.lower()
    return found or [n for n in names if len(n) > 1 and (n.lower() in low or low in n.lower())][:1]


def check_job_columns(config: JobConfig, infos: Mapping[str, ShardInfo]) -> None:
    """Refuse (:class:`ConfigError`, exit 2) an id or pass-through column that no readable
    shard has: a mistake in the job (a typo), not shards to skip (``skip_shard`` would skip
    every one of them). Each is named with its key and the closest column the shards have."""
    if not infos:
        return
    columns = list(dict.fromkeys(n for info in infos.values() for n in info.schema.names))
    have = set(columns)
    wanted = [("id_column", config.id_column), *(("passthrough", c) for c in config.passthrough)]
    problems = []
    for key, col in wanted:
        if col in have:
            continue
        s = setting(key)
        close = _closest(col, columns)
        what = f"id_column = {col!r}" if key == "id_column" else f"passthrough names {col!r}, which"
        shown = ", ".join(columns[:MAX_NAMED_COLUMNS])
        if len(columns) > MAX_NAMED_COLUMNS:
            shown += f", ... ({len(columns)} in all)"
        problems.append(
            f"{what} is not a column of any input shard ({len(infos)} read; their columns: "
            f"{shown})"
            + (f"; did you mean {close[0]!r}?" if close else ".")
            + f" Set {key} in the job file, {s.env} or {s.flag}"
        )
    if problems:
        raise ConfigError(problems)


def apply_schema_policy(
    config: JobConfig, shards: list[ShardRef], found: Inspection
) -> dict[str, ShardResult]:
    """Unreadable and schema-failed shards by path; raises if a schema problem fails the run.

    Each problem is said once however many shards it affects (:func:`schema_problem_lines`):
    in the error, or, with ``on_schema_error = "skip_shard"``, in one warning.
    """
    spec = found.model.spec
    problems = found.schema_problems
    lines = schema_problem_lines(shards, problems, found.infos)
    what = (
        f"{len(problems)} of {len(shards)} shards do not fit model "
        f"{spec.name} v{spec.version} ({spec.describe_inputs()})"
    )
    if problems and config.errors.on_schema_error == "fail":
        readable = len(shards) - len(found.failed)
        # skip_shard scores the rest; where no shard fits, there is no rest to score.
        fix = (
            "Fix the input or the model bundle"
            if len(problems) >= readable
            else "Fix the input, or set errors.on_schema_error = 'skip_shard' to score the rest"
        )
        raise SchemaError(
            f"{what}; nothing was scored. {fix}:\n" + "\n".join(f"  - {p}" for p in lines)
        )
    if problems:
        logger.warning(
            "%s; they are skipped (errors.on_schema_error = 'skip_shard'):\n%s",
            what,
            "\n".join(f"  - {p}" for p in lines),
        )
    uris = {s.rel_path: s.uri for s in shards}
    failed = dict(found.failed)
    for rel, probs in problems.items():
        failed[rel] = ShardResult(
            rel,
            uris[rel],
            ShardStatus.FAILED,
            rows_in=found.infos[rel].num_rows,
            kind=FailureKind.SCHEMA,
            message="; ".join(probs),
        )
    return failed
