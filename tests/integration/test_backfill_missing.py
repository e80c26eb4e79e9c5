"""Days without input in a backfill, and a run on a day without input, through the real CLI.

A range in which no day has input is a wrong template and fails before any day runs (exit 3);
a missing day among others fails the backfill (exit 1) with a WARNING naming it, unless the job
accepts gaps (``allow_missing_partitions``: job key, environment variable or flag).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import write_shards
from tests.integration.helpers import cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DAYS = ["2025-03-01", "2025-03-02"]  # 2025-03-03 has no input


def _job(tmp_path: Path, bundle_dir: Path, archive: str = "archive", extra: str = "") -> Path:
    job = tmp_path / "rescore.toml"
    job.write_text(
        f'input = "{tmp_path}/{archive}/dt={{date}}"\n'
        f'output = "{tmp_path}/scored/dt={{date}}"\n'
        f'model = "{bundle_dir}"\n'
        'scheduler = "sync"\nbatch_size = 512\n'
        f"{extra}"
        "[monitoring]\ndrift = false\n"
    )
    return job


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    for k, day in enumerate(DAYS):
        write_shards(tmp_path / "archive" / f"dt={day}", [700, 500], start=10_000 * k, seed=k)
    return tmp_path / "archive"


def _summary(tmp_path: Path, start: str, end: str) -> dict[str, Any]:
    path = tmp_path / "_score_catalog" / "scored" / "_backfills" / "rescore" / f"{start}_{end}.json"
    return json.loads(path.read_text())


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_a_range_where_no_day_has_input_fails_before_any_day_runs(
    archive: Path, tmp_path: Path, bundle_dir: Path
) -> None:
    job = _job(tmp_path, bundle_dir, archive="my_archiv")  # a typo: the archive is "archive"
    for extra in ([], ["--allow-missing-partitions"]):  # gaps accepted or not: a wrong template
        r = cli("backfill", str(job), "--from", "2025-03-01", "--to", "2025-03-03", *extra)
        assert r.returncode == 3, r.output
        err = _flat(r.stderr)
        assert "no day from 2025-03-01 to 2025-03-03 has input" in err
        assert f"input = '{tmp_path}/my_archiv/dt={{date}}'" in err  # the template
        assert f"{tmp_path}/my_archiv/dt=2025-03-01" in err  # the first path looked for
        assert f"did you mean {tmp_path}/archive?" in err
        assert "SUCCEEDED" not in r.stdout
    assert not (tmp_path / "scored").exists()  # nothing written, not even a summary


def test_a_missing_day_fails_the_backfill_with_a_warning_naming_it(
    archive: Path, tmp_path: Path, bundle_dir: Path
) -> None:
    job = _job(tmp_path, bundle_dir)
    r = cli("backfill", str(job), "--from", DAYS[0], "--to", "2025-03-03")
    assert r.returncode == 1, r.output
    missing = f"{tmp_path}/archive/dt=2025-03-03"
    warnings = [ln for ln in r.stderr.splitlines() if "WARNING" in ln and "2025-03-03" in ln]
    assert len(warnings) == 1 and missing in warnings[0], r.stderr
    s = _summary(tmp_path, DAYS[0], "2025-03-03")
    assert s["status"] == "failed"
    assert s["partitions_by_status"] == {"succeeded": 2, "missing": 1}
    assert s["partitions_missing"] == ["2025-03-03"]
    assert s["allow_missing_partitions"] is False
    (reason,) = s["failure_reasons"]
    assert "1 of 3 days has no input (2025-03-03)" in reason
    assert "--allow-missing-partitions" in reason
    assert "FAILED" in r.stdout and reason in _flat(r.stdout)
    assert s["rows_out"] == 2400  # the days that have input were scored all the same
    # -q: the one line cron mails names the missing day.
    q = cli("backfill", str(job), "--from", DAYS[0], "--to", "2025-03-03", "-q")
    assert q.returncode == 1 and "2025-03-03 missing" in q.stderr and missing in q.stderr


@pytest.mark.parametrize("how", ["job key", "environment", "flag"])
def test_allow_missing_partitions_accepts_a_gap(
    archive: Path, tmp_path: Path, bundle_dir: Path, how: str
) -> None:
    job = _job(tmp_path, bundle_dir, extra="allow_missing_partitions = true\n" * (how == "job key"))
    env = {"SCORE_CATALOG_ALLOW_MISSING_PARTITIONS": "true"} if how == "environment" else None
    flag = ["--allow-missing-partitions"] if how == "flag" else []
    r = cli("backfill", str(job), "--from", DAYS[0], "--to", "2025-03-03", *flag, env=env)
    assert r.returncode == 0, r.output
    s = _summary(tmp_path, DAYS[0], "2025-03-03")
    assert s["status"] == "succeeded" and s["failure_reasons"] == []
    assert s["partitions_missing"] == ["2025-03-03"] and s["allow_missing_partitions"] is True
    assert "missing days accepted" in r.stdout
    # Still said, once, but as accepted: INFO, not WARNING.
    lines = [ln for ln in r.stderr.splitlines() if "partition 2025-03-03: missing" in ln]
    assert len(lines) == 1 and " INFO " in lines[0], r.stderr


def test_run_on_a_day_without_input_names_the_day_and_what_exists(
    archive: Path, tmp_path: Path, bundle_dir: Path
) -> None:
    job = _job(tmp_path, bundle_dir)
    r = cli("run", str(job), "--date", "2025-03-05")
    assert r.returncode == 3, r.output
    err = _flat(r.stderr)
    assert f"input {tmp_path}/archive/dt=2025-03-05 does not exist" in err
    assert "no partition for 2025-03-05 (from --date" in err
    assert f"input = '{tmp_path}/archive/dt={{date}}'" in err
    # What is there instead: the partitions, not a guess at another date.
    assert "only dt=2025-03-01, dt=2025-03-02" in err and "did you mean" not in err
    # Without --date the day is today's (UTC), and the message says so.
    r = cli("run", str(job))
    assert r.returncode == 3 and "today in UTC: no --date was given" in _flat(r.stderr)
    # plan says the same.
    r = cli("plan", str(job), "--date", "2025-03-05")
    assert r.returncode == 3 and "no partition for 2025-03-05" in _flat(r.stderr)
    # backfill's flag is not run's: run --help does not offer it.
    assert "--allow-missing-partitions" not in cli("run", "--help").stdout


def test_a_glob_template_finds_its_days(archive: Path, tmp_path: Path, bundle_dir: Path) -> None:
    # input may be a glob; a day is there when the glob matches (it was always "missing").
    job = _job(tmp_path, bundle_dir)
    job.write_text(job.read_text().replace('dt={date}"', 'dt={date}/*.parquet"', 1))
    r = cli("backfill", str(job), "--from", DAYS[0], "--to", DAYS[-1])
    assert r.returncode == 0, r.output
    s = _summary(tmp_path, DAYS[0], DAYS[-1])
    assert [p["status"] for p in s["partitions"]] == ["succeeded", "succeeded"]
    assert s["rows_out"] == 2400
