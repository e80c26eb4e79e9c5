"""A rollback of one partition of a Delta table (``deltatable.restore_partition``) and what a
rollback would change (``restore_changes``), on local disk with real delta-rs.

Data files are real Parquet files written the way a worker writes them (tests/delta_helpers.py);
what readers see is read back by deltalake's own reader and by Polars, and what was committed
from the commit files themselves. The S3 case is in tests/integration/test_deltatable_s3.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from pipeline.core.errors import AlreadyCommitted, UsageError
from pipeline.sinks.delta import table as delta
from pipeline.sinks.delta.stats import NewFile
from pipeline.sinks.delta.table import TableRef
from tests.delta_helpers import (
    PARTITION,
    SCHEMA,
    day,
    deltalake_rows,
    expected,
    polars_rows,
    rows,
    write_file,
)


@pytest.fixture
def ref(tmp_path: Path) -> TableRef:
    r = TableRef.of(str(tmp_path / "scored"))
    assert delta.ensure_table(r, SCHEMA, [PARTITION], allow_new_columns=False)
    return r


def _commit(
    ref: TableRef,
    adds: list[NewFile],
    removes: Sequence[str] = (),
    *,
    app: str = "job",
    v: int,
    schema: pa.Schema = SCHEMA,
) -> int:
    return delta.commit(
        ref,
        adds=adds,
        removes=list(removes),
        app_id=app,
        run_version=v,
        metadata={"run_id": f"{app}-{v}", "rows": str(sum(a.rows for a in adds))},
        expected_schema=schema,
    )


def _log(ref: TableRef, version: int) -> list[dict[str, Any]]:
    path = Path(ref.location.path) / "_delta_log" / f"{version:020d}.json"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _paths(ref: TableRef, partition: dict[str, str]) -> set[str]:
    return {f.path for f in delta.snapshot(ref, partition).files}


def _three_days(ref: TableRef) -> tuple[list[NewFile], list[NewFile]]:
    """v1: d1 by A (2 files), d2 by A; v2: d1 rescored by B (1 file); v3: d3 by A. Returns
    (d1's A files, d1's B files)."""
    a = [write_file(ref, rows(range(i, i + 20), "A"), day("d1"), row_group_rows=7) for i in (0, 20)]
    _commit(ref, [*a, write_file(ref, rows(range(100, 130), "A"), day("d2"))], v=1)
    b = [write_file(ref, rows(range(40), "B"), day("d1"))]
    _commit(ref, b, [f.path for f in a], v=2)
    _commit(ref, [write_file(ref, rows(range(200, 210), "A"), day("d3"))], app="other", v=1)
    return a, b


def test_a_partition_gets_its_files_back_as_they_were_and_nothing_else_moves(
    ref: TableRef,
) -> None:
    a, b = _three_days(ref)
    others = {d: _paths(ref, day(d)) for d in ("d2", "d3")}
    latest, changes = delta.restore_changes(ref, 1, day("d1"))
    [change] = changes
    assert latest == 3 and change.label == "run_date=d1"
    assert (change.rows_now, change.rows_then) == (40, 40)
    assert [f.path for f in change.removed] == [b[0].path]
    assert sorted(f.path for f in change.re_added) == sorted(f.path for f in a)

    assert delta.restore_partition(ref, 1, day("d1"), {"reason": "B is bad", "by": "me"}) == 4
    want = expected(
        {"d1": (range(40), "A"), "d2": (range(100, 130), "A"), "d3": (range(200, 210), "A")}
    )
    assert deltalake_rows(ref) == polars_rows(ref) == want
    assert {d: _paths(ref, day(d)) for d in ("d2", "d3")} == others

    # One commit: B's file removed, A's two added back exactly as version 1 added them (size,
    # partition values, modification time, stats), no txn.
    log = _log(ref, 4)
    assert sorted(next(iter(x)) for x in log) == ["add", "add", "commitInfo", "remove"]
    added = {x["add"]["path"]: x["add"] for x in log if "add" in x}
    original = {x["add"]["path"]: x["add"] for x in _log(ref, 1) if "add" in x}
    for path, add in added.items():
        keys = ("size", "partitionValues", "modificationTime")
        assert {k: add[k] for k in keys} == {k: original[path][k] for k in keys}
        assert json.loads(add["stats"]) == json.loads(original[path]["stats"])
    assert [x["remove"]["path"] for x in log if "remove" in x] == [b[0].path]
    info = next(x["commitInfo"] for x in log if "commitInfo" in x)
    assert info["score_catalog.restored_to"] == "1"
    assert info["score_catalog.partition"] == "run_date=d1"
    assert (info["score_catalog.files_added"], info["score_catalog.files_removed"]) == ("2", "1")
    assert (info["score_catalog.rows_added"], info["score_catalog.rows_removed"]) == ("40", "40")
    assert (info["score_catalog.reason"], info["score_catalog.by"]) == ("B is bad", "me")

    # The app's run version stands: run 2 (rolled back) is not committed again by a retry.
    assert DeltaTable(ref.table_uri).transaction_version("job") == 2
    with pytest.raises(AlreadyCommitted):
        _commit(ref, [write_file(ref, rows(range(40), "B"), day("d1"))], v=2)
    [entry] = delta.history(ref, 1)
    assert (entry.operation, entry.partition, entry.run_id) == ("WRITE", "run_date=d1", None)
    assert entry.detail == "restored run_date=d1 to version 1: 2 file(s) added back, 1 removed"

    # Again: d1 holds version 1's files already, so nothing is committed.
    assert delta.restore_partition(ref, 1, day("d1")) is None
    assert DeltaTable(ref.table_uri).version() == 4
    # The whole table at version 1 would differ only by d3 (d1 is version 1's again).
    _, whole = delta.restore_changes(ref, 1)
    assert [(c.label, c.changed, c.rows_now, c.rows_then) for c in whole] == [
        ("run_date=d1", False, 40, 40),
        ("run_date=d2", False, 30, 30),
        ("run_date=d3", True, 10, 0),
    ]
    with pytest.raises(UsageError, match="no partition column region"):
        delta.restore_partition(ref, 1, {"region": "eu"})
    with pytest.raises(UsageError, match="versions run from 0 to 4"):
        delta.restore_partition(ref, 4, day("d1"))


def test_a_file_a_vacuum_deleted_is_named_and_nothing_is_committed(ref: TableRef) -> None:
    a, _b = _three_days(ref)
    deleted = delta.vacuum(ref, 0, dry_run=False, force=True)
    assert sorted(deleted) == sorted(f.path for f in a)
    before = deltalake_rows(ref)
    with pytest.raises(UsageError, match=r"file\(s\) it would add back are gone") as refused:
        delta.restore_partition(ref, 1, day("d1"), {"reason": "x"})
    assert all(f"{f.path} (missing)" in str(refused.value) for f in a)
    assert "Nothing was committed" in str(refused.value)
    assert "deleted by hand, or by a VACUUM" in str(refused.value)
    assert "interval" not in str(refused.value)  # "30 days", as a person reads it
    # The plan (what a dry run prints) says so too, before anything is done.
    with pytest.raises(UsageError, match=r"file\(s\) it would add back are gone"):
        delta.restore_changes(ref, 1, day("d1"))
    assert DeltaTable(ref.table_uri).version() == 5  # 3 commits, VACUUM START and END
    assert deltalake_rows(ref) == polars_rows(ref) == before


def test_a_partition_that_never_existed_is_refused_naming_those_there_are(ref: TableRef) -> None:
    _three_days(ref)
    for refuse in (
        lambda: delta.restore_partition(ref, 1, day("d9"), {"reason": "typo"}),
        lambda: delta.restore_changes(ref, 1, day("d9")),
    ):
        with pytest.raises(UsageError, match="no partition run_date=d9, now or at version 1") as e:
            refuse()
        assert "run_date=d1, run_date=d2, run_date=d3" in str(e.value)
    assert DeltaTable(ref.table_uri).version() == 3
    created = next(i for i in delta.history(ref) if i.version == 0)
    assert created.detail == "created, partitioned by run_date"


def test_stats_come_from_the_checkpoint_once_older_commit_files_are_gone(ref: TableRef) -> None:
    a = [write_file(ref, rows(range(30), "A"), day("d1"))]
    _commit(ref, a, v=1)
    _commit(ref, [write_file(ref, rows(range(100, 110), "A"), day("d2"))], app="d2", v=1)
    DeltaTable(ref.table_uri).create_checkpoint()  # at version 2
    log = Path(ref.location.path) / "_delta_log"
    for v in (0, 1):  # as log cleanup does once they are past the log retention
        (log / f"{v:020d}.json").unlink()
    _commit(ref, [write_file(ref, rows(range(30), "B"), day("d1"))], [a[0].path], v=2)

    assert delta.restore_partition(ref, 2, day("d1")) == 4
    [add] = [x["add"] for x in _log(ref, 4) if "add" in x]
    assert add["path"] == a[0].path and json.loads(add["stats"]) == json.loads(a[0].stats)
    want = expected({"d1": (range(30), "A"), "d2": (range(100, 110), "A")})
    assert deltalake_rows(ref) == polars_rows(ref) == want


def test_a_column_gained_since_reads_as_null_and_a_lost_one_is_refused(ref: TableRef) -> None:
    wide = SCHEMA.append(pa.field("score0", pa.float32()))
    a = [write_file(ref, rows(range(20), "A"), day("d1"))]
    _commit(ref, [*a, write_file(ref, rows(range(100, 110), "A"), day("d2"))], v=1)
    delta.ensure_table(ref, wide, [PARTITION], allow_new_columns=True)  # version 2: ADD COLUMN
    b = rows(range(20), "B").append_column("score0", pa.array([0.5] * 20, pa.float32()))
    _commit(ref, [write_file(ref, b, day("d1"))], [a[0].path], v=2, schema=wide)
    assert delta.restore_schema(ref, 1) == (["score0"], [])

    assert delta.restore_partition(ref, 1, day("d1")) == 4
    frame = pl.scan_delta(ref.table_uri).collect()
    assert set(frame.columns) == {*wide.names, PARTITION}  # the schema stays the table's
    assert frame.filter(pl.col(PARTITION) == "d1")["model_version"].unique().to_list() == ["A"]
    assert frame["score0"].null_count() == frame.height == 30

    # The whole table back to version 1 reverts the schema; version 3's files then hold a
    # column the table no longer has: rolling d1 back to them is refused, nothing committed.
    delta.restore(ref, 1)
    assert delta.restore_schema(ref, 3)[1] == [
        "version 3 has column(s) 'score0', which the table no longer has (a rollback of the "
        "whole table reverted its schema since)"
    ]
    with pytest.raises(UsageError, match=r"column\(s\) 'score0', which the table no longer"):
        delta.restore_partition(ref, 3, day("d1"))
    assert DeltaTable(ref.table_uri).version() == 5


def test_a_file_removed_twice_is_vacuumed_and_listed_once(ref: TableRef) -> None:
    """A's files: removed by B (v2), added back by a rollback, removed again by C. delta-rs
    lists such a path twice (relative and absolute); the vacuum names each file once."""
    a, b = _three_days(ref)
    assert delta.restore_partition(ref, 1, day("d1"), {"reason": "B is bad"}) == 4
    c = [write_file(ref, rows(range(40), "C"), day("d1"))]
    _commit(ref, c, [f.path for f in a], v=3)
    deleted = delta.vacuum(ref, 0, dry_run=False, force=True)
    assert sorted(deleted) == sorted(f.path for f in [*a, *b])
    assert not any(Path(ref.location.path, f.path).exists() for f in [*a, *b])
    assert deltalake_rows(ref) == polars_rows(ref)
