"""Delta file statistics from Parquet footers (pipeline.sinks.delta.stats): exact, or left out.

Every expectation is computed from the data itself (pyarrow.compute over the rows written),
never from the footer the code under test reads. Files have several row groups, with nulls,
NaN, long strings and all-null row groups placed in some of them only.
"""

from __future__ import annotations

import datetime as dt
import decimal
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
from pipeline.sinks.compaction import nan_columns
from pipeline.sinks.delta.bounds import MAX_STRING_STAT_CHARS
from pipeline.sinks.delta.stats import (
    check_partition_values,
    data_file_path,
    delta_facts,
    file_stats,
    new_file,
    stats_problem,
)

D = decimal.Decimal

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


def test_a_nan_or_an_infinity_leaves_the_whole_file_without_bounds(tmp_path: Path) -> None:
    # Parquet leaves NaN out of its min/max (this footer says max 2.0 with a NaN in the file);
    # Polars, DuckDB and Spark order NaN above every number, and deltalake takes bounds as proof
    # that `x <= max` holds for every row: no bound is true. A column left out of minValues
    # alone makes deltalake skip the file for any filter on it, so the file gets none at all.
    table = pa.table(
        {
            "with_nan": pa.array([1.0, 2.0, math.nan, 0.5]),
            "clean": pa.array([1.0, 2.0, 3.0, 0.5], pa.float32()),
            "inf": pa.array([1.0, math.inf, 3.0, 0.5]),
            "id": pa.array([1, 2, 3, 4], pa.int64()),
        }
    )
    md = _write(tmp_path, table, row_group_rows=2)
    assert md.row_group(1).column(0).statistics.max == 0.5  # NaN not in the footer's max
    assert nan_columns(table) == {"with_nan"}
    for vouched in (set(), {"clean", "inf", "id"}, {"with_nan", "clean", "id"}):
        got = _stats(md, nan_free=vouched)
        assert set(got) == {"numRecords", "nullCount"}, vouched
        assert got["nullCount"] == {"with_nan": 0, "clean": 0, "inf": 0, "id": 0}
    clean = _stats(md, nan_free={"with_nan", "clean", "inf"})  # the writer's word: no NaN
    assert "minValues" not in clean  # the infinity still leaves the file without bounds
    finite = _stats(
        _write(tmp_path, table.drop_columns(["inf"]), 2), nan_free={"with_nan", "clean"}
    )
    assert finite["minValues"] == {"with_nan": 0.5, "clean": 0.5, "id": 1}
    assert finite["maxValues"] == {"with_nan": 2.0, "clean": 3.0, "id": 4}


def test_row_groups_without_bounds(tmp_path: Path) -> None:
    table = pa.table(
        {
            # values in the first row group, all null in the second: bounds still exact
            "late_nulls": pa.array([3, 1, None, None], pa.int64()),
            # all null: no bounds (the protocol's rule), readers skip on its null count
            "all_null": pa.array([None] * 4, pa.int64()),
            "short": pa.array(["a" * MAX_STRING_STAT_CHARS, "b", "c", None]),
        }
    )
    got = _stats(_write(tmp_path, table, row_group_rows=2))
    assert got["minValues"] == {"late_nulls": 1, "short": "a" * MAX_STRING_STAT_CHARS}
    assert got["maxValues"] == {"late_nulls": 3, "short": "c"}
    assert got["nullCount"] == {"late_nulls": 2, "all_null": 4, "short": 1}
    # an all-NaN row group has no min/max in its footer but values: that file gets no bounds
    nan_group = table.append_column("f", pa.array([math.nan, math.nan, 1.0, 2.0]))
    got = _stats(_write(tmp_path, nan_group, row_group_rows=2), nan_free={"f"})
    assert set(got) == {"numRecords", "nullCount"} and got["nullCount"]["f"] == 0


def test_a_file_with_no_rows(tmp_path: Path) -> None:
    # pyarrow writes one row group without statistics: no bounds, nothing to lose either way.
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.int64()), "s": pa.array([], pa.string())}), path)
    assert _stats(pq.read_metadata(path)) == {"numRecords": 0, "nullCount": {}}


