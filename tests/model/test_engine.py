"""The scoring loop: forward, output columns, and isolating the rows a model raises on."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch import nn

from pipeline.cli.demo import FEATURES, export_bundle, make_rows
from pipeline.model.bundle import OutputSpec
from pipeline.model.engine import SMALL_BATCH, ModelFailedEverywhere, Scored, output_columns, score
from pipeline.model.program import LoadedModel, load_model
from tests.conftest import demo_toml, make_model, reference_scores

BAD_F0 = 5000.0  # feature 0 above 1000 makes RaisesOnHugeF0 index out of its embedding table


class RaisesOnHugeF0(nn.Module):
    """An MLP whose forward raises IndexError for any row with feature 0 > 1000."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = make_model(seed=3)
        self.emb = nn.Embedding(10, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = (x[:, 0] > 1000).long() * 10  # 0 on good rows, 10 (out of range) on bad ones
        return self.mlp(x) + self.emb(idx)


class OomAbove8(nn.Module):
    """Raises a CUDA-style out-of-memory error for batches of more than 8 rows."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 8:
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return self.lin(x)


def _x(n: int, seed: int = 0) -> torch.Tensor:
    t = make_rows(0, n, seed)
    return torch.from_numpy(np.column_stack([t.column(c).to_numpy() for c in FEATURES]).copy())


@pytest.fixture(scope="module")
def demo_model(bundle_dir: Path) -> LoadedModel:
    return load_model(str(bundle_dir), "cpu")


@pytest.fixture(scope="module")
def raising_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("raising_bundle")
    torch.manual_seed(0)
    export_bundle(RaisesOnHugeF0().eval(), d, demo_toml(), n_in=16)
    return d


@pytest.fixture(scope="module")
def raising_model(raising_bundle: Path) -> LoadedModel:
    return load_model(str(raising_bundle), "cpu")


def _clean_forward(bundle: Path, x: torch.Tensor) -> torch.Tensor:
    module = torch.export.load(str(bundle / "model.pt2")).module()
    with torch.inference_mode():
        return module(x)


def _exception_text(bundle: Path, x: torch.Tensor) -> str:
    module = torch.export.load(str(bundle / "model.pt2")).module()
    with pytest.raises(IndexError) as e, torch.inference_mode():
        module(x)
    return str(e.value).splitlines()[0]


# --- score -------------------------------------------------------------------------------


def test_score_equals_the_direct_forward(demo_model: LoadedModel, bundle_dir: Path) -> None:
    table = make_rows(0, 300, 1)
    x = _x(300, 1)
    s = score(demo_model, x)
    assert isinstance(s, Scored)
    assert s.outputs.dtype == torch.float32 and s.outputs.device.type == "cpu"
    assert tuple(s.outputs.shape) == (300, 2)
    assert s.ok.dtype == bool and s.ok.all() and len(s.ok) == 300
    assert s.errors == {} and s.oom_splits == 0 and s.seconds > 0
    torch.testing.assert_close(s.outputs, _clean_forward(bundle_dir, x))
    # And the declared outputs (score = softmax:1, label = argmax) match the reference.
    score_col, label_col = output_columns(s.outputs, demo_model.spec.outputs)
    ref_score, ref_label = reference_scores(bundle_dir, table)
    np.testing.assert_allclose(score_col.to_numpy(), ref_score, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(label_col.to_numpy(), ref_label)


def test_score_of_an_empty_batch(demo_model: LoadedModel) -> None:
    s = score(demo_model, torch.zeros(0, 16))
    assert tuple(s.outputs.shape) == (0, 2)
    assert len(s.ok) == 0 and s.errors == {}
    cols = output_columns(s.outputs, demo_model.spec.outputs)
    assert [len(c) for c in cols] == [0, 0]
    assert [c.type for c in cols] == [pa.float32(), pa.int64()]


def test_bad_rows_are_isolated_and_the_rest_scored(
    raising_model: LoadedModel, raising_bundle: Path
) -> None:
    x = _x(64, 2)
    bad = [5, 31, 62]
    x[bad, 0] = BAD_F0
    text = _exception_text(raising_bundle, x[bad[:1]])
    assert text  # the exported model really raises on such a row
    s = score(raising_model, x)
    assert np.flatnonzero(~s.ok).tolist() == bad
    assert sorted(s.errors) == bad
    for i in bad:
        assert s.errors[i].startswith("model error: ")
        assert text in s.errors[i]
    good = torch.from_numpy(s.ok)
    assert tuple(s.outputs.shape) == (61, 2)
    torch.testing.assert_close(s.outputs, _clean_forward(raising_bundle, x[good]))


def test_a_batch_without_bad_rows_is_not_bisected(
    raising_model: LoadedModel, raising_bundle: Path
) -> None:
    x = _x(64, 4)
    s = score(raising_model, x)
    assert s.ok.all() and s.errors == {}
    torch.testing.assert_close(s.outputs, _clean_forward(raising_bundle, x))


def test_a_failing_single_row_batch_is_a_rejected_row(raising_model: LoadedModel) -> None:
    x = _x(1, 5)
    x[0, 0] = BAD_F0
    s = score(raising_model, x)
    assert s.ok.tolist() == [False]
    assert list(s.errors) == [0]
    assert tuple(s.outputs.shape) == (0, 2)


def test_every_row_failing_is_a_broken_model(
    raising_model: LoadedModel, raising_bundle: Path
) -> None:
    x = _x(64, 6)
    x[:, 0] = BAD_F0
    text = _exception_text(raising_bundle, x[:1])
    with pytest.raises(ModelFailedEverywhere, match="64-row batch") as e:
        score(raising_model, x)
    assert text in str(e.value)


@pytest.mark.parametrize(("rows", "proven"), [(64, True), (SMALL_BATCH, False), (3, False)])
def test_every_row_failing_after_the_model_scored_rows_is_rejected_rows(
    raising_model: LoadedModel, rows: int, proven: bool
) -> None:
    # A shard's short last batch holding only bad rows, or a tiny shard: rows, not the model.
    x = _x(rows, 6)
    x[:, 0] = BAD_F0
    s = score(raising_model, x, proven=proven)
    assert not s.ok.any() and sorted(s.errors) == list(range(rows))
    assert tuple(s.outputs.shape) == (0, 2)


@pytest.fixture(scope="module")
def oom_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    d = tmp_path_factory.mktemp("oom_bundle")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_bundle(
            OomAbove8().eval(),
            d,
            demo_toml(fmt="torchscript", file="model.ts", outputs='label = "argmax"\n'),
            n_in=16,
            fmt="torchscript",
        )
        return load_model(str(d), "cpu")


def test_out_of_memory_splits_the_batch_and_retries(oom_model: LoadedModel) -> None:
    x = _x(64, 7)
    s = score(oom_model, x)
    # 64 -> 2x32 -> 4x16 -> 8x8: one split per failing piece, 1 + 2 + 4.
    assert s.oom_splits == 7
    assert s.ok.all() and s.errors == {}
    with torch.inference_mode():
        expected = torch.cat([oom_model.module(x[i : i + 8]) for i in range(0, 64, 8)])
    torch.testing.assert_close(s.outputs, expected)


# --- output_columns ------------------------------------------------------------------------


def _outputs(n: int, width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(width)
    return torch.randn(n, width, generator=g) * 3


def test_softmax_sigmoid_argmax_and_raw_columns() -> None:
    y = _outputs(50, 3)
    specs = (
        OutputSpec("p0", "softmax", 0),
        OutputSpec("p2", "softmax", 2),
        OutputSpec("s1", "sigmoid", 1),
        OutputSpec("label", "argmax"),
        OutputSpec("logits", "raw"),
        OutputSpec("s0", "sigmoid", 0),
    )
    cols = output_columns(y, specs)
    assert len(cols) == len(specs)
    for spec, col in zip(specs, cols, strict=True):
        assert len(col) == 50
        assert col.type == spec.arrow_type(3), spec  # what the output file's schema declares
    p = torch.softmax(y, dim=1)
    np.testing.assert_allclose(cols[0].to_numpy(), p[:, 0].numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(cols[1].to_numpy(), p[:, 2].numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(cols[2].to_numpy(), torch.sigmoid(y[:, 1]).numpy(), rtol=1e-6)
    np.testing.assert_array_equal(cols[3].to_numpy(), y.argmax(dim=1).numpy())
    assert cols[3].type == pa.int64()
    assert cols[4].type == pa.list_(pa.float32(), 3)
    assert cols[4].to_pylist() == y.tolist()
    np.testing.assert_allclose(cols[5].to_numpy(), torch.sigmoid(y[:, 0]).numpy(), rtol=1e-6)
    for c in (cols[0], cols[1], cols[2], cols[5]):
        assert c.type == pa.float32()


def test_width_one_outputs() -> None:
    y = _outputs(40, 1)
    specs = (OutputSpec("p", "sigmoid"), OutputSpec("raw", "raw"), OutputSpec("p0", "sigmoid", 0))
    p, raw, p0 = output_columns(y, specs)
    assert p.type == raw.type == p0.type == pa.float32()
    for spec, col in zip(specs, (p, raw, p0), strict=True):
        assert col.type == spec.arrow_type(1)
    np.testing.assert_allclose(p.to_numpy(), torch.sigmoid(y[:, 0]).numpy(), rtol=1e-6)
    np.testing.assert_array_equal(p.to_numpy(), p0.to_numpy())
    np.testing.assert_array_equal(raw.to_numpy(), y[:, 0].numpy())


def test_softmax_columns_sum_to_one() -> None:
    y = _outputs(20, 4)
    cols = output_columns(y, tuple(OutputSpec(f"p{k}", "softmax", k) for k in range(4)))
    total = np.sum([c.to_numpy() for c in cols], axis=0)
    np.testing.assert_allclose(total, np.ones(20), rtol=1e-5)


def test_output_columns_of_no_rows_keep_their_types() -> None:
    y = torch.empty(0, 3)
    specs = (
        OutputSpec("p", "softmax", 1),
        OutputSpec("s", "sigmoid", 2),
        OutputSpec("a", "argmax"),
        OutputSpec("r", "raw"),
    )
    cols = output_columns(y, specs)
    assert [len(c) for c in cols] == [0, 0, 0, 0]
    assert [c.type for c in cols] == [s.arrow_type(3) for s in specs]


def test_raw_multi_column_output_of_a_sliced_tensor() -> None:
    # Outputs as score() builds them: concatenated pieces; also a non-contiguous view.
    y = _outputs(30, 6)[:, ::2]
    assert not y.is_contiguous()
    (col,) = output_columns(y, (OutputSpec("r", "raw"),))
    assert col.type == pa.list_(pa.float32(), 3)
    assert col.to_pylist() == y.tolist()


# --- non-finite outputs --------------------------------------------------------------------

NAN_F0 = 1.5  # NonFiniteRows: f0 above this gives NaN in logit 0 ...
INF_F0 = -1.5  # ... and f0 below this gives +inf in every logit


class NonFiniteRows(nn.Module):
    """A small MLP whose logit 0 is NaN where f0 > 1.5, whose logits are all +inf where
    f0 < -1.5, and which raises (an out-of-range embedding index) where f0 > 1000."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = make_model(seed=4)
        self.emb = nn.Embedding(10, 2)
        self.register_buffer("col0", torch.tensor([True, False]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(x) + self.emb((x[:, 0] > 1000).long() * 10)
        y = torch.where((x[:, :1] > NAN_F0) & self.col0, torch.full_like(y, float("nan")), y)
        return torch.where(x[:, :1] < INF_F0, torch.full_like(y, float("inf")), y)


def _nonfinite_model(tmp_path_factory: pytest.TempPathFactory, outputs: str) -> LoadedModel:
    d = tmp_path_factory.mktemp("nonfinite_bundle")
    torch.manual_seed(0)
    export_bundle(NonFiniteRows().eval(), d, demo_toml(outputs=outputs), n_in=16)
    return load_model(str(d), "cpu")


@pytest.fixture(scope="module")
def nonfinite_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """score = softmax:1, label = argmax: both read the whole output row."""
    return _nonfinite_model(tmp_path_factory, 'score = "softmax:1"\nlabel = "argmax"\n')


def _rows_by_f0(x: torch.Tensor) -> tuple[list[int], list[int]]:
    f0 = x[:, 0]
    return (
        torch.nonzero(f0 > NAN_F0).flatten().tolist(),
        torch.nonzero(f0 < INF_F0).flatten().tolist(),
    )


def test_non_finite_rows_are_rejected_and_the_rest_scored(nonfinite_model: LoadedModel) -> None:
    x = _x(2000, 8)
    nan_rows, inf_rows = _rows_by_f0(x)
    assert len(nan_rows) > 20 and len(inf_rows) > 20  # both kinds really occur
    s = score(nonfinite_model, x)
    bad = sorted(nan_rows + inf_rows)
    assert np.flatnonzero(~s.ok).tolist() == bad
    # Softmax and argmax read the whole row: the first declared column, score, is named.
    assert s.errors == dict.fromkeys(bad, "model output is not finite (score)")
    assert tuple(s.outputs.shape) == (2000 - len(bad), 2)
    assert bool(torch.isfinite(s.outputs).all())
    with torch.inference_mode():
        expected = nonfinite_model.module(x[torch.from_numpy(s.ok)])
    torch.testing.assert_close(s.outputs, expected)


def test_the_reason_names_the_first_column_that_reads_a_non_finite_value(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model = _nonfinite_model(tmp_path_factory, 's1 = "sigmoid:1"\ns0 = "sigmoid:0"\n')
    x = _x(500, 9)
    nan_rows, inf_rows = _rows_by_f0(x)
    s = score(model, x)
    # NaN only in logit 0: s1 is finite, s0 is not. +inf everywhere: s1 comes first.
    assert s.errors == {
        **dict.fromkeys(nan_rows, "model output is not finite (s0)"),
        **dict.fromkeys(inf_rows, "model output is not finite (s1)"),
    }
    assert s.outputs.shape[0] == int(s.ok.sum()) == 500 - len(nan_rows) - len(inf_rows)


def test_a_non_finite_value_no_column_reads_is_kept(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model = _nonfinite_model(tmp_path_factory, 's1 = "sigmoid:1"\n')
    x = _x(500, 10)
    nan_rows, inf_rows = _rows_by_f0(x)
    assert nan_rows
    s = score(model, x)
    # Logit 0 is NaN on nan_rows, but the only written column is sigmoid(logit 1).
    assert sorted(s.errors) == inf_rows
    assert s.outputs.shape[0] == 500 - len(inf_rows)
    assert bool(torch.isnan(s.outputs[:, 0]).any())
    (col,) = output_columns(s.outputs, model.spec.outputs)
    assert np.isfinite(col.to_numpy()).all()


def test_non_finite_and_raising_rows_in_one_batch(nonfinite_model: LoadedModel) -> None:
    x = _x(300, 11)
    raising = [0, 7, 150]
    x[raising, 0] = BAD_F0
    nan_rows, inf_rows = _rows_by_f0(x)
    nan_rows = [i for i in nan_rows if i not in raising]
    s = score(nonfinite_model, x)
    assert sorted(s.errors) == sorted(raising + nan_rows + inf_rows)
    assert all(s.errors[i].startswith("model error: ") for i in raising)
    assert all(s.errors[i] == "model output is not finite (score)" for i in nan_rows + inf_rows)
    assert np.flatnonzero(~s.ok).tolist() == sorted(s.errors)
    with torch.inference_mode():
        expected = nonfinite_model.module(x[torch.from_numpy(s.ok)])
    torch.testing.assert_close(s.outputs, expected)


def test_a_batch_non_finite_everywhere_is_rows_rejected_not_a_broken_model(
    nonfinite_model: LoadedModel,
) -> None:
    x = _x(64, 12)
    x[:, 0] = 3.0
    s = score(nonfinite_model, x)
    assert not s.ok.any() and len(s.errors) == 64
    assert tuple(s.outputs.shape) == (0, 2)
    cols = output_columns(s.outputs, nonfinite_model.spec.outputs)
    assert [len(c) for c in cols] == [0, 0]


class Huge(nn.Module):
    """Finite outputs whose sum over a batch overflows float32 (3e38 each)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :2] * 0.0 + 3e38


def test_finite_outputs_whose_sum_overflows_are_kept(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    d = tmp_path_factory.mktemp("huge_bundle")
    export_bundle(Huge().eval(), d, demo_toml(outputs='r = "raw"\n'), n_in=16)
    model = load_model(str(d), "cpu")
    s = score(model, _x(100, 13))
    assert float(s.outputs.sum()) == float("inf")  # the quick check cannot tell ...
    assert s.ok.all() and s.errors == {}  # ... and the exact one keeps every row
    assert tuple(s.outputs.shape) == (100, 2)


@pytest.mark.parametrize("width", [1, 2, 3, 8, 16, 64])
def test_a_row_s_output_columns_do_not_depend_on_where_it_sits_in_the_batch(width: int) -> None:
    # A resumed run, a retried task or a shard's short last batch puts a row at another offset
    # than a clean run did, and on as many threads as its worker has: the row's columns must
    # come out bit for bit the same.
    y = _outputs(500, width)
    kinds = ["softmax", "argmax", "raw"] if width > 1 else ["sigmoid", "raw"]
    specs = tuple(
        OutputSpec(f"c{k}", kind, 0 if kind == "softmax" else None) for k, kind in enumerate(kinds)
    )
    whole = output_columns(y, specs)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for offset in (1, 7, 31, 33, 250):
                part = output_columns(y[offset:], specs)
                for a, b in zip(whole, part, strict=True):
                    assert a.slice(offset).equals(b), (threads, offset)
    finally:
        torch.set_num_threads(before)


# --- call_rows: a batch scored in slices ----------------------------------------------------


@pytest.mark.parametrize("call_rows", [1, 7, 64, 256, 300, 10_000])
def test_a_batch_scored_in_slices_gives_the_same_scores(
    demo_model: LoadedModel, call_rows: int
) -> None:
    # The driver splits a batch into calls of call_rows rows where that runs faster on the CPU
    # (tuning.choose_call_rows); a row's output depends on its own row only. Calls of the sizes
    # it uses (powers of two from 256) give the same bits; a call of a few rows may take another
    # kernel and round a row's last bit differently (6e-8 here at 1-3 and 7 rows a call).
    x = _x(300, 5)
    whole, sliced = score(demo_model, x), score(demo_model, x, call_rows=call_rows)
    if call_rows >= 64:
        assert torch.equal(whole.outputs, sliced.outputs)
    else:
        torch.testing.assert_close(sliced.outputs, whole.outputs, rtol=0, atol=1e-6)
    assert sliced.ok.all() and sliced.errors == {}


def test_bad_rows_in_slices_are_isolated_as_in_one_call(
    raising_model: LoadedModel, raising_bundle: Path
) -> None:
    x = _x(64, 2)
    bad = [0, 5, 15, 16, 63]  # at slice edges (16 rows a call) and inside them
    x[bad, 0] = BAD_F0
    whole = score(raising_model, x)
    sliced = score(raising_model, x, call_rows=16)
    assert np.flatnonzero(~sliced.ok).tolist() == bad
    assert sliced.errors == whole.errors
    assert torch.equal(sliced.outputs, whole.outputs)


def test_a_slice_failing_everywhere_is_a_broken_model_only_when_every_row_fails(
    raising_model: LoadedModel,
) -> None:
    x = _x(64, 3)
    x[:16, 0] = BAD_F0  # the whole first slice fails: bad rows, the others score
    s = score(raising_model, x, call_rows=16)
    assert np.flatnonzero(~s.ok).tolist() == list(range(16))
    x[:, 0] = BAD_F0
    with pytest.raises(ModelFailedEverywhere):
        score(raising_model, x, call_rows=16)
