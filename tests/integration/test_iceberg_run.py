"""``format = "iceberg"`` end to end through the real CLI, with no catalog configured (the embedded
SQLite catalog beside the table): a backfill is three partitions of one table, found through
the catalog and identifier the report names and read by pyiceberg and Polars as exactly each
day's scores; a rescore changes one day in exactly one new snapshot; a killed run leaves the
latest snapshot whole and its rerun commits once; a commit that landed before a kill is never
committed again.

Runs are real processes (``scheduler = "sync"``: the kill points fire in the run's own
process); the table is read back here with pyiceberg ``scan()`` and Polars ``scan_iceberg``.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.io.layout import LOCK_NAME
from tests.conftest import demo_bundles, reference_scores, write_shards
from tests.integration.helpers import Pause, cli, manifest_path, pause_env, report, start_cli

pyiceberg = pytest.importorskip("pyiceberg")
from pyiceberg.catalog.sql import SqlCatalog  # noqa: E402
from pyiceberg.table import Table  # noqa: E402

pytestmark = pytest.mark.integration
# Polars plans an Iceberg scan with pyiceberg unless the polars_iceberg plugin is installed, and
# warns each time (a PerformanceWarning, an error under this suite's filterwarnings).
os.environ.setdefault("POLARS_ICEBERG_PLANNER", "pyiceberg")

DAYS = ["2025-01-01", "2025-01-02", "2025-01-03"]
ID = "item_id"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two bundles of the demo MLP, seeds 0 and 1, model versions "1" and "2"."""
    return demo_bundles(tmp_path_factory.mktemp, 2)


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    """Three daily partitions of two shards (1,200 and 800 rows, 500-row row groups)."""
    for k, day in enumerate(DAYS):
        write_shards(
            tmp_path / "archive" / f"dt={day}",
            [1200, 800],
            row_group_rows=500,
            start=10_000 * k,
            seed=k,
        )
    return tmp_path / "archive"


@pytest.fixture
def job(tmp_path: Path, archive: Path, models: dict[str, Path]) -> Path:
    """A job scoring the archive with model 1 into an Iceberg table, no catalog configured."""
    path = tmp_path / "nightly.toml"
    path.write_text(
        "\n".join(
            [
                f'input = "{archive}/dt={{date}}"',
                f'output = "{tmp_path / "scored"}/dt={{date}}"',
                f'model = "{models["1"]}"',
                'format = "iceberg"',
                'scheduler = "sync"',
                "batch_size = 512",
                "[monitoring]",
                "drift = false",
            ]
        )
        + "\n"
    )
    return path


def run(job: Path, day: str, *extra: str, env: dict[str, str] | None = None) -> Any:
    return cli("run", str(job), "--date", day, *extra, env=env)


def table_of(section: dict[str, Any]) -> Table:
    """The table a report's ``output_format`` names: its catalog and identifier, nothing else."""
    assert section["format"] == "iceberg"
    assert section["catalog"].startswith("sqlite:///")
    return SqlCatalog("score_catalog", uri=section["catalog"]).load_table(section["identifier"])


def day_rows(table: Table, day: str, snapshot_id: int | None = None) -> pa.Table:
    """A day's rows by pyiceberg's scan, and the same by Polars (``scan_iceberg``): one answer."""
    import polars as pl

    rows = table.scan(row_filter=f"dt == '{day}'", snapshot_id=snapshot_id).to_arrow()
    by_polars = (
        pl.scan_iceberg(table, snapshot_id=snapshot_id)
        .filter(pl.col("dt") == day)
        .select(ID, "score", "model_version")
        .collect()
        .sort(ID)
    )
    mine = rows.select([ID, "score", "model_version"]).sort_by(ID)
    assert by_polars[ID].to_list() == mine.column(ID).to_pylist()
    assert by_polars["model_version"].to_list() == mine.column("model_version").to_pylist()
    np.testing.assert_array_equal(by_polars["score"].to_numpy(), mine.column("score").to_numpy())
    return rows.sort_by(ID)


def check_day(table: Table, archive: Path, bundle: Path, day: str, version: str, **at: Any) -> None:
    """The table's rows of ``day`` are exactly the day's input ids, scored by ``bundle``."""
    inputs = pa.concat_tables(
        [pq.read_table(p) for p in sorted((archive / f"dt={day}").glob("*.parquet"))]
    ).sort_by(ID)
    rows = day_rows(table, day, **at)
    assert rows.column(ID).to_pylist() == inputs.column(ID).to_pylist()
    assert set(rows.column("model_version").to_pylist()) == {version}
    assert set(rows.column("dt").to_pylist()) == {day}
    score, _ = reference_scores(bundle, inputs)
    np.testing.assert_allclose(rows.column("score").to_numpy(), score, atol=1e-6, rtol=0)


