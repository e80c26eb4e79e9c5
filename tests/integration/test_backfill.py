"""`score-catalog backfill` over a hive-partitioned archive, through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.conftest import write_shards
from tests.integration.helpers import cli, data_files, manifest_path, report, temporaries

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DAYS = ["2025-01-01", "2025-01-02", "2025-01-03"]


@pytest.fixture
def archive(tmp_path: Path, bundle_dir: Path) -> Path:
    """Three daily partitions of two shards each (2025-01-04 is missing), and a job file."""
    for k, day in enumerate(DAYS):
        write_shards(tmp_path / "archive" / f"dt={day}", [1200, 800], start=10_000 * k, seed=k)
    job = tmp_path / "rescore.toml"
    job.write_text(
        f'input = "{tmp_path}/archive/dt={{date}}"\n'
        f'output = "{tmp_path}/scored/dt={{date}}"\n'
        f'model = "{bundle_dir}"\n'
        'scheduler = "sync"\nbatch_size = 512\n'
        "[monitoring]\ndrift = false\n"
    )
    return job


def _summary(tmp_path: Path, start: str, end: str) -> dict[str, Any]:
    """The backfill's summary file for START..END."""
    # In the control area beside the output template's fixed part (pipeline.io.layout).
    path = tmp_path / "_score_catalog" / "scored" / "_backfills" / "rescore" / f"{start}_{end}.json"
    return json.loads(path.read_text())


def test_backfill_interrupted_then_resumed_scores_every_row_once(
    archive: Path, tmp_path: Path
) -> None:
    # 2025-01-04 has no input: accepted here (an archive with gaps); test_backfill_missing
    # covers a missing day without the flag.
    args = [
        "backfill", str(archive), "--from", "2025-01-01", "--to", "2025-01-04",
        "--allow-missing-partitions",
    ]  # fmt: skip
    # SIGKILL at the 4th output commit: partition 1 is done, partition 2 has one shard done.
    killed = cli(*args, env={"_SCORE_CATALOG_KILL_AT": "output-rename:4"})
    assert killed.returncode == -9, killed.stderr
    assert (tmp_path / "scored" / "dt=2025-01-01" / "_SUCCESS").exists()
    assert not (tmp_path / "scored" / "dt=2025-01-02" / "_SUCCESS").exists()
    # The manifest is saved on a time budget (pipeline.io.manifest), so whether partition 2's
    # finished shard was recorded before the kill depends on the machine's speed (a busy one
    # spaces the saves further): a recorded shard is skipped by the rerun, one not recorded is
    # scored again. Either way every row is there once (checked below).
    killed_manifest = manifest_path(tmp_path / "scored" / "dt=2025-01-02")
    saved = killed_manifest.exists()
    recorded = len(json.loads(killed_manifest.read_text())["shards"]) if saved else 0
    assert recorded <= 1

    resumed = cli(*args)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    s = _summary(tmp_path, "2025-01-01", "2025-01-04")
    parts = {p["date"]: p for p in s["partitions"]}
    assert parts["2025-01-01"]["status"] == "skipped"  # finished before the kill
    assert parts["2025-01-02"]["status"] == "succeeded"
    assert parts["2025-01-02"]["shards_skipped"] == recorded
    assert parts["2025-01-02"]["shards_scored"] == 2 - recorded
    assert parts["2025-01-03"]["status"] == "succeeded"
    assert parts["2025-01-04"]["status"] == "missing"
    assert s["status"] == "succeeded"
    assert "2025-01-04" in resumed.stdout and "missing" in resumed.stdout

    for k, day in enumerate(DAYS):
        out = tmp_path / "scored" / f"dt={day}"
        assert (out / "_SUCCESS").exists() and report(out)["rows_out"] == 2000
        ids = [i for p in data_files(out) for i in pq.read_table(p).column("item_id").to_pylist()]
        assert sorted(ids) == list(range(10_000 * k, 10_000 * k + 2000))  # each row once
    assert not temporaries(tmp_path / "scored")

    again = cli(*args)  # nothing left to do: every partition is skipped without a run
    assert again.returncode == 0
    s = _summary(tmp_path, "2025-01-01", "2025-01-04")
    assert s["partitions_by_status"] == {"skipped": 3, "missing": 1}


