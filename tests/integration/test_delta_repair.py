"""A Delta table that lost a committed data file is repaired by the next run: the file's shard is
scored again and the run's one commit adds its new file and removes the dangling path. Real CLI
processes, real tables read back by deltalake and Polars (``tests.integration.test_delta_run``'s
helpers), on local disk and on the S3 server.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.io.outputs.deltatable import TableRef
from tests.integration.helpers import cli, report
from tests.integration.servers import S3Bucket
from tests.integration.test_delta_run import (  # noqa: F401  (fixtures: archive, models)
    DAYS,
    archive,
    commits,
    expected_rows,
    job_file,
    models,
    rows_of,
    run,
    table_version,
)

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
