"""An Iceberg table's ``optimize`` and ``vacuum`` (:mod:`pipeline.sinks.iceberg.maintenance`) on
real tables the real sink wrote (runs through the sink seam, as tests/sinks/test_contract.py
makes them; several small runs give several small files): a compaction is one ``replace``
snapshot that leaves the other partitions' files and every reader's rows as they were; a vacuum
deletes only the files of the snapshots it expires, never a file no snapshot listed, and keeps
the Delta table's retention rules.

Snapshots "hours ago" are made by shifting the clock pyiceberg stamps a new snapshot with
(``pyiceberg.table.snapshots.time``, read for nothing else); vacuum itself runs on the real
clock."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("pyiceberg")

import polars as pl
import pyiceberg.table.snapshots
from pyiceberg.partitioning import UNPARTITIONED_PARTITION_SPEC
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata, new_table_metadata
from pyiceberg.table.refs import SnapshotRef, SnapshotRefType
from pyiceberg.table.snapshots import Operation, Snapshot, SnapshotLogEntry, Summary
from pyiceberg.table.sorting import UNSORTED_SORT_ORDER

from pipeline.core.config import JobConfig
from pipeline.core.errors import CommitConflict, ConfigError, TableError, UsageError
from pipeline.io import storage
from pipeline.sinks.iceberg import catalog, commit, maintenance
from pipeline.sinks.iceberg.catalog import IcebergRef
from pipeline.sinks.iceberg.schema import iceberg_schema
from tests.sinks.test_contract import Output, ids_of, run, shards

# Polars 2.1 warns on every Iceberg scan that it plans with pyiceberg (warnings fail tests).
os.environ.setdefault("POLARS_ICEBERG_PLANNER", "pyiceberg")

DAY1, DAY2 = "2026-12-01", "2026-12-02"
BY = {"by": "tester"}


class _Clock:
    """``time`` as pyiceberg's snapshots read it, ``hours`` behind the real one."""

    def __init__(self, hours: float) -> None:
        self.hours = hours

    def time(self) -> float:
        return time.time() - self.hours * 3600


@dataclasses.dataclass
class Scored:
    """A table the real sink wrote, one partition per day."""

    tmp: Path
    clock: _Clock

    def output(self, day: str) -> Output:
        config = JobConfig(
            input=str(self.tmp / "in"),
            output=str(self.tmp / "scored" / "run_date={date}"),
            model="m",
            format="iceberg",
            date=day,
            name="nightly",
        )
        return Output("iceberg", config, self.tmp / "scored")

    def run(self, day: str, found: dict[str, range], run_id: str, hours_ago: float = 0) -> int:
        """One run of the day's partition, its snapshot stamped ``hours_ago``; its id."""
        self.clock.hours = hours_ago
        try:
            run(self.output(day), found, run_id)
        finally:
            self.clock.hours = 0
        snap = self.table().current_snapshot()
        assert snap is not None
        return snap.snapshot_id

    @property
    def ref(self) -> IcebergRef:
        table_ref = self.output(DAY1).sink("any").table
        assert isinstance(table_ref, IcebergRef)
        return table_ref

    def table(self) -> Table:
        table = catalog.load(self.ref)
        assert table is not None
        return table

    def files(self, day: str) -> set[str]:
        """The data files (relative paths) of the day's partition in the current snapshot."""
        return {
            self.ref.rel(t.file.file_path)
            for t in self.table().scan(row_filter=f"run_date == '{day}'").plan_files()
        }

    def on_disk(self) -> set[str]:
        root = Path(self.ref.location.path)
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def scored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Scored:
    clock = _Clock(0)
    monkeypatch.setattr(pyiceberg.table.snapshots, "time", clock)
    return Scored(tmp_path, clock)


