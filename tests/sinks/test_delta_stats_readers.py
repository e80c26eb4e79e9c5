"""Delta file statistics as real readers use them: whatever the data, a filter returns exactly the
rows that the reader's own in-memory filter of the whole table returns (issue 29).

Tables hold every type catalogs carry (bool, int64, float64 with NaN, infinities, -0.0 and
nulls, date32, timestamps with and without a time zone, decimal128(38, 9), short strings of any
character and long ones sharing 32-character prefixes, U+10FFFF included), written the way a
worker writes them (2-4 files in two partitions, 1-5 rows per row group, stats from
:mod:`pipeline.sinks.delta.stats`) and committed by :func:`deltatable.commit` (whose re-check
of every file's stats runs). Then random predicates (=, !=, <, <=, >, >=, between, is null) on
every column and the partition column go through deltalake ``to_pyarrow_table(filters=)``,
Polars ``scan_delta`` and DuckDB 1.4.4 ``delta_scan``, each against its own in-memory filter
(:mod:`tests.delta_readers`, which also says which two known reader faults it accepts; the
fixed tests at the end pin them, and fail once the readers are fixed).

deltalake is read through a pyarrow filesystem of ours: through its default one the process
aborts at exit now and then (SIGABRT, delta-rs#2184).
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pytest
from deltalake import DeltaTable
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pipeline.sinks.delta import table as delta
from pipeline.sinks.delta.table import TableRef
from tests.delta_helpers import arrow_filesystem, write_file
from tests.delta_readers import (
    OPS,
    arrow_expr,
    check_deltalake,
    check_duckdb,
    check_polars,
    data_files,
)
from tests.duckdb_delta import DuckDBDelta, duckdb_python

PARTITION = "run_date"
DAYS = ("2026-12-01", "2026-12-02")
MONEY = pa.decimal128(38, 9)
SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("flag", pa.bool_()),
        ("n", pa.int64()),
        ("x", pa.float64()),
        ("day", pa.date32()),
        ("at", pa.timestamp("us", tz="UTC")),
        ("local", pa.timestamp("us")),
        ("money", MONEY),
        ("code", pa.string()),
        ("title", pa.string()),
    ]
)

_T0, _T1 = dt.datetime(1, 1, 2), dt.datetime(9999, 12, 30)
_MONEY_MAX = decimal.Decimal(10**28 - 1)
# Long strings share 30-33 character prefixes, so that their 32-character bounds tie often.
_PREFIXES = ("x" * 30, "x" * 31 + "é", "品" * 32, "x" * 31 + "\U0010ffff", "😀" * 33)
_TAIL = st.text(alphabet="az\x7fé中😀\U0010ffff", max_size=40)
_FLOATS = st.one_of(
    st.floats(-1e6, 1e6, width=64),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e308, -1e308]),
)
VALUES: dict[str, st.SearchStrategy[Any]] = {
    "flag": st.booleans(),
    "n": st.integers(-(2**63), 2**63 - 1),
    "x": _FLOATS,
    "day": st.dates(),
    "at": st.datetimes(_T0, _T1, timezones=st.just(dt.timezone.utc)),
    "local": st.datetimes(_T0, _T1),
    "money": st.decimals(-_MONEY_MAX, _MONEY_MAX, places=9, allow_nan=False),
    "code": st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=8),
    "title": st.builds(lambda p, t: p + t, st.sampled_from(_PREFIXES), _TAIL),
}


@st.composite
def tables(draw: Any) -> list[tuple[str, pa.Table, int]]:
    """2-4 files, each (day, rows, rows per row group): ids unique over the table, every
    column but id nullable; some files hold a NaN, some a string over pyarrow's 4,096-byte
    statistics limit (their footer then has no bounds for it)."""
    files = []
    next_id = 0
    for k in range(draw(st.integers(2, 4))):
        n = draw(st.integers(1, 12))
        cols: dict[str, Any] = {"id": list(range(next_id, next_id + n))}
        next_id += n + 1
        for name, values in VALUES.items():
            cols[name] = draw(st.lists(st.none() | values, min_size=n, max_size=n))
        if draw(st.integers(0, 9)) == 0:
            cols["title"][0] = "y" * 5000
        day = DAYS[k % 2] if k < 2 else draw(st.sampled_from(DAYS))
        files.append((day, pa.table(cols, schema=SCHEMA), draw(st.integers(1, 5))))
    return files


def _present(table: pa.Table, name: str) -> list[Any]:
    return [v for v in table.column(name).to_pylist() if v is not None]


@st.composite
def predicates(draw: Any, whole: pa.Table, count: int) -> list[tuple[str, str, Any, Any]]:
    """(column, op, value, second value for between): values mostly from the table (bounds
    are tested where they are tight), some fresh, some cut or extended strings."""
    out = []
    for _ in range(count):
        name = draw(st.sampled_from(["id", PARTITION, *VALUES]))
        op = draw(st.sampled_from(OPS))
        present = _present(whole, name)
        fresh = VALUES.get(name, st.integers(-5, 200) if name == "id" else st.sampled_from(DAYS))
        pick = st.sampled_from(present) | fresh if present else fresh
        a, b = draw(pick), draw(pick)
        if name == "title" and draw(st.booleans()):
            a = draw(st.sampled_from([a[:32], a[:31], a[:32] + "\x7f", a + "a"]))
        if op == "between" and _key(a) > _key(b):
            a, b = b, a
        out.append((name, op, a, b))
    return out


def _key(v: Any) -> Any:
    return (1, 0) if isinstance(v, float) and math.isnan(v) else (0, v)


def _write_table(root: Path, files: list[tuple[str, pa.Table, int]]) -> TableRef:
    ref = TableRef.of(str(root / "table"))
    delta.ensure_table(ref, SCHEMA, [PARTITION], allow_new_columns=False)
    adds = [write_file(ref, t, {PARTITION: d}, row_group_rows=rg) for d, t, rg in files]
    delta.commit(
        ref, adds=adds, removes=[], app_id="t", run_version=1, metadata={}, expected_schema=SCHEMA
    )
    return ref


def _whole(files: list[tuple[str, pa.Table, int]]) -> pa.Table:
    parts = [
        t.append_column(PARTITION, pa.array([d] * t.num_rows, pa.string())) for d, t, _ in files
    ]
    return pa.concat_tables(parts)


def _arrow(name: str, op: str, a: Any, b: Any) -> pc.Expression:
    return arrow_expr(SCHEMA.append(pa.field(PARTITION, pa.string())), (name, op, a, b))


def _ids(table: pa.Table) -> list[int]:
    return sorted(table.column("id").to_pylist())


def _check(
    reader: str, ref: TableRef, whole: pa.Table, preds: list[Any], request: Any
) -> list[str]:
    if reader == "deltalake":
        return check_deltalake(ref, whole, preds, "id")
    if reader == "polars":
        return check_polars(ref, whole, preds, "id")
    return check_duckdb(request.getfixturevalue("duckdb"), ref, whole, preds, "id")[0]


@pytest.fixture(scope="module")
def duckdb() -> Iterator[DuckDBDelta]:
    python = duckdb_python()
    with tempfile.TemporaryDirectory() as home:
        duck = DuckDBDelta(python, Path(home))
        try:
            yield duck
        finally:
            duck.close()


def _run(reader: str, files: Any, data: Any, count: int, request: pytest.FixtureRequest) -> None:
    whole = _whole(files)
    preds = data.draw(predicates(whole, count))
    with tempfile.TemporaryDirectory() as tmp:
        wrong = _check(reader, _write_table(Path(tmp), files), whole, preds, request)
    assert not wrong, f"{len(wrong)} of {len(preds)} predicates wrong: " + "; ".join(wrong[:8])


# No shrinking: every example writes a table, and shrinking one failure took over 5 minutes; the
# failing example and each wrong predicate are printed whole instead.
_SETTINGS = {
    "deadline": None,
    "phases": [Phase.explicit, Phase.reuse, Phase.generate, Phase.target],
    "suppress_health_check": [
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
}


@pytest.mark.parametrize("reader", ["deltalake", "polars", "duckdb"])
@settings(max_examples=6, **_SETTINGS)  # type: ignore[arg-type]
@given(files=tables(), data=st.data())
def test_readers_return_what_their_own_filter_returns(
    reader: str, files: Any, data: Any, request: pytest.FixtureRequest
) -> None:
    _run(reader, files, data, 40, request)


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["deltalake", "polars", "duckdb"])
@settings(max_examples=60, **_SETTINGS)  # type: ignore[arg-type]
@given(files=tables(), data=st.data())
def test_readers_return_what_their_own_filter_returns_many(
    reader: str, files: Any, data: Any, request: pytest.FixtureRequest
) -> None:
    _run(reader, files, data, 60, request)


# --------------------------------------------------------------------------- fixed cases


def _file(start: int, **cols: list[Any]) -> pa.Table:
    """A table of SCHEMA with ids from ``start``, ``cols`` given, every other column null."""
    n = len(next(iter(cols.values())))
    data = {name: cols.get(name, [None] * n) for name in VALUES}
    return pa.table({"id": list(range(start, start + n)), **data}, schema=SCHEMA)


_UTC = dt.timezone.utc
_LOW = {
    "flag": [True, True],
    "n": [1, 2],
    "x": [0.5, -0.0],
    "day": [dt.date(1, 1, 1), dt.date(2026, 1, 1)],
    "at": [dt.datetime(2026, 1, 1, 0, 0, 0, 1, tzinfo=_UTC), dt.datetime(2026, 1, 1, tzinfo=_UTC)],
    "local": [dt.datetime(2026, 1, 1, 0, 0, 0, 999), dt.datetime(2026, 1, 1)],
    "money": [decimal.Decimal("-1" + "0" * 28), decimal.Decimal("0.000000001")],
    "code": ["a", "\U00020000"],
    "title": ["x" * 31 + "\U0010ffff" + "a", "x" * 40],
}
_HIGH = {
    "flag": [False, False],
    "n": [3, 4],
    "x": [0.75, 2.0],
    "day": [dt.date(2026, 1, 2), dt.date(9999, 12, 31)],
    # delta-rs widens a timestamp max by up to 1 ms (the protocol's max may be truncated)
    "at": [dt.datetime(2026, 1, 1, 0, 0, 0, 2_001, tzinfo=_UTC)] * 2,
    "local": [dt.datetime(2026, 1, 1, 0, 0, 0, 2_001)] * 2,
    "money": [decimal.Decimal("0.000000002"), decimal.Decimal("1" + "0" * 28)],
    "code": ["\U00020001", "\U0010ffff"],
    "title": ["y" * 33 + "a", "z" * 50],
}


def test_every_type_has_bounds_that_deltalake_skips_files_on(tmp_path: Path) -> None:
    """Two files whose values do not overlap in any column (a string max whose 32nd character
    is U+10FFFF, which carries to the 31st, included): deltalake keeps one of the two for an
    equality on any column, so bounds are written, and read, for every type; and the answer is
    exact. A third file
    holds a NaN: it has no bounds, and is read for every filter."""
    files = [("2026-12-01", _file(0, **_LOW), 1), ("2026-12-02", _file(10, **_HIGH), 1)]
    ref = _write_table(tmp_path, files)
    table = DeltaTable(ref.table_uri)
    data = table.to_pyarrow_dataset(filesystem=arrow_filesystem(ref))
    whole = _whole(files)
    for name in VALUES:
        for side, values in (("low", _LOW), ("high", _HIGH)):
            for v in values[name]:
                expr = _arrow(name, "=", v, None)
                kept = list(data.get_fragments(filter=expr))
                assert len(kept) == 1, (name, side, v, [f.path for f in kept])
                assert _ids(data.to_table(filter=expr)) == _ids(whole.filter(expr)), (name, v)
    preds = [(c, "=", v, None) for c in VALUES for v in _LOW[c]]
    assert check_deltalake(ref, whole, preds, "id") == []
    nan = _file(20, x=[math.nan, 5.0], n=[1, 2])
    ref = _write_table(tmp_path / "nan", [*files, ("2026-12-01", nan, 1)])
    data = DeltaTable(ref.table_uri).to_pyarrow_dataset(filesystem=arrow_filesystem(ref))
    kept = {f.path.split("/")[0] for f in data.get_fragments(filter=pc.field("n") == 3)}
    assert len(list(data.get_fragments(filter=pc.field("n") == 3))) == 2  # the NaN file and one
    assert kept == {"run_date=2026-12-01", "run_date=2026-12-02"}


@pytest.mark.parametrize("reader", ["deltalake", "polars", "duckdb"])
def test_characters_of_every_plane_bound_right(
    reader: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The readers' JSON decoder turns an escaped U+20000 into U+10000 (every even plane loses
    0x10000): a max written escaped is below its value. Stats keep characters unescaped."""
    chars = [chr(c) for c in (0xE9, 0xFFFF, 0x10000, 0x1F600, 0x20000, 0x2A6DF, 0x40000, 0x10FFFF)]
    files = [("2026-12-01", _file(10 * k, code=[c, c + "a"]), 1) for k, c in enumerate(chars)]
    ref = _write_table(tmp_path, files)
    whole = _whole(files)
    preds = [("code", op, c, None) for c in chars for op in ("=", ">=", "<=")]
    assert _check(reader, ref, whole, preds, request) == []


