"""Which versions a rollback undid (``history``'s statuses, and which runs the next rollback
lists as undone), and which partition a rollback is of: pure functions of the table's history
and the command line, tested on histories written out by hand."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from pipeline.core.errors import UsageError
from pipeline.driver.rollback import scope
from pipeline.driver.tables import Target, rolled_back, undoing
from pipeline.io import storage
from pipeline.sinks.delta.ops import DeltaTableOps
from pipeline.sinks.delta.table import TableRef
from pipeline.sinks.tables import VersionInfo

T0 = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)


def run(version: int, partition: str) -> VersionInfo:
    return VersionInfo(
        version, T0, "WRITE", f"run{version}", None, 10, partition, {}, "", "score-catalog"
    )


def restore(version: int, to: int, partition: str | None = None) -> VersionInfo:
    """A RESTORE of the whole table (``partition``: the partitions it changed)."""
    meta = {"restored_to": str(to)}
    return VersionInfo(version, T0, "RESTORE", None, None, None, partition, meta, "", None)


def partition_restore(version: int, to: int, partition: str) -> VersionInfo:
    meta = {"restored_to": str(to), "partition": partition}
    return VersionInfo(version, T0, "WRITE", None, None, None, partition, meta, "", None)


def undone(*infos: VersionInfo) -> dict[int, int]:
    """version -> the version of the rollback that undid it (``infos`` oldest first)."""
    return {v: by.version for v, by in rolled_back(list(reversed(infos))).items()}


def test_a_partition_rollback_undoes_only_its_partitions_runs() -> None:
    history = [run(1, "d=1"), run(2, "d=2"), run(3, "d=1"), run(4, "d=2")]
    assert undone(*history, partition_restore(5, 1, "d=1")) == {3: 5}
    # A RESTORE of the whole table undoes every later version, whichever partition it is of.
    assert undone(*history, restore(5, 1, "d=2,d=1")) == {2: 5, 3: 5, 4: 5}


def test_a_rollback_that_undoes_a_rollback_serves_its_runs_again() -> None:
    history = [run(1, "d=1"), run(2, "d=1"), partition_restore(3, 1, "d=1"), run(4, "d=2")]
    assert undone(*history) == {2: 3}
    # d=1 back to version 2: run 2 is served again, the rollback at 3 is what was undone.
    assert undone(*history, partition_restore(5, 2, "d=1")) == {3: 5}
    # The whole table back to version 2: the same for d=1, and d=2's run 4 undone too.
    assert undone(*history, restore(5, 2)) == {3: 5, 4: 5}
    # Back to before run 2 again: undone by the newest rollback that undid it.
    assert undone(*history, restore(5, 2), partition_restore(6, 1, "d=1")) == {2: 6, 3: 5, 4: 5}


def test_the_rollback_undoing_a_run_is_the_one_history_names_and_none_once_undone() -> None:
    history = [run(1, "d=1"), run(2, "d=2"), restore(3, 1, "d=2")]
    newest_first = list(reversed(history))
    assert undoing(newest_first, "run2") == history[2]
    assert undoing(newest_first, "run1") is None
    # Back to version 2, before the rollback: the table serves run 2 again (report's line).
    undo = restore(4, 2, "d=2")
    assert undoing([undo, *newest_first], "run2") is None
    assert undoing([partition_restore(4, 2, "d=2"), *newest_first], "run2") is None


def test_the_partition_is_the_folder_or_the_option_and_they_must_agree(tmp_path: Path) -> None:
    area = storage.locate(str(tmp_path / "_score_catalog"))
    table = Target(DeltaTableOps(TableRef.of(str(tmp_path / "scored"))), None, area)
    folder = Target(table.table, {"d": "1"}, area)
    assert scope(table, None) is None
    assert scope(table, {"d": "2"}) == {"d": "2"}
    assert scope(folder, None) == {"d": "1"}
    assert scope(folder, {"d": "1"}) == {"d": "1"}
    with pytest.raises(UsageError, match=r"--partition d=2 is not the partition OUTPUT points"):
        scope(folder, {"d": "2"})