def _rows(table: Table, day: str, snapshot_id: int | None = None) -> list[tuple[Any, ...]]:
    """The day's rows as pyiceberg's scan returns them, checked equal to Polars's with a
    partition filter (one answer from both readers), sorted."""
    got = table.scan(row_filter=f"run_date == '{day}'", snapshot_id=snapshot_id).to_arrow()
    columns = [got.column(c).to_pylist() for c in ("item_id", "score", "run_date")]
    mine = sorted(zip(*columns, strict=True))
    frame = (
        pl.scan_iceberg(table, snapshot_id=snapshot_id)
        .filter(pl.col("run_date") == day)
        .select("item_id", "score", "run_date")
        .collect()
    )
    assert sorted(frame.iter_rows()) == mine
    return mine


# --------------------------------------------------------------------------- optimize


def test_optimize_compacts_one_partition_in_one_replace_snapshot_with_the_same_rows(
    scored: Scored,
) -> None:
    scored.run(DAY1, shards(3), "r1")
    scored.run(DAY2, shards(2), "r2")
    scored.run(DAY1, shards(4, start=1), "r3")  # 4 new files, the 3 of r1 replaced
    table = scored.table()
    before = {day: _rows(table, day) for day in (DAY1, DAY2)}
    day1, day2 = scored.files(DAY1), scored.files(DAY2)
    assert len(day1) == 4 and len(day2) == 2
    snapshots = len(table.snapshots())

    done = maintenance.optimize(table, {"run_date": DAY1}, None, BY)

    assert done["numFilesRemoved"] == 4 and done["numFilesAdded"] == 1
    table = scored.table()
    assert len(table.snapshots()) == snapshots + 1
    snap = table.current_snapshot()
    assert snap is not None and snap.summary is not None
    assert snap.sequence_number == done["version"] and snap.snapshot_id == done["snapshot_id"]
    assert snap.summary.operation.value == "replace"
    assert snap.summary["score_catalog.operation"] == "OPTIMIZE"
    assert snap.summary["score_catalog.by"] == "tester"
    assert snap.summary["score_catalog.compacted"] == "4 into 1"
    assert snap.summary["added-records"] == snap.summary["deleted-records"] == "36"
    assert scored.files(DAY2) == day2  # untouched
    (new,) = scored.files(DAY1)
    assert new.startswith(f"run_date={DAY1}/compacted-") and new.endswith(".parquet")
    assert {day: _rows(table, day) for day in (DAY1, DAY2)} == before
    # The file is written as the sink writes its files: no partition column, no field ids,
    # the sources' rows in their order, one after the other.
    written = pq.read_table(Path(scored.ref.location.path) / new)
    assert "run_date" not in written.column_names
    assert all(b"PARQUET:field_id" not in (f.metadata or {}) for f in written.schema)
    sources = [pq.read_table(Path(scored.ref.location.path) / p) for p in sorted(day1)]
    assert written.column("item_id").to_pylist() == [
        i for s in sources for i in s.column("item_id").to_pylist()
    ]
    assert sorted(written.column("item_id").to_pylist()) == ids_of(shards(4, start=1))


def test_optimize_of_every_partition_and_of_nothing_to_compact(scored: Scored) -> None:
    scored.run(DAY1, shards(3), "r1")
    scored.run(DAY2, shards(2), "r2")
    table = scored.table()
    before = {day: _rows(table, day) for day in (DAY1, DAY2)}
    # Files at least the target are left alone: nothing to compact, no snapshot.
    assert maintenance.optimize(table, None, 1, BY) == {"numFilesRemoved": 0, "numFilesAdded": 0}
    assert len(scored.table().snapshots()) == 2

    done = maintenance.optimize(table, None, None, BY)
    assert (done["numFilesRemoved"], done["numFilesAdded"]) == (5, 2)
    table = scored.table()
    assert len(table.snapshots()) == 3
    assert len(scored.files(DAY1)) == len(scored.files(DAY2)) == 1
    assert {day: _rows(table, day) for day in (DAY1, DAY2)} == before
    # Nothing left to compact: a second optimize changes nothing.
    assert maintenance.optimize(table, None, None, BY)["numFilesAdded"] == 0
    assert len(scored.table().snapshots()) == 3


