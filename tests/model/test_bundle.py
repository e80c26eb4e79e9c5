"""Tests for pipeline.model.bundle and pipeline.model.program: bundle loading, validation, pickle
refusal, dry runs,
devices."""

from __future__ import annotations

import hashlib
import shutil
import warnings
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from torch import nn

from pipeline.core.errors import EXIT_INPUT, ConfigError, ModelError
from pipeline.model.bundle import OutputSpec, parse_bundle_toml, read_bundle
from pipeline.model.program import LoadedModel, forward, load_model, resolve_device
from tests.catalog_models import CountsCalls
from tests.conftest import bounded_bundle, demo_toml, make_model

TS: dict[str, str] = {"fmt": "torchscript", "file": "model.ts"}


# --------------------------------------------------------------------------------------------
# Helpers: every test loads from its own fresh directory (load_model caches per process).
# --------------------------------------------------------------------------------------------


def copy_bundle(src: Path, dst: Path, toml: str | None = None) -> Path:
    shutil.copytree(src, dst)
    if toml is not None:
        (dst / "model.toml").write_text(toml)
    return dst


def script_bundle(dst: Path, model: nn.Module, toml: str, file: str = "model.ts") -> Path:
    """A TorchScript bundle (fast to make, unlike torch.export)."""
    dst.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript is deprecated in recent torch
        torch.jit.save(torch.jit.script(model.eval()), dst / file)
    (dst / "model.toml").write_text(toml)
    return dst


def random_input(rows: int = 257, width: int = 16, seed: int = 123) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g, dtype=torch.float32)


def eager(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(x)


def loaded_forward(lm: LoadedModel, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return forward(lm, x)


class RowSum(nn.Module):
    """One value per row, returned as a 1-D tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(1)


class ColumnSum(nn.Module):
    """Sums over the batch: the first output dimension is not the batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0)


# --------------------------------------------------------------------------------------------
# Loading the two supported formats
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["exported_program", "torchscript"])
def test_bundle_matches_eager_model(
    kind: str, bundle_dir: Path, torchscript_bundle_dir: Path, tmp_path: Path
) -> None:
    src = bundle_dir if kind == "exported_program" else torchscript_bundle_dir
    uri = str(copy_bundle(src, tmp_path / "b"))
    lm = load_model(uri, "cpu")
    assert lm.spec.format == kind
    assert lm.spec.name == "test-mlp"
    assert lm.spec.version == "1"
    assert lm.device == torch.device("cpu")
    assert lm.width == 16
    assert lm.out_width == 2
    assert lm.spec.input_columns == tuple(f"f{i}" for i in range(16))
    assert lm.spec.outputs == (OutputSpec("score", "softmax", 1), OutputSpec("label", "argmax"))
    x = random_input()
    got = loaded_forward(lm, x)
    want = eager(make_model(), x)
    assert got.shape == (257, 2)
    assert got.dtype == torch.float32
    assert float((got - want).abs().max()) <= 1e-6
    # Not trivially equal to a different network.
    assert float((got - eager(make_model(seed=1), x)).abs().max()) > 1e-3


def test_both_formats_agree(bundle_dir: Path, torchscript_bundle_dir: Path, tmp_path: Path) -> None:
    ep = load_model(str(copy_bundle(bundle_dir, tmp_path / "ep")))
    ts = load_model(str(copy_bundle(torchscript_bundle_dir, tmp_path / "ts")))
    x = random_input(rows=5, seed=7)
    torch.testing.assert_close(loaded_forward(ep, x), loaded_forward(ts, x), atol=1e-6, rtol=0)


def test_load_is_cached_per_process(torchscript_bundle_dir: Path, tmp_path: Path) -> None:
    uri = str(copy_bundle(torchscript_bundle_dir, tmp_path / "b"))
    first = load_model(uri, "cpu")
    assert load_model(uri, "cpu") is first
    assert load_model(uri, torch.device("cpu")) is first


