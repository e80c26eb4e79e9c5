"""DuckDB's Iceberg reader (``iceberg_scan``) on a table this tool wrote through the real CLI,
from its own venv: the table's name mapping (data files hold no Parquet field ids), its identity
partition ``run_date`` (a string the data files do not hold: it comes from the manifests), a
rescored day's deleted files, and time travel to the snapshot before the rescore.

The project is tested with duckdb 2.x, which cannot load its ``iceberg`` extension without
network access; duckdb 1.4.4 loads it offline from the ``duckdb-ext-iceberg`` and
``duckdb-ext-avro`` packages (the manifests are Avro). ``make test`` builds that venv
(``.venv-duckdb-iceberg``) and points ``DUCKDB_ICEBERG_PYTHON`` at it; without it this test
skips, saying how to get it. DuckDB has no SQLite catalog: it is given the metadata file the
catalog points at (the report names the catalog and identifier).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.cli.demo import export_bundle
from tests.conftest import demo_toml, make_model, write_shards
from tests.integration.helpers import cli, report

pyiceberg = pytest.importorskip("pyiceberg")
from pyiceberg.catalog.sql import SqlCatalog  # noqa: E402

# Two CLI processes (a three-night backfill, a rescore) and DuckDB's: 10-17 s here.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DAYS = ["2025-01-01", "2025-01-02", "2025-01-03"]
ID = "item_id"

# Runs inside the DuckDB 1.4.4 venv: loads the extensions from the package's own folder, with
# autoinstall and autoload off so that nothing is ever downloaded. Answers each day's rows by a
# filtered scan (WHERE run_date = day), the whole table grouped by day, and the rescored day at
# the snapshot before the rescore.
_QUERY = textwrap.dedent(
    """
    import json, os, sys
    import duckdb, duckdb_ext
    meta, days, before = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    con = duckdb.connect()
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    extensions = os.path.join(list(duckdb_ext.__path__)[0], "extensions")
    con.execute("SET extension_directory = ?", [extensions])
    con.execute("LOAD avro")
    con.execute("LOAD iceberg")
    cols = "item_id, score, model_version, run_date"
    def rows(sql, params=()):
        return sorted(list(r) for r in con.execute(sql, list(params)).fetchall())
    scan = f"iceberg_scan('{meta}')"
    out = {
        "columns": [r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {scan}").fetchall()],
        "days": {d: rows(f"SELECT {cols} FROM {scan} WHERE run_date = ?", [d]) for d in days},
        "counts": rows(f"SELECT run_date, count(*) FROM {scan} GROUP BY run_date"),
        "before": rows(
            f"SELECT {cols} FROM iceberg_scan('{meta}', snapshot_from_id = {before}) "
            "WHERE run_date = ?",
            [days[1]],
        ),
    }
    print(json.dumps(out))
    """
)


def _duckdb_python() -> Path:
    path = Path(os.environ.get("DUCKDB_ICEBERG_PYTHON") or REPO / ".venv-duckdb-iceberg/bin/python")
    if not path.exists():
        pytest.skip(
            f"DuckDB's iceberg reader needs duckdb 1.4.4 + duckdb-ext-iceberg + duckdb-ext-avro "
            f"in their own venv, not found at {path}: `make .venv-duckdb-iceberg/.installed` "
            "builds it (`make test` does)"
        )
    return path


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


def _input_ids(archive: Path, day: str) -> list[int]:
    tables = [pq.read_table(p, columns=[ID]) for p in sorted((archive / f"dt={day}").glob("*"))]
    return sorted(pa.concat_tables(tables).column(ID).to_pylist())


def _pyiceberg_rows(table: Any, day: str, snapshot_id: int | None = None) -> list[list[Any]]:
    """A day's rows as pyiceberg reads them (the tool's own reader, tested elsewhere)."""
    got = table.scan(row_filter=f"run_date == '{day}'", snapshot_id=snapshot_id).to_arrow()
    cols = [got.column(c).to_pylist() for c in (ID, "score", "model_version", "run_date")]
    return sorted([list(r) for r in zip(*cols, strict=True)])


def test_duckdb_reads_each_day_of_the_table_exactly(tmp_path: Path) -> None:
    python = _duckdb_python()
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
    table = catalog.load_table(section["identifier"])
    # The data files hold neither field ids nor the partition column: DuckDB needs the name
    # mapping for the one and the manifests for the other.
    sample = pq.ParquetFile(next((out / f"run_date={DAYS[0]}").glob("*.parquet"))).schema_arrow
    assert "run_date" not in sample.names
    assert all(f.metadata is None or b"PARQUET:field_id" not in f.metadata for f in sample)

    args = [table.metadata_location, json.dumps(DAYS), str(before.snapshot_id)]
    done = subprocess.run(
        [str(python), "-c", _QUERY, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["columns"] == [ID, "score", "label", "model_version", "run_date"]
    for day in DAYS:
        rows = got["days"][day]
        assert [r[0] for r in rows] == _input_ids(archive, day)
        assert {r[3] for r in rows} == {day}
        assert {r[2] for r in rows} == {"2" if day == DAYS[1] else "1"}
        assert rows == _pyiceberg_rows(table, day)  # the same scores, bit for bit
    assert got["counts"] == [[day, 1200] for day in DAYS]  # the rescore's old files are gone
    old = got["before"]
    assert {r[2] for r in old} == {"1"}
    assert old == _pyiceberg_rows(table, DAYS[1], snapshot_id=before.snapshot_id)