def test_optimize_refuses_a_column_the_table_is_not_partitioned_by(scored: Scored) -> None:
    scored.run(DAY1, shards(2), "r1")
    with pytest.raises(UsageError, match=r"no partition column dt .*run_date"):
        maintenance.optimize(scored.table(), {"dt": DAY1}, None, BY)


def test_a_compacted_file_gets_the_stats_a_runs_file_gets_and_no_bounds_where_a_nan_is(
    tmp_path: Path,
) -> None:
    """The compacted file's ``DataFile`` is built as a run's commit builds its files': bounds
    from the footer, none for a float column that held a NaN (in any source)."""
    output = pa.schema([("item_id", pa.int64()), ("score", pa.float32())])
    root = storage.locate(str(tmp_path / "scored"))
    ref = IcebergRef.of(root, storage.locate(str(tmp_path / "_score_catalog" / "scored")))
    catalog.ensure_table(ref, iceberg_schema(ref.uri, output, ["dt"]), ["dt"], {})
    adds = []
    for k, nan in enumerate((False, True, False)):
        rel = f"dt={DAY1}/f{k}.parquet"
        ids = range(10 * k, 10 * k + 5)
        scores = [float("nan") if nan and i == ids.start else i / 10 for i in ids]
        (tmp_path / "scored" / f"dt={DAY1}").mkdir(parents=True, exist_ok=True)
        path = tmp_path / "scored" / rel
        pq.write_table(
            pa.table({"item_id": list(ids), "score": pa.array(scores, pa.float32())}), path
        )
        adds.append(commit.NewFile(rel, path.stat().st_size, 5, ("score",) if nan else ()))
    run_ = commit.RunCommit({"dt": DAY1}, adds, (), "app", 1, {"run_id": "r1"})
    commit.commit(ref, run_, iceberg_schema(ref.uri, output, ["dt"]))
    table = catalog.load(ref)
    assert table is not None
    filters = ("score >= 2.0", "score < 1.2", "item_id == 12", "score == 0.1")
    before = [table.scan(row_filter=f).to_arrow().num_rows for f in filters]
    assert before == [5, 6, 1, 1]
    assert maintenance.optimize(table, {"dt": DAY1}, None, BY)["numFilesAdded"] == 1
    table = catalog.load(ref)
    assert table is not None
    (task,) = table.scan().plan_files()
    schema = table.schema()
    item, score = schema.find_field("item_id").field_id, schema.find_field("score").field_id
    assert task.file.record_count == 15
    assert item in task.file.lower_bounds and item in task.file.upper_bounds
    assert score not in task.file.lower_bounds and score not in task.file.upper_bounds
    # Filters find the rows they found before.
    assert [table.scan(row_filter=f).to_arrow().num_rows for f in filters] == before