def test_auto_device_loads_on_cpu_here(torchscript_bundle_dir: Path, tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("auto means cuda on this machine")
    lm = load_model(str(copy_bundle(torchscript_bundle_dir, tmp_path / "b")), "auto")
    assert lm.device == torch.device("cpu")


@pytest.mark.parametrize(("n_out", "n_in"), [(3, 16), (5, 7)])
def test_width_and_out_width(tmp_path: Path, n_out: int, n_in: int) -> None:
    columns = tuple(f"c{i}" for i in range(n_in))
    uri = str(
        script_bundle(
            tmp_path / "b",
            make_model(n_in=n_in, n_out=n_out),
            demo_toml(columns, outputs='probs = "raw"\ntop = "argmax"\n', **TS),
        )
    )
    lm = load_model(uri)
    assert lm.width == n_in
    assert lm.out_width == n_out
    raw, top = lm.spec.outputs
    assert raw.arrow_type(lm.out_width) == pa.list_(pa.float32(), n_out)
    assert top.arrow_type(lm.out_width) == pa.int64()
    assert loaded_forward(lm, random_input(rows=4, width=n_in)).shape == (4, n_out)


def test_one_dimensional_output_becomes_one_column(tmp_path: Path) -> None:
    uri = str(script_bundle(tmp_path / "b", RowSum(), demo_toml(outputs='p = "sigmoid"\n', **TS)))
    lm = load_model(uri)
    assert lm.out_width == 1
    x = random_input(rows=3)
    torch.testing.assert_close(loaded_forward(lm, x), x.sum(1, keepdim=True))
    assert lm.spec.outputs[0].arrow_type(1) == pa.float32()


def test_output_not_batch_first_refused(tmp_path: Path) -> None:
    uri = str(script_bundle(tmp_path / "b", ColumnSum(), demo_toml(outputs='p = "raw"\n', **TS)))
    with pytest.raises(ModelError) as excinfo:
        load_model(uri)
    msg = str(excinfo.value)
    assert uri in msg
    assert "first dimension must be the batch" in msg
    assert "(16, 1)" in msg


def test_single_column_input_with_dim(torchscript_bundle_dir: Path, tmp_path: Path) -> None:
    toml = (
        'name = "vec"\nversion = "3"\nformat = "torchscript"\nfile = "model.ts"\n'
        '[inputs]\ncolumn = "features"\ndim = 16\n[outputs]\nscore = "softmax:0"\n'
    )
    lm = load_model(str(copy_bundle(torchscript_bundle_dir, tmp_path / "b", toml)))
    assert lm.width == 16
    assert lm.spec.input_columns == ("features",)
    assert lm.spec.describe_inputs() == "inputs.column = 'features' (dim 16)"


def test_single_column_without_dim_needs_width(
    torchscript_bundle_dir: Path, tmp_path: Path
) -> None:
    toml = (
        'name = "vec"\nversion = "3"\nformat = "torchscript"\nfile = "model.ts"\n'
        '[inputs]\ncolumn = "features"\n[outputs]\nscore = "softmax:1"\n'
    )
    no_width = str(copy_bundle(torchscript_bundle_dir, tmp_path / "a", toml))
    with pytest.raises(ModelError) as excinfo:
        load_model(no_width)
    assert "inputs.column needs inputs.dim" in str(excinfo.value)
    assert no_width in str(excinfo.value)

    with_width = str(copy_bundle(torchscript_bundle_dir, tmp_path / "b", toml))
    assert load_model(with_width, widths=(16,)).width == 16

    wrong_width = str(copy_bundle(torchscript_bundle_dir, tmp_path / "c", toml))
    with pytest.raises(ModelError) as excinfo:
        load_model(wrong_width, widths=(8,))
    assert "rejected input of (1, 8) float32" in str(excinfo.value)


def test_declared_width_vs_data_width(torchscript_bundle_dir: Path, tmp_path: Path) -> None:
    uri = str(copy_bundle(torchscript_bundle_dir, tmp_path / "b"))
    with pytest.raises(ModelError) as excinfo:
        load_model(uri, widths=(3,))
    msg = str(excinfo.value)
    assert "declares 16 features per row but the data has 3" in msg
    assert uri in msg


def test_cached_model_still_checks_width(torchscript_bundle_dir: Path, tmp_path: Path) -> None:
    uri = str(copy_bundle(torchscript_bundle_dir, tmp_path / "b"))
    assert load_model(uri).width == 16
    with pytest.raises(ModelError):
        load_model(uri, widths=(3,))


# --------------------------------------------------------------------------------------------
# SHA-256
# --------------------------------------------------------------------------------------------


def test_sha256_covers_toml_and_weights(torchscript_bundle_dir: Path, tmp_path: Path) -> None:
    d = copy_bundle(torchscript_bundle_dir, tmp_path / "b")
    uri = str(d)
    toml_bytes = (d / "model.toml").read_bytes()
    weights = (d / "model.ts").read_bytes()
    spec, got_weights, sha = read_bundle(uri)
    assert got_weights == weights
    assert sha == hashlib.sha256(toml_bytes + weights).hexdigest()
    assert spec.file == "model.ts"

    (d / "model.toml").write_text(demo_toml(version="2", **TS))
    _, _, sha_toml = read_bundle(uri)
    assert sha_toml != sha

    (d / "model.toml").write_bytes(toml_bytes)
    assert read_bundle(uri)[2] == sha  # same bytes, same hash

    script_bundle(d, make_model(seed=1), toml_bytes.decode())
    _, _, sha_weights = read_bundle(uri)
    assert sha_weights not in (sha, sha_toml)


def test_changed_weights_reload_and_expected_sha(
    torchscript_bundle_dir: Path, tmp_path: Path
) -> None:
    d = copy_bundle(torchscript_bundle_dir, tmp_path / "b")
    uri = str(d)
    old = load_model(uri)
    x = random_input(rows=8)
    assert float((loaded_forward(old, x) - eager(make_model(), x)).abs().max()) <= 1e-6
    assert load_model(uri, expected_sha256=old.sha256) is old

    script_bundle(d, make_model(seed=1), (d / "model.toml").read_text())
    # A worker that expects the old bundle refuses the new one.
    with pytest.raises(ModelError) as excinfo:
        load_model(uri, expected_sha256=old.sha256)
    msg = str(excinfo.value)
    assert "changed while the run was going on" in msg
    assert old.sha256[:12] in msg
    # Without the expectation the new content is loaded, not the cached old model.
    new = load_model(uri)
    assert new is not old
    assert new.sha256 != old.sha256
    assert float((loaded_forward(new, x) - eager(make_model(seed=1), x)).abs().max()) <= 1e-6


def test_wrong_expected_sha_refused(torchscript_bundle_dir: Path, tmp_path: Path) -> None:
    uri = str(copy_bundle(torchscript_bundle_dir, tmp_path / "b"))
    with pytest.raises(ModelError) as excinfo:
        load_model(uri, expected_sha256="wrong")
    msg = str(excinfo.value)
    assert uri in msg
    assert "instead of wrong" in msg
    assert excinfo.value.exit_code == EXIT_INPUT


# --------------------------------------------------------------------------------------------
# model.toml validation
# --------------------------------------------------------------------------------------------


def test_many_toml_problems_reported_together(tmp_path: Path) -> None:
    (tmp_path / "model.toml").write_text(
        'name = "m"\nversion = "1"\nformat = "onnx"\nfile = "model.onnx"\nauthor = "me"\n'
        '[outputs]\np = "tanh"\nq = "softmax"\nr = "softmax:1"\n'
    )
    with pytest.raises(ModelError) as excinfo:
        load_model(str(tmp_path))
    msg = str(excinfo.value)
    assert f"model bundle {tmp_path}/model.toml is invalid" in msg
    for fragment in (
        "unknown key 'author'",
        "format = 'onnx' is not one of exported_program, torchscript",
        "[inputs] table is required",
        "outputs.p = 'tanh' is not one of softmax:K, sigmoid, sigmoid:K, argmax, raw",
        "outputs.q = 'softmax' is not one of",
    ):
        assert fragment in msg, fragment
    assert "outputs.r" not in msg
    assert msg.count("\n  - ") == 5


def test_both_columns_and_column_and_more() -> None:
    raw = (
        b'name = ""\nversion = 1\nformat = "torchscript"\nfile = "m.ts"\n'
        b'[inputs]\ncolumns = ["a"]\ncolumn = "v"\nshape = [2]\n'
    )
    with pytest.raises(ModelError) as excinfo:
        parse_bundle_toml(raw, "mem://bundle")
    msg = str(excinfo.value)
    for fragment in (
        "name must be a non-empty string",
        "version must be a non-empty string",
        "unknown key inputs.shape",
        "[inputs] needs exactly one of columns",
        "[outputs] table is required",
    ):
        assert fragment in msg, fragment
    assert msg.count("\n  - ") == 5


HEAD = 'name = "m"\nversion = "1"\nformat = "torchscript"\nfile = "m.ts"\n'


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ('[inputs]\ncolumns = []\n[outputs]\ns = "raw"\n', "non-empty list of column names"),
        ('[inputs]\ncolumns = ["a", 1]\n[outputs]\ns = "raw"\n', "non-empty list"),
        ('[inputs]\ncolumns = ["a", "a"]\n[outputs]\ns = "raw"\n', "names a column twice"),
        ('[inputs]\ncolumn = ""\n[outputs]\ns = "raw"\n', "inputs.column must be a column"),
        ('[inputs]\ncolumn = "v"\ndim = 0\n[outputs]\ns = "raw"\n', "inputs.dim must be"),
        ('[inputs]\n[outputs]\ns = "raw"\n', "needs exactly one of"),
        ('inputs = "a"\n[outputs]\ns = "raw"\n', "[inputs] table is required"),
        ('[inputs]\ncolumns = ["a"]\n[outputs]\n', "[outputs] table is required"),
        ('[inputs]\ncolumns = ["a"]\n[outputs]\ns = 1\n', "outputs.s = 1 is not one of"),
        ('[inputs]\ncolumns = ["a"]\n[outputs]\ns = "softmax:x"\n', "outputs.s = 'softmax:x'"),
        ('[inputs]\ncolumns = ["a"]\n[outputs]\ns = "argmax:1"\n', "outputs.s = 'argmax:1'"),
    ],
)
def test_single_toml_problems(body: str, fragment: str) -> None:
    with pytest.raises(ModelError) as excinfo:
        parse_bundle_toml((HEAD + body).encode(), "b")
    assert fragment in str(excinfo.value)
    assert "model bundle b/model.toml is invalid" in str(excinfo.value)