def test_deltalake_nan_literal_upper_bounds_hold_for_every_row(tmp_path: Path) -> None:
    """Known, and not the stats' to fix: deltalake answers ``x <= NaN`` (pyarrow's filter: no
    row) with every row of a file that has bounds, as its pruning orders NaN above every
    number. The property test leaves such predicates out; this fails once deltalake is fixed."""
    files = [("2026-12-01", _file(0, x=[1.0, 2.0]), 1)]
    ref = _write_table(tmp_path, files)
    table = DeltaTable(ref.table_uri)
    fs = arrow_filesystem(ref)
    assert _whole(files).filter(pc.field("x") <= math.nan).num_rows == 0
    assert table.to_pyarrow_table(filesystem=fs, filters=[("x", "<=", math.nan)]).num_rows == 2
    assert table.to_pyarrow_table(filesystem=fs, filters=[("x", ">=", math.nan)]).num_rows == 0


def test_parquet_readers_lose_nan_rows_with_no_delta_bounds(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Known, and not the stats' to fix: pyarrow's and DuckDB's Parquet readers skip row
    groups on the footer's min/max, which leave NaN out. The file here has no Delta bounds
    (it holds a NaN), and both lose its NaN row all the same; reading it through the Delta
    log loses exactly that row too. The property test accepts this case only; this fails once
    the readers are fixed."""
    files = [("2026-12-01", _file(0, x=[0.0, 0.0, math.nan, None]), 4)]
    ref = _write_table(tmp_path, files)
    whole = _whole(files)
    assert "minValues" not in DeltaTable(ref.table_uri).get_add_actions(flatten=True).column_names
    expr = pc.field("x") != 0.0
    plain = ds.dataset(data_files(ref), format="parquet")
    assert _ids(whole.filter(expr)) == [2] and _ids(plain.to_table(filter=expr)) == []
    got = DeltaTable(ref.table_uri).to_pyarrow_table(filesystem=arrow_filesystem(ref), filters=expr)
    assert _ids(got) == []
    duck = request.getfixturevalue("duckdb")
    [(want, scanned, alone)] = duck.query(
        ref.table_uri, [('"x" > ?', [0.5])], files=data_files(ref)
    )
    assert (want, scanned, alone) == ([2], [], [])
