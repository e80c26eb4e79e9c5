"""Catalog models with several typed inputs, through the real CLI: a string category through a
vocabulary (unseen values mapped to the oov id, a dictionary-encoded shard among plain ones),
an int64 seller id through an embedding with a range check, numeric features, and a list-column
embedding. Each row's outputs equal the eager module's, in order, exactly once; rows with a null
or an out-of-range id are in the rejects with their reasons."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import torch

from pipeline import save_bundle
from tests.catalog_models import (
    EMB_DIM,
    RANKER_INPUTS,
    SELLERS,
    Ranker,
    Tower,
    ranker_example,
    ranker_reference,
    write_catalog,
)
from tests.integration.helpers import cli, data_files, job_args, rejects_of

pytestmark = pytest.mark.integration

SIZES = [2300, 1800, 2600]


def _read(root: Path) -> pa.Table:
    return pads.dataset([str(p) for p in data_files(root)]).to_table().sort_by("item_id")


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["sync", "local"])
def test_a_three_input_ranker_scores_every_row_once(tmp_path: Path, scheduler: str) -> None:
    module = Ranker()
    bundle = tmp_path / "ranker"
    save_bundle(
        module,
        bundle,
        inputs=RANKER_INPUTS,
        outputs={"score": "sigmoid"},
        example=ranker_example(),
        name="catalog-ranker",
        version="3",
    )
    paths = write_catalog(tmp_path / "in", SIZES)
    out = tmp_path / "out"
    r = cli(
        "run", *job_args(tmp_path / "in", out, bundle), "--id-column", "item_id",
        "--passthrough", "brand", "--scheduler", scheduler, "--workers", "2",
        "--max-rejected-fraction", "0.2", "--batch-size", "512",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    table = pads.dataset([str(p) for p in paths]).to_table()
    scores, reasons = ranker_reference(module, table)
    assert reasons and scores  # the data has rejects of every kind, and rows to score

    got = _read(out)
    ids = got.column("item_id").to_pylist()
    assert ids == sorted(scores)  # every scorable row exactly once
    np.testing.assert_allclose(
        got.column("score").to_numpy(), [scores[i] for i in ids], atol=1e-5, rtol=0
    )
    # Within each output file, rows keep their input order.
    for f in data_files(out):
        file_ids = pads.dataset(str(f)).to_table().column("item_id").to_pylist()
        assert file_ids == sorted(file_ids)
    rejected = _read(rejects_of(out))
    assert (
        dict(
            zip(
                rejected.column("item_id").to_pylist(),
                rejected.column("reject_reason").to_pylist(),
                strict=True,
            )
        )
        == reasons
    )
    unseen = [b for b in got.column("brand").to_pylist() if b == "unseen-brand"]
    assert unseen  # unseen brands were scored through oov = 0, not rejected
    rep = r.report
    assert rep is not None and rep["rows_out"] == len(scores)
    assert rep["rows_rejected"] == len(reasons)
    # The report counts rows by cause, without each row's own value.
    out_of_range = sum(1 for why in reasons.values() if why.startswith("seller_id = "))
    cause = f"seller_id is outside 0..{SELLERS - 1} (num_embeddings = {SELLERS})"
    assert out_of_range and rep["rejects_by_reason"][cause] == out_of_range
    assert sum(rep["rejects_by_reason"].values()) == len(reasons)


def test_a_list_column_embedding_beside_numeric_features(tmp_path: Path) -> None:
    module = Tower()
    bundle = tmp_path / "tower"
    save_bundle(
        module,
        bundle,
        inputs={"embedding": {"column": "embedding"}, "numeric": {"columns": ["rating", "stock"]}},
        outputs={"label": "argmax", "p1": "softmax:1"},
        example=(torch.randn(3, EMB_DIM), torch.randn(3, 2)),
        name="tower",
        version="1",
    )
    paths = write_catalog(tmp_path / "in", SIZES[:2])
    out = tmp_path / "out"
    r = cli(
        "run", *job_args(tmp_path / "in", out, bundle), "--id-column", "item_id",
        "--scheduler", "sync", "--max-rejected-fraction", "0.2",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    table = pads.dataset([str(p) for p in paths]).to_table().sort_by("item_id")
    emb = table.column("embedding").to_pylist()
    ok = [i for i, e in enumerate(emb) if e is not None and len(e) == EMB_DIM]
    x_emb = torch.tensor([emb[i] for i in ok], dtype=torch.float32)
    num = np.column_stack(
        [table.column(c).to_numpy().astype(np.float32) for c in ("rating", "stock")]
    )
    with torch.inference_mode():
        logits = module(x_emb, torch.from_numpy(num[ok]))
    got = _read(out)
    assert got.column("item_id").to_pylist() == [table.column("item_id")[i].as_py() for i in ok]
    np.testing.assert_allclose(
        got.column("p1").to_numpy(), torch.softmax(logits, 1)[:, 1].numpy(), atol=1e-5, rtol=0
    )
    assert got.column("label").to_pylist() == logits.argmax(1).tolist()
    reasons = set(_read(rejects_of(out)).column("reject_reason").to_pylist())
    assert reasons == {"null in embedding", "embedding has 3 values, expected 8"}


def test_a_string_column_where_a_number_is_expected_names_input_and_column(
    tmp_path: Path,
) -> None:
    bundle = tmp_path / "ranker"
    inputs = {**RANKER_INPUTS, "numeric": {"columns": ["price", "rating", "brand"]}}
    save_bundle(
        Ranker(), bundle, inputs=inputs, outputs={"score": "sigmoid"},
        example=ranker_example(), name="r", version="1",
    )  # fmt: skip
    write_catalog(tmp_path / "in", [500, 500])
    r = cli("run", *job_args(tmp_path / "in", tmp_path / "out", bundle), "--id-column", "item_id")
    assert r.returncode == 3, r.stdout + r.stderr
    why = "which is not numeric (input 'numeric' is float32: integer and float columns are cast"
    assert f"feature column 'brand' has type string, {why}" in r.stderr
    assert "has type dictionary<values=string, indices=int32, ordered=0>, " + why in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_shard_with_lists_of_another_size_is_that_shards_problem(tmp_path: Path) -> None:
    """The width comes from the bundle (written by save_bundle from the example), so a shard
    of 7-value lists is a schema problem of that shard: named, and skipped on request."""
    bundle = tmp_path / "tower"
    save_bundle(
        Tower(), bundle,
        inputs={"embedding": {"column": "embedding"}, "numeric": {"columns": ["rating", "stock"]}},
        outputs={"label": "argmax"}, example=(torch.randn(3, EMB_DIM), torch.randn(3, 2)),
        name="tower", version="1",
    )  # fmt: skip
    paths = write_catalog(tmp_path / "in", [400, 300, 500])
    odd = pads.dataset(str(paths[1])).to_table()
    short = pa.array([[0.5] * 7] * odd.num_rows, pa.list_(pa.float32(), 7))
    pq.write_table(
        odd.set_column(odd.schema.get_field_index("embedding"), "embedding", short), paths[1]
    )
    out = tmp_path / "out"
    args = ("--id-column", "item_id", "--scheduler", "sync", "--max-rejected-fraction", "0.2")
    r = cli("run", *job_args(tmp_path / "in", out, bundle), *args)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "feature column 'embedding' holds lists of 7 values; the model takes 8" in r.stderr
    assert "part-00001.parquet" in r.stderr
    r = cli(
        "run", *job_args(tmp_path / "in", out, bundle), *args,
        "--on-schema-error", "skip_shard", "--max-failed-shards", "1",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    statuses = {s["rel_path"]: s["status"] for s in r.report["shards"]} if r.report else {}
    assert statuses == {
        "part-00000.parquet": "scored",
        "part-00001.parquet": "failed",
        "part-00002.parquet": "scored",
    }