def test_bool_dim_refused() -> None:
    body = '[inputs]\ncolumn = "v"\ndim = true\n[outputs]\ns = "raw"\n'
    with pytest.raises(ModelError):
        parse_bundle_toml((HEAD + body).encode(), "b")


def test_invalid_toml(tmp_path: Path) -> None:
    (tmp_path / "model.toml").write_text('name = "unterminated\n')
    with pytest.raises(ModelError) as excinfo:
        load_model(str(tmp_path))
    assert "is not valid TOML" in str(excinfo.value)
    assert str(tmp_path) in str(excinfo.value)


def test_valid_transforms_parse() -> None:
    body = (
        '[inputs]\ncolumns = ["a", "b"]\n[outputs]\n'
        'p = "softmax:3"\nq = "sigmoid"\nr = "sigmoid:0"\ns = "argmax"\nt = "raw"\n'
    )
    spec = parse_bundle_toml((HEAD + body).encode(), "b")
    assert spec.outputs == (
        OutputSpec("p", "softmax", 3),
        OutputSpec("q", "sigmoid", None),
        OutputSpec("r", "sigmoid", 0),
        OutputSpec("s", "argmax", None),
        OutputSpec("t", "raw", None),
    )
    assert [o.describe() for o in spec.outputs] == [
        "softmax:3",
        "sigmoid",
        "sigmoid:0",
        "argmax",
        "raw",
    ]
    assert spec.columns == ("a", "b")
    assert spec.column is None
    assert spec.describe_inputs() == "inputs.columns = ['a', 'b']"
    assert OutputSpec("t", "raw").arrow_type(1) == pa.float32()