def test_backfill_force_rescores_and_a_bad_partition_does_not_stop_the_others(
    archive: Path, tmp_path: Path
) -> None:
    (tmp_path / "archive" / "dt=2025-01-02" / "part-00001.parquet").write_bytes(b"not parquet")
    r = cli("backfill", str(archive), "--from", "2025-01-01", "--to", "2025-01-03")
    assert r.returncode == 1, r.stdout + r.stderr
    s = _summary(tmp_path, "2025-01-01", "2025-01-03")
    statuses = [p["status"] for p in s["partitions"]]
    assert statuses == ["succeeded", "failed", "succeeded"]
    assert s["status"] == "failed"
    # The summary says why the day failed, in the JSON and in the table.
    why = "1 failed shards > errors.max_failed_shards = 0"
    assert why in s["partitions"][1]["failure_reasons"]
    assert any(ln.startswith("  2025-01-02") and why in ln for ln in r.stdout.splitlines())
    forced = cli("backfill", str(archive), "--from", "2025-01-01", "--to", "2025-01-01", "--force")
    assert forced.returncode == 0
    assert _summary(tmp_path, "2025-01-01", "2025-01-01")["partitions"][0]["status"] == "succeeded"


def test_backfill_needs_date_templates_and_a_sane_range(tmp_path: Path, bundle_dir: Path) -> None:
    job = tmp_path / "flat.toml"
    job.write_text(f'input = "{tmp_path}/in"\noutput = "{tmp_path}/out"\nmodel = "{bundle_dir}"\n')
    r = cli("backfill", str(job), "--from", "2025-01-01", "--to", "2025-01-02")
    assert r.returncode == 2 and "has no {date}" in r.stderr
    job.write_text(
        f'input = "{tmp_path}/in/dt={{date}}"\noutput = "{tmp_path}/out/dt={{date}}"\n'
        f'model = "{bundle_dir}"\n'
    )
    r = cli("backfill", str(job), "--from", "2025-02-01", "--to", "2025-01-01")
    assert r.returncode == 2 and "before" in r.stderr


def test_a_stopped_backfill_counts_every_planned_day(tmp_path: Path, bundle_dir: Path) -> None:
    """SIGTERM during the first of four days: the summary still says four days were planned,
    one ran (interrupted) and three did not."""
    days = ["2025-02-01", "2025-02-02", "2025-02-03", "2025-02-04"]
    for k, day in enumerate(days):
        write_shards(tmp_path / "archive" / f"dt={day}", [2_000] * 2, start=100_000 * k)
    job = tmp_path / "rescore.toml"
    job.write_text(
        f'input = "{tmp_path}/archive/dt={{date}}"\noutput = "{tmp_path}/scored/dt={{date}}"\n'
        f'model = "{bundle_dir}"\nscheduler = "sync"\nbatch_size = 500\n'
    )
    # The signal arrives as the first day writes its first batch (sent from that fault point,
    # as cron's timeout would send it): never after that day, however fast it goes.
    env = {"_SCORE_CATALOG_KILL_AT": "batch-written:1", "_SCORE_CATALOG_KILL_SIGNAL": "SIGTERM"}
    r = cli("backfill", str(job), "--from", days[0], "--to", days[-1], env=env)
    assert r.returncode == 143, r.stderr
    s = _summary(tmp_path, days[0], days[-1])
    assert s["status"] == "interrupted"
    assert s["partitions_total"] == 4
    assert [p["date"] for p in s["partitions"]] == days[:1]
    assert s["not_run"] == days[1:]
    assert s["partitions_by_status"] == {"interrupted": 1, "not_run": 3}
    assert "1 interrupted, 3 not_run" in r.stdout
