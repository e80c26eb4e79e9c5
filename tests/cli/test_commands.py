"""pipeline.cli: options made from the config's settings, layering through the CLI, errors.

No scoring here (tests/integration covers runs); every command below stops at configuration.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pipeline.cli.commands import main, run
from pipeline.core import config, jobfile, settings
from pipeline.core.errors import EXIT_USAGE

# Settings only a job file or the environment can set (no flag), on purpose.
NO_FLAG = {
    "name",
    "stale_lock_after_s",
    "errors.task_retries",
    "monitoring.drift",
    "monitoring.psi_threshold",
    "monitoring.ks_threshold",
    "monitoring.rows_change_threshold",
    "delta.log_retention_days",
    "delta.deleted_file_retention_days",
}


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[None]:
    """The commands configure logging; put the root logger back afterwards."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    yield
    logging.captureWarnings(False)
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def invoke(*args: str, env: dict[str, str] | None = None) -> click.testing.Result:
    # Keep the caller's SCORE_CATALOG_* variables out: only what the test sets counts.
    clean = {k: None for k in os.environ if k.startswith(settings.ENV_PREFIX)}
    return CliRunner().invoke(main, list(args), env={**clean, **(env or {})})


def options_by_name() -> dict[str, click.Option]:
    return {p.name: p for p in run.params if isinstance(p, click.Option) and p.name}


def test_every_flagged_setting_is_a_run_option_with_the_config_choices() -> None:
    options = options_by_name()
    flagged = [s for s in config.SETTINGS if s.flag is not None]
    assert {s.key for s in config.SETTINGS} - {s.key for s in flagged} == NO_FLAG
    backfill = {p.name: p for p in main.commands["backfill"].params if p.name}
    for s in flagged:
        if s.commands is not None:  # a flag of other commands only (backfill's)
            assert s.name not in options, s.key
            assert all(s.name in {p.name for p in main.commands[c].params} for c in s.commands)
            assert s.flag in backfill[s.name].opts
            continue
        option = options[s.name]
        assert s.flag in option.opts, (s.key, option.opts)
        # None: "not given", so that the job file and the environment stay.
        assert option.default is None or option.multiple, s.key
        if s.kind.choices and s.kind.name == "str":
            assert isinstance(option.type, click.Choice)
            assert tuple(option.type.choices) == s.kind.choices
    assert tuple(options["precision"].type.choices) == config.PRECISIONS  # type: ignore[attr-defined]


def test_help_shows_the_dataclass_defaults() -> None:
    text = invoke("run", "--help").output
    flat = re.sub(r"\s+", " ", text)
    for key in ("batch_size", "task_rows", "errors.max_rejected_fraction", "id_column"):
        s = config.setting(key)
        assert f"(default {s.default})" in flat, key
    assert "--overlap / --no-overlap" in flat


def test_invalid_job_file_reports_every_mistake_at_once(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(
        'input = "i"\noutput = "o/{day}"\nmodel = "m"\nbatchsize = 5\n'
        '[errors]\non_schema_error = "ignore"\n'
    )
    res = invoke("run", str(job))
    assert res.exit_code == EXIT_USAGE
    assert "(3 problems)" in res.output
    assert "unknown key 'batchsize'" in res.output
    assert "output = 'o/{day}' uses unknown placeholder(s) ['day']" in res.output
    assert "errors.on_schema_error = 'ignore' must be 'fail' or 'skip_shard'" in res.output


def test_flags_beat_environment_beats_job_file(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('input = "i"\noutput = "o"\nmodel = "m"\ndevice = "tpu"\nworkers = 0\n')
    # The file's bad device is replaced by the environment's bad one, which the flag replaces;
    # the file's bad workers stays. Only what survives the layering is reported.
    res = invoke("run", str(job), "--device", "cpu", env={"SCORE_CATALOG_DEVICE": "gpu"})
    assert res.exit_code == EXIT_USAGE
    assert "workers = 0 must be an integer >= 1" in res.output
    assert "device" not in res.output
    res = invoke("run", str(job), "--workers", "2", env={"SCORE_CATALOG_DEVICE": "gpu"})
    assert "device = 'gpu'" in res.output and "workers" not in res.output


def test_flag_values_parse_like_environment_values() -> None:
    res = invoke("run", "--input", "i", "--output", "o", "--batch-size", "lots")
    assert res.exit_code == EXIT_USAGE
    assert "'lots' is not an integer or \"auto\"" in res.output
    res = invoke("run", "--output", "o", "--batch-size", "AUTO", "--precision", "bf16")
    assert res.exit_code == EXIT_USAGE
    assert "input is required" in res.output and "model is required" in res.output
    assert "batch_size" not in res.output and "precision" not in res.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--resource", "GPU"], "'GPU' is not NAME=N"),
        (["--resource", "GPU=many"], "'GPU=many' is not NAME=N"),
        (["--storage-option", "novalue"], "'novalue' is not KEY=VALUE"),
        (["--precision", "fp64"], "'fp64' is not one of"),
    ],
)
def test_bad_flag_values_are_usage_errors(args: list[str], needle: str) -> None:
    res = invoke("run", "--input", "i", "--output", "o", "--model", "m", *args)
    assert res.exit_code == EXIT_USAGE
    assert needle in res.output


