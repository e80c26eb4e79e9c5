"""engine = "onnx": real bundles exported by torch.onnx.export and run by ONNX Runtime score as
torch does (within the fp32 parity tolerance), through the scoring loop the workers use; a model
that does not export is refused by name; the export is kept and a damaged one replaced; a forked
process scores with a session of its own."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from pipeline import save_bundle
from pipeline.core.errors import ModelError
from pipeline.model import onnxengine
from pipeline.model.engine import output_columns, score
from pipeline.model.precision import DEFAULT_TOLERANCE, ExecutionOptions, prepare
from pipeline.model.program import LoadedModel, load_model
from tests.catalog_models import RANKER_INPUTS, Ranker, ranker_example
from tests.conftest import make_model

TOL = DEFAULT_TOLERANCE["fp32"]
FEATURES16 = {"features": {"columns": [f"f{i}" for i in range(16)]}}


def _both(bundle: Path) -> tuple[LoadedModel, LoadedModel]:
    loaded = load_model(str(bundle))
    torch_model, _ = prepare(loaded, ExecutionOptions())
    onnx_model, _ = prepare(loaded, ExecutionOptions(engine="onnx"))
    return torch_model, onnx_model


def _assert_same_scores(bundle: Path, rows: int = 5000) -> None:
    torch_model, onnx_model = _both(bundle)
    assert isinstance(onnx_model.module, onnxengine.OnnxModule)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        x = torch_model.example(rows, random=True, device="cpu")
    a, b = score(torch_model, x), score(onnx_model, x)
    assert a.ok.all() and b.ok.all()
    assert a.outputs.shape == b.outputs.shape == (rows, torch_model.out_width)
    assert float((a.outputs - b.outputs).abs().max()) <= TOL
    specs = torch_model.spec.outputs
    for spec, ca, cb in zip(
        specs, output_columns(a.outputs, specs), output_columns(b.outputs, specs), strict=True
    ):
        va, vb = np.asarray(ca), np.asarray(cb)
        if spec.transform == "argmax":
            assert (va != vb).mean() <= TOL, spec.name
        else:
            assert np.abs(va - vb).max() <= TOL, spec.name


def test_an_mlp_scores_as_torch_does(tmp_path: Path) -> None:
    save_bundle(
        make_model(hidden=(64, 32)),
        tmp_path / "mlp",
        inputs=FEATURES16,
        outputs={"score": "softmax:1", "label": "argmax"},
        example={"features": torch.randn(4, 16)},
        name="m",
        version="1",
    )
    _assert_same_scores(tmp_path / "mlp")


def test_a_three_input_model_scores_as_torch_does(tmp_path: Path) -> None:
    """Floats, a vocabulary id and an embedding id (int64): each input fed by name, in the
    program's call order."""
    save_bundle(
        Ranker(),
        tmp_path / "ranker",
        inputs=RANKER_INPUTS,
        outputs={"score": "sigmoid", "raw": "raw"},
        example=ranker_example(),
        name="ranker",
        version="1",
    )
    _assert_same_scores(tmp_path / "ranker")


class _NoOnnx(nn.Module):
    """torch.export takes it; the ONNX exporter has no translation for ``aten.erfinv``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.erfinv(torch.tanh(self.lin(x)) * 0.5)


def test_a_model_that_does_not_export_is_refused_by_name(tmp_path: Path) -> None:
    save_bundle(
        _NoOnnx().eval(),
        tmp_path / "odd",
        inputs=FEATURES16,
        outputs={"raw": "raw"},
        example={"features": torch.randn(4, 16)},
        name="m",
        version="1",
    )
    loaded = load_model(str(tmp_path / "odd"))
    with pytest.raises(ModelError) as err:
        prepare(loaded, ExecutionOptions(engine="onnx"))
    text = str(err.value)
    assert str(tmp_path / "odd") in text
    assert "torch.onnx.export failed" in text
    assert "nothing was scored" in text and "engine 'torch'" in text
    assert err.value.exit_code == 3
    # torch itself still runs it: the refusal is the engine's, not the bundle's.
    with torch.inference_mode():
        assert score(loaded, loaded.example(8, random=True)).ok.all()


def _cached_mlp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int) -> LoadedModel:
    """An MLP bundle saved under ``tmp_path`` and loaded, with a cache folder of its own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    save_bundle(
        make_model(seed=seed),
        tmp_path / "mlp",
        inputs=FEATURES16,
        outputs={"score": "softmax:1"},
        example={"features": torch.randn(4, 16)},
        name="m",
        version="1",
    )
    return load_model(str(tmp_path / "mlp"))


def test_the_export_is_kept_and_a_damaged_one_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = _cached_mlp(tmp_path, monkeypatch, seed=5)
    path = onnxengine.cache_path(loaded)
    assert not path.exists()
    first = onnxengine.prepare_onnx(loaded)
    assert path.is_file() and path.stat().st_mode & 0o077 == 0
    kept = path.read_bytes()
    # A second preparation reads the kept export: the same bytes, no new export.
    second = onnxengine.prepare_onnx(loaded)
    assert isinstance(second.module, onnxengine.OnnxModule) and second.module.data == kept
    path.write_bytes(b"not an onnx model")
    third = onnxengine.prepare_onnx(loaded)
    assert "exporting again" in caplog.text
    assert path.read_bytes() == kept
    x = loaded.example(300, random=True)
    for m in (first, second, third):
        assert float((score(m, x).outputs - score(loaded, x).outputs).abs().max()) <= TOL


def test_an_export_whose_weights_changed_after_it_was_kept_is_exported_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A valid ONNX model with one weight changed loads and scores: only the checksum kept beside
    # it tells (a break-it review scored with an edited embedding row, silently).
    import onnx
    from onnx import numpy_helper

    loaded = _cached_mlp(tmp_path, monkeypatch, seed=6)
    onnxengine.prepare_onnx(loaded)
    path = onnxengine.cache_path(loaded)
    kept = path.read_bytes()
    proto = onnx.load_from_string(kept)
    init = proto.graph.initializer[0]
    changed = numpy_helper.to_array(init) + 5.0
    init.CopyFrom(numpy_helper.from_array(changed, init.name))
    path.write_bytes(proto.SerializeToString())
    again = onnxengine.prepare_onnx(loaded)
    assert "do not match the SHA-256 kept with it" in caplog.text
    assert path.read_bytes() == kept and again.module.data == kept
    x = loaded.example(300, random=True)
    assert float((score(again, x).outputs - score(loaded, x).outputs).abs().max()) <= TOL


def _score_in_child(model: LoadedModel, x: torch.Tensor, q: multiprocessing.Queue[object]) -> None:
    q.put(score(model, x).outputs.numpy())


def test_a_forked_process_scores_with_a_session_of_its_own(tmp_path: Path) -> None:
    """The parent ran the model (a session with its threads) before the fork, as the driver's
    parity check does before the embedded cluster forks its workers."""
    save_bundle(
        make_model(seed=2),
        tmp_path / "mlp",
        inputs=FEATURES16,
        outputs={"score": "softmax:1"},
        example={"features": torch.randn(4, 16)},
        name="m",
        version="1",
    )
    _, model = _both(tmp_path / "mlp")
    x = model.example(1000, random=True)
    here = score(model, x).outputs.numpy()
    ctx = multiprocessing.get_context("fork")
    q: multiprocessing.Queue[object] = ctx.Queue()
    child = ctx.Process(target=_score_in_child, args=(model, x, q))
    child.start()
    got = q.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert np.array_equal(np.asarray(got), here)
