"""Issue 22, 9g: ``plan``'s estimate times what a worker runs for each shard (read, score,
write), not the model alone, which put the demo job at 0.03 s of scoring for a run whose shards
took about a second; and it says what it leaves out. No timing is asserted: the estimate's
arithmetic is checked on given costs, and the plan's JSON and text on a real job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core.config import JobConfig
from pipeline.driver import planning
from pipeline.driver.autotune import AUTO_SAMPLE_ROWS, SWEEP_ROWS_ENV
from pipeline.driver.cluster import Plan
from tests.integration.helpers import cli, job_args

pytestmark = pytest.mark.integration


def _config(scheduler: str = "local") -> JobConfig:
    return JobConfig(input="in", output="out", model="m", scheduler=scheduler)


@pytest.mark.parametrize(("load", "share"), [(0.0, 1.0), (3.0, 0.5)])
def test_the_estimate_spreads_the_timed_cost_over_the_worker_slots(
    monkeypatch: pytest.MonkeyPatch, load: float, share: float
) -> None:
    monkeypatch.setattr(planning.os, "getloadavg", lambda: (load, load, load))
    calibration = {
        "device": "cpu",
        "rows_per_s": 1e9,  # the model alone: not what the estimate uses
        "pipeline": {"per_row_s": 1e-4, "warm_up_s": 0.5},
    }
    plan = Plan("local", 2, 1, 1, cores=2)
    est = planning._estimate(_config(), plan, calibration, [1000] * 8)
    assert est is not None
    # Each of the 2 slots warms up once and takes 4 of the 8 shards of 0.1 s; on a machine
    # whose load average leaves one core free, the two slots share it and take twice as long.
    assert est["scoring_s"] == pytest.approx((0.5 + 4 * 0.1) / share)
    assert est["slots"] == 2 and est["tasks"] == 8
    assert any("starting 2 Dask worker" in e for e in est["excludes"])
    # In one process (sync), one slot takes every shard in turn.
    one = Plan("sync", 1, 1, 2, cores=2)
    sync = planning._estimate(_config("sync"), one, calibration, [1000] * 8)
    assert sync is not None and sync["tasks"] == 8
    assert sync["scoring_s"] == pytest.approx(0.5 + 8 * 0.1)  # one slot: one core is enough
    # An external cluster's size is not known: no estimate, rather than a wrong one.
    ext = Plan("tcp://127.0.0.1:8786", None, None, None, cores=2)
    assert planning._estimate(_config("tcp://127.0.0.1:8786"), ext, calibration, [10]) is None


@pytest.mark.slow
def test_plan_times_the_workers_whole_path_and_says_what_it_leaves_out(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    args = job_args(catalog, tmp_path / "out", bundle_dir)
    j = cli("plan", *args, "--json")
    assert j.returncode == 0, j.stderr
    plan = json.loads(j.stdout)
    pipe = plan["calibration"]["pipeline"]
    assert pipe["shard"] == "part-00000.parquet" and pipe["rows"] == 2500  # its first rows
    assert pipe["rows_per_s"] > 0 and pipe["warm_up_s"] >= 0
    est = plan["estimate"]
    assert plan["estimated_scoring_s"] == est["scoring_s"]
    # At least every row at the timed pace, spread over every slot, plus one warm-up.
    floor = plan["rows_to_score"] * pipe["per_row_s"] / est["slots"] + pipe["warm_up_s"]
    assert est["scoring_s"] >= floor * 0.999
    assert est["startup_s"] > 0

    t = cli("plan", *args)
    assert t.returncode == 0, t.stderr
    text = " ".join(t.stdout.split())
    assert "s of scoring, from the first shard's start to the last one's commit: 7,300 rows" in text
    assert "reading, scoring and writing 2,500 rows of part-00000.parquet here" in text
    assert "a whole run: about" in text
    assert "not included: starting" in text and "the run's finish" in text


def test_plan_uses_the_batch_size_auto_chose_in_an_earlier_run(
    catalog: Path, bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # plan read the cache under another key than the run writes, so it always said "not
    # measured yet" and timed 4,096 whatever the run had chosen.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(SWEEP_ROWS_ENV, str(AUTO_SAMPLE_ROWS))
    args = job_args(catalog, tmp_path / "out", bundle_dir, "--scheduler", "sync")
    r = cli("run", *args, "--batch-size", "auto", in_process=True)
    assert r.returncode == 0, r.output
    assert r.report is not None
    chosen = r.report["execution"]["batch_size_auto"]["batch_size"]
    j = cli("plan", *args, "--batch-size", "auto", "--json", in_process=True)
    assert j.returncode == 0, j.stderr
    cal = json.loads(j.stdout)["calibration"]
    assert cal["note"] is None and cal["batch_size"] == chosen
