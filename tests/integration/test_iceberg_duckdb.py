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

import pytest

pyiceberg = pytest.importorskip("pyiceberg")
from tests.iceberg_readers import DAYS, ID, check_answer, write_table  # noqa: E402

# Two CLI processes (a three-night backfill, a rescore) and DuckDB's: 10-17 s here.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]

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


def test_duckdb_reads_each_day_of_the_table_exactly(tmp_path: Path) -> None:
    python = _duckdb_python()
    written = write_table(tmp_path)
    args = [written.table.metadata_location, json.dumps(DAYS), str(written.before)]
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
    check_answer(written, got)
