"""A job's configuration from its layers: job file < environment < flags (:func:`build_config`).

Every layer is merged into one plain mapping first and validated once
(:func:`pipeline.core.config.keyed_problems`), so that a user sees every bad key in one message,
each naming where its value came from (the job file, a ``SCORE_CATALOG_*`` variable, a flag),
instead of fixing them one run at a time. :func:`metrics_destination` reads where a job's
metrics go from the same layers even when the job itself is invalid.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core import config
from pipeline.core.config import JobConfig
from pipeline.core.errors import ConfigError
from pipeline.core.settings import ENV_PREFIX, Keyed, closest_names

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib


def _env_layer(env: Mapping[str, str]) -> tuple[dict[str, Any], list[Keyed]]:
    """The ``SCORE_CATALOG_*`` variables as a layer, and their problems keyed by variable."""
    layer: dict[str, Any] = {}
    problems: list[Keyed] = []
    for var, raw in sorted(env.items()):
        if not var.startswith(ENV_PREFIX):
            continue
        s = config.BY_ENV.get(var)
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


def _unknown_env(var: str) -> str:
    """An unknown SCORE_CATALOG_* variable: the closest names, or every name if none is."""
    close = closest_names(var, list(config.BY_ENV), ENV_PREFIX)
    if close:
        return f"unknown environment variable {var}; did you mean {' or '.join(close)}?"
    return f"unknown environment variable {var}; known ones: {', '.join(config.BY_ENV)}"


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
            if k in config.TABLE_KEYS and isinstance(v, Mapping):
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
    sourced += [(_origin(origins, key), p) for key, p in config.keyed_problems(merged)]
    if sourced:
        raise _sourced_error(sourced, source)
    kwargs: dict[str, Any] = {}
    for name, value in merged.items():
        if name in config.SECTIONS:
            kwargs[name] = config.SECTIONS[name](**value)
        elif config.TOP_LEVEL[name].kind.name == "list":
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
        s = config.setting(key)
        value = merged.get(key)
        ok = value is not None and s.kind.accepts(value) and not config.value_problems(s, value)
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
        if k in config.TABLE_KEYS and isinstance(v, Mapping):
            for entry, ev in v.items():
                if ev is not None:
                    origins[f"{k}.{entry}"] = label(f"{k}.{entry}")
        origins[k] = label(k)


def _env_of(key: str) -> str:
    """The environment variable that sets ``key`` (a table: the environment as a whole)."""
    found = next((s.env for s in config.SETTINGS if s.key == key and s.env), None)
    return found or f"the {ENV_PREFIX}* variables"


def _flag_of(key: str) -> str:
    """The command-line flag that sets ``key`` (``--batch-size``, ``--storage-option``)."""
    for s in config.SETTINGS:
        if s.key == key or (s.kind.name == "table" and key.startswith(f"{s.key}.")):
            return s.flag or f"--{key}"
    table = key.split(".", 1)[0]
    return next((s.flag for s in config.SETTINGS if s.table == table and s.flag), None) or key


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
