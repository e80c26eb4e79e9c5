"""The Iceberg commit (:mod:`pipeline.sinks.iceberg.commit`) where pyiceberg's own retries could
land a run twice: a duplicate of the run landing between its token check and its catalog swap
(pyiceberg retries the stale attempt on the new table; the token requirement refuses it inside
that retry), a commit whose answer was lost, and another partition's commit landing in between
(rebased, both kept). Real tables in an embedded SQLite catalog, real Parquet files.

The duplicate tests run twice: as the SQL catalog commits (the token requirement checked in its
swap) and as a REST catalog's commit is staged (no requirement of this tool's: it cannot travel
over REST). The SQL catalog checks pyiceberg's own ``assert-ref-snapshot-id`` in its swap as a
REST server does, so the second run shows what keeps a REST commit from landing twice: the token
checked on the very table version each attempt is built on, and that assertion."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("pyiceberg")

from pyiceberg.table import Table, Transaction

from pipeline.core.errors import AlreadyCommitted, CommitRefused
from pipeline.io import storage
from pipeline.sinks.iceberg import catalog, commit
from pipeline.sinks.iceberg.catalog import IcebergRef
from pipeline.sinks.iceberg.commit import NewFile, RunCommit, TokenAlreadyCommitted
from pipeline.sinks.iceberg.schema import iceberg_schema

OUTPUT = pa.schema([("item_id", pa.int64()), ("score", pa.float32())])


@pytest.fixture
def ref(tmp_path: Path) -> IcebergRef:
    root = storage.locate(str(tmp_path / "scored"))
    ref = IcebergRef.of(root, storage.locate(str(tmp_path / "_score_catalog" / "scored")))
    catalog.ensure_table(ref, iceberg_schema(ref.uri, OUTPUT, ["dt"]), ["dt"], {})
    return ref


def _file(ref: IcebergRef, day: str, name: str, ids: range, nan: bool = False) -> NewFile:
    rel = f"dt={day}/{name}.parquet"
    path = Path(ref.location.path) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    scores = [float("nan") if nan and i == ids.start else i / 10 for i in ids]
    pq.write_table(pa.table({"item_id": list(ids), "score": pa.array(scores, pa.float32())}), path)
    return NewFile(rel, path.stat().st_size, len(ids), ("score",) if nan else ())


def _run(day: str, adds: list[NewFile], version: int, removes: tuple[str, ...] = ()) -> RunCommit:
    return RunCommit(
        partition={"dt": day},
        adds=adds,
        removes=removes,
        app_id=f"score-catalog/job/dt={day}",
        run_version=version,
        summary={"run_id": f"r{version}"},
    )


def _commit(ref: IcebergRef, run: RunCommit) -> tuple[int, int]:
    return commit.commit(ref, run, iceberg_schema(ref.uri, OUTPUT, ["dt"]))


def _table(ref: IcebergRef) -> Table:
    table = catalog.load(ref)
    assert table is not None
    return table


def _ids(ref: IcebergRef, day: str) -> list[int]:
    rows = _table(ref).scan(row_filter=f"dt == '{day}'").to_arrow()
    return sorted(rows.column("item_id").to_pylist())


def _with_tokens(ref: IcebergRef, app_id: str) -> list[str]:
    return [
        str(s.summary["score_catalog.app_version"])
        for s in _table(ref).snapshots()
        if s.summary is not None and s.summary["score_catalog.app_id"] == app_id
    ]


def _before_swap(monkeypatch: pytest.MonkeyPatch, action: Callable[[], Any]) -> None:
    """Run ``action`` once, when the first commit attempt has staged its transaction on the
    table it loaded and is about to swap (the ``iceberg-before-commit`` point)."""
    done: list[bool] = []

    def point(name: str) -> None:
        if name == "iceberg-before-commit" and not done:
            done.append(True)
            action()

    monkeypatch.setattr(commit, "checkpoint", point)


@pytest.fixture(params=["sql", "as-over-rest"])
def staging(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the commit is staged: with the token requirement (the SQL catalog), or without it,
    as for a REST catalog (the same real SQL catalog underneath)."""
    if request.param == "as-over-rest":
        monkeypatch.setattr(catalog, "is_sql", lambda _ref: False)
    return str(request.param)


def test_a_duplicate_that_lands_before_the_swap_is_refused_by_the_catalog(
    ref: IcebergRef, monkeypatch: pytest.MonkeyPatch, staging: str
) -> None:
    run = _run("2026-12-01", [_file(ref, "2026-12-01", "a", range(5))], 1)
    # The duplicate (a second process resuming the same run) lands between this attempt's
    # token check and its swap. SQL: the catalog checks the token requirement against the
    # table it swaps, and refuses. As over REST: the duplicate moved main, so the swap refuses
    # the attempt's assert-ref-snapshot-id; pyiceberg reloads to retry, and the producer finds
    # the token on the reloaded table.
    _before_swap(monkeypatch, lambda: _commit(ref, run))
    monkeypatch.setattr(time, "sleep", lambda _s: None)
    with pytest.raises(AlreadyCommitted, match="is not committed again") as excinfo:
        _commit(ref, run)
    assert isinstance(excinfo.value.__context__, TokenAlreadyCommitted)
    assert _with_tokens(ref, run.app_id) == ["1"]
    assert _ids(ref, "2026-12-01") == list(range(5))  # once, not twice