def test_a_column_without_statistics_leaves_the_file_without_bounds(tmp_path: Path) -> None:
    table = pa.table(
        {"id": pa.array(range(6), pa.int64()), "other": pa.array(range(6), pa.int64())}
    )
    got = _stats(_write(tmp_path, table, row_group_rows=3, write_statistics=["id"]))
    assert got == {"numRecords": 6, "nullCount": {"id": 0}}
    # binary has no bounds in any reader's stats schema: leaving it out costs the file nothing
    blob = table.drop_columns(["other"]).append_column("blob", pa.array([b"x"] * 6))
    got = _stats(_write(tmp_path, blob, row_group_rows=3, write_statistics=["id"]))
    assert got["minValues"] == {"id": 0} and got["nullCount"] == {"id": 0}


def test_bounds_for_every_type_catalogs_carry(tmp_path: Path) -> None:
    n = 6
    day0 = dt.date(2026, 1, 1)
    local = [dt.datetime(2026, 1, 1, 0, 0, 0, 1_500) + dt.timedelta(hours=i) for i in range(n)]
    table = pa.table(
        {
            "flag": pa.array([True, False, None] * 2),
            "always": pa.array([True] * n),
            "money": pa.array(
                [D("-12.50"), D("3.25"), None, D("0.01"), D("7"), D("-0.5")], pa.decimal128(10, 2)
            ),
            "big": pa.array(
                [D("-" + "9" * 29 + "." + "9" * 9), D("1E-9")] * 3, pa.decimal128(38, 9)
            ),
            "blob": pa.array([b"x"] * n),
            "naive": pa.array(local, pa.timestamp("us")),
            "day": pa.array([day0 + dt.timedelta(days=i * 500) for i in range(n)], pa.date32()),
            "tags": pa.array([[1, 2]] * n),
            "pair": pa.array([{"a": 1, "b": "x"}] * n),
            "after": pa.array(range(n), pa.int64()),  # its leaf index comes after the nested ones
            "cat": pa.array(["b", "a", "c", "a", "b", "c"]).dictionary_encode(),
            "small": pa.array([-3, 4, 0, 1, 2, 2], pa.int8()),
        }
    )
    md = _write(tmp_path, table, row_group_rows=3)
    text = file_stats(md)
    # decimals as exact JSON numbers: a float would have rounded the 38-digit min
    assert '"big":-99999999999999999999999999999.999999999' in text
    assert '"money":-12.50' in text and '"money":7.00' in text
    got = json.loads(text, parse_float=D)
    assert got["minValues"] == {
        "flag": False,
        "always": True,
        "money": D("-12.50"),
        "big": D("-99999999999999999999999999999.999999999"),
        "naive": "2026-01-01T00:00:00.001",  # no zone, rounded down to the millisecond
        "day": "2026-01-01",
        "after": 0,
        "cat": "a",
        "small": -3,
    }
    assert got["maxValues"] == {
        "flag": True,
        "always": True,
        "money": D("7.00"),
        "big": D("1E-9"),
        "naive": "2026-01-01T05:00:00.002",  # rounded up
        "day": (day0 + dt.timedelta(days=2500)).isoformat(),
        "after": n - 1,
        "cat": "c",
        "small": 4,
    }
    assert set(got["nullCount"]) == set(table.column_names) - {"tags", "pair"}
    assert got["nullCount"]["flag"] == 2 and got["nullCount"]["money"] == 1


def test_an_unknown_flat_type_leaves_the_file_without_bounds(tmp_path: Path) -> None:
    # Delta has no unsigned integers (the driver refuses them before writing); were one written,
    # no bound is written for it and so none for the file: a reader would skip on its absence.
    table = pa.table({"u": pa.array([2**64 - 1, 1], pa.uint64()), "id": pa.array([1, 2])})
    got = _stats(_write(tmp_path, table, row_group_rows=1))
    assert got == {"numRecords": 2, "nullCount": {"u": 0, "id": 0}}