def snapshots(table: Table) -> list[dict[str, str]]:
    """The summaries of the table's snapshots, oldest first."""
    return [s.summary.ser_model() for s in table.snapshots() if s.summary is not None]


def test_a_backfill_is_one_table_read_by_day_and_a_rescore_is_one_snapshot_of_one_day(
    tmp_path: Path, archive: Path, models: dict[str, Path], job: Path
) -> None:
    out = tmp_path / "scored"
    done = cli("backfill", str(job), "--from", DAYS[0], "--to", DAYS[-1])
    assert done.returncode == 0, done.output
    assert sorted(p.name for p in out.iterdir()) == [*(f"dt={d}" for d in DAYS), "metadata"]
    section = report(out / f"dt={DAYS[0]}")["output_format"]
    assert section["identifier"] == "score_catalog.scored"
    table = table_of(section)
    assert [f.name for f in table.spec().fields] == ["dt"]
    for day in DAYS:
        check_day(table, archive, models["1"], day, "1")
    before = table.current_snapshot()
    assert before is not None and len(table.snapshots()) == 3
    files_before = {d: sorted(p.name for p in (out / f"dt={d}").iterdir()) for d in DAYS}

    rescore = run(job, DAYS[1], "--model", str(models["2"]))
    assert rescore.returncode == 0, rescore.output
    rep = report(out / f"dt={DAYS[1]}")["output_format"]
    table = table_of(rep)
    assert len(table.snapshots()) == 4  # exactly one new snapshot
    now = table.current_snapshot()
    assert now is not None and now.parent_snapshot_id == before.snapshot_id
    assert rep["snapshot_id"] == now.snapshot_id and rep["version"] == now.sequence_number
    assert rep["committed"] is True and rep["files_added"] == 2 and rep["files_removed"] == 2
    summary = snapshots(table)[-1]
    assert summary["score_catalog.partition"] == f"dt={DAYS[1]}"
    assert summary["score_catalog.app_version"] == "2"
    assert summary["score_catalog.run_id"] == report(out / f"dt={DAYS[1]}")["run_id"]
    assert summary["changed-partition-count"] == "1"
    check_day(table, archive, models["2"], DAYS[1], "2")
    for day in (DAYS[0], DAYS[2]):
        check_day(table, archive, models["1"], day, "1")
        assert sorted(p.name for p in (out / f"dt={day}").iterdir()) == files_before[day]
    check_day(table, archive, models["1"], DAYS[1], "1", snapshot_id=before.snapshot_id)


def test_a_killed_run_leaves_the_latest_snapshot_whole_and_its_rerun_commits_once(
    tmp_path: Path, archive: Path, models: dict[str, Path], job: Path
) -> None:
    out, day = tmp_path / "scored", DAYS[0]
    assert run(job, day).returncode == 0
    table = table_of(report(out / f"dt={day}")["output_format"])
    killed = run(
        job, day, "--model", str(models["2"]), env={"_SCORE_CATALOG_KILL_AT": "output-rename:2"}
    )
    assert killed.returncode == -signal.SIGKILL, killed.output
    table = table.refresh()
    assert len(table.snapshots()) == 1
    check_day(table, archive, models["1"], day, "1")

    rerun = run(job, day, "--model", str(models["2"]))
    assert rerun.returncode == 0, rerun.output
    table = table.refresh()
    assert [s["score_catalog.app_version"] for s in snapshots(table)] == ["1", "2"]
    check_day(table, archive, models["2"], day, "2")


def test_a_commit_that_landed_before_a_kill_is_never_committed_again(
    tmp_path: Path, archive: Path, models: dict[str, Path], job: Path
) -> None:
    out, day = tmp_path / "scored", DAYS[0]
    assert run(job, day).returncode == 0
    killed = run(
        job,
        day,
        "--model",
        str(models["2"]),
        env={"_SCORE_CATALOG_KILL_AT": "iceberg-after-commit"},
    )
    assert killed.returncode == -signal.SIGKILL, killed.output
    state = json.loads(manifest_path(out / f"dt={day}").read_text())["output_format"]
    assert state["format"] == "iceberg" and state["pending"]["run_version"] == 2
    catalog = state["catalog"]
    table = SqlCatalog("score_catalog", uri=catalog).load_table(state["identifier"])
    landed = table.current_snapshot()
    assert landed is not None and len(table.snapshots()) == 2

    retry = run(job, day, "--model", str(models["2"]))
    assert retry.returncode == 0, retry.output
    table = table.refresh()
    assert len(table.snapshots()) == 2  # the token check: no second snapshot
    rep = report(out / f"dt={day}")["output_format"]
    killed_run = snapshots(table)[-1]["score_catalog.run_id"]
    assert rep["recovered"] == {"run_id": killed_run, "table_version": landed.sequence_number}
    assert rep["committed"] is False
    check_day(table, archive, models["2"], day, "2")