def test_an_optimize_that_another_commit_overtakes_commits_nothing_and_leaves_no_file(
    scored: Scored, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run on the partition lands between optimize's read and its commit (the table lock
    keeps runs out; another writer is not bound by it): the commit is refused by pyiceberg's
    serializable check, and the compacted file is deleted again."""
    scored.run(DAY1, shards(3), "r1")
    table = scored.table()

    def point(name: str) -> None:
        if name == "iceberg-optimize-before-commit":
            scored.run(DAY1, shards(3, start=1), "r2")

    monkeypatch.setattr(maintenance, "checkpoint", point)
    with pytest.raises(CommitConflict, match="Nothing was committed; run optimize again"):
        maintenance.optimize(table, {"run_date": DAY1}, None, BY)
    assert len(scored.table().snapshots()) == 2
    assert not [p for p in scored.on_disk() if "compacted-" in p]
    assert [r[0] for r in _rows(scored.table(), DAY1)] == ids_of(shards(3, start=1))


# --------------------------------------------------------------------------- vacuum


def _history(scored: Scored) -> dict[str, int]:
    """Day 1 rewritten 60, 50, 30 h ago and now, day 2 written 45 h ago: snapshot ids."""
    return {
        "a": scored.run(DAY1, shards(2), "ra", hours_ago=60),
        "b": scored.run(DAY1, shards(2, start=1), "rb", hours_ago=50),
        "x": scored.run(DAY2, shards(2), "rx", hours_ago=45),
        "c": scored.run(DAY1, shards(2, start=2), "rc", hours_ago=30),
        "d": scored.run(DAY1, shards(2, start=3), "rd"),
    }


def _listed(scored: Scored, snapshot_id: int) -> set[str]:
    table = scored.table()
    return {
        scored.ref.rel(t.file.file_path) for t in table.scan(snapshot_id=snapshot_id).plan_files()
    }


def test_vacuum_refuses_a_retention_shorter_than_the_tables_unless_forced(scored: Scored) -> None:
    _history(scored)
    table = scored.table()
    loc = scored.ref.location
    for dry_run in (True, False):
        with pytest.raises(UsageError, match=r"40 h refused: the table keeps snapshots 30 days"):
            maintenance.vacuum(table, loc, {}, 40, dry_run, False, BY)
    with pytest.raises(UsageError, match="-1 h is negative"):
        maintenance.vacuum(table, loc, {}, -1, True, True, BY)
    # The default (30 days): every snapshot is younger, nothing to do.
    assert maintenance.vacuum(table, loc, {}, None, False, False, BY) == []
    assert len(scored.table().snapshots()) == 5


def test_vacuum_dry_run_lists_the_files_only_expired_snapshots_list_and_deletes_nothing(
    scored: Scored,
) -> None:
    ids = _history(scored)
    on_disk = scored.on_disk()
    found = maintenance.vacuum(scored.table(), scored.ref.location, {}, 40, True, True, BY)
    # Expired: a and b (older than 40 h); x was current 40 h ago and stays, so b's files
    # (removed 30 h ago, within the window) stay: only a's go.
    assert found == sorted(_listed(scored, ids["a"]))
    assert scored.on_disk() == on_disk
    assert len(scored.table().snapshots()) == 5


def test_vacuum_deletes_the_files_of_expired_snapshots_only(scored: Scored) -> None:
    ids = _history(scored)
    table = scored.table()
    kept = {k: _rows(table, DAY1, ids[k]) for k in ("x", "c", "d")}
    day2 = _rows(table, DAY2)
    files = {k: _listed(scored, i) for k, i in ids.items()}
    stray = Path(scored.ref.location.path) / f"run_date={DAY1}" / "part-9-00000000-rz.parquet"
    pq.write_table(pa.table({"item_id": [1]}), stray)  # a run in flight: no snapshot lists it
    manifest_lists = {k: table.metadata.snapshot_by_id(i).manifest_list for k, i in ids.items()}  # type: ignore[union-attr]

    deleted = maintenance.vacuum(table, scored.ref.location, {}, 40, False, True, BY)

    assert deleted == sorted(files["a"])
    on_disk = scored.on_disk()
    assert not files["a"] & on_disk
    assert files["b"] | files["x"] | files["c"] | files["d"] <= on_disk
    assert stray.exists()
    table = scored.table()
    assert {s.snapshot_id for s in table.snapshots()} == {ids[k] for k in "xcd"}
    for k, path in manifest_lists.items():
        assert Path(path.removeprefix("file://")).exists() == (k in "xcd")
    # The table reads as before, now and at every snapshot kept.
    assert {k: _rows(table, DAY1, ids[k]) for k in ("x", "c", "d")} == kept
    assert _rows(table, DAY2) == day2
    # Time travel to an expired snapshot fails, naming it (pyiceberg and Polars alike).
    with pytest.raises(ValueError, match=f"Snapshot not found: {ids['a']}"):
        table.scan(snapshot_id=ids["a"]).to_arrow()
    with pytest.raises(ValueError, match=f"snapshot ID not found: {ids['b']}"):
        pl.scan_iceberg(table, snapshot_id=ids["b"]).collect()
    record = json.loads(table.properties[maintenance.LAST_VACUUM_PROPERTY])
    assert record["by"] == "tester" and record["snapshots_expired"] == "2"
    assert record["files_deleted"] == "2" and record["retention_hours"] == "40"
    # Again: nothing left to expire.
    assert maintenance.vacuum(table, scored.ref.location, {}, 40, False, True, BY) == []


def test_vacuum_keeps_the_table_retention_property(scored: Scored) -> None:
    """``history.expire.max-snapshot-age-ms`` is the table's retention: the default when no
    retention is given, the shortest one allowed without --force; a value that is not a number
    is named."""
    ids = _history(scored)
    table = scored.table()
    with table.transaction() as tx:
        tx.set_properties({maintenance.RETENTION_PROPERTY: str(40 * 3_600_000)})
    table = scored.table()
    with pytest.raises(UsageError, match="keeps snapshots 40 h"):
        maintenance.vacuum(table, scored.ref.location, {}, 39, True, False, BY)
    assert maintenance.vacuum(table, scored.ref.location, {}, None, True, False, BY) == sorted(
        _listed(scored, ids["a"])
    )
    with table.transaction() as tx:
        tx.set_properties({maintenance.RETENTION_PROPERTY: "5 days"})
    with pytest.raises(ConfigError, match="not a number of milliseconds"):
        maintenance.vacuum(scored.table(), scored.ref.location, {}, None, True, False, BY)


def test_a_vacuum_stopped_before_its_expiry_commit_is_finished_by_the_next(
    scored: Scored, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files go before the snapshots that list them: a vacuum stopped in between leaves the
    old snapshots in the metadata, and the next vacuum expires them (their files already
    gone) without failing on what is missing."""
    ids = _history(scored)
    files_a = _listed(scored, ids["a"])

    def stop(name: str) -> None:
        if name == "iceberg-vacuum-before-expire":
            raise KeyboardInterrupt

    monkeypatch.setattr(maintenance, "checkpoint", stop)
    with pytest.raises(KeyboardInterrupt):
        maintenance.vacuum(scored.table(), scored.ref.location, {}, 40, False, True, BY)
    assert not files_a & scored.on_disk()
    assert len(scored.table().snapshots()) == 5  # not expired yet
    monkeypatch.setattr(maintenance, "checkpoint", lambda name: None)
    assert maintenance.vacuum(scored.table(), scored.ref.location, {}, 40, False, True, BY) == []
    assert {s.snapshot_id for s in scored.table().snapshots()} == {ids[k] for k in "xcd"}
    assert _rows(scored.table(), DAY1) == _rows(scored.table(), DAY1, ids["d"])


