"""Metrics files read back with prometheus_client's own parser and checked by ``promtool check
metrics`` (Prometheus's own linter); pushes to a real HTTP server."""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.core.errors import StorageError
from pipeline.core.statuses import RunStatus
from pipeline.report.metrics import (
    LAST_SUCCESS,
    STATUSES,
    previous_success_timestamp,
    push_metrics,
    registry_for,
    write_metrics_file,
)
from tests.conftest import REPO

JOB = "nightly-catalog"


def report(status: str = "succeeded", day: int = 1, **extra: Any) -> dict[str, Any]:
    """The fields of a ``_report.json`` that the metrics read, with realistic values."""
    data: dict[str, Any] = {
        "run_id": f"202603{day:02d}T020000Z-a1b2c3",
        "job": JOB,
        "status": status,
        "started_at": f"2026-03-{day:02d}T02:00:00.125000+00:00",
        "finished_at": f"2026-03-{day:02d}T02:14:31.625000+00:00",
        "duration_s": 871.5,
        "rows_in": 7_300_000,
        "rows_out": 7_299_412,
        "rows_rejected": 588,
        "shards_failed": 0 if status != "failed" else 3,
        "rows_processed": 7_300_000,
        "rows_per_s": 8375.7,
        "drift": {
            "baseline": {"run_id": "20260228T020000Z-ffffff"},
            "columns": {
                "score_p1": {"psi": 0.031, "ks": 0.04, "alert": False},
                "label": {"psi": 0.4, "ks": 0.22, "alert": True},
                "new_col": {"psi": None, "ks": None, "alert": True},
            },
            "alert": True,
        },
    }
    data.update(extra)
    return data