def test_resource_values_reach_the_config_as_numbers() -> None:
    res = invoke("run", "--output", "o/{day}", "--resource", "GPU=0", "--storage-option", "key=abc")
    assert res.exit_code == EXIT_USAGE
    assert "resources.GPU = 0.0 must be a number > 0" in res.output
    assert "abc" not in res.output  # storage option values are never shown


def test_from_flags_nests_table_keys_and_drops_unset() -> None:
    assert config.from_flags(
        {"batch_size": 8, "workers": None, "max_failed_shards": 2, "on_invalid_rows": None}
    ) == {"batch_size": 8, "errors": {"max_failed_shards": 2}}


def test_json_log_format_for_a_config_error(tmp_path: Path) -> None:
    res = invoke("run", "--log-format", "json", "--output", "o")
    assert res.exit_code == EXIT_USAGE
    (err,) = [json.loads(line) for line in res.stderr.splitlines() if line.strip()]
    assert err["event"] == "error" and err["exit_code"] == 2
    # stdout still ends with the one summary line JSON mode promises: the failure's.
    (summary,) = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
    assert summary["event"] == "summary" and summary["status"] == "failed"
    assert summary["exit_code"] == 2 and summary["run_id"] == err["run_id"]


# ---------------------------------------------------------------- issue 13: help and flags


@pytest.mark.parametrize(
    ("command", "says", "not_says"),
    [
        ("run", ["4 scored and committed", "143 or 130"], []),
        ("plan", ["0 every shard would be scored", "3 a shard would fail"], ["143", "drifted"]),
        ("report", ["no run report at RUN_URI"], ["143", "drifted", "error budget"]),
        ("demo", ["0 the catalog (and bundle) were written"], ["143", "drifted"]),
        ("backfill", ["the worst of the days'", "4 a day's scores drifted"], ["error budget"]),
    ],
)
def test_each_command_lists_its_own_exit_codes(
    command: str, says: list[str], not_says: list[str]
) -> None:
    res = invoke(command, "--help")
    assert res.exit_code == 0
    text = re.sub(r"\s+", " ", res.output)
    assert "Exit codes:" in text
    for words in says:
        assert words in text, (command, words)
    for words in not_says:
        assert words not in text, (command, words)


def test_backfill_help_shows_only_the_flags_it_uses() -> None:
    text = invoke("backfill", "--help").output
    assert "--date" not in text  # each day sets its own
    assert "--from YYYY-MM-DD" in text and "--to YYYY-MM-DD" in text
    assert "%Y" not in text
    res = invoke(
        "backfill", "job.toml", "--from", "2025-01-01", "--to", "2025-01-02", "--date", "x"
    )
    assert res.exit_code == EXIT_USAGE and "No such option '--date'" in res.output


def test_passthrough_takes_a_comma_list_like_the_environment(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('input = "i"\noutput = "o"\nmodel = "m"\n')
    option = options_by_name()["passthrough"]
    ctx = click.Context(run)
    for given, expected in (
        (("a,b",), ["a", "b"]),
        (("a, b", "c"), ["a", "b", "c"]),
        (("a",), ["a"]),
        ((), None),
    ):
        assert option.process_value(ctx, given) == expected, given
    from_env = jobfile.build_config(job, env={"SCORE_CATALOG_PASSTHROUGH": "a,b"})
    from_flag = jobfile.build_config(
        job, env={}, overrides=config.from_flags({"passthrough": ["a", "b"]})
    )
    assert from_env.passthrough == from_flag.passthrough == ("a", "b")
    res = invoke("run", str(job), "--passthrough", "item_id,x")  # the list is checked as one
    assert res.exit_code == EXIT_USAGE
    assert "passthrough names the id column 'item_id'" in res.output


def test_create_output_bucket_is_a_flag_and_a_job_key(tmp_path: Path) -> None:
    s = config.setting("create_output_bucket")
    assert s.default is False and s.flag == "--create-output-bucket"
    assert "--create-output-bucket" in invoke("run", "--help").output
    job = tmp_path / "job.toml"
    job.write_text('input = "i"\noutput = "o"\nmodel = "m"\ncreate_output_bucket = true\n')
    assert jobfile.build_config(job, env={}).create_output_bucket is True


def test_the_collector_is_paused_while_starting_then_frozen_and_back_on() -> None:
    import gc

    from pipeline.cli.commands import _StartupGC

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with _StartupGC() as startup:
            assert not gc.isenabled()
            startup.started()
            assert gc.isenabled()
            assert gc.get_freeze_count() > frozen  # what start-up made is out of reach now
            startup.started()  # again (each backfill day): nothing more
        assert gc.isenabled()
        gc.disable()  # a caller that had it off keeps it off
        with _StartupGC() as startup:
            startup.started()
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_a_run_turns_the_collector_back_on(bundle_dir: Path, catalog: Path, tmp_path: Path) -> None:
    import gc

    try:
        res = invoke(
            "run", "--input", str(catalog), "--output", str(tmp_path / "out"),
            "--model", str(bundle_dir), "--scheduler", "sync", "-q",
        )  # fmt: skip
        assert res.exit_code == 0, res.output
        assert gc.isenabled()
        failed = invoke("run", "--input", str(tmp_path / "none"), "--output", str(tmp_path / "o"))
        assert failed.exit_code != 0  # a run that fails before scoring turns it back on too
        assert gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