def test_long_strings_get_a_cut_min_and_an_incremented_max(tmp_path: Path) -> None:
    k = MAX_STRING_STAT_CHARS
    values = ["b" * 40, "b" * (k - 1) + "a" + "zzz", "ab", "b" * k + "\U0010ffff", None]
    got = _stats(_write(tmp_path, pa.table({"s": values}), row_group_rows=2))
    assert got["minValues"]["s"] == "ab"
    # max "b" * 32 + U+10FFFF: cut to 32 characters, the last one incremented
    assert got["maxValues"]["s"] == "b" * (k - 1) + "c"
    long_min = _stats(_write(tmp_path, pa.table({"s": ["é" * 50, "é" * 60]}), row_group_rows=1))
    assert long_min["minValues"]["s"] == "é" * k  # a prefix is never above the value
    assert long_min["maxValues"]["s"] == "é" * (k - 1) + "ê"


def test_string_max_increments_past_surrogates_and_the_last_code_point(tmp_path: Path) -> None:
    k = MAX_STRING_STAT_CHARS
    cases = {
        "a" * (k - 1) + "\ud7ff" + "tail": "a" * (k - 1) + "\ue000",  # U+D800-DFFF: no characters
        "a" * (k - 2) + "\U0010ffff" * 3: "a" * (k - 3) + "b",  # U+10FFFF has no next: carry
        "x" * (k + 5): "x" * (k - 1) + "y",
    }
    for value, upper in cases.items():
        got = _stats(_write(tmp_path, pa.table({"s": [value, "a"]}), row_group_rows=1))
        assert got["maxValues"]["s"] == upper, value
        assert all(v <= upper for v in (value, value[:k])) and value > value[:k]
    # no string is above every string that starts with 32 x U+10FFFF: no bounds for the file
    top = "\U0010ffff" * (k + 1)
    got = _stats(_write(tmp_path, pa.table({"s": [top, "a"], "id": [1, 2]}), row_group_rows=1))
    assert set(got) == {"numRecords", "nullCount"}


def test_strings_over_the_footers_limit_leave_the_file_without_bounds(tmp_path: Path) -> None:
    # pyarrow 26 writes a string column's min/max whole up to 4,096 bytes and drops them for a
    # row group past that: then the true max is nowhere in the footer, and no bound is written.
    fits, over = "z" * 4096, "z" * 4097
    got = _stats(_write(tmp_path, pa.table({"s": [fits, "a"], "id": [1, 2]}), row_group_rows=1))
    assert got["maxValues"]["s"] == "z" * (MAX_STRING_STAT_CHARS - 1) + "{"
    got = _stats(_write(tmp_path, pa.table({"s": [over, "a"], "id": [1, 2]}), row_group_rows=1))
    assert got == {"numRecords": 2, "nullCount": {"s": 0, "id": 0}}


def test_stats_keep_characters_as_they_are(tmp_path: Path) -> None:
    # The readers' JSON decoder decodes a \ud840\udc00 escape (U+20000) as U+10000: a max
    # below its value, which lost the row in deltalake, Polars and DuckDB. Raw UTF-8 reads right.
    values = ["\U00020000", "\U0010ffff", "中", "é"]
    text = file_stats(_write(tmp_path, pa.table({"s": values}), row_group_rows=2))
    assert "\\u" not in text
    assert json.loads(text)["maxValues"]["s"] == "\U0010ffff"


def test_the_drivers_check_of_a_workers_stats(tmp_path: Path) -> None:
    # stats_problem is what the driver asks of every file before committing it.
    big = D("12345678901234567890123456.123456789")
    table = pa.table({"x": [1.0, 2.5], "money": pa.array([big, D(0)], pa.decimal128(38, 9))})
    md = _write(tmp_path, table, row_group_rows=1)
    vouched = file_stats(md, nan_free={"x"})
    assert stats_problem(vouched, md) is None
    # a claim without bounds: a NaN seen by the worker, which no footer shows; taken as said
    unvouched = file_stats(md)
    assert "minValues" not in json.loads(unvouched) and stats_problem(unvouched, md) is None
    # a decimal bound off in its 36th digit (a float would not tell them apart)
    off = vouched.replace(
        "12345678901234567890123456.123456789", "12345678901234567890123456.123456788"
    )
    assert off != vouched and stats_problem(off, md) == "its stats do not match its footer"
    # no floats: a claim without bounds is not what the footer gives
    ints = _write(tmp_path, pa.table({"n": [1, 2]}), row_group_rows=1)
    bare = json.dumps({"numRecords": 2, "nullCount": {"n": 0}})
    assert stats_problem(bare, ints) == "its stats do not match its footer"
    assert stats_problem(file_stats(ints), ints) is None
    assert stats_problem("{not json", ints) == "its stats are not JSON"
    assert stats_problem("", ints) == "its stats do not match its footer"


