"""Issue 6 through the real CLI: drift against the previous run, JSON logs, the HTML report,
the metrics file, and the plan and report commands."""

from __future__ import annotations

import json
from pathlib import Path

import dask.dataframe as dd
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.cli.demo import FEATURES
from tests.conftest import write_shards
from tests.integration.helpers import CliResult, cli, control_of, job_args, report

pytestmark = pytest.mark.integration


def _run(inp: Path, root: Path, bundle: Path, date: str, *extra: str) -> CliResult:
    """`run` into ``root/DATE`` on the sync scheduler."""
    return cli(
        "run",
        *job_args(inp, root / "{date}", bundle),
        "--date",
        date,
        "--scheduler",
        "sync",
        *extra,
    )


def _shifted(src: Path, dst: Path, offset: float) -> Path:
    """The same shards with every feature moved by ``offset`` (an upstream feature broke)."""
    dst.mkdir(parents=True)
    for p in sorted(src.glob("*.parquet")):
        t = pq.read_table(p)
        for name in FEATURES:
            i = t.schema.get_field_index(name)
            t = t.set_column(
                i, name, pc.add(t.column(name), pa.scalar(offset, t.schema.field(i).type))
            )
        pq.write_table(t, dst / p.name, row_group_size=1000)
    return dst


@pytest.mark.slow
def test_drift_crosses_threshold_on_shifted_data_not_on_identical_rerun(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "scored"
    first = _run(catalog, root, bundle_dir, "2026-11-01")
    assert first.returncode == 0, first.stderr
    assert report(root / "2026-11-01")["drift"]["baseline"] is None  # nothing to compare with
    first_id = report(root / "2026-11-01")["run_id"]
    resumed = _run(catalog, root, bundle_dir, "2026-11-01")  # every shard done: nothing scored
    assert resumed.returncode == 0, resumed.stdout
    # The same dataset: the first run's verdict (nothing to compare with) stands.
    assert report(root / "2026-11-01")["drift"]["baseline"] is None
    assert report(root / "2026-11-01")["verdict"]["judged_by"] == first_id

    same = _run(catalog, root, bundle_dir, "2026-11-02")
    assert same.returncode == 0, same.stderr
    d = report(root / "2026-11-02")["drift"]
    # The resume that scored nothing is no baseline; the first run is, although the resume
    # replaced its _report.json (the index entry keeps its sketches).
    assert d["baseline"]["run_id"] == first_id
    assert d["alert"] is False
    assert all(c["psi"] < 0.01 and c["ks"] < 0.02 for c in d["columns"].values()), d

    shifted = _shifted(catalog, tmp_path / "shifted", 3.0)
    moved = _run(shifted, root, bundle_dir, "2026-11-03")
    assert moved.returncode == 4, moved.stdout + moved.stderr
    rep = report(root / "2026-11-03")
    assert rep["status"] == "succeeded_with_warnings"
    assert rep["drift"]["alert"] is True
    assert rep["drift"]["baseline"]["run_id"] == report(root / "2026-11-02")["run_id"]
    assert rep["drift"]["columns"]["score"]["psi"] > 0.25
    assert any("drift" in w for w in rep["warnings"])
    assert (root / "2026-11-03" / "_SUCCESS").exists()  # the scores are complete all the same
    assert "SUCCEEDED_WITH_WARNINGS" in moved.stdout


def test_json_logs_every_line_parses_with_the_documented_fields(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    r = cli(
        "run",
        *job_args(catalog, tmp_path / "out", bundle_dir),
        "--scheduler",
        "local",
        "--workers",
        "2",
        "--log-format",
        "json",
    )
    assert r.returncode == 0, r.stderr
    for stream in (r.stdout, r.stderr):
        assert "\x1b" not in stream and "\r" not in stream
    err = [json.loads(line) for line in r.stderr.splitlines()]
    out = [json.loads(line) for line in r.stdout.splitlines()]
    assert all({"time", "level", "event"} <= set(e) for e in err + out)
    scored = [e for e in err if e["event"] == "shard_scored"]
    assert sorted(e["shard"] for e in scored) == sorted(p.name for p in catalog.glob("*.parquet"))
    assert all(e["rows"] > 0 and e["rows_per_s"] > 0 for e in scored)
    (summary,) = out
    assert summary["event"] == "summary" and summary["status"] == "succeeded"
    assert summary["rows_out"] == 7300 and summary["exit_code"] == 0


def test_json_logs_for_an_error_before_scoring(tmp_path: Path, bundle_dir: Path) -> None:
    r = cli(
        "run",
        *job_args(tmp_path / "nothing-here", tmp_path / "out", bundle_dir),
        "--log-format",
        "json",
    )
    assert r.returncode == 3, r.stderr
    lines = [json.loads(line) for line in r.stderr.splitlines()]
    assert lines[-1]["event"] == "error" and lines[-1]["exit_code"] == 3
    assert "nothing-here" in lines[-1]["message"]


def test_html_report_and_metrics_match_the_json_report(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    metrics = tmp_path / "textfile" / "score_catalog.prom"
    metrics.parent.mkdir()
    r = cli(
        "run",
        *job_args(catalog, out, bundle_dir),
        "--scheduler",
        "sync",
        "--metrics-file",
        str(metrics),
    )
    assert r.returncode == 0, r.stderr
    rep = report(out)
    page = (control_of(out) / "_report.html").read_text()
    for section in ("status", "totals", "shards", "throughput", "latency", "scores", "drift"):
        assert f'id="{section}"' in page
    assert "http://" not in page and "https://" not in page and "<script" not in page
    # The argmax label is discrete: rows per value, equal to the output's own counts (at this
    # size every row is in the sample), drawn as bars; the probability keeps its histogram.
    labels = ds.dataset(out, format="parquet").to_table(columns=["label"]).column("label")
    values, counts = np.unique(labels.to_numpy(), return_counts=True)
    expected = {"values": values.tolist(), "counts": counts.tolist()}
    assert rep["outputs"]["label"]["value_counts"] == expected
    assert "value_counts" not in rep["outputs"]["score"]
    assert "Rows per value of label" in page and "Distribution of score" in page
    assert "Scoring began" in page  # the throughput line starts with the first shard
    # The output reads as a dataset: the page and the run index are beside it, not in it.
    assert ds.dataset(out, format="parquet").count_rows() == 7300
    assert len(dd.read_parquet(str(out)).compute()) == 7300

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(metrics.read_text())
        for s in fam.samples
    }
    # One prefix, no `job` label (Prometheus's own, on node_exporter's series): `job_name`.
    assert all(name.startswith("score_catalog_last_") for name, _ in samples)
    assert all(dict(labels)["job_name"] == rep["job"] for _, labels in samples)
    job = (("job_name", rep["job"]),)
    assert samples[("score_catalog_last_run_scored_rows", job)] == rep["rows_out"] == 7300
    assert samples[("score_catalog_last_run_rejected_rows", job)] == rep["rows_rejected"]
    assert samples[("score_catalog_last_run_failed_shards", job)] == rep["shards_failed"]
    duration = samples[("score_catalog_last_run_duration_seconds", job)]
    assert duration == pytest.approx(rep["duration_s"])
    throughput = samples[("score_catalog_last_run_throughput_rows_per_second", job)]
    assert throughput == pytest.approx(rep["rows_per_s"])
    status = (("job_name", rep["job"]), ("status", "succeeded"))
    assert samples[("score_catalog_last_run_status", status)] == 1
    assert list(metrics.parent.iterdir()) == [metrics]  # written atomically: no temp file left


def test_metrics_file_records_a_failure_before_scoring(bundle_dir: Path, tmp_path: Path) -> None:
    metrics = tmp_path / "m.prom"
    r = cli(
        "run",
        *job_args(tmp_path / "missing", tmp_path / "out", bundle_dir),
        "--metrics-file",
        str(metrics),
    )
    assert r.returncode == 3
    text = metrics.read_text()
    assert 'score_catalog_last_run_status{job_name="score-catalog",status="failed"} 1.0' in text


@pytest.mark.slow
def test_plan_names_a_broken_shard_and_scores_nothing(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    (catalog / "part-broken.parquet").write_bytes(b"PAR1 this is not parquet")
    out = tmp_path / "out"
    r = cli(
        "plan",
        *job_args(catalog, out, bundle_dir),
        "--batch-size",
        "512",
    )
    assert r.returncode == 3, r.stdout + r.stderr
    assert "part-broken.parquet" in r.stdout and "PROBLEM" in r.stdout
    assert "7,300 in footers, 7,300 to score" in r.stdout
    assert not out.exists()  # nothing written, no lock taken

    j = cli("plan", *job_args(catalog, out, bundle_dir), "--json")
    assert j.returncode == 3, j.stderr  # the same problem, the same exit code as text output
    plan = json.loads(j.stdout)
    assert plan["shards_failing"] == 1 and plan["shards_to_score"] == 3
    assert plan["calibration"]["rows_per_s"] > 0 and plan["estimated_scoring_s"] > 0


@pytest.mark.slow
def test_plan_says_what_a_resume_would_skip(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = job_args(catalog, out, bundle_dir)
    assert cli("run", *args, "--scheduler", "sync").returncode == 0
    write_shards(catalog / "new", [900], start=10_000)
    r = cli("plan", *args, "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    actions = {s["rel_path"]: s["action"] for s in plan["shards"]}
    assert actions.pop("new/part-00000.parquet") == "score"
    assert set(actions.values()) == {"skip (done)"}
    assert plan["rows_to_score"] == 900


@pytest.mark.slow
def test_report_vs_shows_sane_changes_against_a_base_near_zero(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    """The case that printed ``+402501073323306.0%``: the other run's scores sat near 0 (a model
    whose positive class was all but impossible) and it rejected nothing. Score quantiles now
    change by their difference, and rejected rows by their count against none."""
    import torch

    from pipeline.cli.demo import export_bundle
    from tests.conftest import demo_toml, make_model

    silent = make_model()
    with torch.no_grad():  # softmax[:, 1] = e^-60 / (1 + e^-60), about 1e-26, for every row
        silent.net[-1].weight.zero_()
        silent.net[-1].bias.copy_(torch.tensor([30.0, -30.0]))
    silent_bundle = export_bundle(silent, tmp_path / "silent", demo_toml(), n_in=16)
    root = tmp_path / "scored"
    assert _run(catalog, root, silent_bundle, "2026-11-01").returncode == 0
    with_nulls = tmp_path / "nulls"
    with_nulls.mkdir()
    for p in sorted(catalog.glob("*.parquet")):
        t = pq.read_table(p)
        if p.name == "part-00000.parquet":  # 25 rows with a null feature: rejected
            i = t.schema.get_field_index("f2")
            values = t.column("f2").to_pylist()
            values[:25] = [None] * 25
            t = t.set_column(i, "f2", pa.array(values, pa.float32()))
        pq.write_table(t, with_nulls / p.name, row_group_size=1000)
    _run(with_nulls, root, bundle_dir, "2026-11-02")  # drift against the silent model: exit 4
    now, then = report(root / "2026-11-02"), report(root / "2026-11-01")
    assert now["rows_rejected"] == 25 and then["rows_rejected"] == 0
    assert 0 < then["outputs"]["score"]["quantiles"]["p05"] < 1e-20

    both = cli("report", str(root / "2026-11-02"), "--vs", str(root / "2026-11-01"))
    assert both.returncode == 0, both.stderr
    rows = {
        line[:25].strip(): line[25:].split()
        for line in both.stdout.splitlines()
        if line.startswith("  ") and len(line) > 25
    }
    for q in ("p05", "p50", "p95"):
        x, y = (r["outputs"]["score"]["quantiles"][q] for r in (now, then))
        assert rows[f"score {q}"] == [f"{x:.4f}", f"{y:.4f}", f"{x - y:+.4f}"], both.stdout
    assert rows["rows_rejected"] == ["25", "0", "+25"], both.stdout
    assert rows["rows_in"] == ["7,300", "7,300", "+0.0%"], both.stdout
    assert rows["rows_out"] == ["7,275", "7,300", "-0.3%"], both.stdout
    assert "%" not in "".join(rows[f"score {q}"][2] for q in ("p05", "p50", "p95"))


@pytest.mark.slow
def test_report_command_summary_and_side_by_side(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "scored"
    assert _run(catalog, root, bundle_dir, "2026-11-01").returncode == 0
    shifted = _shifted(catalog, tmp_path / "shifted", 3.0)
    assert _run(shifted, root, bundle_dir, "2026-11-02").returncode == 4
    one = cli("report", str(root / "2026-11-01"))
    assert one.returncode == 0, one.stderr
    assert report(root / "2026-11-01")["run_id"] in one.stdout and "SUCCEEDED" in one.stdout
    both = cli("report", str(root / "2026-11-02"), "--vs", str(root / "2026-11-01"))
    assert both.returncode == 0, both.stderr
    assert "score p50" in both.stdout and "PSI" in both.stdout and "ALERT" in both.stdout
    missing = cli("report", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "no run report" in missing.stderr  # usage (issue 13)
