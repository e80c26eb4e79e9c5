"""``pipeline.save_bundle``: a module becomes a bundle the tool loads, or nothing is written;
``score-catalog bundle check`` shows what a bundle takes and gives."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from pipeline import ModelError, save_bundle
from pipeline.cli.commands import main
from pipeline.model.program import forward, load_model
from tests.catalog_models import (
    BRANDS,
    EMB_DIM,
    RANKER_INPUTS,
    Ranker,
    SwappedRanker,
    Tower,
    catalog_table,
    ranker_example,
)


def _save(path: Path, module: torch.nn.Module | None = None, **kw: object) -> object:
    args: dict[str, object] = dict(
        inputs=RANKER_INPUTS,
        outputs={"score": "sigmoid"},
        example=ranker_example(),
        name="catalog-ranker",
        version="3",
    )
    args.update(kw)
    return save_bundle(module if module is not None else Ranker(), path, **args)  # type: ignore[arg-type]


def test_a_three_input_bundle_round_trips(tmp_path: Path) -> None:
    module = Ranker()
    spec = _save(tmp_path / "b", module)
    assert [i.name for i in spec.inputs] == ["numeric", "brand", "seller"]  # type: ignore[attr-defined]
    assert (tmp_path / "b" / "vocabulary-brand.txt").read_text() == "".join(
        f"{b}\n" for b in BRANDS
    )
    model = load_model(str(tmp_path / "b"))
    assert model.widths == (3, 0, 0)
    x = ranker_example(50)
    xs = (x["numeric"], x["brand"], x["seller"])
    with torch.inference_mode():
        torch.testing.assert_close(forward(model, xs), module(*xs), atol=1e-6, rtol=0)
    assert sorted(p.name for p in (tmp_path).iterdir()) == ["b"]  # no staging folder left


def test_inputs_named_like_the_parameters_are_passed_by_name(tmp_path: Path) -> None:
    module = SwappedRanker()  # forward(seller, numeric, brand)
    _save(tmp_path / "b", module)
    model = load_model(str(tmp_path / "b"))
    assert [model.spec.inputs[i].name for i in model.order] == ["seller", "numeric", "brand"]
    x = ranker_example(20)
    with torch.inference_mode():
        got = forward(model, (x["numeric"], x["brand"], x["seller"]))
        want = module(x["seller"], x["numeric"], x["brand"])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_a_module_the_tool_cannot_load_is_refused_and_nothing_written(tmp_path: Path) -> None:
    class Two(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    with pytest.raises(ModelError, match="returned tuple"):
        save_bundle(
            Two(),
            tmp_path / "b",
            inputs={"x": {"columns": ["a"]}},
            outputs={"s": "raw"},
            example=torch.zeros(2, 1),
            name="n",
            version="1",
        )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        (
            {"inputs": {**RANKER_INPUTS, "numeric": {"columns": list("abc"), "dtype": "float64"}}},
            "dtype = 'float64'",
        ),
        ({"outputs": {"score": "softmax:3"}}, "needs at least 4 values per output row"),
        ({"example": ranker_example()["numeric"]}, "holds 1 tensor(s) for 3 input(s)"),
        ({"example": {"numeric": torch.zeros(2, 3)}}, "missing ['brand', 'seller']"),
    ],
)
def test_what_would_not_load_is_refused_before_anything_is_written(
    tmp_path: Path, kw: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ModelError) as excinfo:
        _save(tmp_path / "b", **kw)
    assert fragment in str(excinfo.value)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_bundle_is_kept_unless_overwrite(tmp_path: Path) -> None:
    _save(tmp_path / "b")
    with pytest.raises(ModelError, match="exists and is not empty"):
        _save(tmp_path / "b")
    _save(tmp_path / "b", Ranker(seed=1), overwrite=True, version="4")
    assert load_model(str(tmp_path / "b")).spec.version == "4"


def test_a_list_column_input_with_a_one_row_example(tmp_path: Path) -> None:
    module = Tower()
    save_bundle(
        module,
        tmp_path / "t",
        inputs={
            "embedding": {"column": "embedding", "dim": EMB_DIM},
            "numeric": {"columns": ["price", "rating"]},
        },
        outputs={"label": "argmax", "p": "softmax:2"},
        example=(torch.randn(1, EMB_DIM), torch.randn(1, 2)),  # exported from 2 rows anyway
        name="tower",
        version="1",
    )
    model = load_model(str(tmp_path / "t"))
    xs = (torch.randn(7, EMB_DIM), torch.randn(7, 2))
    with torch.inference_mode():
        torch.testing.assert_close(forward(model, xs), module(*xs), atol=1e-6, rtol=0)


def test_bundle_check_shows_inputs_and_a_dry_run(tmp_path: Path) -> None:
    _save(tmp_path / "b")
    r = CliRunner().invoke(main, ["bundle", "check", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    assert "forward(numeric, brand, seller) <- numeric, brand, seller (by name)" in r.output
    brand = "int64 (batch,); vocabulary vocabulary-brand.txt (5 values), unseen -> 0"
    assert brand in r.output
    assert "ids 0..999" in r.output
    assert "dry run   8 random rows: 8 scored, 0 rejected" in r.output

    shard = tmp_path / "in" / "part-0.parquet"
    shard.parent.mkdir()
    table = catalog_table(0, 300, 0)
    pq.write_table(table, shard)
    r = CliRunner().invoke(
        main,
        ["bundle", "check", str(tmp_path / "b"), "--input", str(shard.parent), "--rows", "300"],
    )
    assert r.exit_code == 0, r.output
    nulls = table.column("brand").null_count
    assert "rejected: null in brand" in r.output and nulls > 0

    r = CliRunner().invoke(main, ["bundle", "check", str(tmp_path / "nothing")])
    assert r.exit_code == 3 and f"model bundle {tmp_path / 'nothing'} does not exist" in r.output
    (tmp_path / "empty").mkdir()  # a folder that exists without model.toml: said so
    r = CliRunner().invoke(main, ["bundle", "check", str(tmp_path / "empty")])
    assert r.exit_code == 3 and "has no model.toml" in r.output


def test_inputs_named_like_parameters_they_would_not_feed_are_refused(tmp_path: Path) -> None:
    class TwoIds(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Embedding(1000, 2), torch.nn.Embedding(1000, 2)

        def forward(self, brand: torch.Tensor, seller_id: torch.Tensor) -> torch.Tensor:
            return (self.a(brand) + 3 * self.b(seller_id)).sum(1, keepdim=True)

    ids = torch.arange(4)
    with pytest.raises(ModelError) as excinfo:
        save_bundle(
            TwoIds(),
            tmp_path / "b",
            inputs={  # 'brand' is declared second but is the program's first parameter
                "seller": {"column": "seller_id", "dtype": "int64", "num_embeddings": 1000},
                "brand": {"column": "brand", "vocabulary": list(BRANDS), "oov": 0},
            },
            outputs={"y": "raw"},
            example=(ids, ids % len(BRANDS)),
            name="m",
            version="1",
        )
    msg = str(excinfo.value)
    assert (
        "input 'brand' is declared second, but the program's parameter 'brand' is its first" in msg
    )
    assert "forward(brand, seller_id)" in msg
    assert list(tmp_path.iterdir()) == []


def test_ids_the_bundle_declares_valid_must_not_crash_the_model(tmp_path: Path) -> None:
    class Small(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e = torch.nn.Embedding(3, 2)  # 3 rows, for a vocabulary of 5

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.e(x).sum(1, keepdim=True)

    with pytest.raises(ModelError) as excinfo:
        save_bundle(
            Small(),
            tmp_path / "b",
            inputs={"brand": {"column": "brand", "vocabulary": list(BRANDS), "oov": 0}},
            outputs={"y": "raw"},
            example=torch.tensor([0, 1, 2]),  # the example alone never shows ids 3 and 4
            name="m",
            version="1",
        )
    msg = str(excinfo.value)
    assert "the model fails on id 4 of input 'brand'" in msg
    assert "a vocabulary of 5 values" in msg
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        (
            {"example": {**ranker_example(), "brand": ranker_example()["brand"].int()}},
            "'brand' is int32, declared int64",
        ),
        (
            {"inputs": {**RANKER_INPUTS, "brand": {"column": "brand", "vocabulary": ["a", None]}}},
            "vocabulary values must be strings; value 1 is None",
        ),
    ],
)
def test_example_and_vocabulary_mistakes_are_named(
    tmp_path: Path, kw: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ModelError, match=None) as excinfo:
        _save(tmp_path / "b", **kw)
    assert fragment in str(excinfo.value)


def test_a_list_inputs_width_is_written_from_the_example(tmp_path: Path) -> None:
    save_bundle(
        Tower(),
        tmp_path / "t",
        inputs={"embedding": {"column": "embedding"}, "numeric": {"columns": ["a", "b"]}},
        outputs={"label": "argmax"},
        example=(torch.randn(3, EMB_DIM), torch.randn(3, 2)),
        name="tower",
        version="1",
    )
    assert f"dim = {EMB_DIM}" in (tmp_path / "t" / "model.toml").read_text()


def test_bundle_check_refuses_ids_the_model_cannot_take(tmp_path: Path) -> None:
    _save(tmp_path / "b")
    vocab = tmp_path / "b" / "vocabulary-brand.txt"  # 5 values for the model's 5-row embedding
    vocab.write_text(vocab.read_text() + "extra-1\nextra-2\n")  # edited by hand: 7 values
    r = CliRunner().invoke(main, ["bundle", "check", str(tmp_path / "b")])
    assert r.exit_code == 3, r.output
    assert "the model fails on id 6 of input 'brand'" in r.output
    assert "a vocabulary of 7 values" in r.output


class _LogOfFirst(torch.nn.Module):
    """NaN for rows whose first feature is negative: a model may score some rows as NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def forward(self, numeric: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(numeric) + torch.log(numeric[:, :1])
        return out


def test_an_example_the_model_scores_nan_for_some_rows_is_saved(tmp_path: Path) -> None:
    # NaN in the same rows on both sides is agreement, not an infinite difference.
    example = torch.tensor([[1.0, 2.0], [-1.0, 0.5], [3.0, -2.0]])
    with torch.inference_mode():
        assert _LogOfFirst()(example).isnan().any()
    save_bundle(
        _LogOfFirst(),
        tmp_path / "b",
        inputs={"numeric": {"columns": ["a", "b"]}},
        outputs={"score": "raw"},
        example=example,
        name="log",
        version="1",
    )
    assert (tmp_path / "b" / "model.toml").exists()


def test_nan_on_one_side_only_is_an_infinite_difference() -> None:
    from pipeline.model.export import _max_difference

    nan, inf = float("nan"), float("inf")
    same = torch.tensor([1.0, nan, inf, -inf])
    assert _max_difference(same, same.clone()) == 0.0
    assert _max_difference(torch.tensor([1.0, nan]), torch.tensor([1.0, 2.0])) == inf
    assert _max_difference(torch.tensor([inf]), torch.tensor([-inf])) == inf
    assert _max_difference(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0])) == 0.5