_TIME = st.datetimes(dt.datetime(1, 1, 2), dt.datetime(9999, 12, 30))
_VALUES: dict[str, tuple[pa.DataType, st.SearchStrategy[Any]]] = {
    "int": (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    "float": (pa.float64(), st.floats(width=64)),
    "float32": (pa.float32(), st.floats(width=32)),
    "bool": (pa.bool_(), st.booleans()),
    "str": (pa.string(), st.text(max_size=40)),
    "long_str": (pa.string(), st.builds(lambda t: "é" * 31 + t, st.text(max_size=10))),
    "date": (pa.date32(), st.dates()),
    "ntz": (pa.timestamp("us"), _TIME),
    "utc": (pa.timestamp("us", "UTC"), _TIME.map(lambda t: t.replace(tzinfo=dt.timezone.utc))),
    # within 38 digits: hypothesis may round a bound of 10**29 - 1 out to 10**29
    "decimal": (pa.decimal128(38, 9), st.decimals(-D(10**28), D(10**28), places=9)),
}


def _as_value(kind: str, bound: Any) -> Any:
    """A stats JSON bound as a Python value comparable with the column's values."""
    if kind in ("ntz", "utc"):
        t = dt.datetime.fromisoformat(bound.rstrip("Z"))
        return t.replace(tzinfo=dt.timezone.utc) if kind == "utc" else t
    if kind == "date":
        return dt.date.fromisoformat(bound)
    return bound


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(sorted(_VALUES)),
    data=st.data(),
    row_group_rows=st.integers(1, 5),
)
def test_bounds_hold_every_value(tmp_path: Path, kind: str, data: Any, row_group_rows: int) -> None:
    """Whatever the data and row groups: every non-null value lies within the bounds written,
    and the counts are exact; bounds are missing only for a NaN or an infinity. A file whose
    stats broke this would lose rows in every reader."""
    typ, strategy = _VALUES[kind]
    values = data.draw(
        st.lists(st.one_of(st.none(), strategy), min_size=row_group_rows + 1, max_size=25)
    )
    table = pa.table({"c": pa.array(values, typ)})
    path = tmp_path / "p.parquet"
    pq.write_table(table, path, row_group_size=row_group_rows)
    md = pq.read_metadata(path)
    got = json.loads(delta_facts(md, frozenset(nan_columns(table)))["stats"], parse_float=D)
    assert got["numRecords"] == len(values)
    assert got["nullCount"]["c"] == sum(v is None for v in values)
    present = [v for v in values if v is not None]
    odd = [v for v in present if isinstance(v, float) and not math.isfinite(v)]
    if "minValues" not in got:
        assert odd, f"no bounds for {present}"
        return
    assert not odd, f"bounds {got} for a file holding {odd}"
    if not present:
        assert got["minValues"] == got["maxValues"] == {}
        return
    lo, hi = (_as_value(kind, got[k]["c"]) for k in ("minValues", "maxValues"))
    if kind == "float32":  # a float32 bound reads back as the same float32
        lo, hi = (pa.scalar(float(v), pa.float32()).as_py() for v in (lo, hi))
    elif kind == "float":
        lo, hi = float(lo), float(hi)
    assert all(lo <= v <= hi for v in present), (lo, hi)


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
        import pipeline.sinks.delta.stats
        assert "deltalake" not in sys.modules, "pipeline.sinks.delta.stats imported deltalake"
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
                from pipeline.sinks.delta.stats import file_stats
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
