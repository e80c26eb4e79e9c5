"""The template root is a dataset (issue 22, case 5), through the real CLI.

With default settings, readers of an output template's fixed part (``scored`` for
``scored/run_date={date}``) see every date at once. They used to count the rejects kept under
it as scores (DuckDB's ``'**/*.parquet'``, Dask) and fail on the reports and run index there
(Polars). Now everything that is not scores lives beside the root (``pipeline.io.layout``), each
reader returns exactly the sum of ``rows_out`` over the dates with only the output columns and
the partition key, and an output laid out by the previous version is moved on its next run,
resume and drift included.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import write_shards
from tests.integration.helpers import cli, data_files, report

pytestmark = pytest.mark.integration

DAYS = ["2026-11-27", "2026-11-28", "2026-11-29"]
OUTPUT_COLUMNS = ["item_id", "category", "score", "label", "model_version"]
KEY = "run_date"
# Rows per shard and the rows of each day made unscorable (a null feature: a reject).
SIZES = {DAYS[0]: [1500, 900], DAYS[1]: [1100, 1300, 700], DAYS[2]: [1000, 800]}
POISONED = {DAYS[0]: [(0, 3), (1, 10)], DAYS[1]: [(2, 5)], DAYS[2]: [(0, 1)]}


def _poison(path: Path, row: int) -> None:
    t = pq.read_table(path)
    vals = t.column("f2").to_pylist()
    vals[row] = None
    t = t.set_column(t.schema.get_field_index("f2"), "f2", pa.array(vals, pa.float32()))
    pq.write_table(t, path, row_group_size=400)


@pytest.fixture
def job(tmp_path: Path, bundle_dir: Path) -> Path:
    """Three days of input with a few rejects each (ids unique across days), and a nightly
    job with default rejects, control files and run index."""
    for k, day in enumerate(DAYS):
        folder = tmp_path / "archive" / f"dt={day}"
        paths = write_shards(folder, SIZES[day], row_group_rows=400, start=100_000 * k, seed=k)
        for shard, row in POISONED[day]:
            _poison(paths[shard], row)
    path = tmp_path / "nightly.toml"
    path.write_text(
        f'input = "{tmp_path}/archive/dt={{date}}"\n'
        f'output = "{tmp_path}/scored/{KEY}={{date}}"\n'
        f'model = "{bundle_dir}"\n'
        'passthrough = ["category"]\nscheduler = "sync"\nbatch_size = 512\n'
    )
    return path


def _backfill(job: Path, start: str, end: str) -> None:
    r = cli("backfill", str(job), "--from", start, "--to", end, in_process=True)
    assert r.returncode == 0, r.output


def _reports(root: Path, days: list[str]) -> list[dict[str, Any]]:
    return [report(root / f"{KEY}={day}") for day in days]


def _readers(root: Path) -> dict[str, tuple[int, int, list[str]]]:
    """What each reader finds at the template root: rows, distinct ids, columns."""
    import dask.dataframe as dd
    import duckdb
    import pandas as pd
    import polars as pl
    import pyarrow.dataset as ds

    found: dict[str, tuple[int, int, list[str]]] = {}
    con = duckdb.connect()
    sql = f"select * from read_parquet('{root}/**/*.parquet', hive_partitioning=true)"
    cols = [d[0] for d in con.execute(f"{sql} limit 0").description]
    rows, ids = con.execute(f"select count(*), count(distinct item_id) from ({sql})").fetchone()
    found["duckdb **/*.parquet hive"] = (rows, ids, cols)
    for name, frame in (
        ("polars root", pl.scan_parquet(root).collect()),
        ("polars **/*.parquet", pl.scan_parquet(f"{root}/**/*.parquet").collect()),
    ):
        found[name] = (frame.height, frame["item_id"].n_unique(), frame.columns)
    table = ds.dataset(root, partitioning="hive").to_table()
    found["pyarrow.dataset hive"] = (
        table.num_rows,
        len(set(table.column("item_id").to_pylist())),
        table.column_names,
    )
    frame = pd.read_parquet(root)
    found["pandas"] = (len(frame), frame["item_id"].nunique(), list(frame.columns))
    dframe = dd.read_parquet(str(root)).compute()
    found["dask"] = (len(dframe), dframe["item_id"].nunique(), list(dframe.columns))
    return found


def _assert_root_reads_exactly(root: Path, reps: list[dict[str, Any]]) -> None:
    total = sum(r["rows_out"] for r in reps)
    for name, (rows, ids, cols) in _readers(root).items():
        assert (rows, ids) == (total, total), f"{name}: {rows} rows, {ids} ids, expected {total}"
        assert cols in (OUTPUT_COLUMNS, [*OUTPUT_COLUMNS, KEY]), f"{name}: columns {cols}"


def _root_holds_only_data(root: Path) -> None:
    others = [p for p in root.rglob("*") if p.is_file() and p.suffix != ".parquet"]
    assert {p.name for p in others} <= {"_SUCCESS", "_SCORE_CATALOG"}, others
    assert all(p.stat().st_size == 0 for p in others)
    assert all(p.parent.parent == root for p in root.rglob("*.parquet"))


def test_readers_of_the_template_root_see_exactly_the_scores(job: Path, tmp_path: Path) -> None:
    _backfill(job, DAYS[0], DAYS[1])
    root = tmp_path / "scored"
    reps = _reports(root, DAYS[:2])
    assert [r["rows_rejected"] for r in reps] == [2, 1]  # rejects exist
    _assert_root_reads_exactly(root, reps)
    # Because nothing but scores and two empty markers is below the root: the rejects, the
    # control files, the run index and the backfill summary are beside it.
    _root_holds_only_data(root)
    assert all(r["rejects"].startswith(str(tmp_path / "_rejects" / "scored")) for r in reps)
    assert (tmp_path / "_score_catalog" / "scored" / "_runs").is_dir()
    assert (tmp_path / "_score_catalog" / "scored" / "_backfills").is_dir()


# ---------------------------------------------------------------- the previous version's layout


def _to_previous_layout(tmp_path: Path, days: list[str]) -> None:
    """Lay the outputs out as the previous version wrote them: control folders, default rejects,
    run index and backfill summaries under the template root, each JSON file naming those
    places (manifest entries and reports their rejects, run index entries their report)."""
    root, area, rejects = (
        tmp_path / "scored",
        tmp_path / "_score_catalog" / "scored",
        tmp_path / "_rejects" / "scored",
    )
    (root / "_score_catalog").mkdir()
    (root / "_rejects").mkdir()
    for day in days:
        (area / f"{KEY}={day}").rename(root / "_score_catalog" / f"{KEY}={day}")
        (rejects / f"{KEY}={day}").rename(root / "_rejects" / f"{KEY}={day}")
    for name in ("_runs", "_backfills"):
        (area / name).rename(root / name)
    for path in root.rglob("*.json"):
        text = path.read_text()
        text = text.replace(str(rejects), str(root / "_rejects"))
        text = text.replace(str(area), str(root / "_score_catalog"))
        path.write_text(text)


def test_an_older_layout_moves_on_the_next_run_and_resume_and_drift_still_work(
    job: Path, tmp_path: Path
) -> None:
    root = tmp_path / "scored"
    _backfill(job, DAYS[0], DAYS[1])
    first, second = _reports(root, DAYS[:2])
    _to_previous_layout(tmp_path, DAYS[:2])
    # What a reader of the root met with that layout: the rejects counted as scores.
    import duckdb

    sql = f"select count(*) from read_parquet('{root}/**/*.parquet', hive_partitioning=true)"
    assert duckdb.connect().execute(sql).fetchone() == (first["rows_in"] + second["rows_in"],)
    shown = cli("report", str(root / f"{KEY}={DAYS[0]}"), "--json", in_process=True)
    assert shown.returncode == 0 and json.loads(shown.stdout)["run_id"] == first["run_id"]

    # The next run of one day takes its lock and moves everything of the template.
    r = cli("run", str(job), "--date", DAYS[1], in_process=True)
    assert r.returncode == 0, r.output
    again = report(root / f"{KEY}={DAYS[1]}")
    assert again["shards_skipped"] == again["shards_total"] == 3  # the moved manifest was read
    assert again["rows_out"] == second["rows_out"]
    new_rejects = str(tmp_path / "_rejects" / "scored" / f"{KEY}={DAYS[1]}")
    shard_rejects = [s["rejects"] for s in again["shards"] if s["rejects"]]
    assert shard_rejects and all(p.startswith(new_rejects + "/") for p in shard_rejects)
    assert all(Path(p).is_file() for p in shard_rejects)
    _root_holds_only_data(root)
    assert not (root / "_score_catalog").exists() and not (root / "_rejects").exists()
    assert not (root / "_runs").exists() and not (root / "_backfills").exists()
    backfills = tmp_path / "_score_catalog" / "scored" / "_backfills"
    assert len(list(backfills.rglob("*.json"))) == 1
    # The other day was not run, and its files moved too: its report is found in the new place.
    moved = tmp_path / "_score_catalog" / "scored" / f"{KEY}={DAYS[0]}"
    moved_report = json.loads((moved / "_report.json").read_text())
    assert moved_report["run_id"] == first["run_id"]
    # ...and names its rejects where they are now (so does its manifest).
    old_rejects = tmp_path / "_rejects" / "scored" / f"{KEY}={DAYS[0]}"
    assert moved_report["rejects"] == str(old_rejects)
    entries = json.loads((moved / "_manifest.json").read_text())["shards"].values()
    named = [e["rejects"] for e in entries if e.get("rejects")]
    assert named and all(Path(p).is_file() and Path(p).parent == old_rejects for p in named)
    shown = cli("report", str(root / f"{KEY}={DAYS[0]}"), "--json", in_process=True)
    assert shown.returncode == 0 and json.loads(shown.stdout)["run_id"] == first["run_id"]
    _assert_root_reads_exactly(root, [first, again])

    # The next night compares with its predecessor from the moved run index (the rerun above
    # scored nothing, so the one before it).
    r = cli("run", str(job), "--date", DAYS[2], in_process=True)
    assert r.returncode in (0, 4), r.output
    third = report(root / f"{KEY}={DAYS[2]}")
    assert third["drift"]["baseline"]["run_id"] == second["run_id"]
    assert len(data_files(root)) == 7
    _assert_root_reads_exactly(root, [first, again, third])
