"""Issue 29, done when: a Delta table the real CLI wrote, whose pass-through columns are bool,
timestamps with and without a time zone, float64 with NaN, 60-character strings, date32,
decimal128 and int64, answers an equality and a range predicate on each column, on the score
and on the partition column (``run_date``) with exactly the rows an in-memory filter of the whole
table gives, through deltalake ``to_pyarrow_table(filters=)``, Polars ``scan_delta`` and DuckDB
1.4.4 ``delta_scan`` (each with its own semantics: :mod:`tests.delta_readers`).

Two nightly runs (two partitions, two shards each; the Dask scheduler, so the stats are computed
in forked workers) into one table; one shard holds NaN in ``weight``, the others none, so most
files carry bounds for every column and one carries none.
"""

from __future__ import annotations

import decimal
import json
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from pipeline.core.errors import EXIT_OK
from pipeline.sinks.delta.table import TableRef
from tests.conftest import write_shards
from tests.delta_helpers import arrow_filesystem
from tests.delta_readers import (
    Predicate,
    arrow_expr,
    check_deltalake,
    check_duckdb,
    check_polars,
)
from tests.duckdb_delta import DuckDBDelta, duckdb_python
from tests.integration.helpers import KILL_AT, cli, manifest_path

pytestmark = pytest.mark.integration

DAYS = ("2026-12-01", "2026-12-02")
ID = "item_id"
TYPES = {
    "flag": pa.bool_(),
    "seen_at": pa.timestamp("us", "UTC"),
    "local_at": pa.timestamp("us"),
    "weight": pa.float64(),
    "title": pa.string(),
    "day": pa.date32(),
    "amount": pa.decimal128(14, 2),
    "qty": pa.int64(),
}
PASSTHROUGH = tuple(TYPES)
SHARD_ROWS = (700, 500)
# 60 characters each; the two days' titles share their first 32 characters within a day, and
# carry characters of even planes (which an escaped JSON string reads 0x10000 too low).
_TITLE_HEADS = {
    DAYS[0]: "catalogue-élément-中文-𠀀-title-",
    DAYS[1]: "catalogue-élément-中文-𠀀-titlf-",
}


def _typed(table: pa.Table, day: str, k: int) -> pa.Table:
    """``table`` (demo shard ``k`` of ``day``) with the pass-through columns (:data:`TYPES`):
    nulls in each (ids ending 3 modulo a number of its own), NaN in ``weight`` of the first
    shard of the first day only."""
    n, rng = table.num_rows, np.random.default_rng([k, int(day[-2:])])
    ids = table.column(ID).to_numpy()
    base = np.datetime64(f"{day}T00:00:00", "us") + (ids * 1_000_123).astype("timedelta64[us]")
    weight = rng.normal(size=n)
    if day == DAYS[0] and k == 0:
        weight[::50] = np.nan
    head = _TITLE_HEADS[day]
    titles = [f"{head}{i:0{60 - len(head)}d}" for i in ids]
    cents = rng.integers(-(10**10), 10**10, n)
    cols = {
        "flag": (rng.random(n) < 0.3, 7),
        "seen_at": (base, 11),
        "local_at": (base + np.timedelta64(7, "h"), 13),
        "weight": (weight, 17),
        "title": (titles, 19),
        "day": (
            (np.datetime64(day) + (ids % 400).astype("timedelta64[D]")).astype("datetime64[D]"),
            23,
        ),
        "amount": ([decimal.Decimal(int(c)).scaleb(-2) for c in cents], 29),
        "qty": (rng.integers(-1000, 1000, n), 31),
    }
    for name, (values, every) in cols.items():
        table = table.append_column(name, pa.array(values, TYPES[name], mask=ids % every == 3))
    return table


def _archive(root: Path) -> Path:
    start = 0
    for day in DAYS:
        folder = root / "archive" / f"dt={day}"
        for k, path in enumerate(
            write_shards(folder, list(SHARD_ROWS), row_group_rows=200, start=start)
        ):
            pq.write_table(_typed(pq.read_table(path), day, k), path, row_group_size=200)
        start += 10_000
    return root / "archive"


def _job(root: Path, archive: Path, model: Path) -> Path:
    names = ", ".join(f'"{c}"' for c in PASSTHROUGH)
    job = root / "nightly.toml"
    job.write_text(
        f'input = "{archive}/dt={{date}}"\n'
        f'output = "{root}/scored/run_date={{date}}"\n'
        f'model = "{model}"\n'
        'format = "delta"\n'
        'scheduler = "local"\n'
        f"passthrough = [{names}]\n"
        "batch_size = 512\n"
        "[monitoring]\ndrift = false\n"
    )
    return job


@pytest.fixture(scope="module")
def table(bundle_dir: Path) -> Iterator[tuple[TableRef, pa.Table]]:
    """The table two nightly runs wrote, and its rows read whole (by deltalake, unfiltered)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        job = _job(root, _archive(root), bundle_dir)
        for day in DAYS:
            r = cli("run", str(job), "--date", day)
            assert r.returncode == EXIT_OK, r.output
        ref = TableRef.of(str(root / "scored"))
        whole = DeltaTable(ref.table_uri).to_pyarrow_table(filesystem=arrow_filesystem(ref))
        yield ref, whole


def _value(whole: pa.Table, name: str, q: float) -> Any:
    """The value at quantile ``q`` of the column's non-null, non-NaN values (sorted)."""
    values = sorted(v for v in whole.column(name).to_pylist() if v is not None and v == v)
    return values[int(q * (len(values) - 1))]


