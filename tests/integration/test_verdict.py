"""Issue 22, item 2 through the real CLI: a drift verdict belongs to the dataset.

A drift verdict belongs to the dataset: a rerun that leaves the output's data unchanged reports
the verdict of the run that judged it (status, exit code, warnings, the HTML drift section and
the PSI gauges), a partial rerun judges the whole dataset again against the previous
*different* dataset of the job, and ``score-catalog accept-drift`` is the one way to turn an
alert into a success, recorded in the run index.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.cli.demo import FEATURES
from pipeline.io import runindex
from tests.integration.helpers import CliResult, cli, control_of, job_args, report

pytestmark = pytest.mark.integration

DAY1, DAY2 = "2026-11-01", "2026-11-02"


def _run(inp: Path, root: Path, bundle: Path, date: str, *extra: str, **kw: object) -> CliResult:
    """`run` into ``root/DATE`` on the sync scheduler."""
    args = job_args(inp, root / "{date}", bundle)
    return cli("run", *args, "--date", date, "--scheduler", "sync", *extra, **kw)  # type: ignore[arg-type]


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


def _metrics(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "job_name"))): s.value
        for fam in text_string_to_metric_families(path.read_text())
        for s in fam.samples
    }


def _status_of(metrics: Path) -> str:
    (status,) = [
        dict(labels)["status"]
        for (name, labels), v in _metrics(metrics).items()
        if name == "score_catalog_last_run_status" and v == 1
    ]
    return status


def _psi(metrics: Path) -> dict[str, float]:
    return {
        dict(labels)["output"]: v
        for (name, labels), v in _metrics(metrics).items()
        if name == "score_catalog_last_run_drift_psi"
    }


def _acceptances(root: Path) -> list[Path]:
    """The drift acceptances in the run index of the job writing ``root/{date}``."""
    index = Path(runindex.index_root(str(root / "{date}"))) / runindex.INDEX_DIR
    return sorted(index.rglob(f"{runindex.ACCEPTED_DIR}/*.json"))


@pytest.fixture
def drifted(catalog: Path, bundle_dir: Path, tmp_path: Path) -> tuple[Path, Path, CliResult]:
    """Day 1 on the catalog, day 2 on the same catalog with every feature shifted: day 2
    drifted (exit 4). Returns the output root, day 2's input and day 2's result."""
    root = tmp_path / "scored"
    assert _run(catalog, root, bundle_dir, DAY1).returncode == 0
    shifted = _shifted(catalog, tmp_path / "shifted", 3.0)
    metrics = tmp_path / "m.prom"
    night = _run(shifted, root, bundle_dir, DAY2, "--metrics-file", str(metrics))
    assert night.returncode == 4, night.output
    return root, shifted, night


def test_a_rerun_over_unchanged_data_keeps_the_drift_verdict(
    drifted: tuple[Path, Path, CliResult], bundle_dir: Path, tmp_path: Path
) -> None:
    root, shifted, night = drifted
    first = night.report
    assert first is not None and first["status"] == "succeeded_with_warnings"
    metrics = tmp_path / "m.prom"
    first_psi = _psi(metrics)
    assert first_psi["score"] > 0.25

    again = _run(shifted, root, bundle_dir, DAY2, "--metrics-file", str(metrics))
    assert again.returncode == 4, again.output  # the same exit code as the night that judged it
    rep = again.report
    assert rep is not None and rep["run_id"] != first["run_id"]
    assert rep["shards_scored"] == 0 and rep["shards_skipped"] == 3
    assert rep["status"] == "succeeded_with_warnings"
    assert rep["drift"] == first["drift"]  # the same comparison, not "this run scored no rows"
    drift_warnings = [w for w in rep["warnings"] if w.startswith("drift")]
    assert drift_warnings == [w for w in first["warnings"] if w.startswith("drift")]
    assert drift_warnings
    assert rep["verdict"]["reused"] is True and rep["verdict"]["accepted"] is None
    assert rep["verdict"]["judged_by"] == first["run_id"]
    assert rep["verdict"]["dataset"] == first["verdict"]["dataset"]
    assert "SUCCEEDED_WITH_WARNINGS" in again.stdout
    page = (control_of(root / DAY2) / "_report.html").read_text()
    assert "DRIFT ALERT" in page and first["drift"]["baseline"]["run_id"] in page
    assert _status_of(metrics) == "succeeded_with_warnings"
    assert _psi(metrics) == first_psi  # the PSI gauge stays, with the same values
    assert (root / DAY2 / "_SUCCESS").exists()


def test_a_partial_rerun_judges_the_whole_dataset_against_the_previous_day(
    drifted: tuple[Path, Path, CliResult], catalog: Path, bundle_dir: Path
) -> None:
    root, shifted, night = drifted
    first = night.report
    assert first is not None
    day1 = report(root / DAY1)
    # Upstream fixes one shard of day 2 (a third of the rows): only it is scored again.
    shutil.copy(catalog / "part-00000.parquet", shifted / "part-00000.parquet")
    again = _run(shifted, root, bundle_dir, DAY2)
    rep = again.report
    assert rep is not None and rep["shards_scored"] == 1 and rep["shards_skipped"] == 2
    # Day 2 is still compared with day 1, not with its own earlier version...
    assert rep["drift"]["baseline"]["run_id"] == day1["run_id"]
    # ...and over every row now in the output, not only the shard scored now.
    assert (
        rep["drift"]["rows"]["current"]
        == rep["rows_out"]
        == sum(pq.read_metadata(p).num_rows for p in shifted.glob("*.parquet"))
    )
    assert rep["outputs"]["score"]["count"] == rep["rows_out"]
    # Two thirds of the data are still shifted: the alert stands.
    assert rep["drift"]["alert"] is True and again.returncode == 4, again.output
    # Between the two alerts of the same day: the partial fix moved the distribution less than
    # the whole shift did.
    psi = rep["drift"]["columns"]["score"]["psi"]
    assert 0.25 < psi < first["drift"]["columns"]["score"]["psi"]
    assert rep["verdict"]["reused"] is False
    assert rep["verdict"]["dataset"] != first["verdict"]["dataset"]


@pytest.mark.slow
def test_accept_drift_is_recorded_and_the_rerun_exits_0(
    drifted: tuple[Path, Path, CliResult], bundle_dir: Path, tmp_path: Path
) -> None:
    root, shifted, night = drifted
    first = night.report
    assert first is not None
    metrics = tmp_path / "m.prom"
    reason = "new supplier feed, reviewed in INC-123"
    ok = cli("accept-drift", str(root / DAY2), "--reason", reason, "--by", "alice")
    assert ok.returncode == 0, ok.output
    assert "accepted by alice" in ok.stdout
    (entry_path,) = _acceptances(root)
    entry = json.loads(entry_path.read_text())
    assert entry["by"] == "alice" and entry["reason"] == reason
    assert entry["dataset"] == first["verdict"]["dataset"]
    assert entry["baseline"] == first["drift"]["baseline"]["run_id"]
    assert entry["judged_by"] == first["run_id"]

    again = _run(shifted, root, bundle_dir, DAY2, "--metrics-file", str(metrics))
    assert again.returncode == 0, again.output
    rep = again.report
    assert rep is not None and rep["status"] == "succeeded"
    accepted = rep["verdict"]["accepted"]
    assert accepted["by"] == "alice" and accepted["reason"] == reason
    assert accepted["at"] == entry["at"]
    assert rep["drift"]["alert"] is True  # the facts stay; the alert is accepted
    assert any("drift accepted by alice" in w and reason in w for w in rep["warnings"])
    assert "drift accepted by alice" in again.stdout
    assert "DRIFT ALERT, ACCEPTED" in (control_of(root / DAY2) / "_report.html").read_text()
    assert _status_of(metrics) == "succeeded"
    found = _metrics(metrics)
    assert found[("score_catalog_last_run_drift_accepted", ())] == 1
    assert _psi(metrics)["score"] > 0.25


def test_accept_drift_refuses_what_it_cannot_accept(
    drifted: tuple[Path, Path, CliResult], tmp_path: Path
) -> None:
    root, _, _ = drifted
    calm = cli("accept-drift", str(root / DAY1), "--reason", "x")
    assert calm.returncode == 2 and "no drift alert to accept" in calm.stderr, calm.output
    nothing = cli("accept-drift", str(tmp_path / "nowhere"), "--reason", "x")
    assert nothing.returncode == 2 and "no drift verdict" in nothing.stderr, nothing.output
    blank = cli("accept-drift", str(root / DAY2), "--reason", "  ")
    assert blank.returncode == 2 and "--reason" in blank.stderr, blank.output
    assert not _acceptances(root)


@pytest.mark.slow
def test_changed_data_after_an_acceptance_is_judged_again(
    drifted: tuple[Path, Path, CliResult], bundle_dir: Path, tmp_path: Path
) -> None:
    root, shifted, _ = drifted
    assert cli("accept-drift", str(root / DAY2), "--reason", "ok").returncode == 0
    # Another shard changes upstream (shifted even further): a new dataset, a new verdict.
    p = shifted / "part-00001.parquet"
    t = pq.read_table(p)
    i = t.schema.get_field_index(FEATURES[0])
    t = t.set_column(i, FEATURES[0], pc.add(t.column(i), pa.scalar(1.0, t.schema.field(i).type)))
    pq.write_table(t, p, row_group_size=1000)
    again = _run(shifted, root, bundle_dir, DAY2)
    assert again.returncode == 4, again.output
    assert again.report is not None and again.report["verdict"]["accepted"] is None


@pytest.mark.slow
def test_a_backfill_that_skips_a_drifted_day_keeps_its_verdict(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    archive = tmp_path / "archive"
    shutil.copytree(catalog, archive / f"dt={DAY1}")
    _shifted(catalog, archive / f"dt={DAY2}", 3.0)
    job = tmp_path / "nightly.toml"
    out = tmp_path / "scored"
    job.write_text(
        f'input = "{archive}/dt={{date}}"\noutput = "{out}/dt={{date}}"\n'
        f'model = "{bundle_dir}"\nscheduler = "sync"\n'
    )
    args = ["backfill", str(job), "--from", DAY1, "--to", DAY2]
    assert cli(*args).returncode == 4
    skipped = cli(*args)  # both days are done: skipped, and day 2's verdict still stands
    assert skipped.returncode == 4, skipped.output
    accepted = cli("accept-drift", str(out / f"dt={DAY2}"), "--reason", "expected")
    assert accepted.returncode == 0, accepted.output
    assert cli(*args).returncode == 0
    # Rescored, the same data: the accepted alert is no drift for the backfill either.
    forced = cli(*args, "--force")
    assert forced.returncode == 0, forced.output


# ---------------------------------------------------------------------------------------------
# The baseline: an earlier dataset whose verdict was clean or accepted (breakit22 C4, M3)

DAY3 = "2026-11-03"


def _touch(shard: Path) -> None:
    """Upstream re-exports ``shard`` with the same content: a new version (new mtime)."""
    data = shard.read_bytes()
    shard.unlink()
    shard.write_bytes(data)


def test_a_persistent_shift_alerts_every_night_until_it_is_accepted(
    drifted: tuple[Path, Path, CliResult], bundle_dir: Path, tmp_path: Path
) -> None:
    """Day 2 drifted and nobody accepted it: day 3, shifted the same way, is compared with day
    1 (the alert is no norm) and alerts too; once day 3 is accepted, day 4 is compared with
    it and passes."""
    root, shifted, _ = drifted
    day1 = report(root / DAY1)
    third = _run(shifted, root, bundle_dir, DAY3)
    assert third.returncode == 4, third.output
    assert third.report is not None
    assert third.report["drift"]["baseline"]["run_id"] == day1["run_id"]
    assert cli("accept-drift", str(root / DAY3), "--reason", "new normal").returncode == 0
    fourth = _run(shifted, root, bundle_dir, "2026-11-04")
    assert fourth.returncode == 0, fourth.output
    assert fourth.report is not None
    assert fourth.report["drift"]["baseline"]["run_id"] == third.report["run_id"]
    assert fourth.report["drift"]["alert"] is False


def test_a_drifted_day_judged_again_is_compared_with_the_days_before_it(
    drifted: tuple[Path, Path, CliResult], bundle_dir: Path, tmp_path: Path
) -> None:
    """Day 2 drifted (not accepted); day 3 came with the same shift, and was accepted. Then
    one of day 2's input shards is re-exported with the same content: day 2 is a new dataset,
    judged again, against day 1, never against day 3, which finished later and carries the
    same shift (that hid the alert: exit 0, PSI 0.0007)."""
    root, shifted, _ = drifted
    day1 = report(root / DAY1)
    third = _run(shifted, root, bundle_dir, DAY3)
    assert third.returncode == 4, third.output
    assert cli("accept-drift", str(root / DAY3), "--reason", "ok").returncode == 0
    _touch(shifted / "part-00001.parquet")
    metrics = tmp_path / "m.prom"
    again = _run(shifted, root, bundle_dir, DAY2, "--metrics-file", str(metrics))
    assert again.returncode == 4, again.output
    rep = again.report
    assert rep is not None and rep["shards_scored"] == 1
    assert rep["verdict"]["reused"] is False
    assert rep["drift"]["baseline"]["run_id"] == day1["run_id"]
    assert rep["drift"]["columns"]["score"]["psi"] > 0.25 and rep["drift"]["alert"] is True
    assert _status_of(metrics) == "succeeded_with_warnings"

    # A verdict an older version kept after judging the day against a later one: judged again.
    manifest_path = control_of(root / DAY2) / "_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["verdict"]["drift"]["baseline"]["output"] = str(root / DAY3)
    manifest["verdict"]["drift"]["alert"] = False
    manifest_path.write_text(json.dumps(manifest))
    rerun = _run(shifted, root, bundle_dir, DAY2)
    assert rerun.returncode == 4, rerun.output
    assert rerun.report is not None and rerun.report["verdict"]["reused"] is False
    assert rerun.report["drift"]["baseline"]["run_id"] == day1["run_id"]


def test_a_fixed_output_is_compared_with_its_last_clean_dataset(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    """A job without placeholders: the baseline is that output's previous dataset whose verdict
    was clean or accepted, so a shifted feed that changes again still alerts."""
    out = tmp_path / "scored"
    args = ["run", *job_args(tmp_path / "feed", out, bundle_dir), "--scheduler", "sync"]
    shutil.copytree(catalog, tmp_path / "feed")
    clean = cli(*args)
    assert clean.returncode == 0, clean.output
    shutil.rmtree(tmp_path / "feed")
    _shifted(catalog, tmp_path / "feed", 3.0)
    assert cli(*args).returncode == 4
    _touch(tmp_path / "feed" / "part-00002.parquet")  # the shifted feed, exported again
    again = cli(*args)
    assert again.returncode == 4, again.output
    assert again.report is not None and clean.report is not None
    assert again.report["drift"]["baseline"]["run_id"] == clean.report["run_id"]
