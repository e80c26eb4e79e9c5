"""``--engine onnx`` through the real CLI: the embedded cluster's forked workers score with ONNX
Runtime what torch scores (within the fp32 parity tolerance), the report says which engine ran
and what the parity check found; a difference beyond the tolerance is refused before anything
is written (exit 3); and without onnxruntime installed the engine is a config error (exit 2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pytest

from tests.integration.helpers import REPO, cli, data_files, job_args

pytestmark = pytest.mark.integration

TOL = 1e-4  # fp32's parity tolerance (pipeline.model.precision.DEFAULT_TOLERANCE)


def _scores(out: Path) -> pa.Table:
    return pads.dataset([str(p) for p in data_files(out)]).to_table().sort_by("item_id")


def test_workers_score_with_onnx_runtime_as_torch_does(
    tmp_path: Path, catalog: Path, bundle_dir: Path
) -> None:
    common = ("--scheduler", "local", "--workers", "2", "--batch-size", "512")
    ref = cli("run", *job_args(catalog, tmp_path / "torch", bundle_dir, *common))
    assert ref.returncode == 0, ref.stdout + ref.stderr
    r = cli("run", *job_args(catalog, tmp_path / "onnx", bundle_dir, *common, "--engine", "onnx"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.report is not None and ref.report is not None
    execution = r.report["execution"]
    assert execution["engine"] == "onnx" and ref.report["execution"]["engine"] == "torch"
    parity = execution["parity"]
    assert parity["rows"] > 0 and parity["reference"] == "torch fp32 on the CPU"
    assert parity["columns"]["score"]["max_abs_diff"] <= TOL
    assert r.report["settings"]["engine"] == "onnx" and "engine" not in ref.report["settings"]
    a, b = _scores(tmp_path / "torch"), _scores(tmp_path / "onnx")
    assert a.num_rows == b.num_rows == r.report["rows_in"] == 2500 + 1700 + 3100
    assert a.column("item_id").equals(b.column("item_id"))
    diff = np.abs(a.column("score").to_numpy() - b.column("score").to_numpy())
    assert diff.max() <= TOL
    labels_differ = a.column("label").to_numpy() != b.column("label").to_numpy()
    assert labels_differ.mean() <= TOL


def test_a_difference_beyond_the_tolerance_is_refused_before_scoring(
    tmp_path: Path, catalog: Path, bundle_dir: Path
) -> None:
    """A tolerance of 0: ONNX Runtime's kernels round differently from torch's (1e-7 here), so
    the parity check must fail, naming the column, the difference and the way out."""
    out = tmp_path / "out"
    r = cli(
        "run", *job_args(catalog, out, bundle_dir, "--engine", "onnx", "--parity-tolerance", "0"),
        "--scheduler", "sync",
    )  # fmt: skip
    assert r.returncode == 3, r.stdout + r.stderr
    text = r.stdout + r.stderr
    assert "engine 'onnx' differs from torch" in text
    assert "score: max |diff|" in text
    assert "nothing was scored" in text and "engine 'torch'" in text
    assert not data_files(out)


# Hides onnxruntime from the CLI process as if it were not installed: the import system asks
# this finder first, and it says the module does not exist. (A real uninstall would change the
# shared environment every other test runs in.)
_HIDE_ONNXRUNTIME = """\
import importlib.abc
import sys


class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "onnxruntime":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
"""


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_without_onnxruntime_the_engine_is_a_config_error(
    tmp_path: Path, catalog: Path, bundle_dir: Path, how: str
) -> None:
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(_HIDE_ONNXRUNTIME)
    env = {"PYTHONPATH": f"{hide}:{REPO}"}
    extra: tuple[str, ...] = ("--engine", "onnx")
    if how == "environment":
        env["SCORE_CATALOG_ENGINE"] = "onnx"
        extra = ()
    out = tmp_path / "out"
    r = cli("run", *job_args(catalog, out, bundle_dir, *extra), "--scheduler", "sync", env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    text = r.stdout + r.stderr
    assert "engine = 'onnx' needs onnxruntime" in text
    assert "pip install 'score-catalog[onnx]'" in text
    assert not out.exists() or not data_files(out)
