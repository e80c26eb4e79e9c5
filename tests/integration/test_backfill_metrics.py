"""A backfill's outcome in the metrics, its summary and its ``-q`` line (breakit22 C5 and LOWs).

A backfill publishes one outcome to the metrics file and the Pushgateway, its own: failed when a
day failed or is missing, interrupted, ``succeeded_with_warnings`` on an open drift alert. The
days' runs publish nothing of their own (the last day's ``succeeded`` used to overwrite a failed
backfill's outcome), the last-success time moves only when the whole backfill succeeded, and
every way a backfill can stop early (a template typo, the range, an input without ``{date}``)
writes ``failed`` too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.cli.demo import FEATURES
from tests.conftest import write_shards
from tests.integration.helpers import cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DAYS = ["2025-03-01", "2025-03-02", "2025-03-03"]
LAST_SUCCESS = "score_catalog_last_success_timestamp_seconds"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "job_name"))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _status(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> str:
    (status,) = [
        dict(labels)["status"]
        for (name, labels), v in samples.items()
        if name == "score_catalog_last_run_status" and v == 1
    ]
    return status


def _job(tmp_path: Path, bundle_dir: Path, input_template: str = "archive/dt={date}") -> Path:
    job = tmp_path / "rescore.toml"
    job.write_text(
        f'input = "{tmp_path}/{input_template}"\noutput = "{tmp_path}/scored/dt={{date}}"\n'
        f'model = "{bundle_dir}"\nscheduler = "sync"\nmetrics_file = "{tmp_path}/bf.prom"\n'
    )
    return job


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    """Three days of input, 1,200 rows each, in two shards."""
    for k, day in enumerate(DAYS):
        write_shards(tmp_path / "archive" / f"dt={day}", [700, 500], start=10_000 * k, seed=k)
    return tmp_path / "archive"


def _summary(tmp_path: Path, start: str, end: str) -> dict[str, Any]:
    path = tmp_path / "_score_catalog" / "scored" / "_backfills" / "rescore" / f"{start}_{end}.json"
    return json.loads(path.read_text())


def test_a_failed_backfill_says_failed_and_keeps_the_last_success(
    archive: Path, tmp_path: Path, bundle_dir: Path
) -> None:
    """Day 1 was backfilled before (a success). Now day 2 has a truncated shard and day 4 no
    input: the backfill fails (exit 1), and so do its metrics, although days 1 and 3 ran; the
    last success is still the earlier backfill's."""
    job = _job(tmp_path, bundle_dir)
    metrics = tmp_path / "bf.prom"
    first = cli("backfill", str(job), "--from", DAYS[0], "--to", DAYS[0])
    assert first.returncode == 0, first.output
    before = _samples(metrics.read_text())
    assert _status(before) == "succeeded"
    shard = archive / f"dt={DAYS[1]}" / "part-00001.parquet"
    shard.write_bytes(shard.read_bytes()[:1000])

    r = cli("backfill", str(job), "--from", DAYS[0], "--to", "2025-03-04", "-q")
    assert r.returncode == 1, r.output
    summary = _summary(tmp_path, DAYS[0], "2025-03-04")
    assert summary["status"] == "failed"
    assert summary["partitions_by_status"] == {
        "skipped": 1,
        "failed": 1,
        "succeeded": 1,
        "missing": 1,
    }
    after = _samples(metrics.read_text())
    assert _status(after) == "failed"
    assert after[(LAST_SUCCESS, ())] == before[(LAST_SUCCESS, ())]
    # Every day's rows in the output, the skipped day's too; the failed day's shard counts.
    assert after[("score_catalog_last_run_scored_rows", ())] == summary["rows_out"]
    assert summary["rows_out"] == sum(p.get("rows_out") or 0 for p in summary["partitions"])
    assert after[("score_catalog_last_run_failed_shards", ())] >= 1


