"""Spark's Iceberg reader on a table this tool wrote through the real CLI: the same nights and
checks as DuckDB's (tests/iceberg_readers.py), through ``spark.read.format("iceberg")`` on the
current metadata file and ``snapshot-id`` for time travel.

Not part of ``make test`` (so not of CI): ``make test-spark-iceberg`` builds its venv and runs
it. Spark 3.5 needs ``iceberg-spark-runtime``, a Maven artifact; the one offline copy is inside
a third party's wheel and lacks its shaded Jackson, which ``tests/spark_jars.py`` relocates from
another (docs/iceberg.md, Readers). Skips, saying so, where ``SPARK_ICEBERG_PYTHON`` is unset.
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

# Two CLI processes and a JVM: 20-40 s here.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Runs inside the Spark venv: the runtime jar from the wheel's package, the relocated Jackson
# from SPARK_ICEBERG_JARS; local[1], no UI.
_QUERY = textwrap.dedent(
    """
    import glob, json, os, sys
    import snowpark_connect_deps_iceberg as deps
    from pyspark.sql import SparkSession
    meta, days, before, jars = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    pkg = os.path.dirname(deps.__file__)
    runtime = glob.glob(os.path.join(pkg, "jars", "iceberg-spark-runtime-3.5_2.12-*.jar"))
    jackson = sorted(glob.glob(os.path.join(jars, "shaded-jackson-*.jar")))
    spark = (
        SparkSession.builder.master("local[1]")
        .config("spark.jars", ",".join(runtime + jackson))
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    cols = ["item_id", "score", "model_version", "run_date"]
    def rows(df):
        return sorted(list(r) for r in df.collect())
    table = spark.read.format("iceberg").load(meta)
    old = spark.read.format("iceberg").option("snapshot-id", before).load(meta)
    out = {
        "columns": table.columns,
        "days": {d: rows(table.where(f"run_date = '{d}'").select(*cols)) for d in days},
        "counts": rows(table.groupBy("run_date").count()),
        "before": rows(old.where(f"run_date = '{days[1]}'").select(*cols)),
    }
    print("RESULT " + json.dumps(out), flush=True)
    spark.stop()
    """
)


def _spark() -> tuple[Path, Path]:
    python = os.environ.get("SPARK_ICEBERG_PYTHON")
    jars = os.environ.get("SPARK_ICEBERG_JARS")
    if not python or not jars or not Path(python).exists():
        pytest.skip(
            "Spark's Iceberg reader runs from its own venv with relocated jars, not in make test "
            "(docs/iceberg.md, Readers): `make test-spark-iceberg` builds and runs it"
        )
    return Path(python), Path(jars)


def test_spark_reads_each_day_of_the_table_exactly(tmp_path: Path) -> None:
    python, jars = _spark()
    written = write_table(tmp_path)
    args = [written.table.metadata_location, json.dumps(DAYS), str(written.before), str(jars)]
    done = subprocess.run(
        [str(python), "-c", _QUERY, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)},
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    assert got["columns"] == [ID, "score", "label", "model_version", "run_date"]
    check_answer(written, got)
