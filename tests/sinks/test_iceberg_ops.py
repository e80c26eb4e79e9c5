"""An Iceberg table's history and rollback behind ``TableOps`` (:mod:`pipeline.sinks.iceberg.ops`):
versions are snapshots' sequence numbers, a partition's rollback is ONE new snapshot that
touches no other partition, a whole-table rollback is one new snapshot too (and can itself be
rolled back), the run tokens stand, and a file that is gone is refused before anything is
committed. How a command finds the table (``locate_table``) too.

Tables are real: an embedded SQLite catalog, real Parquet files, each run committed by the
sink's own commit (:func:`pipeline.sinks.iceberg.commit.commit`); what readers see is read back
by pyiceberg's scan and by Polars ``scan_iceberg``, filtered by partition. The same through the
real CLI: tests/integration/test_iceberg_rollback.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("pyiceberg")

from pyiceberg.table import Table

from pipeline.core.errors import AlreadyCommitted, NotATableError, UsageError
from pipeline.io import storage
from pipeline.sinks import locate_table
from pipeline.sinks.iceberg import catalog, commit
from pipeline.sinks.iceberg.catalog import IcebergRef
from pipeline.sinks.iceberg.commit import NewFile, RunCommit
from pipeline.sinks.iceberg.ops import IcebergTableOps
from pipeline.sinks.iceberg.schema import evolve, iceberg_schema

# Polars plans an Iceberg scan with pyiceberg unless its plugin is installed, and warns each
# time (an error under this suite's filterwarnings).
os.environ.setdefault("POLARS_ICEBERG_PLANNER", "pyiceberg")

OUTPUT = pa.schema([("item_id", pa.int64()), ("score", pa.float32()), ("model", pa.string())])
D1, D2, D3 = "2026-12-01", "2026-12-02", "2026-12-03"


@pytest.fixture
def ref(tmp_path: Path) -> IcebergRef:
    root = storage.locate(str(tmp_path / "scored"))
    ref = IcebergRef.of(root, storage.locate(str(tmp_path / "_score_catalog" / "scored")))
    catalog.ensure_table(ref, iceberg_schema(ref.uri, OUTPUT, ["dt"]), ["dt"], {})
    return ref


@pytest.fixture
def ops(ref: IcebergRef) -> IcebergTableOps:
    return IcebergTableOps(ref)


def _file(ref: IcebergRef, day: str, name: str, ids: range, model: str) -> NewFile:
    rel = f"dt={day}/{name}.parquet"
    path = Path(ref.location.path) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "item_id": list(ids),
        "score": pa.array([i / 10 for i in ids], pa.float32()),
        "model": [model] * len(ids),
    }
    pq.write_table(pa.table(data), path)
    return NewFile(rel, path.stat().st_size, len(ids))


def _commit(
    ref: IcebergRef,
    day: str,
    adds: list[NewFile],
    version: int,
    removes: tuple[str, ...] = (),
    schema: pa.Schema = OUTPUT,
) -> int:
    """A run's snapshot of ``day``, as the sink commits it; its sequence number."""
    run = RunCommit(
        partition={"dt": day},
        adds=adds,
        removes=removes,
        app_id=f"score-catalog/job/dt={day}",
        run_version=version,
        summary={
            "run_id": f"{day}-r{version}",
            "partition": f"dt={day}",
            "rows": str(sum(a.rows for a in adds)),
            "job": "job",
            "model_sha256": f"sha-{adds[0].path[-9:-8] if adds else '-'}",
        },
    )
    return commit.commit(ref, run, iceberg_schema(ref.uri, schema, ["dt"]))[0]


def _table(ref: IcebergRef) -> Table:
    table = catalog.load(ref)
    assert table is not None
    return table


