"""How a rollback is recorded, for a Delta and an Iceberg table alike, through the real CLI
(break-it review of issue 32): a rollback SIGKILLed right after its commit landed
(``_SCORE_CATALOG_KILL_AT=rollback-committed``) is still named by ``report`` and recorded by
its retry, which commits nothing more; and after a whole-table rollback is undone, ``report``
of the run it had undone says what ``history`` says: the table serves it again.

The rollback driver is format-neutral (pipeline/driver/rollback.py, tables.py): each test runs
once per format. Runs are real processes (``tests.integration.helpers.cli``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.cli.demo import export_bundle
from tests.conftest import demo_toml, make_model, write_shards
from tests.integration.helpers import cli, report

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # 8 CLI calls each: ~25 s here

D1, D2 = "2025-04-01", "2025-04-02"
JOB = "nightly"
KILLED = {"_SCORE_CATALOG_KILL_AT": "rollback-committed"}


@pytest.fixture(params=["delta", "iceberg"])
def fmt(request: pytest.FixtureRequest) -> str:
    if request.param == "iceberg":
        pytest.importorskip("pyiceberg")
    return str(request.param)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model A and model B: the demo MLP with seeds 0 and 1 (different scores)."""
    out = {}
    for seed, name in enumerate("AB"):
        d = tmp_path_factory.mktemp(f"model{name}")
        export_bundle(make_model(seed=seed), d, demo_toml(version=name), n_in=16)
        out[name] = d
    return out


def _job(tmp_path: Path, bundles: dict[str, Path], fmt: str) -> Path:
    archive = tmp_path / "archive"
    for k, day in enumerate((D1, D2)):
        write_shards(archive / f"dt={day}", [600, 400], row_group_rows=500, start=10_000 * k)
    job = tmp_path / f"{JOB}.toml"
    job.write_text(
        f'name = "{JOB}"\ninput = "{archive}/dt={{date}}"\n'
        f'output = "{tmp_path}/scored/dt={{date}}"\n'
        f'model = "{bundles["A"]}"\nformat = "{fmt}"\nscheduler = "sync"\nbatch_size = 512\n'
        "[monitoring]\ndrift = true\n"
    )
    return job


def _run(job: Path, day: str, model: Path | None = None) -> tuple[str, int]:
    """Score ``day``: (its run id, the table version it committed). A drift alert (exit 4) is
    a finished run too."""
    done = cli("run", str(job), "--date", day, *(["--model", str(model)] if model else []))
    assert done.returncode in (0, 4) and done.report is not None, done.output
    return str(done.report["run_id"]), int(done.report["output_format"]["version"])


def _history(where: Path) -> dict[int, dict[str, Any]]:
    shown = cli("history", str(where), "--json")
    assert shown.returncode == 0, shown.output
    return {r["version"]: r for r in json.loads(shown.stdout)}


def _records(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "_score_catalog" / "scored" / "_runs" / JOB / "_rollbacks").glob("*"))


def test_a_rollback_killed_after_its_commit_is_recorded_by_its_retry(
    tmp_path: Path, bundles: dict[str, Path], fmt: str
) -> None:
    job = _job(tmp_path, bundles, fmt)
    out = tmp_path / "scored"
    day = out / f"dt={D1}"
    a1, v1 = _run(job, D1)
    b1, v2 = _run(job, D1, bundles["B"])
    args = ["rollback", str(day), "--to-version", str(v1), "--reason", "model B is bad"]

    killed = cli(*args, env=KILLED)
    assert killed.returncode == -9, killed.output  # SIGKILLed right after its commit landed
    versions = _history(out)
    rollback = max(versions)
    assert versions[rollback]["restored_to"] == v1
    assert versions[v2]["status"] == f"rolled back (version {rollback})"
    assert _records(tmp_path) == []  # it died before it wrote its record
    # report reads the table, as history does: the undone run says so before any retry.
    shown = cli("report", str(day))
    assert shown.stdout.startswith(
        f"ROLLED BACK: rollback of partition dt={D1} to version {v1} (table version {rollback}"
    ), shown.output
    assert "'model B is bad') undid this run" in shown.stdout

    # The retry finds the partition already as version v1 left it: it commits nothing, and
    # records the rollback that made it so, as that rollback would have.
    retry = cli(*args[:-1], "model B is bad (retry)")
    assert retry.returncode == 0, retry.output
    assert (
        f"recorded the rollback of partition dt={D1} to version {v1} (table version {rollback}, "
    ) in retry.stdout
    assert "nothing to roll back, nothing committed" in retry.stdout
    assert max(_history(out)) == rollback
    [path] = _records(tmp_path)
    record = json.loads(path.read_text())
    assert (record["version"], record["to_version"], record["scope"]) == (rollback, v1, "partition")
    assert (record["rolled_back"], record["reason"]) == ([b1], "model B is bad")
    assert [(p["partition"], p["run_id"]) for p in record["partitions"]] == [(f"dt={D1}", a1)]
    assert record["partitions"][0]["outputs"]  # model A's score sketches: the next drift's
    assert record["recovered"]["by"]

    # Once recorded, a retry records nothing more.
    again = cli(*args[:-1], "once more")
    assert again.returncode == 0 and "recorded the rollback" not in again.stdout, again.output
    assert _records(tmp_path) == [path]

    # The next run of the day compares its drift with what the rollback restored.
    _run(job, D1, bundles["B"])
    baseline = report(day)["drift"]["baseline"]
    assert (baseline["run_id"], baseline["finished_at"]) == (a1, record["at"])


def test_report_agrees_with_history_once_a_rollback_is_undone(
    tmp_path: Path, bundles: dict[str, Path], fmt: str
) -> None:
    job = _job(tmp_path, bundles, fmt)
    out = tmp_path / "scored"
    _a1, v1 = _run(job, D1)
    _a2, v2 = _run(job, D2)

    back = cli("rollback", str(out), "--to-version", str(v1), "--reason", "oops")
    assert back.returncode == 0, back.output
    rollback = max(_history(out))
    shown = cli("report", str(out / f"dt={D2}"))
    assert shown.stdout.startswith(f"ROLLED BACK: rollback to version {v1} "), shown.output

    # Back to the version before the rollback: the table serves day 2's run again.
    undo = cli("rollback", str(out), "--to-version", str(rollback - 1), "--reason", "undo oops")
    assert undo.returncode == 0, undo.output
    versions = _history(out)
    assert versions[v2]["status"].startswith("committed"), versions[v2]
    assert versions[rollback]["status"] == f"rolled back (version {rollback + 1})"
    shown = cli("report", str(out / f"dt={D2}"))
    assert shown.returncode == 0, shown.output
    assert "ROLLED BACK" not in shown.stdout

    # The same undo again finds the table as that version left it: nothing more committed.
    twice = cli("rollback", str(out), "--to-version", str(rollback - 1), "--reason", "undo oops")
    assert twice.returncode == 0, twice.output
    assert "already holds what version" in twice.stdout and max(_history(out)) == rollback + 1
