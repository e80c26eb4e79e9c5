"""Tests for pipeline.core.config: layering, validation (all problems at once), templating,
redaction."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import string
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipeline.core import tableformats
from pipeline.core.config import SECTIONS, SETTINGS, ErrorPolicy, JobConfig, from_flags
from pipeline.core.errors import EXIT_USAGE, ConfigError
from pipeline.core.jobfile import MetricsDestination, build_config, metrics_destination
from pipeline.core.settings import ENV_PREFIX

REPO = Path(__file__).resolve().parents[2]
JOB_FILES = sorted((REPO / "jobs").glob("*.toml"))

# The three required keys, so that a test can focus on the one thing it is about.
BASE: dict[str, Any] = {"input": "data/in", "output": "data/out/{date}", "model": "data/model"}


def write_job(tmp: Path, text: str, name: str = "job.toml") -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def problems_of(excinfo: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return list(excinfo.value.problems)


def has_problem(problems: list[str], *fragments: str) -> bool:
    """True when one problem line contains every fragment."""
    return any(all(f in p for f in fragments) for p in problems)


# --------------------------------------------------------------------------------------------
# Defaults and the job file
# --------------------------------------------------------------------------------------------


def test_defaults_without_job_file() -> None:
    cfg = build_config(env={}, overrides=BASE)
    assert cfg.input == "data/in"
    assert cfg.output == "data/out/{date}"
    assert cfg.model == "data/model"
    assert cfg.name == "score-catalog"
    assert cfg.id_column == "item_id"
    assert cfg.passthrough == ()
    assert cfg.batch_size == 4096
    assert cfg.device == "auto"
    assert cfg.scheduler == "local"
    assert cfg.overlap == "auto"
    assert cfg.workers is None
    assert cfg.rejects is None
    assert cfg.date is None
    assert cfg.force is False
    assert cfg.stale_lock_after_s == 6 * 3600.0
    assert cfg.errors == ErrorPolicy(
        max_failed_shards=0,
        max_rejected_fraction=0.01,
        on_schema_error="fail",
        on_invalid_rows="reject",
        task_retries=2,
    )
    assert dict(cfg.storage) == {}


def test_job_file_values_and_name_from_stem(tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        'input = "s3://bucket/in"\noutput = "s3://bucket/out"\nmodel = "m"\n'
        'passthrough = ["category", "brand"]\nbatch_size = 128\ndevice = "cpu"\n'
        'scheduler = "tcp://10.0.0.5:8786"\nworkers = 3\nforce = true\n'
        "stale_lock_after_s = 60\n"
        '[errors]\nmax_failed_shards = 2\non_schema_error = "skip_shard"\n'
        '[storage]\nendpoint_url = "http://minio:9000"\n',
        name="nightly_books.toml",
    )
    cfg = build_config(job, env={})
    assert cfg.name == "nightly_books"
    assert cfg.input == "s3://bucket/in"
    assert cfg.passthrough == ("category", "brand")
    assert isinstance(cfg.passthrough, tuple)
    assert cfg.batch_size == 128
    assert cfg.device == "cpu"
    assert cfg.scheduler == "tcp://10.0.0.5:8786"
    assert cfg.workers == 3
    assert cfg.force is True
    assert cfg.stale_lock_after_s == 60
    assert cfg.errors.max_failed_shards == 2
    assert cfg.errors.on_schema_error == "skip_shard"
    # Keys not set in [errors] keep their defaults.
    assert cfg.errors.task_retries == 2
    assert cfg.errors.on_invalid_rows == "reject"
    assert dict(cfg.storage) == {"endpoint_url": "http://minio:9000"}


def test_name_in_job_file_beats_the_stem(tmp_path: Path) -> None:
    job = write_job(tmp_path, 'name = "explicit"\ninput = "i"\noutput = "o"\nmodel = "m"\n')
    assert build_config(job, env={}).name == "explicit"


def test_missing_job_file_is_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as excinfo:
        build_config(missing, env={})
    assert str(missing) in str(excinfo.value)
    assert "does not exist" in str(excinfo.value)
    assert excinfo.value.exit_code == EXIT_USAGE


def test_invalid_toml_is_config_error(tmp_path: Path) -> None:
    job = write_job(tmp_path, 'input = "unterminated\n')
    with pytest.raises(ConfigError) as excinfo:
        build_config(job, env={})
    assert "is not valid TOML" in str(excinfo.value)
    assert str(job) in str(excinfo.value)


def test_required_keys_each_reported_with_how_to_set_them() -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={})
    problems = problems_of(excinfo)
    assert len(problems) == 3
    for key in ("input", "output", "model"):
        assert has_problem(
            problems, f"{key} is required", f"SCORE_CATALOG_{key.upper()}", f"--{key}"
        )
    assert "3 problems" in str(excinfo.value)


# --------------------------------------------------------------------------------------------
# Precedence: job file < SCORE_CATALOG_* < overrides
# --------------------------------------------------------------------------------------------


def test_precedence_file_env_overrides(tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        'input = "file-in"\noutput = "file-out"\nmodel = "file-model"\n'
        'batch_size = 100\ndevice = "cpu"\nworkers = 2\nscheduler = "threads"\n'
        "[errors]\ntask_retries = 5\nmax_failed_shards = 1\nmax_rejected_fraction = 0.2\n",
    )
    env = {
        "SCORE_CATALOG_BATCH_SIZE": "200",
        "SCORE_CATALOG_INPUT": "env-in",
        "SCORE_CATALOG_TASK_RETRIES": "7",
        "SCORE_CATALOG_MAX_FAILED_SHARDS": "4",
        "SCORE_CATALOG_SCHEDULER": "sync",
    }
    overrides = {
        "batch_size": 300,
        "workers": None,  # "not given": the file's value stays
        "scheduler": None,
        "errors": {"max_failed_shards": 9, "task_retries": None},
    }
    cfg = build_config(job, env=env, overrides=overrides)
    assert cfg.batch_size == 300  # override beats env beats file
    assert cfg.input == "env-in"  # env beats file
    assert cfg.output == "file-out"  # only in the file
    assert cfg.device == "cpu"
    assert cfg.workers == 2  # a None override does not erase the file's value
    assert cfg.scheduler == "sync"  # a None override does not erase the env's value
    assert cfg.errors.task_retries == 7  # env beats file inside [errors]
    assert cfg.errors.max_failed_shards == 9  # override beats env inside [errors]
    assert cfg.errors.max_rejected_fraction == 0.2  # file value kept, tables merge per key


def test_env_values_are_parsed_by_type() -> None:
    env = {
        "SCORE_CATALOG_INPUT": "in",
        "SCORE_CATALOG_OUTPUT": "out",
        "SCORE_CATALOG_MODEL": "model",
        "SCORE_CATALOG_PASSTHROUGH": "category, brand ,,price",
        "SCORE_CATALOG_FORCE": "yes",
        "SCORE_CATALOG_WORKERS": "6",
        "SCORE_CATALOG_STALE_LOCK_AFTER_S": "1.5",
        "SCORE_CATALOG_MAX_REJECTED_FRACTION": "0.25",
        "SCORE_CATALOG_ON_INVALID_ROWS": "fail",
        # Not ours: ignored.
        "PATH": "/usr/bin",
        "OTHER_BATCH_SIZE": "nonsense",
    }
    cfg = build_config(env=env)
    assert cfg.passthrough == ("category", "brand", "price")
    assert cfg.force is True
    assert cfg.workers == 6
    assert cfg.stale_lock_after_s == 1.5
    assert cfg.errors.max_rejected_fraction == 0.25
    assert cfg.errors.on_invalid_rows == "fail"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("ON", True),
        (" Yes ", True),
        ("0", False),
        ("false", False),
        ("off", False),
        ("no", False),
        ("", False),
    ],
)
def test_env_bool_words(raw: str, expected: bool) -> None:
    cfg = build_config(env={"SCORE_CATALOG_FORCE": raw}, overrides=BASE)
    assert cfg.force is expected


@pytest.mark.parametrize(
    ("file_value", "env_value", "expected"),
    [
        (None, None, "auto"),
        ("true", None, True),
        ('"auto"', None, "auto"),
        ("false", None, False),
        ("false", "auto", "auto"),
        ('"auto"', "off", False),
        (None, " AUTO ", "auto"),
        (None, "yes", True),
    ],
)
def test_overlap_is_on_off_or_auto_in_every_layer(
    tmp_path: Path, file_value: str | None, env_value: str | None, expected: bool | str
) -> None:
    text = 'input = "i"\noutput = "o"\nmodel = "m"\n'
    if file_value is not None:
        text += f"overlap = {file_value}\n"
    env = {} if env_value is None else {"SCORE_CATALOG_OVERLAP": env_value}
    assert build_config(write_job(tmp_path, text), env=env).overlap == expected


def test_overlap_words_other_than_auto_are_refused(tmp_path: Path) -> None:
    job = write_job(tmp_path, 'input = "i"\noutput = "o"\nmodel = "m"\noverlap = "sometimes"\n')
    with pytest.raises(ConfigError) as excinfo:
        build_config(job, env={"SCORE_CATALOG_OVERLAP": "maybe"})
    assert problems_of(excinfo) == [
        "SCORE_CATALOG_OVERLAP='maybe' is not true, false or \"auto\"",
        f"overlap = 'sometimes' must be true, false or \"auto\" (in {job})",
    ]


def test_an_empty_overlap_variable_is_refused_not_read_as_false() -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={"SCORE_CATALOG_OVERLAP": " "}, overrides=BASE)
    assert problems_of(excinfo) == ["SCORE_CATALOG_OVERLAP=' ' is not true, false or \"auto\""]


@pytest.mark.parametrize(
    ("key", "word"),
    [
        ("overlap", 'true, false or "auto"'),
        ("batch_size", 'an integer or "auto"'),
        ("force", "true or false"),
    ],
)
def test_a_constructed_config_refuses_none_where_the_key_is_not_optional(
    key: str, word: str
) -> None:
    # In a layer None means "not given"; in JobConfig(...) it is the value itself.
    with pytest.raises(ConfigError) as excinfo:
        JobConfig(**BASE, **{key: None})
    assert problems_of(excinfo) == [f"{key} = None must be {word}"]
    assert JobConfig(**BASE, workers=None).workers is None  # an optional key


def test_env_false_beats_file_true(tmp_path: Path) -> None:
    job = write_job(tmp_path, 'input = "i"\noutput = "o"\nmodel = "m"\nforce = true\n')
    assert build_config(job, env={}).force is True
    assert build_config(job, env={"SCORE_CATALOG_FORCE": "0"}).force is False
    assert build_config(job, env={"SCORE_CATALOG_FORCE": "0"}, overrides={"force": True}).force


def test_env_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCORE_CATALOG_BATCH_SIZE", "77")
    assert build_config(overrides=BASE).batch_size == 77
    # An explicit env mapping replaces os.environ entirely.
    assert build_config(env={}, overrides=BASE).batch_size == 4096


def test_an_unknown_env_var_is_named_with_the_closest_names() -> None:
    # Issue 22, 9e: the closest name(s), not all 35 of them.
    for typo in ("SCORE_CATALOG_BATCHSIZE", "SCORE_CATALOG_BACH_SIZE"):
        with pytest.raises(ConfigError) as excinfo:
            build_config(env={typo: "10"}, overrides=BASE)
        (problem,) = problems_of(excinfo)
        assert (
            problem
            == f"unknown environment variable {typo}; did you mean SCORE_CATALOG_BATCH_SIZE?"
        )
    # Nothing close: every known name, so that the right one can be found.
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={"SCORE_CATALOG_NOPE": "10"}, overrides=BASE)
    (problem,) = problems_of(excinfo)
    assert "did you mean" not in problem
    assert "known ones:" in problem and "SCORE_CATALOG_TASK_RETRIES" in problem


def test_an_unknown_job_key_gets_a_guess_too(tmp_path: Path) -> None:
    job = write_job(tmp_path, 'input = "i"\noutput = "o"\nmodel = "m"\nid_colum = "x"\n')
    with pytest.raises(ConfigError) as excinfo:
        build_config(job, env={})
    (problem,) = problems_of(excinfo)
    assert problem.startswith("unknown key 'id_colum'; did you mean 'id_column'? known keys:")


def test_env_type_errors_all_reported() -> None:
    env = {
        "SCORE_CATALOG_BATCH_SIZE": "lots",
        "SCORE_CATALOG_FORCE": "maybe",
        "SCORE_CATALOG_STALE_LOCK_AFTER_S": "soon",
        "SCORE_CATALOG_TASK_RETRIES": "2.5",
        "SCORE_CATALOG_NOPE": "1",
    }
    with pytest.raises(ConfigError) as excinfo:
        build_config(env=env, overrides=BASE)
    problems = problems_of(excinfo)
    assert len(problems) == 5
    assert "SCORE_CATALOG_BATCH_SIZE='lots' is not an integer or \"auto\"" in problems
    assert "SCORE_CATALOG_FORCE='maybe' is not true or false" in problems
    assert "SCORE_CATALOG_STALE_LOCK_AFTER_S='soon' is not a number" in problems
    assert "SCORE_CATALOG_TASK_RETRIES='2.5' is not an integer" in problems
    assert has_problem(problems, "unknown environment variable SCORE_CATALOG_NOPE")


def test_problems_from_file_and_env_reported_together(tmp_path: Path) -> None:
    job = write_job(tmp_path, 'input = "i"\noutput = "o"\nmodel = "m"\nbatchsize = 5\n')
    with pytest.raises(ConfigError) as excinfo:
        build_config(job, env={"SCORE_CATALOG_WORKERS": "many"})
    problems = problems_of(excinfo)
    assert has_problem(problems, "unknown key 'batchsize'", f"(in {job})")
    assert "SCORE_CATALOG_WORKERS='many' is not an integer" in problems
    # Issue 22, 9d: not "in job.toml" for a problem that came from the environment.
    assert excinfo.value.source is None
    assert "invalid configuration (2 problems)" in str(excinfo.value)


def test_each_problem_names_its_real_source(tmp_path: Path) -> None:
    """Issue 22, 9d: a flag's or a variable's mistake is not "in jobs/my_job.toml"."""
    job = write_job(tmp_path, 'input = "i"\noutput = "o"\nmodel = "m"\n')
    with pytest.raises(ConfigError) as excinfo:
        build_config(job, env={"SCORE_CATALOG_WORKERS": "0"})
    assert str(excinfo.value) == (
        "invalid configuration: workers = 0 must be an integer >= 1 (from SCORE_CATALOG_WORKERS)"
    )
    with pytest.raises(ConfigError) as excinfo:
        build_config(job, env={}, overrides=from_flags({"batch_size": 0, "on_schema_error": "x"}))
    assert problems_of(excinfo) == [
        'batch_size = 0 must be an integer >= 1 or "auto" (from --batch-size)',
        "errors.on_schema_error = 'x' must be 'fail' or 'skip_shard' (from --on-schema-error)",
    ]
    # All from the job file: said once, in the header, as before.
    job.write_text('input = "i"\noutput = "o"\nmodel = "m"\nworkers = 0\n')
    with pytest.raises(ConfigError) as excinfo:
        build_config(job, env={})
    assert str(excinfo.value) == (
        f"invalid configuration in {job}: workers = 0 must be an integer >= 1"
    )


# --------------------------------------------------------------------------------------------
# Unknown keys and type errors
# --------------------------------------------------------------------------------------------


def test_unknown_keys_top_level_and_errors_named(tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        'input = "i"\noutput = "o"\nmodel = "m"\nbatchsize = 5\ngpu = true\n'
        "[errors]\nmax_failed = 3\ntask_retries = 1\n",
    )
    with pytest.raises(ConfigError) as excinfo:
        build_config(job, env={})
    message = str(excinfo.value)
    problems = problems_of(excinfo)
    assert len(problems) == 3
    assert "unknown key 'batchsize'" in message
    assert "unknown key 'gpu'" in message
    assert "unknown key 'errors.max_failed'" in message
    # The known keys are listed so that the typo can be fixed.
    assert has_problem(problems, "'batchsize'", "batch_size", "stale_lock_after_s", "storage")
    assert has_problem(problems, "'errors.max_failed'", "errors.max_failed_shards")


def test_type_errors_all_reported() -> None:
    overrides = {
        **BASE,
        "batch_size": "8",
        "force": "yes",
        "passthrough": "category",
        "workers": 2.0,
        "device": 0,
        "stale_lock_after_s": "1h",
        "errors": {"max_rejected_fraction": "high", "task_retries": True},
    }
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={}, overrides=overrides)
    problems = problems_of(excinfo)
    assert sorted(problems) == sorted(
        [
            "batch_size = '8' must be an integer or \"auto\"",
            "force = 'yes' must be true or false",
            "passthrough = 'category' must be a list of strings",
            "workers = 2.0 must be an integer",
            "device = 0 must be a string",
            "stale_lock_after_s = '1h' must be a number",
            "errors.max_rejected_fraction = 'high' must be a number",
            "errors.task_retries = True must be an integer",
        ]
    )


@pytest.mark.parametrize("value", [True, False])
def test_bool_is_not_an_integer(value: bool) -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={}, overrides={**BASE, "batch_size": value})
    assert problems_of(excinfo) == [f'batch_size = {value!r} must be an integer or "auto"']


def test_passthrough_list_with_non_string() -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={}, overrides={**BASE, "passthrough": ["a", 1]})
    assert problems_of(excinfo) == ["passthrough = ['a', 1] must be a list of strings"]


@pytest.mark.parametrize("key", ["errors", "storage"])
def test_tables_must_be_tables(tmp_path: Path, key: str) -> None:
    job = write_job(tmp_path, f'input = "i"\noutput = "o"\nmodel = "m"\n{key} = 5\n')
    with pytest.raises(ConfigError) as excinfo:
        build_config(job, env={})
    assert problems_of(excinfo) == [f"[{key}] must be a table"]


# --------------------------------------------------------------------------------------------
# Value rules
# --------------------------------------------------------------------------------------------


def test_every_bad_value_reported_at_once(tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        'input = "i"\noutput = "out/{day}"\nrejects = "rej/{user}"\nmodel = "m"\n'
        'batch_size = 0\ndevice = "gpu"\nscheduler = "yarn"\nworkers = 0\n'
        'date = "2024-13-01"\npassthrough = ["item_id", "x", "x"]\nstale_lock_after_s = 0\n'
        "[errors]\nmax_failed_shards = -1\nmax_rejected_fraction = 1.5\n"
        'on_schema_error = "ignore"\non_invalid_rows = "drop"\ntask_retries = -1\n',
    )
    with pytest.raises(ConfigError) as excinfo:
        build_config(job, env={})
    problems = problems_of(excinfo)
    expected = [
        ("output = 'out/{day}'", "unknown placeholder", "day"),
        ("rejects = 'rej/{user}'", "unknown placeholder", "user"),
        ("batch_size = 0", ">= 1"),
        ("device = 'gpu'", "auto, cpu, cuda, cuda:N"),
        ("scheduler = 'yarn'", "tcp://HOST:PORT"),
        ("workers = 0", ">= 1"),
        ("date = '2024-13-01'", "YYYY-MM-DD"),
        ("names a column twice",),
        ("passthrough names the id column 'item_id'",),
        ("stale_lock_after_s = 0", "> 0"),
        ("errors.max_failed_shards = -1", ">= 0"),
        ("errors.max_rejected_fraction = 1.5", "[0, 1]"),
        ("errors.on_schema_error = 'ignore'", "'fail' or 'skip_shard'"),
        ("errors.on_invalid_rows = 'drop'", "'reject' or 'fail'"),
        ("errors.task_retries = -1", ">= 0"),
    ]
    for fragments in expected:
        assert has_problem(problems, *fragments), (fragments, problems)
    assert len(problems) == len(expected)
    assert f"({len(expected)} problems)" in str(excinfo.value)
    assert excinfo.value.source == str(job)


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_good_devices(device: str) -> None:
    assert build_config(env={}, overrides={**BASE, "device": device}).device == device


@pytest.mark.parametrize("device", ["gpu", "CUDA", "cuda:", "cuda:x", "cpu:0", "mps", ""])
def test_bad_devices(device: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={}, overrides={**BASE, "device": device})
    assert problems_of(excinfo) == [f"device = {device!r} is not one of auto, cpu, cuda, cuda:N"]


@pytest.mark.parametrize(
    "scheduler", ["local", "threads", "sync", "tcp://10.0.0.1:8786", "tls://sched:8786"]
)
def test_good_schedulers(scheduler: str) -> None:
    assert build_config(env={}, overrides={**BASE, "scheduler": scheduler}).scheduler == scheduler


@pytest.mark.parametrize("scheduler", ["processes", "tcp://", "http://host:1", "tcp://a b", ""])
def test_bad_schedulers(scheduler: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={}, overrides={**BASE, "scheduler": scheduler})
    assert has_problem(problems_of(excinfo), f"scheduler = {scheduler!r}", "local, threads, sync")


@pytest.mark.parametrize("date", ["2024-02-30", "2024-1-5", "yesterday", "15/01/2024"])
def test_bad_dates(date: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={}, overrides={**BASE, "date": date})
    assert problems_of(excinfo) == [f"date = {date!r} is not a date in YYYY-MM-DD form"]


@pytest.mark.parametrize(
    ("template", "fragment"),
    [
        ("out/{day}", "unknown placeholder(s) ['day']"),
        ("out/{0}", "unknown placeholder(s) ['0']"),
        ("out/{}", "unknown placeholder(s) ['']"),
        ("out/{date.year}", "unknown placeholder(s) ['date.year']"),
        ("out/{date", "is not a valid template"),
        ("out/date}", "is not a valid template"),
    ],
)
def test_bad_output_templates(template: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={}, overrides={**BASE, "output": template})
    assert has_problem(problems_of(excinfo), f"output = {template!r}", fragment)


def test_bad_rejects_template() -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={}, overrides={**BASE, "rejects": "rej/{run}"})
    assert has_problem(
        problems_of(excinfo), "rejects = 'rej/{run}'", "['run']", "allowed: {date}, {run_id}"
    )


def test_passthrough_with_id_column_refused() -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={}, overrides={**BASE, "passthrough": ["category", "item_id"]})
    assert problems_of(excinfo) == [
        "passthrough names the id column 'item_id'; it is always copied first"
    ]
    # The same column is fine once it is no longer the id column.
    cfg = build_config(
        env={}, overrides={**BASE, "id_column": "sku", "passthrough": ["category", "item_id"]}
    )
    assert cfg.passthrough == ("category", "item_id")


def test_passthrough_with_id_column_from_env_layer(tmp_path: Path) -> None:
    job = write_job(tmp_path, 'input = "i"\noutput = "o"\nmodel = "m"\npassthrough = ["sku"]\n')
    with pytest.raises(ConfigError) as excinfo:
        build_config(job, env={"SCORE_CATALOG_ID_COLUMN": "sku"})
    assert has_problem(problems_of(excinfo), "passthrough names the id column 'sku'")


def test_type_and_value_problems_reported_together() -> None:
    overrides = {**BASE, "batch_size": "8", "device": "gpu", "bogus": 1}
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={}, overrides=overrides)
    problems = problems_of(excinfo)
    assert has_problem(problems, "batch_size = '8'")
    assert has_problem(problems, "unknown key 'bogus'")
    assert has_problem(problems, "device = 'gpu'")


@pytest.mark.parametrize("date", ["20240115", "2024-W03-1"])
def test_date_must_be_yyyy_mm_dd(date: str) -> None:
    with pytest.raises(ConfigError):
        build_config(env={}, overrides={**BASE, "date": date})


def test_template_format_spec_is_refused() -> None:
    # Placeholders take no format spec: {date} is already YYYY-MM-DD.
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={}, overrides={**BASE, "output": "out/{date:%Y}"})
    assert has_problem(problems_of(excinfo), "output")


def test_nan_stale_lock_after_refused() -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={"SCORE_CATALOG_STALE_LOCK_AFTER_S": "nan"}, overrides=BASE)
    assert has_problem(problems_of(excinfo), "stale_lock_after_s")


def test_nan_rejected_fraction_refused() -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={"SCORE_CATALOG_MAX_REJECTED_FRACTION": "nan"}, overrides=BASE)
    assert has_problem(problems_of(excinfo), "errors.max_rejected_fraction = nan", "[0, 1]")


# --------------------------------------------------------------------------------------------
# The JobConfig object
# --------------------------------------------------------------------------------------------


def test_jobconfig_is_frozen() -> None:
    cfg = build_config(env={}, overrides=BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch_size = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.errors.task_retries = 9  # type: ignore[misc]
    assert cfg.batch_size == 4096
    assert cfg.errors.task_retries == 2


def test_jobconfig_direct_construction_validates() -> None:
    cfg = JobConfig(input="i", output="o", model="m", batch_size=10)
    assert cfg.batch_size == 10
    with pytest.raises(ConfigError) as excinfo:
        JobConfig(input="", output="o", model="m", batch_size=0, device="tpu")
    problems = problems_of(excinfo)
    assert "input must not be empty" in problems
    assert has_problem(problems, "batch_size = 0")
    assert has_problem(problems, "device = 'tpu'")
    assert len(problems) == 3


def test_replace_revalidates() -> None:
    cfg = build_config(env={}, overrides=BASE)
    assert dataclasses.replace(cfg, workers=4).workers == 4
    with pytest.raises(ConfigError) as excinfo:
        dataclasses.replace(cfg, workers=0)
    assert problems_of(excinfo) == ["workers = 0 must be an integer >= 1"]


def test_output_and_rejects_templating() -> None:
    cfg = build_config(
        env={},
        overrides={
            **BASE,
            "output": "s3://bucket/scored/run_date={date}/run={run_id}",
            "date": "2024-03-05",
        },
    )
    assert cfg.run_date == "2024-03-05"
    assert cfg.output_uri("r42") == "s3://bucket/scored/run_date=2024-03-05/run=r42"
    # Default rejects: outside the template's fixed part (s3://bucket/scored), beside it.
    assert cfg.rejects_uri("r42") == "s3://bucket/_rejects/scored/run_date=2024-03-05/run=r42"

    cfg2 = dataclasses.replace(cfg, output="out/{date}/", rejects="rej/{run_id}/{date}")
    assert cfg2.output_uri("abc") == "out/2024-03-05/"
    assert cfg2.rejects_uri("abc") == "rej/abc/2024-03-05"

    cfg3 = dataclasses.replace(cfg, output="out/{{literal}}/{date}/", rejects=None)
    assert cfg3.output_uri("x") == "out/{literal}/2024-03-05/"
    # A trailing slash on the output does not end up in the rejects' name.
    assert cfg3.rejects_uri("x") == "out/_rejects/{literal}/2024-03-05"


def test_run_date_defaults_to_today_utc() -> None:
    before = dt.datetime.now(dt.timezone.utc).date().isoformat()
    cfg = build_config(env={}, overrides={**BASE, "output": "out/{date}"})
    got = cfg.output_uri("r")
    after = dt.datetime.now(dt.timezone.utc).date().isoformat()
    assert cfg.run_date in (before, after)
    assert got in (f"out/{before}", f"out/{after}")


def test_redacted_hides_storage_values(tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        'input = "s3://b/in"\noutput = "s3://b/out"\nmodel = "s3://b/m"\n'
        'passthrough = ["category"]\n'
        '[storage]\nkey = "AKIAEXAMPLEKEY"\nsecret = "hunter2-secret"\n'
        'endpoint_url = "http://minio.internal:9000"\n',
    )
    cfg = build_config(job, env={}, overrides={"storage": {"token": "tok-123456"}})
    red = cfg.redacted()
    assert red["storage"] == {
        "key": "***",
        "secret": "***",
        "endpoint_url": "***",
        "token": "***",
    }
    text = json.dumps(red)  # JSON-able as a whole
    for secret in ("AKIAEXAMPLEKEY", "hunter2-secret", "minio.internal", "tok-123456"):
        assert secret not in text
    assert red["passthrough"] == ["category"]
    assert red["input"] == "s3://b/in"
    assert red["errors"]["task_retries"] == 2
    # The config itself keeps the real values for fsspec.
    assert cfg.storage["secret"] == "hunter2-secret"
    assert cfg.storage["token"] == "tok-123456"


def test_config_error_shape() -> None:
    one = ConfigError("just one")
    assert one.problems == ["just one"]
    assert str(one) == "invalid configuration: just one"
    many = ConfigError(["a", "b"], "job.toml")
    assert str(many) == "invalid configuration in job.toml (2 problems):\n  - a\n  - b"
    assert many.exit_code == EXIT_USAGE


# --------------------------------------------------------------------------------------------
# The job files shipped in jobs/
# --------------------------------------------------------------------------------------------


def test_jobs_folder_has_job_files() -> None:
    assert JOB_FILES, f"no job files found in {REPO / 'jobs'}"


@pytest.mark.parametrize("job", JOB_FILES, ids=lambda p: p.name)
def test_shipped_job_files_validate(job: Path) -> None:
    cfg = build_config(job, env={})
    assert isinstance(cfg, JobConfig)
    assert cfg.name  # from the file or its stem
    out = cfg.output_uri("run-1")
    rej = cfg.rejects_uri("run-1")
    for uri in (out, rej):
        assert "{" not in uri and "}" not in uri, uri
    assert out != rej
    json.dumps(cfg.redacted())


# --------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------

_absent = st.none()


@settings(max_examples=60, deadline=None)
@given(
    file_bs=_absent | st.integers(1, 10**6),
    env_bs=_absent | st.integers(1, 10**6),
    flag_bs=_absent | st.integers(1, 10**6),
    file_w=_absent | st.integers(1, 512),
    env_w=_absent | st.integers(1, 512),
    flag_w=_absent | st.integers(1, 512),
    file_tr=_absent | st.integers(0, 50),
    env_tr=_absent | st.integers(0, 50),
    flag_tr=_absent | st.integers(0, 50),
)
def test_later_layer_always_wins(
    file_bs: int | None,
    env_bs: int | None,
    flag_bs: int | None,
    file_w: int | None,
    env_w: int | None,
    flag_w: int | None,
    file_tr: int | None,
    env_tr: int | None,
    flag_tr: int | None,
) -> None:
    lines = ['input = "i"', 'output = "o"', 'model = "m"']
    if file_bs is not None:
        lines.append(f"batch_size = {file_bs}")
    if file_w is not None:
        lines.append(f"workers = {file_w}")
    if file_tr is not None:
        lines += ["[errors]", f"task_retries = {file_tr}"]
    env: dict[str, str] = {}
    if env_bs is not None:
        env["SCORE_CATALOG_BATCH_SIZE"] = str(env_bs)
    if env_w is not None:
        env["SCORE_CATALOG_WORKERS"] = str(env_w)
    if env_tr is not None:
        env["SCORE_CATALOG_TASK_RETRIES"] = str(env_tr)
    # None in overrides means "flag not given", exactly like the CLI passes it.
    overrides: dict[str, Any] = {
        "batch_size": flag_bs,
        "workers": flag_w,
        "errors": {"task_retries": flag_tr},
    }

    def last(*values: int | None, default: int | None) -> int | None:
        given_ = [v for v in values if v is not None]
        return given_[-1] if given_ else default

    with tempfile.TemporaryDirectory() as d:
        job = write_job(Path(d), "\n".join(lines) + "\n")
        cfg = build_config(job, env=env, overrides=overrides)
    assert cfg.batch_size == last(file_bs, env_bs, flag_bs, default=4096)
    assert cfg.workers == last(file_w, env_w, flag_w, default=None)
    assert cfg.errors.task_retries == last(file_tr, env_tr, flag_tr, default=2)


# Every name a job file knows at the top level or inside [errors]/[monitoring].
_KNOWN = {s.name for s in SETTINGS} | set(SECTIONS)
_junk_key = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=12).filter(
    lambda k: k not in _KNOWN
)


@settings(max_examples=60, deadline=None)
@given(
    top=st.sets(_junk_key, max_size=4),
    in_errors=st.sets(_junk_key, max_size=4),
    value=st.one_of(st.integers(), st.text(max_size=5), st.booleans()),
)
def test_junk_keys_always_rejected_and_named(
    top: set[str], in_errors: set[str], value: Any
) -> None:
    assume(top or in_errors)
    overrides: dict[str, Any] = {**BASE, **{k: value for k in top}}
    if in_errors:
        overrides["errors"] = {k: value for k in in_errors}
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={}, overrides=overrides)
    problems = problems_of(excinfo)
    message = str(excinfo.value)
    for k in top:
        assert has_problem(problems, f"unknown key {k!r}")
    for k in in_errors:
        assert has_problem(problems, f"unknown key {'errors.' + k!r}")
    assert len(problems) == len(top) + len(in_errors)
    assert all(k in message for k in top | in_errors)


@settings(max_examples=40, deadline=None)
@given(
    junk=st.dictionaries(
        _junk_key.map(lambda k: ENV_PREFIX + k.upper()), st.text(max_size=5), max_size=4
    ).filter(bool)
)
def test_junk_env_vars_always_rejected_and_named(junk: Mapping[str, str]) -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_config(env=dict(junk), overrides=BASE)
    problems = problems_of(excinfo)
    assert len(problems) == len(junk)
    for var in junk:
        assert has_problem(problems, f"unknown environment variable {var};")


def test_nan_is_not_a_valid_batch_size_from_env() -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_config(env={"SCORE_CATALOG_BATCH_SIZE": "nan"}, overrides=BASE)
    assert problems_of(excinfo) == ["SCORE_CATALOG_BATCH_SIZE='nan' is not an integer or \"auto\""]


# --- where the metrics of a job whose configuration is wrong go (issue 22, item 8) -----------


def test_metrics_destination_reads_every_layer_that_can_be_read(tmp_path: Path) -> None:
    job = tmp_path / "nightly.toml"
    job.write_text('batch_size = "lots"\nmetrics_file = "/m/job.prom"\nunknown_key = 1\n')
    with pytest.raises(ConfigError):
        build_config(job, env={})
    found = metrics_destination(job, env={"SCORE_CATALOG_BATCH_SIZ": "5"})
    assert found == MetricsDestination("nightly", "/m/job.prom", None)
    # Later layers win, as in build_config; a value that is wrong itself is left out.
    env = {"SCORE_CATALOG_METRICS_FILE": "/m/env.prom", "SCORE_CATALOG_PUSHGATEWAY": "gw:9091"}
    found = metrics_destination(job, env=env, overrides={"name": "nightly-eu"})
    assert found == MetricsDestination("nightly-eu", "/m/env.prom", None)


def test_metrics_destination_without_a_readable_job_file(tmp_path: Path) -> None:
    job = tmp_path / "broken.toml"
    job.write_text('input = "unterminated\n')
    env = {"SCORE_CATALOG_PUSHGATEWAY": "http://gw:9091"}
    assert metrics_destination(job, env=env) == MetricsDestination("broken", None, "http://gw:9091")
    assert metrics_destination(tmp_path / "missing.toml", env={}) is None


def test_an_iceberg_output_is_a_table_and_needs_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """``format = "iceberg"``: the template's folders are partitions (as for Delta, the message
    names the format), and without pyiceberg the job is refused with the extra to install."""
    with pytest.raises(ConfigError) as excinfo:
        JobConfig(input="i", output="data/scored/{date}", model="m", format="iceberg")
    assert has_problem(problems_of(excinfo), 'format = "iceberg"', "run_date={date}")
    monkeypatch.setattr(
        tableformats,
        "missing_packages",
        lambda names: ["pyiceberg"] if "pyiceberg" in names else [],
    )
    with pytest.raises(ConfigError) as excinfo:
        JobConfig(input="i", output="data/scored/run_date={date}", model="m", format="iceberg")
    assert problems_of(excinfo) == [
        "format = 'iceberg' needs pyiceberg, which is not installed here: pip install "
        "'score-catalog[iceberg]', or use format 'delta' or 'parquet'"
    ]
