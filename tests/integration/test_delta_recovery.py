"""A Delta table after the storage let it down: a committed data file lost (the next run scores
its shard again and its one commit removes the dangling path), a store that died just after a
commit landed (the run says the commit landed; the next run records it as recovered and the
dead run's run-index entry as committed), and a full disk at the commit (one plain line with the
cause first and a pointer to the report). Real CLI processes, real tables read back by deltalake
and Polars (``tests.integration.test_delta_run``'s helpers), on local disk and on S3 (moto).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from pipeline.sinks.delta.table import TableRef
from tests.integration import test_delta_run as delta_run
from tests.integration.diskfaults import small_disk
from tests.integration.helpers import Pause, cli, pause_env, report, start_cli
from tests.integration.netfaults import flaky_proxy
from tests.integration.servers import S3Bucket, aws_env, start_moto_server
from tests.integration.test_delta_run import (
    DAYS,
    commits,
    expected_rows,
    job_file,
    rows_of,
    run,
    table_version,
)

# test_delta_run's fixtures: three model bundles (module scope) and a three-day archive.
models = delta_run.models
archive = delta_run.archive

pytestmark = pytest.mark.integration


def _lose_one_file(out: Path, day: str) -> str:
    """Delete one committed data file of ``day`` by hand; its name."""
    victim = sorted((out / f"dt={day}").glob("*.parquet"))[0]
    victim.unlink()
    return victim.name


def test_a_lost_data_file_is_scored_again_by_a_plain_rerun(
    tmp_path: Path, archive: Path, models: dict[str, Path]
) -> None:
    out = tmp_path / "scored"
    job = job_file(tmp_path, archive, models["1"], f"{out}/dt={{date}}")
    ref = TableRef.of(str(out))
    day = DAYS[0]
    assert run(job, day).returncode == 0
    v1 = table_version(ref)
    lost = _lose_one_file(out, day)

    plan = cli("plan", str(job), "--date", day, "--json")
    assert plan.returncode == 0, plan.output
    actions = {e["rel_path"]: e["action"] for e in json.loads(plan.stdout)["shards"]}
    assert sorted(actions.values()) == ["score", "skip (done)"]

    again = run(job, day)
    assert again.returncode == 0, again.output
    assert "missing from storage" in again.output
    rep = report(out / f"dt={day}")
    assert rep["status"] == "succeeded"
    assert rep["shards_scored"] == 1 and rep["shards_skipped"] == 1
    fmt = rep["output_format"]
    assert fmt["version"] == v1 + 1 == table_version(ref)
    assert fmt["files_added"] == 1 and fmt["files_removed"] == 1
    last = commits(ref)[-1]
    assert last["score_catalog.files_removed"] == "1"
    # Exactly the day's rows, once each, read by deltalake and by Polars.
    assert rows_of(ref) == expected_rows(archive, {day: "1"}, models)
    assert lost not in {p.name for p in (out / f"dt={day}").glob("*.parquet")}

    third = run(job, day)  # repaired: nothing left to do
    assert third.returncode == 0, third.output
    assert table_version(ref) == v1 + 1


def test_a_backfill_over_a_day_that_lost_a_file_repairs_that_day(
    tmp_path: Path, archive: Path, models: dict[str, Path]
) -> None:
    out = tmp_path / "scored"
    job = job_file(tmp_path, archive, models["1"], f"{out}/dt={{date}}")
    ref = TableRef.of(str(out))
    first = cli("backfill", str(job), "--from", DAYS[0], "--to", DAYS[1])
    assert first.returncode == 0, first.output
    before = table_version(ref)
    _lose_one_file(out, DAYS[1])

    again = cli("backfill", str(job), "--from", DAYS[0], "--to", DAYS[1])
    assert again.returncode == 0, again.output
    summary = tmp_path / "_score_catalog" / "scored" / "_backfills" / "nightly"
    parts = json.loads((summary / f"{DAYS[0]}_{DAYS[1]}.json").read_text())["partitions"]
    statuses = {p["date"]: p["status"] for p in parts}
    assert statuses[DAYS[0]] == "skipped"  # whole: not run at all
    assert statuses[DAYS[1]] == "succeeded"  # unfinished: run, and repaired
    assert table_version(ref) == before + 1
    assert rows_of(ref) == expected_rows(archive, dict.fromkeys(DAYS[:2], "1"), models)


@pytest.mark.slow  # four runs against the S3 server: about 15 s here
def test_on_s3_a_lost_data_file_is_scored_again_by_a_plain_rerun(
    tmp_path: Path, archive: Path, models: dict[str, Path], s3_bucket: S3Bucket
) -> None:
    opts = s3_bucket.storage_options
    uri = s3_bucket.uri("scored")
    job = job_file(tmp_path, archive, models["1"], f"{uri}/dt={{date}}", storage=opts)
    ref = TableRef.of(uri, opts)
    day = DAYS[0]
    assert run(job, day).returncode == 0
    v1 = table_version(ref)
    files = sorted(s3_bucket.fs.glob(f"{s3_bucket.name}/scored/dt={day}/*.parquet"))
    s3_bucket.fs.rm(files[0])

    again = run(job, day)
    assert again.returncode == 0, again.output
    assert table_version(ref) == v1 + 1
    assert rows_of(ref) == expected_rows(archive, {day: "1"}, models)
    third = run(job, day)
    assert third.returncode == 0, third.output
    assert table_version(ref) == v1 + 1


# --------------------------------------------------------------------------- lost answers


def _index_entry(bucket: S3Bucket, run_id: str) -> dict[str, object]:
    raw = bucket.fs.cat_file(f"{bucket.name}/_score_catalog/scored/_runs/nightly/{run_id}.json")
    return dict(json.loads(raw))


@pytest.mark.slow  # a moto server of its own, three runs: about 20 s here
@pytest.mark.parametrize("point", ["delta-committed", "delta-after-commit"])
def test_a_store_that_dies_after_the_commit_landed_is_recorded_by_the_next_run(
    tmp_path: Path,
    archive: Path,
    models: dict[str, Path],
    point: str,
    pauses: Callable[..., Pause],
) -> None:
    """The S3 endpoint goes away right after the run's commit landed (before it read the
    table back, or before it recorded the commit), and stays away past the retry deadline:
    the run exits 1 saying its commit landed; the next run records it as recovered, commits
    nothing again, and the dead run's run-index entry says it was committed."""
    pause = pauses(point)
    with start_moto_server(tmp_path / "moto.log") as server:
        port = int(server.endpoint.rsplit(":", 1)[1])
        with flaky_proxy(port) as proxy:
            name = f"landed-{uuid.uuid4().hex[:8]}"
            server.client().create_bucket(Bucket=name)
            via = S3Bucket(name, proxy.endpoint)
            direct = S3Bucket(name, server.endpoint)
            direct.fs = direct.new_fs()
            opts = {**via.storage_options, "retry_deadline_s": 5}
            job = job_file(
                tmp_path, archive, models["1"], f"{via.uri('scored')}/dt={{date}}", storage=opts
            )
            ref = TableRef.of(direct.uri("scored"), direct.storage_options)
            day = DAYS[0]
            proc = start_cli(
                "run", str(job), "--date", day, "-q", env={**aws_env(), **pause_env(pause)}
            )
            pause.wait(proc)
            proxy.down()  # for good: past the run's retry deadline
            pause.release()
            _, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 1, stderr
            landed = table_version(ref)
            assert landed == 1  # version 0 made the table, version 1 is the run's commit
            lines = [ln for ln in stderr.splitlines() if ln.strip()]
            assert len(lines) == 1, stderr
            assert f"its commit landed as version {landed}" in lines[0] or (
                f"run version 1 of 'score-catalog/nightly/dt={day}' was committed" in lines[0]
            ), lines[0]
            dead_run = commits(ref)[-1]["score_catalog.run_id"]

            proxy.up()
            again = run(job, day, env=aws_env())
            assert again.returncode == 0, again.output
            assert table_version(ref) == landed  # nothing committed again
            assert (
                f"version {landed}: committed by run {dead_run} before it stopped" in again.stdout
            )
            raw = direct.fs.cat_file(f"{name}/_score_catalog/scored/dt={day}/_report.json")
            rep = json.loads(raw)
            assert rep["status"] == "succeeded", rep["failure_reasons"]
            recovered = {"run_id": dead_run, "table_version": landed}
            assert rep["output_format"]["recovered"] == recovered
            entry = _index_entry(direct, dead_run)
            assert entry["status"] == "succeeded"
            assert entry["recovered"] == {"by": rep["run_id"], "table_version": landed}
            assert rows_of(ref) == expected_rows(archive, {day: "1"}, models)


