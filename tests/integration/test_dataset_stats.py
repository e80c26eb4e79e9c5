"""A rerun describes the dataset: a resumed run's ``outputs`` and drift cover every shard in the
output (skipped shards through the statistics their manifest entries keep), not only the shards
the run rescored; a rerun that scores nothing keeps them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipeline.cli.demo import FEATURES, make_rows
from pipeline.report import drift
from pipeline.worker import sketch
from tests.integration.helpers import CliResult, cli, job_args, manifest_path, report

pytestmark = pytest.mark.integration

SIZES = (2600, 1900, 3100, 2400)


def _shard(k: int, seed: int) -> pa.Table:
    """Shard k of a catalog whose shards differ: every feature moved by 1.5 * (k - 1.5)."""
    t = make_rows(10_000 * k, SIZES[k], seed)
    for name in FEATURES:
        i = t.schema.get_field_index(name)
        t = t.set_column(i, name, pc.add(t.column(name), pa.scalar(1.5 * (k - 1.5), pa.float32())))
    return t


def _write(root: Path, k: int, seed: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(_shard(k, seed), root / f"part-{k:05d}.parquet", row_group_size=700)


def _run(inp: Path, root: Path, bundle: Path, date: str, *extra: str) -> CliResult:
    args = job_args(inp, root / "{date}", bundle, "--date", date, "--scheduler", "sync", *extra)
    return cli("run", *args, in_process=True)


def _same_outputs(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two ``outputs`` sections describe the same rows: exact totals, sketches within their
    resolution (a skipped shard's distribution is rebuilt from its 101-point sketch)."""
    assert a.keys() == b.keys()
    for col in a:
        x, y = a[col], b[col]
        assert x["count"] == y["count"], col
        assert (x["min"], x["max"]) == (y["min"], y["max"]), col
        assert x["mean"] == pytest.approx(y["mean"], rel=1e-6), col
        assert drift.ks(x["sketch"], y["sketch"]) < 0.02, col
        assert drift.psi(x["sketch"], y["sketch"]) < 0.01, col
        span = x["max"] - x["min"]
        for q in x["quantiles"]:
            assert x["quantiles"][q] == pytest.approx(y["quantiles"][q], abs=0.02 * span), (col, q)
        # A discrete column (the argmax label) keeps its rows per value through the sketches.
        assert ("value_counts" in x) == ("value_counts" in y), col
        if "value_counts" in x:
            vx, vy = x["value_counts"], y["value_counts"]
            assert vx["values"] == vy["values"], col
            for cx, cy in zip(vx["counts"], vy["counts"], strict=True):
                assert cx == pytest.approx(cy, abs=0.01 * x["count"] + 1), col


def test_resume_and_noop_rerun_report_the_whole_output(bundle_dir: Path, tmp_path: Path) -> None:
    inp, root = tmp_path / "catalog", tmp_path / "scored"
    for k in range(4):
        _write(inp, k, seed=0)
    before = _run(inp, root, bundle_dir, "2026-10-31")  # the day before: the drift baseline
    assert before.returncode == 0, before.output
    rep0 = report(root / "2026-10-31")
    first = _run(inp, root, bundle_dir, "2026-11-01")
    assert first.returncode == 0, first.output
    rep1 = report(root / "2026-11-01")

    _write(inp, 2, seed=7)  # one shard changed upstream: same distribution, other rows
    resumed = _run(inp, root, bundle_dir, "2026-11-01")
    assert resumed.returncode == 0, resumed.output
    rep2 = report(root / "2026-11-01")
    assert (rep2["shards_scored"], rep2["shards_skipped"]) == (1, 3)
    assert rep2["rows_processed"] == SIZES[2]  # this invocation's work ...
    assert rep2["outputs"]["score"]["count"] == rep2["rows_out"] == sum(SIZES)  # ... the dataset
    d = rep2["drift"]
    # Compared with the day before, not with this day's own earlier version.
    assert d["baseline"]["run_id"] == rep0["run_id"]
    assert d["alert"] is False and rep2["status"] == "succeeded", d
    assert all(c["psi"] < 0.01 and c["ks"] < 0.02 for c in d["columns"].values()), d

    # The rescored shard alone is far from the whole: a report over it only would have alerted.
    alone = pq.read_table(root / "2026-11-01" / "part-00002.parquet").column("score")
    assert drift.psi(rep1["outputs"]["score"]["sketch"], sketch.sketch(alone.to_numpy())) > 0.25

    # Equal, within the sketches' resolution, to a clean full run of the same (changed) data.
    clean = _run(inp, root, bundle_dir, "2026-11-02")
    assert clean.returncode == 0, clean.output
    rep_clean = report(root / "2026-11-02")
    assert rep_clean["shards_scored"] == 4
    _same_outputs(rep2["outputs"], rep_clean["outputs"])

    # A rerun that scores nothing keeps them, and raises no drift alert.
    noop = _run(inp, root, bundle_dir, "2026-11-01")
    assert noop.returncode == 0, noop.output
    rep3 = report(root / "2026-11-01")
    assert (rep3["shards_scored"], rep3["rows_processed"]) == (0, 0)
    _same_outputs(rep3["outputs"], rep_clean["outputs"])
    assert not (rep3["drift"] or {}).get("alert") and rep3["status"] == "succeeded"
    assert rep3["rows_out"] == sum(SIZES) and rep3["warnings"] == []


def test_manifest_entries_without_statistics_are_named(bundle_dir: Path, tmp_path: Path) -> None:
    inp, root = tmp_path / "catalog", tmp_path / "scored"
    for k in range(2):
        _write(inp, k, seed=0)
    assert _run(inp, root, bundle_dir, "2026-11-01").returncode == 0
    path = manifest_path(root / "2026-11-01")
    manifest = json.loads(path.read_text())
    entry = manifest["shards"]["part-00000.parquet"]
    assert set(entry["outputs"]) == {"score", "label"}
    assert len(entry["outputs"]["score"]["sketch"]) == sketch.SKETCH_POINTS
    del entry["outputs"]  # as an older version wrote it
    path.write_text(json.dumps(manifest))
    r = _run(inp, root, bundle_dir, "2026-11-01")
    assert r.returncode == 0, r.output
    rep = report(root / "2026-11-01")
    assert rep["shards_skipped"] == 2
    assert rep["outputs"]["score"]["count"] == SIZES[1]  # only the shard with statistics
    assert any("part-00000.parquet" in w and "--force" in w for w in rep["warnings"])