def test_a_file_a_partition_rollback_added_back_is_kept(scored: Scored) -> None:
    """Reachability decides, not an expired snapshot's delete entries: a's files, removed 50 h
    ago, are listed again by a commit that rolled day 1 back to a (made here with the run's
    producer, as a partition rollback makes it), and stay."""
    ids = _history(scored)
    table = scored.table()
    back = [
        t.file
        for t in table.scan(row_filter=f"run_date == '{DAY1}'", snapshot_id=ids["a"]).plan_files()
    ]
    now = [t.file for t in table.scan(row_filter=f"run_date == '{DAY1}'").plan_files()]
    tx = table.transaction()
    with commit.LeanOverwrite(
        operation=Operation.OVERWRITE, transaction=tx, io=table.io
    ) as producer:
        for f in now:
            producer.delete_data_file(f)
        for f in back:
            producer.append_data_file(f)
    tx.commit_transaction()
    rolled = _rows(scored.table(), DAY1)
    assert rolled == _rows(scored.table(), DAY1, ids["a"])

    deleted = maintenance.vacuum(scored.table(), scored.ref.location, {}, 40, False, True, BY)

    assert deleted == []  # a's files are the current snapshot's; b's are x's
    assert {s.snapshot_id for s in scored.table().snapshots()} >= {ids[k] for k in "xcd"}
    assert ids["a"] not in {s.snapshot_id for s in scored.table().snapshots()}
    assert _rows(scored.table(), DAY1) == rolled