# --------------------------------------------------------------------------------------------
# Pickles are refused
# --------------------------------------------------------------------------------------------


def _assert_pickle_refusal(msg: str, uri: str) -> None:
    assert uri in msg
    assert "pickled object" in msg
    assert "arbitrary code" in msg
    assert "torch.export.export" in msg
    assert "Dim(" in msg


@pytest.mark.parametrize(
    ("fmt", "file"), [("exported_program", "model.pt2"), ("torchscript", "m.ts")]
)
def test_pickled_module_refused(tmp_path: Path, fmt: str, file: str) -> None:
    tmp_path.joinpath("model.toml").write_text(demo_toml(fmt=fmt, file=file))
    torch.save(make_model(), tmp_path / file)
    with pytest.raises(ModelError) as excinfo:
        load_model(str(tmp_path))
    _assert_pickle_refusal(str(excinfo.value), str(tmp_path))
    assert "torch.save of a module or state_dict" in str(excinfo.value)


def test_pickled_state_dict_refused(tmp_path: Path) -> None:
    tmp_path.joinpath("model.toml").write_text(demo_toml())
    torch.save(make_model().state_dict(), tmp_path / "model.pt2")
    with pytest.raises(ModelError) as excinfo:
        load_model(str(tmp_path))
    _assert_pickle_refusal(str(excinfo.value), str(tmp_path))


