"""``pipeline.save_bundle``: a module becomes a bundle the tool loads, or nothing is written;
``score-catalog bundle check`` shows what a bundle takes and gives."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from pipeline import ModelError, save_bundle
from pipeline.cli import main
from pipeline.model import forward, load_model
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
    assert "forward(numeric, brand, seller)" in r.output
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
    assert r.exit_code == 3 and "has no model.toml" in r.output