def predicates(whole: pa.Table) -> list[Predicate]:
    """An equality and a range (between, and > for the partition) on every pass-through
    column, the score and the partition column; a few more on the edges of the strings' and
    timestamps' bounds."""
    out: list[Predicate] = []
    for name in (*PASSTHROUGH, "score", "label", ID):
        out.append((name, "=", _value(whole, name, 0.37), None))
        if name != "flag":
            out.append((name, "between", _value(whole, name, 0.2), _value(whole, name, 0.45)))
            out.append((name, ">", _value(whole, name, 0.9), None))
    out += [("flag", "=", True, None), ("flag", "is null", None, None)]
    out += [("run_date", "=", DAYS[1], None), ("run_date", ">", DAYS[0], None)]
    top = _value(whole, "title", 1.0)
    out += [
        ("title", "=", top, None),
        ("title", ">=", top[:32], None),
        ("title", "<", top[:33], None),
    ]
    out += [("seen_at", "=", _value(whole, "seen_at", 1.0), None)]
    out += [("local_at", "<=", _value(whole, "local_at", 0.0), None)]
    return out


def _bounds(ref: TableRef) -> list[set[str]]:
    """The columns each file of the table has bounds for."""
    adds = pa.table(DeltaTable(ref.table_uri).get_add_actions(flatten=True))
    cols = [c.removeprefix("min.") for c in adds.column_names if c.startswith("min.")]
    return [{c for c in cols if row[f"min.{c}"] is not None} for row in adds.to_pylist()]


def test_the_table_holds_every_row_and_bounds_for_every_column(
    table: tuple[TableRef, pa.Table],
) -> None:
    ref, whole = table
    assert whole.num_rows == 2 * sum(SHARD_ROWS)
    for name, typ in TYPES.items():  # passed through as they were, not cast or refused
        assert whole.schema.field(name).type == typ, name
    bounds = sorted(_bounds(ref), key=len)
    assert len(bounds) == 4
    assert bounds[0] == set()  # the file with a NaN in weight: numRecords and nullCount only
    wanted = {*PASSTHROUGH, ID, "score", "label", "model_version"}
    assert all(b == wanted for b in bounds[1:]), bounds


def test_deltalake_answers_every_filter_exactly(table: tuple[TableRef, pa.Table]) -> None:
    ref, whole = table
    preds = predicates(whole)
    wrong = check_deltalake(ref, whole, preds, ID)
    assert not wrong, f"{len(wrong)} of {len(preds)} wrong: " + "; ".join(wrong)


def test_polars_answers_every_filter_exactly(table: tuple[TableRef, pa.Table]) -> None:
    ref, whole = table
    preds = predicates(whole)
    wrong = check_polars(ref, whole, preds, ID)
    assert not wrong, f"{len(wrong)} of {len(preds)} wrong: " + "; ".join(wrong)


def test_duckdb_answers_every_filter_exactly(
    table: tuple[TableRef, pa.Table], tmp_path: Path
) -> None:
    ref, whole = table
    duck = DuckDBDelta(duckdb_python(), tmp_path)
    preds = predicates(whole)
    try:
        wrong, parquet_nan = check_duckdb(duck, ref, whole, preds, ID)
    finally:
        duck.close()
    assert not wrong, f"{len(wrong)} of {len(preds)} wrong: " + "; ".join(wrong)
    assert parquet_nan <= 1  # weight > v may lose the NaN rows in DuckDB's own Parquet reader


def test_filters_match_rows_in_both_days(table: tuple[TableRef, pa.Table]) -> None:
    """The predicates are not trivially empty: most select rows, from both partitions."""
    _, whole = table
    hits = [whole.filter(arrow_expr(whole.schema, p)) for p in predicates(whole)]
    assert sum(h.num_rows > 0 for h in hits) >= len(hits) - 3
    days = set(pc.unique(pa.concat_tables(hits).column("run_date")).to_pylist())
    assert days == set(DAYS)


def test_a_resumed_run_scores_again_a_file_whose_recorded_stats_are_stale(
    tmp_path: Path, bundle_dir: Path
) -> None:
    """A run killed right before its commit, resumed by a version of the tool whose stats rules
    differ: its manifest holds stats without the bool column's bounds (as before issue 29),
    which the commit's check refuses. The resume scores those shards again instead of
    reusing their files (and being refused by every rerun)."""
    job = _job(tmp_path, _archive(tmp_path), bundle_dir)
    day = DAYS[1]
    killed = cli("run", str(job), "--date", day, env={KILL_AT: "delta-before-commit"})
    assert killed.returncode == -signal.SIGKILL, killed.output
    path = manifest_path(tmp_path / "scored" / f"run_date={day}")
    manifest = json.loads(path.read_text())
    for entry in manifest["shards"].values():
        stats = json.loads(entry["stats"])
        for side in ("minValues", "maxValues"):
            del stats[side]["flag"]
        entry["stats"] = json.dumps(stats)
    path.write_text(json.dumps(manifest))

    resumed = cli("run", str(job), "--date", day)
    assert resumed.returncode == EXIT_OK, resumed.output
    assert resumed.report is not None and resumed.report["shards_skipped"] == 0
    assert "recorded by another version?" in resumed.output
    ref = TableRef.of(str(tmp_path / "scored"))
    assert [("flag" in b) for b in _bounds(ref)] == [True, True]
    whole = DeltaTable(ref.table_uri).to_pyarrow_table(filesystem=arrow_filesystem(ref))
    preds: list[Predicate] = [("flag", "=", True, None), ("flag", "=", False, None)]
    assert check_deltalake(ref, whole, preds, ID) == []
