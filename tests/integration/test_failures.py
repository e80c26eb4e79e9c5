"""Bad input, the error budget, resume, and the run lock, through the real CLI and library API."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import ErrorPolicy, JobConfig, run
from pipeline.cli.demo import FEATURES
from tests.conftest import demo_toml, write_shards
from tests.integration.helpers import (
    CliResult,
    cli,
    data_files,
    job_args,
    manifest_path,
    rejects_of,
    report,
    temporaries,
)

pytestmark = pytest.mark.integration


def _run(catalog: Path, out: Path, bundle: Path, *extra: str) -> CliResult:
    """`run` with this suite's common flags, in this process (see :func:`cli` for why)."""
    opts = ("--passthrough", "category", "--batch-size", "400", "--scheduler", "sync")
    return cli("run", *job_args(catalog, out, bundle, *opts, *extra), in_process=True)


def _poison(path: Path, rows: dict[int, tuple[str, float | None]]) -> None:
    """Set feature values of given rows (index -> (column, value)); None writes a null."""
    t = pq.read_table(path)
    for col in {c for c, _ in rows.values()}:
        vals = t.column(col).to_pylist()
        for i, (c, v) in rows.items():
            if c == col:
                vals[i] = v
        t = t.set_column(t.schema.get_field_index(col), col, pa.array(vals, pa.float32()))
    pq.write_table(t, path, row_group_size=300)