def day_rows(ref: IcebergRef, day: str, snapshot_id: int | None = None) -> list[tuple[Any, ...]]:
    """A day's rows by pyiceberg's scan with a row filter, and by Polars with a filter: the
    same rows, or the test fails here."""
    import polars as pl

    table = _table(ref)
    got = table.scan(row_filter=f"dt == '{day}'", snapshot_id=snapshot_id).to_arrow()
    mine = sorted(got.select(["item_id", "model", "dt"]).to_pylist(), key=lambda r: r["item_id"])
    mine_rows = [tuple(r.values()) for r in mine]
    frame = (
        pl.scan_iceberg(table, snapshot_id=snapshot_id)
        .filter(pl.col("dt") == day)
        .select("item_id", "model", "dt")
        .collect()
    )
    assert sorted(frame.iter_rows()) == mine_rows
    return mine_rows


def want(day: str, ids: range, model: str) -> list[tuple[Any, ...]]:
    return [(i, model, day) for i in ids]


def _paths(ref: IcebergRef, day: str) -> set[str]:
    table = _table(ref)
    return {
        ref.rel(t.file.file_path, table.metadata.location)
        for t in table.scan(row_filter=f"dt == '{day}'").plan_files()
    }


def _three_days(ref: IcebergRef) -> tuple[list[NewFile], list[NewFile]]:
    """v1: d1 by A (2 files); v2: d2 by A; v3: d1 rescored by B (1 file); v4: d3 by A.
    Returns (d1's A files, d1's B files)."""
    a = [_file(ref, D1, f"a{i}", range(i, i + 20), "A") for i in (0, 20)]
    assert _commit(ref, D1, a, 1) == 1
    assert _commit(ref, D2, [_file(ref, D2, "a", range(100, 130), "A")], 1) == 2
    b = [_file(ref, D1, "b", range(40), "B")]
    assert _commit(ref, D1, b, 2, removes=tuple(f.path for f in a)) == 3
    assert _commit(ref, D3, [_file(ref, D3, "a", range(200, 210), "A")], 1) == 4
    return a, b


def test_history_is_one_version_per_snapshot_numbered_by_sequence_number(
    ref: IcebergRef, ops: IcebergTableOps
) -> None:
    _three_days(ref)
    infos = ops.history()
    assert [i.version for i in infos] == [4, 3, 2, 1]
    assert [i.run_id for i in infos] == [f"{D3}-r1", f"{D1}-r2", f"{D2}-r1", f"{D1}-r1"]
    assert {i.operation for i in infos} == {"WRITE"}
    newest = infos[0]
    assert (newest.partition, newest.rows, newest.model_sha256) == (f"dt={D3}", 10, "sha-a")
    assert newest.metadata["app_id"] == f"score-catalog/job/dt={D3}"
    assert newest.metadata["app_version"] == "1" and "score_catalog.rows" not in newest.metadata
    assert infos[1].detail == "1 file(s) added, 2 removed"
    snaps = {s.sequence_number: s for s in _table(ref).snapshots()}
    assert newest.timestamp.timestamp() * 1000 == pytest.approx(snaps[4].timestamp_ms)
    assert [i.version for i in ops.history(limit=2)] == [4, 3]