def test_a_duplicate_that_lands_during_pyicebergs_retry_is_refused_there(
    ref: IcebergRef,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    staging: str,
) -> None:
    """Another partition's commit makes the attempt stale; while pyiceberg waits to retry it
    on the new table, the duplicate lands: the retried attempt is refused inside pyiceberg's
    loop (the producer checks the token on the table it rebases on; SQL: the requirement
    too), not by this tool's own loop around it (no "again")."""
    run = _run("2026-12-01", [_file(ref, "2026-12-01", "a", range(5))], 1)
    other = _run("2026-12-02", [_file(ref, "2026-12-02", "b", range(100, 103))], 1)
    _before_swap(monkeypatch, lambda: _commit(ref, other))
    real_sleep = time.sleep
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        if not slept:  # pyiceberg's first back-off: the duplicate lands now
            slept.append(seconds)
            _commit(ref, run)
        real_sleep(0)

    monkeypatch.setattr(time, "sleep", sleep)
    with (
        caplog.at_level(logging.INFO),
        pytest.raises(AlreadyCommitted, match="is not committed again") as excinfo,
    ):
        _commit(ref, run)
    assert any("retrying (1/" in r.getMessage() for r in caplog.records)
    assert not any("; again" in r.getMessage() for r in caplog.records)
    assert isinstance(excinfo.value.__context__, TokenAlreadyCommitted)
    assert _with_tokens(ref, run.app_id) == ["1"]
    assert _ids(ref, "2026-12-01") == list(range(5))
    assert _ids(ref, "2026-12-02") == list(range(100, 103))


def test_a_commit_whose_answer_was_lost_is_found_landed(
    ref: IcebergRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Transaction.commit_transaction

    def lost(self: Transaction) -> Table:
        real(self)
        raise ConnectionError("the answer was lost")

    monkeypatch.setattr(Transaction, "commit_transaction", lost)
    run = _run("2026-12-01", [_file(ref, "2026-12-01", "a", range(5))], 1)
    sequence, snapshot_id = _commit(ref, run)
    table = _table(ref)
    assert table.current_snapshot() is not None
    assert snapshot_id == table.current_snapshot().snapshot_id  # type: ignore[union-attr]
    assert sequence == 1
    with pytest.raises(AlreadyCommitted):
        _commit(ref, run)
    assert _with_tokens(ref, run.app_id) == ["1"]


def test_another_partitions_commit_in_between_is_rebased_and_both_stay(
    ref: IcebergRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _run("2026-12-01", [_file(ref, "2026-12-01", "a", range(5))], 1)
    _commit(ref, first)
    other = _run("2026-12-02", [_file(ref, "2026-12-02", "b", range(100, 103))], 1)
    again = _run(
        "2026-12-01",
        [_file(ref, "2026-12-01", "c", range(10, 14))],
        2,
        removes=("dt=2026-12-01/a.parquet",),
    )
    _before_swap(monkeypatch, lambda: _commit(ref, other))
    _commit(ref, again)
    assert _ids(ref, "2026-12-01") == list(range(10, 14))
    assert _ids(ref, "2026-12-02") == list(range(100, 103))
    table = _table(ref)
    assert len(table.snapshots()) == 3
    summary = table.current_snapshot().summary  # type: ignore[union-attr]
    assert summary is not None and summary["score_catalog.app_version"] == "2"
    assert summary["deleted-data-files"] == "1" and summary["added-data-files"] == "1"


def test_a_file_that_is_not_what_its_worker_said_is_refused_before_anything_lands(
    ref: IcebergRef,
) -> None:
    good = _file(ref, "2026-12-01", "a", range(5))
    lying = NewFile(good.path, good.size, 6)
    with pytest.raises(CommitRefused, match="5 rows, the worker reported 6"):
        _commit(ref, _run("2026-12-01", [lying], 1))
    elsewhere = NewFile("dt=2026-12-02/x.parquet", 1, 1)
    with pytest.raises(CommitRefused, match="not in its partition's folder"):
        _commit(ref, _run("2026-12-01", [elsewhere], 1))
    assert _table(ref).current_snapshot() is None


def test_a_column_holding_a_nan_has_no_bounds(ref: IcebergRef) -> None:
    _commit(ref, _run("2026-12-01", [_file(ref, "2026-12-01", "a", range(5), nan=True)], 1))
    (task,) = _table(ref).scan().plan_files()
    score = _table(ref).schema().find_field("score").field_id
    item = _table(ref).schema().find_field("item_id").field_id
    assert score not in (task.file.lower_bounds or {})
    assert score not in (task.file.upper_bounds or {})
    assert item in task.file.lower_bounds
