"""The real CLI end to end on generated multi-shard, multi-row-group data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.driver.autotune import AUTO_SAMPLE_ROWS, SWEEP_ROWS_ENV
from pipeline.model import tuning
from tests.conftest import reference_scores, write_shards
from tests.integration.helpers import (
    cli,
    data_files,
    job_args,
    read_tree,
    report,
    temporaries,
)

pytestmark = pytest.mark.integration


def _args(catalog: Path, out: Path, bundle: Path, *extra: str) -> list[str]:
    return [
        "run",
        *job_args(catalog, out, bundle),
        "--passthrough",
        "category",
        "--batch-size",
        "512",
        *extra,
    ]


def test_local_dask_cluster_scores_every_row_once_in_order(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "scored"
    r = cli(*_args(catalog, out, bundle_dir, "--scheduler", "local", "--workers", "2"))
    assert r.returncode == 0, r.stderr
    assert "SUCCEEDED" in r.stdout and "7,300 scored" in r.stdout
    assert (out / "_SUCCESS").exists()
    assert not temporaries(out)
    inputs = sorted(catalog.glob("*.parquet"))
    outputs = data_files(out)
    assert [p.name for p in outputs] == [p.name for p in inputs]
    for src, dst in zip(inputs, outputs, strict=True):
        t_in, t_out = pq.read_table(src), pq.read_table(dst)
        assert t_out.column_names == ["item_id", "category", "score", "label", "model_version"]
        assert t_out.column("item_id").equals(t_in.column("item_id"))
        assert t_out.column("category").equals(t_in.column("category"))
        score, label = reference_scores(bundle_dir, t_in)
        np.testing.assert_allclose(t_out.column("score").to_numpy(), score, atol=1e-6, rtol=0)
        np.testing.assert_array_equal(t_out.column("label").to_numpy(), label)
        assert set(t_out.column("model_version").to_pylist()) == {"1"}
    rep = report(out)
    assert rep["status"] == "succeeded"
    assert rep["rows_in"] == rep["rows_out"] == 7300
    assert rep["shards_total"] == rep["shards_scored"] == 3
    assert [s["rows_in"] for s in rep["shards"]] == [2500, 1700, 3100]
    assert rep["threads"]["workers"] == 2 and rep["threads"]["torch_threads"] >= 1
    for key in (
        "run_id",
        "job",
        "started_at",
        "finished_at",
        "duration_s",
        "input",
        "output",
        "rows_per_s",
        "batch_size",
        "device",
        "model",
        "versions",
        "batch_latency_ms",
        "outputs",
        "shards",
    ):
        assert key in rep
    assert set(rep["model"]) >= {"name", "version", "format", "sha256"}
    assert set(rep["versions"]) == {"python", "torch", "pyarrow", "dask"}
    assert set(rep["batch_latency_ms"]) == {"p50", "p95", "p99"}
    q = rep["outputs"]["score"]["quantiles"]
    assert 0.0 <= q["p01"] <= q["p50"] <= q["p99"] <= 1.0
    # The output directory reads as a dataset as it is, with both pyarrow and Dask.
    assert ds.dataset(out, format="parquet").count_rows() == 7300
    import dask.dataframe as dd

    assert len(dd.read_parquet(str(out)).compute()) == 7300


def test_clirunner_job_file_env_and_flags(catalog: Path, bundle_dir: Path, tmp_path: Path) -> None:
    job = tmp_path / "nightly.toml"
    job.write_text(
        f'input = "{catalog}"\noutput = "{tmp_path}/out/run_date={{date}}"\n'
        f'model = "{bundle_dir}"\nbatch_size = 100\nscheduler = "sync"\n'
    )
    res = cli(
        "run",
        str(job),
        "--date",
        "2026-01-02",
        "--batch-size",
        "700",
        env={"SCORE_CATALOG_BATCH_SIZE": "300", "SCORE_CATALOG_ID_COLUMN": "item_id"},
        in_process=True,
    )
    assert res.returncode == 0, res.output
    out = tmp_path / "out" / "run_date=2026-01-02"
    rep = report(out)
    assert rep["batch_size"] == 700  # flag beats env beats job file
    assert rep["job"] == "nightly"
    assert rep["rows_out"] == 7300


def test_torchscript_bundle_scores_the_same(
    catalog: Path, bundle_dir: Path, torchscript_bundle_dir: Path, tmp_path: Path
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for bundle, out in ((bundle_dir, a), (torchscript_bundle_dir, b)):
        res = cli(*_args(catalog, out, bundle, "--scheduler", "sync"), in_process=True)
        assert res.returncode == 0, res.output
    ta, tb = read_tree(a), read_tree(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        np.testing.assert_allclose(
            ta[k].column("score").to_numpy(), tb[k].column("score").to_numpy(), atol=1e-6
        )
    assert report(b)["model"]["format"] == "torchscript"


def test_help_documents_commands_options_and_exit_codes() -> None:
    top = cli("--help", in_process=True)
    assert top.returncode == 0
    for word in ("run", "demo", "Exit codes", "2 usage", "3 input"):
        assert word in top.stdout
    run_help = cli("run", "--help", in_process=True).stdout
    for opt in (
        "--input",
        "--output",
        "--model",
        "--batch-size",
        "--device",
        "--id-column",
        "--passthrough",
        "--scheduler",
        "--workers",
        "--rejects",
        "--force",
        "--max-failed-shards",
        "--max-rejected-fraction",
        "--on-schema-error",
        "--on-invalid-rows",
        "Exit codes",
    ):
        assert opt in run_help, opt


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["run", "--output", "x", "--model", "y"], 2, "input is required"),
        (
            ["run", "--input", "nowhere", "--output", "o", "--model", "m", "--batch-size", "0"],
            2,
            "batch_size",
        ),
        (
            ["run", "--input", "does/not/exist", "--output", "{tmp}/o", "--model", "{bundle}"],
            3,
            "does not exist",
        ),
        (
            ["run", "--input", "{catalog}", "--output", "{catalog}/scored", "--model", "{bundle}"],
            2,
            "overlaps the input",
        ),
        (
            ["run", "--input", "{catalog}", "--output", "{tmp}/o", "--model", "{tmp}"],
            3,
            "no model.toml",
        ),
        (
            [
                "run",
                *job_args("{catalog}", "{tmp}/o", "{bundle}"),
                "--device",
                "cuda",
            ],
            2,
            "not available",
        ),
    ],
)
def test_exit_codes(
    args: list[str], code: int, needle: str, catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    args = [a.format(tmp=tmp_path, catalog=catalog, bundle=bundle_dir) for a in args]
    res = cli(*args, in_process=True)
    assert res.returncode == code, res.output
    assert needle in res.output
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_schema_drift_float64_and_int_features_score_like_float32(
    bundle_dir: Path, tmp_path: Path
) -> None:
    cat = tmp_path / "cat"
    write_shards(cat, [800, 900], row_group_rows=300)
    p = cat / "part-00001.parquet"
    t = pq.read_table(p)
    t = t.set_column(t.schema.get_field_index("f0"), "f0", t.column("f0").cast(pa.float64()))
    t = t.set_column(
        t.schema.get_field_index("item_id"), "item_id", t.column("item_id").cast(pa.int32())
    )
    t = t.append_column("extra", pa.array(["x"] * t.num_rows))
    pq.write_table(t, p, row_group_size=300)
    out = tmp_path / "out"
    res = cli(*_args(cat, out, bundle_dir, "--scheduler", "sync"), in_process=True)
    assert res.returncode == 0, res.output
    t_out = pq.read_table(out / "part-00001.parquet")
    # One id type across the output (int32 and int64 promoted to int64): readers of the whole
    # folder refuse files that disagree (pipeline.driver.inspect.meta_fields).
    assert t_out.schema.field("item_id").type == pa.int64()
    score, _ = reference_scores(bundle_dir, pq.read_table(p))
    np.testing.assert_allclose(t_out.column("score").to_numpy(), score, atol=1e-6)


def test_empty_shard_gets_an_empty_output_with_the_schema(bundle_dir: Path, tmp_path: Path) -> None:
    cat = tmp_path / "cat"
    write_shards(cat, [500, 0, 400], row_group_rows=200)
    out = tmp_path / "out"
    res = cli(*_args(cat, out, bundle_dir, "--scheduler", "sync"), in_process=True)
    assert res.returncode == 0, res.output
    empty = pq.read_table(out / "part-00001.parquet")
    assert empty.num_rows == 0
    assert empty.column_names == ["item_id", "category", "score", "label", "model_version"]
    assert report(out)["rows_out"] == 900


def _two_auto_runs(
    catalog: Path, bundle: Path, tmp_path: Path, batch: str = "auto"
) -> list[dict[str, Any]]:
    """The reports of two `--batch-size auto` (or ``batch``) runs of ``catalog`` (outputs a
    and b).

    The measurement is made whatever the budget (SWEEP_ROWS_ENV): left to the first pass's
    pace, a busy machine measured fewer rounds, or none."""
    reps = []
    for name in ("a", "b"):
        out = tmp_path / name
        res = cli(
            *_args(catalog, out, bundle, "--scheduler", "sync", "--batch-size", batch),
            in_process=True,
        )
        assert res.returncode == 0, res.output
        reps.append(report(out))
    return reps


def test_batch_size_auto_is_measured_once_then_cached(
    catalog: Path, bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(SWEEP_ROWS_ENV, str(AUTO_SAMPLE_ROWS))
    reps = _two_auto_runs(catalog, bundle_dir, tmp_path)
    first, second = (r["execution"]["batch_size_auto"] for r in reps)
    assert first["cached"] is False and second["cached"] is True
    assert first["basis"] == "pipeline"  # measured through the workers' own scoring code
    rate = {r["batch"]: r["samples_per_s"] for r in first["sweep"]}
    # The default and its neighbours up to the sample's rows (the first shard's 2,500): 2,048
    # (8,192 does not fit), each over the same 2,500 rows.
    assert sorted(rate) == [2048, 4096]
    # Kept, or replaced by a size that won both pairs by 5%: its fastest pass too, then.
    if first["batch_size"] != 4096:
        assert rate[first["batch_size"]] * 0.95 >= rate[4096] * (1 - 1e-9)
    assert reps[0]["batch_size"] == first["batch_size"]
    # The second night revalidates the cached size against its neighbours that fit.
    check = second["revalidation"]
    assert check["cached"] == first["batch_size"] and check["outcome"] in ("kept", "replaced")
    near = {4096: [2048], 2048: [1024]}[first["batch_size"]]
    assert [p["size"] for p in check["pairs"]] == near
    assert reps[1]["batch_size"] == second["batch_size"] == check["chosen"]
    assert (tmp_path / "cache" / "score-catalog" / "batch_sizes.json").exists()
    assert reps[1]["rows_out"] == 7300


def test_batch_size_auto_measures_again_on_another_cpu(
    catalog: Path, bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cache folder that moved to another machine (a shared home, a copied image): the choice
    # made on the first CPU is not reused on a CPU with other flags, and the new choice is.
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setenv(SWEEP_ROWS_ENV, str(AUTO_SAMPLE_ROWS))
    first, _ = _two_auto_runs(catalog, bundle_dir, tmp_path / "here")
    path = cache / "score-catalog" / "batch_sizes.json"
    doc = json.loads(path.read_text())
    (key,) = doc
    here = doc[key]["cpu"]
    assert here == tuning.cpu_identity()
    assert first["execution"]["batch_size_auto"]["cpu"] == tuning.cpu_summary(here)
    doc[key]["cpu"] = {**here, "flags": here["flags"] + " amx_bf16 amx_tile"}  # another CPU's
    path.write_text(json.dumps(doc))
    again, reused = (
        r["execution"]["batch_size_auto"]
        for r in _two_auto_runs(catalog, bundle_dir, tmp_path / "there")
    )
    assert again["cached"] is False and [s["batch"] for s in again["sweep"]] == [2048, 4096]
    assert reused["cached"] is True
    assert reused["revalidation"]["cached"] == again["batch_size"]
    assert json.loads(path.read_text())[key]["cpu"] == here


def test_batch_size_auto_on_a_first_shard_smaller_than_every_size_is_not_cached(
    bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 500 rows fit no neighbour of the default: nothing was compared, so a later run over big
    # shards must measure rather than reuse it.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(SWEEP_ROWS_ENV, str(AUTO_SAMPLE_ROWS))
    small = tmp_path / "small"
    write_shards(small, [500])
    runs = [r["execution"]["batch_size_auto"] for r in _two_auto_runs(small, bundle_dir, tmp_path)]
    assert [r["cached"] for r in runs] == [False, False]
    assert [r["sweep"] for r in runs] == [[], []]
    assert all("fits no size but 4,096" in r["note"] for r in runs)


@pytest.mark.parametrize(("huge_pages", "overlap"), [(None, False), ("0", True)])
def test_overlap_auto_turns_the_threads_off_where_every_core_runs_a_loop(
    huge_pages: str | None,
    overlap: bool,
    bundle_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A real CLI process: it asks torch for huge pages itself unless the environment says 0.
    cat = tmp_path / "cat"
    write_shards(cat, [700, 900], row_group_rows=300)
    out = tmp_path / "o"
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    env = {"THP_MEM_ALLOC_ENABLE": huge_pages} if huge_pages is not None else {}
    args = _args(cat, out, bundle_dir, "--scheduler", "threads", "--cores", "2", "-v")
    res = cli(*args, env=env)
    assert res.returncode == 0, res.stderr
    rep = report(out)
    assert rep["execution"]["overlap"] is overlap
    assert ("overlap threads off (overlap = auto)" in res.stderr) is not overlap
    ids = [i for p in data_files(out) for i in pq.read_table(p).column("item_id").to_pylist()]
    assert ids == list(range(1600))


@pytest.mark.parametrize(
    "extra",
    [
        ["--no-overlap"],
        ["--overlap"],
        ["--scheduler", "threads", "--workers", "2"],
        ["--batch-size", "1"],
        ["--batch-size", "7", "--cores", "1"],
        ["--precision", "bf16"],
        ["--precision", "int8", "--parity-tolerance", "1"],
    ],
    ids=["no-overlap", "overlap", "threads", "batch-1", "batch-7-cores-1", "bf16", "int8"],
)
def test_every_option_keeps_order_and_exactly_once(
    extra: list[str], bundle_dir: Path, tmp_path: Path
) -> None:
    cat = tmp_path / "cat"
    write_shards(cat, [900, 0, 1300], row_group_rows=400)
    out = tmp_path / "o"
    args = _args(cat, out, bundle_dir, "--scheduler", "sync", *extra)
    res = cli(*args, in_process=True)
    assert res.returncode == 0, res.output
    ids = [i for p in data_files(out) for i in pq.read_table(p).column("item_id").to_pylist()]
    assert ids == list(range(2200))
    rep = report(out)
    assert rep["rows_out"] == 2200 and rep["accounting_ok"]
    tol = 1.0 if "int8" in extra else 5e-2 if "bf16" in extra else 1e-6
    for p in data_files(out):
        t_out = pq.read_table(p)
        score, _ = reference_scores(bundle_dir, pq.read_table(cat / p.name))
        if len(score):
            assert np.abs(t_out.column("score").to_numpy() - score).max() <= tol


def test_rows_per_model_call_are_measured_once_per_cpu_then_cached(
    bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 10,000 rows in batches of 1,024: enough batches to measure whether calls of 256 or 512
    # rows run faster on this CPU; the choice is the machine's, so the test checks what holds
    # whatever it is: one of the sizes measured, the fastest within the noise, reused by the
    # next run, and the scores those of the model.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cat = tmp_path / "cat"
    write_shards(cat, [5000, 5000], row_group_rows=1000)
    reps = _two_auto_runs(cat, bundle_dir, tmp_path, batch="1024")
    first, second = (r["execution"]["call_rows"] for r in reps)
    assert first["cached"] is False and second["cached"] is True
    assert first["key"] == second["key"] and first["key"].endswith("|calls1024")
    assert first["cpu"] == tuning.cpu_summary(tuning.cpu_identity())
    sweep = {r["batch"]: r["samples_per_s"] for r in first["sweep"]}
    assert sorted(sweep) == [256, 512, 1024]
    # The fastest size, or one call per batch when the fastest did not win twice over.
    assert first["rows"] in (max(sweep, key=lambda b: sweep[b]), 1024)
    assert second["rows"] == first["rows"] and "sweep" not in second
    for name in ("a", "b"):
        got = pq.read_table(tmp_path / name / "part-00000.parquet")
        want, _ = reference_scores(bundle_dir, pq.read_table(cat / "part-00000.parquet"))
        np.testing.assert_allclose(got.column("score").to_numpy(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("batch", ["256", "4096"])
def test_rows_per_model_call_are_not_measured_for_a_small_job_or_batch(
    bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: str
) -> None:
    # Batches of 256 have no smaller call size to try; 3,000 rows are under 8 batches of 4,096.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cat = tmp_path / "cat"
    write_shards(cat, [3000], row_group_rows=1000)
    out = tmp_path / "out"
    res = cli(
        *_args(cat, out, bundle_dir, "--scheduler", "sync", "--batch-size", batch),
        in_process=True,
    )
    assert res.returncode == 0, res.output
    assert report(out)["execution"]["call_rows"] is None


class _BatchCentred(torch.nn.Module):
    """Scores each row against its call's mean: a row's output depends on the other rows in
    its call (as a BatchNorm left in training mode does)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x - x.mean(dim=0, keepdim=True))


