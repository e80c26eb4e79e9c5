"""Execution options: precision, compile, and the parity check against the fp32 CPU reference."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from pipeline.cli.commands import main
from pipeline.core.errors import ConfigError, ModelError
from pipeline.model.precision import (
    DEFAULT_TOLERANCE,
    ExecutionOptions,
    check_parity,
    cpu_has_native_bf16,
    parity,
    prepare,
)
from pipeline.model.program import forward, load_model
from pipeline.worker.batching import Batch, to_device_ahead
from tests.integration.helpers import data_files, job_args, report


@pytest.fixture
def model(bundle_dir: Path):  # type: ignore[no-untyped-def]
    return load_model(str(bundle_dir), "cpu")


def test_fp32_is_the_model_itself(model) -> None:  # type: ignore[no-untyped-def]
    prepared, compile_s = prepare(model, ExecutionOptions())
    x = torch.randn(300, 16)
    with torch.inference_mode():
        assert torch.equal(forward(prepared, x), forward(model, x))
    assert compile_s is None


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_reduced_precision_stays_within_its_default_tolerance(
    model,
    precision: str,  # type: ignore[no-untyped-def]
) -> None:
    prepared, _ = prepare(model, ExecutionOptions(precision=precision))
    x = torch.randn(2048, 16, generator=torch.Generator().manual_seed(1))
    cols = parity(model, prepared, x)
    assert set(cols) == {"score", "label"}
    assert 0 < cols["score"]["max_abs_diff"] <= DEFAULT_TOLERANCE[precision]
    assert cols["score"]["mean_abs_diff"] <= cols["score"]["max_abs_diff"]
    assert 0 <= cols["label"]["mismatch_fraction"] <= 0.05
    check_parity(cols, precision, DEFAULT_TOLERANCE[precision], "b")  # does not raise
    with torch.inference_mode():
        out = forward(prepared, x)
    assert out.shape == (2048, 2)
    if precision == "bf16":
        assert out.dtype == torch.bfloat16  # autocast really ran in bf16


def test_check_parity_names_the_column_and_the_difference() -> None:
    cols = {
        "score": {"max_abs_diff": 0.3, "mean_abs_diff": 0.01},
        "label": {"mismatch_fraction": 0.2},
    }
    with pytest.raises(ModelError) as e:
        check_parity(cols, "int8", 0.1, "model bundle X")
    msg = str(e.value)
    assert "score: max |diff| 0.3" in msg and "label: labels differing 0.2" in msg
    assert "model bundle X" in msg and "int8" in msg


def test_parity_compares_the_rows_both_score_and_fails_on_rows_only_one_leaves_nan(
    model,  # type: ignore[no-untyped-def]
) -> None:
    # Rows whose input is NaN give NaN outputs on both sides (rejects either way): they take
    # no part in the difference. A NaN difference used to pass every "> tolerance" test.
    prepared, _ = prepare(model, ExecutionOptions(precision="bf16"))
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(2))
    x[::7, 3] = float("nan")
    cols = parity(model, prepared, x)
    assert 0 < cols["score"]["max_abs_diff"] <= DEFAULT_TOLERANCE["bf16"]
    assert cols["score"]["non_finite_mismatch"] == 0
    check_parity(cols, "bf16", DEFAULT_TOLERANCE["bf16"], "b")  # does not raise
    one_sided = {"score": {"max_abs_diff": 0.0, "mean_abs_diff": 0.0, "non_finite_mismatch": 4}}
    with pytest.raises(ModelError, match="score: 4 value"):
        check_parity(one_sided, "bf16", 0.05, "model bundle X")


def test_unsupported_combinations_are_config_errors(
    model,
    torchscript_bundle_dir: Path,  # type: ignore[no-untyped-def]
) -> None:
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):
        prepare(model, ExecutionOptions(precision="fp16"))
    ts = load_model(str(torchscript_bundle_dir), "cpu")
    with pytest.raises(ConfigError, match="int8 needs an exported_program bundle"):
        prepare(ts, ExecutionOptions(precision="int8"))


def test_bf16_warning_matches_cpu_flags(model, caplog) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    fresh = dataclasses.replace(model)  # a new object, so prepare() does not reuse its cache
    with caplog.at_level("WARNING"):
        prepare(fresh, ExecutionOptions(precision="bf16"))
    warned = any("no bf16 instructions" in r.message for r in caplog.records)
    assert warned == (not cpu_has_native_bf16())


def test_to_device_ahead_passes_cpu_batches_through() -> None:
    import numpy as np
    import pyarrow as pa

    from pipeline.model.features import Features

    batches = [
        Batch(
            i,
            pa.record_batch({"id": [i]}),
            Features(np.zeros((1, 2), np.float32), np.ones(1, bool), None),
            np.zeros(1, np.int32),
            torch.zeros(1, 2),
        )
        for i in range(3)
    ]
    out = list(to_device_ahead(iter(batches), torch.device("cpu")))
    assert out == batches and all(b.device_tensors is None for b in out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_device_ahead_copies_in_order_on_cuda() -> None:  # pragma: no cover - GPU only
    import numpy as np
    import pyarrow as pa

    from pipeline.model.features import Features

    dev = torch.device("cuda")
    batches = [
        Batch(
            i,
            pa.record_batch({"id": [i]}),
            Features(np.full((4, 2), i, np.float32), np.ones(4, bool), None),
            np.zeros(4, np.int32),
            torch.full((4, 2), float(i)).pin_memory(),
        )
        for i in range(5)
    ]
    out = list(to_device_ahead(iter(batches), dev))
    assert [int(b.device_tensors[0][0, 0].item()) for b in out] == [0, 1, 2, 3, 4]


@pytest.mark.integration
def test_cli_bf16_run_keeps_rows_order_and_reports_parity(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    outs = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        res = CliRunner().invoke(
            main,
            [
                "run",
                *job_args(catalog, out, bundle_dir),
                "--scheduler",
                "sync",
                "--batch-size",
                "300",
                "--precision",
                precision,
            ],
        )
        assert res.exit_code == 0, res.output
        outs[precision] = out
    rep = report(outs["bf16"])
    assert rep["execution"]["precision"] == "bf16"
    par = rep["execution"]["parity"]
    assert par["rows"] == 2048 and par["tolerance"] == DEFAULT_TOLERANCE["bf16"]
    assert par["columns"]["score"]["max_abs_diff"] <= par["tolerance"]
    assert report(outs["fp32"])["execution"]["parity"] is None
    for a, b in zip(data_files(outs["fp32"]), data_files(outs["bf16"]), strict=True):
        ta, tb = pq.read_table(a), pq.read_table(b)
        assert ta.column("item_id").equals(tb.column("item_id"))
        diff = np.abs(ta.column("score").to_numpy() - tb.column("score").to_numpy())
        assert diff.max() <= DEFAULT_TOLERANCE["bf16"]
    # A precision setting is part of the manifest's settings hash: switching rescores.
    assert rep["shards_scored"] == 3


@pytest.mark.integration
def test_parity_beyond_tolerance_fails_before_anything_is_written(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o"
    res = CliRunner().invoke(
        main,
        [
            "run",
            *job_args(catalog, out, bundle_dir),
            "--scheduler",
            "sync",
            "--precision",
            "bf16",
            "--parity-tolerance",
            "0",
        ],
    )
    assert res.exit_code == 3
    assert "differs from fp32 beyond the tolerance 0" in res.output
    assert not out.exists()


@pytest.mark.integration
@pytest.mark.slow
def test_compile_gives_the_same_scores(catalog: Path, bundle_dir: Path, tmp_path: Path) -> None:
    shutil.rmtree(tmp_path / "o", ignore_errors=True)
    out = tmp_path / "o"
    res = CliRunner().invoke(
        main,
        [
            "run",
            *job_args(catalog, out, bundle_dir),
            "--scheduler",
            "sync",
            "--compile",
        ],
    )
    assert res.exit_code == 0, res.output
    ex = report(out)["execution"]
    assert ex["compile"] is True and ex["compile_s"] > 0
    assert ex["parity"]["columns"]["score"]["max_abs_diff"] <= 1e-4
