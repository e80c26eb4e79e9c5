"""Delta file statistics from Parquet footers (pipeline.io.outputs.deltastats): exact, or left out.

Every expectation is computed from the data itself (pyarrow.compute over the rows written),
never from the footer the code under test reads. Files have several row groups, with nulls,
NaN, long strings and all-null row groups placed in some of them only.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.core.errors import ConfigError
from pipeline.io.outputs.deltastats import (
    MAX_STRING_STAT_CHARS,
    check_partition_values,
    data_file_path,
    file_stats,
    nan_columns,
    new_file,
)

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, table: pa.Table, row_group_rows: int, **kw: Any) -> pq.FileMetaData:
    path = tmp_path / "f.parquet"
    pq.write_table(table, path, row_group_size=row_group_rows, **kw)
    md = pq.read_metadata(path)
    assert md.num_row_groups >= 2
    return md


def _stats(md: pq.FileMetaData, **kw: Any) -> dict[str, Any]:
    return dict(json.loads(file_stats(md, **kw)))


def _ms_floor(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def test_fold_over_row_groups_matches_the_data(tmp_path: Path) -> None:
    ts = [
        dt.datetime(2026, 12, 1, 1, 2, 3, 456_789, tzinfo=dt.timezone.utc) + dt.timedelta(seconds=i)
        for i in range(40)
    ]
    table = pa.table(
        {
            "id": pa.array([(i * 7919) % 1000 - 300 for i in range(40)], pa.int64()),
            "small": pa.array([i % 5 - 2 if i % 6 else None for i in range(40)], pa.int8()),
            "score": pa.array([None if i % 9 == 0 else i / 7 for i in range(40)], pa.float32()),
            "name": pa.array([f"item-{i:03d}" if i % 4 else None for i in range(40)]),
            "day": pa.array([dt.date(2026, 1, 1) + dt.timedelta(days=i) for i in range(40)]),
            "at": pa.array(ts, pa.timestamp("us", tz="UTC")),
        }
    )
    md = _write(tmp_path, table, row_group_rows=7)
    got = _stats(md, nan_free={"score"})
    assert got["numRecords"] == 40
    for col in table.column_names:
        values = table.column(col)
        assert got["nullCount"][col] == values.null_count, col
    for col in ("id", "small", "name"):
        assert got["minValues"][col] == pc.min(table.column(col)).as_py(), col
        assert got["maxValues"][col] == pc.max(table.column(col)).as_py(), col
    # float32 values as JSON numbers that read back as the same float32
    assert pa.array([got["minValues"]["score"]], pa.float32()).equals(
        pa.array([pc.min(table.column("score")).as_py()], pa.float32())
    )
    assert got["maxValues"]["score"] == pytest.approx(pc.max(table.column("score")).as_py())
    assert got["minValues"]["day"] == "2026-01-01"
    assert got["maxValues"]["day"] == (dt.date(2026, 1, 1) + dt.timedelta(days=39)).isoformat()
    # microseconds rounded outward to the millisecond Delta stats hold: still true bounds
    assert got["minValues"]["at"] == _ms_floor(ts[0])
    assert got["maxValues"]["at"] == _ms_floor(ts[-1] + dt.timedelta(milliseconds=1))


def test_timestamps_round_outward_at_every_unit(tmp_path: Path) -> None:
    base = 1_764_000_000_123_456_789  # ns, not on a millisecond
    table = pa.table(
        {
            "ns": pa.array([base, base + 1, -1_500_000, 0], pa.timestamp("ns", tz="UTC")),
            "s": pa.array([5, 7, 6, 8], pa.timestamp("s", tz="UTC")),
            "ms": pa.array([1, 2, 3, 4], pa.timestamp("ms", tz="UTC")),
        }
    )
    got = _stats(_write(tmp_path, table, row_group_rows=2))
    assert got["minValues"]["ns"] == "1969-12-31T23:59:59.998Z"  # -1.5 ms, floored
    assert got["maxValues"]["ns"] == "2025-11-24T16:00:00.124Z"  # .123456790, ceiled
    assert got["minValues"]["s"] == "1970-01-01T00:00:05.000Z"
    assert got["maxValues"]["s"] == "1970-01-01T00:00:08.000Z"
    assert (got["minValues"]["ms"], got["maxValues"]["ms"]) == (
        "1970-01-01T00:00:00.001Z",
        "1970-01-01T00:00:00.004Z",
    )


def test_nan_leaves_float_bounds_out(tmp_path: Path) -> None:
    # Parquet leaves NaN out of its min/max (this footer says max 2.0 with a NaN in the file);
    # Polars orders NaN above every number: for it, 2.0 is no upper bound of this file.
    table = pa.table(
        {
            "with_nan": pa.array([1.0, 2.0, math.nan, 0.5]),
            "clean": pa.array([1.0, 2.0, 3.0, 0.5], pa.float32()),
            "inf": pa.array([1.0, math.inf, 3.0, 0.5]),
        }
    )
    md = _write(tmp_path, table, row_group_rows=2)
    assert md.row_group(1).column(0).statistics.max == 0.5  # NaN not in the footer's max
    assert nan_columns(table) == {"with_nan"}
    unvouched = _stats(md)
    assert unvouched["minValues"] == {} and unvouched["maxValues"] == {}
    vouched = _stats(md, nan_free={"clean", "inf"})
    assert vouched["minValues"] == {"clean": 0.5}
    assert vouched["maxValues"] == {"clean": 3.0}
    assert vouched["nullCount"] == {"with_nan": 0, "clean": 0, "inf": 0}


def test_row_groups_without_bounds(tmp_path: Path) -> None:
    table = pa.table(
        {
            # values in the first row group, all null in the second: bounds still exact
            "late_nulls": pa.array([3, 1, None, None], pa.int64()),
            "all_null": pa.array([None] * 4, pa.int64()),
            # an all-NaN row group has no min/max in its footer and values: no bounds
            "nan_group": pa.array([math.nan, math.nan, 1.0, 2.0]),
            "long": pa.array(["a" * (MAX_STRING_STAT_CHARS + 1), "b", "c", "d"]),
            "short": pa.array(["a" * MAX_STRING_STAT_CHARS, "b", "c", None]),
        }
    )
    got = _stats(_write(tmp_path, table, row_group_rows=2), nan_free={"nan_group"})
    assert got["minValues"] == {"late_nulls": 1, "short": "a" * MAX_STRING_STAT_CHARS}
    assert got["maxValues"] == {"late_nulls": 3, "short": "c"}
    assert got["nullCount"] == {
        "late_nulls": 2,
        "all_null": 4,
        "nan_group": 0,
        "long": 0,
        "short": 1,
    }


def test_columns_without_statistics_are_left_out(tmp_path: Path) -> None:
    table = pa.table(
        {"id": pa.array(range(6), pa.int64()), "other": pa.array(range(6), pa.int64())}
    )
    got = _stats(_write(tmp_path, table, row_group_rows=3, write_statistics=["id"]))
    assert got["minValues"] == {"id": 0}
    assert "other" not in got["nullCount"]


def test_types_without_safe_bounds(tmp_path: Path) -> None:
    n = 6
    table = pa.table(
        {
            "u": pa.array([2**64 - 1, 1, 2, 3, 4, 5], pa.uint64()),
            "flag": pa.array([True, False] * 3),
            "money": pa.array([1, 2, 3, 4, 5, 6], pa.decimal128(10, 2)),
            "blob": pa.array([b"x"] * n),
            "naive": pa.array([dt.datetime(2026, 1, 1)] * n, pa.timestamp("us")),
            "tags": pa.array([[1, 2]] * n),
            "pair": pa.array([{"a": 1, "b": "x"}] * n),
            "after": pa.array(range(n), pa.int64()),  # its leaf index comes after the nested ones
            "cat": pa.array(["b", "a", "c", "a", "b", "c"]).dictionary_encode(),
        }
    )
    got = _stats(_write(tmp_path, table, row_group_rows=3))
    assert got["minValues"] == {"after": 0, "cat": "a"}
    assert got["maxValues"] == {"after": n - 1, "cat": "c"}
    assert set(got["nullCount"]) == {"u", "flag", "money", "blob", "naive", "after", "cat"}


_VALUES = {
    "int": st.integers(-(2**63), 2**63 - 1),
    "float": st.floats(allow_nan=False, allow_infinity=False, width=64),
    "str": st.text(max_size=40),
}
_TYPES = {"int": pa.int64(), "float": pa.float64(), "str": pa.string()}


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(sorted(_VALUES)),
    data=st.data(),
    row_group_rows=st.integers(1, 5),
)
def test_bounds_hold_every_value(tmp_path: Path, kind: str, data: Any, row_group_rows: int) -> None:
    """Whatever the data and row groups: every non-null value lies within the bounds written,
    and the counts are exact. A file whose stats broke this would lose rows in every reader."""
    values = data.draw(
        st.lists(st.one_of(st.none(), _VALUES[kind]), min_size=row_group_rows + 1, max_size=25)
    )
    table = pa.table({"c": pa.array(values, _TYPES[kind])})
    path = tmp_path / "p.parquet"
    pq.write_table(table, path, row_group_size=row_group_rows)
    got = json.loads(file_stats(pq.read_metadata(path), nan_free={"c"}))
    assert got["numRecords"] == len(values)
    assert got["nullCount"]["c"] == sum(v is None for v in values)
    present = [v for v in values if v is not None]
    if "c" in got["minValues"]:
        assert all(got["minValues"]["c"] <= v <= got["maxValues"]["c"] for v in present)
    elif kind != "str" and present:
        pytest.fail(f"no bounds for {present}")


def test_new_file_record(tmp_path: Path) -> None:
    table = pa.table({"id": pa.array(range(5), pa.int64())})
    md = _write(tmp_path, table, row_group_rows=2)
    rec = new_file(
        "run_date=d1/part-0.parquet",
        size=123,
        metadata=md,
        partition_values={"run_date": "d1"},
        modification_time=42,
    )
    assert (rec.path, rec.size, rec.rows, rec.modification_time) == (
        "run_date=d1/part-0.parquet",
        123,
        5,
        42,
    )
    assert dict(rec.partition_values) == {"run_date": "d1"}
    assert json.loads(rec.stats)["maxValues"] == {"id": 4}
    import pickle

    assert pickle.loads(pickle.dumps(rec)) == rec  # workers send it to the driver


def test_partition_paths() -> None:
    assert data_file_path({"run_date": "2026-12-01", "region": "eu_1"}, "part-1.parquet") == (
        "run_date=2026-12-01/region=eu_1/part-1.parquet"
    )
    assert data_file_path({}, "part-1.parquet") == "part-1.parquet"
    for bad in ("a b", "12:00", "x/y", ".hidden", "", "50%", "-x"):
        with pytest.raises(ConfigError, match="partition value"):
            check_partition_values({"run_date": bad})
    for key in ("_p", "1p", "a-b"):
        with pytest.raises(ConfigError, match="partition column"):
            check_partition_values({key: "x"})
    for name in ("_part.parquet", ".part.parquet", "a/b.parquet", "part.csv"):
        with pytest.raises(ValueError, match="data file name"):
            data_file_path({}, name)


def _python(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_worker_side_never_imports_deltalake(tmp_path: Path) -> None:
    done = _python(
        """
        import sys
        import pipeline.io.outputs.deltastats
        assert "deltalake" not in sys.modules, "pipeline.io.outputs.deltastats imported deltalake"
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr


def test_forked_worker_computes_stats_after_the_driver_used_deltalake(tmp_path: Path) -> None:
    """Dask workers are forked from the driver; a forked child that calls delta-rs after its
    parent did panics. A child that only writes Parquet and computes stats (all a worker does)
    works, and so does the parent afterwards."""
    done = _python(
        """
        import os, json
        import pyarrow as pa, pyarrow.parquet as pq
        from deltalake import DeltaTable, write_deltalake
        write_deltalake("t", pa.table({"id": [1, 2]}))
        assert DeltaTable("t").version() == 0
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                from pipeline.io.outputs.deltastats import file_stats
                pq.write_table(pa.table({"id": [3, 4, 5]}), "child.parquet", row_group_size=2)
                stats = json.loads(file_stats(pq.read_metadata("child.parquet")))
                code = 0 if stats["maxValues"] == {"id": 5} else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        write_deltalake("t", pa.table({"id": [3]}), mode="append")
        assert DeltaTable("t").version() == 1
        print("ok")
        """,
        tmp_path,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