@pytest.mark.parametrize("row_dependent", [False, True])
def test_rows_per_model_call_are_not_split_for_a_model_whose_rows_depend_on_each_other(
    bundle_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    row_dependent: bool,
) -> None:
    # Which size wins is the machine's; here calls of 256 are made the winner (in this process)
    # so that what follows is tested: every run checks that a row's output does not depend on
    # the other rows of its call, and a model whose outputs do keeps one call per batch, with a
    # warning (in the log and the report, every night) that says why and what to do.
    from pipeline.cli.demo import export_bundle
    from tests.conftest import demo_toml

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(
        tuning, "choose_call_rows", lambda *a, **k: (256, [], {"rounds": 2, "noise": 0.0})
    )
    bundle = bundle_dir
    if row_dependent:
        bundle = tmp_path / "centred"
        export_bundle(_BatchCentred().eval(), bundle, demo_toml(), n_in=16)
    cat = tmp_path / "cat"
    write_shards(cat, [9000], row_group_rows=1000)
    for night in ("1", "2"):  # the second finds the first's choice cached: checked all the same
        out = tmp_path / f"out{night}"
        args = _args(cat, out, bundle, "--scheduler", "sync", "--batch-size", "1024")
        res = cli(*args, in_process=True)
        assert res.returncode == 0, res.output
        rep = report(out)
        calls = rep["execution"]["call_rows"]
        said = [w for w in rep["warnings"] if "depends on the other rows in its call" in w]
        if row_dependent:
            assert calls["rows"] == 1024 and "depend" in calls["note"]
            assert "depends on the other rows in its call" in res.output
            assert "model.eval()" in res.output and len(said) == 1
        else:
            assert calls["rows"] == 256 and "note" not in calls and not said
            assert calls["cached"] is (night == "2")
            assert "depends on the other rows" not in res.output