@pytest.mark.slow  # a moto server of its own, two runs: about 15 s here
def test_a_commit_whose_answer_is_lost_in_a_blip_succeeds_in_the_same_run(
    tmp_path: Path, archive: Path, models: dict[str, Path], pauses: Callable[..., Pause]
) -> None:
    """The endpoint goes away right after the commit landed and comes back within the retry
    deadline: the same run reads the table back, finds its commit and succeeds (exit 0), once."""
    pause = pauses("delta-committed")
    with start_moto_server(tmp_path / "moto.log") as server:
        port = int(server.endpoint.rsplit(":", 1)[1])
        with flaky_proxy(port) as proxy:
            name = f"blip-{uuid.uuid4().hex[:8]}"
            server.client().create_bucket(Bucket=name)
            via = S3Bucket(name, proxy.endpoint)
            direct = S3Bucket(name, server.endpoint)
            opts = {**via.storage_options, "retry_deadline_s": 60}
            job = job_file(
                tmp_path, archive, models["1"], f"{via.uri('scored')}/dt={{date}}", storage=opts
            )
            ref = TableRef.of(direct.uri("scored"), direct.storage_options)
            env = {**aws_env(), **pause_env(pause)}
            proc = start_cli("run", str(job), "--date", DAYS[0], "-q", env=env)
            pause.wait(proc)
            proxy.down()
            pause.release()
            time.sleep(2)  # the outage: every request meanwhile is refused or cut
            proxy.up()
            _, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, stderr
            assert table_version(ref) == 1
            assert len(commits(ref)) == 1
            assert rows_of(ref) == expected_rows(archive, {DAYS[0]: "1"}, models)