def test_legacy_pickle_refused(tmp_path: Path) -> None:
    tmp_path.joinpath("model.toml").write_text(demo_toml())
    torch.save(
        make_model().state_dict(), tmp_path / "model.pt2", _use_new_zipfile_serialization=False
    )
    assert (tmp_path / "model.pt2").read_bytes()[:1] == b"\x80"
    with pytest.raises(ModelError) as excinfo:
        load_model(str(tmp_path))
    _assert_pickle_refusal(str(excinfo.value), str(tmp_path))


@pytest.mark.parametrize("fmt", ["pickle", "state_dict", "torch_save"])
def test_pickle_formats_refused(tmp_path: Path, fmt: str) -> None:
    tmp_path.joinpath("model.toml").write_text(demo_toml(fmt=fmt))
    with pytest.raises(ModelError) as excinfo:
        load_model(str(tmp_path))
    msg = str(excinfo.value)
    assert f"format = {fmt!r} is refused" in msg
    assert "arbitrary code" in msg
    assert "torch.export.export" in msg
    assert 'format = "exported_program"' in msg


def test_wrong_format_for_file(torchscript_bundle_dir: Path, tmp_path: Path) -> None:
    # A TorchScript file declared as an exported program.
    d = copy_bundle(torchscript_bundle_dir, tmp_path / "b", demo_toml(file="model.ts"))
    with pytest.raises(ModelError) as excinfo:
        load_model(str(d))
    msg = str(excinfo.value)
    assert "cannot load the weights file" in msg
    assert "format exported_program" in msg
    assert str(d) in msg