def test_batch_size_auto_runs_when_its_cache_cannot_be_written(
    catalog: Path, bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cache must never stop a run: here the file's name is taken by a folder, so the
    # atomic replace fails (a break-it review: exit 1, nothing written).
    cache = tmp_path / "cache"
    (cache / "score-catalog" / "batch_sizes.json").mkdir(parents=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setenv(SWEEP_ROWS_ENV, str(AUTO_SAMPLE_ROWS))
    out = tmp_path / "out"
    res = cli(
        *_args(catalog, out, bundle_dir, "--scheduler", "sync", "--batch-size", "auto"),
        in_process=True,
    )
    assert res.returncode == 0, res.output
    assert "batch size auto: cannot write" in res.output
    assert report(out)["rows_out"] == 7300


def test_a_cached_batch_size_edited_by_hand_is_measured_again(
    catalog: Path, bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(SWEEP_ROWS_ENV, str(AUTO_SAMPLE_ROWS))
    _two_auto_runs(catalog, bundle_dir, tmp_path / "before")
    path = tmp_path / "cache" / "score-catalog" / "batch_sizes.json"
    doc = json.loads(path.read_text())
    (key,) = doc
    doc[key]["batch_size"] = 1_000_000_000  # an integer, but no size the sweep measures
    path.write_text(json.dumps(doc))
    again = _two_auto_runs(catalog, bundle_dir, tmp_path / "after")[0]["execution"]
    assert again["batch_size_auto"]["cached"] is False
    assert again["batch_size_auto"]["batch_size"] in (1024, 2048, 4096)
