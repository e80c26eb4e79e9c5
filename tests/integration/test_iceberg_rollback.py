"""``score-catalog history`` and ``rollback`` of an Iceberg table (``format = "iceberg"``, no
catalog configured) through the real CLI: a three-day backfill, one day rescored with another
model, that day rolled back to its earlier scores in ONE new snapshot while the other days stay
exactly as they are, for pyiceberg and Polars filtered by day; a dry run that changes nothing; a
rollback that needs a file that is gone, refused with nothing changed; a rescore of the
rolled-back day that commits; and the whole table rolled back, and that rollback undone.

Runs are real processes (``tests.integration.helpers.cli``); the table is found through the
catalog and identifier the run's report names, and read back here with ``test_iceberg_run``'s
helpers (pyiceberg ``scan`` with a row filter, and Polars ``scan_iceberg`` with a filter: one
answer, or the test fails).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyiceberg")

from pyiceberg.table import Table

from pipeline.io import storage
from pipeline.io.locking import RunLock
from pipeline.sinks.tables import table_lock_root
from tests.integration import test_iceberg_run as iceberg_run
from tests.integration.helpers import cli, report
from tests.integration.test_iceberg_run import DAYS, check_day, day_rows, table_of

# test_iceberg_run's fixtures: two model bundles (module scope) and a three-day archive.
models = iceberg_run.models
archive = iceberg_run.archive

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # about 10 CLI runs each

D1, D2, D3 = DAYS
JOB = "nightly"


@pytest.fixture
def job(tmp_path: Path, archive: Path, models: dict[str, Path]) -> Path:
    """The archive scored with model 1 into an Iceberg table, no catalog configured; drift on,
    so that a rollback's records for the next run's drift are made and read too."""
    path = tmp_path / f"{JOB}.toml"
    path.write_text(
        f'name = "{JOB}"\ninput = "{archive}/dt={{date}}"\n'
        f'output = "{tmp_path / "scored"}/dt={{date}}"\n'
        f'model = "{models["1"]}"\nformat = "iceberg"\nscheduler = "sync"\nbatch_size = 512\n'
        "[monitoring]\ndrift = true\n"
    )
    return path


def _run(job: Path, day: str, model: Path | None = None) -> str:
    """Score ``day`` (with ``model``, else the job's); its run id. A drift alert (exit 4) is a
    finished run too: whether the two models differ past the thresholds is not tested here."""
    done = cli("run", str(job), "--date", day, *(["--model", str(model)] if model else []))
    assert done.returncode in (0, 4), done.output
    return str(done.report["run_id"] if done.report else "")


def _backfill(job: Path, out: Path) -> Table:
    done = cli("backfill", str(job), "--from", D1, "--to", D3)
    assert done.returncode in (0, 4), done.output
    return table_of(report(out / f"dt={D1}")["output_format"])


def history(where: Path) -> dict[int, dict[str, Any]]:
    shown = cli("history", str(where), "--json")
    assert shown.returncode == 0, shown.output
    return {r["version"]: r for r in json.loads(shown.stdout)}


def versions_by_day(table: Table) -> dict[str, int]:
    """day -> the sequence number of its newest run's snapshot."""
    out: dict[str, int] = {}
    for snap in sorted(table.snapshots(), key=lambda s: s.sequence_number or 0):
        summary = snap.summary.additional_properties if snap.summary else {}
        if "score_catalog.run_id" in summary:
            day = summary["score_catalog.partition"].split("=", 1)[1]
            out[day] = int(snap.sequence_number or 0)
    return out


def every_day(table: Table) -> dict[str, list[Any]]:
    return {d: day_rows(table, d).to_pylist() for d in DAYS}


def test_a_day_rolls_back_alone_in_one_snapshot_and_its_rescore_commits(
    tmp_path: Path, archive: Path, models: dict[str, Path], job: Path
) -> None:
    out = tmp_path / "scored"
    table = _backfill(job, out)
    assert len(table.snapshots()) == 3
    after_backfill = every_day(table)
    run_ids = {d: report(out / f"dt={d}")["run_id"] for d in DAYS}
    b2 = _run(job, D2, models["2"])
    table = table.refresh()
    by_day = versions_by_day(table)
    assert by_day[D2] == 4 and len(table.snapshots()) == 4
    check_day(table, archive, models["2"], D2, "2")

    # history: one version per snapshot, numbered by sequence number, with each run's id.
    versions = history(out)
    assert sorted(versions) == [1, 2, 3, 4]
    assert versions[4]["run_id"] == b2 and versions[4]["status"].startswith("committed")
    assert {versions[by_day[d]]["run_id"] for d in (D1, D3)} == {run_ids[D1], run_ids[D3]}
    assert all(v["operation"] == "WRITE" for v in versions.values())
    assert "Iceberg table" in cli("history", str(out)).stdout

    # A dry run prints the plan and changes nothing.
    dry = cli("rollback", str(out / f"dt={D2}"), "--to-version", "3", "--dry-run")
    assert dry.returncode == 0, dry.output
    assert f"would roll partition dt={D2} of {out} back to version 3 (it is at 4)" in dry.stdout
    assert f"dt={D2}: 2,000 rows -> 2,000 rows (replaced: 2 file(s) out, 2 back)" in dry.stdout
    assert f"undoes run(s) {b2} (version 4)" in dry.stdout
    assert len(table.refresh().snapshots()) == 4

    back = cli("rollback", str(out / f"dt={D2}"), "--to-version", "3", "--reason", "model 2 bad")
    assert back.returncode == 0, back.output
    assert f"rolled partition dt={D2} of {out} back to version 3 as version 5" in back.stdout
    table = table.refresh()
    assert len(table.snapshots()) == 5  # exactly one new snapshot
    summary = table.current_snapshot().summary  # type: ignore[union-attr]
    assert summary is not None and summary["changed-partition-count"] == "1"
    assert every_day(table) == after_backfill  # day 2 has model 1's scores again, row for row
    check_day(table, archive, models["1"], D2, "1")
    for day in (D1, D3):
        check_day(table, archive, models["1"], day, "1")
    versions = history(out)
    assert versions[5]["status"] == "restore" and versions[5]["partition"] == f"dt={D2}"
    assert versions[5]["restored_to"] == 3 and versions[5]["reason"] == "model 2 bad"
    assert versions[4]["status"] == "rolled back (version 5)"
    assert 5 not in history(out / f"dt={D1}")
    shown = cli("report", str(out / f"dt={D2}"))
    assert shown.stdout.startswith(f"ROLLED BACK: rollback of partition dt={D2} to version 3 ")

    # Back to version 4 would add model 2's files back: one is gone, so it is refused.
    gone = sorted(p for p in (out / f"dt={D2}").glob(f"*{b2}.parquet"))
    assert len(gone) == 2
    gone[0].unlink()
    refused = cli("rollback", str(out / f"dt={D2}"), "--to-version", "4", "--reason", "redo")
    assert refused.returncode == 2, refused.output
    assert "file(s) it would add back are gone or changed" in refused.output
    assert f"{gone[0].name} (missing)" in refused.output
    assert "Nothing was committed" in refused.output
    table = table.refresh()
    assert len(table.snapshots()) == 5 and every_day(table) == after_backfill

    # Day 2 rescored with model 2: scored again, a new run version, one new snapshot.
    b2_again = _run(job, D2, models["2"])
    table = table.refresh()
    assert len(table.snapshots()) == 6
    summary = table.current_snapshot().summary  # type: ignore[union-attr]
    assert summary is not None
    assert (summary["score_catalog.run_id"], summary["score_catalog.app_version"]) == (
        b2_again,
        "3",
    )
    rep = report(out / f"dt={D2}")
    assert rep["rows_processed"] == 2000 and rep["output_format"]["version"] == 6
    # Its drift compares with what day 2 held after the rollback: model 1's run, as restored.
    [record] = (tmp_path / "_score_catalog" / "scored" / "_runs" / JOB / "_rollbacks").iterdir()
    rollback = json.loads(record.read_text())
    assert [(p["partition"], p["run_id"]) for p in rollback["partitions"]] == [
        (f"dt={D2}", run_ids[D2])
    ]
    assert rep["drift"]["baseline"]["run_id"] == run_ids[D2]
    assert rep["drift"]["baseline"]["finished_at"] == rollback["at"]
    check_day(table, archive, models["2"], D2, "2")
    for day in (D1, D3):
        check_day(table, archive, models["1"], day, "1")


def test_the_whole_table_rolls_back_as_one_snapshot_and_that_can_be_undone(
    tmp_path: Path, archive: Path, models: dict[str, Path], job: Path
) -> None:
    out = tmp_path / "scored"
    table = _backfill(job, out)
    first = next(d for d, v in versions_by_day(table).items() if v == 1)
    at_3 = every_day(table)

    back = cli("rollback", str(job), "--to-version", "1", "--reason", "start over")
    assert back.returncode == 0, back.output
    assert f"rolled {out} back to version 1 as version 4" in back.stdout
    assert "rows -> 0 rows (removed: it held nothing then)" in back.stdout
    table = table.refresh()
    assert len(table.snapshots()) == 4
    now = every_day(table)
    assert now[first] == at_3[first]
    assert all(now[d] == [] for d in DAYS if d != first)
    versions = history(out)
    assert versions[4]["operation"] == "RESTORE" and versions[4]["restored_to"] == 1
    assert {versions[v]["status"] for v in (2, 3)} == {"rolled back (version 4)"}
    # Every earlier state is still readable at its snapshot.
    snap_3 = next(s for s in table.snapshots() if s.sequence_number == 3)
    assert {d: day_rows(table, d, snap_3.snapshot_id).to_pylist() for d in DAYS} == at_3

    # The locks Delta's rollback takes: refused while a run holds a partition's lock, and a
    # run refused while the table lock is held; nothing changed either way.
    area = storage.locate(str(tmp_path / "_score_catalog" / "scored"))
    running = RunLock.acquire(area.child(f"dt={D2}"), "a-run", stale_after_s=3600)
    try:
        busy = cli("rollback", str(out), "--to-version", "3", "--reason", "undo")
        assert busy.returncode == 1 and "in progress" in busy.output, busy.output
    finally:
        running.release()
    held = RunLock.acquire(table_lock_root(area), "rollback-by-hand", stale_after_s=3600)
    try:
        refused = cli("run", str(job), "--date", D2)
        assert refused.returncode == 1 and "rollback-by-hand" in refused.output, refused.output
    finally:
        held.release()
    assert len(table.refresh().snapshots()) == 4

    # The rollback is a version like any other: rolling back to 3 undoes it.
    undo = cli("rollback", str(out), "--to-version", "3", "--reason", "undo")
    assert undo.returncode == 0, undo.output
    table = table.refresh()
    assert len(table.snapshots()) == 5 and every_day(table) == at_3
    for day in DAYS:
        check_day(table, archive, models["1"], day, "1")
