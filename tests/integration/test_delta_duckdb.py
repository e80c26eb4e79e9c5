"""DuckDB's Delta reader (``delta_scan``, and ``ATTACH ... (TYPE delta, VERSION n)`` for time
travel) on a table this tool committed, from its own venv.

The project is tested with duckdb 2.x, which cannot load its ``delta`` extension without network
access; duckdb 1.4.4 loads it offline from the ``duckdb-ext-delta`` package. ``make test`` builds
that venv (``.venv-duckdb-delta``) and points ``DUCKDB_DELTA_PYTHON`` at it; without it this
test skips, saying how to get it.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pipeline.sinks.delta import table as delta
from pipeline.sinks.delta.table import TableRef
from tests.delta_helpers import PARTITION, SCHEMA, day, expected, rows, write_file

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

# Runs inside the DuckDB 1.4.4 venv: loads the extension from the package's own folder, with
# autoinstall and autoload off so that nothing is ever downloaded.
_QUERY = textwrap.dedent(
    """
    import json, os, sys
    import duckdb, duckdb_ext
    table = sys.argv[1]
    con = duckdb.connect()
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    extensions = os.path.join(list(duckdb_ext.__path__)[0], "extensions")
    con.execute("SET extension_directory = ?", [extensions])
    con.execute("LOAD delta")
    def rows(sql):
        return sorted(list(r) for r in con.execute(sql).fetchall())
    out = {
        "latest": rows(f"SELECT id, model_version, run_date FROM delta_scan('{table}')"),
        "filtered": rows(
            f"SELECT id, model_version, run_date FROM delta_scan('{table}') "
            "WHERE id BETWEEN 15 AND 32 AND run_date = 'd1'"
        ),
    }
    con.execute(f"ATTACH '{table}' AS v1 (TYPE delta, VERSION 1)")
    out["v1"] = rows("SELECT id, model_version, run_date FROM v1")
    print(json.dumps(out))
    """
)


def _duckdb_python() -> Path:
    path = Path(os.environ.get("DUCKDB_DELTA_PYTHON") or REPO / ".venv-duckdb-delta/bin/python")
    if not path.exists():
        pytest.skip(
            f"DuckDB's delta reader needs duckdb 1.4.4 + duckdb-ext-delta in their own venv, not "
            f"found at {path}: `make .venv-duckdb-delta/.installed` builds it (`make test` does)"
        )
    return path


def _as_lists(parts: dict[str, tuple[Any, str]]) -> list[list[Any]]:
    return [list(r) for r in expected(parts)]


def test_duckdb_reads_each_version_exactly(tmp_path: Path) -> None:
    python = _duckdb_python()
    ref = TableRef.of(str(tmp_path / "scored"))
    delta.ensure_table(ref, SCHEMA, [PARTITION], allow_new_columns=False)
    v1 = [write_file(ref, rows(range(i, i + 20), "m1"), day("d1")) for i in (0, 20)]
    v1 += [write_file(ref, rows(range(100, 110), "m1"), day("d2"))]
    delta.commit(
        ref, adds=v1, removes=[], app_id="job", run_version=1, metadata={}, expected_schema=SCHEMA
    )
    old = [f.path for f in delta.snapshot(ref, day("d1")).files]
    v2 = [write_file(ref, rows(range(40), "m2"), day("d1"))]
    delta.commit(
        ref, adds=v2, removes=old, app_id="job", run_version=2, metadata={}, expected_schema=SCHEMA
    )

    done = subprocess.run(
        [str(python), "-c", _QUERY, ref.table_uri],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["latest"] == _as_lists({"d1": (range(40), "m2"), "d2": (range(100, 110), "m1")})
    assert got["filtered"] == _as_lists({"d1": (range(15, 33), "m2")})
    assert got["v1"] == _as_lists({"d1": (range(40), "m1"), "d2": (range(100, 110), "m1")})