def test_a_partition_rolls_back_alone_in_one_snapshot_and_the_tokens_stand(
    ref: IcebergRef, ops: IcebergTableOps
) -> None:
    a, b = _three_days(ref)
    others = {d: _paths(ref, d) for d in (D2, D3)}
    latest, changes = ops.restore_changes(1, {"dt": D1})
    [change] = changes
    assert latest == 4 and change.label == f"dt={D1}"
    assert (change.rows_now, change.rows_then) == (40, 40)
    assert [f.path for f in change.removed] == [b[0].path]
    assert sorted(f.path for f in change.re_added) == sorted(f.path for f in a)
    before = len(_table(ref).snapshots())

    meta = {"reason": "B is bad", "by": "me", "rolled_back_runs": f"{D1}-r2"}
    assert ops.restore_partition(1, {"dt": D1}, meta) == 5
    table = _table(ref)
    assert len(table.snapshots()) == before + 1  # one new snapshot
    assert day_rows(ref, D1) == want(D1, range(40), "A")
    assert day_rows(ref, D2) == want(D2, range(100, 130), "A")
    assert day_rows(ref, D3) == want(D3, range(200, 210), "A")
    assert {d: _paths(ref, d) for d in (D2, D3)} == others
    assert _paths(ref, D1) == {f.path for f in a}
    summary = table.current_snapshot().summary  # type: ignore[union-attr]
    assert summary is not None
    assert summary["changed-partition-count"] == "1"
    assert summary["score_catalog.restored_to"] == "1"
    assert summary["score_catalog.partition"] == f"dt={D1}"
    assert (summary["score_catalog.reason"], summary["score_catalog.by"]) == ("B is bad", "me")
    assert (summary["score_catalog.files_added"], summary["score_catalog.files_removed"]) == (
        "2",
        "1",
    )
    assert (summary["score_catalog.rows_added"], summary["score_catalog.rows_removed"]) == (
        "40",
        "40",
    )
    [entry] = ops.history(limit=1)
    assert (entry.operation, entry.partition, entry.run_id) == ("WRITE", f"dt={D1}", None)
    assert entry.detail == f"restored dt={D1} to version 1: 2 file(s) added back, 1 removed"

    # The run token stands: B's run (version 2) is not committed again; the next run is 3.
    assert table.properties[f"score_catalog.txn.score-catalog/job/dt={D1}"] == "2"
    with pytest.raises(AlreadyCommitted):
        _commit(ref, D1, [_file(ref, D1, "b-again", range(40), "B")], 2)
    c = [_file(ref, D1, "c", range(40), "C")]
    assert _commit(ref, D1, c, 3, removes=tuple(f.path for f in a)) == 6
    assert day_rows(ref, D1) == want(D1, range(40), "C")

    # Back to version 5 (the rollback's own snapshot): A's files again; then nothing to do.
    assert ops.restore_partition(5, {"dt": D1}, {}) == 7
    assert day_rows(ref, D1) == want(D1, range(40), "A")
    assert ops.restore_partition(5, {"dt": D1}, {}) is None
    assert len(_table(ref).snapshots()) == 7


def test_the_whole_table_rolls_back_as_a_new_snapshot_that_can_itself_be_undone(
    ref: IcebergRef, ops: IcebergTableOps
) -> None:
    _three_days(ref)
    at_4 = {d: day_rows(ref, d) for d in (D1, D2, D3)}
    _, changes = ops.restore_changes(2, None)
    assert [(c.label, c.changed, c.rows_now, c.rows_then) for c in changes] == [
        (f"dt={D1}", True, 40, 40),
        (f"dt={D2}", False, 30, 30),
        (f"dt={D3}", True, 10, 0),
    ]
    assert ops.restore(2, {"reason": "start over"}, [f"dt={D1}", f"dt={D3}"]) == 5
    assert day_rows(ref, D1) == want(D1, range(40), "A")
    assert day_rows(ref, D2) == at_4[D2]
    assert day_rows(ref, D3) == []
    [entry] = ops.history(limit=1)
    assert (entry.operation, entry.detail) == ("RESTORE", "restored version 2")
    assert entry.partition == f"dt={D1},dt={D3}" and entry.metadata["reason"] == "start over"
    # Every state is still in the history, and readable there.
    assert [i.version for i in ops.history()] == [5, 4, 3, 2, 1]
    snap_4 = next(s for s in _table(ref).snapshots() if s.sequence_number == 4)
    assert day_rows(ref, D3, snap_4.snapshot_id) == at_4[D3]

    # Undo the rollback: version 4 again, as a sixth snapshot.
    assert ops.restore(4, {"reason": "undo"}, []) == 6
    assert {d: day_rows(ref, d) for d in (D1, D2, D3)} == at_4
    # A whole table that holds its version's files already still gets its snapshot.
    assert ops.restore(4, {}, []) == 7
    assert {d: day_rows(ref, d) for d in (D1, D2, D3)} == at_4


