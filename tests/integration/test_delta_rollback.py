"""``score-catalog rollback`` of one partition of a Delta table, and of the whole table, through
the real CLI (issue 29): days scored by model A, one day rescored by model B, that day rolled
back to A's scores while the other days stay exactly as they are, for every reader; the whole
table's rollback names each partition it would remove before it acts; drift baselines, history
and reports follow the partition; a retry of the undone run's commit is still refused.

Runs are real processes (``tests.integration.helpers.cli``); the table is read back in this
process with deltalake (over a pyarrow filesystem of ours: its default one aborts at exit now
and then) and Polars ``scan_delta``, every column of every row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from pipeline.cli.demo import export_bundle
from pipeline.core.errors import AlreadyCommitted
from pipeline.sinks.delta import table as delta
from pipeline.sinks.delta.table import TableRef
from pipeline.sinks.naming import app_id_of
from tests.conftest import demo_toml, make_model, write_shards
from tests.delta_helpers import arrow_filesystem
from tests.integration.helpers import cli, report

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # 12 CLI runs: about a minute here

D1, D2, D3 = "2025-03-01", "2025-03-02", "2025-03-03"
JOB = "nightly"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model A and model B: the demo MLP with seeds 0 and 1 (different scores), versions A, B."""
    out = {}
    for seed, name in enumerate("AB"):
        d = tmp_path_factory.mktemp(f"model{name}")
        export_bundle(make_model(seed=seed), d, demo_toml(version=name), n_in=16)
        out[name] = d
    return out


def _job(tmp_path: Path, bundles: dict[str, Path]) -> Path:
    archive = tmp_path / "archive"
    for k, day in enumerate((D1, D2, D3)):
        write_shards(archive / f"dt={day}", [1200, 800], row_group_rows=500, start=10_000 * k)
    job = tmp_path / f"{JOB}.toml"
    job.write_text(
        f'name = "{JOB}"\ninput = "{archive}/dt={{date}}"\n'
        f'output = "{tmp_path}/scored/dt={{date}}"\n'
        f'model = "{bundles["A"]}"\nformat = "delta"\nscheduler = "sync"\nbatch_size = 512\n'
        "[monitoring]\ndrift = true\n"
    )
    return job


def _run(job: Path, day: str, model: Path | None = None) -> str:
    """Score ``day`` (with ``model``, else the job's); its run id. A drift alert (exit 4) is a
    finished run too: whether A and B differ past the thresholds is not what is tested here."""
    done = cli("run", str(job), "--date", day, *(["--model", str(model)] if model else []))
    assert done.returncode in (0, 4), done.output
    return str(done.report["run_id"] if done.report else "")


def table_rows(ref: TableRef, version: int | None = None) -> dict[str, list[tuple[Any, ...]]]:
    """day -> every row of it (every column, sorted), by deltalake and by Polars: both readers
    give the same rows, or the test fails here."""
    table = DeltaTable(ref.table_uri, version=version).to_pyarrow_table(
        filesystem=arrow_filesystem(ref)
    )
    cols = sorted(table.column_names)
    by_deltalake = sorted(tuple(r[c] for c in cols) for r in table.select(cols).to_pylist())
    frame = pl.scan_delta(ref.table_uri, version=version).select(cols).collect()
    by_polars = sorted(frame.iter_rows())
    assert by_polars == by_deltalake
    at = cols.index("dt")
    out: dict[str, list[tuple[Any, ...]]] = {}
    for row in by_deltalake:
        out.setdefault(row[at], []).append(row)
    return out


def version_of(ref: TableRef) -> int:
    return int(DeltaTable(ref.table_uri).version())


def history(where: Path) -> dict[int, dict[str, Any]]:
    shown = cli("history", str(where), "--json")
    assert shown.returncode == 0, shown.output
    return {r["version"]: r for r in json.loads(shown.stdout)}


