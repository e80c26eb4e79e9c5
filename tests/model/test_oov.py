"""Unseen values get an id of their own: the README's and docs' model examples, run as written,
and the warning ``save_bundle``, ``bundle check``, ``plan`` and ``run`` give when ``oov`` is the id
of a real vocabulary value (issue 22, item 4)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from pipeline import ModelError, save_bundle
from pipeline.cli.commands import main
from pipeline.model.bundle import read_bundle
from pipeline.model.columns import build
from pipeline.model.oov import check, embedding_rows, is_reserved
from pipeline.model.program import load_model
from tests.catalog_models import BRANDS, SELLERS, Ranker, catalog_table, ranker_example
from tests.conftest import REPO
from tests.integration.helpers import cli

REAL_BRANDS = list(BRANDS[1:])  # acme, zenith, orbit, nova: no "<unk>"


def _python_block(doc: Path, containing: str) -> str:
    """The fenced ```python block of ``doc`` that contains ``containing``, dedented."""
    text = doc.read_text(encoding="utf-8")
    for m in re.finditer(r"^( *)```python\n(.*?)^\1```", text, re.M | re.S):
        if containing in m.group(2):
            indent = len(m.group(1))
            return "".join(line[indent:] + "\n" for line in m.group(2).splitlines())
    raise AssertionError(f"no python block with {containing!r} in {doc}")


def _ids(bundle: Path, brands: list[str]) -> list[int]:
    """The ids a run feeds the model for ``brands`` (through the run's own input code)."""
    spec = read_bundle(str(bundle))[0]
    inp = next(i for i in spec.inputs if i.name == "brand")
    part = build(pa.record_batch({"brand": pa.array(brands)}), inp, 0)
    return [int(v) for v in part.x]


def _pipeline_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("pipeline")
    ]


class _DocRanker(torch.nn.Module):
    """The model the README describes: forward(numeric, brand, seller), with a brand embedding
    of ``brand_rows`` rows."""

    def __init__(self, brand_rows: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.brand = torch.nn.Embedding(brand_rows, 4)
        self.seller = torch.nn.Embedding(SELLERS, 3)
        self.head = torch.nn.Linear(3 + 4 + 3, 1)

    def forward(
        self, numeric: torch.Tensor, brand: torch.Tensor, seller: torch.Tensor
    ) -> torch.Tensor:
        out: torch.Tensor = self.head(
            torch.cat([numeric, self.brand(brand), self.seller(seller)], 1)
        )
        return out


def test_the_readme_model_example_gives_unseen_brands_their_own_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    code = _python_block(REPO / "README.md", "save_bundle(model")
    brands = REAL_BRANDS
    # What the README's comments describe: a row per brand and one for unseen brands.
    g = torch.Generator().manual_seed(0)
    namespace: dict[str, Any] = {
        "model": _DocRanker(len(brands) + 1).eval(),
        "brands": brands,
        "numeric": torch.randn(200, 3, generator=g),
        "brand_ids": torch.randint(0, len(brands), (200,), generator=g),
        "seller_ids": torch.randint(0, SELLERS, (200,), generator=g),
    }
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING):
        exec(compile(code, "README.md", "exec"), namespace)  # as written
    assert _pipeline_warnings(caplog) == []
    ids = _ids(tmp_path / "models" / "catalog-ranker", [*brands, "never-seen-brand"])
    assert ids[:-1] == list(range(len(brands)))
    assert ids[-1] not in ids[:-1]  # an unseen brand is not scored as any real one


def test_the_model_bundles_doc_example_gives_unseen_values_their_own_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    code = _python_block(REPO / "docs" / "model-bundles.md", "spec = save_bundle(")
    g = torch.Generator().manual_seed(0)
    namespace: dict[str, Any] = {
        "module": _DocRanker(3).eval(),  # "<unk>", "acme", "zenith"
        "x_num": torch.randn(50, 3, generator=g),
        "x_brand": torch.randint(0, 3, (50,), generator=g),
        "x_seller": torch.randint(0, SELLERS, (50,), generator=g),
    }
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING):
        exec(compile(code, "docs/model-bundles.md", "exec"), namespace)
    assert _pipeline_warnings(caplog) == []
    spec = read_bundle(str(tmp_path / "models" / "catalog-ranker"))[0]
    brand = next(i for i in spec.inputs if i.name == "brand")
    (unseen,) = _ids(tmp_path / "models" / "catalog-ranker", ["never-seen-brand"])
    assert brand.vocab[unseen] == "<unk>"


def _save_real_brands(path: Path, oov: int, brand_rows: int) -> None:
    save_bundle(
        _DocRanker(brand_rows),
        path,
        inputs={
            "numeric": {"columns": ["price", "rating", "stock"]},
            "brand": {"column": "brand", "vocabulary": REAL_BRANDS, "oov": oov},
            "seller": {"column": "seller_id", "dtype": "int64", "num_embeddings": SELLERS},
        },
        outputs={"score": "sigmoid"},
        example={**ranker_example(8), "brand": torch.arange(8) % len(REAL_BRANDS)},
        name="catalog-ranker",
        version="3",
    )


@pytest.mark.parametrize(
    ("brand_rows", "advice"),
    [
        (len(REAL_BRANDS) + 1, "has 5 rows for 4 values, so set oov = 4"),
        (
            len(REAL_BRANDS),
            "none to spare: give it one more (nn.Embedding(5, ...)), set oov = 4",
        ),
    ],
)
def test_save_bundle_warns_when_oov_is_a_real_values_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, brand_rows: int, advice: str
) -> None:
    with caplog.at_level(logging.WARNING):
        _save_real_brands(tmp_path / "b", oov=0, brand_rows=brand_rows)
    (warning,) = _pipeline_warnings(caplog)
    assert warning.startswith("save_bundle: ")
    assert f"model bundle {tmp_path / 'b'}: input 'brand'" in warning  # the target, not staging
    assert "oov = 0 is the id of 'acme' (line 1 of vocabulary-brand.txt)" in warning
    assert "scored exactly as 'acme'" in warning
    assert advice in warning and '"<unk>"' in warning  # the two safe forms
    assert (tmp_path / "b" / "model.toml").exists()  # a warning: the bundle is saved


def test_a_reserved_entry_or_an_own_id_is_not_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        _save_real_brands(tmp_path / "own", oov=len(REAL_BRANDS), brand_rows=len(REAL_BRANDS) + 1)
        save_bundle(  # the test models' form: "<unk>" first, oov = 0
            Ranker(),
            tmp_path / "unk",
            inputs={
                "numeric": {"columns": ["price", "rating", "stock"]},
                "brand": {"column": "brand", "vocabulary": list(BRANDS), "oov": 0},
                "seller": {"column": "seller_id", "dtype": "int64", "num_embeddings": SELLERS},
            },
            outputs={"score": "sigmoid"},
            example=ranker_example(),
            name="r",
            version="1",
        )
    assert _pipeline_warnings(caplog) == []
    assert all(is_reserved(v) for v in ("<unk>", "[UNK]", "__unknown__", "Unknown", "<unseen>"))
    assert not any(is_reserved(v) for v in ("acme", "unk-brand", "other brand"))


def test_the_embedding_is_sized_from_the_program_through_reshapes_only(tmp_path: Path) -> None:
    class Reshaped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e = torch.nn.Embedding(7, 2)
            self.f = torch.nn.Embedding(9, 2)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            # a reaches its embedding through a view; b's ids are shifted first.
            return self.e(a.view(-1)) + self.f(b + 1)

    save_bundle(
        Reshaped(),
        tmp_path / "b",
        inputs={
            "a": {"column": "a", "vocabulary": ["<unk>", "x", "y"], "oov": 0},
            "b": {"column": "b", "vocabulary": ["<unk>", "x", "y"], "oov": 0},
        },
        outputs={"y": "raw"},
        example=(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2])),
        name="m",
        version="1",
    )
    assert embedding_rows(load_model(str(tmp_path / "b"))) == {0: 7}


def _write_brands_bundle(path: Path, oov: int) -> None:
    """A bundle whose model.toml was edited by hand after save_bundle: ``oov`` set to any id."""
    _save_real_brands(path, oov=len(REAL_BRANDS), brand_rows=len(REAL_BRANDS) + 1)
    toml = path / "model.toml"
    toml.write_text(toml.read_text().replace(f"oov = {len(REAL_BRANDS)}", f"oov = {oov}"))


@pytest.mark.slow
def test_bundle_check_plan_and_run_say_it_once(tmp_path: Path) -> None:
    bundle = tmp_path / "b"
    _write_brands_bundle(bundle, oov=0)
    shards = tmp_path / "in"
    shards.mkdir()
    pq.write_table(catalog_table(0, 400, 0), shards / "part-0.parquet", row_group_size=100)
    said = "input 'brand' (column 'brand'): oov = 0 is the id of 'acme'"

    r = CliRunner().invoke(main, ["bundle", "check", str(bundle)])
    assert r.exit_code == 0, r.output
    assert "unseen -> 0 ('acme')" in r.output
    assert sum(said in line and "WARNING" in line for line in r.output.splitlines()) == 1

    job = ["--input", str(shards), "--output", str(tmp_path / "out"), "--model", str(bundle)]
    job += ["--scheduler", "sync", "--passthrough", "brand", "--max-rejected-fraction", "0.5"]
    plan = cli("plan", *job)
    assert plan.returncode == 0, plan.output
    assert plan.stdout.count(said) == 1 and said not in plan.stderr

    run = cli("run", *job)
    assert run.returncode == 0, run.output
    assert [ln for ln in run.stderr.splitlines() if said in ln and "WARNING" in ln] == [
        ln for ln in run.stderr.splitlines() if said in ln
    ]
    assert run.stderr.count(said) == 1
    assert run.report is not None
    assert sum(said in w for w in run.report["warnings"]) == 1


@pytest.mark.slow
def test_an_oov_beyond_the_models_embedding_is_refused_before_scoring(tmp_path: Path) -> None:
    bundle = tmp_path / "b"
    _write_brands_bundle(bundle, oov=7)  # the embedding has 5 rows: ids 0..4
    shards = tmp_path / "in"
    shards.mkdir()
    pq.write_table(catalog_table(0, 400, 0), shards / "part-0.parquet", row_group_size=100)
    out = tmp_path / "out"
    r = cli("run", "--input", str(shards), "--output", str(out), "--model", str(bundle))
    assert r.returncode == 3, r.output
    flat = " ".join(r.stderr.split())
    assert "input 'brand' (column 'brand'): oov = 7 is beyond the model's embedding" in flat
    assert "5 rows (ids 0..4)" in flat and "set oov = 4" in flat
    assert not out.exists() and not os.path.exists(tmp_path / "_score_catalog")
    with pytest.raises(ModelError, match="oov = 7 is beyond"):
        check(load_model(str(bundle)))  # the library says the same