def test_runs_at_once_on_a_new_table_all_commit_and_one_day_twice_commits_once(
    tmp_path: Path,
    archive: Path,
    models: dict[str, Path],
    job: Path,
    pauses: Callable[..., Pause],
) -> None:
    """Three days started at once on a table that does not exist yet: the first runs make the
    catalog, the namespace and the table together, and every day commits its own snapshot
    (the catalog's compare-and-swap, pyiceberg's retries, none losing another's day). Then
    two runs of one day: A held just before its commit, B refused by the partition's run
    lock with nothing committed; A commits once."""
    out = tmp_path / "scored"
    procs = [start_cli("run", str(job), "--date", d) for d in DAYS]
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stdout + stderr
    table = table_of(report(out / f"dt={DAYS[0]}")["output_format"])
    assert sorted(s["score_catalog.partition"] for s in snapshots(table)) == [
        f"dt={d}" for d in DAYS
    ]
    for day in DAYS:
        check_day(table, archive, models["1"], day, "1")

    day = DAYS[1]
    committing = pauses("iceberg-before-commit")
    a = start_cli(
        "run", str(job), "--date", day, "--model", str(models["2"]), env=pause_env(committing)
    )
    try:
        committing.wait(a)
        assert (tmp_path / "_score_catalog" / "scored" / f"dt={day}" / LOCK_NAME).exists()
        b = run(job, day, "--model", str(models["2"]))
        assert b.returncode == 1, b.output
        assert "locked by run" in b.output, b.output
        assert len(table.refresh().snapshots()) == 3
    finally:
        committing.release()
    stdout, stderr = a.communicate(timeout=120)
    assert a.returncode == 0, stdout + stderr
    table = table.refresh()
    assert len(table.snapshots()) == 4
    assert snapshots(table)[-1]["score_catalog.app_version"] == "2"
    check_day(table, archive, models["2"], day, "2")
    for other in (DAYS[0], DAYS[2]):
        check_day(table, archive, models["1"], other, "1")


def test_optimize_and_vacuum_through_the_cli_keep_every_day_exact(
    tmp_path: Path, archive: Path, models: dict[str, Path], job: Path
) -> None:
    """``optimize`` of one day compacts its two files into one in one snapshot that history
    shows; ``vacuum`` refuses a retention below the table's unless forced, lists without
    deleting on a dry run, and with ``--force`` deletes exactly the files no kept snapshot
    reads; every day reads the same throughout, and the next run of the compacted day
    commits."""
    out = tmp_path / "scored"
    done = cli("backfill", str(job), "--from", DAYS[0], "--to", DAYS[1])
    assert done.returncode == 0, done.output
    table = table_of(report(out / f"dt={DAYS[0]}")["output_format"])
    first_files = sorted(p.name for p in (out / f"dt={DAYS[0]}").iterdir())
    assert len(first_files) == 2

    opt = cli("optimize", str(out / f"dt={DAYS[0]}"))
    assert opt.returncode == 0, opt.output
    assert f"partition dt={DAYS[0]}: 2 file(s) compacted into 1" in opt.stdout, opt.stdout
    table = table.refresh()
    assert len(table.snapshots()) == 3
    for day in DAYS[:2]:
        check_day(table, archive, models["1"], day, "1")
    shown = cli("history", str(out), "--json")
    assert shown.returncode == 0, shown.output
    assert json.loads(shown.stdout)[0]["operation"] == "OPTIMIZE"

    short = cli("vacuum", str(out), "--retention-hours", "1")
    assert short.returncode == 2 and "retention" in short.output, short.output
    compacted = sorted(p.name for p in (out / f"dt={DAYS[0]}").iterdir())
    dry = cli("vacuum", str(out), "--dry-run", "--retention-hours", "0", "--force")
    assert dry.returncode == 0, dry.output
    assert "would delete 2 file(s)" in dry.stdout, dry.stdout
    assert sorted(p.name for p in (out / f"dt={DAYS[0]}").iterdir()) == compacted
    gone = cli("vacuum", str(out), "--retention-hours", "0", "--force")
    assert gone.returncode == 0 and "deleted 2 file(s)" in gone.stdout, gone.output
    left = sorted(p.name for p in (out / f"dt={DAYS[0]}").iterdir())
    assert len(left) == 1 and left[0] not in first_files
    table = table.refresh()
    for day in DAYS[:2]:
        check_day(table, archive, models["1"], day, "1")

    rescore = run(job, DAYS[0], "--model", str(models["2"]))
    assert rescore.returncode == 0, rescore.output
    table = table.refresh()
    check_day(table, archive, models["2"], DAYS[0], "2")
    check_day(table, archive, models["1"], DAYS[1], "1")