# --------------------------------------------------------------------------------------------
# Dry runs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["exported_program", "torchscript"])
def test_declared_columns_do_not_match_model(
    kind: str, bundle_dir: Path, torchscript_bundle_dir: Path, tmp_path: Path
) -> None:
    src, extra = (bundle_dir, {}) if kind == "exported_program" else (torchscript_bundle_dir, TS)
    d = copy_bundle(src, tmp_path / "b", demo_toml(("a", "b", "c"), **extra))
    with pytest.raises(ModelError) as excinfo:
        load_model(str(d))
    msg = str(excinfo.value)
    if kind == "exported_program":
        # The program records its input's shape: the mismatch is named before any call.
        assert f"model bundle {d}: the declared inputs do not fit the model" in msg
        assert (
            "inputs.columns = ['a', 'b', 'c'] gives float32 (batch, 3), but the program's "
            "input 1 takes float32 (batch, 16)"
        ) in msg
    else:
        assert f"model bundle {d} (inputs.columns = ['a', 'b', 'c'])" in msg
        assert "rejected input of (1, 3) float32" in msg
    assert excinfo.value.exit_code == EXIT_INPUT


@pytest.mark.parametrize("rows", [1, 4])
def test_static_batch_export_refused_with_hint(rows: int, tmp_path: Path) -> None:
    ep = torch.export.export(make_model(), (torch.zeros(rows, 16),))  # no dynamic_shapes
    torch.export.save(ep, tmp_path / "model.pt2")
    (tmp_path / "model.toml").write_text(demo_toml())
    with pytest.raises(ModelError) as excinfo:
        load_model(str(tmp_path))
    msg = str(excinfo.value)
    assert str(tmp_path) in msg
    assert f"exported with a static batch size of {rows} rows" in msg
    assert "dynamic_shapes=({0: torch.export.Dim('batch', min=1)},)" in msg


def _two_output_bundle(src: Path, dst: Path, outputs: str) -> str:
    return str(copy_bundle(src, dst, demo_toml(outputs=outputs, **TS)))


@pytest.mark.parametrize(
    ("outputs", "fragments"),
    [
        ('score = "softmax:5"\n', ["outputs.score = 'softmax:5'", "at least 6", "gives 2"]),
        ('score = "softmax:2"\n', ["outputs.score = 'softmax:2'", "at least 3", "gives 2"]),
        ('p = "sigmoid"\n', ["outputs.p = 'sigmoid'", "2 values per output row", "sigmoid:K"]),
        ('p = "sigmoid:2"\n', ["outputs.p = 'sigmoid:2'", "2 values per output row"]),
    ],
)
def test_transform_does_not_fit_two_outputs(
    torchscript_bundle_dir: Path, tmp_path: Path, outputs: str, fragments: list[str]
) -> None:
    uri = _two_output_bundle(torchscript_bundle_dir, tmp_path / "b", outputs)
    with pytest.raises(ModelError) as excinfo:
        load_model(uri)
    msg = str(excinfo.value)
    assert f"model bundle {uri}:" in msg
    for fragment in fragments:
        assert fragment in msg, fragment


@pytest.mark.parametrize(
    "outputs",
    ['p = "sigmoid:1"\n', 'p = "sigmoid:0"\n', 's = "softmax:0"\nt = "raw"\nu = "argmax"\n'],
)
def test_transform_fits_two_outputs(
    torchscript_bundle_dir: Path, tmp_path: Path, outputs: str
) -> None:
    lm = load_model(_two_output_bundle(torchscript_bundle_dir, tmp_path / "b", outputs))
    assert lm.out_width == 2
    assert len(lm.spec.outputs) == outputs.count("\n")


@pytest.mark.parametrize(
    ("outputs", "fragment"),
    [
        ('s = "argmax"\n', "outputs.s = 'argmax' needs at least 2 values"),
        ('s = "softmax:0"\n', "outputs.s = 'softmax:0' needs at least 2 values"),
        ('s = "sigmoid:1"\n', "outputs.s = 'sigmoid:1' does not fit a model with 1 values"),
    ],
)
def test_transform_does_not_fit_one_output(tmp_path: Path, outputs: str, fragment: str) -> None:
    uri = str(script_bundle(tmp_path / "b", make_model(n_out=1), demo_toml(outputs=outputs, **TS)))
    with pytest.raises(ModelError) as excinfo:
        load_model(uri)
    assert fragment in str(excinfo.value)