def test_a_partition_rolls_back_alone_and_drift_history_and_reports_follow_it(
    tmp_path: Path, bundles: dict[str, Path]
) -> None:
    job = _job(tmp_path, bundles)
    out = tmp_path / "scored"
    ref = TableRef.of(str(out))
    a1 = _run(job, D1)
    v1 = version_of(ref)
    a2 = _run(job, D2)
    b1 = _run(job, D1, bundles["B"])
    v3 = version_of(ref)
    assert (v1, v3) == (1, 3)
    at_v1, at_v3 = table_rows(ref, v1), table_rows(ref, v3)
    assert at_v1[D1] != at_v3[D1]  # model B's scores are not model A's

    # Day 1 back to version 1 (A's scores), named by its folder as a new user would.
    back = cli("rollback", str(out / f"dt={D1}"), "--to-version", "1", "--reason", "model B bad")
    assert back.returncode == 0, back.output
    assert version_of(ref) == 4
    now = table_rows(ref)
    assert set(now) == {D1, D2}  # day 2 is still there
    assert now[D2] == at_v3[D2]  # exactly as it was
    assert now[D1] == at_v1[D1]  # exactly A's scores, row for row
    assert f"rolling partition dt={D1} of {out} back to version 1 (it is at 3)" in back.stdout
    assert f"dt={D1}: 2,000 rows -> 2,000 rows (replaced: 2 file(s) out, 2 back)" in back.stdout
    assert f"undoes run(s) {b1} (version 3)" in back.stdout
    assert f"rolled partition dt={D1} of {out} back to version 1 as version 4" in back.stdout
    assert f"dt={D2}" not in back.stdout

    # The undone run's token stands: a retry of its commit is refused, nothing written.
    app_id = app_id_of(JOB, {"dt": D1})
    assert DeltaTable(ref.table_uri).transaction_version(app_id) == 2
    with pytest.raises(AlreadyCommitted):
        delta.commit(
            ref,
            adds=[],
            removes=[],
            app_id=app_id,
            run_version=2,
            metadata={"run_id": b1},
            expected_schema=pa.schema([]),
        )
    assert version_of(ref) == 4

    # History and reports: only day 1's run B counts as rolled back.
    versions = history(out)
    assert versions[4]["status"] == "restore" and versions[4]["partition"] == f"dt={D1}"
    assert versions[4]["restored_to"] == 1 and versions[4]["reason"] == "model B bad"
    assert versions[3]["status"] == "rolled back (version 4)" and versions[3]["run_id"] == b1
    assert versions[2]["status"] == "committed" and versions[2]["run_id"] == a2
    assert versions[1]["status"] == "committed" and versions[1]["run_id"] == a1
    assert 4 not in history(out / f"dt={D2}")
    shown = cli("report", str(out / f"dt={D1}"))
    assert shown.returncode == 0, shown.output
    assert shown.stdout.startswith(f"ROLLED BACK: rollback of partition dt={D1} to version 1 ")
    other = cli("report", str(out / f"dt={D2}"))
    assert other.returncode == 0 and "ROLLED BACK" not in other.stdout, other.output
    [record] = (tmp_path / "_score_catalog" / "scored" / "_runs" / JOB / "_rollbacks").iterdir()
    rollback = json.loads(record.read_text())
    assert (rollback["scope"], rollback["partition"]) == ("partition", f"dt={D1}")
    assert rollback["rolled_back"] == [b1]
    assert [(p["partition"], p["run_id"]) for p in rollback["partitions"]] == [(f"dt={D1}", a1)]

    # A new day's first version compares with the day before it, not with day 1 for having
    # been restored lately.
    a3 = _run(job, D3)
    assert report(out / f"dt={D3}")["drift"]["baseline"]["run_id"] == a2

    # The whole table back to version 1 would remove days 2 and 3: a dry run names them with
    # their rows, leaves day 1 (unchanged) out, and changes nothing.
    before = table_rows(ref)
    dry = cli("rollback", str(out), "--to-version", "1", "--dry-run")
    assert dry.returncode == 0, dry.output
    assert (
        f"would roll the whole table {out} (RESTORE) back to version 1 (it is at 5)" in dry.stdout
    )
    assert f"dt={D2}: 2,000 rows -> 0 rows" in dry.stdout
    assert f"dt={D3}: 2,000 rows -> 0 rows" in dry.stdout
    assert f"dt={D1}:" not in dry.stdout and "1 other partition(s) unchanged" in dry.stdout
    assert f"undoes run(s) {a3} (version 5), {a2} (version 2)" in dry.stdout
    assert version_of(ref) == 5 and table_rows(ref) == before

    # Day 1 rescored with model B: scored again (its B files are no longer in the table), a new
    # run version, and its drift compares with what day 1 holds now: A's scores, as restored.
    b1_again = _run(job, D1, bundles["B"])
    assert version_of(ref) == 6
    last = DeltaTable(ref.table_uri).history(1)[0]
    assert (last["score_catalog.run_id"], last["score_catalog.app_version"]) == (b1_again, "3")
    assert table_rows(ref)[D1] == at_v3[D1]
    rep = report(out / f"dt={D1}")
    assert rep["rows_processed"] == 2000 and rep["verdict"]["reused"] is False
    assert rep["drift"]["baseline"]["run_id"] == a1
    assert rep["drift"]["baseline"]["finished_at"] == rollback["at"]  # the restored scores
    # Day 2's baseline is still its own run with model A.
    _run(job, D2, bundles["B"])
    assert report(out / f"dt={D2}")["drift"]["baseline"]["run_id"] == a2


def test_a_whole_table_rollback_names_what_it_removes_before_it_acts(
    tmp_path: Path, bundles: dict[str, Path]
) -> None:
    job = _job(tmp_path, bundles)
    out = tmp_path / "scored"
    ref = TableRef.of(str(out))
    _run(job, D1)
    a2 = _run(job, D2)
    at_v1 = table_rows(ref, 1)

    back = cli("rollback", str(job), "--to-version", "1", "--reason", "start over")
    assert back.returncode == 0, back.output
    lines = back.stdout.splitlines()
    named = next(i for i, x in enumerate(lines) if x.strip().startswith(f"dt={D2}: 2,000 rows"))
    done = next(i for i, x in enumerate(lines) if x.startswith(f"rolled {out} back to version 1"))
    assert named < done, back.stdout  # listed first, then done
    assert f"dt={D2}: 2,000 rows -> 0 rows (removed: it held nothing then)" in lines[named]
    assert "to roll back one partition alone" not in back.stdout  # there is only one
    assert version_of(ref) == 3 and table_rows(ref) == at_v1
    versions = history(out)
    assert versions[3]["operation"] == "RESTORE" and versions[3]["partition"] == f"dt={D2}"
    assert versions[2]["status"] == "rolled back (version 3)" and versions[2]["run_id"] == a2

    # A partition and --partition that disagree are refused; a job file takes --partition.
    clash = cli(
        "rollback",
        str(out / f"dt={D1}"),
        "--partition",
        f"dt={D2}",
        "--to-version",
        "0",
        "--reason",
        "x",
    )
    assert clash.returncode == 2 and "is not the partition OUTPUT points at" in clash.output
    noop = cli(
        "rollback", str(job), "--partition", f"dt={D1}", "--to-version", "2", "--reason", "x"
    )
    assert noop.returncode == 0, noop.output
    assert "nothing to roll back, nothing committed" in noop.stdout
    assert version_of(ref) == 3
