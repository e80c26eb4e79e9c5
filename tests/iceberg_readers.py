"""An Iceberg table written through the real CLI for other engines to read back (DuckDB, Spark):
three nights by a backfill with model 1, then night 2 rescored with model 2; and what each
night must hold, as the tool's own reader (pyiceberg) and the input say.

The engines run in venvs of their own (they pin what the project does not), so each gets the
current metadata file (the embedded SQLite catalog is pyiceberg's) and answers in JSON; the
checks here compare their answer with :func:`pyiceberg_rows` and the input's ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.table import Table

from pipeline.cli.demo import export_bundle
from tests.conftest import demo_toml, make_model, write_shards
from tests.integration.helpers import cli, report

DAYS = ["2025-01-01", "2025-01-02", "2025-01-03"]
ID = "item_id"
#: The columns each engine answers, in this order.
COLUMNS = (ID, "score", "model_version", "run_date")
#: Rows of each night (two shards).
NIGHT_ROWS = 1200


@dataclass(frozen=True)
class Written:
    """The table after the rescore, and the snapshot before it."""

    table: Table
    before: int  # the snapshot id of the three nights before night 2 was rescored
    archive: Path  # the input, dt=<night>/ folders


def _job(tmp_path: Path) -> tuple[Path, Path]:
    """Three daily partitions of two shards, two model bundles (versions "1" and "2"), and a job
    scoring them with model 1 into an Iceberg table, no catalog configured."""
    archive = tmp_path / "archive"
    for k, day in enumerate(DAYS):
        shards = archive / f"dt={day}"
        write_shards(shards, [700, 500], row_group_rows=300, start=10_000 * k, seed=k)
    for seed in range(2):
        bundle = tmp_path / f"m{seed + 1}"
        export_bundle(make_model(seed=seed), bundle, demo_toml(version=str(seed + 1)), n_in=16)
    job = tmp_path / "nightly.toml"
    lines = [
        f'input = "{archive}/dt={{date}}"',
        f'output = "{tmp_path / "scored"}/run_date={{date}}"',
        f'model = "{tmp_path / "m1"}"',
        'format = "iceberg"',
        'scheduler = "sync"',
        "batch_size = 512",
        "[monitoring]",
        "drift = false",
    ]
    job.write_text("\n".join(lines) + "\n")
    return job, archive


def write_table(tmp_path: Path) -> Written:
    """Three nights, then night 2 rescored with model 2 (its old files deleted by the snapshot).
    The data files hold neither Parquet field ids nor the partition column: a reader needs the
    table's name mapping for the one and the manifests for the other (checked here)."""
    job, archive = _job(tmp_path)
    out = tmp_path / "scored"
    done = cli("backfill", str(job), "--from", DAYS[0], "--to", DAYS[-1])
    assert done.returncode == 0, done.output
    section = report(out / f"run_date={DAYS[0]}")["output_format"]
    assert section["commit_s"] > 0  # the snapshot's own time, beside the run's duration_s
    catalog = SqlCatalog("score_catalog", uri=section["catalog"])
    before = catalog.load_table(section["identifier"]).current_snapshot()
    assert before is not None
    rescore = cli("run", str(job), "--date", DAYS[1], "--model", str(tmp_path / "m2"))
    assert rescore.returncode == 0, rescore.output
    sample = pq.ParquetFile(next((out / f"run_date={DAYS[0]}").glob("*.parquet"))).schema_arrow
    assert "run_date" not in sample.names
    assert all(f.metadata is None or b"PARQUET:field_id" not in f.metadata for f in sample)
    return Written(catalog.load_table(section["identifier"]), before.snapshot_id, archive)


def input_ids(archive: Path, day: str) -> list[int]:
    """The ids of a night's input, sorted."""
    tables = [pq.read_table(p, columns=[ID]) for p in sorted((archive / f"dt={day}").glob("*"))]
    return sorted(pa.concat_tables(tables).column(ID).to_pylist())


def pyiceberg_rows(table: Table, day: str, snapshot_id: int | None = None) -> list[list[Any]]:
    """A night's rows (:data:`COLUMNS`, sorted) as pyiceberg reads them, the tool's own reader
    (tests/integration/test_iceberg_run.py)."""
    got = table.scan(row_filter=f"run_date == '{day}'", snapshot_id=snapshot_id).to_arrow()
    cols = [got.column(c).to_pylist() for c in COLUMNS]
    return sorted([list(r) for r in zip(*cols, strict=True)])


def check_answer(written: Written, got: dict[str, Any]) -> None:
    """An engine's answer: ``days`` (each night by ``WHERE run_date = night``), ``counts``
    (rows per night of the whole table) and ``before`` (night 2 at the snapshot before the
    rescore), each row as :data:`COLUMNS`, equal to pyiceberg's and the input's."""
    table = written.table
    for day in DAYS:
        rows = got["days"][day]
        assert [r[0] for r in rows] == input_ids(written.archive, day)
        assert {r[3] for r in rows} == {day}
        assert {r[2] for r in rows} == {"2" if day == DAYS[1] else "1"}
        assert rows == pyiceberg_rows(table, day)  # the same scores, bit for bit
    assert got["counts"] == [[day, NIGHT_ROWS] for day in DAYS]  # the rescore's old files: gone
    old = got["before"]
    assert {r[2] for r in old} == {"1"}
    assert old == pyiceberg_rows(table, DAYS[1], snapshot_id=written.before)