def test_a_file_that_is_gone_is_named_and_nothing_is_committed(
    ref: IcebergRef, ops: IcebergTableOps
) -> None:
    a, _b = _three_days(ref)
    (Path(ref.location.path) / a[0].path).unlink()
    before = day_rows(ref, D1)
    for refuse in (
        lambda: ops.restore_partition(1, {"dt": D1}, {"reason": "x"}),
        lambda: ops.restore_changes(1, {"dt": D1}),  # what a dry run prints: refused too
        lambda: ops.restore(1, {}, []),
    ):
        with pytest.raises(UsageError, match=r"file\(s\) it would add back are gone") as e:
            refuse()
        assert f"{a[0].path} (missing)" in str(e.value) and a[1].path not in str(e.value)
        assert "Nothing was committed" in str(e.value)
    assert len(_table(ref).snapshots()) == 4 and day_rows(ref, D1) == before


def test_versions_partitions_and_columns_that_do_not_exist_are_refused(
    ref: IcebergRef, ops: IcebergTableOps
) -> None:
    _three_days(ref)
    for refuse in (
        lambda: ops.restore_partition(1, {"dt": "2026-12-09"}, {"reason": "typo"}),
        lambda: ops.restore_changes(1, {"dt": "2026-12-09"}),
    ):
        with pytest.raises(UsageError, match="no partition dt=2026-12-09, now or at versi") as e:
            refuse()
        assert f"dt={D1}, dt={D2}, dt={D3}" in str(e.value)
    with pytest.raises(UsageError, match="no partition column region"):
        ops.restore_partition(1, {"region": "eu"}, {})
    with pytest.raises(UsageError, match="is the latest version"):
        ops.restore_partition(4, {"dt": D1}, {})
    with pytest.raises(UsageError, match=r"no version 9 .*its versions now: 1 to 4"):
        ops.restore(9, {}, [])
    with pytest.raises(UsageError, match="no column 'nope'"):
        ops.read(None, None, ["nope"])
    assert len(_table(ref).snapshots()) == 4


def test_read_gives_a_version_of_a_partition(ref: IcebergRef, ops: IcebergTableOps) -> None:
    _three_days(ref)
    old = ops.read(1, {"dt": D1}, ["item_id", "model"])
    assert old.column_names == ["item_id", "model"]
    assert sorted(old.column("item_id").to_pylist()) == list(range(40))
    assert set(old.column("model").to_pylist()) == {"A"}
    now = ops.read(None, {"dt": D1}, None)
    assert set(now.column("model").to_pylist()) == {"B"} and now.num_rows == 40
    assert ops.read(None, None, ["item_id"]).num_rows == 40 + 30 + 10


def test_a_column_gained_since_reads_as_null_in_the_rows_restored(
    ref: IcebergRef, ops: IcebergTableOps
) -> None:
    a = [_file(ref, D1, "a", range(20), "A")]
    _commit(ref, D1, a, 1)
    wide = OUTPUT.append(pa.field("score2", pa.float32()))
    evolve(ref.uri, _table(ref), wide, ["dt"])
    path = Path(ref.location.path) / f"dt={D1}" / "b.parquet"
    data = {
        "item_id": list(range(20)),
        "score": pa.array([0.5] * 20, pa.float32()),
        "model": ["B"] * 20,
        "score2": pa.array([1.5] * 20, pa.float32()),
    }
    pq.write_table(pa.table(data), path)
    b = NewFile(f"dt={D1}/b.parquet", path.stat().st_size, 20)
    _commit(ref, D1, [b], 2, removes=(a[0].path,), schema=wide)
    assert ops.restore_schema(1) == (["score2"], [])
    assert ops.restore_partition(1, {"dt": D1}, {}) == 3
    rows = _table(ref).scan().to_arrow()
    assert rows.column("score2").null_count == rows.num_rows == 20  # the schema stays
    assert set(rows.column("model").to_pylist()) == {"A"}
    assert not ops.schema_reverts