# --------------------------------------------------------------------------- a full disk


def test_a_full_disk_at_the_commit_is_one_plain_line_naming_the_cause_and_the_report(
    tmp_path: Path, archive: Path, models: dict[str, Path], pauses: Callable[..., Pause]
) -> None:
    out = tmp_path / "scored"
    job = job_file(tmp_path, archive, models["1"], f"{out}/dt={{date}}")
    day = DAYS[0]
    with small_disk(out, "4m"):
        assert run(job, day).returncode == 0
        pause = pauses("delta-before-commit")
        env = pause_env(pause)
        proc = start_cli("run", str(job), "--date", day, "--model", str(models["2"]), "-q", env=env)
        pause.wait(proc)
        with (out / "_filler").open("wb") as filler:  # the rest of the disk
            try:
                while True:
                    filler.write(b"x" * 65536)
            except OSError:
                pass
        pause.release()
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 1, stderr
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        assert len(lines) == 1, stderr
        line = lines[0]
        assert "No space left on device" in line, line
        assert line.index("No space left on device") < line.index("Generic LocalFileSystem"), line
        assert "\x1b" not in line
        rep = report(out / f"dt={day}")
        assert f"(report: {tmp_path}/_score_catalog/scored/dt={day}/_report.json)" in line, line
        assert rep["status"] == "failed"
        assert not any("\x1b" in r for r in rep["failure_reasons"]), rep["failure_reasons"]
        assert "No space left on device" in rep["failure_reasons"][0]
        assert rep["output_format"]["committed"] is False
        ref = TableRef.of(str(out))
        assert rows_of(ref) == expected_rows(archive, {day: "1"}, models)  # the last version
        (out / "_filler").unlink()  # room again: the rerun commits
        again = run(job, day, "--model", str(models["2"]))
        assert again.returncode == 0, again.output
        assert rows_of(ref) == expected_rows(archive, {day: "2"}, models)


# --------------------------------------------------------------------------- a format change


def test_a_table_where_a_folder_output_was_moved_away_starts_without_a_warning(
    tmp_path: Path, archive: Path, models: dict[str, Path]
) -> None:
    """The README's way from a Parquet folder to a table: move the folder away, run with
    ``--format delta``. The folder's manifest (in the control area beside it) describes no file
    of the table: one INFO line, no warning per shard, every row scored into the table."""
    out = tmp_path / "scored"
    folder_job = job_file(tmp_path, archive, models["1"], f"{out}/dt={{date}}", fmt=None)
    day = DAYS[0]
    assert run(folder_job, day).returncode == 0
    (out).rename(tmp_path / "old_scored")
    table_job = job_file(tmp_path, archive, models["1"], f"{out}/dt={{date}}", name="nightly")
    first = run(table_job, day)
    assert first.returncode == 0, first.output
    assert "WARNING" not in first.stderr, first.stderr
    assert "described a Parquet folder output that is no longer here" in first.stderr
    rep = report(out / f"dt={day}")
    assert rep["shards_scored"] == 2 and rep["warnings"] == []
    assert rows_of(TableRef.of(str(out))) == expected_rows(archive, {day: "1"}, models)


def test_a_parquet_reader_over_a_tables_folder_reads_older_versions_files(
    tmp_path: Path, archive: Path, models: dict[str, Path]
) -> None:
    """What README "Reading the output" warns of: after a rescore, a plain Parquet reader over
    the table's folder counts the day twice; Delta readers read the latest version exactly."""
    out = tmp_path / "scored"
    job = job_file(tmp_path, archive, models["1"], f"{out}/dt={{date}}")
    day = DAYS[0]
    assert run(job, day).returncode == 0
    assert run(job, day, "--model", str(models["2"])).returncode == 0
    want = expected_rows(archive, {day: "2"}, models)
    assert rows_of(TableRef.of(str(out))) == want  # deltalake and Polars scan_delta
    plain = pads.dataset(str(out), format="parquet", partitioning="hive")
    assert plain.count_rows() == 2 * len(want)