def test_unreadable_shards_fail_alone_within_and_beyond_budget(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    (catalog / "zero.parquet").write_bytes(b"")
    good = (catalog / "part-00000.parquet").read_bytes()
    (catalog / "truncated.parquet").write_bytes(good[: len(good) // 2])
    (catalog / "text.parquet").write_text("item_id,f0\n1,2\n")
    out = tmp_path / "o1"
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 1, r.output
    rep = report(out)
    assert rep["status"] == "failed" and not (out / "_SUCCESS").exists()
    failed = {Path(s["input"]).name: s for s in rep["shards"] if s["status"] == "failed"}
    assert set(failed) == {"zero.parquet", "truncated.parquet", "text.parquet"}
    assert all(s["kind"] == "unreadable" and s["rows_in"] is None for s in failed.values())
    assert all(Path(s["input"]).name in s["message"] for s in failed.values())
    assert rep["rows_in"] == rep["rows_out"] == 7300  # readable shards only
    assert rep["shards_scored"] == 3 and rep["shards_failed"] == 3
    out2 = tmp_path / "o2"
    r = _run(catalog, out2, bundle_dir, "--max-failed-shards", "3")
    assert r.returncode == 0, r.output
    assert report(out2)["status"] == "succeeded_with_errors"
    assert (out2 / "_SUCCESS").exists()
    assert "unreadable" in r.output


def test_schema_error_fails_before_scoring_or_skips_the_shard(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    p = catalog / "part-00001.parquet"
    t = pq.read_table(p).drop_columns(["f3"])
    t = t.set_column(t.schema.get_field_index("f5"), "f5", pa.array(["x"] * t.num_rows))
    pq.write_table(t, p)
    out = tmp_path / "o"
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 3, r.output
    assert "part-00001.parquet" in r.output and "'f3' is missing" in r.output
    assert "'f5' has type string" in r.output
    assert not out.exists() or not data_files(out)
    r = _run(
        catalog, out, bundle_dir, "--on-schema-error", "skip_shard", "--max-failed-shards", "1"
    )
    assert r.returncode == 0, r.output
    rep = report(out)
    assert rep["status"] == "succeeded_with_errors"
    bad = [s for s in rep["shards"] if s["status"] == "failed"]
    assert len(bad) == 1 and bad[0]["kind"] == "schema" and bad[0]["rows_in"] == 1700
    assert [f.name for f in data_files(out)] == ["part-00000.parquet", "part-00002.parquet"]


def test_invalid_rows_are_rejected_with_reasons_and_accounted(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    _poison(
        catalog / "part-00001.parquet",
        {3: ("f2", None), 401: ("f7", float("nan")), 1699: ("f0", float("inf"))},
    )
    out = tmp_path / "o"
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 0, r.output
    rep = report(out)
    assert rep["status"] == "succeeded_with_errors"
    assert rep["rows_rejected"] == 3 and rep["rows_out"] == 7297 and rep["rows_in"] == 7300
    assert rep["accounting_ok"]
    rej = pq.read_table(rejects_of(out) / "part-00001.parquet")
    assert rej.column_names == ["item_id", "category", "reject_reason"]
    assert rej.column("reject_reason").to_pylist() == [
        "null in f2",
        "NaN in f7",
        "infinite value in f0",
    ]
    first_id = pq.read_table(catalog / "part-00001.parquet").column("item_id")[0].as_py()
    assert rej.column("item_id").to_pylist() == [first_id + 3, first_id + 401, first_id + 1699]
    scored = pq.read_table(out / "part-00001.parquet").column("item_id").to_pylist()
    assert len(scored) == 1697 and not set(scored) & set(rej.column("item_id").to_pylist())
    assert not (rejects_of(out) / "part-00000.parquet").exists()  # only shards with rejects
    # Rejects live beside the output, not inside it: the output reads as scores only.
    assert ds.dataset(out, format="parquet").count_rows() == 7297
    shard = next(s for s in rep["shards"] if s["rel_path"] == "part-00001.parquet")
    assert shard["rows_in"] == shard["rows_out"] + shard["rows_rejected"]


def test_rejected_fraction_beyond_budget_fails_the_run(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    _poison(catalog / "part-00000.parquet", {i: ("f1", float("nan")) for i in range(100)})
    out, rejects = tmp_path / "o", tmp_path / "rejects"
    r = _run(catalog, out, bundle_dir, "--rejects", str(rejects))
    assert r.returncode == 1, r.output
    rep = report(out)
    assert rep["status"] == "failed" and not (out / "_SUCCESS").exists()
    assert "max_rejected_fraction" in " ".join(rep["failure_reasons"])
    assert pq.read_table(rejects / "part-00000.parquet").num_rows == 100
    r = _run(catalog, out, bundle_dir, "--rejects", str(rejects), "--max-rejected-fraction", "0.05")
    assert r.returncode == 0 and (out / "_SUCCESS").exists()


def test_on_invalid_rows_fail_names_shard_row_group_and_id(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    _poison(catalog / "part-00002.parquet", {1234: ("f9", float("nan"))})
    out = tmp_path / "o"
    r = _run(catalog, out, bundle_dir, "--on-invalid-rows", "fail")
    assert r.returncode == 1, r.output
    first_id = pq.read_table(catalog / "part-00002.parquet").column("item_id")[0].as_py()
    assert "part-00002.parquet" in r.output and "row group 4" in r.output
    assert f"item_id = {first_id + 1234}" in r.output and "NaN in f9" in r.output
    assert not (out / "part-00002.parquet").exists() and not (out / "_SUCCESS").exists()


def _mtimes(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in data_files(out)}


def test_resume_skips_done_shards_and_rescores_only_what_changed(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o"
    assert _run(catalog, out, bundle_dir).returncode == 0
    before = _mtimes(out)
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 0, r.output
    rep = report(out)
    assert rep["shards_skipped"] == 3 and rep["shards_scored"] == 0
    assert rep["rows_out"] == 7300 and rep["rows_processed"] == 0
    assert rep["batch_latency_ms"]["p50"] is None  # the model was never called
    assert _mtimes(out) == before and (out / "_SUCCESS").exists()
    # Rewrite one shard (same rows, new file): only it is rescored.
    p = catalog / "part-00001.parquet"
    time.sleep(0.01)
    pq.write_table(pq.read_table(p), p, row_group_size=500)
    assert _run(catalog, out, bundle_dir).returncode == 0
    rep = report(out)
    assert [s["status"] for s in rep["shards"]] == ["skipped", "scored", "skipped"]
    after = _mtimes(out)
    assert after["part-00000.parquet"] == before["part-00000.parquet"]
    assert after["part-00001.parquet"] != before["part-00001.parquet"]
    # --force rescores everything.
    assert _run(catalog, out, bundle_dir, "--force").returncode == 0
    assert report(out)["shards_scored"] == 3
    manifest = json.loads(manifest_path(out).read_text())
    entry = manifest["shards"]["part-00001.parquet"]
    assert entry["rows_in"] == 1700 and entry["rows_scored"] == 1700
    assert entry["fingerprint"]["num_rows"] == 1700 and len(entry["model_sha256"]) == 64


def test_changed_model_rescores_everything(catalog: Path, bundle_dir: Path, tmp_path: Path) -> None:
    import shutil

    bundle2 = tmp_path / "bundle2"
    shutil.copytree(bundle_dir, bundle2)
    out = tmp_path / "o"
    assert _run(catalog, out, bundle2).returncode == 0
    (bundle2 / "model.toml").write_text(demo_toml(version="2"))
    assert _run(catalog, out, bundle2).returncode == 0
    rep = report(out)
    assert rep["shards_scored"] == 3 and rep["model"]["version"] == "2"
    assert set(pq.read_table(out / "part-00000.parquet").column("model_version").to_pylist()) == {
        "2"
    }


def test_stale_rejects_are_removed_when_a_shard_is_rescored_clean(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    p = catalog / "part-00000.parquet"
    clean = pq.read_table(p)
    _poison(p, {5: ("f1", None)})
    out = tmp_path / "o"
    assert _run(catalog, out, bundle_dir).returncode == 0
    assert (rejects_of(out) / "part-00000.parquet").exists()
    pq.write_table(clean, p)
    assert _run(catalog, out, bundle_dir).returncode == 0
    assert not (rejects_of(out) / "part-00000.parquet").exists()
    assert report(out)["rows_out"] == 7300


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o"
    out.mkdir()
    holder = subprocess.Popen(
        # Alive until the test kills it, however long the run takes (it slept 60 s before).
        [sys.executable, "-c", "import signal; signal.pause()"]
    )
    try:
        lock = {
            "host": socket.gethostname(),
            "pid": holder.pid,
            "run_id": "other-run",
            "started_at": "2026-01-01T00:00:00+00:00",
            "started_ts": time.time(),
        }
        (out / "_lock.json").write_text(json.dumps(lock))
        r = _run(catalog, out, bundle_dir)
        assert r.returncode == 1
        assert "locked by run other-run" in r.output and f"pid {holder.pid}" in r.output
        # What the next line shows: a dead holder is taken over, no hand deletion asked for.
        assert "a holder that is gone is taken over by the next run" in r.output
        assert "if it is dead, delete" not in r.output
        assert not data_files(out)
        # Refused before its start-up: no cluster started, no model loaded (that took ~7 s).
        assert "loaded model" not in r.output and "overlap threads" not in r.output, r.output
    finally:
        holder.kill()
        holder.wait()
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 0, r.output
    taken = report(out)["lock_taken_over"]
    assert taken["run_id"] == "other-run" and "no longer running" in taken["reason"]
    assert not (out / "_lock.json").exists()
    # An old lock held by a live process elsewhere is stale after stale_lock_after_s.
    lock = {"host": "elsewhere", "pid": 1, "run_id": "ancient", "started_ts": time.time() - 99}
    (out / "_lock.json").write_text(json.dumps(lock))
    # The same job (flags only: a job file would be another job, whose run is refused).
    env = {"SCORE_CATALOG_STALE_LOCK_AFTER_S": "10", "SCORE_CATALOG_SCHEDULER": "sync"}
    opts = ("--passthrough", "category", "--batch-size", "400")
    res = cli("run", *job_args(catalog, out, bundle_dir, *opts), env=env, in_process=True)
    assert res.returncode == 0, res.output
    assert report(out)["lock_taken_over"]["run_id"] == "ancient"


def _raising_bundle(d: Path) -> Path:
    """A TorchScript model that raises on rows whose f0 > 1000 (like an index out of range)."""

    class Picky(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if bool((x[:, 0] > 1000.0).any()):
                raise ValueError("index out of range in self")
            return self.lin(x)

    torch.manual_seed(0)
    d.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(Picky().eval()), str(d / "model.ts"))
    (d / "model.toml").write_text(demo_toml(fmt="torchscript", file="model.ts"))
    return d


def test_rows_the_model_fails_on_are_bisected_out_and_rejected(
    catalog: Path, tmp_path: Path
) -> None:
    bundle = _raising_bundle(tmp_path / "picky")
    _poison(catalog / "part-00000.parquet", {7: ("f0", 5000.0), 399: ("f0", 9999.0)})
    out = tmp_path / "o"
    r = _run(catalog, out, bundle)
    assert r.returncode == 0, r.output
    rej = pq.read_table(rejects_of(out) / "part-00000.parquet")
    assert rej.num_rows == 2
    assert all("index out of range" in r for r in rej.column("reject_reason").to_pylist())
    assert report(out)["rows_out"] == 7298
    # A model that fails on every row is a run failure, not thousands of rejects.
    for p in catalog.glob("*.parquet"):
        t = pq.read_table(p)
        i = t.schema.get_field_index("f0")
        t = t.set_column(i, "f0", pa.array(np.full(t.num_rows, 5000.0, np.float32)))
        pq.write_table(t, p)
    out2 = tmp_path / "o2"
    r = _run(catalog, out2, bundle)
    assert r.returncode == 1
    rep = report(out2)
    assert rep["status"] == "failed" and rep["errors"][0]["kind"] == "model"
    assert "the model failed on every one of its 2,500 rows" in rep["errors"][0]["message"]


def test_bad_rows_first_are_rejects_when_the_model_scores_the_rest(
    catalog: Path, tmp_path: Path
) -> None:
    # A shard sorted so that its 1,000 bad rows come first (three whole batches of 400 and
    # part of a fourth): rows, not a broken model, because the model scores the others.
    bundle = _raising_bundle(tmp_path / "picky")
    _poison(catalog / "part-00000.parquet", {i: ("f0", 5000.0) for i in range(1000)})
    out = tmp_path / "o"
    r = _run(catalog, out, bundle, "--max-rejected-fraction", "0.5")
    assert r.returncode == 0, r.output
    rep = report(out)
    assert rep["rows_rejected"] == 1000 and rep["rows_out"] == 7300 - 1000


def test_a_last_batch_of_only_bad_rows_is_rejects_not_a_broken_model(
    catalog: Path, tmp_path: Path
) -> None:
    # part-00000 has 2,500 rows: with batch 500 its last batch is rows 2,000-2,499; poison
    # all of them, as a shard whose tail is bad would be. The model scored rows before, so
    # these are bad rows, not a broken model: rejected, and the night succeeds within budget.
    bundle = _raising_bundle(tmp_path / "picky")
    _poison(catalog / "part-00000.parquet", {i: ("f0", 5000.0) for i in range(2000, 2500)})
    out = tmp_path / "o"
    r = _run(catalog, out, bundle, "--batch-size", "500", "--max-rejected-fraction", "0.1")
    assert r.returncode == 0, r.output
    rep = report(out)
    assert rep["status"] == "succeeded_with_errors" and rep["rows_rejected"] == 500
    assert rep["rows_out"] == 7300 - 500 and rep["shards_failed"] == 0


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 700), min_size=1, max_size=3),
    rg=st.integers(1, 400),
    bs=st.integers(1, 500),
    bad=st.lists(
        st.tuples(
            st.integers(0, 2099),
            st.sampled_from(FEATURES),
            st.sampled_from([None, float("nan"), float("inf"), -float("inf")]),
        ),
        max_size=12,
    ),
)
def test_property_rows_in_equals_scored_plus_rejected(
    bundle_dir: Path,
    sizes: list[int],
    rg: int,
    bs: int,
    bad: list[tuple[int, str, float | None]],
) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = write_shards(root / "cat", sizes, row_group_rows=rg)
        expected_bad: set[int] = set()
        offset = 0
        for p, n in zip(paths, sizes, strict=True):
            rows = {i - offset: (c, v) for i, c, v in bad if offset <= i < offset + n}
            if rows:
                _poison(p, rows)
                expected_bad |= {offset + i for i in rows}
            offset += n
        cfg = JobConfig(
            input=str(root / "cat"),
            output=str(root / "out"),
            model=str(bundle_dir),
            batch_size=bs,
            scheduler="sync",
            errors=ErrorPolicy(max_rejected_fraction=1.0),
        )
        rep = run(cfg)
        assert rep["rows_in"] == sum(sizes)
        assert rep["rows_out"] + rep["rows_rejected"] == sum(sizes)
        rejected = set()
        for f in (root / "_rejects" / "out").glob("*.parquet"):
            rejected |= set(pq.read_table(f).column("item_id").to_pylist())
        assert rejected == expected_bad
        scored = [
            i
            for f in data_files(root / "out")
            for i in pq.read_table(f).column("item_id").to_pylist()
        ]
        assert scored == sorted(set(range(sum(sizes))) - expected_bad)
        assert not temporaries(root / "out")
        assert os.path.exists(root / "out" / "_SUCCESS")


def test_duplicate_ids_are_counted_and_warned(bundle_dir: Path, tmp_path: Path) -> None:
    cat = tmp_path / "cat"
    paths = write_shards(cat, [600, 500], row_group_rows=250)
    t = pq.read_table(paths[1])
    ids = t.column("item_id").to_numpy().copy()
    ids[10:13] = ids[0]  # three repeats of the first id
    missing = np.zeros(len(ids), dtype=bool)
    missing[[40, 41]] = True  # and two rows with no id at all
    t = t.set_column(0, "item_id", pa.array(ids, mask=missing))
    pq.write_table(t, paths[1], row_group_size=250)
    out = tmp_path / "o"
    r = _run(cat, out, bundle_dir)
    assert r.returncode == 0, r.output
    rep = report(out)
    assert rep["duplicate_ids"] == 3
    assert [s["duplicate_ids"] for s in rep["shards"]] == [0, 3]
    assert any("3 rows repeat a item_id value seen earlier" in w for w in rep["warnings"])
    assert rep["null_ids"] == 2 and [s["null_ids"] for s in rep["shards"]] == [0, 2]
    assert any(w.startswith("2 rows have a null item_id (part-00001") for w in rep["warnings"])
    assert "WARNING" in r.output
    assert rep["rows_out"] == 1100  # warned, not dropped
    # A rerun skips both shards and still reports their counts (kept in the manifest).
    again = _run(cat, out, bundle_dir)
    assert again.returncode == 0, again.output
    rep = report(out)
    assert rep["shards_skipped"] == 2
    assert rep["duplicate_ids"] == 3 and [s["duplicate_ids"] for s in rep["shards"]] == [0, 3]
    assert rep["null_ids"] == 2 and [s["null_ids"] for s in rep["shards"]] == [0, 2]


def test_storage_credentials_never_reach_logs_report_or_manifest(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    secret = "hunter2-SECRET-VALUE"
    out = tmp_path / "o"
    (catalog / "zero.parquet").write_bytes(b"")  # an error message path, too
    r = _run(
        catalog,
        out,
        bundle_dir,
        "-v",
        "--storage-option",
        f"secret={secret}",
        "--max-failed-shards",
        "1",
    )
    assert r.returncode == 0, r.output
    assert secret not in r.output
    for f in out.rglob("_*.json"):
        assert secret not in f.read_text(), f
    job = tmp_path / "job.toml"
    job.write_text(
        f'input = "{catalog}"\noutput = "{out}"\nmodel = "{bundle_dir}"\n'
        f'batch_size = 0\n[storage]\nsecret = "{secret}"\n'
    )
    res = cli("run", str(job), in_process=True)
    assert res.returncode == 2 and secret not in res.output


def test_model_width_mismatch_is_exit_3_naming_bundle_and_spec(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    import shutil

    narrow = tmp_path / "narrow"
    shutil.copytree(bundle_dir, narrow)
    (narrow / "model.toml").write_text(demo_toml(columns=("f0", "f1", "f2")))
    out = tmp_path / "o"
    r = _run(catalog, out, narrow)
    assert r.returncode == 3
    assert str(narrow) in r.output and "inputs.columns = ['f0', 'f1', 'f2']" in r.output
    assert not out.exists()