def test_a_command_finds_the_table_from_its_folder_a_partition_or_its_job_file(
    ref: IcebergRef, tmp_path: Path
) -> None:
    _three_days(ref)
    found = locate_table(ref.uri)
    assert isinstance(found.table, IcebergTableOps) and found.partition is None
    assert found.table.kind == "Iceberg table"
    assert found.area.path == str(tmp_path / "_score_catalog" / "scored")
    part = locate_table(f"{ref.uri}/dt={D2}")
    assert part.partition == {"dt": D2} and part.label == f"dt={D2}"
    job = tmp_path / "nightly.toml"
    job.write_text(
        f'input = "{tmp_path}/in/dt={{date}}"\noutput = "{ref.uri}/dt={{date}}"\n'
        'model = "m"\nformat = "iceberg"\n'
    )
    by_job = locate_table(str(job))
    assert isinstance(by_job.table, IcebergTableOps) and by_job.partition is None
    assert [i.version for i in by_job.table.history()] == [4, 3, 2, 1]

    # A folder with Iceberg metadata but no table in this tool's catalog: said so.
    foreign = tmp_path / "foreign" / "metadata"
    foreign.mkdir(parents=True)
    (foreign / "00000-x.metadata.json").write_text("{}")
    with pytest.raises(NotATableError, match="not a table score-catalog made"):
        locate_table(str(tmp_path / "foreign"))
    with pytest.raises(NotATableError, match="nor an Iceberg metadata/"):
        locate_table(str(tmp_path / "nothing"))


@st.composite
def histories(draw: st.DrawFn) -> list[tuple[str, int]]:
    """Runs on three days, in any order: (day, rows) each, 2 to 6 of them."""
    return draw(
        st.lists(
            st.tuples(st.sampled_from([D1, D2, D3]), st.integers(1, 30)), min_size=2, max_size=6
        )
    )


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(runs=histories(), data=st.data())
def test_any_rollback_gives_each_day_the_rows_it_must_hold(
    runs: list[tuple[str, int]], data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """For any history of runs, a day rolled back to any earlier version holds exactly its rows
    of then and every other day its rows of now; the whole table rolled back holds every day's
    rows of then; each in one new snapshot, read by pyiceberg and Polars alike."""
    tmp = tmp_path_factory.mktemp("history")
    root = storage.locate(str(tmp / "scored"))
    ref = IcebergRef.of(root, storage.locate(str(tmp / "_score_catalog" / "scored")))
    catalog.ensure_table(ref, iceberg_schema(ref.uri, OUTPUT, ["dt"]), ["dt"], {})
    ops = IcebergTableOps(ref)
    states: dict[int, dict[str, list[tuple[Any, ...]]]] = {}
    held: dict[str, tuple[str, ...]] = {}
    versions: dict[str, int] = {}
    for k, (day, n) in enumerate(runs):
        versions[day] = versions.get(day, 0) + 1
        new = _file(ref, day, f"r{k}", range(1000 * k, 1000 * k + n), f"m{k}")
        seq = _commit(ref, day, [new], versions[day], removes=held.get(day, ()))
        held[day] = (new.path,)
        states[seq] = {d: day_rows(ref, d) for d in (D1, D2, D3)}
    latest = len(runs)
    to = data.draw(st.integers(1, latest - 1), label="to")
    day = data.draw(st.sampled_from([D1, D2, D3]), label="day")
    now = states[latest]
    if not now[day] and not states[to][day]:
        with pytest.raises(UsageError, match="no partition"):
            ops.restore_partition(to, {"dt": day}, {})
    else:
        done = ops.restore_partition(to, {"dt": day}, {})
        changed = now[day] != states[to][day]
        assert done == (latest + 1 if changed else None)
        for d in (D1, D2, D3):
            assert day_rows(ref, d) == (states[to][d] if d == day else now[d])
    top = len(_table(ref).snapshots())
    assert ops.restore(to, {}, []) == top + 1
    assert {d: day_rows(ref, d) for d in (D1, D2, D3)} == states[to]