def test_one_output_sigmoid_and_raw_accepted(tmp_path: Path) -> None:
    outputs = 'p = "sigmoid"\nq = "sigmoid:0"\nr = "raw"\n'
    uri = str(script_bundle(tmp_path / "b", make_model(n_out=1), demo_toml(outputs=outputs, **TS)))
    lm = load_model(uri)
    assert lm.out_width == 1
    x = random_input(rows=6)
    torch.testing.assert_close(
        loaded_forward(lm, x), eager(make_model(n_out=1), x), atol=1e-6, rtol=0
    )


# --------------------------------------------------------------------------------------------
# Missing files and devices
# --------------------------------------------------------------------------------------------


def test_missing_model_toml(tmp_path: Path) -> None:
    (tmp_path / "model.pt2").write_bytes(b"not read")
    with pytest.raises(ModelError) as excinfo:
        load_model(str(tmp_path))
    msg = str(excinfo.value)
    assert f"model bundle {tmp_path} has no model.toml" in msg
    assert excinfo.value.exit_code == EXIT_INPUT


def test_missing_bundle_directory(tmp_path: Path) -> None:
    # Issue 22, 9f: a path that does not exist is not "a folder without model.toml".
    (tmp_path / "catalog-ranker").mkdir()
    with pytest.raises(ModelError) as excinfo:
        load_model(str(tmp_path / "catalog-rankr"))
    msg = str(excinfo.value)
    assert f"model bundle {tmp_path / 'catalog-rankr'} does not exist" in msg
    assert f"did you mean {tmp_path / 'catalog-ranker'}?" in msg
    assert "has no model.toml" not in msg


def test_missing_weights(tmp_path: Path) -> None:
    (tmp_path / "model.toml").write_text(demo_toml(file="weights/model.pt2"))
    with pytest.raises(ModelError) as excinfo:
        load_model(str(tmp_path))
    assert str(excinfo.value) == (
        f"model bundle {tmp_path}: weights file 'weights/model.pt2' does not exist"
    )


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("auto").type == "cuda"
        return
    assert resolve_device("auto") == torch.device("cpu")
    for requested in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(ConfigError) as excinfo:
            resolve_device(requested)
        msg = str(excinfo.value)
        assert f"device {requested!r} is not available" in msg
        assert "--device cpu" in msg


