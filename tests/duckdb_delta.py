"""DuckDB 1.4.4's Delta reader (``delta_scan``) from its own venv, kept running for many queries.

The project is tested with duckdb 2.x, which cannot load its ``delta`` extension without network
access; duckdb 1.4.4 loads it offline from the ``duckdb-ext-delta`` package, in its own venv
(``make .venv-duckdb-delta/.installed``; ``DUCKDB_DELTA_PYTHON`` points at its python). Starting
that interpreter and loading the extension takes about a second, so :class:`DuckDBDelta` starts it
once and sends it batches of predicates over a pipe (one JSON line each way).

For each predicate it answers three id lists: DuckDB's own in-memory filter of the whole table
(``delta_scan`` read unfiltered into a table: DuckDB's semantics, NaN above every number and
equal to itself), ``delta_scan`` with the predicate (which skips files on their Delta stats and
row groups on their Parquet statistics), and, only where those two differ, DuckDB's Parquet reader
alone (``read_parquet`` of the table's files, no Delta log).
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
import os
import subprocess
import textwrap
from pathlib import Path
from typing import IO, Any

import pytest

REPO = Path(__file__).resolve().parents[1]

# Runs inside the DuckDB 1.4.4 venv: loads the extension from the package's own folder, with
# autoinstall and autoload off so that nothing is ever downloaded.
_SERVER = textwrap.dedent(
    """
    import datetime as dt, decimal, json, os, sys
    import duckdb, duckdb_ext
    con = duckdb.connect()
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    extensions = os.path.join(list(duckdb_ext.__path__)[0], "extensions")
    con.execute("SET extension_directory = ?", [extensions])
    con.execute("LOAD delta")
    con.execute("SET TimeZone = 'UTC'")

    def value(v):
        kind, text = v
        if kind == "none": return None
        if kind == "float": return float(text)
        if kind == "decimal": return decimal.Decimal(text)
        if kind == "date": return dt.date.fromisoformat(text)
        if kind == "datetime": return dt.datetime.fromisoformat(text)
        return text  # bool, int, str: JSON has them

    def ids(sql, params):
        return sorted(r[0] for r in con.execute(sql, params).fetchall())

    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        table, key = req["table"], req["key"]
        scan = "delta_scan('" + table.replace("'", "''") + "')"
        con.execute("CREATE OR REPLACE TABLE mem AS SELECT * FROM " + scan)
        out = []
        for where, params in req["predicates"]:
            args = [value(p) for p in params]
            try:
                want = ids(f"SELECT {key} FROM mem WHERE {where}", args)
                got = ids(f"SELECT {key} FROM {scan} WHERE {where}", args)
            except duckdb.Error as e:  # an answer of its own: the test names it
                out.append([None, f"{type(e).__name__}: {e}", None])
                continue
            alone = None
            if want != got and req["files"]:
                alone = ids(
                    f"SELECT {key} FROM read_parquet(?, hive_partitioning = true, "
                    f"hive_types_autocast = false) WHERE {where}",
                    [req["files"], *args],
                )
            out.append([want, got, alone])
        print(json.dumps(out), flush=True)
    """
)


def duckdb_python() -> Path:
    """The DuckDB 1.4.4 venv's python; skips the test, saying how to get it, when it is absent."""
    path = Path(os.environ.get("DUCKDB_DELTA_PYTHON") or REPO / ".venv-duckdb-delta/bin/python")
    if not path.exists():
        pytest.skip(
            f"DuckDB's delta reader needs duckdb 1.4.4 + duckdb-ext-delta in their own venv, not "
            f"found at {path}: `make .venv-duckdb-delta/.installed` builds it (`make test` does)"
        )
    return path


def encode(v: Any) -> list[Any]:
    """A predicate parameter for the pipe: [kind, JSON value], typed as DuckDB binds it (a
    datetime with a zone binds as TIMESTAMPTZ, one without as TIMESTAMP)."""
    if v is None:
        return ["none", None]
    if isinstance(v, bool):
        return ["bool", v]
    if isinstance(v, float):
        return ["float", repr(v) if math.isfinite(v) else str(v)]
    if isinstance(v, decimal.Decimal):
        return ["decimal", format(v, "f")]
    if isinstance(v, dt.datetime):
        return ["datetime", v.isoformat()]
    if isinstance(v, dt.date):
        return ["date", v.isoformat()]
    if isinstance(v, (int, str)):
        return [type(v).__name__, v]
    raise TypeError(f"no DuckDB parameter for {v!r}")


class DuckDBDelta:
    """One DuckDB 1.4.4 process answering batches of predicates on Delta tables."""

    def __init__(self, python: Path, home: Path) -> None:
        self._proc = subprocess.Popen(
            [str(python), "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={"PATH": "/usr/bin:/bin", "HOME": str(home)},
        )
        assert self._read() == "ready"

    def _read(self) -> Any:
        out: IO[str] | None = self._proc.stdout
        assert out is not None
        line = out.readline()
        if not line:
            err = self._proc.stderr.read() if self._proc.stderr else ""
            raise AssertionError(f"the DuckDB process ended: {err[-2000:]}")
        return json.loads(line)

    def query(
        self,
        table: str,
        predicates: list[tuple[str, list[Any]]],
        *,
        key: str = "id",
        files: list[str] | None = None,
    ) -> list[tuple[list[Any] | None, list[Any] | str, list[Any] | None]]:
        """For each (SQL condition with ``?`` placeholders, parameters): (in-memory ids,
        ``delta_scan`` ids, ``read_parquet`` ids of ``files`` where the first two differ); a
        query DuckDB refused answers (None, the error, None)."""
        req = {
            "table": table,
            "key": key,
            "files": files or [],
            "predicates": [[w, [encode(p) for p in ps]] for w, ps in predicates],
        }
        stdin = self._proc.stdin
        assert stdin is not None
        stdin.write(json.dumps(req) + "\n")
        stdin.flush()
        return [(a, b, c) for a, b, c in self._read()]

    def close(self) -> None:
        if self._proc.stdin:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for stream in (self._proc.stdout, self._proc.stderr):
            if stream:
                stream.close()
