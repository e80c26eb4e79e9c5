"""Issue 22, items 7 and 8 through the real CLI: the status in ``_report.json``, the metrics and
the exit code always agree, and a run that never started still tells the metrics it failed.

Item 7 fills the disk at each step of the finish phase (``_SCORE_CATALOG_FAIL_AT``, see
``pipeline/core/faults.py``: from that point on every staged write raises ENOSPC without a file
name, as a full disk does; ``:once`` fails that one write). Item 8 breaks the configuration in
each layer that can name the metrics file: the job file, the environment, the flags, and a
command line Click refuses before any of them is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.io import runindex
from pipeline.report.build import exit_code_for
from tests.integration.helpers import cli, control_of, job_args, report_path

pytestmark = pytest.mark.integration

FAIL_AT = "_SCORE_CATALOG_FAIL_AT"


def _status(metrics: Path) -> str:
    (status,) = [
        s.labels["status"]
        for fam in text_string_to_metric_families(metrics.read_text())
        for s in fam.samples
        if s.name == "score_catalog_last_run_status" and s.value == 1
    ]
    return status


def _job_name(metrics: Path) -> str:
    names = {
        s.labels["job_name"]
        for fam in text_string_to_metric_families(metrics.read_text())
        for s in fam.samples
    }
    (name,) = names
    return name


# ---------------------------------------------------------------- item 7


@pytest.mark.parametrize(
    ("fault", "code", "left"),
    [
        # The disk fills once the status is decided: the manifest (with the verdict) is first.
        ("judged", 1, "_manifest.json"),
        ("html-rename", 1, "_report.html"),
        ("report-rename", 1, "_report.json"),
        # The report says succeeded; then _SUCCESS cannot be written: the report must not stay.
        ("success-rename", 1, "_SUCCESS"),
        # One failed write only: the report is rewritten as failed.
        ("success-rename:1:once", 1, "_SUCCESS"),
        ("report-rename:1:once", 1, "_report.json"),
        ("runindex-rename", 1, "_report.html"),
        # The run index alone cannot be written: it is a record, the run stands with a warning.
        ("runindex-rename:1:once", 0, None),
    ],
)
def test_a_full_disk_at_each_finish_step_leaves_report_metrics_and_exit_code_agreeing(
    catalog: Path, bundle_dir: Path, tmp_path: Path, fault: str, code: int, left: str | None
) -> None:
    out = tmp_path / "out"
    metrics = tmp_path / "m.prom"
    args = ["run", *job_args(catalog, out, bundle_dir), "--scheduler", "sync"]
    r = cli(*args, "--metrics-file", str(metrics), env={FAIL_AT: fault})
    assert r.returncode == code, r.output
    status = _status(metrics)
    path = report_path(out)
    if path.exists():
        rep = json.loads(path.read_text())
        assert rep["status"] == status
        assert exit_code_for(rep["status"], rep["failure_reasons"]) == r.returncode
        if code:
            assert "No space left on device" in rep["failure_reasons"][0]
    assert (out / "_SUCCESS").exists() == (code == 0)
    if code:
        assert status == "failed"
        last = r.stderr.strip().splitlines()[-1]
        # One line naming what could not be written, and why.
        assert "No space left on device" in last and left is not None and left in last, last
        assert "Traceback" not in r.stderr
    else:
        assert status == "succeeded"
        assert r.report is not None
        assert any("could not record the run in the index" in w for w in r.report["warnings"])
    page = control_of(out) / "_report.html"
    if page.exists():
        assert status.upper() in page.read_text()
    # The run index, where later runs look for a drift baseline, never calls it a success.
    index = Path(runindex.index_root(str(out))) / runindex.INDEX_DIR
    entries = [json.loads(p.read_text()) for p in index.rglob("*.json")]
    assert all(e["status"] == status for e in entries)


@pytest.mark.slow
def test_a_rerun_after_a_failed_commit_succeeds(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = ["run", *job_args(catalog, out, bundle_dir), "--scheduler", "sync"]
    assert cli(*args, env={FAIL_AT: "success-rename"}).returncode == 1
    again = cli(*args)
    assert again.returncode == 0, again.output
    assert again.report is not None and again.report["status"] == "succeeded"
    assert again.report["shards_skipped"] == 3 and (out / "_SUCCESS").exists()


# ---------------------------------------------------------------- item 8


def _bad_job(tmp_path: Path, catalog: Path, bundle_dir: Path, extra: str) -> Path:
    job = tmp_path / "nightly.toml"
    job.write_text(
        f'input = "{catalog}"\noutput = "{tmp_path / "out"}"\nmodel = "{bundle_dir}"\n{extra}'
    )
    return job


def test_a_bad_key_in_the_job_file_still_writes_failed_metrics(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    metrics = tmp_path / "m.prom"
    job = _bad_job(
        tmp_path, catalog, bundle_dir, f'batch_size = "lots"\nmetrics_file = "{metrics}"\n'
    )
    r = cli("run", str(job))
    assert r.returncode == 2, r.output
    assert "batch_size" in r.stderr
    assert _status(metrics) == "failed"
    assert _job_name(metrics) == "nightly"  # the job file's stem, as a good run would say


def test_a_job_file_that_is_not_toml_with_the_metrics_file_from_the_environment(
    tmp_path: Path,
) -> None:
    metrics = tmp_path / "m.prom"
    job = tmp_path / "broken.toml"
    job.write_text('input = "unterminated\n')
    r = cli("run", str(job), env={"SCORE_CATALOG_METRICS_FILE": str(metrics)})
    assert r.returncode == 2, r.output
    assert _status(metrics) == "failed" and _job_name(metrics) == "broken"


def test_an_unknown_environment_variable_with_the_metrics_file_flag(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    metrics = tmp_path / "m.prom"
    args = job_args(catalog, tmp_path / "out", bundle_dir, "--metrics-file", str(metrics))
    r = cli("run", *args, env={"SCORE_CATALOG_BATCH_SIZ": "512"})
    assert r.returncode == 2, r.output
    assert _status(metrics) == "failed"


def test_a_flag_click_refuses_still_writes_failed_metrics(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    metrics = tmp_path / "m.prom"
    job = _bad_job(tmp_path, catalog, bundle_dir, f'metrics_file = "{metrics}"\n')
    r = cli("run", str(job), "--batch-size", "lots")
    assert r.returncode == 2, r.output
    assert _status(metrics) == "failed" and _job_name(metrics) == "nightly"
    flag = tmp_path / "flag.prom"
    r = cli("run", str(job), "--no-such-flag", f"--metrics-file={flag}")
    assert r.returncode == 2, r.output
    assert _status(flag) == "failed"


@pytest.mark.slow
def test_a_backfill_with_a_bad_config_writes_failed_metrics(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    metrics = tmp_path / "m.prom"
    job = tmp_path / "days.toml"
    job.write_text(
        f'input = "{catalog}/{{date}}"\noutput = "{tmp_path}/out/{{date}}"\n'
        f'model = "{bundle_dir}"\nworkers = 0\nmetrics_file = "{metrics}"\n'
    )
    r = cli("backfill", str(job), "--from", "2026-11-01", "--to", "2026-11-02")
    assert r.returncode == 2, r.output
    assert _status(metrics) == "failed" and _job_name(metrics) == "days"


def test_a_config_error_is_pushed_to_the_pushgateway(
    catalog: Path, bundle_dir: Path, tmp_path: Path, gateway: Any
) -> None:
    host, port = gateway.server_address[:2]
    job = _bad_job(tmp_path, catalog, bundle_dir, 'precision = "fp64"\n')
    r = cli("run", str(job), "--pushgateway", f"http://{host}:{port}")
    assert r.returncode == 2, r.output
    ((path, body),) = gateway.requests
    assert path == "/metrics/job/nightly"
    assert 'score_catalog_last_run_status{job_name="nightly",status="failed"} 1.0' in body.decode()