def ts(iso: str) -> float:
    return dt.datetime.fromisoformat(iso).timestamp()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a text exposition as {(name, sorted labels): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(found: dict[Any, float], name: str, **labels: str) -> float:
    return found[(f"score_catalog_{name}", tuple(sorted({"job_name": JOB, **labels}.items())))]


def test_file_values_equal_the_report(tmp_path: Path) -> None:
    path = tmp_path / "score_catalog_nightly.prom"
    r = report()
    write_metrics_file(str(path), r)
    text = path.read_text()
    found = samples(text)
    assert value(found, "last_run_start_timestamp_seconds") == ts(r["started_at"])
    assert value(found, "last_run_end_timestamp_seconds") == ts(r["finished_at"])
    assert value(found, "last_success_timestamp_seconds") == ts(r["finished_at"])
    assert value(found, "last_run_duration_seconds") == r["duration_s"]
    assert value(found, "last_run_scored_rows") == r["rows_out"]
    assert value(found, "last_run_rejected_rows") == r["rows_rejected"]
    assert value(found, "last_run_failed_shards") == r["shards_failed"]
    assert value(found, "last_run_throughput_rows_per_second") == r["rows_per_s"]
    assert value(found, "last_run_drift_psi", output="score_p1") == 0.031
    assert value(found, "last_run_drift_psi", output="label") == 0.4
    for s in STATUSES:
        assert value(found, "last_run_status", status=s) == (1.0 if s == "succeeded" else 0.0)
    # The column without a PSI has no sample; nothing beyond the above is exported.
    assert (
        "score_catalog_last_run_drift_psi",
        (("job_name", JOB), ("output", "new_col")),
    ) not in found
    # The alert is open: nobody accepted it (the report has no verdict saying so).
    assert value(found, "last_run_drift_accepted") == 0
    assert len(found) == 8 + 2 + 1 + len(STATUSES)  # no table version: not a Delta table
    assert "# HELP score_catalog_last_success_timestamp_seconds Unix time" in text
    assert "# TYPE score_catalog_last_run_status gauge" in text


def test_drift_accepted_is_1_once_accepted_and_absent_without_an_alert(tmp_path: Path) -> None:
    path = tmp_path / "m.prom"
    accepted = {"by": "alice", "at": "2026-03-01T09:00:00+00:00", "reason": "new feed"}
    verdict = {"dataset": "d", "judged_by": "r", "judged_at": "t", "reused": True}
    write_metrics_file(str(path), report(verdict={**verdict, "accepted": accepted}))
    assert value(samples(path.read_text()), "last_run_drift_accepted") == 1
    calm = report(drift={"baseline": None, "note": "first run"}, verdict=None)
    write_metrics_file(str(path), calm)
    assert not any(
        name == "score_catalog_last_run_drift_accepted" for name, _ in samples(path.read_text())
    )


def test_carried_and_model_rows_are_an_incremental_run_s_and_absent_otherwise(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.prom"
    write_metrics_file(str(path), report(incremental=INCREMENTAL))
    found = samples(path.read_text())
    assert value(found, "last_run_carried_rows") == 7_210_000
    assert value(found, "last_run_model_rows") == 90_000
    for plain in (None, {}):
        write_metrics_file(str(path), report(incremental=plain))
        names = {name for name, _ in samples(path.read_text())}
        assert not names & {
            "score_catalog_last_run_carried_rows",
            "score_catalog_last_run_model_rows",
        }


def test_table_version_is_the_delta_tables_and_absent_for_a_folder(tmp_path: Path) -> None:
    path = tmp_path / "m.prom"
    fmt = {"format": "delta", "table": "s3://b/scored", "partition": "run_date=2026-03-01"}
    write_metrics_file(str(path), report(output_format={**fmt, "version": 7, "committed": True}))
    found = samples(path.read_text())
    assert value(found, "table_version", partition="run_date=2026-03-01") == 7
    for folder in ({"format": "parquet_folder"}, None, {**fmt, "version": None}):
        write_metrics_file(str(path), report(output_format=folder))
        names = {name for name, _ in samples(path.read_text())}
        assert "score_catalog_table_version" not in names


# --- Names and labels that fit Prometheus --------------------------------------------------

#: Unit suffixes in Prometheus's naming convention for what a run measures; a name ends in one
#: unless its value has no unit (an index, a 0/1 state).
UNITS = ("_timestamp_seconds", "_seconds", "_rows", "_shards", "_rows_per_second")
UNITLESS = {
    "score_catalog_table_version",
    "score_catalog_last_run_drift_psi",
    "score_catalog_last_run_drift_accepted",
    "score_catalog_last_run_status",
}


INCREMENTAL = {"rows_carried": 7_210_000, "rows_scored": 90_000, "rows_new": 12_000}


def _families(tmp_path: Path, **extra: Any) -> tuple[str, list[Any]]:
    path = tmp_path / "score_catalog.prom"
    write_metrics_file(str(path), report(**{"incremental": INCREMENTAL, **extra}))
    text = path.read_text()
    return text, list(text_string_to_metric_families(text))


def test_names_and_labels_fit_prometheus_conventions(tmp_path: Path) -> None:
    text, families = _families(tmp_path)
    assert len(families) == 14
    for fam in families:
        # One prefix, units last, `_total` only on counters (there are none: every metric
        # describes the last run, and a batch job's counter would restart at 0 each run).
        assert re.fullmatch(r"score_catalog_[a-z][a-z0-9_]*", fam.name), fam.name
        assert "score_catalog" not in fam.name[len("score_catalog") :], fam.name
        assert fam.name.endswith(UNITS) or fam.name in UNITLESS, fam.name
        assert fam.type == "gauge" and not fam.name.endswith("_total"), fam.name
        assert fam.documentation, fam.name
        for s in fam.samples:
            # `job` is the label Prometheus sets on what it scrapes (node_exporter's job): ours
            # would come out as `exported_job`.
            assert "job" not in s.labels and s.labels["job_name"] == JOB, s
    assert "job=" not in text


def test_promtool_check_metrics_passes(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        # Debian's `prometheus` package ships it (apt-get install prometheus); no PyPI wheel does.
        pytest.skip("promtool is not installed (Debian package `prometheus`)")
    text, _ = _families(tmp_path)
    lint = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert (lint.returncode, lint.stdout + lint.stderr) == (0, "")
    # The linter does catch what it is here for: a `_total` gauge and a counter without one.
    bad = "# HELP a_total x\n# TYPE a_total gauge\na_total 1\n# HELP b x\n# TYPE b counter\nb 1\n"
    lint = subprocess.run(
        [promtool, "check", "metrics"], input=bad, capture_output=True, text=True, timeout=60
    )
    assert lint.returncode != 0 and "_total" in lint.stdout + lint.stderr


def test_docs_table_lists_exactly_the_metrics(tmp_path: Path) -> None:
    _, families = _families(tmp_path)
    doc = (REPO / "docs" / "monitoring.md").read_text(encoding="utf-8")
    section = doc.split("\n## Metrics", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(score_catalog_[a-z0-9_]+)", section, flags=re.M)
    assert sorted(rows) == sorted(f.name for f in families)


def test_last_success_carried_from_a_file_labelled_job(tmp_path: Path) -> None:
    # A file from before the `job_name` label: the first run after an upgrade, failing, keeps
    # the last success instead of resetting the "hours since last success" alert.
    path = tmp_path / "score_catalog.prom"
    path.write_text(
        f"# HELP {LAST_SUCCESS} x\n# TYPE {LAST_SUCCESS} gauge\n"
        f'{LAST_SUCCESS}{{job="{JOB}"}} 1.7723310716e+09\n'
    )
    write_metrics_file(str(path), report("failed", day=2, drift=None))
    found = samples(path.read_text())
    assert value(found, "last_success_timestamp_seconds") == 1.7723310716e09
    assert not any(("job", JOB) in labels for _, labels in found)


def test_failed_run_keeps_the_previous_success(tmp_path: Path) -> None:
    path = str(tmp_path / "score_catalog.prom")
    ok = report("succeeded", day=1)
    write_metrics_file(path, ok)
    assert previous_success_timestamp(path, JOB) == ts(ok["finished_at"])

    failed = report("failed", day=2, drift=None)
    write_metrics_file(path, failed)
    found = samples(Path(path).read_text())
    assert value(found, "last_success_timestamp_seconds") == ts(ok["finished_at"])
    assert value(found, "last_run_end_timestamp_seconds") == ts(failed["finished_at"])
    assert value(found, "last_run_status", status="failed") == 1.0
    assert value(found, "last_run_status", status="succeeded") == 0.0
    assert value(found, "last_run_failed_shards") == 3

    # And again: the carried timestamp survives a second failure, then a success moves it.
    write_metrics_file(path, report("failed", day=3, drift=None))
    assert previous_success_timestamp(path, JOB) == ts(ok["finished_at"])
    later = report("succeeded_with_errors", day=4)
    write_metrics_file(path, later)
    assert previous_success_timestamp(path, JOB) == ts(later["finished_at"])


def test_status_labels_are_the_run_statuses() -> None:
    assert tuple(s.value for s in RunStatus) == STATUSES
    assert "interrupted" in STATUSES


def test_interrupted_run_is_not_a_success(tmp_path: Path) -> None:
    path = str(tmp_path / "score_catalog.prom")
    ok = report("succeeded", day=1)
    write_metrics_file(path, ok)
    stopped = report(RunStatus.INTERRUPTED, day=2, drift=None)
    write_metrics_file(path, stopped)
    found = samples(Path(path).read_text())
    assert value(found, "last_success_timestamp_seconds") == ts(ok["finished_at"])
    assert value(found, "last_run_end_timestamp_seconds") == ts(stopped["finished_at"])
    assert value(found, "last_run_status", status="interrupted") == 1.0
    assert sum(value(found, "last_run_status", status=s) for s in STATUSES) == 1.0


def test_failed_run_without_history_has_no_last_success(tmp_path: Path) -> None:
    path = tmp_path / "score_catalog.prom"
    write_metrics_file(str(path), report("failed"))
    found = samples(path.read_text())
    assert not any(name.endswith("last_success_timestamp_seconds") for name, _ in found)
    assert value(found, "last_run_status", status="failed") == 1.0


def test_early_failure_summary(tmp_path: Path) -> None:
    # What run.py exports when a run stops before scoring: no drift, fewer fields.
    r = {
        "job": JOB,
        "status": "failed",
        "started_at": "2026-03-02T02:00:00+00:00",
        "finished_at": "2026-03-02T02:00:01.5+00:00",
        "duration_s": 1.5,
        "rows_out": 0,
        "rows_rejected": 0,
        "shards_failed": 0,
        "rows_per_s": 0.0,
        "drift": None,
        "error": "input /data/in/2026-03-02 does not exist",
    }
    path = tmp_path / "m.prom"
    write_metrics_file(str(path), r)
    found = samples(path.read_text())
    assert value(found, "last_run_scored_rows") == 0
    assert value(found, "last_run_duration_seconds") == 1.5


def test_no_drift_means_no_drift_samples(tmp_path: Path) -> None:
    for i, drift in enumerate([None, {"baseline": None, "note": "no previous run"}]):
        path = tmp_path / f"m{i}.prom"
        write_metrics_file(str(path), report(drift=drift))
        text = path.read_text()
        assert "score_catalog_last_run_drift_psi{" not in text
        found = samples(text)
        assert not any(name == "score_catalog_last_run_drift_psi" for name, _ in found)
    r = report()
    del r["drift"]
    reg = registry_for(r, previous_success_ts=None)
    labels = {"job_name": JOB, "output": "score_p1"}
    assert reg.get_sample_value("score_catalog_last_run_drift_psi", labels) is None


def test_a_run_that_scored_nothing_has_no_throughput() -> None:
    # Stopped before scoring, or a resume with nothing left to do: no rate, not a rate of 0.
    reg = registry_for(report(rows_processed=0, rows_per_s=0.0), previous_success_ts=None)
    labels = {"job_name": JOB}
    assert reg.get_sample_value("score_catalog_last_run_throughput_rows_per_second", labels) is None
    assert reg.get_sample_value("score_catalog_last_run_scored_rows", labels) == 7_299_412


def test_missing_fields_are_left_out() -> None:
    r = report()
    del r["rows_per_s"]
    r["duration_s"] = None
    reg = registry_for(r, previous_success_ts=None)
    assert (
        reg.get_sample_value("score_catalog_last_run_throughput_rows_per_second", {"job_name": JOB})
        is None
    )
    assert (
        reg.get_sample_value("score_catalog_last_run_duration_seconds", {"job_name": JOB}) is None
    )
    assert (
        reg.get_sample_value("score_catalog_last_run_scored_rows", {"job_name": JOB})
        == r["rows_out"]
    )


def test_file_is_replaced_atomically(tmp_path: Path) -> None:
    path = tmp_path / "score_catalog.prom"
    write_metrics_file(str(path), report(day=1))
    first = os.stat(path).st_ino
    write_metrics_file(str(path), report(day=2))
    # A new inode: the file was renamed into place, never rewritten where a reader could see
    # half of it; and no temporary file is left beside it.
    assert os.stat(path).st_ino != first
    assert os.listdir(tmp_path) == ["score_catalog.prom"]
    found = samples(path.read_text())
    assert value(found, "last_run_end_timestamp_seconds") == ts(report(day=2)["finished_at"])


def test_missing_directory_is_a_storage_error(tmp_path: Path) -> None:
    path = tmp_path / "no-such-dir" / "score_catalog.prom"
    with pytest.raises(StorageError, match=r"cannot write metrics file .*no-such-dir") as err:
        write_metrics_file(str(path), report())
    assert "collector.textfile.directory" in str(err.value)
    assert not (tmp_path / "no-such-dir").exists()


def test_previous_success_of_missing_garbled_or_other_job(tmp_path: Path) -> None:
    path = tmp_path / "m.prom"
    assert previous_success_timestamp(str(path), JOB) is None
    path.write_text('score_catalog_last_success_timestamp_seconds{job_name="x" 17\n}}} garbage\n')
    assert previous_success_timestamp(str(path), JOB) is None
    path.write_bytes(b"\xff\xfe\x00\x01")
    assert previous_success_timestamp(str(path), JOB) is None
    write_metrics_file(str(path), report())
    assert previous_success_timestamp(str(path), "another-job") is None


# --- Pushgateway ---------------------------------------------------------------------------


class Recorder(BaseHTTPRequestHandler):
    """Records every request; answers with the server's ``status`` attribute."""

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        server: Any = self.server
        server.requests.append((self.command, self.path, dict(self.headers), body))
        self.send_response(server.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_PUT = do_POST = do_DELETE = _handle

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass


@pytest.fixture
def gateway() -> Iterator[Any]:
    server: Any = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.requests = []
    server.status = 200
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def url_of(server: Any) -> str:
    host, port = server.server_address[:2]
    return f"http://{host}:{port}"


def test_push_sends_the_metrics(gateway: Any) -> None:
    r = report()
    push_metrics(url_of(gateway), r, timeout=5)
    [(method, path, headers, body)] = gateway.requests
    assert method == "PUT"
    assert path == f"/metrics/job/{JOB}"
    assert headers["Content-Type"].startswith("text/plain")
    found = samples(body.decode())
    # The job is the grouping key (in the path); the series carry the textfile's job_name.
    assert all(dict(labels)["job_name"] == JOB and "job" not in dict(labels) for _, labels in found)
    assert value(found, "last_run_scored_rows") == r["rows_out"]
    assert value(found, "last_success_timestamp_seconds") == ts(r["finished_at"])
    assert value(found, "last_run_status", status="succeeded") == 1.0


def test_push_of_failed_run_carries_the_given_success(gateway: Any) -> None:
    push_metrics(url_of(gateway), report("failed"), previous_success_ts=1_772_330_071.5)
    found = samples(gateway.requests[0][3].decode())
    assert value(found, "last_success_timestamp_seconds") == 1_772_330_071.5


def test_push_job_names_are_escaped(gateway: Any) -> None:
    push_metrics(url_of(gateway), report(job="team/nightly catalog"))
    path = gateway.requests[0][1]
    # prometheus_client base64-encodes a grouping value containing "/" (Pushgateway's rule).
    assert path.startswith("/metrics/job@base64/")


def test_push_error_answer_is_a_storage_error(gateway: Any) -> None:
    gateway.status = 500
    with pytest.raises(StorageError, match=f"Pushgateway {url_of(gateway)}"):
        push_metrics(url_of(gateway), report())


def test_push_to_closed_port_is_a_storage_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(StorageError, match=f"cannot push metrics to Pushgateway {url}"):
        push_metrics(url, report(), timeout=2)