def test_load_model_on_unavailable_cuda(torchscript_bundle_dir: Path, tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    uri = str(copy_bundle(torchscript_bundle_dir, tmp_path / "b"))
    with pytest.raises(ConfigError) as excinfo:
        load_model(uri, "cuda")
    assert "is not available on this machine" in str(excinfo.value)


# --------------------------------------------------------------------------------------------
# Exported programs are called through their own graph (pipeline.model.program._graph_call)
# --------------------------------------------------------------------------------------------


def test_an_exported_program_runs_through_its_graph_with_the_module_s_exact_outputs(
    bundle_dir: Path, tmp_path: Path
) -> None:
    from pipeline.model.program import callable_of

    m = load_model(str(copy_bundle(bundle_dir, tmp_path / "b")))
    assert callable_of(m.module) is not m.module  # the graph call was taken and confirmed
    for rows in (1, 7, 300):
        x = random_input(rows)
        with torch.inference_mode():
            own = m.module(x)
        assert torch.equal(forward(m, x), own)


def test_a_program_that_mutates_a_buffer_mutates_the_module_s_own_once_per_call(
    tmp_path: Path,
) -> None:
    # torch.export keeps an in-place add_ on the buffer in the graph: the graph call gets the
    # module's own buffer, so the mutation lands where the module's call would put it.
    from pipeline.cli.demo import export_bundle
    from pipeline.model.program import callable_of

    d = export_bundle(CountsCalls(make_model()), tmp_path / "b", demo_toml(), n_in=16)
    m = load_model(str(d))
    assert callable_of(m.module) is not m.module
    before = int(m.module.calls)
    forward(m, random_input(5))
    forward(m, random_input(5))
    assert int(m.module.calls) == before + 2


def test_a_functional_program_with_a_buffer_mutation_output_keeps_the_module_s_call(
    tmp_path: Path,
) -> None:
    # After run_decompositions the mutation is an output the module's wrapper writes back;
    # calling the graph would drop it, so such a program is called as torch gives it.
    from pipeline.model.program import callable_of

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecation
        ep = torch.export.export(
            CountsCalls(make_model()).eval(),
            (torch.zeros(2, 16),),
            dynamic_shapes=({0: torch.export.Dim("batch", min=1)},),
        ).run_decompositions()
        kinds = {o.kind.name for o in ep.graph_signature.output_specs}
        assert "BUFFER_MUTATION" in kinds
        d = tmp_path / "b"
        d.mkdir()
        torch.export.save(ep, d / "model.pt2")
        (d / "model.toml").write_text(demo_toml())
        m = load_model(str(d))
    assert callable_of(m.module) is m.module
    before = int(m.module.calls)
    forward(m, random_input(5))
    assert int(m.module.calls) == before + 1


def test_a_graph_call_that_differs_from_the_module_is_dropped_at_the_dry_run(
    bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipeline.model.program as model_mod

    real = model_mod._graph_call

    def off_by_one(ep: object, module: object) -> object:
        call = real(ep, module)
        assert call is not None
        return lambda *xs: tuple(t + 1 for t in call(*xs))

    monkeypatch.setattr(model_mod, "_graph_call", off_by_one)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # a first load: no cache
    m = load_model(str(copy_bundle(bundle_dir, tmp_path / "b")))
    assert model_mod.callable_of(m.module) is m.module
    x = random_input(9)
    with torch.inference_mode():
        assert torch.equal(forward(m, x), m.module(x))


def test_a_batch_bound_the_program_was_exported_with_is_kept(tmp_path: Path) -> None:
    # Calls skip the program's own input checks, so the bound is enforced before scoring.
    from pipeline.model.program import check_batch_size

    m = load_model(str(bounded_bundle(tmp_path / "b", 1000)))
    assert m.max_batch == 1000
    check_batch_size(m, 1000)  # does not raise
    with pytest.raises(ConfigError, match="at most 1,000 rows"):
        check_batch_size(m, 4096)


def test_an_unbounded_batch_has_no_limit(bundle_dir: Path, tmp_path: Path) -> None:
    assert load_model(str(copy_bundle(bundle_dir, tmp_path / "b"))).max_batch is None


def test_a_weights_file_that_is_not_an_archive_is_refused_without_torch_s_traceback(
    bundle_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = copy_bundle(bundle_dir, tmp_path / "b")
    (d / "model.pt2").write_bytes(b"not a zip at all" * 100)
    with pytest.raises(ModelError, match=r"not a torch\.export archive"):
        load_model(str(d))
    assert "Traceback" not in caplog.text


class _Two(nn.Module):
    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.inner = make_model()
        self.as_dict = as_dict

    def forward(self, x: torch.Tensor) -> Any:
        y = self.inner(x)
        return {"logits": y, "double": 2 * y} if self.as_dict else (y, 2 * y)


@pytest.mark.parametrize(
    ("as_dict", "said"),
    [(False, "returned a tuple of 2 (Tensor)"), (True, "returned a dict (keys logits, double)")],
)
def test_a_model_returning_several_tensors_is_named_for_what_it_returns(
    as_dict: bool, said: str, tmp_path: Path
) -> None:
    # The message is about the outputs, not about inputs that fit the program perfectly well.
    from pipeline.cli.demo import export_bundle

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        d = export_bundle(_Two(as_dict), tmp_path / "b", demo_toml(), n_in=16)
    with pytest.raises(ModelError) as excinfo:
        load_model(str(d))
    msg = str(excinfo.value)
    assert said in msg and "returns one (batch, n) tensor" in msg
    assert "rejected input" not in msg