@pytest.mark.parametrize(
    ("case", "code"),
    [
        ("template typo", 3),  # no day has input: a wrong template
        ("to before from", 2),
        ("input without {date}", 2),
        ("all skipped, one missing", 1),
    ],
)
def test_every_early_end_of_a_backfill_writes_failed_metrics(
    archive: Path, tmp_path: Path, bundle_dir: Path, case: str, code: int
) -> None:
    job = _job(tmp_path, bundle_dir)
    start, end = DAYS[0], DAYS[1]
    if case == "template typo":
        job = _job(tmp_path, bundle_dir, "archiv/dt={date}")
    elif case == "to before from":
        start, end = end, start
    elif case == "input without {date}":
        job = _job(tmp_path, bundle_dir, f"archive/dt={DAYS[0]}")
    else:
        assert cli("backfill", str(job), "--from", DAYS[0], "--to", DAYS[0]).returncode == 0
        (tmp_path / "bf.prom").unlink()
        shutil.rmtree(archive / f"dt={DAYS[1]}")
    r = cli("backfill", str(job), "--from", start, "--to", end, "-q")
    assert r.returncode == code, r.output
    assert _status(_samples((tmp_path / "bf.prom").read_text())) == "failed"


def _shift(day: Path) -> None:
    """Every feature of the day's shards moved by 3: its scores drift."""
    for p in sorted(day.glob("*.parquet")):
        t = pq.read_table(p)
        for name in FEATURES:
            i = t.schema.get_field_index(name)
            shifted = pc.add(t.column(name), pa.scalar(3.0, t.schema.field(i).type))
            t = t.set_column(i, name, shifted)
        pq.write_table(t, p, row_group_size=250)


def test_a_drifted_backfill_says_drift_everywhere_and_counts_skipped_rows(
    archive: Path, tmp_path: Path, bundle_dir: Path
) -> None:
    """Day 3 drifts (exit 4): the summary's status, its header and the -q line say so, and so
    do the metrics (succeeded_with_warnings, day 3's PSI); rerun with every day skipped, the
    same, with the rows of the skipped days counted."""
    _shift(archive / f"dt={DAYS[2]}")
    job = _job(tmp_path, bundle_dir)
    args = ["backfill", str(job), "--from", DAYS[0], "--to", DAYS[2]]
    r = cli(*args)
    assert r.returncode == 4, r.output
    header = r.stdout.splitlines()[0]
    assert "SUCCEEDED_WITH_WARNINGS" in header and f"DRIFT ALERT ON {DAYS[2]}" in header, header
    summary = _summary(tmp_path, DAYS[0], DAYS[2])
    assert summary["status"] == "succeeded_with_warnings"
    assert summary["drift_alerts"] == [DAYS[2]]
    rows = summary["rows_out"]
    assert rows == 3 * 1200
    samples = _samples((tmp_path / "bf.prom").read_text())
    assert _status(samples) == "succeeded_with_warnings"
    assert samples[("score_catalog_last_run_drift_psi", (("output", "score"),))] > 0.25
    assert samples[("score_catalog_last_run_drift_accepted", ())] == 0

    again = cli(*args, "-q")
    assert again.returncode == 4, again.output
    (line,) = again.stderr.strip().splitlines()
    assert "succeeded_with_warnings (drift alert on" in line and "drift alert stands" in line
    assert f"{DAYS[2]} skipped" in line and "accept-drift" in line, line
    summary = _summary(tmp_path, DAYS[0], DAYS[2])
    assert summary["partitions_by_status"] == {"skipped": 3}
    assert summary["rows_out"] == rows  # the skipped days' rows are in the output
    samples = _samples((tmp_path / "bf.prom").read_text())
    assert _status(samples) == "succeeded_with_warnings"
    assert samples[("score_catalog_last_run_scored_rows", ())] == rows


def test_a_failed_backfill_pushes_one_outcome_without_a_new_success(
    archive: Path, tmp_path: Path, bundle_dir: Path, gateway: Any
) -> None:
    """One push for the whole backfill: failed, and no last-success time from the day that
    succeeded in it (the group a push replaces had none before)."""
    host, port = gateway.server_address[:2]
    shard = archive / f"dt={DAYS[1]}" / "part-00000.parquet"
    shard.write_bytes(shard.read_bytes()[:1000])
    job = _job(tmp_path, bundle_dir)
    r = cli(
        "backfill",
        str(job),
        "--from",
        DAYS[0],
        "--to",
        DAYS[1],
        "--pushgateway",
        f"http://{host}:{port}",
    )
    assert r.returncode == 1, r.output
    ((path, body),) = gateway.requests
    assert path == "/metrics/job/rescore"
    samples = _samples(body.decode())
    assert _status(samples) == "failed"
    assert (LAST_SUCCESS, ()) not in samples