# --------------------------------------------------------------------------- the rule


@st.composite
def _histories(draw: st.DrawFn) -> tuple[list[int], list[frozenset[str]], int]:
    """A main branch's snapshots: commit times (ms, increasing), the files each lists (some
    removed and added back later), and a cutoff among them."""
    n = draw(st.integers(1, 8))
    gaps = draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    times = [sum(gaps[: i + 1]) * 1000 for i in range(n)]
    files = draw(st.lists(st.frozensets(st.sampled_from("abcdef")), min_size=n, max_size=n))
    # At, just before or just after a commit: the boundaries are where the rules could part.
    cutoff = draw(st.sampled_from([0, *times, times[-1] + 1000])) + draw(
        st.sampled_from([-1, 0, 1])
    )
    return times, files, cutoff


def _metadata(times: list[int], files: list[frozenset[str]]) -> TableMetadata:
    snaps = [
        Snapshot(
            snapshot_id=i + 1,
            parent_snapshot_id=i or None,
            sequence_number=i + 1,
            timestamp_ms=t,
            manifest_list=f"snap-{i}.avro",
            summary=Summary(Operation.OVERWRITE),
        )
        for i, t in enumerate(times)
    ]
    empty = new_table_metadata(
        Schema(), UNPARTITIONED_PARTITION_SPEC, UNSORTED_SORT_ORDER, "file:///t", {}
    )
    return empty.model_copy(
        update={
            "snapshots": snaps,
            "current_snapshot_id": len(snaps),
            "snapshot_log": [
                SnapshotLogEntry(snapshot_id=s.snapshot_id, timestamp_ms=s.timestamp_ms)
                for s in snaps
            ],
            "refs": {
                "main": SnapshotRef(
                    snapshot_id=len(snaps), snapshot_ref_type=SnapshotRefType.BRANCH
                )
            },
        }
    )


@settings(max_examples=300, deadline=None)
@given(_histories())
def test_what_vacuum_deletes_is_what_delta_deletes(
    history: tuple[list[int], list[frozenset[str]], int],
) -> None:
    """Delta's lite vacuum deletes a file the table no longer holds whose last removal is older
    than the cutoff; expiring the snapshots older than it but the one current at the cutoff,
    then deleting what only expired snapshots list, deletes exactly those files."""
    times, files, cutoff = history
    expired = maintenance._expired(_metadata(times, files), cutoff, 1)
    ours = set().union(*(files[i - 1] for i in expired)) - set().union(
        *(f for i, f in enumerate(files, 1) if i not in expired)
    )
    removed_at: dict[str, int] = {}
    for before, after, t in zip(files, files[1:], times[1:], strict=False):
        for f in before - after:
            removed_at[f] = t  # the last removal wins
    delta = {f for f, t in removed_at.items() if t < cutoff and f not in files[-1]}
    assert ours == delta
    assert len(files) not in expired  # the current snapshot always stays


def test_optimize_names_a_file_the_table_lists_that_is_gone(scored: Scored) -> None:
    scored.run(DAY1, shards(3), "r1")
    gone = sorted(scored.files(DAY1))[1]
    (Path(scored.ref.location.path) / gone).unlink()
    with pytest.raises(TableError, match=f"1 file.* missing .*{gone}.*Nothing was committed"):
        maintenance.optimize(scored.table(), None, None, BY)
    assert len(scored.table().snapshots()) == 1
    assert not [p for p in scored.on_disk() if "compacted-" in p]
