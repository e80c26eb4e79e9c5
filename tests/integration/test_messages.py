"""Issue 13: common mistakes give a message and an exit code, never a traceback.

Each case runs the real CLI (a real process where the environment matters) against real
files, a real S3-compatible server (moto on 127.0.0.1, with no credentials where that is the
mistake) and a real closed port, and checks the message, the exit code and that stderr holds
no traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from pipeline.core.errors import EXIT_INPUT, EXIT_RUN_FAILED, EXIT_USAGE
from tests.integration.helpers import CliResult, cli, cli_argv, job_args
from tests.integration.servers import MotoServer, aws_env, free_port

pytestmark = pytest.mark.integration


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _no_traceback(r: CliResult) -> None:
    assert "Traceback" not in r.output, r.output


def _run(*args: str, env: dict[str, str] | None = None) -> CliResult:
    """The real CLI in a process whose environment is exactly ``env`` (AWS settings included)."""
    done = subprocess.run(
        cli_argv(*args),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    return CliResult(done.returncode, done.stdout, done.stderr, None)


# ---------------------------------------------------------------- files where folders go


@pytest.mark.parametrize("name", ["model.pt2", "model.toml"])
def test_model_naming_a_file_in_the_bundle_says_give_the_folder(
    name: str, catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    r = cli("run", *job_args(catalog, tmp_path / "o", bundle_dir / name), in_process=True)
    assert r.returncode == EXIT_USAGE, r.output
    assert f"model = '{bundle_dir / name}' is a file, not a model bundle folder" in r.output
    assert f"--model {bundle_dir}" in r.output
    _no_traceback(r)
    assert not (tmp_path / "o").exists()


def test_rejects_under_a_file_is_refused_before_anything_is_written(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file\n")
    out = tmp_path / "o"
    r = cli(
        "run", *job_args(catalog, out, bundle_dir), "--rejects", str(blocker / "rej"),
        "--scheduler", "sync", in_process=True,
    )  # fmt: skip
    assert r.returncode == EXIT_RUN_FAILED, r.output
    assert f"rejects {blocker / 'rej'} is a file or lies under one ({blocker})" in r.output
    _no_traceback(r)
    assert not out.exists()


def test_output_under_a_file_and_metrics_file_a_folder(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file\n")
    r = cli("run", *job_args(catalog, blocker, bundle_dir), in_process=True)
    assert r.returncode == EXIT_RUN_FAILED, r.output
    assert f"output {blocker} is a file" in r.output
    _no_traceback(r)

    r = cli(
        "run", *job_args(catalog, tmp_path / "o", bundle_dir), "--metrics-file", str(tmp_path),
        in_process=True,
    )  # fmt: skip
    assert r.returncode == EXIT_USAGE, r.output
    assert f"metrics_file = '{tmp_path}' is a folder; give a file in it" in r.output
    _no_traceback(r)


def test_a_folder_where_a_job_file_or_report_file_goes(tmp_path: Path) -> None:
    r = cli("run", str(tmp_path), in_process=True)
    assert r.returncode == EXIT_USAGE and "is a directory" in r.output, r.output
    folder = tmp_path / "r.json"
    folder.mkdir()
    r = cli("report", str(folder), in_process=True)
    assert r.returncode == EXIT_USAGE, r.output
    assert f"no run report at {folder}: it is a folder, not a report file" in r.output
    _no_traceback(r)


def test_report_of_nothing_is_a_usage_error_with_a_message(tmp_path: Path) -> None:
    for where, what in (
        (tmp_path / "nothing", "it does not exist"),
        (tmp_path, "it has no _report.json"),
    ):
        r = cli("report", str(where), in_process=True)
        assert r.returncode == EXIT_USAGE, r.output
        assert f"no run report at {where}: {what}; give a run's output root" in _flat(r.output)
        _no_traceback(r)
    not_json = tmp_path / "x.json"
    not_json.write_text("{not json")
    r = cli("report", str(not_json), in_process=True)
    assert r.returncode == EXIT_USAGE and "is not a run report (not JSON" in r.output
    _no_traceback(r)


# ---------------------------------------------------------------- object storage


def _s3_env(moto: MotoServer, *, credentials: bool) -> dict[str, str]:
    env = aws_env(os.environ)
    env = {k: v for k, v in env.items() if not k.startswith("SCORE_CATALOG_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    if not credentials:
        del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    return env


def _s3_args(moto: MotoServer, catalog: Path, bundle: Path, output: str) -> list[str]:
    return [
        "run", *job_args(catalog, output, bundle), "--scheduler", "sync",
        f"--storage-option=endpoint_url={moto.endpoint}",
    ]  # fmt: skip


def test_s3_output_without_credentials_says_how_to_give_them(
    moto_server: MotoServer, catalog: Path, bundle_dir: Path
) -> None:
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    moto_server.client().create_bucket(Bucket=bucket)
    args = _s3_args(moto_server, catalog, bundle_dir, f"s3://{bucket}/scored")
    r = _run(*args, env=_s3_env(moto_server, credentials=False))
    assert r.returncode == EXIT_USAGE, r.output
    text = _flat(r.stderr)
    assert f"s3://{bucket}: no credentials for s3:// storage (NoCredentialsError" in text
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in text and "[storage]" in text
    _no_traceback(r)
    listed = moto_server.client().list_objects_v2(Bucket=bucket)
    assert listed.get("KeyCount", 0) == 0  # nothing was written


def test_unknown_storage_option_is_exit_2_naming_the_key(
    moto_server: MotoServer, catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    args = _s3_args(moto_server, catalog, bundle_dir, "s3://any-bucket/scored")
    r = cli(*args, "--storage-option", "enpoint=x", "--storage-option", "colour=blue")
    assert r.returncode == EXIT_USAGE, r.output
    text = _flat(r.output)
    assert "storage options 'colour', 'enpoint' are not options of s3:// storage" in text
    assert "did you mean 'enpoint' -> 'endpoint_url'?" in text and "known: anon," in text
    _no_traceback(r)
    # The report command checks its own --storage-option the same way.
    r = cli("report", "s3://any-bucket/scored", "--storage-option", "colour=blue")
    assert r.returncode == EXIT_USAGE and "'colour' is not an option of s3://" in r.output
    _no_traceback(r)
    # A job on local paths only is not checked: fsspec's local filesystem ignores options.
    local = cli(
        "run", *job_args(catalog, tmp_path / "o", bundle_dir), "--scheduler", "sync",
        "--storage-option", "colour=blue", in_process=True,
    )  # fmt: skip
    assert local.returncode == 0, local.output


@pytest.mark.slow
def test_missing_output_bucket_is_an_error_unless_creating_it_is_asked_for(
    moto_server: MotoServer, catalog: Path, bundle_dir: Path
) -> None:
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    output = f"s3://{bucket}/scored"
    args = [
        *_s3_args(moto_server, catalog, bundle_dir, output),
        "--rejects", f"s3://{bucket}/rejects",
    ]  # fmt: skip
    env = _s3_env(moto_server, credentials=True)
    r = _run(*args, env=env)
    assert r.returncode == EXIT_USAGE, r.output
    assert f"output {output}: bucket '{bucket}' does not exist at s3://{bucket}" in _flat(r.stderr)
    assert "--create-output-bucket" in r.stderr
    _no_traceback(r)
    names = [b["Name"] for b in moto_server.client().list_buckets()["Buckets"]]
    assert bucket not in names  # refused: not created

    r = _run(*args, "--create-output-bucket", env=env)
    assert r.returncode == 0, r.output
    listed = moto_server.client().list_objects_v2(Bucket=bucket, Prefix="scored/")
    keys = {o["Key"] for o in listed["Contents"]}
    assert {"scored/_SUCCESS", "scored/part-00000.parquet"} <= keys


# ---------------------------------------------------------------- an unreachable scheduler


def test_unreachable_scheduler_is_a_message_in_bounded_time(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    port = free_port()  # nothing listens there
    out = tmp_path / "o"
    t0 = time.monotonic()
    r = cli("run", *job_args(catalog, out, bundle_dir), "--scheduler", f"tcp://127.0.0.1:{port}")
    took = time.monotonic() - t0
    assert r.returncode == EXIT_RUN_FAILED, r.output
    assert (
        f"cannot reach the Dask scheduler at tcp://127.0.0.1:{port}: nothing listens on "
        f"127.0.0.1:{port} (connection refused)" in _flat(r.stderr)
    )
    _no_traceback(r)
    assert took < 25, took  # Dask's client alone retried for its whole 30 s timeout
    assert not out.exists()  # refused before the lock: no failed report either


def test_input_that_is_not_parquet_is_exit_3(bundle_dir: Path, tmp_path: Path) -> None:
    text = tmp_path / "rows.csv"
    text.write_text("item_id,f0\n1,2\n")
    r = cli("run", *job_args(text, tmp_path / "o", bundle_dir), in_process=True)
    assert r.returncode == EXIT_INPUT and "matched no Parquet shards" in r.output
    _no_traceback(r)
