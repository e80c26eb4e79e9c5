"""Runs that fail after scoring, under ``-q``: one line each, saying which run and why (breakit22).

Cron mails what a ``-q`` run writes. A disk that fills while the run commits used to print three
lines (two ERRORs about the report that could not be rewritten, then an error naming the file but
not the run, nor that it was the storage), and files in the output that the report does not list
one ERROR line each before the run's own line. The details belong in the report and the log file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.integration.helpers import FAIL_AT, cli, job_args

pytestmark = pytest.mark.integration

RUN_ID = r"\d{8}T\d{6}Z-[0-9a-f]+"


@pytest.mark.parametrize(
    ("fault", "left"),
    [
        ("judged", "_manifest.json"),  # from the manifest on, nothing can be written
        ("report-rename", "_report.json"),
        ("success-rename", "_SUCCESS"),
    ],
)
def test_a_disk_filling_while_the_run_commits_is_one_line_naming_the_run(
    catalog: Path, bundle_dir: Path, tmp_path: Path, fault: str, left: str
) -> None:
    out = tmp_path / "out"
    log = tmp_path / "night.log"
    args = ["run", *job_args(catalog, out, bundle_dir), "--scheduler", "sync"]
    r = cli(*args, "-q", "--log-file", str(log), env={FAIL_AT: fault})
    assert r.returncode == 1, r.output
    (line,) = r.stderr.strip().splitlines()
    assert re.match(rf"error: run {RUN_ID} failed: storage failure: ", line), line
    assert left in line and "No space left on device" in line, line
    # The log file has the night's whole story, whatever -q says.
    assert line.removeprefix("error: ") in log.read_text()


def test_files_the_report_does_not_list_are_one_line_under_q(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = ["run", *job_args(catalog, out, bundle_dir), "--scheduler", "sync"]
    assert cli(*args).returncode == 0
    strays = [out / f"stray{i}.parquet" for i in range(3)]
    for p in strays:
        pq.write_table(pa.table({"item_id": [1, 2, 3]}), p)
    quiet = cli(*args, "-q")
    assert quiet.returncode == 1, quiet.output
    (line,) = quiet.stderr.strip().splitlines()
    assert re.match(rf"error: run {RUN_ID} failed: ", line), line
    assert all(str(p) in line for p in strays) and "_report.json" in line, line
    assert quiet.report is not None
    assert all(any(str(p) in reason for reason in quiet.report["failure_reasons"]) for p in strays)
    loud = cli(*args)  # without -q: a line per file
    assert loud.returncode == 1, loud.output
    for p in strays:
        assert any(str(p) in ln and "not in the report" in ln for ln in loud.stderr.splitlines())
